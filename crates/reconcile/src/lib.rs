//! Pure reconciliation decisions, shared by the replica and the model checker.
//!
//! Timely requires every worker of a replica to build the same dataflows in
//! the same order (invariant I1): dataflow indices and channel identifiers come
//! from per-worker counters. The partial drop shows why reconciling a
//! reconnected replica is *not* a local action: process 1 saw "build A, drop A",
//! process 2 saw only "build A"; a restarted controller asks for A again. If each
//! worker reconciles alone, process 1 builds a new A that process 2 never joins
//! (a hang, or misrouted data), while process 2 keeps its old half of A.
//!
//! Every decision the replica makes about *which* dataflows to keep, drop and
//! build, and *when* a barrier may pass, is a pure function in this crate. The
//! replica calls them; the stateright model in `lockstep-model` calls the very
//! same functions, so the model checks the code's logic rather than a
//! paraphrase of it. That is why this crate has no I/O, no timely, no clock and
//! depends only on `lockstep-protocol`: every function here must give the same
//! answer on every worker that calls it with the same inputs.
//!
//! - [`collective`]: the plan every worker applies together after a reconnect
//!   (barrier strategy, or a history mismatch reconciled collectively).
//! - [`local`]: the plan one worker applies alone. Safe only when every worker
//!   is known to hold the same state (broadcast and log strategies); unsafe
//!   under partial installs, which the model shows for the naive strategy.
//! - [`barrier`]: whether a worker may apply a barrier-guarded command, and
//!   [`barrier_view`]: which announcements it must consider.
//! - [`history_check`]: what the controller learns from the processes'
//!   history digests on connect (history check).
//! - [`lockstep_check`] and [`lockstep_prefix_check`]: invariant I1 over the
//!   workers' dataflow-creation logs.
//!
//! # How the replica uses these (the protocol the model checks)
//!
//! Under the barrier strategy, per worker:
//!
//! 1. **Hello** of a newer session: the worker first resolves any barrier
//!    round it has announced (it never abandons one on its own: a peer may
//!    already have passed it), then joins the new session and tells its peers
//!    over the mesh ("joined session S"). Sessions must be totally ordered
//!    (epoch, then connection attempt within the epoch): Hello's random nonce
//!    alone cannot order two sessions of one epoch.
//! 2. **CreateDataflow** (seqno N): announce `(N, description hash)` and wait.
//!    Decide with [`barrier`] over [`barrier_view`]: `Pass` builds, `Abandoned`
//!    skips (the session is being replaced), `Diverged` halts the process.
//! 3. **InitializationComplete** (seqno N, after the compacted target):
//!    announce `(N, hash of the target)` together with the worker's installed
//!    set (the [`DataflowKey`]s it runs); on `Pass`, apply [`collective`] to
//!    the installed sets every worker announced, in worker order: drop
//!    `drop_per_worker[me]`, then build `build` in order.
//! 4. Drops (AllowCompaction to the empty frontier) apply on arrival: they
//!    allocate no timely identifiers, and reconciliation repairs a drop that
//!    only some workers saw.
//!
//! Under broadcast and log every worker applies the same totally ordered
//! stream, so [`local`] at the stream's target entry gives every worker the
//! same plan. `lockstep-model` checks all of this exhaustively for small sizes
//! (`cargo xtask model`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

pub use lockstep_protocol::Digest;

/// A controller session as workers order them: the epoch in the high 64
/// bits, the connection attempt (Hello's nonce) in the low 64 bits, so no
/// epoch or nonce aliases another.
pub type Session = u128;

/// The session of a Hello with `epoch` and `nonce`.
pub fn session_of(epoch: u64, nonce: u64) -> Session {
    (u128::from(epoch) << 64) | u128::from(nonce)
}

pub mod controller;
pub mod delivery;
pub mod initialization;
pub mod rounds;
pub mod strategy;
pub mod worker;
pub use controller::{ControllerSession, HistoryStep, MismatchResolution, Phase};
pub use delivery::{
    Choice, Delivery, DeliveryMutant, DeliveryRules, Fallback, ReplicaDelivery, SessionStart,
};
pub use initialization::{GateMutant, InitializationDecision, InitializationGate};
pub use rounds::{PlanError, Report, RoundBook, RoundMutant};
pub use strategy::log::{LogHoldMutant, LogRead};
pub use strategy::{rules, socket_ordered, Source, StrategyRules};
pub use worker::{
    Action, CommandClass, MeshAnnouncement, PendingRound, Reconciliation, SessionCommand,
    WorkerSession, WorkerView,
};

