//! Regression test: collective reconciliation when creates follow a
//! controller restart at once.
//!
//! A slow worker may read a peer's reconcile record (which carries the peer's
//! installed dataflows) and that peer's next barrier record (a create, which
//! carries none) from the mesh in one batch. If the second record's empty
//! list replaces the first, the slow worker plans its reconciliation from an
//! empty list and drops every dataflow while its peers keep them: the
//! workers' dataflow orders differ (I1). The failpoint
//! `replica_hold_mesh_in_reconcile` makes that interleaving happen on
//! purpose (crates/replica/src/worker/mesh.rs).
//!
//! Needs the `failpoints` feature (`cargo xtask test` turns it on).

mod common;

use std::time::Duration;

use common::*;
use lockstep_plan::Plan;
use lockstep_protocol::CommandHistory;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_worker_reconciles_from_its_peers_reconcile_reports() {
    // 3 processes x 1 worker, as in the defect's report; worker 1 is slow.
    let r = start_replica_with_env(
        31,
        3,
        1,
        &[("FAILPOINTS", "replica_hold_mesh_in_reconcile=return(1)")],
    )
    .await;
    let small = |id: u64| dataflow(id, &[1], Plan::Get { collection_id: 1 });
    let a = controller(&r, 1, CommandHistory::new());
    a.write_input(1, vec![u(&[7, 1], 0, 1)], 1).unwrap();
    for id in 1..=28 {
        a.create_dataflow(small(id)).unwrap();
    }
    a.wait_for_frontier(1028, 0).await.unwrap();
    let history = a.history().await.unwrap();
    a.shutdown();

    // The restarted controller creates a dataflow as soon as it sent
    // InitializationComplete (a create sent earlier joins the replayed
    // target instead of following it).
    let b = controller(&r, 2, history);
    let mut events = b.events();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.recv().await {
                Ok(lockstep_controller::Event::Connected { .. }) => break,
                Ok(_) => {}
                Err(e) => panic!("controller events ended: {e}"),
            }
        }
    })
    .await
    .expect("the restarted controller connected within 20 s");
    b.create_dataflow(small(29)).unwrap();
    if let Err(e) =
        tokio::time::timeout(Duration::from_secs(20), b.wait_for_frontier(1029, 0)).await
    {
        panic!(
            "dataflow 29 did not come up after the restart: {e}\n{}",
            logs(&r, 20)
        );
    }
    let statuses = b.statuses().await.unwrap();
    assert_eq!(statuses.len(), 3);
    for s in &statuses {
        assert_eq!(
            s.creation_log,
            statuses[0].creation_log,
            "I1: worker {} built other dataflows than worker {}\n{}",
            s.worker_index,
            statuses[0].worker_index,
            logs(&r, 20)
        );
        assert_eq!(s.installed.len(), 29, "worker {}", s.worker_index);
        // Reconciliation kept the 28 unchanged dataflows: nothing rebuilt.
        assert_eq!(
            s.creation_log.len(),
            29,
            "worker {} rebuilt dataflows it could keep",
            s.worker_index
        );
    }
    // The failpoint made the interleaving happen (a test that did not get
    // it would prove nothing).
    let log = logs(&r, 1000);
    assert!(
        log.contains("reading a peer's reconciliation report and its next round together"),
        "the failpoint never held worker 1's mesh until the peer's next round:\n{log}"
    );
    let rows = b.peek(1029, 0).await.unwrap();
    assert_eq!(rows, vec![(vec![7, 1], 1)], "I3: peek of dataflow 29");
    b.shutdown();
}
