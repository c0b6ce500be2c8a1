use super::*;

fn up(v: i64, time: u64, diff: i64) -> Update {
    Update {
        row: lockstep_plan::row(&[v]),
        time,
        diff,
    }
}

#[test]
fn writes_are_checked_against_the_upper_and_the_magnitude() {
    let mut inputs = Inputs::default();
    assert_eq!(inputs.check(1, 7, &[up(1, 0, 1)], 1), Ok(()));
    inputs.record(1, 7, vec![up(1, 0, i64::MAX - 1)], 1);
    assert_eq!(inputs.upper(1, 7), 1);
    assert!(matches!(
        inputs.check(1, 7, &[], 0),
        Err(WriteRefused::UpperBelow { current: 1, .. })
    ));
    assert!(matches!(
        inputs.check(1, 7, &[up(1, 0, 1)], 2),
        Err(WriteRefused::TimeOutside { time: 0, .. })
    ));
    assert_eq!(inputs.check(1, 7, &[up(2, 1, 1)], 2), Ok(()));
    assert_eq!(
        inputs.check(1, 7, &[up(2, 1, -2)], 2),
        Err(WriteRefused::Overflow { collection: 7 })
    );
    // Another collection and another replica are apart.
    assert_eq!(inputs.check(1, 8, &[up(2, 0, i64::MAX)], 1), Ok(()));
    assert_eq!(inputs.check(2, 7, &[up(2, 0, 1)], 1), Ok(()));
}

#[test]
fn the_catalog_rows_are_replaced_once_the_updates_doubled_and_stay_consolidated() {
    let mut inputs = Inputs::default();
    let mut replaced = 0;
    // One row inserted and retracted at the same time, over and over:
    // the consolidation is empty, the stored updates never are.
    for t in 0..10_000u64 {
        let batch = vec![up(1, t, 1), up(1, t, -1), up(t as i64 % 3, t, 1)];
        if let Some(snapshot) = inputs.record(1, 7, batch, t + 1).snapshot {
            assert!(snapshot.updates.len() <= t as usize + 1);
            inputs.replaced(1, 7);
            replaced += 1;
        }
    }
    let s = &inputs.by_replica[&1][&7];
    assert!((1..=30).contains(&replaced), "{replaced} replacements");
    assert!(
        s.catalog_updates <= 2 * s.snapshot_updates + 1024 + 3,
        "{} stored for {} live",
        s.catalog_updates,
        s.snapshot_updates
    );
    let writes = inputs.writes_of(1);
    assert_eq!(writes.len(), 1);
    assert_eq!(writes[0].upper, 10_000);
    assert_eq!(writes[0].updates.len(), 10_000);
    assert!(writes[0].updates.iter().all(|u| u.diff == 1));
}

#[test]
fn a_collection_that_only_grows_is_never_consolidated_on_a_write() {
    let mut inputs = Inputs::default();
    for t in 0..2_000u64 {
        let batch = (0..10).map(|i| up(i, t, 1)).collect();
        let r = inputs.record(1, 7, batch, t + 1);
        assert!(r.snapshot.is_none(), "rewritten at {t}");
    }
    // A retraction that cancels nothing: still nothing to rewrite.
    let r = inputs.record(1, 7, vec![up(0, 2_000, -1)], 2_001);
    assert!(r.snapshot.is_none());
    // One that cancels: the rows are replaced by fewer.
    let r = inputs.record(1, 7, vec![up(1, 2_001, 1), up(1, 2_001, -1)], 2_002);
    assert_eq!(r.snapshot.expect("replaced").updates.len(), 20_001);
}

#[test]
fn a_reloaded_index_replaces_the_rows_once_they_doubled_the_compacted_updates() {
    // What a catalog holds after many writes that cancel below the since.
    let writes: Vec<(u64, WriteInput)> = (0..100u64)
        .map(|t| {
            let mut updates: Vec<Update> =
                (0..100).map(|i| up(t as i64 * 1000 + i, t, 1)).collect();
            if t >= 2 {
                updates.extend((0..100).map(|i| up((t as i64 - 2) * 1000 + i, t, -1)));
            }
            (
                1,
                WriteInput {
                    collection_id: 7,
                    updates,
                    upper: t + 1,
                    more: false,
                    batch_digest: None,
                },
            )
        })
        .collect();
    let mut inputs = Inputs::load(writes, None);
    inputs.set_lag(Some(4));
    let s = &inputs.by_replica[&1][&7];
    assert!(
        s.snapshot_updates < 2_000,
        "{} compacted",
        s.snapshot_updates
    );
    // The first write after the load replaces the rows.
    let r = inputs.record(1, 7, vec![up(-1, 100, 1)], 101);
    assert!(r.snapshot.is_some());
}