/// One dataflow as reconciliation sees it: its catalog ID and the hash of its
/// description ([`lockstep_protocol::DataflowDescription::hash`]).
///
/// Two installed dataflows are the same dataflow only if both the ID and the
/// hash are equal: an ID whose description changed must be rebuilt.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct DataflowKey {
    /// The dataflow's catalog ID.
    pub id: u64,
    /// The hash of its description.
    pub hash: Digest,
}

impl fmt::Display for DataflowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.id, self.hash)
    }
}

/// The plan of a collective reconciliation: the same for every worker except
/// for what each one drops.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct CollectivePlan {
    /// IDs of dataflows every worker keeps running, in target order.
    pub keep: Vec<u64>,
    /// For each worker (indexed like the input), the IDs it drops, in the
    /// order of its installed list.
    pub drop_per_worker: Vec<Vec<u64>>,
    /// Dataflows every worker builds, together, in exactly this order.
    pub build: Vec<DataflowKey>,
}

/// The plan of a worker reconciling alone.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct LocalPlan {
    /// IDs the worker keeps running, in target order.
    pub keep: Vec<u64>,
    /// IDs the worker drops, in the order of its installed list.
    pub drop: Vec<u64>,
    /// Dataflows the worker builds, in this order.
    pub build: Vec<DataflowKey>,
}

/// The target with later duplicates of an ID removed (the first entry for an
/// ID wins). A well-formed target has no duplicates; this keeps the plans
/// well-defined (and identical on every worker) when it does.
fn dedup_target(target: &[DataflowKey]) -> Vec<DataflowKey> {
    let mut seen = BTreeSet::new();
    target
        .iter()
        .filter(|k| seen.insert(k.id))
        .copied()
        .collect()
}

/// The keys one worker holds unambiguously: an ID installed twice on the same
/// worker (which a healthy worker never has) is never reused, so it is absent.
fn unambiguous(installed: &[DataflowKey]) -> BTreeSet<DataflowKey> {
    let mut count: BTreeMap<u64, usize> = BTreeMap::new();
    for k in installed {
        *count.entry(k.id).or_default() += 1;
    }
    installed
        .iter()
        .filter(|k| count[&k.id] == 1)
        .copied()
        .collect()
}

/// Collective reconciliation: what every worker of the replica does together
/// after a reconnect, given what each worker has installed and the
/// controller's target.
///
/// Guarantees:
/// - **keep** holds the ID of every target entry that *every* worker has
///   installed exactly once with the same hash, in target order. With no
///   workers at all, nothing is kept.
/// - **drop_per_worker\[w\]** holds every ID worker `w` has installed that is
///   not kept (including an ID whose hash differs from the target's, and an ID
///   installed twice on that worker), each once, in the order of `w`'s
///   installed list. It has one entry per input worker.
/// - **build** holds every target entry that is not kept, in target order:
///   all workers build these, together, in this order, after dropping.
/// - Determinism: the plan depends only on the inputs, so every worker that
///   computes it from the same announced installed sets and the same target
///   gets the same plan (keep and build are worker-independent).
/// - After applying the plan every worker has exactly the target installed,
///   and every worker appended the same entries, in the same order, to its
///   creation log: I1 is preserved if it held before.
/// - A target that names an ID twice is read with its first entry only.
pub fn collective<L: AsRef<[DataflowKey]>>(
    installed_per_worker: &[L],
    target: &[DataflowKey],
) -> CollectivePlan {
    let target = dedup_target(target);
    // Workers in lockstep announce equal lists: each distinct list is read
    // once (a 4x2 replica holding 10,000 dataflows is eight equal lists,
    // and every worker computes this plan).
    let lists: Vec<&[DataflowKey]> = installed_per_worker.iter().map(|l| l.as_ref()).collect();
    let mut distinct: Vec<&[DataflowKey]> = Vec::new();
    let list_of: Vec<usize> = lists
        .iter()
        .map(|l| {
            distinct.iter().position(|m| m == l).unwrap_or_else(|| {
                distinct.push(l);
                distinct.len() - 1
            })
        })
        .collect();
    let per_list: Vec<BTreeSet<DataflowKey>> = distinct.iter().map(|l| unambiguous(l)).collect();
    let kept: Vec<DataflowKey> = if per_list.is_empty() {
        Vec::new()
    } else {
        target
            .iter()
            .filter(|k| per_list.iter().all(|s| s.contains(k)))
            .copied()
            .collect()
    };
    let kept_ids: BTreeSet<u64> = kept.iter().map(|k| k.id).collect();
    let drops_per_list: Vec<Vec<u64>> = distinct.iter().map(|l| drops(l, &kept_ids)).collect();
    let drop_per_worker = list_of.iter().map(|&i| drops_per_list[i].clone()).collect();
    let build = target
        .iter()
        .filter(|k| !kept_ids.contains(&k.id))
        .copied()
        .collect();
    CollectivePlan {
        keep: kept.iter().map(|k| k.id).collect(),
        drop_per_worker,
        build,
    }
}

