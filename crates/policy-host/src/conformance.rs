//! The conformance check: runs a policy file through table scenarios and
//! reports in the reporting contract of docs/invariants.md.
//!
//! `lockstep policy check FILE` is meant to be a thin wrapper:
//!
//! ```no_run
//! let lines = lockstep_policy_host::conformance::check("my-policy.wasm")?;
//! print!("{}", lockstep_policy_host::conformance::report(&lines));
//! let ok = lines.iter().all(|l| l.ok());
//! std::process::exit(if ok { 0 } else { 1 });
//! # Ok::<(), lockstep_policy_host::LoadError>(())
//! ```
//!
//! The kind of policy is detected from the world it implements:
//!
//! - **orphans**: the seed's three-controller timeline (envd@1, @2, @3 from
//!   one catalog, with stale controllers seeing newer epochs, labels that
//!   went backwards, and replicas a newer controller created) where no
//!   service the newest catalog holds may be deleted (O1), and normal starts
//!   where every orphan must go (O2) and the controller must not halt;
//! - **distribution**: every command class, in and out of reconciliation,
//!   gets a strategy, the same one when asked twice, and history mismatches
//!   get an action. (The distribution fault suite runs separately.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use lockstep_policy::{
    CatalogView, CommandClass, CommandInfo, DistributionPolicy, MismatchInfo, OrphanDecision,
    OrphanPolicy, Service,
};

use crate::{
    check_decision, detect_kind, policy_name, Limits, LoadError, PolicyKind,
    WasmDistributionPolicy, WasmOrphanPolicy,
};

/// The suite name in report lines.
pub const SUITE: &str = "policy-conformance";

/// One summary line of the reporting contract, and what broke.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuiteLine {
    /// The suite (`policy-conformance`).
    pub suite: String,
    /// The policy's name (its file name without `.wasm`).
    pub variant: String,
    /// The world the policy implements.
    pub kind: PolicyKind,
    /// Scenarios run.
    pub scenarios: usize,
    /// Scenarios passed.
    pub passed: usize,
    /// Scenarios failed.
    pub failed: usize,
    /// One line per failed scenario: which scenario, which invariant, what
    /// the policy answered.
    pub failures: Vec<String>,
}

impl SuiteLine {
    /// Whether every scenario passed.
    pub fn ok(&self) -> bool {
        self.failed == 0
    }

    /// The reporting contract's JSON object, on one line:
    /// `{"suite":"policy-conformance","variant":"epoch","scenarios":12,"passed":12,"failed":0}`.
    pub fn to_json(&self) -> String {
        /// The line's fields, in the contract's order.
        #[derive(serde::Serialize)]
        struct Line<'a> {
            suite: &'a str,
            variant: &'a str,
            scenarios: usize,
            passed: usize,
            failed: usize,
        }
        serde_json::to_string(&Line {
            suite: &self.suite,
            variant: &self.variant,
            scenarios: self.scenarios,
            passed: self.passed,
            failed: self.failed,
        })
        .expect("a summary line serializes")
    }

    /// A line from the results of its scenarios (`Err`: what broke).
    pub fn from_results(variant: &str, kind: PolicyKind, results: Vec<Result<(), String>>) -> Self {
        let scenarios = results.len();
        let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        Self {
            suite: SUITE.to_string(),
            variant: variant.to_string(),
            kind,
            scenarios,
            passed: scenarios - failures.len(),
            failed: failures.len(),
            failures,
        }
    }
}

impl std::fmt::Display for SuiteLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_json())
    }
}

/// The report as the contract prints it: each failure on a line of its own
/// above its summary, then one JSON line per suite and variant. Ends with a
/// newline.
pub fn report(lines: &[SuiteLine]) -> String {
    let mut out = String::new();
    for line in lines {
        for failure in &line.failures {
            // One line per failure, even when a panic message spans several.
            let failure = failure.replace('\n', " ");
            out.push_str(&format!("{SUITE} {}: FAILED {failure}\n", line.variant));
        }
        out.push_str(&line.to_json());
        out.push('\n');
    }
    out
}

/// Loads the policy at `path` with [`Limits::default`], detects its kind
/// and runs that kind's scenarios. `Err` only if it cannot be loaded; a
/// policy that loads but fails scenarios gives lines with `failed > 0`.
pub fn check(path: impl AsRef<Path>) -> Result<Vec<SuiteLine>, LoadError> {
    check_with(path, Limits::default())
}

