//! Conversions of the plan IR (expressions, predicates, aggregates, plans)
//! to and from their wire messages (`proto/lockstep/plan/v1/plan.proto`).
//! Plain to wire is infallible; wire to plain names the missing field or
//! unknown enum value.

use lockstep_protocol::ConvertError;

use crate::ir::*;
use crate::proto as p;

fn missing(message: &'static str, field: &'static str) -> ConvertError {
    ConvertError::Missing { message, field }
}

impl From<Expr> for p::Expr {
    fn from(e: Expr) -> Self {
        use p::expr::Kind;
        let bin = |a: Box<Expr>, b: Box<Expr>| {
            Box::new(p::BinaryExpr {
                left: Some(Box::new((*a).into())),
                right: Some(Box::new((*b).into())),
            })
        };
        let kind = match e {
            Expr::Column(c) => Kind::Column(c),
            Expr::Literal(v) => Kind::Literal(v),
            Expr::Add(a, b) => Kind::Add(bin(a, b)),
            Expr::Sub(a, b) => Kind::Sub(bin(a, b)),
            Expr::Mul(a, b) => Kind::Mul(bin(a, b)),
        };
        p::Expr { kind: Some(kind) }
    }
}

impl TryFrom<p::Expr> for Expr {
    type Error = ConvertError;
    fn try_from(e: p::Expr) -> Result<Self, ConvertError> {
        use p::expr::Kind;
        #[allow(clippy::boxed_local)]
        fn bin(b: Box<p::BinaryExpr>) -> Result<(Box<Expr>, Box<Expr>), ConvertError> {
            let l = b.left.ok_or_else(|| missing("BinaryExpr", "left"))?;
            let r = b.right.ok_or_else(|| missing("BinaryExpr", "right"))?;
            Ok((Box::new((*l).try_into()?), Box::new((*r).try_into()?)))
        }
        Ok(match e.kind.ok_or_else(|| missing("Expr", "kind"))? {
            Kind::Column(c) => Expr::Column(c),
            Kind::Literal(v) => Expr::Literal(v),
            Kind::Add(b) => {
                let (l, r) = bin(b)?;
                Expr::Add(l, r)
            }
            Kind::Sub(b) => {
                let (l, r) = bin(b)?;
                Expr::Sub(l, r)
            }
            Kind::Mul(b) => {
                let (l, r) = bin(b)?;
                Expr::Mul(l, r)
            }
        })
    }
}

impl From<CompareOp> for p::CompareOp {
    fn from(op: CompareOp) -> Self {
        match op {
            CompareOp::Eq => p::CompareOp::Eq,
            CompareOp::Ne => p::CompareOp::Ne,
            CompareOp::Lt => p::CompareOp::Lt,
            CompareOp::Le => p::CompareOp::Le,
            CompareOp::Gt => p::CompareOp::Gt,
            CompareOp::Ge => p::CompareOp::Ge,
        }
    }
}

impl From<Predicate> for p::Predicate {
    fn from(pr: Predicate) -> Self {
        p::Predicate {
            op: p::CompareOp::from(pr.op) as i32,
            left: Some(pr.left.into()),
            right: Some(pr.right.into()),
        }
    }
}

impl TryFrom<p::Predicate> for Predicate {
    type Error = ConvertError;
    fn try_from(pr: p::Predicate) -> Result<Self, ConvertError> {
        let bad = ConvertError::UnknownEnum {
            message: "Predicate",
            field: "op",
            value: pr.op,
        };
        let op = match p::CompareOp::try_from(pr.op).map_err(|_| bad.clone())? {
            p::CompareOp::Unspecified => return Err(bad),
            p::CompareOp::Eq => CompareOp::Eq,
            p::CompareOp::Ne => CompareOp::Ne,
            p::CompareOp::Lt => CompareOp::Lt,
            p::CompareOp::Le => CompareOp::Le,
            p::CompareOp::Gt => CompareOp::Gt,
            p::CompareOp::Ge => CompareOp::Ge,
        };
        Ok(Predicate {
            op,
            left: pr
                .left
                .ok_or_else(|| missing("Predicate", "left"))?
                .try_into()?,
            right: pr
                .right
                .ok_or_else(|| missing("Predicate", "right"))?
                .try_into()?,
        })
    }
}

