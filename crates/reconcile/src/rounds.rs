//! One worker's book of barrier rounds: what the mesh told it so far, and the
//! decisions it takes from that.
//!
//! The replica's worker (`crates/replica/src/worker/mod.rs`) and the model checker
//! (`crates/model`) run this same type: the worker feeds it the records its
//! mesh delivers, the model feeds it records in every order its per-worker
//! mesh queues allow. Nothing here does I/O.
//!
//! A *round* is (session, seqno): a barrier-guarded create, or the collective
//! reconciliation at InitializationComplete. A worker announces each round it
//! reaches, in increasing seqno order; a reconciliation round's announcement
//! carries the announcer's installed dataflows (its *report*).
//!
//! Guarantees:
//! - a record is kept per round: a later round of the same worker never
//!   replaces an earlier round's report (a create announces no report);
//! - [`RoundBook::decide`] is [`barrier`] over [`barrier_view`], so every
//!   worker reaches the same decision for a round whatever order its mesh
//!   delivers in;
//! - [`RoundBook::reconcile_plan`] is the [`collective`] plan over every
//!   worker's report of the round, or an error when a report is missing or
//!   the workers' dataflow-creation logs differ (the caller halts rather
//!   than plan from a guess: a dataflow built on some workers only has moved
//!   their timely dataflow counters apart, which no plan repairs; only a
//!   restart of the replica does).

use std::collections::BTreeMap;

use crate::{
    barrier, barrier_view, collective, local, Announcement, BarrierDecision, DataflowKey, Digest,
    Session,
};

/// What a worker reports in a reconciliation round.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Report {
    /// Its installed dataflows, in creation order.
    pub installed: Vec<DataflowKey>,
    /// A digest of its dataflow-creation log (timely index, ID, description
    /// hash of everything it ever built): equal on workers in lockstep.
    pub created: Digest,
}

/// Why a passed reconciliation round gives no plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    /// A worker's report of the round is missing.
    MissingReport {
        /// The worker.
        worker: usize,
    },
    /// Workers built different dataflows (their creation logs differ): I1
    /// is already broken, and only a restart of the replica repairs it.
    CreationLogsDiffer {
        /// A worker whose log differs from worker 0's.
        worker: usize,
    },
}

impl std::fmt::Display for PlanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlanError::MissingReport { worker } => {
                write!(f, "worker {worker}'s report of the round is missing")
            }
            PlanError::CreationLogsDiffer { worker } => write!(
                f,
                "worker {worker} built other dataflows than worker 0 (their dataflow-creation logs differ)"
            ),
        }
    }
}

/// A deliberate flaw planted in [`RoundBook`], so that the model checker can
/// show it catches it (feature `mutants`; the replica never sets one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RoundMutant {
    /// The book as it is meant to be.
    #[default]
    None,
    /// One report per (session, worker): every round replaces the last
    /// report, so a create's empty list can replace a reconciliation report
    /// (the defect fixed in commit 3d7d42c).
    OverwriteReports,
    /// Reconciliation under the barrier strategy plans each worker alone
    /// ([`local`]) from its own report.
    LocalReconcileUnderBarrier,
    /// A round passes as soon as the worker itself announced it.
    SkipBarrier,
    /// Rounds wait on peers that already joined a newer session (the
    /// announcements of the round's own session only, no [`barrier_view`]).
    IgnoreNewerSessions,
}

impl RoundMutant {
    /// Every planted flaw, with the variant name the model reports it under.
    pub const ALL: [(RoundMutant, &'static str); 3] = [
        (RoundMutant::OverwriteReports, "mutant-overwrite-reports"),
        (
            RoundMutant::LocalReconcileUnderBarrier,
            "mutant-local-reconcile-under-barrier",
        ),
        (RoundMutant::SkipBarrier, "mutant-skip-barrier"),
    ];
    // `IgnoreNewerSessions` deadlocks only with two faults and no command,
    // a bound of its own: the model's tests check it (crates/model/tests/models.rs).
}

/// What one worker knows of the barrier rounds of its replica.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RoundBook {
    peers: usize,
    /// Per worker: the newest session it announced it joined.
    joined: Vec<Session>,
    /// Every round announcement not yet forgotten: (session, announcement).
    announced: Vec<(Session, Announcement)>,
    /// Reports, by (session, worker, seqno).
    reports: BTreeMap<(Session, usize, u64), Report>,
    mutant: RoundMutant,
}

