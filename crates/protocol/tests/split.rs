//! Writes split per process: every update goes to the process whose worker
//! owns its row, part lists line up, and a worker's history digest over its
//! share equals the controller's over the whole write.

use lockstep_plan::row;
use lockstep_protocol::history::updates_digest;
use lockstep_protocol::{row_owner, CommandHistory, CommandKind, Update, WriteInput};

fn write(n: i64) -> WriteInput {
    WriteInput {
        collection_id: 7,
        updates: (0..n)
            .map(|i| Update {
                row: lockstep_plan::row(&[i, i * 31, 1 << 40]),
                time: 3 + (i as u64 % 2),
                diff: if i % 5 == 0 { -1 } else { 1 },
            })
            .collect(),
        upper: 5,
        more: false,
        batch_digest: None,
    }
}

#[test]
fn the_owner_rule_is_pinned() {
    // The controller and the replica may be built apart: a change of this
    // rule must be a protocol change, so it is pinned here.
    assert_eq!(row_owner(&row(&[]), 8), 7);
    assert_eq!(row_owner(&row(&[0]), 8), 6);
    assert_eq!(row_owner(&row(&[1, 2]), 8), 4);
    assert_eq!(row_owner(&row(&[-1, 7, 3]), 8), 5);
    assert_eq!(row_owner(&row(&[1 << 50, 5]), 8), 6);
    assert_eq!(row_owner(&row(&[1, 2]), 3), 2);
    assert_eq!(row_owner(&row(&[1 << 50, 5]), 3), 0);
}

#[test]
fn rows_spread_over_the_workers() {
    let mut counts = [0usize; 8];
    for i in 0..80_000i64 {
        counts[row_owner(&row(&[i, 10 * i]), 8)] += 1;
    }
    for (w, c) in counts.iter().enumerate() {
        assert!(
            (9_000..11_000).contains(c),
            "worker {w} owns {c} of 80,000 rows"
        );
    }
}

#[test]
fn each_update_goes_to_its_owners_process_once() {
    let whole = write(2_000);
    let (processes, wpp) = (4, 2);
    // Small parts, so that several parts and padding are needed.
    let per_process = whole.clone().split_per_process(processes, wpp, 4_000);
    assert_eq!(per_process.len(), processes);
    let n = per_process[0].len();
    assert!(n > 1, "expected several parts, got {n}");
    let mut seen = Vec::new();
    for (p, parts) in per_process.iter().enumerate() {
        assert_eq!(parts.len(), n, "process {p} has a different part count");
        for (k, part) in parts.iter().enumerate() {
            let last = k + 1 == n;
            assert_eq!(part.more, !last, "process {p} part {k}: more");
            assert_eq!(part.upper, whole.upper);
            assert_eq!(part.collection_id, whole.collection_id);
            assert_eq!(
                part.batch_digest,
                last.then(|| updates_digest(&whole.updates)),
                "process {p} part {k}: only the last part carries the digest"
            );
            for u in &part.updates {
                assert_eq!(row_owner(&u.row, processes * wpp) / wpp, p);
                seen.push(u.clone());
            }
        }
    }
    let key = |u: &Update| (u.row.clone(), u.time, u.diff);
    seen.sort_by_key(key);
    let mut all = whole.updates.clone();
    all.sort_by_key(key);
    assert_eq!(seen, all, "the shares are not a partition of the write");
}

#[test]
fn a_workers_history_over_its_share_matches_the_controllers() {
    let whole = write(1_000);
    let mut controller = CommandHistory::new();
    controller.push(CommandKind::WriteInput(whole.clone()));
    for parts in whole.clone().split_per_process(3, 1, 2_000) {
        // A worker holds the parts and applies them as one write, the last
        // part's fields with every part's updates.
        let mut applied = parts.last().cloned().expect("a part");
        applied.updates = parts.into_iter().flat_map(|p| p.updates).collect();
        let mut worker = CommandHistory::summarizing();
        worker.push(CommandKind::WriteInput(applied.clone()));
        assert_eq!(worker.digest(), controller.digest());
        // Without the whole write's digest, the share alone would differ.
        applied.batch_digest = None;
        let mut alone = CommandHistory::summarizing();
        alone.push(CommandKind::WriteInput(applied));
        assert_ne!(alone.digest(), controller.digest());
    }
}

#[test]
fn a_split_write_round_trips_on_the_wire() {
    let part = write(3)
        .split_per_process(2, 1, 1 << 20)
        .remove(0)
        .remove(0);
    assert!(part.batch_digest.is_some());
    let cmd = lockstep_protocol::Command {
        seqno: 9,
        strategy: lockstep_protocol::Strategy::Barrier,
        kind: CommandKind::WriteInput(part),
    };
    let wire = lockstep_protocol::proto::Command::from(cmd.clone());
    assert_eq!(lockstep_protocol::Command::try_from(wire).unwrap(), cmd);
}

#[test]
fn rows_that_are_not_integers_have_owners_and_digests_of_their_own() {
    // Text rows (another family's): not canonical varints (0x80 and up
    // continue a varint the row ends inside).
    let a = "n1\tn2".as_bytes().to_vec();
    let b = vec![0x80];
    assert!(lockstep_protocol::varint_count(&b).is_none());
    let mut counts = [0usize; 8];
    for i in 0..8_000 {
        counts[row_owner(format!("node-{i}\tnode-{}", i * 7).as_bytes(), 8)] += 1;
    }
    assert!(
        counts.iter().all(|c| (800..1_200).contains(c)),
        "{counts:?}"
    );
    // Each row has its own digest, and a non-canonical encoding of 1 is not
    // the row [1].
    let digest = |row: Vec<u8>| {
        updates_digest(&[Update {
            row,
            time: 0,
            diff: 1,
        }])
    };
    assert_ne!(digest(a.clone()), digest(b.clone()));
    assert_ne!(digest(vec![0x81, 0x00]), digest(row(&[1])));
    assert_eq!(digest(a.clone()), digest(a));
}
