//! Model checking of lockstep's protocols with stateright.
//!
//! Tests on real processes sample faults; a model checker tries every
//! interleaving of deliveries, crashes and dropped connections, for small
//! sizes. That is the cheapest place to find a flaw in collective
//! reconciliation or in an orphan rule, so both live here:
//!
//! - [`compute`]: the compute protocol under each distribution strategy
//!   (naive, broadcast, barrier, log), and with sessions that alternate
//!   between two of them, every pair ([`PAIRS`]; where one is `log`, the
//!   workers' log reads and log-marker hold are the replica's own code),
//!   with invariants I1, I4 and liveness.
//!   Every worker of the model runs the replica's own session machine
//!   (`lockstep_reconcile::WorkerSession`: sessions, buffering,
//!   reconciliation, barrier rounds, halts), and the controller decides
//!   initialization with the controller's own `InitializationGate`: the model
//!   checks the code that runs, not a paraphrase of it. What the model
//!   writes itself is only the I/O around them: channels, the mesh, the
//!   broadcast stream and the command log.
//! - [`orphan`]: three controllers overlapping on a fenced catalog and a
//!   labelled orchestrator, with the real orphan rules from `lockstep-policy`,
//!   and invariants O1, O3, O4 (and O2 in settled states).
//!
//! [`run_variant`] checks one named variant ([`VARIANTS`]) in each of its
//! CI-sized scenarios ([`scenarios`]) and returns a [`VariantReport`] that
//! prints the reporting contract's JSON line; each scenario's [`Report`]
//! holds, for every violated property, the shortest counterexample as a
//! readable trace. The `lockstep-model` binary (what
//! `cargo xtask model` runs) checks them all. The negative controls (`naive`,
//! `catalog-only`) must be caught; every other variant must pass, and must
//! also show its `sometimes` examples, so that a model that does nothing
//! cannot pass.
//!
//! The models are checked against themselves too (`tests/models.rs`): a
//! barrier that reconciles locally, or that waits on a peer that skipped a
//! session, is caught ([`lockstep_reconcile::RoundMutant`]), and so is a
//! worker without the log-marker hold ([`lockstep_reconcile::LogHoldMutant`]);
//! so are an unconditional ensure
//! (O4) and an orchestrator without tombstones (O2). [`EXTRA_VARIANTS`] adds
//! the history check, over naive: with the compacted
//! history digest it is caught, with a digest of everything a process did it
//! passes.
//!
//! Counterexamples are shortest because the search is breadth first on one
//! thread and the first violating path is kept (stateright itself keeps the
//! last one it meets).

pub mod compute;
pub mod orphan;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path, Property};

pub use compute::{ComputeBounds, ComputeModel};
pub use lockstep_protocol::Strategy;
pub use orphan::{OrphanBounds, OrphanModel};

/// How a model explains itself in a trace.
pub trait Explain: Model {
    /// The step `action` taken from `state`, in words.
    fn describe_step(&self, state: &Self::State, action: &Self::Action) -> String;
    /// The state in one line.
    fn summarize(&self, state: &Self::State) -> String;
    /// What is broken in `state`, if anything.
    fn broken(&self, state: &Self::State) -> Vec<String>;
}

impl Explain for ComputeModel {
    fn describe_step(&self, s: &Self::State, a: &Self::Action) -> String {
        self.describe(s, a)
    }
    fn summarize(&self, s: &Self::State) -> String {
        self.summary(s)
    }
    fn broken(&self, s: &Self::State) -> Vec<String> {
        let mut out = Vec::new();
        if let Err(e) = self.check_i1(s) {
            out.push(e);
        }
        if let Err(e) = self.check_i4(s) {
            out.push(e);
        }
        if self.then.is_some() {
            if let Err(e) = self.check_no_halt(s) {
                out.push(e);
            }
        }
        if !self.target_reachable(s) {
            out.push(
                "I2 broken: from this state no fault-free continuation reaches the target".into(),
            );
        }
        out
    }
}

