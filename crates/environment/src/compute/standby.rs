//! A replica's standby generation: the second controller an upgrade that
//! keeps answering (`Environment::upgrade_replica_answering`) drives beside
//! the replica's own while the replica's processes restart. While it exists
//! it takes every mutation of the replica (creates, drops, writes,
//! compactions, policies), so it computes what the replica computes; reads
//! (peeks) go to whichever of the two the upgrade routes them to. Every read
//! holds a token of the controller it went to, so the upgrade can wait until
//! a controller's reads in flight are answered before it takes that
//! controller's processes away.

use super::*;

/// The standby of one replica.
pub(crate) struct Standby {
    controller: Controller,
    /// Whether peeks of the replica go to the standby.
    serves_reads: bool,
}

/// Which controller of a replica a read went to.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Generation {
    /// The replica's own controller.
    Own,
    /// Its standby's.
    Standby,
}

/// A reconfiguration of a replica under way: an upgrade that keeps
/// answering or a resize (`crate::upgrade`), shown by `ListReplicas`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reconfiguration {
    /// `upgrade` or `resize`.
    pub kind: &'static str,
    /// The shape it goes to: processes, workers per process.
    pub target: (u32, u32),
    /// Where it is.
    pub phase: ReconfigurationPhase,
    /// When it started.
    pub started: Instant,
    /// When it entered its phase.
    pub phase_started: Instant,
}

/// The phases of a reconfiguration, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconfigurationPhase {
    /// The standby generation is started and catching up with the
    /// replica; reads go to the replica.
    StandbyHydrating,
    /// Reads go to the standby; the replica's processes are being
    /// restarted or replaced.
    Replacing,
    /// Reads go to the standby; the replica's new processes are catching
    /// up with it.
    Hydrating,
    /// The replica's new processes failed (a resize's): reads go to the
    /// standby while the replica goes back to its old shape and catches up.
    RollingBack,
    /// Reads went back to the replica; the standby is being dropped.
    DroppingStandby,
}

impl ReconfigurationPhase {
    /// Every phase, in order.
    pub const ALL: [ReconfigurationPhase; 5] = [
        ReconfigurationPhase::StandbyHydrating,
        ReconfigurationPhase::Replacing,
        ReconfigurationPhase::Hydrating,
        ReconfigurationPhase::RollingBack,
        ReconfigurationPhase::DroppingStandby,
    ];

    /// Its name in `ListReplicas` and on the CLI.
    pub fn name(self) -> &'static str {
        match self {
            ReconfigurationPhase::StandbyHydrating => "standby-hydrating",
            ReconfigurationPhase::Replacing => "replacing",
            ReconfigurationPhase::Hydrating => "hydrating",
            ReconfigurationPhase::RollingBack => "rolling-back",
            ReconfigurationPhase::DroppingStandby => "dropping-standby",
        }
    }
}

