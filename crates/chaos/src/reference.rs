//! The reference's answers for the suites' workloads: the plain-Rust
//! evaluation of a plan over the writes a client made.

use std::collections::BTreeMap;

use lockstep_plan::Plan;

/// The rows of `plan` at `t` (row bytes to their count) over `applied`,
/// the writes to collection `input` (write time to its one row, inserted
/// once), as the plain-Rust reference computes them.
pub fn rows_at(
    plan: &Plan,
    input: u64,
    applied: &BTreeMap<u64, Vec<i64>>,
    t: u64,
) -> BTreeMap<Vec<u8>, i64> {
    let updates: Vec<lockstep_protocol::Update> = applied
        .range(..=t)
        .map(|(w, v)| lockstep_protocol::Update {
            row: lockstep_plan::row(v),
            time: *w,
            diff: 1,
        })
        .collect();
    let inputs = BTreeMap::from([(input, updates)]);
    lockstep_plan::reference::evaluate(plan, &inputs, t)
        .into_iter()
        .collect()
}
