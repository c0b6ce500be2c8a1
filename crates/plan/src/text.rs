//! A small text syntax for plans, for the CLI and the docs:
//!
//! ```text
//! plan := get(C)
//!       | map(plan, expr, ...)            each expr is one output column
//!       | filter(plan, pred, ...)         every predicate must hold
//!       | join(plan, plan, LK, RK)        key column LK of the left, RK of the right
//!       | reduce(plan, [K, ...], agg, ...)
//!       | arrange(plan, [K, ...])
//! expr := #N | INTEGER | add(expr, expr) | sub(expr, expr) | mul(expr, expr)
//! pred := expr OP expr                    OP is one of == != < <= > >=
//! agg  := count | sum(#N)
//! ```
//!
//! For example `reduce(filter(get(1), #1 > 10), [#0], count, sum(#1))`.
//! [`parse_plan`] and the `Display` of [`Plan`] are inverse: a displayed plan
//! parses back to itself.

use std::fmt;

use crate::ir::{Aggregate, CompareOp, Expr, Plan, Predicate, MAX_PLAN_DEPTH};

/// Why a plan text does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("plan syntax error at byte {at}: {message}")]
pub struct ParseError {
    /// Byte offset of the problem.
    pub at: usize,
    /// What was expected.
    pub message: String,
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
    /// Plan operators and expressions open around the current position.
    depth: usize,
}

