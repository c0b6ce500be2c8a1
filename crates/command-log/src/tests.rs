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
            protocol_version: lockstep_protocol::PROTOCOL_VERSION,
            epoch,
            nonce,
            replica_id: 1,
            process_index: 0,
            process_count: 1,
            workers_per_process: 1,
            proof: Vec::new(),
        }),
    )
}

#[test]
fn appends_are_ordered_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.sqlite");
    let mut log = SqliteLog::open(&path).unwrap();
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
    let mut other = SqliteLog::open_reader(&path).unwrap();
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

#[test]
fn start_offset_is_the_newest_marker() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = SqliteLog::open(&dir.path().join("l")).unwrap();
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

#[test]
fn older_epochs_are_fenced_out_and_append_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let mut old = SqliteLog::open(&path).unwrap();
    let mut new = SqliteLog::open(&path).unwrap();
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

#[test]
fn corrupt_entries_are_reported_with_their_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let mut log = SqliteLog::open(&path).unwrap();
    log.append(1, &[hello(1, 1)]).unwrap();
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute(
            "INSERT INTO entries (offset, epoch, marker, command) VALUES (2, 1, 0, x'ffffffff')",
            [],
        )
        .unwrap();
    let err = log.read_from(1, 10).unwrap_err();
    assert!(matches!(err, LogError::Corrupt { offset: 2, .. }), "{err}");
}

#[test]
fn truncation_keeps_offsets_and_is_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let mut log = SqliteLog::open(&path).unwrap();
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

#[test]
fn status_requests_are_forgotten_without_reusing_offsets_and_fenced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l");
    let mut log = SqliteLog::open(&path).unwrap();
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
