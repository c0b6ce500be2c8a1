//! Model 2: orphan removal by controllers that overlap in time.
//!
//! # What is modelled
//!
//! - A **fenced catalog**: the replicas the newest controller wants, the next
//!   replica ID (IDs are allocated monotonically) and the newest epoch.
//!   Loading it bumps the epoch; a write by a controller whose epoch is no
//!   longer the newest fails, and that controller halts.
//! - An **orchestrator**: services by replica ID, each labelled with the epoch
//!   of the controller that last ensured it. `ensure` is conditional (it never
//!   overwrites a service labelled with a newer epoch; the controller that
//!   finds one halts), as O3 requires (docs/invariants.md); the unconditional ensure of
//!   the epoch rule's first version can be modelled to show what it breaks (O4). A delete leaves
//!   a tombstone with the deleter's epoch, which a conditional ensure also
//!   respects (as in `lockstep-orchestrator`).
//! - **Three controllers**, each running the seed's steps: load the catalog
//!   (taking epoch 1, 2 or 3 in load order), ensure every replica it holds
//!   (one step each), list the services and ask the orphan rule which to
//!   delete (or whether to halt), delete them (one step each), then serve:
//!   create or drop replicas (a catalog write, then the orchestrator call). A
//!   controller may crash between a catalog write and its orchestrator call
//!   (the seed's failpoint), which leaves an orphan or a missing service.
//! - The orphan rule is the real [`lockstep_policy::OrphanPolicy`] by name:
//!   `epoch` ([`lockstep_policy::EpochRule`]), `id-watermark`
//!   ([`lockstep_policy::IdWatermarkRule`]) or the negative control
//!   `catalog-only` ([`lockstep_policy::CatalogOnlyRule`]).
//!
//! Initially the catalog holds replica 1 (next ID 2) and the orchestrator
//! runs services 0 (an orphan left by a crash) and 1, both labelled epoch 0.
//!
//! # Properties
//!
//! Violations are recorded by the step that commits them (history variables)
//! and the properties say none was ever recorded:
//! - **O1**: orphan removal never deletes a service whose replica the newest
//!   catalog holds.
//! - **O3**: a stale controller acts on nothing newer than its view: no
//!   catalog write commits unless its epoch is the newest, and it never
//!   deletes or overwrites a service labelled with a newer epoch or with an ID
//!   at or above its next ID (it must spare or halt instead).
//! - **O4**: a service's epoch label (and so its spec) never goes back to an
//!   older controller's.
//! - **O2** (in settled states): once the newest controller has started and
//!   serves, and no controller is mid-way through a step, every service the
//!   newest catalog lacks is gone. This needs the orchestrator's tombstones
//!   (a delete records the deleter's epoch, and a conditional ensure refuses
//!   to re-create a service a newer controller deleted); without them a stale
//!   controller's ensure resurrects a replica the newest one dropped.
//!
//! Two `sometimes` properties guard against a vacuous model: an orphan is
//! removed, and a stale controller halts.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use lockstep_policy::{native_orphan_rule, CatalogView, OrphanDecision, Service};
use stateright::{Model, Property};

/// The bounds of one check of the orphan model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OrphanBounds {
    /// Controllers (each loads once).
    pub controllers: usize,
    /// Replica creations and drops while serving, in total.
    pub serve_ops: usize,
    /// Controller crashes between a catalog write and the orchestrator call.
    pub crashes: usize,
}

impl fmt::Display for OrphanBounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} controllers (epochs 1-{}), {} create/drop replica ops, {} crashes, 2 initial services",
            self.controllers, self.controllers, self.serve_ops, self.crashes
        )
    }
}

/// The orphan-removal model for one rule.
#[derive(Clone, Debug)]
pub struct OrphanModel {
    /// The rule's name: `epoch`, `id-watermark` or `catalog-only`.
    pub rule: &'static str,
    /// Whether `ensure` is conditional (the project's orchestrators are).
    pub conditional_ensure: bool,
    /// Whether a delete leaves a tombstone with the deleter's epoch that a
    /// conditional ensure respects (the project's orchestrators do), so a
    /// stale controller cannot re-create a service a newer one deleted.
    pub tombstones: bool,
    /// The bounds.
    pub bounds: OrphanBounds,
}

