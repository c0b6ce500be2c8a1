//! The owner's requests: one arm per request, and the waiters for statuses
//! and frontiers they leave (answered as responses come in).

use super::*;

impl Actor {
    pub(super) fn on_request(&mut self, r: Request) {
        match r {
            Request::SetPolicy(policy) => {
                tracing::info!(policy = %policy.name(), "distribution policy replaced; in force from the next session");
                self.policy = policy;
            }
            Request::SetAddresses(addrs) => {
                if addrs.len() != self.replica.processes.len() {
                    tracing::error!(
                        ?addrs,
                        processes = self.replica.processes.len(),
                        "new process addresses ignored: not one per process"
                    );
                    return;
                }
                tracing::info!(?addrs, "the replica's processes moved; reconnecting");
                self.replica.processes = addrs;
                self.disconnect("the replica's processes moved to new addresses".into());
            }
            Request::Reshape(replica) => self.reshape(replica),
            Request::Send(kind) => {
                // A (re)created collection starts with no reported frontier.
                if let CommandKind::CreateDataflow(d) = &kind {
                    for e in &d.exports {
                        self.frontiers.remove(&e.collection_id);
                    }
                }
                // A dropped collection ends its subscriptions with an error.
                if let CommandKind::AllowCompaction {
                    collection_id,
                    frontier: None,
                } = &kind
                {
                    let ended: Vec<u64> = self
                        .subs
                        .iter()
                        .filter(|(_, s)| s.collection == *collection_id)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in ended {
                        let sub = self.subs.remove(&id).expect("listed");
                        let _ = sub.sink.try_send(Err(ControllerError::Dropped {
                            collection: *collection_id,
                        }));
                    }
                }
                self.send(kind)
            }
            Request::Peek {
                collection,
                timestamp,
                reply,
            } => {
                let peek_id = self.next_peek_id;
                self.next_peek_id += 1;
                self.peeks.insert(
                    peek_id,
                    PendingPeek {
                        results: BTreeMap::new(),
                        parts: BTreeMap::new(),
                        parts_bytes: 0,
                        reply,
                    },
                );
                self.send(CommandKind::Peek(Peek {
                    peek_id,
                    collection_id: collection,
                    timestamp,
                }));
            }
            Request::Subscribe {
                collection,
                as_of,
                sink,
            } => {
                let id = self.next_subscribe_id;
                self.next_subscribe_id += 1;
                self.subs
                    .insert(id, Sub::new(collection, self.replica.processes.len(), sink));
                self.send(CommandKind::Subscribe(Subscribe {
                    subscribe_id: id,
                    collection_id: collection,
                    as_of,
                }));
            }
            Request::Statuses { full, reply } => {
                let at = self.request_status(full);
                self.status_waiters.push((at, full, reply));
            }
            Request::Frontier { collection, reply } => {
                let _ = reply.send(self.frontier_of(collection));
            }
            Request::WaitFrontier {
                collection,
                beyond,
                reply,
            } => {
                self.frontier_waiters.push((collection, beyond, reply));
                self.answer_frontier_waiters();
            }
            Request::History { reply } => {
                let mut h = self.history.clone();
                h.reduce();
                let _ = reply.send(h);
            }
            Request::ProcessLags { reply } => {
                let _ = reply.send(self.process_lags());
            }
            Request::CaughtUp { reply } => {
                let _ = reply.send(self.caught_up());
            }
            Request::ProcessVersions { reply } => {
                let mut versions = self.versions.clone();
                versions.resize(self.replica.processes.len(), None);
                let _ = reply.send(versions);
            }
            Request::Reconnect => self.disconnect("reconnect requested".into()),
            Request::Shutdown => {}
        }
    }