/// Every installed ID not in `kept`, once, in installed order.
fn drops(installed: &[DataflowKey], kept: &BTreeSet<u64>) -> Vec<u64> {
    let mut seen = BTreeSet::new();
    installed
        .iter()
        .map(|k| k.id)
        .filter(|id| !kept.contains(id) && seen.insert(*id))
        .collect()
}

/// Local reconciliation: what one worker does alone with its own installed
/// set and the target.
///
/// Guarantees: **keep** holds every target entry the worker has installed
/// exactly once with the same hash, in target order; **drop** every other
/// installed ID, once, in installed order; **build** every other target entry,
/// in target order. Afterwards the worker has exactly the target installed.
///
/// Safety condition: this is correct for the *replica* only when every worker
/// holds the same installed set (the broadcast and log strategies apply the
/// same totally ordered commands on every worker). Under a partial install
/// (the partial drop) workers compute different plans, build different dataflows
/// and break I1; the model checker demonstrates this with the naive strategy.
pub fn local(installed: &[DataflowKey], target: &[DataflowKey]) -> LocalPlan {
    let target = dedup_target(target);
    let mine = unambiguous(installed);
    let kept: Vec<DataflowKey> = target
        .iter()
        .filter(|k| mine.contains(k))
        .copied()
        .collect();
    let kept_ids: BTreeSet<u64> = kept.iter().map(|k| k.id).collect();
    LocalPlan {
        keep: kept.iter().map(|k| k.id).collect(),
        drop: drops(installed, &kept_ids),
        build: target
            .iter()
            .filter(|k| !kept_ids.contains(&k.id))
            .copied()
            .collect(),
    }
}

/// The sequence number a worker announces when it leaves a session (a newer
/// Hello arrived): it will announce nothing more in that session, so every
/// round it has not announced yet can never pass. See [`barrier`].
pub const SESSION_END: u64 = u64::MAX;

/// A worker's announcement, over the replica's mesh, that it reached a
/// barrier-guarded command (or left the session, see [`SESSION_END`]).
///
/// Announcements belong to one controller session (one Hello nonce): the
/// caller passes [`barrier`] only the announcements of the current session.
/// A worker announces rounds in increasing `seqno` order.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Announcement {
    /// The announcing worker's global index.
    pub worker: usize,
    /// The command's sequence number in the session.
    pub seqno: u64,
    /// The command's hash (for a reconciliation round: the target's hash).
    pub hash: Digest,
}

impl Announcement {
    /// The announcement that `worker` left the session.
    pub fn session_end(worker: usize) -> Self {
        Announcement {
            worker,
            seqno: SESSION_END,
            hash: Digest::default(),
        }
    }
}

/// Whether a worker waiting at a barrier may apply its command.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BarrierDecision {
    /// Not every worker has announced yet; keep waiting (and keep reading the
    /// mesh).
    Wait,
    /// Every worker announced the same (seqno, hash): apply the command.
    Pass,
    /// A worker announced a different hash for the same seqno: the workers
    /// received different commands. The process must halt so that the
    /// controller restarts the replica (I4: if you cannot tell, halt).
    Diverged {
        /// The first (lowest-index) worker that announced something else.
        worker: usize,
        /// What that worker announced: (seqno, hash).
        theirs: (u64, Digest),
        /// What we announced: (seqno, hash).
        ours: (u64, Digest),
    },
    /// A worker went past this seqno without announcing it (it left the
    /// session, or announced a later round): this round can never pass on any
    /// worker. Skip the command; the session is being replaced.
    Abandoned {
        /// The first (lowest-index) worker that skipped the round.
        worker: usize,
    },
}

