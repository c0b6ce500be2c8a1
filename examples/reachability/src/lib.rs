//! A second dataflow family for lockstep, built outside the core crates
//! against the replica's extension point (`lockstep_replica::family`):
//! single-source shortest paths (breadth-first distances) over a directed
//! graph, computed with differential's `iterate`, which the built-in plan
//! language has not.
//!
//! Format [`FORMAT`]. A dataflow has exactly one input, the edges: rows
//! `[src, dst]` (a row of another length is ignored), a set (each edge
//! written once and retracted at most once). Each export's description is
//! its root node, 8 bytes little-endian ([`describe`]); the export holds a
//! row `[node, distance]` for every node reachable from the root, the root
//! at distance 0. [`reference()`] computes the same in plain Rust.
//!
//! Nothing in the controller, the protocol or the replica's core knows this
//! family: it travels as bytes in `Export.description` and is read here.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use differential_dataflow::operators::iterate::Iterate;
use differential_dataflow::AsCollection;
use lockstep_protocol::validate::{validate_dataflow, InvalidDataflow};
use lockstep_protocol::{DataflowDescription, Export};
use lockstep_replica::family::{Family, Prepared};
use lockstep_replica::render::Coll;
use timely::dataflow::operators::ToStream;

/// The format name of this family's descriptions.
pub const FORMAT: &str = "lockstep.example.reachability.v1";

/// The reachability family (see the crate documentation).
#[derive(Clone, Copy, Debug, Default)]
pub struct Reachability;

/// An export of collection `collection_id`: the distances from `root`.
pub fn describe(collection_id: u64, root: i64) -> Export {
    Export {
        collection_id,
        description: root.to_le_bytes().to_vec(),
    }
}

/// The root an export's description holds ([`describe`]'s inverse).
pub fn root(e: &Export) -> Result<i64, InvalidDataflow> {
    let bytes: [u8; 8] =
        e.description
            .as_slice()
            .try_into()
            .map_err(|_| InvalidDataflow::Description {
                export: e.collection_id,
                reason: format!(
                "export {}'s description is {} bytes; a {FORMAT} root is 8 (i64, little-endian)",
                e.collection_id,
                e.description.len()
            ),
            })?;
    Ok(i64::from_le_bytes(bytes))
}

/// Roots of the exports, in export order; each prepared dataflow reads one
/// input, the edges.
struct Roots {
    edges: u64,
    roots: Vec<(u64, i64)>,
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
            .flat_map(|row: Vec<i64>| match row[..] {
                [src, dst] => Some((src, dst)),
                _ => None,
            });
        self.roots
            .iter()
            .map(|&(collection, root)| {
                let scope = edges.inner.scope();
                // The root, at distance 0, from the dataflow's first time
                // on (every worker introduces it; `reduce` keeps one).
                let start = vec![((root, 0i64), 0u64, 1i64)]
                    .to_stream(scope)
                    .as_collection();
                let edges = edges.clone();
                let distances = start.clone().iterate(|scope, dists| {
                    let edges = edges.enter(scope);
                    let start = start.enter(scope);
                    dists
                        .join_map(edges, |_src, d, dst| (*dst, d + 1))
                        .concat(start)
                        .reduce(|_node, ds, out| out.push((*ds[0].0, 1)))
                });
                (collection, distances.map(|(node, d)| vec![node, d]))
            })
            .collect()
    }
}

/// The distances from `root` over the edges `updates` hold at time `t`
/// (an edge is there when its multiplicity up to `t` is positive): what an
/// export of this family holds, as `[node, distance]` rows.
pub fn reference(updates: &[lockstep_protocol::Update], root: i64, t: u64) -> BTreeSet<Vec<i64>> {
    let mut counts: BTreeMap<(i64, i64), i64> = BTreeMap::new();
    for u in updates.iter().filter(|u| u.time <= t) {
        if let [src, dst] = u.row[..] {
            *counts.entry((src, dst)).or_insert(0) += u.diff;
        }
    }
    let mut out_edges: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for ((src, dst), c) in counts {
        if c > 0 {
            out_edges.entry(src).or_default().push(dst);
        }
    }
    let mut dist = BTreeMap::from([(root, 0i64)]);
    let mut queue = VecDeque::from([root]);
    while let Some(n) = queue.pop_front() {
        let d = dist[&n];
        for &m in out_edges.get(&n).into_iter().flatten() {
            dist.entry(m).or_insert_with(|| {
                queue.push_back(m);
                d + 1
            });
        }
    }
    dist.into_iter().map(|(n, d)| vec![n, d]).collect()
}