impl RoundBook {
    /// An empty book for a replica of `peers` workers.
    pub fn new(peers: usize) -> Self {
        RoundBook {
            peers,
            joined: vec![0; peers],
            announced: Vec::new(),
            reports: BTreeMap::new(),
            mutant: RoundMutant::None,
        }
    }

    /// The same book with a planted flaw (model checking only).
    #[cfg(feature = "mutants")]
    pub fn with_mutant(mut self, mutant: RoundMutant) -> Self {
        self.mutant = mutant;
        self
    }

    /// The number of workers of the replica.
    pub fn peers(&self) -> usize {
        self.peers
    }

    /// `worker` announced it joined `session`. Records of workers outside
    /// the replica are ignored.
    pub fn joined(&mut self, worker: usize, session: Session) {
        if let Some(j) = self.joined.get_mut(worker) {
            *j = (*j).max(session);
        }
    }

    /// A round announcement of `session`, with the announcer's report for a
    /// reconciliation round. Records of workers outside the replica are
    /// ignored.
    pub fn announced(
        &mut self,
        session: Session,
        announcement: Announcement,
        report: Option<Report>,
    ) {
        if announcement.worker >= self.peers {
            return;
        }
        self.announced.push((session, announcement));
        let seqno = match self.mutant {
            RoundMutant::OverwriteReports => 0,
            _ => announcement.seqno,
        };
        match (report, self.mutant) {
            (Some(r), _) => {
                self.reports
                    .insert((session, announcement.worker, seqno), r);
            }
            (None, RoundMutant::OverwriteReports) => {
                // The create's empty list replaces the report's list.
                let key = (session, announcement.worker, seqno);
                if let Some(r) = self.reports.get_mut(&key) {
                    r.installed.clear();
                }
            }
            (None, _) => {}
        }
    }

    /// This worker accepted `session`: everything about older sessions is
    /// of no further use.
    pub fn start_session(&mut self, session: Session) {
        self.announced.retain(|(s, _)| *s >= session);
        self.reports.retain(|(s, _, _), _| *s >= session);
    }

    /// The decision on this worker's round `mine` of `session`.
    pub fn decide(&self, session: Session, mine: &Announcement) -> BarrierDecision {
        if self.mutant == RoundMutant::SkipBarrier {
            return BarrierDecision::Pass;
        }
        let view = if self.mutant == RoundMutant::IgnoreNewerSessions {
            self.announced
                .iter()
                .filter(|(s, _)| *s == session)
                .map(|(_, a)| *a)
                .collect()
        } else {
            barrier_view(session, &self.joined, &self.announced)
        };
        barrier(self.peers, &view, mine)
    }

    /// What worker `me` drops to reconcile in the passed round (session,
    /// seqno) to `target`, and what every worker then builds: the
    /// [`collective`] plan over every worker's report. An error if a
    /// worker's report of the round is missing, or if the workers' creation
    /// logs differ.
    pub fn reconcile_plan(
        &self,
        session: Session,
        seqno: u64,
        me: usize,
        target: &[DataflowKey],
    ) -> Result<(Vec<u64>, Vec<DataflowKey>), PlanError> {
        let key = |w: usize| match self.mutant {
            RoundMutant::OverwriteReports => (session, w, 0),
            _ => (session, w, seqno),
        };
        let report = |w: usize| {
            self.reports
                .get(&key(w))
                .ok_or(PlanError::MissingReport { worker: w })
        };
        if self.mutant == RoundMutant::LocalReconcileUnderBarrier {
            let plan = local(&report(me)?.installed, target);
            return Ok((plan.drop, plan.build));
        }
        let reports: Vec<&Report> = (0..self.peers).map(report).collect::<Result<_, _>>()?;
        if let Some(w) = reports.iter().position(|r| r.created != reports[0].created) {
            return Err(PlanError::CreationLogsDiffer { worker: w });
        }
        let lists: Vec<&[DataflowKey]> = reports.iter().map(|r| r.installed.as_slice()).collect();
        let mut plan = collective(&lists, target);
        Ok((plan.drop_per_worker.swap_remove(me), plan.build))
    }

