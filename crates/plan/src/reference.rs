//! A plain-Rust evaluation of the plan IR: the reference that tests, the demo
//! and the fault suites compare the replica's answers with (invariant I3).
//!
//! It follows the semantics the replica renders (see the replica's `render`
//! module): rows missing a referenced column are dropped by map, filter,
//! join keys, reduce keys and arrange keys; a summed column a row lacks
//! contributes 0; a reduce group whose count is zero produces no row.

use std::collections::BTreeMap;

use lockstep_protocol::{Row, Timestamp, Update};

use crate::ir::{aggregate_group, Plan};
use crate::rows::{self, Values};

/// A multiset of encoded rows (as peeks answer them): row -> multiplicity
/// (never zero).
pub type Multiset = BTreeMap<Row, i64>;

/// A multiset of decoded rows, what the evaluation works on.
type Bag = BTreeMap<Values, i64>;

fn add<R: Ord + Clone>(m: &mut BTreeMap<R, i64>, row: R, d: i64) {
    let e = m.entry(row.clone()).or_insert(0);
    *e = e.wrapping_add(d);
    if *e == 0 {
        m.remove(&row);
    }
}

/// The contents of a collection given by `updates` at time `t`.
pub fn at_time(updates: &[Update], t: Timestamp) -> Multiset {
    let mut m = Multiset::new();
    for u in updates.iter().filter(|u| u.time <= t) {
        add(&mut m, u.row.clone(), u.diff);
    }
    m
}

fn key_of(row: &[i64], key: &[u32]) -> Option<Values> {
    key.iter().map(|&c| row.get(c as usize).copied()).collect()
}

/// Evaluates `plan` at time `t` over the input collections' updates,
/// returning its rows encoded. A Get of a collection absent from `inputs`
/// reads an empty collection; an input row that is not a row of this family
/// is dropped (as the replica drops it).
pub fn evaluate(plan: &Plan, inputs: &BTreeMap<u64, Vec<Update>>, t: Timestamp) -> Multiset {
    eval(plan, inputs, t)
        .into_iter()
        .map(|(values, d)| (rows::encode(&values), d))
        .collect()
}

fn eval(plan: &Plan, inputs: &BTreeMap<u64, Vec<Update>>, t: Timestamp) -> Bag {
    match plan {
        Plan::Get { collection_id } => {
            let mut m = Bag::new();
            for u in inputs.get(collection_id).into_iter().flatten() {
                if let (true, Ok(values)) = (u.time <= t, rows::decode(&u.row)) {
                    add(&mut m, values, u.diff);
                }
            }
            m
        }
        Plan::Map { input, exprs } => {
            let mut out = Bag::new();
            for (row, d) in eval(input, inputs, t) {
                if let Some(r) = exprs
                    .iter()
                    .map(|e| e.eval(&row))
                    .collect::<Option<Values>>()
                {
                    add(&mut out, r, d);
                }
            }
            out
        }
        Plan::Filter { input, predicates } => eval(input, inputs, t)
            .into_iter()
            .filter(|(row, _)| predicates.iter().all(|p| p.eval(row) == Some(true)))
            .collect(),
        Plan::Join {
            left,
            right,
            left_key,
            right_key,
        } => {
            let l = eval(left, inputs, t);
            let r = eval(right, inputs, t);
            let mut out = Bag::new();
            for (lrow, ld) in &l {
                let Some(lk) = lrow.get(*left_key as usize) else {
                    continue;
                };
                for (rrow, rd) in &r {
                    if rrow.get(*right_key as usize) == Some(lk) {
                        let mut row = lrow.clone();
                        row.extend(rrow.iter().copied());
                        add(&mut out, row, ld.wrapping_mul(*rd));
                    }
                }
            }
            out
        }
        Plan::Reduce {
            input,
            key,
            aggregates,
        } => {
            let mut groups: BTreeMap<Values, Vec<(Values, i64)>> = BTreeMap::new();
            for (row, d) in eval(input, inputs, t) {
                if let Some(k) = key_of(&row, key) {
                    groups.entry(k).or_default().push((row, d));
                }
            }
            let mut out = Bag::new();
            for (mut k, rows) in groups {
                let rows = rows.iter().map(|(row, d)| (&row[..], *d));
                if let Some(aggs) = aggregate_group(aggregates, rows) {
                    k.extend(aggs);
                    add(&mut out, k, 1);
                }
            }
            out
        }
        Plan::Arrange { input, key } => eval(input, inputs, t)
            .into_iter()
            .filter(|(row, _)| key_of(row, key).is_some())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Aggregate, CompareOp, Expr, Predicate};

    fn u(row: &[i64], time: u64, diff: i64) -> Update {
        Update {
            row: rows::encode(row),
            time,
            diff,
        }
    }

    #[test]
    fn join_reduce_filter_map() {
        let mut inputs = BTreeMap::new();
        inputs.insert(
            1,
            vec![u(&[1, 10], 0, 1), u(&[2, 20], 0, 1), u(&[1, 10], 2, -1)],
        );
        inputs.insert(2, vec![u(&[1, 100], 0, 1), u(&[2, 200], 1, 2)]);
        let join = Plan::Join {
            left: Box::new(Plan::Get { collection_id: 1 }),
            right: Box::new(Plan::Get { collection_id: 2 }),
            left_key: 0,
            right_key: 0,
        };
        let at1 = evaluate(&join, &inputs, 1);
        assert_eq!(at1.get(&rows::encode(&[1, 10, 1, 100])), Some(&1));
        assert_eq!(at1.get(&rows::encode(&[2, 20, 2, 200])), Some(&2));
        let at2 = evaluate(&join, &inputs, 2);
        assert_eq!(at2.len(), 1, "the retraction at 2 removes key 1");

        let reduce = Plan::Reduce {
            input: Box::new(Plan::Get { collection_id: 2 }),
            key: vec![],
            aggregates: vec![Aggregate::Count, Aggregate::Sum(1)],
        };
        assert_eq!(
            evaluate(&reduce, &inputs, 1),
            [(rows::encode(&[3, 500]), 1)].into_iter().collect()
        );

        let fm = Plan::Map {
            input: Box::new(Plan::Filter {
                input: Box::new(Plan::Get { collection_id: 1 }),
                predicates: vec![Predicate {
                    op: CompareOp::Gt,
                    left: Expr::Column(1),
                    right: Expr::Literal(15),
                }],
            }),
            exprs: vec![Expr::Add(
                Box::new(Expr::Column(1)),
                Box::new(Expr::Literal(1)),
            )],
        };
        assert_eq!(
            evaluate(&fm, &inputs, 5),
            [(rows::encode(&[21]), 1)].into_iter().collect()
        );
    }
}
