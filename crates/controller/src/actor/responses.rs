//! What the processes send: one arm per response, merged across processes
//! (peeks, subscribes, frontiers, statuses), and refusals of answers that
//! break the protocol's bounds.

use super::*;

impl Actor {
    /// A message of a process's connection: a closed connection ends the
    /// session; a response goes to its `on_*` handler, one per kind.
    pub(super) fn on_conn(&mut self, msg: FromConn) {
        if msg.generation != self.generation || !self.phase().is_connected() {
            return;
        }
        let p = msg.process;
        self.last_heard[p] = Instant::now();
        self.silent_reported[p] = false;
        let resp = match msg.event {
            ConnEvent::Closed(reason) => {
                tracing::warn!(process = p, %reason, "connection to replica process lost");
                self.emit(Event::Disconnected {
                    process: p,
                    reason: reason.clone(),
                });
                self.disconnect(format!("process {p}: {reason}"));
                return;
            }
            ConnEvent::Response(r) => r,
        };
        if resp.process_index as usize != p {
            self.refuse_answer(
                p,
                format!(
                    "a response names process {} on the connection to process {p}",
                    resp.process_index
                ),
            );
            return;
        }
        match resp.kind {
            ResponseKind::Frontiers(updates) => self.on_frontiers(p, updates),
            ResponseKind::PeekResponse(r) => self.on_peek_response(p, r),
            ResponseKind::SubscribeResponse(b) => self.on_subscribe_response(p, b),
            ResponseKind::Status(s) => self.on_status(p, s),
            ResponseKind::HelloResponse(h) => self.on_hello_response(p, h),
            ResponseKind::Error(error) => self.on_error(p, error),
        }
    }