/// The durable, fenced catalog.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Catalog {
    /// The newest epoch.
    pub epoch: u64,
    /// Replicas wanted.
    pub replicas: BTreeSet<u64>,
    /// The next replica ID.
    pub next_id: u64,
}

/// Why a controller halted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HaltReason {
    /// A catalog write was fenced off.
    Fenced,
    /// A conditional ensure found a newer service.
    NewerService,
    /// The orphan rule said another controller took over.
    Policy,
}

/// Where a controller is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not started.
    Idle,
    /// Ensuring these replicas, in order.
    Ensuring(Vec<u64>),
    /// About to list services and classify them.
    Listing,
    /// Deleting these orphans, in order.
    Deleting(Vec<u64>),
    /// Serving requests.
    Serving,
    /// Created replica (catalog written), its service not ensured yet.
    Creating(u64),
    /// Dropped replica (catalog written), its service not deleted yet.
    Dropping(u64),
    /// Halted.
    Halted(HaltReason),
    /// Crashed.
    Crashed,
}

/// One controller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ctl {
    /// Where it is.
    pub phase: Phase,
    /// Its epoch (0 before loading).
    pub epoch: u64,
    /// The replicas its catalog view holds.
    pub keep: BTreeSet<u64>,
    /// Its view's next ID.
    pub next_id: u64,
}

/// A state of the orphan model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OrphanState {
    /// The catalog.
    pub catalog: Catalog,
    /// Services: replica ID -> epoch label.
    pub services: BTreeMap<u64, u64>,
    /// Tombstones: replica ID -> the newest epoch that deleted its service.
    pub tombstones: BTreeMap<u64, u64>,
    /// The controllers.
    pub ctls: Vec<Ctl>,
    /// Serve operations so far.
    pub serve_ops: usize,
    /// Crashes so far.
    pub crashes: usize,
    /// Invariant violations committed so far: (property, what happened).
    pub violations: Vec<(Invariant, String)>,
    /// Orphans removed so far.
    pub orphans_removed: usize,
    /// Controllers that halted while stale.
    pub stale_halts: usize,
}

/// The orphan invariants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Invariant {
    /// No wanted service removed.
    O1,
    /// Stale controllers stop.
    O3,
    /// No stale overwrite.
    O4,
}

/// A step of the orphan model.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OrphanAction {
    /// Controller loads the catalog.
    Load(usize),
    /// Controller ensures its next replica.
    Ensure(usize),
    /// Controller lists services and asks the rule.
    List(usize),
    /// Controller deletes its next orphan.
    Delete(usize),
    /// Serving controller creates a replica (catalog write).
    CreateReplica(usize),
    /// Serving controller drops a replica (catalog write).
    DropReplica(usize, u64),
    /// Controller ensures the service of the replica it created.
    FinishCreate(usize),
    /// Controller deletes the service of the replica it dropped.
    FinishDrop(usize),
    /// Controller crashes between a catalog write and the orchestrator call.
    Crash(usize),
}

impl OrphanModel {
    /// The model of `rule` (`epoch`, `id-watermark`, `catalog-only`) with
    /// conditional ensure.
    pub fn new(rule: &'static str, bounds: OrphanBounds) -> Self {
        assert!(
            native_orphan_rule(rule).is_some(),
            "unknown orphan rule {rule}"
        );
        OrphanModel {
            rule,
            conditional_ensure: true,
            tombstones: true,
            bounds,
        }
    }

    fn record(s: &mut OrphanState, inv: Invariant, what: String) {
        s.violations.push((inv, what));
    }

    /// Ensure `id` labelled with `c`'s epoch; false if `c` must halt.
    fn ensure(&self, s: &mut OrphanState, c: usize, id: u64) -> bool {
        let epoch = s.ctls[c].epoch;
        let dropped_by_newer = s.tombstones.get(&id).is_some_and(|t| *t > epoch);
        if self.tombstones && self.conditional_ensure && dropped_by_newer {
            s.ctls[c].phase = Phase::Halted(HaltReason::NewerService);
            s.stale_halts += 1;
            return false;
        }
        let newer = s.services.get(&id).copied().filter(|l| *l > epoch);
        if let Some(label) = newer {
            if self.conditional_ensure {
                s.ctls[c].phase = Phase::Halted(HaltReason::NewerService);
                s.stale_halts += 1;
                return false;
            }
            Self::record(
                s,
                Invariant::O4,
                format!(
                    "controller@{epoch} overwrote service r{id}: its label went back from epoch {label} to {epoch}"
                ),
            );
            Self::record(
                s,
                Invariant::O3,
                format!("stale controller@{epoch} overwrote service r{id} of controller@{label}"),
            );
        }
        s.services.insert(id, epoch);
        true
    }