/// [`check`] with explicit limits.
pub fn check_with(path: impl AsRef<Path>, limits: Limits) -> Result<Vec<SuiteLine>, LoadError> {
    let path = path.as_ref();
    let variant = policy_name(path);
    Ok(vec![match detect_kind(path)? {
        PolicyKind::Distribution => {
            let mut p = WasmDistributionPolicy::load(path, limits)?;
            check_distribution(&mut p, &variant)
        }
        PolicyKind::Orphans => {
            let mut p = WasmOrphanPolicy::load(path, limits)?;
            check_orphans(&mut p, &variant)
        }
    }])
}

// ---------------------------------------------------------------- orphans

/// One orphan scenario: what is listed, what the controller's catalog says,
/// and what a correct answer must (not) do.
struct OrphanScenario {
    name: &'static str,
    services: Vec<Service>,
    view: CatalogView,
    /// IDs the newest controller's catalog holds: never deleted (O1).
    must_keep: Vec<u64>,
    /// True orphans this controller must delete (O2); only when it is the
    /// newest controller.
    must_delete: Vec<u64>,
    /// Whether halting is an acceptable answer (only for stale controllers).
    may_halt: bool,
}

fn svc(id: u64, epoch: u64) -> Service {
    Service {
        id,
        name: format!("replica-{id}"),
        epoch,
        labels: BTreeMap::new(),
    }
}

fn view(keep: &[u64], our_epoch: u64, next_id: u64) -> CatalogView {
    CatalogView {
        keep: keep.iter().copied().collect(),
        our_epoch,
        next_id,
    }
}

fn orphan_scenarios() -> Vec<OrphanScenario> {
    let mut labelled = svc(3, 2);
    labelled
        .labels
        .insert("lockstep.io/kind".to_string(), "replica".to_string());
    labelled
        .labels
        .insert("lockstep.io/cluster".to_string(), "default".to_string());
    vec![
        // Normal starts: we are the newest controller.
        OrphanScenario {
            name: "normal start: orphans of older epochs are deleted",
            services: vec![svc(1, 4), svc(2, 5), svc(3, 3), svc(4, 4)],
            view: view(&[1, 2], 5, 10),
            must_keep: vec![1, 2],
            must_delete: vec![3, 4],
            may_halt: false,
        },
        OrphanScenario {
            name: "normal start: nothing listed",
            services: vec![],
            view: view(&[1], 2, 2),
            must_keep: vec![],
            must_delete: vec![],
            may_halt: false,
        },
        OrphanScenario {
            name: "normal start: every service is wanted",
            services: vec![svc(1, 4), svc(2, 4)],
            view: view(&[1, 2], 5, 3),
            must_keep: vec![1, 2],
            must_delete: vec![],
            may_halt: false,
        },
        OrphanScenario {
            name: "normal start: an orphan with other labels is deleted",
            services: vec![svc(1, 3), labelled],
            view: view(&[1], 3, 5),
            must_keep: vec![1],
            must_delete: vec![3],
            may_halt: false,
        },
        OrphanScenario {
            name: "crash after the catalog dropped a replica: the orphan goes on restart",
            services: vec![svc(1, 1), svc(2, 1)],
            view: view(&[1], 2, 3),
            must_keep: vec![1],
            must_delete: vec![2],
            may_halt: false,
        },
        // The seed's timeline: envd@1, @2, @3 load the same catalog {r1}
        // (next ID 2) and each ensures r1.
        OrphanScenario {
            name: "three controllers: envd@3 (newest) sees r1 it ensured",
            services: vec![svc(1, 3)],
            view: view(&[1], 3, 2),
            must_keep: vec![1],
            must_delete: vec![],
            may_halt: false,
        },
        OrphanScenario {
            name: "three controllers: envd@3 (newest) sees r1 relabelled by envd@1",
            services: vec![svc(1, 1)],
            view: view(&[1], 3, 2),
            must_keep: vec![1],
            must_delete: vec![],
            may_halt: false,
        },
        OrphanScenario {
            name: "three controllers: envd@2 sees r1 ensured by envd@3",
            services: vec![svc(1, 3)],
            view: view(&[1], 2, 2),
            must_keep: vec![1],
            must_delete: vec![],
            may_halt: true,
        },
        OrphanScenario {
            name: "three controllers: envd@2 sees r1 relabelled back by envd@1",
            services: vec![svc(1, 1)],
            view: view(&[1], 2, 2),
            must_keep: vec![1],
            must_delete: vec![],
            may_halt: true,
        },
        OrphanScenario {
            name: "three controllers: envd@1 sees r1 ensured by envd@3",
            services: vec![svc(1, 3)],
            view: view(&[1], 1, 2),
            must_keep: vec![1],
            must_delete: vec![],
            may_halt: true,
        },
        OrphanScenario {
            name: "three controllers: envd@2 sees r2, created by envd@3 after it served",
            services: vec![svc(1, 3), svc(2, 3)],
            view: view(&[1], 2, 2),
            must_keep: vec![1, 2],
            must_delete: vec![],
            may_halt: true,
        },
        OrphanScenario {
            name: "three controllers: envd@1 sees r2 and r3, created by envd@3",
            services: vec![svc(1, 3), svc(2, 3), svc(3, 3)],
            view: view(&[1], 1, 2),
            must_keep: vec![1, 2, 3],
            must_delete: vec![],
            may_halt: true,
        },
    ]
}

