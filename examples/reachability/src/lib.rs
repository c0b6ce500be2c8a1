//! A second dataflow family for lockstep, built outside the core crates
//! against the replica's extension point (`lockstep_replica::family`):
//! single-source shortest paths (breadth-first distances) over a directed
//! graph, computed with differential's `iterate`, which the built-in plan
//! language has not.
//!
//! Format [`FORMAT`]. Rows are text, not integers: nodes are names
//! (UTF-8, non-empty, without tabs or newlines). A dataflow has exactly one
//! input, the edges: rows `src<TAB>dst` ([`edge`]; a row of another shape is
//! ignored), a set (each edge written once and retracted at most once). Each
//! export's description is its root's name ([`describe`]); the export holds
//! a row `node<TAB>distance` ([`distance`], the distance in decimal) for
//! every node reachable from the root, the root at distance 0.
//! [`reference()`] computes the same in plain Rust.
//!
//! Nothing in the controller, the protocol or the replica's core knows this
//! family: it travels as bytes in `Export.description` and is read here.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use differential_dataflow::operators::iterate::Iterate;
use differential_dataflow::AsCollection;
use lockstep_protocol::validate::{validate_dataflow, InvalidDataflow};
use lockstep_protocol::{DataflowDescription, Export, Row, Update};
use lockstep_replica::family::{Coll, Family, Prepared};
use timely::dataflow::operators::ToStream;

/// The format name of this family's descriptions.
pub const FORMAT: &str = "lockstep.example.reachability.v2";

/// The reachability family (see the crate documentation).
#[derive(Clone, Copy, Debug, Default)]
pub struct Reachability;

/// The row of an edge from `src` to `dst`.
pub fn edge(src: &str, dst: &str) -> Row {
    format!("{src}\t{dst}").into_bytes()
}

/// The row saying `node` is `d` steps from the root.
pub fn distance(node: &str, d: u64) -> Row {
    format!("{node}\t{d}").into_bytes()
}

/// The `(src, dst)` of an edge row, `None` for a row of another shape.
pub fn parse_edge(row: &[u8]) -> Option<(String, String)> {
    let text = std::str::from_utf8(row).ok()?;
    let (src, dst) = text.split_once('\t')?;
    (is_name(src) && is_name(dst)).then(|| (src.to_owned(), dst.to_owned()))
}

fn is_name(s: &str) -> bool {
    !s.is_empty() && !s.contains(['\t', '\n'])
}

/// An export of collection `collection_id`: the distances from `root`.
pub fn describe(collection_id: u64, root: &str) -> Export {
    Export {
        collection_id,
        description: root.as_bytes().to_vec(),
    }
}

/// The root an export's description names ([`describe`]'s inverse).
pub fn root(e: &Export) -> Result<String, InvalidDataflow> {
    match std::str::from_utf8(&e.description) {
        Ok(name) if is_name(name) => Ok(name.to_owned()),
        _ => Err(InvalidDataflow::Description {
            export: e.collection_id,
            reason: format!(
                "export {}'s description ({} bytes) is not a {FORMAT} root: a node name \
                 (UTF-8, non-empty, without tabs or newlines)",
                e.collection_id,
                e.description.len()
            ),
        }),
    }
}

/// Roots of the exports, in export order; each prepared dataflow reads one
/// input, the edges.
struct Roots {
    edges: u64,
    roots: Vec<(u64, String)>,
}

impl Family for Reachability {
    fn format(&self) -> &str {
        FORMAT
    }

    fn prepare(&self, desc: &DataflowDescription) -> Result<Box<dyn Prepared>, InvalidDataflow> {
        validate_dataflow(desc)?;
        let first = desc.exports[0].collection_id;
        let [edges] = desc.inputs[..] else {
            return Err(InvalidDataflow::Description {
                export: first,
                reason: format!(
                    "a {FORMAT} dataflow reads exactly one input (the edges), not {:?}",
                    desc.inputs
                ),
            });
        };
        let roots = desc
            .exports
            .iter()
            .map(|e| Ok((e.collection_id, root(e)?)))
            .collect::<Result<_, InvalidDataflow>>()?;
        Ok(Box::new(Roots { edges, roots }))
    }
}