/// The barrier decision for the round `mine` (which the caller has announced)
/// given every announcement of the current session received so far
/// (including the caller's own), from a replica of `workers` workers.
///
/// Guarantees, in order of precedence:
/// 1. **Diverged** if some worker announced `mine.seqno` with another hash
///    (the lowest such worker is named).
/// 2. **Abandoned** if some worker in `0..workers` announced a higher seqno
///    (for instance [`SESSION_END`]) and never `mine.seqno`: announcements are
///    in increasing seqno order per worker, so it never will.
/// 3. **Pass** only if every worker in `0..workers` announced exactly
///    `(mine.seqno, mine.hash)`.
/// 4. **Wait** otherwise.
///
/// Announcements from workers outside `0..workers` are ignored. The decision
/// is monotone (once not `Wait`, more announcements do not change it) and
/// depends on each worker's announcements independently, so all workers reach
/// the same decision for a round, whatever order the mesh delivers in: either
/// all of them pass, or none does.
pub fn barrier(
    workers: usize,
    announcements: &[Announcement],
    mine: &Announcement,
) -> BarrierDecision {
    let ours = (mine.seqno, mine.hash);
    for w in 0..workers {
        if let Some(a) = announcements
            .iter()
            .find(|a| a.worker == w && a.seqno == mine.seqno && a.hash != mine.hash)
        {
            return BarrierDecision::Diverged {
                worker: w,
                theirs: (a.seqno, a.hash),
                ours,
            };
        }
    }
    let mut all = true;
    for w in 0..workers {
        let of_w = || announcements.iter().filter(move |a| a.worker == w);
        let announced = of_w().any(|a| a.seqno == mine.seqno);
        if !announced {
            if of_w().any(|a| a.seqno > mine.seqno) {
                return BarrierDecision::Abandoned { worker: w };
            }
            all = false;
        }
    }
    if all && workers > 0 {
        BarrierDecision::Pass
    } else {
        BarrierDecision::Wait
    }
}

/// The announcements [`barrier`] must see for a round of `session`, built from
/// everything the mesh carried.
///
/// Sessions (one per Hello a worker accepts) are totally ordered: by epoch,
/// then by connection attempt within the epoch. `joined[w]` is the newest
/// session worker `w` announced it joined (it announces that when it accepts
/// a Hello, and it accepts one only once it has no barrier round pending);
/// `announced` holds every round announcement as (session, announcement).
///
/// Guarantees: the result holds every announcement of `session`, plus
/// [`Announcement::session_end`] for every worker that joined a newer session:
/// such a worker will never announce anything more in `session` (it may have
/// skipped it entirely, when its connection was truncated before that Hello
/// reached it), so a round it has not announced is abandoned rather than
/// waited on forever. Without this, a worker waiting in a session that a peer
/// skipped would block for good (the model checker finds that deadlock with
/// two controller faults).
pub fn barrier_view(
    session: Session,
    joined: &[Session],
    announced: &[(Session, Announcement)],
) -> Vec<Announcement> {
    let mut view: Vec<Announcement> = announced
        .iter()
        .filter(|(s, _)| *s == session)
        .map(|(_, a)| *a)
        .collect();
    view.extend(
        joined
            .iter()
            .enumerate()
            .filter(|(_, j)| **j > session)
            .map(|(w, _)| Announcement::session_end(w)),
    );
    view
}

/// What the controller learns from the history digests the processes report
/// on connect.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HistoryVerdict {
    /// Every process reported the controller's digest.
    InSync,
    /// At least one process differs (or none reported); a distribution policy
    /// decides what to do (`lockstep_policy::MismatchInfo` carries these
    /// counts).
    Mismatch {
        /// How many different digests the processes reported.
        distinct: u32,
        /// How many processes reported the controller's digest.
        matching_controller: u32,
    },
}

/// Compares the processes' reported history digests with the controller's.
///
/// Guarantees: **InSync** exactly when at least one digest was reported and
/// every reported digest equals `controller`. Otherwise **Mismatch** with the
/// number of distinct reported digests and the number equal to `controller`
/// (an empty report is `Mismatch { distinct: 0, matching_controller: 0 }`:
/// silence is never proof of agreement). Counts saturate at `u32::MAX`.
pub fn history_check(controller: Digest, reported: &[Digest]) -> HistoryVerdict {
    let matching = reported.iter().filter(|d| **d == controller).count();
    if !reported.is_empty() && matching == reported.len() {
        return HistoryVerdict::InSync;
    }
    let distinct = reported.iter().collect::<BTreeSet<_>>().len();
    HistoryVerdict::Mismatch {
        distinct: u32::try_from(distinct).unwrap_or(u32::MAX),
        matching_controller: u32::try_from(matching).unwrap_or(u32::MAX),
    }
}

