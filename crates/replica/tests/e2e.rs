//! End to end on real processes: a 2-process x 2-worker replica launched by
//! the orchestrator's process backend, driven by the controller.

mod common;

use common::*;
use lockstep_protocol::CommandHistory;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operator_matches_the_reference() {
    let r = start_replica(1, 2, 2).await;
    let c = controller(&r, 1, CommandHistory::new());
    let dataflows = operator_dataflows();
    for d in &dataflows {
        c.create_dataflow(d.clone()).unwrap();
    }
    let writes = operator_writes();
    for (coll, ups, upper) in &writes {
        c.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    for d in &dataflows {
        let coll = d.exports[0].collection_id;
        for t in 0..4 {
            let got = as_multiset(c.peek(coll, t).await.unwrap());
            assert_eq!(got, reference(d, &writes, t), "dataflow {} at time {t}", d.id);
        }
    }
    // I1: every worker built the same dataflows in the same order.
    let statuses = c.statuses().await.unwrap();
    assert_eq!(statuses.len(), 4);
    for s in &statuses {
        assert_eq!(s.creation_log, statuses[0].creation_log, "worker {}", s.worker_index);
        assert_eq!(s.creation_log.len(), dataflows.len());
    }
    c.shutdown();
}
