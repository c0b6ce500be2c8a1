use lockstep_protocol::{Command, CommandKind, Hello, Strategy};

use super::*;

fn cmd(seqno: u64, kind: CommandKind) -> Command {
    Command {
        seqno,
        strategy: Strategy::Log,
        kind,
    }
}

fn hello(epoch: u64, nonce: u64) -> Command {
    cmd(
        0,
        CommandKind::Hello(Hello {
            protocol_version: lockstep_protocol::MIN_PROTOCOL_VERSION,
            epoch,
            nonce,
            replica_id: 1,
            process_index: 0,
            process_count: 1,
            workers_per_process: 1,
            proof: Vec::new(),
            max_protocol_version: lockstep_protocol::PROTOCOL_VERSION,
        }),
    )
}

fn appends_are_ordered_and_read_back(s: &TestLog) {
    let mut log = s.open();
    assert_eq!(log.start_offset().unwrap(), 1);
    let last = log
        .append(
            1,
            &[hello(1, 1), cmd(1, CommandKind::InitializationComplete)],
        )
        .unwrap();
    assert_eq!(last, 2);
    let last = log
        .append(1, &[cmd(2, CommandKind::StatusRequest { full: false })])
        .unwrap();
    assert_eq!(last, 3);
    // A reader (another process) sees the same entries in order.
    let mut other = s.reader();
    let entries = other.read_from(1, 10).unwrap();
    assert_eq!(
        entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(entries[2].command.seqno, 2);
    assert_eq!(other.read_from(3, 10).unwrap().len(), 1);
    assert_eq!(other.read_from(2, 1).unwrap().len(), 1);
    assert!(other.read_from(4, 10).unwrap().is_empty());
}

fn start_offset_is_the_newest_marker(s: &TestLog) {
    let mut log = s.open();
    log.append(
        1,
        &[hello(1, 1), cmd(1, CommandKind::InitializationComplete)],
    )
    .unwrap();
    log.append(
        2,
        &[hello(2, 1), cmd(1, CommandKind::InitializationComplete)],
    )
    .unwrap();
    assert_eq!(log.start_offset().unwrap(), 3);
}

fn older_epochs_are_fenced_out_and_append_nothing(s: &TestLog) {
    let mut old = s.open();
    let mut new = s.open();
    old.append(1, &[hello(1, 1)]).unwrap();
    new.append(2, &[hello(2, 1)]).unwrap();
    let err = old
        .append(1, &[cmd(5, CommandKind::InitializationComplete)])
        .unwrap_err();
    assert!(
        matches!(
            err,
            LogError::Fenced {
                epoch: 1,
                newest: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(new.read_from(1, 10).unwrap().len(), 2);
    // The same epoch may keep appending (a reconnect within one controller).
    new.append(2, &[hello(2, 2)]).unwrap();
}

#[test]
fn foreign_files_are_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("other.sqlite");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("CREATE TABLE users (name TEXT); INSERT INTO users VALUES ('x');")
            .unwrap();
    }
    let before = std::fs::read(&path).unwrap();
    let err = SqliteLog::open(&path).unwrap_err();
    assert!(
        err.to_string().contains("not a lockstep command log"),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before);

    let garbage = dir.path().join("garbage");
    std::fs::write(&garbage, b"this is not sqlite at all, not even close......").unwrap();
    let err = SqliteLog::open(&garbage).unwrap_err();
    assert!(err.to_string().contains("garbage"), "{err}");
}

fn corrupt_entries_are_reported_with_their_offset(s: &TestLog) {
    let mut log = s.open();
    log.append(1, &[hello(1, 1)]).unwrap();
    s.insert_garbage_at(2);
    let err = log.read_from(1, 10).unwrap_err();
    assert!(matches!(err, LogError::Corrupt { offset: 2, .. }), "{err}");
}

fn truncation_keeps_offsets_and_is_fenced(s: &TestLog) {
    let mut log = s.open();
    log.append(
        1,
        &[hello(1, 1), cmd(1, CommandKind::InitializationComplete)],
    )
    .unwrap();
    log.append(
        1,
        &[hello(1, 2), cmd(1, CommandKind::InitializationComplete)],
    )
    .unwrap();
    assert_eq!(log.truncate_before(1, 3).unwrap(), 2);
    assert_eq!(log.read_from(1, 10).unwrap()[0].offset, 3);
    assert_eq!(log.start_offset().unwrap(), 3);
    // New entries continue the numbering, even after everything went.
    assert_eq!(log.truncate_before(1, 5).unwrap(), 2);
    assert_eq!(log.append(1, &[hello(1, 3)]).unwrap(), 5);
    // A newer epoch fences truncation too.
    log.append(2, &[hello(2, 1)]).unwrap();
    assert!(matches!(
        log.truncate_before(1, 6),
        Err(LogError::Fenced { .. })
    ));
    assert_eq!(log.read_from(1, 10).unwrap().len(), 2);
}

fn status_requests_are_forgotten_without_reusing_offsets_and_fenced(s: &TestLog) {
    let mut log = s.open();
    let status = |seqno| cmd(seqno, CommandKind::StatusRequest { full: false });
    log.append(
        1,
        &[
            hello(1, 1),
            status(1),
            cmd(2, CommandKind::InitializationComplete),
        ],
    )
    .unwrap();
    assert_eq!(log.append(1, &[status(3), status(4)]).unwrap(), 5);
    // Offsets 2, 4 and 5 are status requests; the newest goes too.
    assert_eq!(log.forget_status_requests(1, 5).unwrap(), 3);
    let left: Vec<u64> = log
        .read_from(1, 10)
        .unwrap()
        .iter()
        .map(|e| e.offset)
        .collect();
    assert_eq!(left, vec![1, 3]);
    assert_eq!(log.start_offset().unwrap(), 1);
    // A reader past offset 5 must see the next entry: no offset is reused.
    assert_eq!(log.append(1, &[status(5)]).unwrap(), 6);
    log.append(2, &[hello(2, 1)]).unwrap();
    assert!(matches!(
        log.forget_status_requests(1, 6),
        Err(LogError::Fenced { .. })
    ));
    assert_eq!(log.read_from(6, 10).unwrap().len(), 2);
}

#[test]
fn readers_need_an_existing_log() {
    let dir = tempfile::tempdir().unwrap();
    let err = SqliteLog::open_reader(&dir.path().join("missing")).unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    let other = dir.path().join("other.sqlite");
    rusqlite::Connection::open(&other)
        .unwrap()
        .execute_batch("CREATE TABLE users (name TEXT);")
        .unwrap();
    let err = SqliteLog::open_reader(&other).unwrap_err();
    assert!(
        err.to_string().contains("not a lockstep command log"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------
// One body, two backends.

use std::time::{Duration, Instant};

use lockstep_pgtest::PgServer;

/// A fresh, empty store of one backend for one test.
enum TestLog {
    Sqlite(tempfile::TempDir),
    Postgres(PgServer),
}

impl TestLog {
    fn sqlite() -> TestLog {
        TestLog::Sqlite(tempfile::tempdir().unwrap())
    }

    /// A throw-away server of its own: tests run in parallel and some
    /// restart theirs.
    fn postgres() -> TestLog {
        assert!(
            PgServer::available(),
            "no PostgreSQL binaries (install the postgresql package)"
        );
        TestLog::Postgres(PgServer::start().unwrap())
    }

    fn location(&self) -> LogLocation {
        match self {
            TestLog::Sqlite(dir) => LogLocation::Sqlite(dir.path().join("log.sqlite")),
            TestLog::Postgres(pg) => LogLocation::Postgres {
                url: pg.url(),
                name: "r1".into(),
            },
        }
    }

    fn open(&self) -> AnyLog {
        AnyLog::open(&self.location()).unwrap()
    }

    fn reader(&self) -> AnyLog {
        AnyLog::open_reader(&self.location()).unwrap()
    }

    fn server(&self) -> &PgServer {
        match self {
            TestLog::Postgres(pg) => pg,
            TestLog::Sqlite(_) => panic!("not a PostgreSQL store"),
        }
    }

    /// Stores an entry that does not decode at `offset`.
    fn insert_garbage_at(&self, offset: u64) {
        match self {
            TestLog::Sqlite(dir) => {
                rusqlite::Connection::open(dir.path().join("log.sqlite"))
                    .unwrap()
                    .execute(
                        "INSERT INTO entries (offset, epoch, marker, command) VALUES (?1, 1, 0, x'ffffffff')",
                        [offset as i64],
                    )
                    .unwrap();
            }
            TestLog::Postgres(pg) => {
                pg.psql(
                    DB,
                    &format!(
                        "INSERT INTO command_log_entries VALUES ('r1', {offset}, 1, 0, '\\xffffffff'::bytea)"
                    ),
                )
                .unwrap();
            }
        }
    }
}

lockstep_pgtest::on_both_backends!(
    TestLog;
    appends_are_ordered_and_read_back,
    start_offset_is_the_newest_marker,
    older_epochs_are_fenced_out_and_append_nothing,
    corrupt_entries_are_reported_with_their_offset,
    truncation_keeps_offsets_and_is_fenced,
    status_requests_are_forgotten_without_reusing_offsets_and_fenced,
    a_waiting_reader_is_woken_by_an_append,
    concurrent_appenders_get_consecutive_offsets,
);

/// A reader waiting with a 30 s bound is woken by an append from another
/// handle long before it, and then reads the new entry.
fn a_waiting_reader_is_woken_by_an_append(s: &TestLog) {
    let mut writer = s.open();
    writer.append(1, &[hello(1, 1)]).unwrap();
    let mut reader = s.reader();
    assert_eq!(reader.read_from(1, 10).unwrap().len(), 1);
    // Nothing new: a zero wait only checks, a short wait times out.
    assert!(!reader.wait_for_append(Duration::ZERO).unwrap());
    let t = Instant::now();
    assert!(!reader.wait_for_append(Duration::from_millis(200)).unwrap());
    assert!(t.elapsed() >= Duration::from_millis(200));
    let appender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let at = Instant::now();
        writer
            .append(1, &[cmd(1, CommandKind::InitializationComplete)])
            .unwrap();
        at
    });
    let t = Instant::now();
    let woken = reader.wait_for_append(Duration::from_secs(30)).unwrap();
    let waited = t.elapsed();
    let appended_at = appender.join().unwrap();
    assert!(woken, "woken by the append, not by the bound");
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    eprintln!(
        "woken {:?} after the append started",
        Instant::now().saturating_duration_since(appended_at)
    );
    let entries = reader.read_from(2, 10).unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(entries[0].command.kind, CommandKind::InitializationComplete);
    // An append between a read and the next wait is not missed.
    let mut writer = s.open();
    writer.append(1, &[hello(1, 2)]).unwrap();
    let t = Instant::now();
    assert!(reader.wait_for_append(Duration::from_secs(30)).unwrap());
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// Two writers of one epoch appending at once (two controllers' handles of
/// one replica's log): every batch gets its own consecutive offsets, none
/// is lost or numbered twice, and each append returns its batch's last.
fn concurrent_appenders_get_consecutive_offsets(s: &TestLog) {
    const BATCHES: u64 = 40;
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let mut log = s.open();
            std::thread::spawn(move || {
                (0..BATCHES)
                    .map(|i| {
                        let seqno = w * 1_000 + i * 2;
                        let last = log
                            .append(
                                1,
                                &[
                                    cmd(seqno, CommandKind::InitializationComplete),
                                    cmd(seqno + 1, CommandKind::InitializationComplete),
                                ],
                            )
                            .unwrap();
                        (last, seqno)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let appended: Vec<(u64, u64)> = writers
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let entries = s.reader().read_from(1, 1_000).unwrap();
    let offsets: Vec<u64> = entries.iter().map(|e| e.offset).collect();
    assert_eq!(offsets, (1..=4 * BATCHES).collect::<Vec<_>>());
    for (last, seqno) in appended {
        let at = |o: u64| &entries[(o - 1) as usize].command;
        assert_eq!((at(last - 1).seqno, at(last).seqno), (seqno, seqno + 1));
    }
}

// ---------------------------------------------------------------------------
// PostgreSQL only.

const DB: &str = lockstep_pgtest::DATABASE;

#[test]
fn locations_parse_and_hide_passwords() {
    let l: LogLocation = "postgres://u:pw@h:5/db#r-1".parse().unwrap();
    assert_eq!(
        l,
        LogLocation::Postgres {
            url: "postgres://u:pw@h:5/db".into(),
            name: "r-1".into()
        }
    );
    assert_eq!(l.to_string(), "postgres://u@h:5/db#r-1");
    assert!(!format!("{l:?}").contains("pw"));
    assert!("postgres://h/db".parse::<LogLocation>().is_err(), "no name");
    assert!("postgres://h/db#Bad".parse::<LogLocation>().is_err());
    assert_eq!(
        "/state/log.sqlite".parse::<LogLocation>().unwrap(),
        LogLocation::Sqlite("/state/log.sqlite".into())
    );
}

#[test]
fn postgres_logs_of_many_replicas_share_a_database() {
    let pg = PgServer::start().unwrap();
    let mut a = PgLog::open(&pg.url(), "a").unwrap();
    let mut b = PgLog::open(&pg.url(), "b").unwrap();
    assert_eq!(a.append(1, &[hello(1, 1), hello(1, 2)]).unwrap(), 2);
    assert_eq!(b.append(7, &[hello(7, 1)]).unwrap(), 1);
    // Fencing is per log: epoch 7 on b does not fence epoch 1 on a.
    assert_eq!(a.append(1, &[hello(1, 3)]).unwrap(), 3);
    assert_eq!(b.read_from(1, 10).unwrap().len(), 1);
    assert_eq!(a.read_from(1, 10).unwrap().len(), 3);
    // A reader needs an existing log of this format.
    let err = PgLog::open_reader(&pg.url(), "c").unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    let other = pg.new_database("empty").unwrap();
    let err = PgLog::open_reader(&other, "a").unwrap_err();
    assert!(
        err.to_string().contains("not a lockstep command log"),
        "{err}"
    );
    // A newer format is refused, by writers and readers, and left alone.
    pg.psql(
        DB,
        "UPDATE lockstep_schema SET version = 2 WHERE component = 'command_log'",
    )
    .unwrap();
    for err in [
        PgLog::open(&pg.url(), "a").unwrap_err(),
        PgLog::open_reader(&pg.url(), "a").unwrap_err(),
    ] {
        assert!(matches!(err, LogError::Format { .. }), "{err}");
        assert!(err.to_string().contains("format 2"), "{err}");
    }
    assert_eq!(
        pg.psql(DB, "SELECT count(*) FROM command_log_entries")
            .unwrap(),
        "4"
    );
}

/// An append blocked in the server whose backend is terminated fails
/// promptly with an error and appends nothing; the next append reconnects.
#[test]
fn postgres_terminated_backend_fails_the_append_without_a_hang() {
    let s = TestLog::postgres();
    let mut log = s.open();
    log.append(1, &[hello(1, 1)]).unwrap();
    let holder = lockstep_pg::Conn::connect(&s.server().url(), Default::default()).unwrap();
    holder
        .run(|x: &mut lockstep_pg::Session| {
            Box::pin(async move {
                x.client
                    .batch_execute(
                        "BEGIN; SELECT epoch FROM command_log_fence WHERE log = 'r1' FOR UPDATE",
                    )
                    .await?;
                Ok::<_, lockstep_pg::PgError>(())
            })
        })
        .unwrap();
    let url = s.server().url();
    let killer = std::thread::spawn(move || {
        let k = lockstep_pg::Conn::connect(&url, Default::default()).unwrap();
        let started = Instant::now();
        loop {
            let killed: i64 = k
                .run(|x: &mut lockstep_pg::Session| {
                    Box::pin(async move {
                        let row = x
                            .client
                            .query_one(
                                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                                 WHERE application_name = 'lockstep-log-r1' \
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
    let started = Instant::now();
    let err = log.append(1, &[hello(1, 2), hello(1, 3)]).unwrap_err();
    killer.join().unwrap();
    assert!(matches!(err, LogError::Postgres { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    drop(holder);
    assert_eq!(
        log.append(1, &[hello(1, 4)]).unwrap(),
        2,
        "nothing appended"
    );
    let nonces: Vec<u64> = log
        .read_from(1, 10)
        .unwrap()
        .iter()
        .map(|e| match &e.command.kind {
            CommandKind::Hello(h) => h.nonce,
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(nonces, vec![1, 4]);
}

/// The server restarts while a writer appends batches and a reader tails:
/// acknowledged batches survive, a batch in flight is entirely there or
/// entirely absent, offsets stay consecutive, errors are errors (not hangs),
/// and both handles reconnect.
#[test]
fn postgres_server_restart_mid_append_keeps_acknowledged_batches() {
    let mut s = TestLog::postgres();
    let mut log = s.open();
    let mut reader = s.reader();
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    // How many appends were acknowledged, and whether one was after a failure.
    let acked_count = std::sync::Arc::new(AtomicUsize::new(0));
    let resumed = std::sync::Arc::new(AtomicBool::new(false));
    let (stop2, acked_count2, resumed2) = (stop.clone(), acked_count.clone(), resumed.clone());
    let writer = std::thread::spawn(move || {
        let (mut acked, mut failed) = (Vec::new(), Vec::new());
        let mut batch: u64 = 0;
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
            batch += 1;
            let commands: Vec<Command> = (0..3)
                .map(|k| cmd(batch * 3 + k, CommandKind::InitializationComplete))
                .collect();
            match log.append(1, &commands) {
                Ok(_) => {
                    acked.push(batch);
                    acked_count2.fetch_add(1, SeqCst);
                    resumed2.store(!failed.is_empty(), SeqCst);
                }
                Err(e) => {
                    assert!(matches!(e, LogError::Postgres { .. }), "{e}");
                    failed.push(batch);
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        (acked, failed, log)
    });
    // The restart comes once appends are going through (bounded; the
    // assertions below say what did not happen).
    lockstep_pgtest::wait_until(Duration::from_secs(10), || acked_count.load(SeqCst) >= 5);
    match &mut s {
        TestLog::Postgres(pg) => pg.restart().unwrap(),
        TestLog::Sqlite(_) => unreachable!(),
    }
    // The reader is woken by the lost connection, and reads again.
    assert!(reader.wait_for_append(Duration::from_secs(10)).unwrap());
    lockstep_pgtest::wait_until(Duration::from_secs(30), || resumed.load(SeqCst));
    stop.store(true, SeqCst);
    let (acked, failed, _log) = writer.join().unwrap();
    assert!(!failed.is_empty(), "the restart cut an append");
    assert!(
        acked.last() > failed.last(),
        "appends went on after the restart"
    );
    let mut entries = Vec::new();
    for _ in 0..3 {
        match reader.read_from(1, 100_000) {
            Ok(e) => {
                entries = e;
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let offsets: Vec<u64> = entries.iter().map(|e| e.offset).collect();
    assert_eq!(offsets, (1..=entries.len() as u64).collect::<Vec<_>>());
    let mut batches = std::collections::BTreeMap::<u64, u64>::new();
    for e in &entries {
        *batches.entry(e.command.seqno / 3).or_default() += 1;
    }
    for (b, n) in &batches {
        assert_eq!(*n, 3, "batch {b} is whole");
        assert!(acked.contains(b) || failed.contains(b));
    }
    for a in &acked {
        assert!(batches.contains_key(a), "acknowledged batch {a} was lost");
    }
}
