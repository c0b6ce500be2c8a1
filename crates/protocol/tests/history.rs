//! History compaction and the history digest.

use lockstep_protocol::*;

fn dataflow(id: u64, collection: u64) -> DataflowDescription {
    DataflowDescription {
        id,
        as_of: 0,
        inputs: vec![1],
        exports: vec![Export {
            collection_id: collection,
            description: vec![0x0a, 0x02, 0x08, 0x01],
        }],
        debug_name: format!("df{id}"),
        format: DEFAULT_FORMAT.into(),
    }
}

fn write(updates: &[(i64, u64, i64)], upper: u64) -> CommandKind {
    CommandKind::WriteInput(WriteInput {
        collection_id: 1,
        updates: updates
            .iter()
            .map(|&(v, time, diff)| Update {
                row: lockstep_plan::row(&[v]),
                time,
                diff,
            })
            .collect(),
        upper,
        more: false,
        batch_digest: None,
    })
}

fn reduced(cmds: Vec<CommandKind>) -> Vec<CommandKind> {
    let mut h = CommandHistory::new();
    for c in cmds {
        h.push(c);
    }
    h.reduce();
    h.commands().to_vec()
}

#[test]
fn created_then_dropped_dataflow_vanishes() {
    let got = reduced(vec![
        CommandKind::CreateInstance(Default::default()),
        CommandKind::CreateDataflow(dataflow(10, 100)),
        CommandKind::Schedule { dataflow_id: 10 },
        CommandKind::AllowCompaction {
            collection_id: 100,
            frontier: Some(3),
        },
        CommandKind::Subscribe(Subscribe {
            subscribe_id: 1,
            collection_id: 100,
            as_of: 0,
        }),
        CommandKind::CreateDataflow(dataflow(11, 101)),
        CommandKind::AllowCompaction {
            collection_id: 100,
            frontier: None,
        },
    ]);
    assert_eq!(
        got,
        vec![
            CommandKind::CreateInstance(Default::default()),
            CommandKind::CreateDataflow(dataflow(11, 101)),
        ]
    );
}

#[test]
fn only_the_last_compaction_stays() {
    let got = reduced(vec![
        CommandKind::CreateDataflow(dataflow(10, 100)),
        CommandKind::AllowCompaction {
            collection_id: 100,
            frontier: Some(3),
        },
        CommandKind::AllowCompaction {
            collection_id: 100,
            frontier: Some(7),
        },
    ]);
    assert_eq!(
        got,
        vec![
            CommandKind::CreateDataflow(dataflow(10, 100)),
            CommandKind::AllowCompaction {
                collection_id: 100,
                frontier: Some(7)
            },
        ]
    );
}

#[test]
fn peeks_retire_when_answered_or_canceled() {
    let peek = |id| {
        CommandKind::Peek(Peek {
            peek_id: id,
            collection_id: 100,
            timestamp: 1,
        })
    };
    let mut h = CommandHistory::new();
    h.push(CommandKind::CreateDataflow(dataflow(10, 100)));
    h.push(peek(1));
    h.push(peek(2));
    h.push(peek(3));
    h.push(CommandKind::CancelPeek { peek_id: 2 });
    h.retire_peek(1);
    h.reduce();
    assert_eq!(
        h.commands(),
        &[CommandKind::CreateDataflow(dataflow(10, 100)), peek(3)]
    );
}