    /// Process `p`'s frontiers: recorded per collection (at most a bounded
    /// number of collections the controller does not know).
    fn on_frontiers(&mut self, p: usize, updates: Vec<(u64, Frontier)>) {
        for (c, f) in updates {
            let per = match self.frontiers.entry(c) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    if !self.known_collections.contains(&c) {
                        self.unknown_frontiers += 1;
                        if self.unknown_frontiers > self.limits.unknown_frontiers {
                            let limit = self.limits.unknown_frontiers;
                            self.refuse_answer(
                                p,
                                format!(
                                    "frontiers reported for more than {limit} collections the controller does not know (the last: {c})"
                                ),
                            );
                            return;
                        }
                    }
                    v.insert(BTreeMap::new())
                }
            };
            per.insert(p, f);
        }
        self.answer_frontier_waiters();
    }

    /// Process `p`'s answer (or part of one) to a peek; the merged answer
    /// goes out once every process answered.
    fn on_peek_response(&mut self, p: usize, r: lockstep_protocol::PeekResponse) {
        let n = self.replica.processes.len();
        if let Some(pending) = self.peeks.get_mut(&r.peek_id) {
            let result = match r.result {
                PeekResult::Part(rows) => {
                    pending.parts_bytes += rows
                        .iter()
                        .map(|(row, _)| update_bytes(row.len()))
                        .sum::<usize>();
                    if pending.parts_bytes > self.limits.peek_part_bytes {
                        let limit = self.limits.peek_part_bytes;
                        let message = format!(
                            "the answer to peek {} exceeds {limit} bytes held in parts",
                            r.peek_id
                        );
                        // Asked again, it would be refused again: the
                        // peek fails and leaves the history.
                        let pending = self.peeks.remove(&r.peek_id).expect("present");
                        self.history.retire_peek(r.peek_id);
                        let _ = pending
                            .reply
                            .send(Err(ControllerError::Replica(message.clone())));
                        self.refuse_answer(p, message);
                        return;
                    }
                    pending.parts.entry(p).or_default().extend(rows);
                    return;
                }
                PeekResult::Rows(rows) => match pending.parts.remove(&p) {
                    Some(mut parts) => {
                        let bytes: usize =
                            parts.iter().map(|(row, _)| update_bytes(row.len())).sum();
                        pending.parts_bytes = pending.parts_bytes.saturating_sub(bytes);
                        parts.extend(rows);
                        PeekResult::Rows(parts)
                    }
                    None => PeekResult::Rows(rows),
                },
                other => other,
            };
            pending.results.insert(p, result);
            if pending.results.len() == n {
                let pending = self.peeks.remove(&r.peek_id).expect("present");
                self.history.retire_peek(r.peek_id);
                let answer = match merge_peek(pending.results.into_values()) {
                    PeekResult::Rows(rows) | PeekResult::Part(rows) => Ok(rows),
                    PeekResult::Error(e) => Err(ControllerError::Replica(e)),
                    PeekResult::Canceled => Err(ControllerError::Replica("peek canceled".into())),
                };
                let _ = pending.reply.send(answer);
            }
        }
    }

    /// Process `p`'s batch of a subscription, merged with the others' and
    /// passed on; a stalled receiver or too much held back ends it.
    fn on_subscribe_response(&mut self, p: usize, b: lockstep_protocol::SubscribeBatch) {
        let id = b.subscribe_id;
        if let Some(sub) = self.subs.get_mut(&id) {
            let (out, held) = sub.push(p, b);
            let mut stalled = false;
            if let Some(out) = out {
                if sub.sink.capacity() <= 1 {
                    // The receiver stopped reading: the last slot
                    // carries the error, and the subscription ends
                    // here and on the replica.
                    let _ = sub.sink.try_send(Err(ControllerError::Replica(format!(
                        "subscription {id}: the client left more than {} batches unread; ended",
                        crate::SUBSCRIBE_CHANNEL_BATCHES - 1
                    ))));
                    stalled = true;
                } else {
                    let _ = sub.sink.try_send(Ok(out));
                }
            }
            if stalled {
                tracing::warn!(
                    subscribe_id = id,
                    "a subscriber did not keep up; ending its subscription"
                );
                self.subs.remove(&id);
                self.send(CommandKind::CancelSubscribe { subscribe_id: id });
            } else if sub.merge.is_done() {
                self.subs.remove(&id);
            } else if held > self.limits.subscribe_buffer_bytes {
                let limit = self.limits.subscribe_buffer_bytes;
                let message = format!(
                    "subscription {id} holds back more than {limit} bytes of updates past the processes' common upper"
                );
                // The subscription ends with an error and leaves
                // the history (resent, it would grow again).
                let sub = self.subs.remove(&id).expect("present");
                let _ = sub
                    .sink
                    .try_send(Err(ControllerError::Replica(message.clone())));
                self.refuse_answer(p, message);
                self.history
                    .push(CommandKind::CancelSubscribe { subscribe_id: id });
            }
        }
    }

    /// Process `p`'s status of one of its own workers.
    fn on_status(&mut self, p: usize, s: lockstep_protocol::Status) {
        // Process p owns workers p*W..(p+1)*W: a status of another
        // worker is a lie (or a bug) that would stand in for that
        // worker's own report, and grow the status maps.
        let per = self.replica.workers_per_process as usize;
        let owned = p * per..(p + 1) * per;
        if !owned.contains(&(s.worker_index as usize)) {
            self.refuse_answer(
                p,
                format!(
                    "a status of worker {}, which process {p} does not own (it owns workers {}..{})",
                    s.worker_index, owned.start, owned.end
                ),
            );
            return;
        }
        // A Status before any HelloResponse: the process agreed
        // on version 2 (it sends a HelloResponse from 3 on).
        if let Some(v @ None) = self.versions.get_mut(p) {
            *v = Some(crate::ProcessVersion {
                protocol_version: 2,
                build_version: None,
            });
        }
        let full = s.history_hash.is_some();
        if full {
            self.full_statuses.insert(s.worker_index, s.clone());
            self.on_full_status(&s);
        }
        self.statuses.insert(s.worker_index, s);
        self.answer_status_waiters();
    }

    /// The protocol version process `p` agreed on, and its build.
    fn on_hello_response(&mut self, p: usize, h: lockstep_protocol::HelloResponse) {
        // The agreed version must be one this controller offered.
        let (low, high) = lockstep_protocol::handshake::SUPPORTED_VERSIONS;
        if !(low..=high).contains(&h.protocol_version) {
            self.refuse_answer(
                p,
                format!(
                    "a HelloResponse agreeing on protocol version {}, outside the offered {low} to {high}",
                    h.protocol_version
                ),
            );
            return;
        }
        tracing::info!(
            process = p,
            protocol_version = h.protocol_version,
            build_version = %h.build_version,
            "replica process agreed on a protocol version"
        );
        if let Some(v) = self.versions.get_mut(p) {
            *v = Some(crate::ProcessVersion {
                protocol_version: h.protocol_version,
                // For display only: bounded, whatever the process sent.
                build_version: Some(h.build_version.chars().take(64).collect()),
            });
        }
    }

    /// An error process `p` reports.
    fn on_error(&mut self, p: usize, error: lockstep_protocol::ErrorResponse) {
        tracing::warn!(process = p, ?error, "replica error");
        if matches!(
            error.kind,
            lockstep_protocol::ErrorKind::Malformed | lockstep_protocol::ErrorKind::InvalidCommand
        ) {
            self.refuse_dataflow(p, &error);
        }
        self.emit(Event::ReplicaError { process: p, error });
    }

    /// Process `p` sent an answer the controller refuses (`reason`): the
    /// session ends with an error, reported as a lost connection, and the
    /// controller reconnects (with backoff).
    pub(super) fn refuse_answer(&mut self, p: usize, reason: String) {
        tracing::error!(process = p, %reason, "refused a replica process's answer; ending the session");
        let reason = format!("refused answer: {reason}");
        self.emit(Event::Disconnected {
            process: p,
            reason: reason.clone(),
        });
        self.disconnect(format!("process {p}: {reason}"));
    }

    /// A process refused a command as malformed (a frame that does not
    /// decode) or invalid (a description its family refuses, or an ID taken
    /// by another description); if it was a CreateDataflow, that dataflow
    /// leaves the history (resent, it would be refused again, and a
    /// malformed frame costs the connection each time, so none of the
    /// replica's dataflows would answer; an invalid one is built nowhere,
    /// so it would never answer) and the owner is told.
    pub(super) fn refuse_dataflow(&mut self, process: usize, error: &ErrorResponse) {
        let Some(&id) = self.sent_creates.get(&error.seqno) else {
            return;
        };
        if self.history.forget_dataflow(id).is_some() {
            tracing::error!(
                process,
                dataflow = id,
                message = %error.message,
                "a replica process refused the dataflow's command as malformed: it leaves the history and is not resent"
            );
            self.emit(Event::DataflowRefused {
                dataflow: id,
                process,
                message: error.message.clone(),
            });
        }
    }
}
