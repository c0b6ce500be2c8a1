//! Rendering the built-in family's plans (`lockstep-plan`) into
//! differential-dataflow operators.
//!
//! Rendering is deterministic: the same description renders the same timely
//! operators in the same order on every worker, which is what keeps the
//! workers' channel identifiers aligned. A description is decoded and checked
//! *before* anything is built (`lockstep_plan::plans`, through the
//! [`crate::family::PlanFamily`]), so a bad plan is refused identically on
//! every worker and never leaves a half-built dataflow behind.
//!
//! Rows are the plan language's (`lockstep_plan::rows::Values`), decoded
//! from the protocol's row bytes by [`crate::family::PlanFamily`] before
//! they reach [`render`] and encoded after. An expression naming a column a row does not have
//! drops that row (map, filter, join key, reduce key); a summed column a row
//! lacks contributes 0.

use std::collections::BTreeMap;

use differential_dataflow::VecCollection;
use lockstep_plan::rows::Values as Row;
use lockstep_plan::{aggregate_group, Plan};

/// A collection of the plan language's rows at u64 times with i64
/// multiplicities.
pub type PlanColl<'s> = VecCollection<'s, u64, Row, i64>;

fn key_of(row: &[i64], key: &[u32]) -> Option<Row> {
    key.iter().map(|&c| row.get(c as usize).copied()).collect()
}

/// Renders `plan` over the given input collections. The plan must have been
/// validated, so every Get finds its input.
pub fn render<'s>(plan: &Plan, inputs: &BTreeMap<u64, PlanColl<'s>>) -> PlanColl<'s> {
    match plan {
        Plan::Get { collection_id } => inputs[collection_id].clone(),
        Plan::Map { input, exprs } => {
            let exprs = exprs.clone();
            render(input, inputs).flat_map(move |row: Row| {
                exprs.iter().map(|e| e.eval(&row)).collect::<Option<Row>>()
            })
        }
        Plan::Filter { input, predicates } => {
            let predicates = predicates.clone();
            render(input, inputs)
                .filter(move |row: &Row| predicates.iter().all(|p| p.eval(row) == Some(true)))
        }
        Plan::Join {
            left,
            right,
            left_key,
            right_key,
        } => {
            let (lk, rk) = (*left_key as usize, *right_key as usize);
            let l = render(left, inputs).flat_map(move |r: Row| r.get(lk).copied().map(|k| (k, r)));
            let r =
                render(right, inputs).flat_map(move |r: Row| r.get(rk).copied().map(|k| (k, r)));
            l.join(r).map(|(_k, (mut l, r)): (i64, (Row, Row))| {
                l.extend(r);
                l
            })
        }
        Plan::Reduce {
            input,
            key,
            aggregates,
        } => {
            let key = key.clone();
            let aggregates = aggregates.clone();
            render(input, inputs)
                .flat_map(move |row: Row| key_of(&row, &key).map(|k| (k, row)))
                .reduce(
                    move |_key: &Row, vals: &[(&Row, i64)], out: &mut Vec<(Row, i64)>| {
                        let rows = vals.iter().map(|(row, d)| (&row[..], *d));
                        if let Some(aggs) = aggregate_group(&aggregates, rows) {
                            out.push((aggs, 1));
                        }
                    },
                )
                .map(|(mut k, aggs): (Row, Row)| {
                    k.extend(aggs);
                    k
                })
        }
        Plan::Arrange { input, key } => {
            let key = key.clone();
            render(input, inputs)
                .flat_map(move |row: Row| key_of(&row, &key).map(|k| (k, row)))
                .arrange_by_key()
                .as_collection(|_k: &Row, v: &Row| v.clone())
        }
    }
}