#[test]
fn configuration_updates_merge() {
    let cfg = |pairs: &[(&str, &str)]| {
        CommandKind::UpdateConfiguration(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    };
    let got = reduced(vec![
        cfg(&[("a", "1"), ("b", "1")]),
        CommandKind::CreateDataflow(dataflow(10, 100)),
        cfg(&[("b", "2"), ("c", "3")]),
    ]);
    assert_eq!(
        got,
        vec![
            cfg(&[("a", "1"), ("b", "2"), ("c", "3")]),
            CommandKind::CreateDataflow(dataflow(10, 100)),
        ]
    );
}

#[test]
fn writes_consolidate() {
    let got = reduced(vec![
        write(&[(1, 0, 1), (2, 0, 1)], 1),
        write(&[(1, 0, -1), (3, 1, 2)], 2),
    ]);
    assert_eq!(got, vec![write(&[(2, 0, 1), (3, 1, 2)], 2)]);
}

#[test]
fn hello_and_status_requests_are_not_history() {
    let mut h = CommandHistory::new();
    h.push(CommandKind::StatusRequest { full: true });
    h.push(CommandKind::Hello(Hello {
        protocol_version: 1,
        epoch: 1,
        nonce: 1,
        replica_id: 1,
        process_index: 0,
        process_count: 1,
        workers_per_process: 1,
        proof: Vec::new(),
        max_protocol_version: 0,
    }));
    assert!(h.is_empty());
}

#[test]
fn equal_histories_hash_equal_different_ones_differ() {
    let a = |extra: bool| {
        let mut h = CommandHistory::new();
        h.push(CommandKind::CreateInstance(Default::default()));
        h.push(CommandKind::CreateDataflow(dataflow(10, 100)));
        if extra {
            // Created then dropped: compacts away, so the digest is unchanged.
            h.push(CommandKind::CreateDataflow(dataflow(11, 101)));
            h.push(CommandKind::AllowCompaction {
                collection_id: 101,
                frontier: None,
            });
        }
        h
    };
    assert_eq!(a(false).digest(), a(true).digest());

    let mut b = a(false);
    b.push(CommandKind::CreateDataflow(dataflow(12, 102)));
    assert_ne!(a(false).digest(), b.digest());

    // Order matters: timely needs the same creation order everywhere.
    let mut c1 = CommandHistory::new();
    c1.push(CommandKind::CreateDataflow(dataflow(1, 100)));
    c1.push(CommandKind::CreateDataflow(dataflow(2, 101)));
    let mut c2 = CommandHistory::new();
    c2.push(CommandKind::CreateDataflow(dataflow(2, 101)));
    c2.push(CommandKind::CreateDataflow(dataflow(1, 100)));
    assert_ne!(c1.digest(), c2.digest());

    // The partial drop: one process saw build+drop, the other only build.
    let mut p1 = CommandHistory::new();
    p1.push(CommandKind::CreateDataflow(dataflow(1, 100)));
    p1.push(CommandKind::AllowCompaction {
        collection_id: 100,
        frontier: None,
    });
    let mut p2 = CommandHistory::new();
    p2.push(CommandKind::CreateDataflow(dataflow(1, 100)));
    assert_ne!(p1.digest(), p2.digest());
}

#[test]
fn description_hash_is_stable_and_sensitive() {
    assert_eq!(dataflow(1, 100).hash(), dataflow(1, 100).hash());
    assert_ne!(dataflow(1, 100).hash(), dataflow(1, 101).hash());
}

#[test]
fn long_histories_stay_small() {
    let mut h = CommandHistory::new();
    for i in 0..10_000u64 {
        h.push(CommandKind::CreateDataflow(dataflow(i, 1000 + i)));
        h.push(CommandKind::AllowCompaction {
            collection_id: 1000 + i,
            frontier: None,
        });
    }
    assert!(h.len() < 100, "history holds {} commands", h.len());
}

/// The input digest as specified (and as v0.2.0 computed it, one BLAKE3
/// update per field): for a row of canonical varints, its values as 8-byte
/// little-endian words, their count, the time; for any other row, under the
/// derived key, its bytes, their length, the time. Each update adds its hash
/// times its diff, in four wrapping lanes.
fn digest_as_specified(updates: &[Update]) -> [u64; 4] {
    let mut sum = [0u64; 4];
    for u in updates {
        let mut h = match varint_count(&u.row) {
            Some(n) => {
                let mut h = blake3::Hasher::new();
                for v in varint_values(&u.row) {
                    h.update(&v.to_le_bytes());
                }
                h.update(&(n as u64).to_le_bytes());
                h
            }
            None => {
                let mut h = blake3::Hasher::new_derive_key("lockstep 2026 opaque row digest");
                h.update(&u.row);
                h.update(&(u.row.len() as u64).to_le_bytes());
                h
            }
        };
        h.update(&u.time.to_le_bytes());
        let hash = h.finalize();
        for (lane, chunk) in sum.iter_mut().zip(hash.as_bytes().chunks_exact(8)) {
            let x = u64::from_le_bytes(chunk.try_into().unwrap());
            *lane = lane.wrapping_add(x.wrapping_mul(u.diff as u64));
        }
    }
    sum
}

#[test]
fn the_input_digest_hashes_what_it_specifies() {
    let rows: Vec<Vec<u8>> = vec![
        lockstep_plan::row(&[]),
        lockstep_plan::row(&[0]),
        lockstep_plan::row(&[1, 2, 3]),
        lockstep_plan::row(&[-1, i64::MIN, i64::MAX, 127, 128, 300]),
        lockstep_plan::row(&(0..40).collect::<Vec<i64>>()),
        b"a\tb".to_vec(),
        vec![0x81, 0x00], // 1, not canonically encoded: an opaque row
        vec![0xff; 11],   // no varint at all
    ];
    let updates: Vec<Update> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| Update {
            row: row.clone(),
            time: i as u64 * 7,
            diff: i as i64 - 3,
        })
        .collect();
    for u in &updates {
        assert_eq!(
            history::updates_digest(std::slice::from_ref(u)),
            digest_as_specified(std::slice::from_ref(u)),
            "row {:?}",
            u.row
        );
    }
    assert_eq!(
        history::updates_digest(&updates),
        digest_as_specified(&updates)
    );
    assert_ne!(history::updates_digest(&updates), [0; 4]);
}

#[test]
fn rows_consolidate_in_the_order_of_their_values_then_bytes() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut values: Vec<Vec<i64>> = vec![vec![], vec![0], vec![-1], vec![i64::MIN], vec![i64::MAX]];
    for _ in 0..200 {
        let len = (next() % 4) as usize;
        values.push(
            (0..len)
                .map(|_| match next() % 3 {
                    0 => (next() % 300) as i64,
                    1 => -((next() % 300) as i64),
                    _ => next() as i64,
                })
                .collect(),
        );
    }
    let mut rows: Vec<Vec<u8>> = values.iter().map(|v| lockstep_plan::row(v)).collect();
    rows.extend([
        b"a\tb".to_vec(),
        vec![0x81, 0x00],
        vec![0xff; 11],
        vec![0x05, 0x80],
    ]);
    for a in &rows {
        for b in &rows {
            let expected = varint_values(a)
                .cmp(varint_values(b))
                .then_with(|| a.cmp(b));
            assert_eq!(history::row_order(a, b), expected, "{a:02x?} {b:02x?}");
        }
    }
    // Integer rows: numeric order, as when rows were integer vectors.
    for (va, a) in values.iter().zip(&rows) {
        for (vb, b) in values.iter().zip(&rows) {
            assert_eq!(history::row_order(a, b), va.cmp(vb), "{va:?} {vb:?}");
        }
    }
}