/// Held by a read while it waits for its answer.
pub(crate) struct ReadToken(#[allow(dead_code)] Arc<()>);

impl Compute {
    /// Records that a reconfiguration of replica `replica_id` started (its
    /// standby hydrating).
    pub(crate) fn reconfiguring(&self, replica_id: u64, kind: &'static str, target: (u32, u32)) {
        self.reconfigurations.lock().expect("poisoned").insert(
            replica_id,
            Reconfiguration {
                kind,
                target,
                phase: ReconfigurationPhase::StandbyHydrating,
                started: Instant::now(),
                phase_started: Instant::now(),
            },
        );
    }

    /// Replica `replica_id`'s reconfiguration moved to `phase`.
    pub(crate) fn reconfiguration_moved(&self, replica_id: u64, phase: ReconfigurationPhase) {
        if let Some(r) = self
            .reconfigurations
            .lock()
            .expect("poisoned")
            .get_mut(&replica_id)
        {
            r.phase = phase;
            r.phase_started = Instant::now();
        }
    }

    /// Replica `replica_id`'s reconfiguration ended.
    pub(crate) fn reconfigured(&self, replica_id: u64) {
        self.reconfigurations
            .lock()
            .expect("poisoned")
            .remove(&replica_id);
    }

    /// Replica `replica_id`'s reconfiguration under way, if any.
    pub fn reconfiguration(&self, replica_id: u64) -> Option<Reconfiguration> {
        self.reconfigurations
            .lock()
            .expect("poisoned")
            .get(&replica_id)
            .cloned()
    }

    /// Registers `controller` as replica `replica_id`'s standby (reads stay
    /// with the replica's own until [`route_reads`](Self::route_reads)).
    pub(crate) fn add_standby(&self, replica_id: u64, controller: Controller) {
        let old = self.standbys.lock().expect("poisoned").insert(
            replica_id,
            Standby {
                controller,
                serves_reads: false,
            },
        );
        if let Some(old) = old {
            old.controller.shutdown();
        }
    }

    /// Removes and shuts down replica `replica_id`'s standby; reads go to
    /// the replica's own controller again. Returns whether there was one.
    pub(crate) fn remove_standby(&self, replica_id: u64) -> bool {
        let old = self.standbys.lock().expect("poisoned").remove(&replica_id);
        old.map(|s| s.controller.shutdown()).is_some()
    }

    /// The standby's controller of replica `replica_id`, if it has one.
    pub(crate) fn standby(&self, replica_id: u64) -> Option<Controller> {
        self.standbys
            .lock()
            .expect("poisoned")
            .get(&replica_id)
            .map(|s| s.controller.clone())
    }

    /// Sends replica `replica_id`'s reads from now on to its standby (`to`
    /// [`Generation::Standby`]) or its own controller. No-op without a
    /// standby.
    pub(crate) fn route_reads(&self, replica_id: u64, to: Generation) {
        if let Some(s) = self.standbys.lock().expect("poisoned").get_mut(&replica_id) {
            s.serves_reads = to == Generation::Standby;
        }
    }

    /// Every controller that takes replica `replica_id`'s mutations: its
    /// own (first), then its standby's.
    pub(crate) fn mutated(&self, replica_id: u64) -> Vec<Controller> {
        self.controller(replica_id)
            .into_iter()
            .chain(self.standby(replica_id))
            .collect()
    }

    /// Performs the mutation `send` on replica `replica_id`'s standby, if
    /// it has one. A standby that cannot take it is removed (it would
    /// answer reads without it; the upgrade then fails).
    pub(crate) fn to_standby(
        &self,
        replica_id: u64,
        send: impl FnOnce(&Controller) -> Result<(), ControllerError>,
    ) {
        let Some(standby) = self.standby(replica_id) else {
            return;
        };
        if let Err(e) = send(&standby) {
            tracing::warn!(
                replica = replica_id,
                "the standby missed a mutation and is removed: {e}"
            );
            self.remove_standby(replica_id);
        }
    }

    /// The controller that answers replica `replica_id`'s reads now, with
    /// the token the read holds until it is answered.
    pub(crate) fn reader(&self, replica_id: u64) -> Option<(Controller, ReadToken)> {
        // The token is taken under the routing lock: an upgrade that routes
        // reads away and then drains the old route sees this read.
        let standbys = self.standbys.lock().expect("poisoned");
        let (controller, generation) = match standbys.get(&replica_id).filter(|s| s.serves_reads) {
            Some(s) => (s.controller.clone(), Generation::Standby),
            None => (self.controller(replica_id)?, Generation::Own),
        };
        Some((controller, ReadToken(self.reads_of(replica_id, generation))))
    }

    /// The count of replica `replica_id`'s reads in flight that went to
    /// `generation`: one more for every clone of it.
    fn reads_of(&self, replica_id: u64, generation: Generation) -> Arc<()> {
        self.reads
            .lock()
            .expect("poisoned")
            .entry((replica_id, generation))
            .or_default()
            .clone()
    }

    /// Waits until no read of replica `replica_id` that went to
    /// `generation` waits for its answer, at most `bound`; returns whether
    /// none does.
    pub(crate) async fn drain_reads(
        &self,
        replica_id: u64,
        generation: Generation,
        bound: Duration,
    ) -> bool {
        let token = self.reads_of(replica_id, generation);
        let deadline = Instant::now() + bound;
        // Two counts are ours: the map's and `token`.
        while Arc::strong_count(&token) > 2 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }
}
