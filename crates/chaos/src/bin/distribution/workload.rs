//! What every scenario runs and checks: the writes and the dataflows (D1,
//! D2, X, Y) with their histories, the failpoint that crashes the
//! controller part-way through a broadcast, and the check of I1 to I4.
//!
//! The dataflows are written in the variant's family: plans of the built-in
//! language, or roots of the reachability family (`examples/reachability`);
//! the writes are the same pairs in either, encoded as the family's rows
//! (two integers, or an edge between nodes named by them); each family's
//! own reference says what a peek must answer.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lockstep_chaos::outcome::{violation, Failure};
use lockstep_controller::Controller;
use lockstep_example_reachability as reachability;
use lockstep_plan::reference::evaluate;
use lockstep_plan::text::parse_plan;
use lockstep_protocol::{CommandHistory, CommandKind, DataflowDescription, Export, Row, Update};

use super::variant::{Family, Variant};

pub(crate) const LAST_TIME: u64 = 3;
pub(crate) const FAILPOINT: &str = "controller_partial_broadcast";

/// The writes, as `(collection, [(pair, time, diff)], upper)`.
type Writes = Vec<(u64, Vec<([i64; 2], u64, i64)>, u64)>;

fn u(row: [i64; 2], time: u64, diff: i64) -> ([i64; 2], u64, i64) {
    (row, time, diff)
}

/// The writes with their rows in the variant's family.
fn writes(s: Variant) -> Vec<(u64, Vec<Update>, u64)> {
    let row = |[a, b]: [i64; 2]| match s.family {
        Family::Plan => lockstep_plan::row(&[a, b]),
        Family::Reachability => reachability::edge(&a.to_string(), &b.to_string()),
    };
    pairs()
        .into_iter()
        .map(|(c, ups, upper)| {
            let ups = ups
                .into_iter()
                .map(|(pair, time, diff)| Update {
                    row: row(pair),
                    time,
                    diff,
                })
                .collect();
            (c, ups, upper)
        })
        .collect()
}

fn pairs() -> Writes {
    vec![
        (
            1,
            vec![u([1, 10], 0, 1), u([2, 20], 0, 1), u([3, 30], 0, 1)],
            1,
        ),
        (2, vec![u([1, 100], 0, 1), u([2, 200], 0, 1)], 1),
        (1, vec![u([1, 10], 1, -1), u([1, 11], 1, 1)], 2),
        (2, vec![u([3, 300], 2, 2)], 3),
        (1, vec![u([4, 40], 3, 1)], LAST_TIME + 1),
        (2, vec![u([2, 200], 3, -1)], LAST_TIME + 1),
    ]
}

fn dataflow(id: u64, plan: &str) -> DataflowDescription {
    lockstep_plan::dataflow(
        id,
        0,
        vec![1, 2],
        &[(1000 + id, parse_plan(plan).expect("a valid plan"))],
        format!("chaos-{id}"),
    )
}

/// A reachability dataflow: the distances from `root` over the edges of
/// `input`.
fn distances(id: u64, input: u64, root: &str) -> DataflowDescription {
    DataflowDescription {
        id,
        as_of: 0,
        inputs: vec![input],
        exports: vec![reachability::describe(1000 + id, root)],
        debug_name: format!("chaos-{id}"),
        format: reachability::FORMAT.into(),
    }
}

pub(crate) fn d1(s: Variant) -> DataflowDescription {
    match s.family {
        Family::Plan => dataflow(1, "join(get(1), get(2), #0, #0)"),
        Family::Reachability => distances(1, 1, "1"),
    }
}
pub(crate) fn d2(s: Variant) -> DataflowDescription {
    match s.family {
        Family::Plan => dataflow(2, "reduce(get(1), [#0], count, sum(#1))"),
        Family::Reachability => distances(2, 2, "1"),
    }
}
pub(crate) fn x(s: Variant) -> DataflowDescription {
    match s.family {
        Family::Plan => dataflow(3, "reduce(get(2), [#1], count)"),
        Family::Reachability => distances(3, 2, "3"),
    }
}
pub(crate) fn y(s: Variant) -> DataflowDescription {
    match s.family {
        Family::Plan => dataflow(4, "filter(get(1), #1 > 10)"),
        Family::Reachability => distances(4, 1, "4"),
    }
}

/// What export `e` of `d` holds at `t` by its family's reference.
fn reference(
    s: Variant,
    d: &DataflowDescription,
    e: &Export,
    inputs: &BTreeMap<u64, Vec<Update>>,
    t: u64,
) -> Result<BTreeMap<Row, i64>, Failure> {
    let own = |err: String| Failure::Harness(format!("the workload's own dataflow: {err}"));
    Ok(match s.family {
        Family::Plan => {
            let plan = lockstep_plan::decode(e.collection_id, &e.description)
                .map_err(|err| own(err.to_string()))?;
            evaluate(&plan, inputs, t)
        }
        Family::Reachability => {
            let root = reachability::root(e).map_err(|err| own(err.to_string()))?;
            let edges = inputs.get(&d.inputs[0]).cloned().unwrap_or_default();
            reachability::reference(&edges, &root, t)
                .into_iter()
                .map(|row| (row, 1))
                .collect()
        }
    })
}