impl Explain for OrphanModel {
    fn describe_step(&self, s: &Self::State, a: &Self::Action) -> String {
        self.describe(s, a)
    }
    fn summarize(&self, s: &Self::State) -> String {
        self.summary(s)
    }
    fn broken(&self, s: &Self::State) -> Vec<String> {
        let mut out: Vec<String> = s
            .violations
            .iter()
            .map(|(inv, what)| format!("{inv:?} broken: {what}"))
            .collect();
        if let Err(e) = self.check_o2(s) {
            out.push(e);
        }
        out
    }
}

/// A property the checker found violated, with its shortest counterexample.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The property's name.
    pub property: &'static str,
    /// Steps in the counterexample.
    pub steps: usize,
    /// The counterexample, one numbered step per line, then what broke.
    pub trace: String,
}

/// The result of checking one variant.
#[derive(Clone, Debug)]
pub struct Report {
    /// The variant's name.
    pub variant: &'static str,
    /// The bounds, in words.
    pub bounds: String,
    /// Unique states explored.
    pub states: usize,
    /// Whether this variant is a negative control that must be caught.
    pub negative_control: bool,
    /// Violated properties, in property order.
    pub violations: Vec<Violation>,
    /// `sometimes` properties with no example (a vacuous model).
    pub missing_examples: Vec<&'static str>,
    /// Wall-clock seconds.
    pub seconds: f64,
}

impl Report {
    /// Whether the variant met its expectation: a negative control was
    /// caught; any other variant had no violation and every example.
    pub fn ok(&self) -> bool {
        if self.negative_control {
            !self.violations.is_empty()
        } else {
            self.violations.is_empty() && self.missing_examples.is_empty()
        }
    }