impl From<Aggregate> for p::Aggregate {
    fn from(a: Aggregate) -> Self {
        match a {
            Aggregate::Count => p::Aggregate {
                kind: p::AggregateKind::Count as i32,
                column: 0,
            },
            Aggregate::Sum(c) => p::Aggregate {
                kind: p::AggregateKind::Sum as i32,
                column: c,
            },
        }
    }
}

impl TryFrom<p::Aggregate> for Aggregate {
    type Error = ConvertError;
    fn try_from(a: p::Aggregate) -> Result<Self, ConvertError> {
        match p::AggregateKind::try_from(a.kind) {
            Ok(p::AggregateKind::Count) => Ok(Aggregate::Count),
            Ok(p::AggregateKind::Sum) => Ok(Aggregate::Sum(a.column)),
            _ => Err(ConvertError::UnknownEnum {
                message: "Aggregate",
                field: "kind",
                value: a.kind,
            }),
        }
    }
}

impl From<Plan> for p::Plan {
    fn from(plan: Plan) -> Self {
        use p::plan::Node;
        let b = |plan: Box<Plan>| Some(Box::new(p::Plan::from(*plan)));
        let node = match plan {
            Plan::Get { collection_id } => Node::Get(p::Get { collection_id }),
            Plan::Map { input, exprs } => Node::Map(Box::new(p::Map {
                input: b(input),
                exprs: exprs.into_iter().map(Into::into).collect(),
            })),
            Plan::Filter { input, predicates } => Node::Filter(Box::new(p::Filter {
                input: b(input),
                predicates: predicates.into_iter().map(Into::into).collect(),
            })),
            Plan::Join {
                left,
                right,
                left_key,
                right_key,
            } => Node::Join(Box::new(p::Join {
                left: b(left),
                right: b(right),
                left_key,
                right_key,
            })),
            Plan::Reduce {
                input,
                key,
                aggregates,
            } => Node::Reduce(Box::new(p::Reduce {
                input: b(input),
                key,
                aggregates: aggregates.into_iter().map(Into::into).collect(),
            })),
            Plan::Arrange { input, key } => Node::Arrange(Box::new(p::Arrange {
                input: b(input),
                key,
            })),
        };
        p::Plan { node: Some(node) }
    }
}

fn sub_plan(
    plan: Option<Box<p::Plan>>,
    message: &'static str,
    field: &'static str,
) -> Result<Box<Plan>, ConvertError> {
    Ok(Box::new(
        (*plan.ok_or_else(|| missing(message, field))?).try_into()?,
    ))
}

impl TryFrom<p::Plan> for Plan {
    type Error = ConvertError;
    fn try_from(plan: p::Plan) -> Result<Self, ConvertError> {
        use p::plan::Node;
        Ok(match plan.node.ok_or_else(|| missing("Plan", "node"))? {
            Node::Get(g) => Plan::Get {
                collection_id: g.collection_id,
            },
            Node::Map(m) => Plan::Map {
                input: sub_plan(m.input, "Map", "input")?,
                exprs: m
                    .exprs
                    .into_iter()
                    .map(TryInto::try_into)
                    .collect::<Result<_, _>>()?,
            },
            Node::Filter(f) => Plan::Filter {
                input: sub_plan(f.input, "Filter", "input")?,
                predicates: f
                    .predicates
                    .into_iter()
                    .map(TryInto::try_into)
                    .collect::<Result<_, _>>()?,
            },
            Node::Join(j) => Plan::Join {
                left: sub_plan(j.left, "Join", "left")?,
                right: sub_plan(j.right, "Join", "right")?,
                left_key: j.left_key,
                right_key: j.right_key,
            },
            Node::Reduce(r) => Plan::Reduce {
                input: sub_plan(r.input, "Reduce", "input")?,
                key: r.key,
                aggregates: r
                    .aggregates
                    .into_iter()
                    .map(TryInto::try_into)
                    .collect::<Result<_, _>>()?,
            },
            Node::Arrange(a) => Plan::Arrange {
                input: sub_plan(a.input, "Arrange", "input")?,
                key: a.key,
            },
        })
    }
}