/// A history: every write, then these dataflows.
pub(crate) fn history(s: Variant, dataflows: &[DataflowDescription]) -> CommandHistory {
    let mut h = CommandHistory::new();
    h.push(CommandKind::CreateInstance(Default::default()));
    for (c, ups, upper) in writes(s) {
        h.push(CommandKind::WriteInput(lockstep_protocol::WriteInput {
            collection_id: c,
            updates: ups,
            upper,
            more: false,
            batch_digest: None,
        }));
    }
    for d in dataflows {
        h.push(CommandKind::CreateDataflow(d.clone()));
    }
    h
}

/// Checks I1 to I4 against `target`: a broken invariant is a violation.
pub(crate) async fn check(
    s: Variant,
    c: &Controller,
    target: &[DataflowDescription],
) -> Result<(), Failure> {
    for d in target {
        for e in &d.exports {
            c.wait_for_frontier(e.collection_id, LAST_TIME)
                .await
                .map_err(|err| {
                    violation(
                        "I2",
                        format!("dataflow {} did not reach time {LAST_TIME}: {err}", d.id),
                    )
                })?;
        }
    }
    let statuses = c
        .statuses()
        .await
        .map_err(|e| violation("I2", format!("no status from every worker: {e}")))?;
    let logs = lockstep_reconcile::creation_logs(&statuses);
    lockstep_reconcile::lockstep_check(&logs).map_err(|d| violation("I1", d.to_string()))?;
    let want: BTreeSet<u64> = target.iter().map(|d| d.id).collect();
    for s in &statuses {
        let got: BTreeSet<u64> = s.installed.iter().copied().collect();
        if got != want {
            return Err(violation(
                "I4",
                format!(
                    "worker {} has dataflows {got:?} installed, the target is {want:?}",
                    s.worker_index
                ),
            ));
        }
    }
    let mut inputs: BTreeMap<u64, Vec<Update>> = BTreeMap::new();
    for (coll, ups, _) in writes(s) {
        inputs.entry(coll).or_default().extend(ups);
    }
    for d in target {
        for e in &d.exports {
            let got: BTreeMap<Row, i64> = c
                .peek(e.collection_id, LAST_TIME)
                .await
                .map_err(|err| {
                    violation("I3", format!("peek of {} failed: {err}", e.collection_id))
                })?
                .into_iter()
                .collect();
            let want = reference(s, d, e, &inputs, LAST_TIME)?;
            if got != want {
                return Err(violation(
                    "I3",
                    format!(
                        "collection {} at {LAST_TIME} is {got:?}, the reference says {want:?}",
                        e.collection_id
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Sets the failpoint so that the next broadcast of `kind` reaches process 0 only.
pub(crate) fn crash_on(kind: &str) {
    crash_reaching(kind, "1");
}

/// Sets the failpoint so that the next broadcast of `kind` reaches the
/// processes `reach` says (`N`: the first N, `lastN`: the last N).
pub(crate) fn crash_reaching(kind: &str, reach: &str) {
    fail::cfg(FAILPOINT, &format!("return({kind}:{reach})")).expect("failpoint");
}

/// Waits (at most 10 s) until the controller stopped at the failpoint, then
/// clears it. A controller still answering then never crashed: the
/// scenario's fault did not happen, which is the harness's failure (it must
/// not count as a pass, nor as a violation).
pub(crate) async fn crashed(c: &Controller) -> Result<(), Failure> {
    if stopped_at_failpoint(c).await {
        Ok(())
    } else {
        Err(Failure::Harness(
            "the controller did not stop at the partial-broadcast failpoint within 10 s".into(),
        ))
    }
}

/// [`crashed`] for a fault a scenario injects after an earlier one: there,
/// a controller that never reaches the failpoint is the earlier fault's
/// outcome (a replica it broke never lets the successor reach the
/// command), which the scenario's final check judges, so it is not an
/// error here.
pub(crate) async fn crashed_if_reached(c: &Controller) {
    let _ = stopped_at_failpoint(c).await;
}

/// Whether the controller stopped at the failpoint within 10 s; the
/// failpoint is cleared either way.
async fn stopped_at_failpoint(c: &Controller) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let stopped = loop {
        if c.history().await.is_err() {
            break true;
        }
        if tokio::time::Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    fail::remove(FAILPOINT);
    stopped
}

/// Waits for the dataflows of the setup, before any fault: a failure here is
/// the harness's (the system never got going), not a violation.
pub(crate) async fn ready(c: &Controller, dataflows: &[DataflowDescription]) -> Result<(), String> {
    for d in dataflows {
        c.wait_for_frontier(d.exports[0].collection_id, LAST_TIME)
            .await
            .map_err(|e| format!("setup: {e}"))?;
    }
    Ok(())
}