impl Prepared for Roots {
    fn render<'s>(&self, inputs: &BTreeMap<u64, Coll<'s>>) -> Vec<(u64, Coll<'s>)> {
        let edges = inputs[&self.edges]
            .clone()
            .flat_map(|row: Row| parse_edge(&row));
        self.roots
            .iter()
            .map(|(collection, root)| {
                let scope = edges.inner.scope();
                // The root, at distance 0, from the dataflow's first time
                // on (every worker introduces it; `reduce` keeps one).
                let start = vec![((root.clone(), 0u64), 0u64, 1i64)]
                    .to_stream(scope)
                    .as_collection();
                let edges = edges.clone();
                let distances = start.clone().iterate(|scope, dists| {
                    let edges = edges.enter(scope);
                    let start = start.enter(scope);
                    dists
                        .join_map(edges, |_src, d, dst| (dst.clone(), d + 1))
                        .concat(start)
                        .reduce(|_node, ds, out| out.push((*ds[0].0, 1)))
                });
                let rows = distances.map(|(node, d)| distance(&node, d));
                (*collection, rows)
            })
            .collect()
    }
}

/// The distances from `root` over the edges `updates` hold at time `t`
/// (an edge is there when its multiplicity up to `t` is positive): what an
/// export of this family holds, as [`distance`] rows.
pub fn reference(updates: &[Update], root: &str, t: u64) -> BTreeSet<Row> {
    let mut counts: BTreeMap<(String, String), i64> = BTreeMap::new();
    for u in updates.iter().filter(|u| u.time <= t) {
        if let Some(e) = parse_edge(&u.row) {
            *counts.entry(e).or_insert(0) += u.diff;
        }
    }
    let mut out_edges: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for ((src, dst), c) in counts {
        if c > 0 {
            out_edges.entry(src).or_default().push(dst);
        }
    }
    let mut dist = BTreeMap::from([(root.to_owned(), 0u64)]);
    let mut queue = VecDeque::from([root.to_owned()]);
    while let Some(n) = queue.pop_front() {
        let d = dist[&n];
        for m in out_edges.get(&n).into_iter().flatten() {
            if !dist.contains_key(m) {
                dist.insert(m.clone(), d + 1);
                queue.push_back(m.clone());
            }
        }
    }
    dist.iter().map(|(n, &d)| distance(n, d)).collect()
}

/// A sample graph written in three steps, what the example's tests and
/// lockstep's write: a chain `n0 -> n1 -> n2 -> n3` with a branch
/// `n1 -> n4` at time 0; a cycle closed (`n3 -> n0`) and `n5 -> n4 -> n6`,
/// `n5 -> n0` at time 1; at time 2 `n1 -> n4` taken away (which makes `n4`
/// unreachable from `n0` and farther from `n5`) and `n6 -> n7` added. Each
/// entry is a write's updates and its upper.
pub fn sample_writes() -> Vec<(Vec<Update>, u64)> {
    let e = |src: u32, dst: u32, time: u64, diff: i64| Update {
        row: edge(&format!("n{src}"), &format!("n{dst}")),
        time,
        diff,
    };
    vec![
        (
            vec![e(0, 1, 0, 1), e(1, 2, 0, 1), e(2, 3, 0, 1), e(1, 4, 0, 1)],
            1,
        ),
        (
            vec![e(3, 0, 1, 1), e(5, 4, 1, 1), e(4, 6, 1, 1), e(5, 0, 1, 1)],
            2,
        ),
        (vec![e(1, 4, 2, -1), e(6, 7, 2, 1)], 3),
    ]
}