    /// Deletes service `id` on behalf of `c` (not conditional, like a
    /// Kubernetes delete); returns its label if it existed.
    fn delete(&self, s: &mut OrphanState, c: usize, id: u64) -> Option<u64> {
        if self.tombstones {
            let epoch = s.ctls[c].epoch;
            let t = s.tombstones.entry(id).or_insert(0);
            *t = (*t).max(epoch);
        }
        s.services.remove(&id)
    }

    /// O2 in a settled state: once the newest controller serves (it neither
    /// crashed nor halted) and no controller is mid-way through anything,
    /// every service the newest catalog lacks is gone.
    pub fn check_o2(&self, s: &OrphanState) -> Result<(), String> {
        let settled = s
            .ctls
            .iter()
            .all(|c| matches!(c.phase, Phase::Serving | Phase::Halted(_) | Phase::Crashed));
        let newest_serves = s
            .ctls
            .iter()
            .any(|c| c.epoch == s.catalog.epoch && c.phase == Phase::Serving);
        if !(settled && newest_serves) {
            return Ok(());
        }
        match s.services.keys().find(|id| !s.catalog.replicas.contains(id)) {
            Some(id) => Err(format!(
                "O2 broken: orphan r{id} survives although the newest controller (epoch {}) started and serves",
                s.catalog.epoch
            )),
            None => Ok(()),
        }
    }

    /// A catalog write by `c`: false (and `c` halts) if it is fenced off.
    fn fenced(s: &mut OrphanState, c: usize) -> bool {
        if s.catalog.epoch != s.ctls[c].epoch {
            s.ctls[c].phase = Phase::Halted(HaltReason::Fenced);
            s.stale_halts += 1;
            return true;
        }
        false
    }

    /// A one-line summary of a state.
    pub fn summary(&self, s: &OrphanState) -> String {
        let services: Vec<String> = s
            .services
            .iter()
            .map(|(id, e)| format!("r{id}@{e}"))
            .collect();
        let ctls: Vec<String> = s
            .ctls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let phase = match &c.phase {
                    Phase::Idle => "idle".to_string(),
                    Phase::Ensuring(v) => format!("ensuring {v:?}"),
                    Phase::Listing => "listing".into(),
                    Phase::Deleting(v) => format!("deleting {v:?}"),
                    Phase::Serving => "serving".into(),
                    Phase::Creating(id) => format!("creating r{id}"),
                    Phase::Dropping(id) => format!("dropping r{id}"),
                    Phase::Halted(r) => format!("HALTED ({r:?})"),
                    Phase::Crashed => "CRASHED".into(),
                };
                if c.epoch == 0 {
                    format!("c{i}: {phase}")
                } else {
                    format!("c{i}@{}: {phase}", c.epoch)
                }
            })
            .collect();
        format!(
            "catalog@{} {:?} next {} | services [{}] | {}",
            s.catalog.epoch,
            s.catalog.replicas,
            s.catalog.next_id,
            services.join(","),
            ctls.join("; ")
        )
    }

    /// A readable description of a step.
    pub fn describe(&self, s: &OrphanState, a: &OrphanAction) -> String {
        let who = |c: usize| {
            if s.ctls[c].epoch == 0 {
                format!("c{c}")
            } else {
                format!("c{c}@{}", s.ctls[c].epoch)
            }
        };
        match a {
            OrphanAction::Load(c) => format!(
                "{} loads the catalog (epoch {})",
                who(*c),
                s.catalog.epoch + 1
            ),
            OrphanAction::Ensure(c) => match &s.ctls[*c].phase {
                Phase::Ensuring(v) => format!("{} ensures r{}", who(*c), v[0]),
                _ => format!("{} ensures", who(*c)),
            },
            OrphanAction::List(c) => {
                format!("{} lists services and asks the {} rule", who(*c), self.rule)
            }
            OrphanAction::Delete(c) => match &s.ctls[*c].phase {
                Phase::Deleting(v) => format!("{} deletes orphan r{}", who(*c), v[0]),
                _ => format!("{} deletes", who(*c)),
            },
            OrphanAction::CreateReplica(c) => format!(
                "{} creates replica r{} in the catalog",
                who(*c),
                s.ctls[*c].next_id
            ),
            OrphanAction::DropReplica(c, id) => {
                format!("{} drops replica r{id} from the catalog", who(*c))
            }
            OrphanAction::FinishCreate(c) => {
                format!("{} ensures the new replica's service", who(*c))
            }
            OrphanAction::FinishDrop(c) => {
                format!("{} deletes the dropped replica's service", who(*c))
            }
            OrphanAction::Crash(c) => format!("{} CRASHES before its orchestrator call", who(*c)),
        }
    }
}