    /// The reporting contract's line (suite `model`, one scenario per variant).
    pub fn json(&self) -> String {
        let passed = usize::from(self.violations.is_empty() && self.missing_examples.is_empty());
        let mut line = format!(
            r#"{{"suite":"model","variant":"{}","scenarios":1,"passed":{},"failed":{},"states":{}"#,
            self.variant,
            passed,
            1 - passed,
            self.states
        );
        if self.negative_control {
            line.push_str(&format!(r#","caught":{}"#, !self.violations.is_empty()));
        }
        line.push('}');
        line
    }
}

/// Threads for a variant that must pass (no shortest trace to keep).
const MUST_PASS_THREADS: usize = 2;

/// The first violating path found for each property, by name.
type FirstPaths<M> =
    Arc<Mutex<BTreeMap<&'static str, Path<<M as Model>::State, <M as Model>::Action>>>>;

/// Checks `model` exhaustively, breadth first, and reports.
///
/// A negative control is checked on one thread with a visitor that records
/// the first violating path of each property, so its counterexample is a
/// shortest one. A variant that must pass explores the same states on two
/// threads with no visitor: the visitor replays each state's whole path from
/// the start (stateright rebuilds a [`Path`] per state), which cost more
/// than the check itself, and it serves only the trace of a violation. Should
/// such a variant fail, its trace is stateright's own discovery (a
/// counterexample, not necessarily a shortest one).
pub fn check<M>(model: M, variant: &'static str, bounds: String, negative_control: bool) -> Report
where
    M: Model + Explain + Clone + Send + Sync + 'static,
    M::State: Hash + Clone + Debug + PartialEq + Send + Sync + 'static,
    M::Action: Clone + Debug + PartialEq + Send + Sync + 'static,
{
    let start = Instant::now();
    let properties = model.properties();
    let first: FirstPaths<M> = Arc::default();
    let builder = model
        .clone()
        .checker()
        .finish_when(HasDiscoveries::AllFailures);
    let checker = if negative_control {
        // stateright keeps the *last* violating path it meets for a
        // property, so the first one (the shortest, since the search is
        // breadth first on one thread) is recorded here, by a visitor that
        // sees every state in order.
        let first = Arc::clone(&first);
        let model = model.clone();
        let failures: Vec<Property<M>> = properties
            .iter()
            .filter(|p| p.expectation != Expectation::Sometimes)
            .cloned()
            .collect();
        let visitor = move |path: Path<M::State, M::Action>| {
            let mut first = first.lock().expect("visitor lock poisoned");
            for p in &failures {
                if !first.contains_key(p.name) && !(p.condition)(&model, path.last_state()) {
                    first.insert(p.name, path.clone());
                }
            }
        };
        builder.threads(1).visitor(visitor).spawn_bfs().join()
    } else {
        builder.threads(MUST_PASS_THREADS).spawn_bfs().join()
    };
    let discoveries = checker.discoveries();
    let first = first.lock().expect("visitor lock poisoned").clone();
    let mut violations = Vec::new();
    let mut missing_examples = Vec::new();
    for p in &properties {
        if p.expectation == Expectation::Sometimes {
            if !discoveries.contains_key(p.name) {
                missing_examples.push(p.name);
            }
            continue;
        }
        let Some(path) = first.get(p.name).or(discoveries.get(p.name)) else {
            continue;
        };
        let steps = path.clone().into_vec();
        let mut trace = String::new();
        for (i, (state, action)) in steps.iter().enumerate() {
            if i == 0 {
                trace.push_str(&format!("   0. start: {}\n", model.summarize(state)));
            }
            if let Some(a) = action {
                let next = &steps[i + 1].0;
                trace.push_str(&format!(
                    "  {:>2}. {}\n      -> {}\n",
                    i + 1,
                    model.describe_step(state, a),
                    model.summarize(next)
                ));
            }
        }
        if let Some((last, _)) = steps.last() {
            for b in model.broken(last) {
                trace.push_str(&format!("  => {b}\n"));
            }
        }
        violations.push(Violation {
            property: p.name,
            steps: steps.len() - 1,
            trace,
        });
    }
    Report {
        variant,
        bounds,
        states: checker.unique_state_count(),
        negative_control,
        violations,
        missing_examples,
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// One scenario: a model and the bounds to check it within.
#[derive(Clone, Copy, Debug)]
pub enum Variant {
    /// The compute model with a strategy.
    Compute(Strategy, ComputeBounds),
    /// The orphan model with a rule.
    Orphan(&'static str, OrphanBounds),
    /// The naive compute model with a history check on reconnect.
    History(compute::HistoryCheck, ComputeBounds),
    /// A flaw planted in a production machine the model runs.
    Mutant(Mutant, ComputeBounds),
    /// The compute model with sessions alternating between two strategies,
    /// the first session's first (`log-then-barrier`, ...).
    Pair(Strategy, Strategy, ComputeBounds),
}

/// A flaw planted in one of the production types the compute model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// In every worker's round book, under the barrier strategy.
    Round(lockstep_reconcile::RoundMutant),
    /// In the controller's history check, over naive delivery.
    Gate(lockstep_reconcile::GateMutant),
    /// In every worker's log-marker hold, under `log-then-barrier`.
    LogHold(lockstep_reconcile::LogHoldMutant),
    /// In the controller's delivery decisions, under `log-then-barrier`.
    Delivery(lockstep_reconcile::DeliveryMutant),
}

/// The bounds the mutants are checked within: small, and enough for each
/// to show (a restart between two creates; a partial drop wanted again).
const MUTANT_BOUNDS: ComputeBounds = ComputeBounds {
    processes: 2,
    dataflows: 2,
    commands: 3,
    faults: 1,
};

/// The mutant variants: each must be caught.
pub const MUTANT_VARIANTS: [&str; 6] = [
    "mutant-overwrite-reports",
    "mutant-local-reconcile-under-barrier",
    "mutant-skip-barrier",
    "mutant-complete-before-history-check",
    "mutant-no-log-hold",
    "mutant-no-session-marker",
];

/// The planted flaw of a mutant variant.
pub fn mutant(name: &str) -> Option<Mutant> {
    if name == lockstep_reconcile::GateMutant::NAME {
        return Some(Mutant::Gate(
            lockstep_reconcile::GateMutant::CompleteBeforeHistoryCheck,
        ));
    }
    if name == lockstep_reconcile::LogHoldMutant::NAME {
        return Some(Mutant::LogHold(lockstep_reconcile::LogHoldMutant::NoHold));
    }
    if name == lockstep_reconcile::DeliveryMutant::NAME {
        return Some(Mutant::Delivery(
            lockstep_reconcile::DeliveryMutant::NoMarker,
        ));
    }
    lockstep_reconcile::RoundMutant::ALL
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(m, _)| Mutant::Round(*m))
}

/// The compute model's CI scenarios: two processes with more commands and
/// faults, three processes with fewer, and a pool with A' (A's ID with
/// another description) so that a changed description is reconciled too.
const COMPUTE: [ComputeBounds; 3] = [
    ComputeBounds {
        processes: 2,
        dataflows: 2,
        commands: 3,
        faults: 2,
    },
    ComputeBounds {
        processes: 3,
        dataflows: 2,
        commands: 2,
        faults: 1,
    },
    ComputeBounds {
        processes: 2,
        dataflows: 3,
        commands: 3,
        faults: 1,
    },
];

/// The orphan model's CI scenario.
const ORPHANS: OrphanBounds = OrphanBounds {
    controllers: 3,
    serve_ops: 4,
    crashes: 2,
};

/// Every pair of the strategies that protect lockstep, as a variant whose
/// sessions alternate between the two (the first session's first). Two
/// faults give both orders (first, then, first again), so each unordered
/// pair is one variant. Naive follows another strategy only as
/// `history-full-collective` (naive upgraded to barrier), a control.
pub const PAIRS: [(&str, Strategy, Strategy); 3] = [
    ("log-then-barrier", Strategy::Log, Strategy::Barrier),
    ("log-then-broadcast", Strategy::Log, Strategy::Broadcast),
    (
        "barrier-then-broadcast",
        Strategy::Barrier,
        Strategy::Broadcast,
    ),
];

/// The scenarios of a pair ([`PAIRS`]): a session switch (a controller
/// crash and restart, a dropped connection, a replica restart) cuts a
/// session that some worker has not read to its end (the log's, the
/// sequencer's stream) or whose last socket copies some worker has not
/// received. Two faults (first, then, first again) with two commands; one
/// fault with three; three processes with one command.
const PAIR_BOUNDS: [ComputeBounds; 3] = [
    ComputeBounds {
        processes: 2,
        dataflows: 2,
        commands: 2,
        faults: 2,
    },
    ComputeBounds {
        processes: 2,
        dataflows: 2,
        commands: 3,
        faults: 1,
    },
    ComputeBounds {
        processes: 3,
        dataflows: 2,
        commands: 1,
        faults: 1,
    },
];

/// Every variant `cargo xtask model` checks, in report order.
pub const VARIANTS: [&str; 17] = [
    "naive",
    "broadcast",
    "barrier",
    "log",
    PAIRS[0].0,
    PAIRS[1].0,
    PAIRS[2].0,
    "history-full-collective",
    "epoch",
    "id-watermark",
    "catalog-only",
    MUTANT_VARIANTS[0],
    MUTANT_VARIANTS[1],
    MUTANT_VARIANTS[2],
    MUTANT_VARIANTS[3],
    MUTANT_VARIANTS[4],
    MUTANT_VARIANTS[5],
];

/// Variants checked only when named (not part of the CI report): the history
/// check on top of naive, with the compacted history
/// digest the protocol crate computes (a negative control: it misses a
/// dataflow one process built and dropped and another never built) and with a
/// digest of everything a process did.
pub const EXTRA_VARIANTS: [&str; 2] = ["history-compacted", "history-full"];

/// Whether a variant is a negative control (must be caught).
pub fn is_negative_control(name: &str) -> bool {
    matches!(
        name,
        "naive" | "catalog-only" | "history-compacted" | "history-full-collective"
    ) || name.starts_with("mutant-")
}

/// The CI scenarios of a variant of [`VARIANTS`], if the name is one.
pub fn scenarios(name: &str) -> Option<Vec<Variant>> {
    if let Some(m) = mutant(name) {
        return Some(vec![Variant::Mutant(m, MUTANT_BOUNDS)]);
    }
    let strategy = match name {
        "naive" => Strategy::Naive,
        "broadcast" => Strategy::Broadcast,
        "barrier" => Strategy::Barrier,
        "log" => Strategy::Log,
        pair if PAIRS.iter().any(|(name, ..)| *name == pair) => {
            let (_, first, then) = PAIRS.iter().find(|(name, ..)| *name == pair)?;
            return Some(
                PAIR_BOUNDS
                    .iter()
                    .map(|b| Variant::Pair(*first, *then, *b))
                    .collect(),
            );
        }
        "epoch" => return Some(vec![Variant::Orphan("epoch", ORPHANS)]),
        "id-watermark" => return Some(vec![Variant::Orphan("id-watermark", ORPHANS)]),
        "catalog-only" => return Some(vec![Variant::Orphan("catalog-only", ORPHANS)]),
        // The naive→barrier upgrade, a negative control: why a naive
        // session's mismatch restarts the replica. Caught within the first
        // scenario's bounds (two faults), the only one it runs.
        "history-full-collective" => {
            return Some(vec![Variant::History(
                compute::HistoryCheck::FullCollective,
                COMPUTE[0],
            )])
        }
        "history-compacted" | "history-full" => {
            let check = match name {
                "history-full" => compute::HistoryCheck::Full,
                _ => compute::HistoryCheck::Compacted,
            };
            return Some(
                COMPUTE
                    .iter()
                    .map(|b| Variant::History(check, *b))
                    .collect(),
            );
        }
        _ => return None,
    };
    Some(
        COMPUTE
            .iter()
            .map(|b| Variant::Compute(strategy, *b))
            .collect(),
    )
}

/// Checks one scenario of a variant.
pub fn run(name: &'static str, variant: Variant) -> Report {
    let negative = is_negative_control(name);
    match variant {
        Variant::Compute(strategy, bounds) => check(
            ComputeModel::new(strategy, bounds),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::Orphan(rule, bounds) => check(
            OrphanModel::new(rule, bounds),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::History(history, bounds) => check(
            ComputeModel::new(Strategy::Naive, bounds).with_history_check(history),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::Mutant(Mutant::Round(m), bounds) => check(
            ComputeModel::new(Strategy::Barrier, bounds).with_mutant(m),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::Pair(first, then, bounds) => check(
            ComputeModel::alternating(first, then, bounds),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::Mutant(Mutant::LogHold(m), bounds) => check(
            ComputeModel::log_then(Strategy::Barrier, bounds).with_log_hold_mutant(m),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::Mutant(Mutant::Delivery(m), bounds) => check(
            ComputeModel::log_then(Strategy::Barrier, bounds).with_delivery_mutant(m),
            name,
            bounds.to_string(),
            negative,
        ),
        Variant::Mutant(Mutant::Gate(m), bounds) => check(
            ComputeModel::new(Strategy::Naive, bounds)
                .with_history_check(compute::HistoryCheck::Full)
                .with_gate_mutant(m),
            name,
            bounds.to_string(),
            negative,
        ),
    }
}

/// The results of every scenario of one variant.
#[derive(Clone, Debug)]
pub struct VariantReport {
    /// The variant's name.
    pub variant: &'static str,
    /// Whether it is a negative control.
    pub negative_control: bool,
    /// One report per scenario.
    pub scenarios: Vec<Report>,
}

impl VariantReport {
    /// A negative control is caught when every scenario caught it.
    pub fn caught(&self) -> bool {
        self.scenarios.iter().all(|r| !r.violations.is_empty())
    }

    /// Whether every scenario met its expectation.
    pub fn ok(&self) -> bool {
        self.scenarios.iter().all(Report::ok)
    }

    /// The reporting contract's line for the variant: scenarios that found no
    /// violation (and every example) passed; `states` sums the scenarios.
    pub fn json(&self) -> String {
        let passed = self
            .scenarios
            .iter()
            .filter(|r| r.violations.is_empty() && r.missing_examples.is_empty())
            .count();
        let states: usize = self.scenarios.iter().map(|r| r.states).sum();
        let mut line = format!(
            r#"{{"suite":"model","variant":"{}","scenarios":{},"passed":{},"failed":{},"states":{}"#,
            self.variant,
            self.scenarios.len(),
            passed,
            self.scenarios.len() - passed,
            states
        );
        if self.negative_control {
            line.push_str(&format!(r#","caught":{}"#, self.caught()));
        }
        line.push('}');
        line
    }
}

/// Checks every CI scenario of the variant of [`VARIANTS`] with this name.
pub fn run_variant(name: &str) -> Option<VariantReport> {
    let name = *VARIANTS
        .iter()
        .chain(&EXTRA_VARIANTS)
        .find(|n| **n == name)?;
    let scenarios = scenarios(name)?.into_iter().map(|v| run(name, v)).collect();
    Some(VariantReport {
        variant: name,
        negative_control: is_negative_control(name),
        scenarios,
    })
}
