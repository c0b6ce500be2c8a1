use super::*;
use rusqlite::Connection;
use std::time::Duration;

fn inputs_and_dataflows_survive_reopen_and_go_with_their_replica(s: &TestStore) {
    let mut c = s.open();
    let r = c.create_replica("r", cfg(2)).unwrap();
    let d = c
        .create_dataflow_with(r.id, |id| format!("df{id}").into_bytes())
        .unwrap();
    assert_eq!(d.description, format!("df{}", d.id).into_bytes());
    let w1 = c.append_input(r.id, 7, b"one").unwrap();
    let w2 = c.append_input(r.id, 7, b"two").unwrap();
    assert!(w2.seq > w1.seq);
    assert!(matches!(
        c.append_input(r.id + 100, 7, b"x"),
        Err(WriteError::NoSuchReplica(_))
    ));
    drop(c);
    let mut c = s.open();
    let state = c.state().unwrap();
    assert_eq!(state.dataflows[&d.id].description, d.description);
    let writes: Vec<&[u8]> = state.input_writes.iter().map(|w| &w.write[..]).collect();
    assert_eq!(writes, vec![&b"one"[..], &b"two"[..]]);
    c.drop_replica("r").unwrap();
    let state = c.state().unwrap();
    assert!(state.input_writes.is_empty() && state.dataflows.is_empty());
}

/// A group commit stores every write of the group, in order, with
/// increasing positions; a group naming a missing replica stores none of
/// its writes; a fenced-out catalog stores none.
fn a_group_of_writes_is_stored_whole_or_not_at_all(s: &TestStore) {
    let mut c = s.open();
    let r1 = c.create_replica("r1", cfg(1)).unwrap();
    let r2 = c.create_replica("r2", cfg(1)).unwrap();
    let seqs = c
        .append_inputs(&[(r1.id, 1, b"a"), (r2.id, 1, b"b"), (r1.id, 2, b"c")])
        .unwrap();
    assert_eq!(seqs.len(), 3);
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let err = c
        .append_inputs(&[(r1.id, 1, b"lost"), (r2.id + 100, 1, b"x")])
        .unwrap_err();
    assert!(matches!(err, WriteError::NoSuchReplica(_)), "{err}");
    let stored = |c: &mut Catalog| -> Vec<(u64, u64, Vec<u8>)> {
        let state = c.state().unwrap();
        state
            .input_writes
            .iter()
            .map(|w| (w.replica_id, w.collection_id, w.write.clone()))
            .collect()
    };
    let expected = vec![
        (r1.id, 1, b"a".to_vec()),
        (r2.id, 1, b"b".to_vec()),
        (r1.id, 2, b"c".to_vec()),
    ];
    assert_eq!(stored(&mut c), expected, "the failed group left nothing");
    let mut newer = s.open();
    let err = c
        .append_inputs(&[(r1.id, 1, b"stale"), (r2.id, 1, b"stale")])
        .unwrap_err();
    assert!(err.fenced().is_some(), "{err}");
    assert_eq!(
        stored(&mut newer),
        expected,
        "the fenced group left nothing"
    );
}

fn cfg(processes: u32) -> ReplicaConfig {
    ReplicaConfig {
        processes,
        workers_per_process: 2,
        config: String::new(),
    }
}

fn a_version_1_catalog_is_migrated_and_policies_are_kept_and_fenced(s: &TestStore) {
    {
        let mut c = s.open();
        c.create_replica("r", cfg(1)).unwrap();
        // Make it a version 1 catalog, as an older build left it.
        s.make_version_1(&c);
    }
    let mut c = s.open();
    assert_eq!(
        c.state().unwrap().replicas.len(),
        1,
        "kept across the migration"
    );
    assert!(c.policies().unwrap().is_empty());
    assert_eq!(c.format().unwrap(), None, "no format recorded");
    assert_eq!(s.version(), SCHEMA_VERSION);
    let p = StoredPolicy {
        kind: "distribution".into(),
        name: "log".into(),
        wasm: vec![0, 97, 115, 109],
        set_at: 7,
    };
    c.set_policy(&p).unwrap();
    let newer = StoredPolicy {
        name: "barrier".into(),
        set_at: 8,
        ..p.clone()
    };
    c.set_policy(&newer).unwrap();
    assert_eq!(c.policies().unwrap(), vec![newer.clone()]);
    let mut reopened = s.open();
    assert_eq!(reopened.policies().unwrap(), vec![newer]);
    assert!(c.set_policy(&p).unwrap_err().fenced().is_some());
}