    /// Forgets the decided rounds of `session` up to `seqno`: later rounds
    /// never look at them.
    pub fn forget_through(&mut self, session: Session, seqno: u64) {
        self.announced
            .retain(|(s, a)| *s != session || a.seqno > seqno);
        if self.mutant != RoundMutant::OverwriteReports {
            self.reports
                .retain(|(s, _, n), _| *s != session || *n > seqno);
        }
    }

    /// How many announcements and reports the book holds (for tests of
    /// bounded growth).
    pub fn len(&self) -> usize {
        self.announced.len() + self.reports.len()
    }

    /// Whether the book holds no announcement and no report.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Digest;

    fn key(id: u64) -> DataflowKey {
        DataflowKey {
            id,
            hash: Digest([id as u8; 32]),
        }
    }

    fn report(installed: Vec<DataflowKey>) -> Option<Report> {
        Some(Report {
            installed,
            created: Digest([7; 32]),
        })
    }

    fn ann(worker: usize, seqno: u64, h: u8) -> Announcement {
        Announcement {
            worker,
            seqno,
            hash: Digest([h; 32]),
        }
    }

    /// The defect: a peer's reconcile report, then its next create, absorbed
    /// before this worker resolves its reconciliation.
    #[test]
    fn a_later_round_keeps_the_reconcile_report() {
        let target = vec![key(1), key(2)];
        let mut book = RoundBook::new(2);
        book.joined(0, 5);
        book.joined(1, 5);
        book.announced(5, ann(0, 10, 9), report(target.clone()));
        book.announced(5, ann(1, 10, 9), report(target.clone()));
        book.announced(5, ann(1, 11, 3), None);
        assert_eq!(book.decide(5, &ann(0, 10, 9)), BarrierDecision::Pass);
        let (drop, build) = book.reconcile_plan(5, 10, 0, &target).unwrap();
        assert!(drop.is_empty(), "nothing to drop: {drop:?}");
        assert!(build.is_empty(), "nothing to build: {build:?}");
        book.forget_through(5, 10);
        assert_eq!(book.len(), 1, "only the create round is left");
    }

    #[test]
    fn a_missing_report_gives_no_plan() {
        let mut book = RoundBook::new(2);
        book.announced(1, ann(0, 4, 1), report(vec![key(1)]));
        book.announced(1, ann(1, 4, 1), None);
        assert_eq!(
            book.reconcile_plan(1, 4, 0, &[key(1)]),
            Err(PlanError::MissingReport { worker: 1 })
        );
    }

    /// A dataflow built on some workers only (a cut-off log session's
    /// create read by some workers before the next session, skipped by the
    /// others) moved their timely counters apart: no plan, a halt.
    #[test]
    fn different_creation_logs_give_no_plan() {
        let mut book = RoundBook::new(2);
        book.announced(1, ann(0, 4, 1), report(vec![key(1)]));
        book.announced(
            1,
            ann(1, 4, 1),
            Some(Report {
                installed: vec![],
                created: Digest([8; 32]),
            }),
        );
        assert_eq!(
            book.reconcile_plan(1, 4, 0, &[key(1)]),
            Err(PlanError::CreationLogsDiffer { worker: 1 })
        );
    }

    #[test]
    fn a_newer_session_abandons_a_round() {
        let mut book = RoundBook::new(2);
        book.announced(1, ann(0, 4, 1), None);
        book.joined(1, 2);
        assert_eq!(
            book.decide(1, &ann(0, 4, 1)),
            BarrierDecision::Abandoned { worker: 1 }
        );
        book.start_session(2);
        assert!(book.is_empty());
    }
}
