//! A family of your own through `lockstep serve`, walked as the demo walks
//! the built-in one: the example reachability family (`examples/reachability`:
//! text rows, differential's `iterate`) on its own replica binary, with
//! `lockstep serve --format` naming its format. The environment checks the
//! envelope and leaves the descriptions and rows to the family; every
//! answer is checked against the family's plain-Rust reference:
//!
//! create a 2x2 replica; a dataflow of another format and one whose
//! description the family refuses are refused (INVALID_ARGUMENT) and leave
//! nothing; create the distances from two roots; subscribe; write three
//! times; peek every root at every time and accumulate the subscription;
//! kill the environment with SIGKILL and start it again on the same state;
//! the replica's processes are adopted (same PIDs), the answers are the
//! same, and a further write is answered right; then the `lockstep` CLI,
//! which asks the environment its format, shows it in `status`, creates a
//! dataflow whose description it reads from a file (`--export ID=@FILE`),
//! writes rows given as text (`--update TEXT@T`) and in a file
//! (`--update @FILE@T`), and peeks, printing the text rows as text (and in
//! hex with `--hex`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use common::Client;
use futures::StreamExt;
use lockstep_chaos::environment::Sandbox;
use lockstep_environment::proto;
use lockstep_example_reachability::{self as reachability, describe, reference, FORMAT};
use lockstep_protocol::{proto as wire, Update};

const REPLICA: &str = "graph";
/// The exports: the distances from n0 and from n5.
const ROOTS: [(u64, &str); 2] = [(101, "n0"), (102, "n5")];
/// Every bounded wait of this test.
const WAIT: Duration = Duration::from_secs(60);

/// A client of the environment at `url` on `state`, sending the token
/// `lockstep serve` made there.
async fn client(url: &str, state: &Path) -> Client {
    common::client(url, state, WAIT).await
}

fn create(format: &str, exports: Vec<wire::Export>) -> proto::CreateDataflowRequest {
    proto::CreateDataflowRequest {
        replica: REPLICA.into(),
        name: "distances".into(),
        inputs: vec![1],
        exports,
        as_of: 0,
        format: format.into(),
    }
}

fn export(e: lockstep_protocol::Export) -> wire::Export {
    wire::Export {
        collection_id: e.collection_id,
        description: e.description,
    }
}

async fn write(c: &mut Client, updates: &[Update], upper: u64) {
    c.write_input(proto::WriteInputRequest {
        replica: REPLICA.into(),
        collection_id: 1,
        updates: updates.iter().cloned().map(wire::Update::from).collect(),
        upper,
    })
    .await
    .unwrap();
}

/// Peeks every root at every time in `times` and compares with the
/// reference over `written`.
async fn check_peeks(c: &mut Client, written: &[Update], times: std::ops::Range<u64>, when: &str) {
    for (collection, root) in ROOTS {
        for t in times.clone() {
            let rows = c
                .peek(proto::PeekRequest {
                    replica: REPLICA.into(),
                    collection_id: collection,
                    timestamp: t,
                })
                .await
                .unwrap_or_else(|e| panic!("{when}: peek {collection} at {t}: {e}"))
                .into_inner()
                .rows;
            let got: BTreeSet<Vec<u8>> = rows
                .into_iter()
                .map(|r| {
                    assert_eq!(r.diff, 1, "{when}: a distance row counted {}", r.diff);
                    r.values
                })
                .collect();
            assert_eq!(
                got,
                reference(written, root, t),
                "{when}: distances from {root} at {t}"
            );
        }
    }
}