impl<'a> Parser<'a> {
    fn err<T>(&self, message: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError {
            at: self.pos,
            message: message.into(),
        })
    }
    fn ws(&mut self) {
        // Whitespace may be several bytes long (U+00A0, U+3000, ...).
        while let Some(c) = self.s[self.pos..].chars().next() {
            if !c.is_whitespace() {
                break;
            }
            self.pos += c.len_utf8();
        }
    }
    /// Enters one level of nesting; refuses to go past [`MAX_PLAN_DEPTH`]
    /// (which also keeps the parser's own recursion bounded).
    fn enter(&mut self) -> Result<(), ParseError> {
        self.depth += 1;
        if self.depth > MAX_PLAN_DEPTH {
            return self.err(format!(
                "the plan nests deeper than {MAX_PLAN_DEPTH} levels (operators and expressions)"
            ));
        }
        Ok(())
    }
    fn eat(&mut self, tok: &str) -> bool {
        self.ws();
        if self.s[self.pos..].starts_with(tok) {
            self.pos += tok.len();
            true
        } else {
            false
        }
    }
    fn expect(&mut self, tok: &str) -> Result<(), ParseError> {
        if self.eat(tok) {
            Ok(())
        } else {
            self.err(format!("expected `{tok}`"))
        }
    }
    fn ident(&mut self) -> String {
        self.ws();
        let rest = &self.s[self.pos..];
        let n = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        self.pos += n;
        rest[..n].to_string()
    }
    fn int(&mut self) -> Result<i64, ParseError> {
        self.ws();
        let rest = &self.s[self.pos..];
        let n = rest
            .char_indices()
            .find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && c == '-')))
            .map(|(i, _)| i)
            .unwrap_or(rest.len());
        match rest[..n].parse() {
            Ok(v) => {
                self.pos += n;
                Ok(v)
            }
            Err(_) => self.err("expected an integer"),
        }
    }
    fn uint(&mut self) -> Result<u64, ParseError> {
        let v = self.int()?;
        u64::try_from(v).or_else(|_| self.err("expected a non-negative integer"))
    }
    fn column(&mut self) -> Result<u32, ParseError> {
        self.expect("#")?;
        let v = self.uint()?;
        u32::try_from(v).or_else(|_| self.err("column number too large"))
    }
    fn columns(&mut self) -> Result<Vec<u32>, ParseError> {
        self.expect("[")?;
        let mut out = Vec::new();
        if self.eat("]") {
            return Ok(out);
        }
        loop {
            out.push(self.column()?);
            if self.eat("]") {
                return Ok(out);
            }
            self.expect(",")?;
        }
    }
    fn plan(&mut self) -> Result<Plan, ParseError> {
        self.enter()?;
        let plan = self.plan_inner();
        self.depth -= 1;
        plan
    }
    fn plan_inner(&mut self) -> Result<Plan, ParseError> {
        let name = self.ident();
        self.expect("(")?;
        let plan = match name.as_str() {
            "get" => Plan::Get {
                collection_id: self.uint()?,
            },
            "map" => {
                let input = Box::new(self.plan()?);
                let mut exprs = Vec::new();
                while self.eat(",") {
                    exprs.push(self.expr()?);
                }
                Plan::Map { input, exprs }
            }
            "filter" => {
                let input = Box::new(self.plan()?);
                let mut predicates = Vec::new();
                while self.eat(",") {
                    predicates.push(self.pred()?);
                }
                Plan::Filter { input, predicates }
            }
            "join" => {
                let left = Box::new(self.plan()?);
                self.expect(",")?;
                let right = Box::new(self.plan()?);
                self.expect(",")?;
                let left_key = self.column()?;
                self.expect(",")?;
                let right_key = self.column()?;
                Plan::Join {
                    left,
                    right,
                    left_key,
                    right_key,
                }
            }
            "reduce" => {
                let input = Box::new(self.plan()?);
                self.expect(",")?;
                let key = self.columns()?;
                let mut aggregates = Vec::new();
                while self.eat(",") {
                    let agg = self.ident();
                    aggregates.push(match agg.as_str() {
                        "count" => Aggregate::Count,
                        "sum" => {
                            self.expect("(")?;
                            let c = self.column()?;
                            self.expect(")")?;
                            Aggregate::Sum(c)
                        }
                        _ => return self.err("expected `count` or `sum(#N)`"),
                    });
                }
                Plan::Reduce {
                    input,
                    key,
                    aggregates,
                }
            }
            "arrange" => {
                let input = Box::new(self.plan()?);
                self.expect(",")?;
                Plan::Arrange {
                    input,
                    key: self.columns()?,
                }
            }
            _ => return self.err(format!("unknown plan operator `{name}`")),
        };
        self.expect(")")?;
        Ok(plan)
    }
    fn expr(&mut self) -> Result<Expr, ParseError> {
        self.enter()?;
        let expr = self.expr_inner();
        self.depth -= 1;
        expr
    }
    fn expr_inner(&mut self) -> Result<Expr, ParseError> {
        self.ws();
        if self.s[self.pos..].starts_with('#') {
            return Ok(Expr::Column(self.column()?));
        }
        if self.s[self.pos..].starts_with(|c: char| c.is_ascii_digit() || c == '-') {
            return Ok(Expr::Literal(self.int()?));
        }
        let name = self.ident();
        let make: fn(Box<Expr>, Box<Expr>) -> Expr = match name.as_str() {
            "add" => Expr::Add,
            "sub" => Expr::Sub,
            "mul" => Expr::Mul,
            _ => return self.err("expected `#N`, an integer, or add/sub/mul(..)"),
        };
        self.expect("(")?;
        let a = self.expr()?;
        self.expect(",")?;
        let b = self.expr()?;
        self.expect(")")?;
        Ok(make(Box::new(a), Box::new(b)))
    }
    fn pred(&mut self) -> Result<Predicate, ParseError> {
        let left = self.expr()?;
        let op = [
            ("==", CompareOp::Eq),
            ("!=", CompareOp::Ne),
            ("<=", CompareOp::Le),
            (">=", CompareOp::Ge),
            ("<", CompareOp::Lt),
            (">", CompareOp::Gt),
        ]
        .into_iter()
        .find(|(t, _)| self.eat(t))
        .map(|(_, op)| op);
        let Some(op) = op else {
            return self.err("expected a comparison (== != < <= > >=)");
        };
        let right = self.expr()?;
        Ok(Predicate { op, left, right })
    }
}

/// Parses a plan from its text syntax.
pub fn parse_plan(s: &str) -> Result<Plan, ParseError> {
    let mut p = Parser {
        s,
        pos: 0,
        depth: 0,
    };
    let plan = p.plan()?;
    p.ws();
    if p.pos != s.len() {
        return p.err("unexpected text after the plan");
    }
    Ok(plan)
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Column(c) => write!(f, "#{c}"),
            Expr::Literal(v) => write!(f, "{v}"),
            Expr::Add(a, b) => write!(f, "add({a}, {b})"),
            Expr::Sub(a, b) => write!(f, "sub({a}, {b})"),
            Expr::Mul(a, b) => write!(f, "mul({a}, {b})"),
        }
    }
}

impl fmt::Display for Predicate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            CompareOp::Eq => "==",
            CompareOp::Ne => "!=",
            CompareOp::Lt => "<",
            CompareOp::Le => "<=",
            CompareOp::Gt => ">",
            CompareOp::Ge => ">=",
        };
        write!(f, "{} {op} {}", self.left, self.right)
    }
}