#[test]
fn with_a_lag_inserts_retracted_below_the_since_leave_nothing() {
    assert_eq!(since_for(100, None), 0);
    assert_eq!(since_for(100, Some(16)), 84);
    assert_eq!(since_for(101, Some(16)), 84);
    assert_eq!(since_for(104, Some(16)), 88);
    assert_eq!(since_for(10, Some(16)), 0);
    let mut inputs = Inputs {
        lag: Some(16),
        ..Inputs::default()
    };
    let mut sinces = Vec::new();
    // Batch t inserts 100 rows and retracts those of batch t - 4.
    for t in 0..5_000u64 {
        let mut batch: Vec<Update> = (0..100).map(|i| up(t as i64 * 1000 + i, t, 1)).collect();
        if t >= 4 {
            batch.extend((0..100).map(|i| up((t as i64 - 4) * 1000 + i, t, -1)));
        }
        let r = inputs.record(1, 7, batch, t + 1);
        if r.snapshot.is_some() {
            inputs.replaced(1, 7);
        }
        sinces.extend(r.since);
    }
    assert!(sinces.windows(2).all(|w| w[0] < w[1]), "{sinces:?}");
    assert_eq!(inputs.since(1, 7), since_for(5_000, Some(16)));
    let s = &inputs.by_replica[&1][&7];
    // Live after compaction: the last 4 batches' inserts below the
    // since, plus up to 20 batches between the since and the upper.
    assert!(
        s.catalog_updates <= 2 * (200 * 20) + 1024 + 200,
        "{} updates stored after 5,000 batches",
        s.catalog_updates
    );
    let snapshot = inputs.writes_of(1).remove(0);
    let live: i64 = snapshot.updates.iter().map(|u| u.diff).sum();
    assert_eq!(live, 400, "the last four batches are live");
}

#[test]
fn a_read_hold_keeps_the_since_at_or_below_it_until_released() {
    let mut inputs = Inputs {
        lag: Some(4),
        ..Inputs::default()
    };
    for t in 0..10u64 {
        inputs.record(1, 7, vec![up(t as i64, t, 1)], t + 1);
    }
    assert_eq!(inputs.since(1, 7), 6);
    // Below the since: refused, naming the collection and its since.
    assert_eq!(inputs.hold(1, &[7], 5).unwrap_err(), (7, 6));
    let held = inputs.hold(1, &[7, 8], 6).unwrap();
    for t in 10..50u64 {
        inputs.record(1, 7, vec![up(t as i64, t, 1)], t + 1);
    }
    assert_eq!(inputs.since(1, 7), 6, "held");
    assert_eq!(
        inputs.holds_of(1),
        HoldsReport {
            holds: 1,
            held_span: 46 - 6
        }
    );
    assert_eq!(inputs.holds_of(2), HoldsReport::default());
    inputs.advance_hold(held.id, 30);
    inputs.advance_hold(held.id, 20); // never back
    inputs.record(1, 7, vec![], 51);
    assert_eq!(inputs.since(1, 7), 30);
    inputs.release(held.id);
    inputs.record(1, 7, vec![], 52);
    assert_eq!(inputs.since(1, 7), since_for(52, Some(4)));
    assert_eq!(inputs.holds_of(1), HoldsReport::default());
    assert!(held.broken.borrow().is_none(), "released, not broken");
}

#[test]
fn a_hold_the_lag_passes_by_more_than_the_limit_is_broken_saying_why() {
    let mut inputs = Inputs {
        lag: Some(4),
        ..Inputs::default()
    };
    inputs.set_hold_limit(100);
    let held = inputs.hold(1, &[7], 0).unwrap();
    let other = inputs.hold(1, &[8], 0).unwrap();
    for t in 0..100u64 {
        inputs.record(1, 7, vec![up(t as i64, t, 1)], t + 1);
    }
    assert_eq!(inputs.since(1, 7), 0, "at the limit: still held");
    assert!(held.broken.borrow().is_none());
    inputs.record(1, 7, vec![], 101);
    let why = held.broken.borrow().clone().expect("broken");
    assert!(why.contains("more than 100 times behind"), "{why}");
    assert_eq!(inputs.since(1, 7), since_for(101, Some(4)));
    // The hold on another collection is untouched; dropping the
    // replica breaks it.
    assert!(other.broken.borrow().is_none());
    inputs.drop_replica(1);
    assert_eq!(
        other.broken.borrow().as_deref(),
        Some("the replica was dropped")
    );
    assert_eq!(inputs.holds_of(1), HoldsReport::default());
}

#[test]
fn without_a_lag_holds_hold_nothing_back_and_never_break() {
    let mut inputs = Inputs::default();
    inputs.set_hold_limit(1);
    let held = inputs.hold(1, &[7], 0).unwrap();
    for t in 0..10u64 {
        inputs.record(1, 7, vec![up(t as i64, t, 1)], t + 1);
    }
    assert!(held.broken.borrow().is_none());
    assert_eq!(inputs.holds_of(1).held_span, 0);
}