impl Model for OrphanModel {
    type State = OrphanState;
    type Action = OrphanAction;

    fn init_states(&self) -> Vec<OrphanState> {
        let ctl = Ctl {
            phase: Phase::Idle,
            epoch: 0,
            keep: BTreeSet::new(),
            next_id: 0,
        };
        vec![OrphanState {
            catalog: Catalog {
                epoch: 0,
                replicas: [1].into_iter().collect(),
                next_id: 2,
            },
            services: [(0, 0), (1, 0)].into_iter().collect(),
            tombstones: BTreeMap::new(),
            ctls: vec![ctl; self.bounds.controllers],
            serve_ops: 0,
            crashes: 0,
            violations: Vec::new(),
            orphans_removed: 0,
            stale_halts: 0,
        }]
    }

    fn actions(&self, s: &OrphanState, actions: &mut Vec<OrphanAction>) {
        for (c, ctl) in s.ctls.iter().enumerate() {
            match &ctl.phase {
                Phase::Idle => actions.push(OrphanAction::Load(c)),
                Phase::Ensuring(_) => actions.push(OrphanAction::Ensure(c)),
                Phase::Listing => actions.push(OrphanAction::List(c)),
                Phase::Deleting(_) => actions.push(OrphanAction::Delete(c)),
                Phase::Serving => {
                    if s.serve_ops < self.bounds.serve_ops {
                        actions.push(OrphanAction::CreateReplica(c));
                        for id in &ctl.keep {
                            actions.push(OrphanAction::DropReplica(c, *id));
                        }
                    }
                }
                Phase::Creating(_) | Phase::Dropping(_) => {
                    actions.push(if matches!(ctl.phase, Phase::Creating(_)) {
                        OrphanAction::FinishCreate(c)
                    } else {
                        OrphanAction::FinishDrop(c)
                    });
                    if s.crashes < self.bounds.crashes {
                        actions.push(OrphanAction::Crash(c));
                    }
                }
                Phase::Halted(_) | Phase::Crashed => {}
            }
        }
    }

