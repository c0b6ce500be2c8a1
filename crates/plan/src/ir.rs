//! The plan IR every worker renders into the same differential operators:
//! scalar expressions, predicates, aggregates and plans, and their bounds.

use crate::rows::Values;

/// A scalar expression over a row.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// A column of the input row.
    Column(u32),
    /// A constant.
    Literal(i64),
    /// Wrapping addition.
    Add(Box<Expr>, Box<Expr>),
    /// Wrapping subtraction.
    Sub(Box<Expr>, Box<Expr>),
    /// Wrapping multiplication.
    Mul(Box<Expr>, Box<Expr>),
}

impl Expr {
    /// Evaluates the expression; `None` if a column is out of range.
    pub fn eval(&self, row: &[i64]) -> Option<i64> {
        Some(match self {
            Expr::Column(c) => *row.get(*c as usize)?,
            Expr::Literal(v) => *v,
            Expr::Add(a, b) => a.eval(row)?.wrapping_add(b.eval(row)?),
            Expr::Sub(a, b) => a.eval(row)?.wrapping_sub(b.eval(row)?),
            Expr::Mul(a, b) => a.eval(row)?.wrapping_mul(b.eval(row)?),
        })
    }
}

/// A comparison operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompareOp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

/// A predicate `left op right`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Predicate {
    /// The operator.
    pub op: CompareOp,
    /// Left operand.
    pub left: Expr,
    /// Right operand.
    pub right: Expr,
}

impl Predicate {
    /// Evaluates the predicate; `None` if a column is out of range.
    pub fn eval(&self, row: &[i64]) -> Option<bool> {
        let (l, r) = (self.left.eval(row)?, self.right.eval(row)?);
        Some(match self.op {
            CompareOp::Eq => l == r,
            CompareOp::Ne => l != r,
            CompareOp::Lt => l < r,
            CompareOp::Le => l <= r,
            CompareOp::Gt => l > r,
            CompareOp::Ge => l >= r,
        })
    }
}

/// An aggregate of a reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Aggregate {
    /// The number of rows (with multiplicity).
    Count,
    /// The sum of a column (with multiplicity).
    Sum(u32),
}

/// The aggregates of one reduce group, given its rows with multiplicities:
/// `None` when the group's count is zero (it produces no row). A summed
/// column a row lacks contributes 0; arithmetic wraps. The replica's
/// rendering and the plain-Rust reference both call this, so they agree.
pub fn aggregate_group<'a>(
    aggregates: &[Aggregate],
    rows: impl Iterator<Item = (&'a [i64], i64)> + Clone,
) -> Option<Values> {
    let count: i64 = rows.clone().map(|(_, d)| d).fold(0, i64::wrapping_add);
    if count == 0 {
        return None;
    }
    Some(
        aggregates
            .iter()
            .map(|a| match a {
                Aggregate::Count => count,
                Aggregate::Sum(c) => rows
                    .clone()
                    .map(|(row, d)| row.get(*c as usize).copied().unwrap_or(0).wrapping_mul(d))
                    .fold(0i64, i64::wrapping_add),
            })
            .collect(),
    )
}

/// The plan IR every worker renders into the same differential operators.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Plan {
    /// Reads an input collection.
    Get {
        /// The input collection.
        collection_id: u64,
    },
    /// Replaces each row by the values of `exprs`.
    Map {
        /// The input.
        input: Box<Plan>,
        /// One expression per output column.
        exprs: Vec<Expr>,
    },
    /// Keeps rows for which every predicate holds.
    Filter {
        /// The input.
        input: Box<Plan>,
        /// The predicates.
        predicates: Vec<Predicate>,
    },
    /// Equi-join on one key column each side; output is left ++ right.
    Join {
        /// Left input.
        left: Box<Plan>,
        /// Right input.
        right: Box<Plan>,
        /// Key column of the left input.
        left_key: u32,
        /// Key column of the right input.
        right_key: u32,
    },
    /// Group by `key`; output is key values ++ one value per aggregate.
    Reduce {
        /// The input.
        input: Box<Plan>,
        /// Key columns.
        key: Vec<u32>,
        /// Aggregates.
        aggregates: Vec<Aggregate>,
    },
    /// Arranges the input by `key` columns.
    Arrange {
        /// The input.
        input: Box<Plan>,
        /// Key columns.
        key: Vec<u32>,
    },
}

/// The deepest plan this family accepts: plan operators and expressions
/// nested along any path, counted together. Each level of plan or expression
/// is two protobuf messages, so this keeps every encoded plan well under
/// prost's decoding recursion limit (100): a plan accepted anywhere is
/// decodable everywhere.
pub const MAX_PLAN_DEPTH: usize = 32;

impl Expr {
    /// How deeply the expression nests (a column or a literal is 1).
    pub fn depth(&self) -> usize {
        match self {
            Expr::Column(_) | Expr::Literal(_) => 1,
            Expr::Add(a, b) | Expr::Sub(a, b) | Expr::Mul(a, b) => 1 + a.depth().max(b.depth()),
        }
    }
}

impl Plan {
    /// How deeply the plan nests: its operators and, at each, the deepest
    /// expression or predicate operand, along the deepest path (`get(1)` is
    /// 1). See [`MAX_PLAN_DEPTH`].
    pub fn depth(&self) -> usize {
        match self {
            Plan::Get { .. } => 1,
            Plan::Map { input, exprs } => {
                let e = exprs.iter().map(Expr::depth).max().unwrap_or(0);
                1 + input.depth().max(e)
            }
            Plan::Filter { input, predicates } => {
                let e = predicates
                    .iter()
                    .map(|p| p.left.depth().max(p.right.depth()))
                    .max()
                    .unwrap_or(0);
                1 + input.depth().max(e)
            }
            Plan::Join { left, right, .. } => 1 + left.depth().max(right.depth()),
            Plan::Reduce { input, .. } | Plan::Arrange { input, .. } => 1 + input.depth(),
        }
    }

    /// Every input collection the plan reads, in order of appearance.
    pub fn inputs(&self) -> Vec<u64> {
        let mut out = Vec::new();
        self.visit_inputs(&mut out);
        out
    }

    fn visit_inputs(&self, out: &mut Vec<u64>) {
        match self {
            Plan::Get { collection_id } => out.push(*collection_id),
            Plan::Map { input, .. }
            | Plan::Filter { input, .. }
            | Plan::Reduce { input, .. }
            | Plan::Arrange { input, .. } => input.visit_inputs(out),
            Plan::Join { left, right, .. } => {
                left.visit_inputs(out);
                right.visit_inputs(out);
            }
        }
    }
}