async fn pids(c: &mut Client) -> Vec<u32> {
    let r = c
        .list_replicas(proto::ListReplicasRequest::default())
        .await
        .unwrap()
        .into_inner();
    let graph = r.replicas.iter().find(|r| r.name == REPLICA).unwrap();
    graph.process_status.iter().map(|p| p.pid).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_family_of_your_own_walks_through_lockstep_serve_and_a_restart() {
    let sandbox = Sandbox::new().unwrap();
    let binary = common::reachability_binary();
    let args = ["--format", FORMAT];
    let (mut serve, url) = common::serve(sandbox.path(), &binary, &args).await;
    let mut c = client(&url, sandbox.path()).await;
    let r = c
        .create_replica(proto::CreateReplicaRequest {
            name: REPLICA.into(),
            processes: 2,
            workers_per_process: 2,
            config: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let before: Vec<u32> = r
        .replica
        .iter()
        .flat_map(|r| r.process_status.iter().map(|p| p.pid))
        .collect();
    assert_eq!(before.len(), 2);

    // Another format is refused by the environment; a description the
    // family refuses, by the replicas (the environment cannot read it), and
    // the dataflow is not created.
    let roots = || ROOTS.map(|(c, r)| export(describe(c, r))).to_vec();
    let e = c
        .create_dataflow(create(lockstep_plan::FORMAT, roots()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains(FORMAT), "{}", e.message());
    let mut bad = roots();
    bad[1].description = vec![0xff];
    let e = c.create_dataflow(create("", bad)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(
        e.message().contains("is not a") && e.message().contains(FORMAT),
        "{}",
        e.message()
    );
    let listed = c
        .list_dataflows(proto::ListDataflowsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.dataflows.is_empty(), "{listed:?}");

    let created = c
        .create_dataflow(create(FORMAT, roots()))
        .await
        .unwrap()
        .into_inner()
        .dataflow
        .unwrap();
    assert_eq!(created.format, FORMAT);

    let mut sub = c
        .subscribe(proto::SubscribeRequest {
            replica: REPLICA.into(),
            collection_id: 102,
            as_of: 0,
            resume: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut written = Vec::new();
    for (updates, upper) in reachability::sample_writes() {
        write(&mut c, &updates, upper).await;
        written.extend(updates);
    }
    check_peeks(&mut c, &written, 0..3, "before the restart").await;
    let mut streamed: Vec<wire::Update> = Vec::new();
    loop {
        let batch = tokio::time::timeout(WAIT, sub.next())
            .await
            .expect("a subscribe batch in time")
            .expect("the subscription is open")
            .unwrap();
        streamed.extend(batch.updates);
        if batch.upper.first().is_none_or(|&u| u >= 3) {
            break;
        }
    }
    for t in 0..3 {
        let mut at: BTreeMap<Vec<u8>, i64> = BTreeMap::new();
        for u in streamed.iter().filter(|u| u.time <= t) {
            *at.entry(u.row.clone()).or_insert(0) += u.diff;
        }
        at.retain(|_, d| *d != 0);
        assert!(at.values().all(|d| *d == 1), "{at:?} at {t}");
        assert_eq!(
            at.into_keys().collect::<BTreeSet<_>>(),
            reference(&written, "n5", t),
            "the subscription's distances from n5 at {t}"
        );
    }
    drop(sub);

    // SIGKILL, then the same state: the processes are adopted.
    serve.kill().await.unwrap();
    let (_serve, url) = common::serve(sandbox.path(), &binary, &args).await;
    let mut c = client(&url, sandbox.path()).await;
    assert_eq!(pids(&mut c).await, before, "the processes were adopted");
    check_peeks(&mut c, &written, 0..3, "after the restart").await;
    let more = vec![Update {
        row: reachability::edge("n7", "n8"),
        time: 3,
        diff: 1,
    }];
    write(&mut c, &more, 4).await;
    written.extend(more);
    check_peeks(
        &mut c,
        &written,
        3..4,
        "after a write through the new controller",
    )
    .await;
    assert!(reference(&written, "n5", 3).contains(&reachability::distance("n8", 4)));

    // The CLI knows the family from the environment (GetStatus's format)
    // and drives it in its own bytes: `status` names the format; a
    // dataflow (the distances from n7) whose description is read from a
    // file, with no `--format`; a write of one edge as its text and one
    // read from a file; a peek printing the text rows as text (not as
    // integers, not in hex), and in hex with `--hex`; the listing.
    let out = lockstep(&url, sandbox.path(), &["status"]).await;
    assert!(out.contains(&format!("format {FORMAT},")), "{out}");
    let status: serde_json::Value =
        serde_json::from_str(&lockstep(&url, sandbox.path(), &["status", "-o", "json"]).await)
            .expect("status -o json");
    assert_eq!(status["format"], FORMAT, "{status}");
    let files = tempfile::tempdir().unwrap();
    let root = files.path().join("root");
    std::fs::write(&root, describe(103, "n7").description).unwrap();
    let out = lockstep(
        &url,
        sandbox.path(),
        &[
            "dataflow",
            "create",
            "--replica",
            REPLICA,
            "--name",
            "from-n7",
            "--input",
            "1",
            "--export",
            &format!("103=@{}", root.display()),
        ],
    )
    .await;
    assert!(out.starts_with("created dataflow"), "{out}");
    let edge = reachability::edge("n8", "n9");
    let from_file = reachability::edge("n9", "n10");
    let edge_file = files.path().join("edge");
    std::fs::write(&edge_file, &from_file).unwrap();
    lockstep(
        &url,
        sandbox.path(),
        &[
            "input",
            "write",
            "--replica",
            REPLICA,
            "--collection",
            "1",
            "--update",
            &format!("{}@4", std::str::from_utf8(&edge).unwrap()),
            "--update",
            &format!("@{}@4:1", edge_file.display()),
            "--upper",
            "5",
        ],
    )
    .await;
    for row in [edge, from_file] {
        written.push(Update {
            row,
            time: 4,
            diff: 1,
        });
    }
    let peek = [
        "peek",
        "--replica",
        REPLICA,
        "--collection",
        "103",
        "--at",
        "4",
    ];
    let out = lockstep(&url, sandbox.path(), &peek).await;
    let printed: BTreeSet<String> = out.lines().map(str::to_string).collect();
    let expected: BTreeSet<String> = reference(&written, "n7", 4)
        .iter()
        .map(|row| format!("{}\t1", std::str::from_utf8(row).unwrap()))
        .collect();
    assert_eq!(
        printed, expected,
        "the CLI's peek of the distances from n7 at 4, as text"
    );
    assert!(expected.contains("n9\t2\t1") && expected.contains("n10\t3\t1"));
    let hex = |bytes: &[u8]| -> String {
        std::iter::once("0x".to_string())
            .chain(bytes.iter().map(|b| format!("{b:02x}")))
            .collect()
    };
    let out = lockstep(&url, sandbox.path(), &[&peek[..], &["--hex"]].concat()).await;
    let printed: BTreeSet<String> = out.lines().map(str::to_string).collect();
    let expected: BTreeSet<String> = reference(&written, "n7", 4)
        .iter()
        .map(|row| format!("{}\t1", hex(row)))
        .collect();
    assert_eq!(printed, expected, "the CLI's peek --hex");
    let out = lockstep(&url, sandbox.path(), &["dataflow", "list"]).await;
    assert!(out.contains("103=n7"), "{out}");
}

/// Runs the `lockstep` CLI against the environment at `url` on state
/// directory `state` (whose token it sends: `LOCKSTEP_STATE_DIR`); its
/// standard output, once it exited successfully.
async fn lockstep(url: &str, state: &Path, args: &[&str]) -> String {
    let out = tokio::time::timeout(
        WAIT,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(args)
            .arg("--server")
            .arg(url)
            .env("LOCKSTEP_STATE_DIR", state)
            .output(),
    )
    .await
    .expect("the CLI in time")
    .expect("the CLI runs");
    assert!(
        out.status.success(),
        "lockstep {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}