fn cols(key: &[u32]) -> String {
    let v: Vec<String> = key.iter().map(|c| format!("#{c}")).collect();
    format!("[{}]", v.join(", "))
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Plan::Get { collection_id } => write!(f, "get({collection_id})"),
            Plan::Map { input, exprs } => {
                write!(f, "map({input}")?;
                for e in exprs {
                    write!(f, ", {e}")?;
                }
                write!(f, ")")
            }
            Plan::Filter { input, predicates } => {
                write!(f, "filter({input}")?;
                for p in predicates {
                    write!(f, ", {p}")?;
                }
                write!(f, ")")
            }
            Plan::Join {
                left,
                right,
                left_key,
                right_key,
            } => write!(f, "join({left}, {right}, #{left_key}, #{right_key})"),
            Plan::Reduce {
                input,
                key,
                aggregates,
            } => {
                write!(f, "reduce({input}, {}", cols(key))?;
                for a in aggregates {
                    match a {
                        Aggregate::Count => write!(f, ", count")?,
                        Aggregate::Sum(c) => write!(f, ", sum(#{c})")?,
                    }
                }
                write!(f, ")")
            }
            Plan::Arrange { input, key } => write!(f, "arrange({input}, {})", cols(key)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_displays_back() {
        for text in [
            "get(1)",
            "map(get(1), #0, add(#1, 5), mul(#0, -2))",
            "filter(get(2), #1 > 10, #0 != 3)",
            "join(get(1), get(2), #0, #0)",
            "reduce(filter(get(1), #1 >= 10), [#0], count, sum(#1))",
            "reduce(get(1), [], count)",
            "arrange(get(2), [#1, #0])",
        ] {
            let plan = parse_plan(text).unwrap();
            assert_eq!(plan.to_string(), text);
            assert_eq!(parse_plan(&plan.to_string()).unwrap(), plan);
        }
    }

    #[test]
    fn errors_say_where() {
        let e = parse_plan("reduce(get(1), [#0], avg)").unwrap_err();
        assert!(e.message.contains("count"), "{e}");
        assert_eq!(e.at, 24);
        assert!(parse_plan("get(1) extra").is_err());
        assert!(parse_plan("frobnicate(1)")
            .unwrap_err()
            .message
            .contains("unknown plan operator"));
        assert!(parse_plan("filter(get(1), #1 ~ 2)").is_err());
    }

    #[test]
    fn multibyte_whitespace_is_whitespace() {
        for ws in ["\u{a0}", "\u{2003}", "\u{3000}", " \t\n"] {
            let text = format!("filter({ws}get(1),{ws}#1{ws}>{ws}10{ws}){ws}");
            let plan = parse_plan(&text).unwrap();
            assert_eq!(plan.to_string(), "filter(get(1), #1 > 10)");
        }
        // A multibyte character that is not whitespace is an error, not a panic.
        assert!(parse_plan("get(1)\u{e9}").is_err());
        assert!(parse_plan("\u{e9}get(1)").is_err());
    }

    #[test]
    fn nesting_is_bounded() {
        let nested = |n: usize| {
            let mut t = "get(1)".to_string();
            for _ in 1..n {
                t = format!("arrange({t}, [#0])");
            }
            t
        };
        let deepest = parse_plan(&nested(MAX_PLAN_DEPTH)).unwrap();
        assert_eq!(deepest.depth(), MAX_PLAN_DEPTH);
        let e = parse_plan(&nested(MAX_PLAN_DEPTH + 1)).unwrap_err();
        assert!(e.message.contains("deeper than"), "{e}");
        // Far deeper: an error, not a stack overflow.
        assert!(parse_plan(&nested(10_000)).is_err());
        let mut expr = "#0".to_string();
        for _ in 0..10_000 {
            expr = format!("add({expr}, 1)");
        }
        assert!(parse_plan(&format!("map(get(1), {expr})")).is_err());
        // Expressions count toward the depth.
        let mut expr = "#0".to_string();
        for _ in 1..MAX_PLAN_DEPTH {
            expr = format!("add({expr}, 1)");
        }
        assert!(parse_plan(&format!("map(get(1), {expr})")).is_err());
        assert_eq!(
            parse_plan(&format!("filter(get(1), {expr} > 0)"))
                .map(|p| p.depth())
                .map_err(|e| e.to_string()),
            Err(format!(
                "plan syntax error at byte {}: the plan nests deeper than {MAX_PLAN_DEPTH} levels (operators and expressions)",
                "filter(get(1), ".len() + "add(".len() * (MAX_PLAN_DEPTH - 1)
            ))
        );
    }
}
