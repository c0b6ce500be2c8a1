//! One worker's book of barrier rounds: what the mesh told it so far, and the
//! decisions it takes from that.
//!
//! The replica's worker (`crates/replica/src/order/barrier.rs`) and the model checker
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
//!   worker's report of the round, or `None` when a report is missing (the
//!   caller halts rather than plan from a guess).

use std::collections::BTreeMap;

use crate::{
    barrier, barrier_view, collective, local, Announcement, BarrierDecision, DataflowKey, Session,
};

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
    // a bound of its own: the model's tests check it (tests/models.rs).
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
    reports: BTreeMap<(Session, usize, u64), Vec<DataflowKey>>,
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
        report: Option<Vec<DataflowKey>>,
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
                self.reports
                    .insert((session, announcement.worker, seqno), Vec::new());
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
    /// [`collective`] plan over every worker's report. `None` if a worker's
    /// report of the round is missing.
    pub fn reconcile_plan(
        &self,
        session: Session,
        seqno: u64,
        me: usize,
        target: &[DataflowKey],
    ) -> Option<(Vec<u64>, Vec<DataflowKey>)> {
        let key = |w: usize| match self.mutant {
            RoundMutant::OverwriteReports => (session, w, 0),
            _ => (session, w, seqno),
        };
        if self.mutant == RoundMutant::LocalReconcileUnderBarrier {
            let own = self.reports.get(&key(me))?;
            let plan = local(own, target);
            return Some((plan.drop, plan.build));
        }
        let lists: Vec<Vec<DataflowKey>> = (0..self.peers)
            .map(|w| self.reports.get(&key(w)).cloned())
            .collect::<Option<_>>()?;
        let mut plan = collective(&lists, target);
        Some((plan.drop_per_worker.swap_remove(me), plan.build))
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
        book.announced(5, ann(0, 10, 9), Some(target.clone()));
        book.announced(5, ann(1, 10, 9), Some(target.clone()));
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
        book.announced(1, ann(0, 4, 1), Some(vec![key(1)]));
        book.announced(1, ann(1, 4, 1), None);
        assert_eq!(book.reconcile_plan(1, 4, 0, &[key(1)]), None);
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
