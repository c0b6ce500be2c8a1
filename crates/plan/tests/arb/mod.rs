//! proptest strategies for plans, shared by the tests.
#![allow(dead_code, missing_docs)]

use lockstep_plan::{Aggregate, CompareOp, Expr, Plan, Predicate};
use proptest::collection::vec;
use proptest::prelude::*;

pub fn expr() -> impl Strategy<Value = Expr> {
    let leaf = prop_oneof![
        (0u32..8).prop_map(Expr::Column),
        any::<i64>().prop_map(Expr::Literal)
    ];
    leaf.prop_recursive(3, 12, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| Expr::Add(Box::new(a), Box::new(b))),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| Expr::Sub(Box::new(a), Box::new(b))),
            (inner.clone(), inner).prop_map(|(a, b)| Expr::Mul(Box::new(a), Box::new(b))),
        ]
    })
}

fn predicate() -> impl Strategy<Value = Predicate> {
    let op = prop::sample::select(vec![
        CompareOp::Eq,
        CompareOp::Ne,
        CompareOp::Lt,
        CompareOp::Le,
        CompareOp::Gt,
        CompareOp::Ge,
    ]);
    (op, expr(), expr()).prop_map(|(op, left, right)| Predicate { op, left, right })
}

fn aggregate() -> impl Strategy<Value = Aggregate> {
    prop_oneof![Just(Aggregate::Count), (0u32..8).prop_map(Aggregate::Sum)]
}

pub fn plan() -> impl Strategy<Value = Plan> {
    let leaf = (0u64..10).prop_map(|collection_id| Plan::Get { collection_id });
    leaf.prop_recursive(4, 16, 2, |inner| {
        prop_oneof![
            (inner.clone(), vec(expr(), 0..3)).prop_map(|(i, exprs)| Plan::Map {
                input: Box::new(i),
                exprs
            }),
            (inner.clone(), vec(predicate(), 0..3)).prop_map(|(i, predicates)| Plan::Filter {
                input: Box::new(i),
                predicates
            }),
            (inner.clone(), inner.clone(), 0u32..4, 0u32..4).prop_map(|(l, r, lk, rk)| {
                Plan::Join {
                    left: Box::new(l),
                    right: Box::new(r),
                    left_key: lk,
                    right_key: rk,
                }
            }),
            (inner.clone(), vec(0u32..4, 0..3), vec(aggregate(), 0..3)).prop_map(
                |(i, key, aggregates)| Plan::Reduce {
                    input: Box::new(i),
                    key,
                    aggregates
                }
            ),
            (inner, vec(0u32..4, 0..3)).prop_map(|(i, key)| Plan::Arrange {
                input: Box::new(i),
                key
            }),
        ]
    })
}
