//! The campaign's seeded generator and its model of what was asked and
//! answered: the operations of a seed, the writes with their fates, the
//! dataflows, and the answers to check against the reference.

use std::collections::BTreeMap;

use lockstep_plan::reference::{evaluate, Multiset};
use lockstep_plan::text::parse_plan;
use lockstep_plan::Plan;
use lockstep_protocol::Update;

/// splitmix64: a tiny, seeded, portable generator (the same sequence on
/// every machine, so a seed replays).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The generator of operation `index` of `seed`: its details do not
    /// depend on which other operations run (so a shrunk history replays).
    pub fn for_op(seed: u64, index: usize) -> Rng {
        let mut r = Rng(seed ^ 0x5eed_0f0b_5eed_0f0b);
        for _ in 0..=(index % 7) {
            r.next_u64();
        }
        Rng(r.next_u64() ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// The input collections the campaign writes.
pub const INPUTS: [u64; 3] = [1, 2, 3];

/// The identity dataflow of input `k` exports this collection.
pub fn identity_collection(k: u64) -> u64 {
    1000 + k
}

/// One step of a seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Create a random dataflow.
    Create,
    /// Drop a random live dataflow (never an identity one).
    Drop,
    /// Write inserts and retractions to an input, advancing its upper.
    Write,
    /// Peek a random live dataflow.
    Peek,
    /// Subscribe to a random live dataflow and read its snapshot.
    Subscribe,
    /// Subscribe to a random live dataflow, read its snapshot, kill -9 the
    /// environment, write, and resume the subscription after the snapshot's
    /// time: the snapshot plus the resumed changes must be the collection
    /// at the newer time (exactly once: no gap, no duplicate).
    ResumeSubscribe,
    /// kill -9 the environment while idle, and start it again.
    KillEnv,
    /// kill -9 the environment with a request (write, create, drop) in flight.
    KillEnvInFlight,
    /// The environment's controller crashes part-way through a broadcast
    /// (failpoint `controller_partial_broadcast`), then kill -9 and restart.
    PartialBroadcast,
    /// kill -9 one replica process.
    KillProcess,
    /// SIGSTOP one replica process, then SIGCONT it.
    StopCont,
    /// Swap the distribution policy at run time (SetPolicy).
    SwapPolicy,
    /// kill -9 every process of the replica (a restart of the replica).
    RestartReplica,
    /// Restart the PostgreSQL server under a `--store` environment, with a
    /// write in flight (`@postgres` variants only).
    RestartStore,
    /// Cut a simulated host's control or mesh link for a while, then heal
    /// it (`@hosts` variants only).
    CutLink,
    /// Resize the replica or upgrade it keeping its reads answered, with a
    /// fault part-way (`+reconfigure` variants only).
    Reconfigure,
}

impl Op {
    pub fn is_fault(self) -> bool {
        matches!(
            self,
            Op::KillEnv
                | Op::ResumeSubscribe
                | Op::KillEnvInFlight
                | Op::PartialBroadcast
                | Op::KillProcess
                | Op::StopCont
                | Op::RestartReplica
                | Op::RestartStore
                | Op::CutLink
                | Op::Reconfigure
        )
    }
}

/// What a seed runs: the replica's shape and its operations.
#[derive(Clone, Debug)]
pub struct Plan0 {
    pub processes: u32,
    pub workers: u32,
    pub ops: Vec<Op>,
}

/// The seed's shape and `steps` operations.
pub fn generate(seed: u64, steps: usize) -> Plan0 {
    let mut r = Rng::new(seed);
    let processes = r.range(1, 4) as u32;
    let workers = r.range(1, 2) as u32;
    // Weights out of 100.
    let table: [(Op, u64); 13] = [
        (Op::Write, 26),
        (Op::Peek, 13),
        (Op::ResumeSubscribe, 3),
        (Op::Create, 12),
        (Op::Drop, 7),
        (Op::Subscribe, 4),
        (Op::KillEnv, 5),
        (Op::KillEnvInFlight, 6),
        (Op::PartialBroadcast, 7),
        (Op::KillProcess, 5),
        (Op::StopCont, 4),
        (Op::SwapPolicy, 5),
        (Op::RestartReplica, 3),
    ];
    let total: u64 = table.iter().map(|(_, w)| w).sum();
    let ops = (0..steps)
        .map(|_| {
            let mut x = r.below(total);
            for (op, w) in table {
                if x < w {
                    return op;
                }
                x -= w;
            }
            Op::Write
        })
        .collect();
    Plan0 {
        processes,
        workers,
        ops,
    }
}

/// The seed's compaction lag (`lockstep serve --compaction-lag`), drawn
/// from a stream of its own (so the seed's operations do not change):
/// none, or a small lag that the writes of a fault's recovery pass. A
/// negative control of read holds always has one.
pub fn compaction_lag(seed: u64, holds_off: bool) -> Option<u64> {
    let mut r = Rng::new(seed ^ 0x5851_f42d_4c95_7f2d);
    let lags = [None, Some(1), Some(2), Some(4), Some(16)];
    let from = if holds_off { 1 } else { 0 };
    lags[r.range(from, lags.len() as u64 - 1) as usize]
}

/// A variant's own fault (`place_fault`: a store restart, a link cut) in
/// place of about one operation in 16 of `plan`, drawn from a stream of its
/// own, so the variants without one run exactly the seed's operations.
pub fn with_place_fault(mut plan: Plan0, seed: u64, place_fault: Option<Op>) -> Plan0 {
    if let Some(fault) = place_fault {
        let mut r = Rng::new(seed ^ 0x9e37_79b9_7f4a_7c15);
        for op in plan.ops.iter_mut() {
            if r.below(16) == 0 {
                *op = fault;
            }
        }
    }
    plan
}

/// [`Op::Reconfigure`] in place of about one operation in 12 of `plan`,
/// drawn from a stream of its own (the `+reconfigure` variants).
pub fn with_reconfigurations(mut plan: Plan0, seed: u64) -> Plan0 {
    let mut r = Rng::new(seed ^ 0x5851_f42d_4c95_7f2d);
    for op in plan.ops.iter_mut() {
        if r.below(12) == 0 {
            *op = Op::Reconfigure;
        }
    }
    plan
}

/// A random plan over the inputs, as text (parsed by `parse_plan`).
pub fn random_plan(r: &mut Rng) -> String {
    let a = INPUTS[r.below(3) as usize];
    let b = INPUTS[r.below(3) as usize];
    let v = r.below(30);
    match r.below(9) {
        0 => format!("get({a})"),
        1 => format!("filter(get({a}), #1 > {v})"),
        2 => format!("map(get({a}), #0, add(#1, {v}))"),
        3 => format!("reduce(get({a}), [#0], count, sum(#1))"),
        4 => format!("reduce(filter(get({a}), #1 < {v}), [#0], count)"),
        5 => format!("join(get({a}), get({b}), #0, #0)"),
        6 => format!("reduce(join(get({a}), get({b}), #0, #0), [#0], count, sum(#4))"),
        7 => format!("arrange(get({a}), [#0])"),
        _ => format!("reduce(map(get({a}), #0, mul(#1, 2)), [#0], sum(#1))"),
    }
}

/// The input collections `plan` reads.
pub fn plan_inputs(plan: &Plan) -> Vec<u64> {
    let mut out = plan.inputs();
    out.sort();
    out.dedup();
    out
}

pub fn parse(text: &str) -> Result<Plan, String> {
    parse_plan(text).map_err(|e| format!("the campaign's own plan {text:?}: {e}"))
}

/// What came of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Answered with success.
    Acked,
    /// Refused before anything was written.
    Absent,
    /// No answer (the environment died, a deadline passed): it may or may
    /// not have taken effect, wholly.
    Unknown,
    /// Unknown, then found in (true) or out (false) of the final state.
    Resolved(bool),
}