fn run_orphan_scenario(policy: &mut dyn OrphanPolicy, s: &OrphanScenario) -> Result<(), String> {
    let fail = |what: String| Err(format!("scenario \"{}\": {what}", s.name));
    let decision = match policy.classify(&s.services, &s.view) {
        Ok(d) => d,
        Err(e) => return fail(format!("no answer: {e}")),
    };
    if let Err(e) = check_decision(&s.services, &s.view, &decision) {
        return fail(format!("nonsense answer: {e}"));
    }
    match decision {
        OrphanDecision::Halt(reason) if !s.may_halt => fail(format!(
            "O2: the newest controller halted instead of removing orphans ({reason})"
        )),
        OrphanDecision::Halt(_) => Ok(()),
        OrphanDecision::Delete(ids) => {
            let deleted: BTreeSet<u64> = ids.into_iter().collect();
            let wrongly: Vec<u64> = s
                .must_keep
                .iter()
                .copied()
                .filter(|id| deleted.contains(id))
                .collect();
            if !wrongly.is_empty() {
                return fail(format!(
                    "O1: deleted {wrongly:?}, which the newest controller's catalog holds"
                ));
            }
            let left: Vec<u64> = s
                .must_delete
                .iter()
                .copied()
                .filter(|id| !deleted.contains(id))
                .collect();
            if !left.is_empty() {
                return fail(format!("O2: left the orphans {left:?} in place"));
            }
            Ok(())
        }
    }
}

/// Runs the orphan scenarios against any orphan policy, native or WASM.
/// The native `CatalogOnlyRule` fails them (O1): the check can fail.
pub fn check_orphans(policy: &mut dyn OrphanPolicy, variant: &str) -> SuiteLine {
    let results = orphan_scenarios()
        .iter()
        .map(|s| run_orphan_scenario(policy, s))
        .collect();
    SuiteLine::from_results(variant, PolicyKind::Orphans, results)
}

// ----------------------------------------------------------- distribution

const CLASSES: [CommandClass; 12] = CommandClass::ALL;

/// Runs the distribution scenarios against any distribution policy: every
/// command class, in and out of reconciliation, gets a strategy, and the
/// same one when asked again; every history mismatch gets an action.
pub fn check_distribution(policy: &mut dyn DistributionPolicy, variant: &str) -> SuiteLine {
    let mut results = Vec::new();
    for class in CLASSES {
        for reconciling in [false, true] {
            let dataflow = matches!(
                class,
                CommandClass::CreateDataflow
                    | CommandClass::Schedule
                    | CommandClass::AllowCompaction
                    | CommandClass::Peek
                    | CommandClass::Subscribe
            );
            let info = CommandInfo {
                class,
                size_bytes: if class == CommandClass::WriteInput {
                    64 << 20
                } else {
                    128
                },
                dataflow_id: dataflow.then_some(7),
                process_count: 2,
                workers_per_process: 2,
                reconciling,
            };
            let name = format!(
                "{class:?}{}",
                if reconciling {
                    " while reconciling"
                } else {
                    ""
                }
            );
            let result = match (policy.choose(&info), policy.choose(&info)) {
                (Ok(a), Ok(b)) if a == b => Ok(()),
                (Ok(a), Ok(b)) => Err(format!(
                    "scenario \"{name}\": answered {a} then {b} for the same command"
                )),
                (Err(e), _) | (_, Err(e)) => Err(format!("scenario \"{name}\": no strategy: {e}")),
            };
            results.push(result);
        }
    }
    for (process_count, distinct_digests, matching_controller) in
        [(2, 2, 1), (2, 2, 0), (4, 3, 1), (8, 8, 0)]
    {
        let info = MismatchInfo {
            process_count,
            distinct_digests,
            matching_controller,
        };
        results.push(policy.on_mismatch(&info).map(|_| ()).map_err(|e| {
            format!(
                "scenario \"history mismatch: {distinct_digests} digests over {process_count} processes\": no action: {e}"
            )
        }));
    }
    SuiteLine::from_results(variant, PolicyKind::Distribution, results)
}
