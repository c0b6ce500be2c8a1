//! The compute model as a stateright [`Model`]: initial states, enabled
//! actions, transitions and the list of properties.

use std::collections::VecDeque;

use lockstep_reconcile::{BarrierDecision, HistoryStep, LogHoldMutant};
use stateright::{Model, Property};

use super::state::{ComputeAction, ComputeState, Controller, Msg};
use super::{ComputeModel, MAX_REPLICA_RESTARTS};

impl Model for ComputeModel {
    type State = ComputeState;
    type Action = ComputeAction;

    fn init_states(&self) -> Vec<ComputeState> {
        let n = self.bounds.processes;
        let workers = (0..n)
            .map(|i| {
                let mut w = self.fresh_worker(i, n, 0);
                w.machine = w.machine.resumed(1);
                w
            })
            .collect();
        vec![ComputeState {
            ctl: Controller {
                up: true,
                epoch: 1,
                session: 1,
                seqno: 2,
                catalog: Vec::new(),
                commands: 0,
                faults: 0,
                machine: {
                    let mut m = self.controller_machine(n);
                    m.connect();
                    m.connected(n);
                    self.start_delivery(&mut m, 1);
                    m.rehydrated(0);
                    m.check_histories(1, 0);
                    m.serving(0);
                    m
                },
            },
            channels: vec![VecDeque::new(); n],
            workers,
            inboxes: vec![VecDeque::new(); n],
            stream: Vec::new(),
            sequenced: Vec::new(),
            replica_restarts: 0,
            reports: vec![None; n],
        }]
    }

