//! The supervisor's decisions on state it cannot read now (R1).
//! The decision rule (R1): only a record read as gone stops a
//! supervisor; a check that cannot be made now is a retry. State that
//! cannot be read is made here by a directory where a file should be
//! (EISDIR): descriptor exhaustion itself is process-wide, so its test
//! is a binary of its own (`tests/descriptors.rs`).

use super::*;

/// An orchestrator on a fresh state directory, and a record of service
/// `s` whose one process is dead: recorded as this test process with
/// another start time (returned as the watched handle).
fn setup() -> (tempfile::TempDir, ProcessOrchestrator, (u32, u64)) {
    let dir = tempfile::tempdir().unwrap();
    let o = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1)).unwrap();
    let me = std::process::id();
    let dead = (me, proc_start_time(me).unwrap() + 1);
    let record = ServiceRecord {
        version: RECORD_VERSION,
        name: "s".to_string(),
        id: 1,
        epoch: 1,
        labels: BTreeMap::new(),
        program: PathBuf::from("/nonexistent/bin/lockstep-test"),
        env: BTreeMap::from([("K".to_string(), "v".to_string())]),
        port_names: Vec::new(),
        processes: vec![ProcessRecord {
            argv: Vec::new(),
            ports: BTreeMap::new(),
            pid: Some(dead.0),
            start_time: Some(dead.1),
            restarts: 0,
            namespace: None,
            address: None,
        }],
        generation: 1,
    };
    o.inner.write(&record).unwrap();
    (dir, o, dead)
}

/// Puts a directory where the file `path` is (reads of it fail with
/// EISDIR); returns its content to put back.
fn make_unreadable(path: &Path) -> Vec<u8> {
    let content = std::fs::read(path).unwrap();
    std::fs::remove_file(path).unwrap();
    std::fs::create_dir(path).unwrap();
    content
}

fn make_readable(path: &Path, content: &[u8]) {
    std::fs::remove_dir(path).unwrap();
    std::fs::write(path, content).unwrap();
}

fn is_retry(d: &Decision) -> bool {
    matches!(d, Decision::Retry(_))
}

#[test]
fn only_a_record_read_as_gone_stops_a_supervisor() {
    let (_dir, o, dead) = setup();
    let inner = &o.inner;
    assert!(matches!(
        inner.decide("s", 0, Some(dead)),
        Decision::Restart
    ));
    // No such process in the record: stop.
    assert!(matches!(inner.decide("s", 1, Some(dead)), Decision::Stop));
    // Another process in the record than the one that died: watch it.
    assert!(matches!(
        inner.decide("s", 0, None),
        Decision::Watch(h) if h == dead
    ));

    // The record cannot be read now: not a drop.
    let path = inner.record_path("s");
    let content = make_unreadable(&path);
    let d = inner.decide("s", 0, Some(dead));
    assert!(
        matches!(&d, Decision::Retry(r) if r.contains("cannot read the service record")),
        "a record that cannot be read is not dropped"
    );
    // Neither may a restart or a port reassignment stop on it.
    assert!(is_retry(&inner.restart("s", 0, Some(dead)).unwrap()));
    assert!(matches!(
        inner.reassign_ports("s", 0, Some(dead)),
        Ok(Reassigned::Decided(Decision::Retry(_)))
    ));
    make_readable(&path, &content);
    assert!(matches!(
        inner.decide("s", 0, Some(dead)),
        Decision::Restart
    ));

    // Nor its environment file.
    let env = env_path(&path);
    let content = make_unreadable(&env);
    assert!(is_retry(&inner.decide("s", 0, Some(dead))));
    assert!(is_retry(&inner.restart("s", 0, Some(dead)).unwrap()));
    make_readable(&env, &content);

    // Dropped (the record gone): stop.
    remove_record(&path).unwrap();
    assert!(matches!(inner.decide("s", 0, Some(dead)), Decision::Stop));
    assert!(matches!(
        inner.restart("s", 0, Some(dead)),
        Ok(Decision::Stop)
    ));
}

#[tokio::test]
async fn a_lock_that_cannot_be_taken_is_a_retry() {
    let (dir, o, dead) = setup();
    let lock = dir.path().join("orchestrator.lock");
    let content = make_unreadable(&lock);
    let d = o.inner.check_record("s", 0, Some(dead)).await;
    assert!(
        matches!(&d, Decision::Retry(r) if r.contains("cannot take the state lock")),
        "a lock that cannot be taken is no decision to restart"
    );
    assert!(is_retry(&o.inner.restart("s", 0, Some(dead)).unwrap()));
    assert!(matches!(
        o.inner.reassign_ports("s", 0, Some(dead)),
        Ok(Reassigned::Decided(Decision::Retry(_)))
    ));
    make_readable(&lock, &content);
    assert!(matches!(
        o.inner.check_record("s", 0, Some(dead)).await,
        Decision::Restart
    ));
}

#[test]
fn retries_back_off_and_are_reported_once_per_interval() {
    let mut r = Retries::default();
    let waits: Vec<(Duration, bool)> = (0..7).map(|_| r.fail()).collect();
    let ms = Duration::from_millis;
    assert_eq!(
        waits,
        vec![
            (ms(100), true),
            (ms(200), false),
            (ms(400), false),
            (ms(800), false),
            (ms(1600), false),
            (ms(2000), false),
            (ms(2000), false),
        ]
    );
    // A check made again: the wait starts over, the report does not
    // (the process is still down).
    r.checked("s", 0);
    assert_eq!(r.fail(), (ms(100), false));
    // Once it runs again, the next failure is reported at once.
    r.watching("s", 0);
    assert_eq!(r.fail(), (ms(100), true));
    // And one report per interval while it stays down.
    r.reported = Instant::now().checked_sub(REPORT_EVERY);
    assert_eq!(r.fail(), (ms(200), true));
}