impl Fate {
    /// Whether the request took effect, once resolved.
    pub fn visible(self) -> bool {
        matches!(self, Fate::Acked | Fate::Resolved(true))
    }
}

/// One write: updates at one time `time`, upper `time + 1`. Its first
/// update is an insert of a row unique in the whole run (column 2 is a
/// unique ID), so its fate can be read off the input.
#[derive(Clone, Debug)]
pub struct WriteRec {
    pub op: usize,
    pub input: u64,
    pub time: u64,
    pub updates: Vec<Update>,
    pub fate: Fate,
}

/// A dataflow the campaign created (or tried to).
#[derive(Clone, Debug)]
pub struct DataflowRec {
    pub collection: u64,
    pub text: String,
    pub plan: Plan,
    pub inputs: Vec<u64>,
    /// Catalog ID, once known.
    pub id: Option<u64>,
    /// Whether it is live in the catalog, as far as the campaign knows.
    pub live: bool,
    /// A create or drop whose fate is not known yet.
    pub unknown: bool,
    pub identity: bool,
}

/// An answer to check against the reference.
#[derive(Clone, Debug)]
pub struct Answer {
    pub op: usize,
    pub how: &'static str,
    pub collection: u64,
    pub plan: Plan,
    pub time: u64,
    pub rows: Multiset,
}

/// Everything asked and answered in one seed.
#[derive(Debug, Default)]
pub struct World {
    pub writes: Vec<WriteRec>,
    pub dataflows: Vec<DataflowRec>,
    pub answers: Vec<Answer>,
    /// The next write time per input.
    pub next_time: BTreeMap<u64, u64>,
    /// The highest acknowledged upper per input.
    pub acked_upper: BTreeMap<u64, u64>,
    /// Rows of acknowledged inserts that may still be retracted (each is
    /// retracted at most once, so every write's effect stays distinct).
    pub retractable: BTreeMap<u64, Vec<lockstep_protocol::Row>>,
    pub next_uid: i64,
    pub next_collection: u64,
    /// One line per request and answer.
    pub history: Vec<String>,
}

impl World {
    pub fn new() -> World {
        World {
            next_collection: 2000,
            next_uid: 1,
            ..Default::default()
        }
    }