    fn actions(&self, s: &ComputeState, actions: &mut Vec<ComputeAction>) {
        let b = &self.bounds;
        if s.ctl.up {
            if s.ctl.awaiting() && self.history_step(s) != HistoryStep::Wait {
                actions.push(ComputeAction::CheckHistories);
            }
            if s.ctl.commands < b.commands && !s.ctl.awaiting() {
                for (i, k) in self.pool.iter().enumerate() {
                    if s.ctl.catalog.contains(k) {
                        actions.push(ComputeAction::Drop(i));
                    } else if !s.ctl.catalog.iter().any(|c| c.id == k.id) {
                        actions.push(ComputeAction::Create(i));
                    }
                }
            }
            if s.ctl.faults < b.faults {
                actions.push(ComputeAction::Crash);
                if self.uses_channels() {
                    let connections = if self.only_sequenced() {
                        1
                    } else {
                        b.processes
                    };
                    for p in 0..connections {
                        actions.push(ComputeAction::DropConnection(p));
                    }
                }
                // Which process dies makes no difference: the whole replica stops.
                if !s.workers.iter().any(|w| w.halted) {
                    actions.push(ComputeAction::ProcessCrash(b.processes - 1));
                }
            }
            // A replica that halts again after every restart never reaches
            // the target: past MAX_REPLICA_RESTARTS the state is stuck, which
            // the liveness property reports (and the state space stays finite).
            if s.workers.iter().any(|w| w.halted) && s.replica_restarts < MAX_REPLICA_RESTARTS {
                actions.push(ComputeAction::RestartReplica);
            }
        } else {
            actions.push(ComputeAction::Restart);
        }
        for (p, w) in s.workers.iter().enumerate() {
            if w.halted {
                continue;
            }
            let waiting = w.machine.pending().is_some();
            if !s.channels[p].is_empty() {
                // The sequencer forwards what it receives whatever it waits
                // on, and the replica reads every frame as it comes: a
                // socket command queues in the machine while a round
                // waits. Where nothing behind it goes to the sequencer,
                // the model leaves it in the channel until the round is
                // decided instead, which reaches the same states with
                // fewer steps.
                if !waiting || s.channels[p].iter().any(|m| self.is_sequenced(m)) {
                    actions.push(ComputeAction::Receive(p));
                }
            }
            if !waiting && w.cursor < s.sequenced.len() {
                actions.push(ComputeAction::Apply(p));
            }
            if self.tails_log() && !waiting && w.log_position() < s.stream.len() {
                actions.push(ComputeAction::ReadLog(p));
            }
            if waiting {
                for (read, d) in self.decisions(s, p).into_iter().enumerate() {
                    if d != BarrierDecision::Wait {
                        actions.push(ComputeAction::Decide(p, read));
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &ComputeState, action: ComputeAction) -> Option<ComputeState> {
        let mut s = last.clone();
        match action {
            ComputeAction::Create(i) => {
                let key = self.pool[i];
                s.ctl.commands += 1;
                s.ctl.catalog.push(key);
                let (session, seqno) = (s.ctl.session, s.ctl.seqno);
                s.ctl.seqno += 1;
                self.send(
                    &mut s,
                    Msg::Create {
                        session,
                        seqno,
                        key,
                    },
                );
            }
            ComputeAction::Drop(i) => {
                let id = self.pool[i].id;
                s.ctl.commands += 1;
                s.ctl.catalog.retain(|k| k.id != id);
                let session = s.ctl.session;
                s.ctl.seqno += 1;
                self.send(&mut s, Msg::Drop { session, id });
            }
            ComputeAction::Crash => {
                s.ctl.faults += 1;
                s.ctl.up = false;
                for c in &mut s.channels {
                    c.clear();
                }
            }
            ComputeAction::Restart => {
                s.ctl.up = true;
                s.ctl.epoch += 1;
                s.ctl.machine = self.controller_machine(s.workers.len());
                self.start_session(&mut s);
            }
            ComputeAction::DropConnection(p) => {
                s.ctl.faults += 1;
                s.channels[p].clear();
                self.start_session(&mut s);
            }
            ComputeAction::ProcessCrash(_) => {
                s.ctl.faults += 1;
                for w in &mut s.workers {
                    w.halted = true;
                }
            }
            ComputeAction::CheckHistories => {
                // The processes must agree with each other: after a crash the
                // controller cannot know what they applied (it lost what was
                // in flight), and fresh processes have no history at all.
                // The model's policy restarts the replica on a mismatch, or
                // has it reconcile collectively (`history-full-collective`).
                let step = match s.ctl.machine.check_histories(0, u64::MAX) {
                    HistoryStep::AskPolicy { .. } => {
                        s.ctl.machine.mismatch_resolved(self.mismatch(), 0)
                    }
                    step => step,
                };
                match step {
                    HistoryStep::Complete { collective, .. } => self.complete(&mut s, collective),
                    HistoryStep::RestartReplica => self.restart_replica(&mut s),
                    HistoryStep::Wait | HistoryStep::AskPolicy { .. } => return None,
                }
            }
            ComputeAction::RestartReplica => self.restart_replica(&mut s),
            ComputeAction::Receive(p) => {
                let msg = s.channels[p].pop_front()?;
                if self.is_sequenced(&msg) {
                    s.sequenced.push(msg);
                } else {
                    self.receive(&mut s, p, &msg);
                }
            }
            ComputeAction::Decide(p, read) => {
                let d = self.decision(&s, p, read)?;
                if d == BarrierDecision::Wait {
                    return None;
                }
                for _ in 0..read {
                    let (from, record) = s.inboxes[p].pop_front()?;
                    s.workers[p].machine.on_mesh(from, record);
                }
                self.run(&mut s, p);
            }
            ComputeAction::Apply(p) => {
                let msg = s.sequenced.get(s.workers[p].cursor)?.clone();
                s.workers[p].cursor += 1;
                self.receive(&mut s, p, &msg);
            }
            ComputeAction::ReadLog(p) => {
                if s.workers[p].log_position() >= s.stream.len() {
                    return None;
                }
                self.read_log(&mut s, p);
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("I1 lockstep", |m: &Self, s| m.check_i1(s).is_ok()),
            Property::always("I4 no partial install", |m: &Self, s| m.check_i4(s).is_ok()),
            Property::always(
                "I2 target reachable without another fault",
                |m: &Self, s| m.target_reachable(s),
            ),
            Property::sometimes(
                "recovers from a fault with dataflows running",
                |m: &Self, s: &ComputeState| {
                    s.ctl.faults > 0 && !s.ctl.catalog.is_empty() && m.done(s)
                },
            ),
        ];
        // A cut-off log session is cut at the same entry on every worker
        // (the log-marker hold); a cut-off broadcast session is not (see
        // `PAIRS`): a worker may lose lockstep there, and the replica is
        // restarted.
        if self.then.is_some() && !self.sequences() {
            properties.push(Property::always(
                "no worker loses lockstep",
                |m: &Self, s| m.check_no_halt(s).is_ok(),
            ));
        }
        // The hold must be exercised (a mutant without it has none).
        if self.then.is_some() && self.tails_log() && self.hold_mutant == LogHoldMutant::None {
            properties.push(Property::sometimes(
                "a newer session waits for its log marker",
                |_: &Self, s: &ComputeState| s.workers.iter().any(|w| w.machine.holding()),
            ));
        }
        properties
    }
}
