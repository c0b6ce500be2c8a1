//! The dataflow format (family) is state, not a start flag (issue 47 item
//! 3): the first start records it in the catalog (`--format`, or the
//! built-in `lockstep.plan.v1`), a later start without `--format` takes it
//! from there, and a start whose `--format` says otherwise is refused,
//! naming both, before anything is recorded or started.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use lockstep_catalog::Catalog;
use lockstep_environment::{Environment, EnvironmentConfig, StartError};
use lockstep_example_reachability::FORMAT as REACH;
use lockstep_plan::FORMAT as PLAN;

/// The test configuration with `--format` `format` (and the reachability
/// replica program when that is the family asked for).
fn config_with(state: &Path, format: Option<&str>) -> EnvironmentConfig {
    let mut config = config(state, None);
    if format == Some(REACH) {
        config.service.program = reachability_binary();
    }
    config.format = format.map(str::to_string);
    config
}

/// What the catalog in `state` records (opening it fences any environment
/// still holding it: call it once that one is dropped).
fn recorded(state: &Path) -> Option<String> {
    Catalog::open(state.join("catalog.db"))
        .unwrap()
        .format()
        .unwrap()
}

fn load(state: &Path, format: Option<&str>) -> Result<Environment, StartError> {
    Environment::load(config_with(state, format))
}

#[test]
fn the_first_start_records_the_format_and_later_starts_keep_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();

    // Nothing recorded: `--format` is recorded and used.
    drop(load(state, Some(REACH)).unwrap());
    assert_eq!(recorded(state).as_deref(), Some(REACH));

    // Recorded, no `--format`: taken from the catalog.
    drop(load(state, None).unwrap());
    assert_eq!(recorded(state).as_deref(), Some(REACH), "unchanged");

    // Recorded, the same `--format`: fine.
    drop(load(state, Some(REACH)).unwrap());

    // Recorded, another `--format`: refused, naming both.
    let err = load(state, Some(PLAN)).map(drop).expect_err("refused");
    assert!(
        matches!(&err, StartError::FormatMismatch { recorded, given }
            if recorded == REACH && given.as_deref() == Some(PLAN)),
        "{err}"
    );
    let msg = err.to_string();
    assert_eq!(
        msg,
        format!(
            "this catalog's replicas build format {REACH}; --format says {PLAN}: \
             start with --format {REACH} (or a fresh state directory)"
        )
    );
    assert_eq!(recorded(state).as_deref(), Some(REACH), "nothing recorded");
}

#[test]
fn without_a_format_the_built_in_one_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    drop(load(state, None).unwrap());
    assert_eq!(recorded(state).as_deref(), Some(PLAN));
    drop(load(state, Some(PLAN)).unwrap());
    let err = load(state, Some(REACH)).map(drop).expect_err("refused");
    assert!(
        err.to_string()
            .contains(&format!("build format {PLAN}; --format says {REACH}")),
        "{err}"
    );
    assert_eq!(recorded(state).as_deref(), Some(PLAN));
}

/// A catalog of an older schema records no format, but its dataflows name
/// theirs: a start without `--format` would build them as plans, so it is
/// refused too; the right `--format` records it.
#[test]
fn a_catalog_that_recorded_no_format_is_checked_against_its_dataflows() {
    use prost::Message;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    {
        let mut c = Catalog::open(state.join("catalog.db")).unwrap();
        let r = c.create_replica("r", shape(1, 1)).unwrap();
        c.create_dataflow_with(r.id, |id| {
            let desc = lockstep_protocol::DataflowDescription {
                id,
                as_of: 0,
                inputs: vec![1],
                exports: vec![lockstep_example_reachability::describe(2, "a")],
                debug_name: "reach".into(),
                format: REACH.into(),
            };
            lockstep_protocol::proto::DataflowDescription::from(desc).encode_to_vec()
        })
        .unwrap();
    }
    let err = load(state, None).map(drop).expect_err("refused");
    assert!(
        matches!(&err, StartError::FormatMismatch { recorded, given: None } if recorded == REACH),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!(
            "no --format was given, which means the built-in {PLAN}: start with --format {REACH}"
        )),
        "{err}"
    );
    assert_eq!(recorded(state), None, "nothing recorded on a refusal");
    drop(load(state, Some(REACH)).unwrap());
    assert_eq!(recorded(state).as_deref(), Some(REACH));
}

/// The same rule through `lockstep serve` itself: restarted without
/// `--format` it serves the recorded family; with another it exits with
/// the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockstep_serve_keeps_to_the_recorded_format() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let reach = reachability_binary();
    let (mut serve1, _) = serve(state, &reach, &["--format", REACH]).await;
    serve1.kill().await.unwrap();
    assert_eq!(recorded(state).as_deref(), Some(REACH));

    let (mut serve2, _) = serve(state, &reach, &[]).await;
    serve2.kill().await.unwrap();
    let log = std::fs::read_to_string(state.join("serve.stderr")).unwrap();
    assert!(log.contains("format taken from the catalog"), "{log}");

    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(["serve", "--listen", "127.0.0.1:0", "--format", PLAN])
            .arg("--state-dir")
            .arg(state)
            .arg("--service-binary")
            .arg(replica_binary())
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .expect("lockstep serve exited in time")
    .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "this catalog's replicas build format {REACH}; --format says {PLAN}: \
             start with --format {REACH}"
        )),
        "{stderr}"
    );
    assert_eq!(recorded(state).as_deref(), Some(REACH));
}