/// One entry of a worker's dataflow-creation log: (timely dataflow index,
/// dataflow ID, description hash).
pub type CreationEntry = (u64, u64, Digest);

/// The creation logs workers reported in their statuses, as
/// [`lockstep_check`] takes them.
pub fn creation_logs<'a>(
    statuses: impl IntoIterator<Item = &'a lockstep_protocol::Status>,
) -> Vec<Vec<CreationEntry>> {
    statuses
        .into_iter()
        .map(|s| {
            s.creation_log
                .iter()
                .map(|e| (e.timely_index, e.dataflow_id, e.description_hash))
                .collect()
        })
        .collect()
}

/// Two workers' creation logs differ (invariant I1 is broken).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Divergence {
    /// The first worker (lowest index above 0) whose log differs from
    /// worker 0's (for [`lockstep_prefix_check`]: from the reference log).
    pub worker: usize,
    /// The first position at which it differs.
    pub position: usize,
    /// What the reference (worker 0, or the longest log) has there, if anything.
    pub expected: Option<CreationEntry>,
    /// What `worker` has there, if anything.
    pub found: Option<CreationEntry>,
    /// Which worker the reference log belongs to.
    pub reference: usize,
}

fn show(e: &Option<CreationEntry>) -> String {
    match e {
        Some((idx, id, h)) => format!("dataflow {id} (hash {h}) at timely index {idx}"),
        None => "nothing".to_string(),
    }
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "I1 broken: worker {} created {} at position {}, but worker {} created {}",
            self.worker,
            show(&self.found),
            self.position,
            self.reference,
            show(&self.expected)
        )
    }
}

impl std::error::Error for Divergence {}

/// The first position where `a` and `b` differ, if they do (lengths count).
fn first_difference(a: &[CreationEntry], b: &[CreationEntry]) -> Option<usize> {
    let common = a.len().min(b.len());
    (0..common)
        .find(|&i| a[i] != b[i])
        .or((a.len() != b.len()).then_some(common))
}

/// Invariant I1 on a quiet replica: every worker's creation log is equal.
///
/// Guarantees: `Ok` exactly when all logs are equal (zero or one log is
/// trivially `Ok`). Otherwise the error names the lowest-index worker whose
/// log differs from worker 0's, the first differing position, and what each
/// of the two has there (`None` past the end of a shorter log).
// The error is returned once, by a check, never on a hot path: its size
// (two full entries, so a report can say what each worker saw) is fine.
#[allow(clippy::result_large_err)]
pub fn lockstep_check(creation_logs: &[Vec<CreationEntry>]) -> Result<(), Divergence> {
    let Some(first) = creation_logs.first() else {
        return Ok(());
    };
    for (w, log) in creation_logs.iter().enumerate().skip(1) {
        if let Some(position) = first_difference(first, log) {
            return Err(Divergence {
                worker: w,
                position,
                expected: first.get(position).copied(),
                found: log.get(position).copied(),
                reference: 0,
            });
        }
    }
    Ok(())
}

/// Invariant I1 while commands are still in flight: workers may lag, but no
/// two logs diverge, i.e. every log is a prefix of the longest one.
///
/// Guarantees: `Ok` exactly when every log is a prefix of the longest log (the
/// lowest-index one among equally long logs). Otherwise the error names the
/// lowest-index worker whose log is not such a prefix, the first position
/// where it differs from the longest log, and both entries there.
// The error is returned once, by a check, never on a hot path: its size
// (two full entries, so a report can say what each worker saw) is fine.
#[allow(clippy::result_large_err)]
pub fn lockstep_prefix_check(creation_logs: &[Vec<CreationEntry>]) -> Result<(), Divergence> {
    let Some((reference, longest)) = creation_logs
        .iter()
        .enumerate()
        .rev()
        .max_by_key(|(_, l)| l.len())
    else {
        return Ok(());
    };
    for (w, log) in creation_logs.iter().enumerate() {
        let common = log.len();
        if let Some(position) = (0..common).find(|&i| log[i] != longest[i]) {
            return Err(Divergence {
                worker: w,
                position,
                expected: longest.get(position).copied(),
                found: log.get(position).copied(),
                reference,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