    fn next_state(&self, last: &OrphanState, action: OrphanAction) -> Option<OrphanState> {
        let mut s = last.clone();
        match action {
            OrphanAction::Load(c) => {
                s.catalog.epoch += 1;
                let ctl = &mut s.ctls[c];
                ctl.epoch = s.catalog.epoch;
                ctl.keep = s.catalog.replicas.clone();
                ctl.next_id = s.catalog.next_id;
                ctl.phase = Phase::Ensuring(ctl.keep.iter().copied().collect());
            }
            OrphanAction::Ensure(c) => {
                let Phase::Ensuring(mut todo) = s.ctls[c].phase.clone() else {
                    return None;
                };
                if todo.is_empty() {
                    s.ctls[c].phase = Phase::Listing;
                    return Some(s);
                }
                let id = todo.remove(0);
                if self.ensure(&mut s, c, id) {
                    s.ctls[c].phase = if todo.is_empty() {
                        Phase::Listing
                    } else {
                        Phase::Ensuring(todo)
                    };
                }
            }
            OrphanAction::List(c) => {
                let ctl = &s.ctls[c];
                let services: Vec<Service> = s
                    .services
                    .iter()
                    .map(|(id, epoch)| Service {
                        id: *id,
                        name: format!("replica-{id}"),
                        epoch: *epoch,
                        labels: BTreeMap::new(),
                    })
                    .collect();
                let view = CatalogView {
                    keep: ctl.keep.clone(),
                    our_epoch: ctl.epoch,
                    next_id: ctl.next_id,
                };
                let mut rule = native_orphan_rule(self.rule).expect("checked in new");
                s.ctls[c].phase = match rule.classify(&services, &view) {
                    Ok(OrphanDecision::Delete(ids)) if ids.is_empty() => Phase::Serving,
                    Ok(OrphanDecision::Delete(ids)) => Phase::Deleting(ids),
                    Ok(OrphanDecision::Halt(_)) => {
                        s.stale_halts += 1;
                        Phase::Halted(HaltReason::Policy)
                    }
                    // The stated safe default: delete nothing.
                    Err(_) => Phase::Serving,
                };
            }
            OrphanAction::Delete(c) => {
                let Phase::Deleting(mut todo) = s.ctls[c].phase.clone() else {
                    return None;
                };
                let id = todo.remove(0);
                let (epoch, next_id) = (s.ctls[c].epoch, s.ctls[c].next_id);
                if let Some(label) = self.delete(&mut s, c, id) {
                    s.orphans_removed += 1;
                    if s.catalog.replicas.contains(&id) {
                        let what = format!(
                            "controller@{epoch} deleted service r{id} as an orphan, but the newest catalog (epoch {}) holds r{id}",
                            s.catalog.epoch
                        );
                        Self::record(&mut s, Invariant::O1, what);
                    }
                    if label > epoch || id >= next_id {
                        let what = format!(
                            "stale controller@{epoch} (next ID {next_id}) deleted r{id} labelled epoch {label} instead of sparing it or halting"
                        );
                        Self::record(&mut s, Invariant::O3, what);
                    }
                }
                s.ctls[c].phase = if todo.is_empty() {
                    Phase::Serving
                } else {
                    Phase::Deleting(todo)
                };
            }
            OrphanAction::CreateReplica(c) => {
                s.serve_ops += 1;
                if !Self::fenced(&mut s, c) {
                    let id = s.catalog.next_id;
                    s.catalog.next_id += 1;
                    s.catalog.replicas.insert(id);
                    let ctl = &mut s.ctls[c];
                    ctl.keep.insert(id);
                    ctl.next_id = s.catalog.next_id;
                    ctl.phase = Phase::Creating(id);
                }
            }
            OrphanAction::DropReplica(c, id) => {
                s.serve_ops += 1;
                if !Self::fenced(&mut s, c) {
                    s.catalog.replicas.remove(&id);
                    let ctl = &mut s.ctls[c];
                    ctl.keep.remove(&id);
                    ctl.phase = Phase::Dropping(id);
                }
            }
            OrphanAction::FinishCreate(c) => {
                let Phase::Creating(id) = s.ctls[c].phase else {
                    return None;
                };
                if self.ensure(&mut s, c, id) {
                    s.ctls[c].phase = Phase::Serving;
                }
            }
            OrphanAction::FinishDrop(c) => {
                let Phase::Dropping(id) = s.ctls[c].phase else {
                    return None;
                };
                self.delete(&mut s, c, id);
                s.ctls[c].phase = Phase::Serving;
            }
            OrphanAction::Crash(c) => {
                s.crashes += 1;
                s.ctls[c].phase = Phase::Crashed;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        fn none(s: &OrphanState, inv: Invariant) -> bool {
            !s.violations.iter().any(|(i, _)| *i == inv)
        }
        vec![
            Property::always("O1 no wanted service removed", |_, s| {
                none(s, Invariant::O1)
            }),
            Property::always("O3 stale controllers stop", |_, s| none(s, Invariant::O3)),
            Property::always("O4 no stale overwrite", |_, s| none(s, Invariant::O4)),
            Property::always("O2 orphans go", |m: &Self, s: &OrphanState| {
                m.check_o2(s).is_ok()
            }),
            Property::sometimes("an orphan is removed", |_, s: &OrphanState| {
                s.orphans_removed > 0
            }),
            Property::sometimes("a stale controller halts", |_, s: &OrphanState| {
                s.stale_halts > 0
            }),
        ]
    }
}