fn a_version_3_catalog_is_migrated_and_has_no_format(s: &TestStore) {
    let (r, d, p) = {
        let mut c = s.open();
        let r = c.create_replica("r", cfg(1)).unwrap();
        let d = c.create_dataflow(r.id, b"desc").unwrap();
        let p = StoredPolicy {
            kind: "distribution".into(),
            name: "log".into(),
            wasm: vec![0, 97, 115, 109],
            set_at: 7,
        };
        c.set_replica_policy(r.id, &p).unwrap();
        // Make it a version 3 catalog, as the previous build left it.
        s.make_version_3(&c);
        (r, d, p)
    };
    assert_eq!(s.version(), 3);
    let mut c = s.open();
    assert_eq!(s.version(), SCHEMA_VERSION, "migrated on open");
    let state = c.state().unwrap();
    assert_eq!(state.replicas[&r.id], r, "kept across the migration");
    assert_eq!(state.dataflows[&d.id], d);
    assert_eq!(c.replica_policies().unwrap(), vec![(r.id, p)]);
    assert_eq!(c.format().unwrap(), None, "an older catalog recorded none");
    c.record_format("lockstep.example.other.v1").unwrap();
    assert_eq!(
        s.open().format().unwrap().as_deref(),
        Some("lockstep.example.other.v1")
    );
}

fn the_format_is_recorded_kept_and_fenced(s: &TestStore) {
    let mut c = s.open();
    assert_eq!(c.format().unwrap(), None, "a new catalog has none");
    assert!(matches!(c.record_format(""), Err(WriteError::Invalid(_))));
    c.record_format("lockstep.plan.v1").unwrap();
    assert_eq!(c.format().unwrap().as_deref(), Some("lockstep.plan.v1"));
    c.record_format("lockstep.example.other.v1").unwrap();
    assert_eq!(
        c.format().unwrap().as_deref(),
        Some("lockstep.example.other.v1"),
        "replaced"
    );
    let mut newer = s.open();
    assert_eq!(
        newer.format().unwrap().as_deref(),
        Some("lockstep.example.other.v1"),
        "kept across a reopen"
    );
    let err = c.record_format("lockstep.plan.v1").unwrap_err();
    assert!(err.fenced().is_some(), "{err}");
    assert_eq!(
        newer.format().unwrap().as_deref(),
        Some("lockstep.example.other.v1"),
        "the fenced write wrote nothing"
    );
    // Reading is allowed when fenced.
    assert_eq!(
        c.format().unwrap().as_deref(),
        Some("lockstep.example.other.v1")
    );
}

fn replica_policies_are_kept_fenced_and_go_with_their_replica(s: &TestStore) {
    let mut c = s.open();
    let r1 = c.create_replica("r1", cfg(1)).unwrap();
    let r2 = c.create_replica("r2", cfg(1)).unwrap();
    let p = StoredPolicy {
        kind: "distribution".into(),
        name: "log".into(),
        wasm: vec![0, 97, 115, 109],
        set_at: 7,
    };
    assert!(matches!(
        c.set_replica_policy(999, &p),
        Err(WriteError::NoSuchReplica(_))
    ));
    c.set_replica_policy(r1.id, &p).unwrap();
    let newer = StoredPolicy {
        name: "broadcast".into(),
        set_at: 8,
        ..p.clone()
    };
    c.set_replica_policy(r1.id, &newer).unwrap();
    c.set_replica_policy(r2.id, &p).unwrap();
    assert!(c.policies().unwrap().is_empty(), "not environment-wide");
    assert_eq!(
        c.replica_policies().unwrap(),
        vec![(r1.id, newer.clone()), (r2.id, p.clone())]
    );
    c.drop_replica("r2").unwrap();
    let mut reopened = s.open();
    assert_eq!(reopened.replica_policies().unwrap(), vec![(r1.id, newer)]);
    assert!(c
        .set_replica_policy(r1.id, &p)
        .unwrap_err()
        .fenced()
        .is_some());
}