    pub fn log(&mut self, line: String) {
        self.history.push(line);
    }

    /// A new write to `input`: 1-4 inserts and up to 2 retractions of
    /// acknowledged rows.
    pub fn new_write(&mut self, op: usize, input: u64, r: &mut Rng) -> WriteRec {
        let time = *self.next_time.entry(input).or_insert(0);
        self.next_time.insert(input, time + 1);
        let mut updates = Vec::new();
        for _ in 0..r.range(1, 4) {
            let uid = self.next_uid;
            self.next_uid += 1;
            updates.push(Update {
                row: lockstep_plan::row(&[r.below(5) as i64, r.below(30) as i64, uid]),
                time,
                diff: 1,
            });
        }
        let pool = self.retractable.entry(input).or_default();
        for _ in 0..r.below(3) {
            if pool.is_empty() {
                break;
            }
            let row = pool.swap_remove(r.below(pool.len() as u64) as usize);
            updates.push(Update {
                row,
                time,
                diff: -1,
            });
        }
        WriteRec {
            op,
            input,
            time,
            updates,
            fate: Fate::Unknown,
        }
    }

    /// Records `w` with its fate.
    pub fn record_write(&mut self, mut w: WriteRec, fate: Fate) {
        w.fate = fate;
        if fate == Fate::Acked {
            let up = self.acked_upper.entry(w.input).or_insert(0);
            *up = (*up).max(w.time + 1);
            let pool = self.retractable.entry(w.input).or_default();
            pool.extend(
                w.updates
                    .iter()
                    .filter(|u| u.diff > 0)
                    .map(|u| u.row.clone()),
            );
        }
        self.writes.push(w);
    }

    /// Records answer `rows` of operation `op` (`how`) to `d` at `time`,
    /// for the reference to check, and logs it.
    pub fn answer(
        &mut self,
        op: usize,
        how: &'static str,
        d: &DataflowRec,
        time: u64,
        rows: Multiset,
    ) {
        self.log(format!(
            "{op} {how} {} at {time}: {} rows",
            d.collection,
            rows.len()
        ));
        self.answers.push(Answer {
            op,
            how,
            collection: d.collection,
            plan: d.plan.clone(),
            time,
            rows,
        });
    }

    /// The time to read `inputs` at: below every acknowledged upper.
    pub fn read_time(&self, inputs: &[u64]) -> Option<u64> {
        inputs
            .iter()
            .map(|k| self.acked_upper.get(k).copied().unwrap_or(0))
            .min()
            .and_then(|u| u.checked_sub(1))
    }

    /// The inputs as the reference sees them: the visible writes (unknown
    /// ones counted in if `unknown_in`).
    pub fn reference_inputs(&self, unknown_in: bool) -> BTreeMap<u64, Vec<Update>> {
        let mut m: BTreeMap<u64, Vec<Update>> = BTreeMap::new();
        for w in &self.writes {
            let vis = match w.fate {
                Fate::Unknown => unknown_in,
                f => f.visible(),
            };
            if vis {
                m.entry(w.input)
                    .or_default()
                    .extend(w.updates.iter().cloned());
            }
        }
        m
    }

    pub fn reference(&self, plan: &Plan, t: u64) -> Multiset {
        evaluate(plan, &self.reference_inputs(false), t)
    }

    pub fn live_dataflows(&self, with_identity: bool) -> Vec<usize> {
        (0..self.dataflows.len())
            .filter(|&i| {
                let d = &self.dataflows[i];
                d.live && !d.unknown && d.id.is_some() && (with_identity || !d.identity)
            })
            .collect()
    }
}

/// A multiset from answer rows (summing duplicates, dropping zeros).
pub fn multiset(rows: impl IntoIterator<Item = (lockstep_protocol::Row, i64)>) -> Multiset {
    let mut m = Multiset::new();
    for (row, d) in rows {
        *m.entry(row).or_insert(0) += d;
    }
    m.retain(|_, d| *d != 0);
    m
}

/// A short description of how two multisets differ.
pub fn diff(got: &Multiset, want: &Multiset) -> String {
    let mut extra = Vec::new();
    let mut missing = Vec::new();
    for (row, d) in got {
        let w = want.get(row).copied().unwrap_or(0);
        if *d != w {
            extra.push(format!("{row:?}x{}", d - w));
        }
    }
    for (row, d) in want {
        if !got.contains_key(row) {
            missing.push(format!("{row:?}x{d}"));
        }
    }
    extra.truncate(5);
    missing.truncate(5);
    format!(
        "{} rows, the reference has {}; surplus {:?}, missing {:?}",
        got.len(),
        want.len(),
        extra,
        missing
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_replay() {
        let a = generate(7, 40);
        let b = generate(7, 40);
        assert_eq!(a.ops, b.ops);
        assert_eq!((a.processes, a.workers), (b.processes, b.workers));
        for i in 0..50 {
            let mut r = Rng::new(i);
            assert!(parse(&random_plan(&mut r)).is_ok());
        }
    }
}