    /// See [`crate::Controller::reshape`]: every per-process book sized
    /// for the new processes, then a new session with them.
    fn reshape(&mut self, replica: ReplicaAddrs) {
        if replica.replica_id != self.replica.replica_id {
            tracing::error!(
                ours = self.replica.replica_id,
                theirs = replica.replica_id,
                "a reshape for another replica ignored"
            );
            return;
        }
        let n = replica.processes.len();
        tracing::info!(
            processes = n,
            workers_per_process = replica.workers_per_process,
            "the replica was resized; reconnecting to its new processes"
        );
        self.session.reshape(replica.total_workers(), n);
        self.conns = (0..n).map(|_| None).collect();
        self.last_heard = vec![Instant::now(); n];
        self.silent_reported = vec![false; n];
        self.versions = vec![None; n];
        for sub in self.subs.values_mut() {
            sub.reshape(n);
        }
        self.replica = replica;
        self.disconnect("the replica was resized".into());
    }

    /// See [`crate::Controller::process_lags`].
    pub(super) fn process_lags(&self) -> Vec<Option<u64>> {
        let mut lags = vec![Some(0u64); self.replica.processes.len()];
        for d in self.history.live_dataflows() {
            let Some(written) = d.inputs.iter().map(|c| self.history.input_upper(*c)).min() else {
                continue;
            };
            for e in &d.exports {
                let reported = self.frontiers.get(&e.collection_id);
                for (p, lag) in lags.iter_mut().enumerate() {
                    let this = match reported.and_then(|r| r.get(&p)) {
                        None => None,
                        // Complete: nothing more to come.
                        Some(None) => Some(0),
                        Some(Some(t)) => Some(written.saturating_sub(*t)),
                    };
                    *lag = match (*lag, this) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                }
            }
        }
        lags
    }

    /// See [`crate::Controller::caught_up`].
    pub(super) fn caught_up(&self) -> crate::CaughtUp {
        let live = self.history.live_dataflows();
        let caught_up = live
            .iter()
            .filter(|d| {
                let written = d.inputs.iter().map(|c| self.history.input_upper(*c)).min();
                d.exports
                    .iter()
                    .all(|e| match self.frontier_of(e.collection_id) {
                        None => false,
                        // Complete: nothing more to come.
                        Some(None) => true,
                        Some(Some(t)) => written.is_none_or(|w| t >= w),
                    })
            })
            .count();
        crate::CaughtUp {
            dataflows: live.len(),
            caught_up,
        }
    }

    /// The meet of a collection's frontier over all processes, once every
    /// process reported it.
    pub(super) fn frontier_of(&self, collection: u64) -> Option<Frontier> {
        self.frontiers
            .get(&collection)
            .and_then(|per| (per.len() == self.replica.processes.len()).then(|| meet(per.values())))
    }

    pub(super) fn answer_frontier_waiters(&mut self) {
        let waiters = std::mem::take(&mut self.frontier_waiters);
        for (c, t, reply) in waiters {
            if reply.is_closed() {
                continue;
            }
            match self.frontier_of(c) {
                Some(f) if f.is_none_or(|f| f > t) => {
                    let _ = reply.send(());
                }
                _ => self.frontier_waiters.push((c, t, reply)),
            }
        }
    }

    /// Sends a StatusRequest; returns its (nonce, sequence number) if connected.
    pub(super) fn request_status(&mut self, full: bool) -> Option<(u64, u64)> {
        if !self.phase().is_connected() {
            return None;
        }
        self.broadcast(CommandKind::StatusRequest { full });
        Some((self.session.nonce(), self.seqno))
    }

    pub(super) fn answer_status_waiters(&mut self) {
        let total = self.replica.total_workers();
        let epoch = self.epoch;
        let waiters = std::mem::take(&mut self.status_waiters);
        for (at, full, reply) in waiters {
            if reply.is_closed() {
                continue;
            }
            let Some((nonce, seqno)) = at else {
                self.status_waiters.push((at, full, reply));
                continue;
            };
            let map = if full {
                &self.full_statuses
            } else {
                &self.statuses
            };
            let fresh = map
                .values()
                .filter(|s| s.epoch == epoch && s.nonce == nonce && s.applied_seqno >= seqno)
                .count();
            if fresh == total {
                let _ = reply.send(map.values().cloned().collect());
            } else {
                self.status_waiters.push((at, full, reply));
            }
        }
    }
}