fn replacing_inputs_keeps_other_collections_and_is_fenced(s: &TestStore) {
    let mut c = s.open();
    let r = c.create_replica("r", cfg(1)).unwrap();
    for i in 0..5u8 {
        c.append_input(r.id, 1, &[i]).unwrap();
    }
    c.append_input(r.id, 2, b"other").unwrap();
    c.replace_inputs(r.id, 1, b"snapshot").unwrap();
    let writes: Vec<(u64, Vec<u8>)> = c
        .state()
        .unwrap()
        .input_writes
        .into_iter()
        .map(|w| (w.collection_id, w.write))
        .collect();
    assert_eq!(
        writes,
        vec![(2, b"other".to_vec()), (1, b"snapshot".to_vec())]
    );
    let _newer = s.open();
    assert!(c
        .replace_inputs(r.id, 1, b"stale")
        .unwrap_err()
        .fenced()
        .is_some());
}

fn opening_bumps_the_epoch_and_ids_are_monotonic(s: &TestStore) {
    let mut a = s.open();
    assert_eq!(a.epoch(), 1);
    let r1 = a.create_replica("r1", cfg(2)).unwrap();
    let r2 = a.create_replica("r2", cfg(1)).unwrap();
    assert!(r2.id > r1.id);
    a.drop_replica("r2").unwrap();
    let r3 = a.create_replica("r3", cfg(1)).unwrap();
    assert!(r3.id > r2.id, "IDs are never reused");
    let d = a.create_dataflow(r1.id, b"desc").unwrap();
    let gone = a.create_dataflow(r1.id, b"gone").unwrap();
    assert!(gone.id > d.id);
    a.drop_dataflow(gone.id).unwrap();
    assert!(matches!(
        a.drop_dataflow(gone.id),
        Err(WriteError::NoSuchDataflow(_))
    ));
    assert!(matches!(
        a.create_dataflow(r2.id, b"on a dropped replica"),
        Err(WriteError::NoSuchReplica(_))
    ));
    drop(a);
    let mut b = s.open();
    assert_eq!(b.epoch(), 2);
    let state = b.state().unwrap();
    assert_eq!(state.epoch, 2);
    assert_eq!(state.next_replica_id, r3.id + 1);
    assert_eq!(
        state.replicas.keys().copied().collect::<Vec<_>>(),
        vec![r1.id, r3.id]
    );
    assert_eq!(state.replicas[&r1.id].config, cfg(2));
    assert_eq!(state.dataflows[&d.id].description, b"desc");
    assert_eq!(state.dataflows.len(), 1);
    assert_eq!(state.next_dataflow_id, gone.id + 1);
    b.drop_replica("r1").unwrap();
    assert!(b.state().unwrap().dataflows.is_empty());
    assert!(matches!(
        b.drop_replica("r1"),
        Err(WriteError::NoSuchReplica(_))
    ));
    assert!(matches!(
        b.create_replica("r3", cfg(1)),
        Err(WriteError::ReplicaExists(_))
    ));
    assert!(matches!(
        b.create_replica("r4", cfg(0)),
        Err(WriteError::Invalid(_))
    ));
}

fn replica_names_and_shapes_are_bounded(s: &TestStore) {
    let mut c = s.open();
    let shape = |processes, workers_per_process, config: &str| ReplicaConfig {
        processes,
        workers_per_process,
        config: config.into(),
    };
    for (name, config, says) in [
        ("", shape(1, 1, ""), "needs a name"),
        ("Upper", shape(1, 1, ""), "only a-z"),
        ("a b", shape(1, 1, ""), "only a-z"),
        ("r\u{e9}", shape(1, 1, ""), "only a-z"),
        ("-r", shape(1, 1, ""), "start or end"),
        (
            &"r".repeat(MAX_NAME_LEN + 1),
            shape(1, 1, ""),
            "at most 63 characters",
        ),
        ("r", shape(0, 1, ""), "at least one process"),
        ("r", shape(MAX_PROCESSES + 1, 1, ""), "at most 64 processes"),
        ("r", shape(1, 1_000_000, ""), "at most 64 workers"),
        (
            "r",
            shape(1, 1, &"x".repeat(MAX_CONFIG_LEN + 1)),
            "at most 4096 bytes",
        ),
    ] {
        match c.create_replica(name, config) {
            Err(WriteError::Invalid(m)) => assert!(m.contains(says), "{name:?}: {m}"),
            other => panic!("{name:?} was not refused: {other:?}"),
        }
    }
    assert!(
        c.state().unwrap().replicas.is_empty(),
        "nothing was written"
    );
    let longest = "r".repeat(MAX_NAME_LEN);
    c.create_replica(&longest, shape(MAX_PROCESSES, MAX_WORKERS_PER_PROCESS, ""))
        .unwrap();
    c.create_replica("replica-2", shape(1, 1, "x")).unwrap();
}

fn a_stale_handle_is_fenced_and_writes_nothing(s: &TestStore) {
    let mut old = s.open();
    let r1 = old.create_replica("r1", cfg(1)).unwrap();
    let mut new = s.open();
    let err = old.create_replica("r2", cfg(1)).unwrap_err();
    assert_eq!(
        err.fenced(),
        Some(Fenced {
            ours: 1,
            current: 2
        })
    );
    assert!(err.to_string().contains("another controller took over"));
    assert!(old.drop_replica("r1").unwrap_err().fenced().is_some());
    assert!(old.check_fence().unwrap_err().fenced().is_some());
    let err = old.append_input(r1.id, 7, b"stale").unwrap_err();
    assert_eq!(
        err.fenced(),
        Some(Fenced {
            ours: 1,
            current: 2
        }),
        "{err}"
    );
    let state = new.state().unwrap();
    assert!(
        state.input_writes.is_empty(),
        "the fenced input write wrote nothing"
    );
    assert_eq!(state.replicas.len(), 1);
    assert_eq!(
        state.next_replica_id, 2,
        "the fenced write allocated nothing"
    );
    new.create_replica("r2", cfg(1)).unwrap();
    new.check_fence().unwrap();
}

/// Commits do not checkpoint the WAL themselves (their writer would wait
/// for the copy); the catalog's own thread copies it into the database
/// file, also while nothing is written, and the file stays in WAL mode.
#[test]
fn the_wal_is_checkpointed_by_the_catalogs_thread() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("catalog.db");
    let mut c = Catalog::open(&path).unwrap();
    let r = c.create_replica("r", cfg(1)).unwrap();
    let before = std::fs::metadata(&path).unwrap().len();
    // 8 MB, twice SQLite's automatic checkpoint threshold.
    let write = vec![7u8; 100_000];
    for _ in 0..80 {
        c.append_inputs(&[(r.id, 1, &write)]).unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::fs::metadata(&path).unwrap().len() < before + 8_000_000 {
        assert!(
            std::time::Instant::now() < deadline,
            "the WAL was not checkpointed into the database file within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let conn = Connection::open(&path).unwrap();
    let mode: String = conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
}

#[test]
fn garbage_is_refused_and_left_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("catalog.db");
    let garbage = b"this is not a database, it is a shopping list\n".repeat(100);
    std::fs::write(&path, &garbage).unwrap();
    let err = Catalog::open(&path).unwrap_err();
    assert!(matches!(err, OpenError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("corrupt"));
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
}

#[test]
fn a_truncated_catalog_is_refused_and_left_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("catalog.db");
    {
        let mut c = Catalog::open(&path).unwrap();
        for i in 0..200 {
            c.create_replica(&format!("replica-with-a-long-name-{i}"), cfg(1))
                .unwrap();
        }
    }
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 8192);
    // Scribble over the second page (a b-tree page).
    for b in &mut bytes[4096..4096 + 512] {
        *b = 0xa5;
    }
    std::fs::write(&path, &bytes).unwrap();
    let err = Catalog::open(&path).unwrap_err();
    assert!(matches!(err, OpenError::Corrupt { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn a_newer_schema_or_foreign_file_is_refused_and_left_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("catalog.db");
    drop(Catalog::open(&path).unwrap());
    {
        let conn = Connection::open(&path).unwrap();
        conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let err = Catalog::open(&path).unwrap_err();
    assert!(
        matches!(err, OpenError::NewerSchema { found, .. } if found == SCHEMA_VERSION + 1),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before);

    let other = dir.path().join("other.db");
    {
        let conn = Connection::open(&other).unwrap();
        conn.execute_batch("CREATE TABLE t (x INTEGER); INSERT INTO t VALUES (1);")
            .unwrap();
    }
    let before = std::fs::read(&other).unwrap();
    let err = Catalog::open(&other).unwrap_err();
    assert!(matches!(err, OpenError::Foreign { found: 0, .. }), "{err}");
    assert_eq!(std::fs::read(&other).unwrap(), before);
}

// ---------------------------------------------------------------------------
// One body, two backends.

use lockstep_pgtest::PgServer;

/// A fresh, empty store of one backend for one test.
enum TestStore {
    Sqlite(tempfile::TempDir),
    Postgres(PgServer),
}

impl TestStore {
    fn sqlite() -> TestStore {
        TestStore::Sqlite(tempfile::tempdir().unwrap())
    }

    /// A throw-away server of its own: tests run in parallel and some
    /// restart theirs.
    fn postgres() -> TestStore {
        assert!(
            PgServer::available(),
            "no PostgreSQL binaries (install the postgresql package)"
        );
        TestStore::Postgres(PgServer::start().unwrap())
    }

    fn store(&self) -> Store {
        match self {
            TestStore::Sqlite(dir) => Store::Sqlite(dir.path().join("catalog.db")),
            TestStore::Postgres(pg) => Store::Postgres(pg.url()),
        }
    }

    fn open(&self) -> Catalog {
        Catalog::open_store(&self.store()).unwrap()
    }

    fn server(&self) -> &PgServer {
        match self {
            TestStore::Postgres(pg) => pg,
            TestStore::Sqlite(_) => panic!("not a PostgreSQL store"),
        }
    }

    /// Turns the catalog into a version 1 catalog, as an older build left it.
    fn make_version_1(&self, c: &Catalog) {
        match self {
            TestStore::Sqlite(_) => c
                .sqlite_conn()
                .execute_batch(
                    "DROP TABLE settings; DROP TABLE replica_policies; DROP TABLE policies; \
                     PRAGMA user_version = 1;",
                )
                .unwrap(),
            TestStore::Postgres(pg) => {
                pg.psql(
                    lockstep_pgtest::DATABASE,
                    "DROP TABLE catalog_settings; DROP TABLE catalog_replica_policies; \
                     DROP TABLE catalog_policies; \
                     UPDATE lockstep_schema SET version = 1 WHERE component = 'catalog';",
                )
                .unwrap();
            }
        }
    }

    /// Turns the catalog into a version 3 catalog, as an older build (v0.2.0
    /// among them) left it: no settings table.
    fn make_version_3(&self, c: &Catalog) {
        match self {
            TestStore::Sqlite(_) => c
                .sqlite_conn()
                .execute_batch("DROP TABLE settings; PRAGMA user_version = 3;")
                .unwrap(),
            TestStore::Postgres(pg) => {
                pg.psql(
                    lockstep_pgtest::DATABASE,
                    "DROP TABLE catalog_settings; \
                     UPDATE lockstep_schema SET version = 3 WHERE component = 'catalog';",
                )
                .unwrap();
            }
        }
    }

    /// The schema version the store holds now.
    fn version(&self) -> i32 {
        match self {
            TestStore::Sqlite(dir) => Connection::open(dir.path().join("catalog.db"))
                .unwrap()
                .pragma_query_value(None, "user_version", |r| r.get(0))
                .unwrap(),
            TestStore::Postgres(pg) => pg
                .psql(
                    lockstep_pgtest::DATABASE,
                    "SELECT version FROM lockstep_schema WHERE component = 'catalog'",
                )
                .unwrap()
                .trim()
                .parse()
                .unwrap(),
        }
    }
}

lockstep_pgtest::on_both_backends!(
    TestStore;
    inputs_and_dataflows_survive_reopen_and_go_with_their_replica,
    a_group_of_writes_is_stored_whole_or_not_at_all,
    a_version_1_catalog_is_migrated_and_policies_are_kept_and_fenced,
    a_version_3_catalog_is_migrated_and_has_no_format,
    the_format_is_recorded_kept_and_fenced,
    replica_policies_are_kept_fenced_and_go_with_their_replica,
    replacing_inputs_keeps_other_collections_and_is_fenced,
    opening_bumps_the_epoch_and_ids_are_monotonic,
    replica_names_and_shapes_are_bounded,
    a_stale_handle_is_fenced_and_writes_nothing,
    a_panicking_describe_writes_nothing,
    a_resize_keeps_everything_but_the_shape_and_is_checked_and_fenced,
    reconfiguration_records_are_kept_removed_and_fenced,
);

/// A replica's reconfiguration record is kept across a reopen, replaced,
/// listed by replica and removed; a fenced-out handle writes none.
fn reconfiguration_records_are_kept_removed_and_fenced(s: &TestStore) {
    let mut c = s.open();
    c.record_reconfiguration(7, Some("a")).unwrap();
    c.record_reconfiguration(12, Some("b")).unwrap();
    c.record_reconfiguration(7, Some("c")).unwrap();
    c.record_format("f").unwrap();
    drop(c);
    let mut c = s.open();
    assert_eq!(
        c.reconfigurations().unwrap(),
        vec![(12, "b".to_string()), (7, "c".to_string())]
    );
    c.record_reconfiguration(12, None).unwrap();
    c.record_reconfiguration(99, None).unwrap();
    assert_eq!(c.reconfigurations().unwrap(), vec![(7, "c".to_string())]);
    let _newer = s.open();
    assert!(matches!(
        c.record_reconfiguration(7, None),
        Err(WriteError::Fenced(_))
    ));
    assert_eq!(s.open().reconfigurations().unwrap().len(), 1);
    assert_eq!(s.open().format().unwrap().as_deref(), Some("f"));
}

/// A resize changes the shape alone (config, dataflows and inputs stay),
/// survives a reopen, refuses a shape creation would refuse and an unknown
/// name, and a fenced-out handle writes nothing.
fn a_resize_keeps_everything_but_the_shape_and_is_checked_and_fenced(s: &TestStore) {
    let mut c = s.open();
    let r = c
        .create_replica(
            "r",
            ReplicaConfig {
                processes: 2,
                workers_per_process: 2,
                config: "k=v".into(),
            },
        )
        .unwrap();
    let d = c.create_dataflow(r.id, b"df").unwrap();
    c.append_input(r.id, 7, b"one").unwrap();
    let resized = c.resize_replica("r", 4, 1).unwrap();
    assert_eq!((resized.id, resized.name.as_str()), (r.id, "r"));
    assert_eq!(
        (resized.config.processes, resized.config.workers_per_process),
        (4, 1)
    );
    assert_eq!(resized.config.config, "k=v");
    assert!(matches!(
        c.resize_replica("r", 0, 1),
        Err(WriteError::Invalid(_))
    ));
    assert!(matches!(
        c.resize_replica("nosuch", 1, 1),
        Err(WriteError::NoSuchReplica(_))
    ));
    drop(c);
    let mut newer = s.open();
    let state = newer.state().unwrap();
    assert_eq!(state.replicas[&r.id].config, resized.config);
    assert!(state.dataflows.contains_key(&d.id));
    assert_eq!(state.input_writes.len(), 1);
    let mut stale = s.open();
    let _newest = s.open();
    assert!(matches!(
        stale.resize_replica("r", 1, 1),
        Err(WriteError::Fenced(_))
    ));
    assert_eq!(
        s.open().state().unwrap().replicas[&r.id].config.processes,
        4
    );
}

/// `describe` runs inside the write transaction: if it panics, nothing of
/// the dataflow is written and the catalog goes on working.
fn a_panicking_describe_writes_nothing(s: &TestStore) {
    let mut c = s.open();
    let r = c.create_replica("r", cfg(1)).unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.create_dataflow_with(r.id, |_| panic!("describe failed"))
    }));
    assert!(panicked.is_err());
    let d = c.create_dataflow(r.id, b"next").unwrap();
    let state = c.state().unwrap();
    assert_eq!(
        state.dataflows.keys().copied().collect::<Vec<_>>(),
        vec![d.id]
    );
    assert_eq!(s.open().state().unwrap().dataflows.len(), 1);
}

// ---------------------------------------------------------------------------
// PostgreSQL only.

const DB: &str = lockstep_pgtest::DATABASE;

#[test]
fn store_strings_parse() {
    let s: Store = "postgres://u:pw@h:5/db".parse().unwrap();
    assert_eq!(s, Store::Postgres("postgres://u:pw@h:5/db".into()));
    assert_eq!(s.to_string(), "postgres://u@h:5/db", "no password shown");
    assert!(format!("{s:?}").find("pw").is_none());
    assert!(matches!(
        "postgresql://h/db".parse::<Store>(),
        Ok(Store::Postgres(_))
    ));
    assert_eq!(
        "sqlite:/x/c.db".parse::<Store>().unwrap(),
        Store::Sqlite("/x/c.db".into())
    );
    assert!("mysql://h/db".parse::<Store>().is_err());
    assert_eq!(
        Store::from_arg(None, "/state/catalog.db").unwrap(),
        Store::Sqlite("/state/catalog.db".into())
    );
}

#[test]
fn postgres_refuses_a_newer_schema_and_changes_nothing() {
    let s = TestStore::postgres();
    let pg = s.server();
    drop(s.open());
    pg.psql(
        DB,
        &format!(
            "UPDATE lockstep_schema SET version = {} WHERE component = 'catalog'",
            SCHEMA_VERSION + 1
        ),
    )
    .unwrap();
    let before = pg
        .psql(DB, "SELECT key, value FROM catalog_meta ORDER BY key")
        .unwrap();
    let err = Catalog::open_store(&s.store()).unwrap_err();
    assert!(
        matches!(err, OpenError::NewerSchema { found, .. } if found == SCHEMA_VERSION + 1),
        "{err}"
    );
    assert!(err.to_string().contains("newer than this build"), "{err}");
    assert_eq!(
        pg.psql(DB, "SELECT key, value FROM catalog_meta ORDER BY key")
            .unwrap(),
        before,
        "the epoch was not bumped"
    );
    // Catalog tables without a version row are refused too.
    pg.psql(DB, "DELETE FROM lockstep_schema").unwrap();
    let err = Catalog::open_store(&s.store()).unwrap_err();
    assert!(matches!(err, OpenError::Corrupt { .. }), "{err}");
    // An unreachable server is an error, not a hang.
    let err = Catalog::open_store(&Store::Postgres(format!(
        "postgres://postgres:secret@127.0.0.1:{}/nope",
        pg.port()
    )))
    .unwrap_err();
    assert!(matches!(err, OpenError::Postgres { .. }), "{err}");
    assert!(!err.to_string().contains("secret"), "{err}");
}

#[test]
fn postgres_concurrent_opens_get_distinct_epochs_and_work_inside_a_runtime() {
    let s = TestStore::postgres();
    let store = s.store();
    let epochs: Vec<u64> = (0..4)
        .map(|_| {
            let store = store.clone();
            std::thread::spawn(move || Catalog::open_store(&store).unwrap().epoch())
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let mut sorted = epochs.clone();
    sorted.sort();
    assert_eq!(sorted, vec![1, 2, 3, 4], "{epochs:?}");
    // The environment calls the catalog under a std mutex from async tasks.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let catalog = std::sync::Arc::new(std::sync::Mutex::new(s.open()));
    let c2 = catalog.clone();
    let id = rt
        .block_on(async move {
            tokio::spawn(async move {
                let mut c = c2.lock().unwrap();
                c.create_replica("in-a-runtime", cfg(1)).unwrap().id
            })
            .await
        })
        .unwrap();
    let replicas = catalog.lock().unwrap().state().unwrap().replicas;
    assert_eq!(replicas[&id].name, "in-a-runtime");
}

/// A write blocked in the server whose backend is terminated fails promptly
/// and writes nothing; the next write reconnects.
#[test]
fn postgres_terminated_backend_fails_the_write_without_a_hang() {
    let s = TestStore::postgres();
    let mut c = s.open();
    let r = c.create_replica("r", cfg(1)).unwrap();
    // Another session holds the epoch row, so the write waits in the server.
    let holder = lockstep_pg::Conn::connect(&s.server().url(), Default::default()).unwrap();
    holder
        .run(|x: &mut lockstep_pg::Session| {
            Box::pin(async move {
                x.client
                    .batch_execute(
                        "BEGIN; SELECT value FROM catalog_meta WHERE key = 'epoch' FOR UPDATE",
                    )
                    .await?;
                Ok::<_, lockstep_pg::PgError>(())
            })
        })
        .unwrap();
    let url = s.server().url();
    let killer = std::thread::spawn(move || {
        let k = lockstep_pg::Conn::connect(&url, Default::default()).unwrap();
        // Wait until the catalog's write is blocked on the lock, then kill it.
        let started = std::time::Instant::now();
        loop {
            let killed: i64 = k
                .run(|x: &mut lockstep_pg::Session| {
                    Box::pin(async move {
                        let row = x
                            .client
                            .query_one(
                                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                                 WHERE application_name = 'lockstep-catalog' \
                                 AND wait_event_type = 'Lock'",
                                &[],
                            )
                            .await?;
                        Ok::<_, lockstep_pg::PgError>(row.get(0))
                    })
                })
                .unwrap();
            if killed > 0 {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(20), "never blocked");
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let started = std::time::Instant::now();
    let err = c.append_input(r.id, 1, b"killed").unwrap_err();
    killer.join().unwrap();
    assert!(matches!(err, WriteError::Postgres(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    drop(holder); // releases the lock
    c.append_input(r.id, 1, b"after").unwrap();
    let writes: Vec<Vec<u8>> = c
        .state()
        .unwrap()
        .input_writes
        .into_iter()
        .map(|w| w.write)
        .collect();
    assert_eq!(
        writes,
        vec![b"after".to_vec()],
        "the killed write is absent"
    );
}

/// The server restarts while a writer keeps writing: acknowledged writes
/// survive, a write in flight is entirely there or entirely absent, the
/// failures are errors (not hangs) and the catalog reconnects.
#[test]
fn postgres_server_restart_mid_write_keeps_acknowledged_writes() {
    let mut s = TestStore::postgres();
    let mut c = s.open();
    let r = c.create_replica("r", cfg(1)).unwrap();
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    // How many writes were acknowledged, and whether one was after a failure.
    let acked_count = std::sync::Arc::new(AtomicUsize::new(0));
    let resumed = std::sync::Arc::new(AtomicBool::new(false));
    let (stop2, acked_count2, resumed2) = (stop.clone(), acked_count.clone(), resumed.clone());
    let writer = std::thread::spawn(move || {
        let mut acked = Vec::new();
        let mut failed = Vec::new();
        let mut i: u32 = 0;
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
            i += 1;
            let payload = i.to_be_bytes();
            // Collection 1 grows; collection 2 is replaced (delete + insert).
            match c
                .append_input(r.id, 1, &payload)
                .and_then(|_| c.replace_inputs(r.id, 2, &payload))
            {
                Ok(_) => {
                    acked.push(i);
                    acked_count2.fetch_add(1, SeqCst);
                    resumed2.store(!failed.is_empty(), SeqCst);
                }
                Err(e) => {
                    assert!(
                        matches!(e, WriteError::Postgres(_)),
                        "a clear store error: {e}"
                    );
                    failed.push(i);
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        (acked, failed, c)
    });
    // The restart comes once writes are going through, and the writer stops
    // once one went through after the restart cut one (both bounded; the
    // assertions below say which did not happen).
    lockstep_pgtest::wait_until(Duration::from_secs(10), || acked_count.load(SeqCst) >= 5);
    match &mut s {
        TestStore::Postgres(pg) => pg.restart().unwrap(),
        TestStore::Sqlite(_) => unreachable!(),
    }
    lockstep_pgtest::wait_until(Duration::from_secs(30), || resumed.load(SeqCst));
    stop.store(true, SeqCst);
    let (acked, failed, mut c) = writer.join().unwrap();
    assert!(!failed.is_empty(), "the restart cut a write");
    let last = *acked.last().unwrap();
    assert!(
        last > *failed.last().unwrap(),
        "writes went on after the restart"
    );
    c.check_fence().unwrap();
    let state = c.state().unwrap();
    let of = |coll: u64| -> Vec<u32> {
        state
            .input_writes
            .iter()
            .filter(|w| w.collection_id == coll)
            .map(|w| u32::from_be_bytes(w.write[..].try_into().unwrap()))
            .collect()
    };
    let grown = of(1);
    for a in &acked {
        assert!(grown.contains(a), "acknowledged write {a} was lost");
    }
    for g in &grown {
        assert!(
            acked.contains(g) || failed.contains(g),
            "write {g} was never made"
        );
    }
    let mut sorted = grown.clone();
    sorted.sort();
    assert_eq!(grown, sorted, "in order");
    assert_eq!(
        of(2),
        vec![last],
        "the replaced collection has exactly one row"
    );
}
