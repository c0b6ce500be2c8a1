//! The compute model's configuration and steps: the I/O around the session
//! machines (channels, mesh, stream, log), sessions and replica restarts.

use std::sync::Arc;

use lockstep_protocol::{Digest, Strategy};
use lockstep_reconcile::{
    rules, Action, BarrierDecision, ControllerSession, DataflowKey, Delivery, DeliveryMutant,
    GateMutant, HistoryStep, LogHoldMutant, LogRead, MeshAnnouncement, MismatchResolution,
    ReplicaDelivery, RoundMutant, Source, WorkerSession,
};

use super::state::{
    description, digest_of, Cmd, CmdKind, ComputeState, Msg, Runs, Worker, LABELS, MAX_DATAFLOWS,
};
use super::{ComputeBounds, ComputeModel, HistoryCheck};

impl ComputeModel {
    /// The digest a worker reports on Hello under the history check.
    fn history_digest(&self, w: &Worker) -> Digest {
        match self.history {
            // The compacted history: the creates of what still runs, in order.
            HistoryCheck::Compacted | HistoryCheck::Off => digest_of(&w.keys()),
            HistoryCheck::Full | HistoryCheck::FullCollective => digest_of(&(&w.log, &w.installed)),
        }
    }

    /// A dataflow's name in traces.
    pub(super) fn label(&self, k: &DataflowKey) -> &'static str {
        self.pool
            .iter()
            .position(|p| p == k)
            .map_or("?", |i| LABELS[i])
    }

    /// The name of a dataflow ID in traces (the first pool entry with it).
    pub(super) fn id_label(&self, id: u64) -> &'static str {
        self.pool
            .iter()
            .position(|p| p.id == id)
            .map_or("?", |i| LABELS[i])
    }

    /// The model of `strategy` within `bounds`.
    pub fn new(strategy: Strategy, bounds: ComputeBounds) -> Self {
        assert!(
            bounds.dataflows <= MAX_DATAFLOWS,
            "at most {MAX_DATAFLOWS} dataflows"
        );
        let pool = (0..bounds.dataflows)
            .map(|i| {
                let d = description(i);
                DataflowKey {
                    id: d.id,
                    hash: d.hash(),
                }
            })
            .collect();
        ComputeModel {
            strategy,
            then: None,
            hold_mutant: LogHoldMutant::None,
            delivery_mutant: DeliveryMutant::None,
            mutant: RoundMutant::None,
            gate_mutant: GateMutant::None,
            history: HistoryCheck::Off,
            bounds,
            pool,
            reachable: Arc::default(),
        }
    }

    /// The model whose sessions alternate between `log` (the first session)
    /// and `then`: the `log-then-barrier` and `log-then-broadcast`
    /// variants. Every worker tails the log.
    pub fn log_then(then: Strategy, bounds: ComputeBounds) -> Self {
        Self::alternating(Strategy::Log, then, bounds)
    }

    /// The model whose sessions alternate between `first` (the first
    /// session's, and every odd one's) and `then` (every even session's),
    /// as when restarted controllers or a changed policy choose another
    /// strategy: a pair of strategies (`barrier-then-broadcast`, ...).
    pub fn alternating(first: Strategy, then: Strategy, bounds: ComputeBounds) -> Self {
        assert_ne!(first, then, "a pair is of two strategies");
        assert!(
            first != Strategy::Naive && then != Strategy::Naive,
            "naive reconciles alone; it follows barrier only as the \
             history-full-collective control"
        );
        let mut m = Self::new(first, bounds);
        m.then = Some(then);
        m
    }

    /// The same model with a flaw planted in every worker's log-marker
    /// hold.
    pub fn with_log_hold_mutant(mut self, mutant: LogHoldMutant) -> Self {
        self.hold_mutant = mutant;
        self
    }

    /// The same model with a flaw planted in the controller's delivery
    /// decisions.
    pub fn with_delivery_mutant(mut self, mutant: DeliveryMutant) -> Self {
        self.delivery_mutant = mutant;
        self
    }

    /// The strategy the policy chooses for `session` (the controller's
    /// machine takes it: [`ControllerSession::session_choice`]).
    pub fn session_strategy(&self, session: u64) -> Strategy {
        match self.then {
            Some(then) if session.is_multiple_of(2) => then,
            _ => self.strategy,
        }
    }

    /// Whether workers tail the durable log (some session uses `log`).
    pub(super) fn tails_log(&self) -> bool {
        self.sources().any(|s| s == Source::Log)
    }

    /// A fresh worker `index` of `peers`, in session 0, reading the log
    /// (if it tails one) from `log_cursor`: the replica's machine with the
    /// model's planted flaws.
    pub(super) fn fresh_worker(&self, index: usize, peers: usize, log_cursor: usize) -> Worker {
        let mut machine = WorkerSession::new(index, peers, true)
            .with_mutant(self.mutant)
            .with_log_hold_mutant(self.hold_mutant);
        if self.tails_log() {
            machine.set_tails_log();
            machine.log_starts_at(log_cursor as u64);
        }
        Worker::fresh(machine)
    }

    /// The naive model with a history check on reconnect.
    pub fn with_history_check(mut self, history: HistoryCheck) -> Self {
        assert_eq!(
            self.strategy,
            Strategy::Naive,
            "the history check rides on naive"
        );
        self.history = history;
        self
    }

    /// The same model with a flaw planted in the controller's history check.
    pub fn with_gate_mutant(mut self, mutant: GateMutant) -> Self {
        self.gate_mutant = mutant;
        self
    }

    /// What the model's policy answers on a history mismatch.
    pub fn mismatch(&self) -> MismatchResolution {
        match self.history {
            HistoryCheck::FullCollective => MismatchResolution::ReconcileCollectively,
            _ => MismatchResolution::RestartReplica,
        }
    }

    /// The controller's next step in the history check, from the reports of
    /// its session so far (what the controller's actor runs; the model's
    /// bound never passes).
    pub fn history_step(&self, s: &ComputeState) -> HistoryStep {
        s.ctl.machine.clone().check_histories(0, u64::MAX)
    }

    /// A fresh controller session machine, for a replica of one worker per
    /// process, with a command log if the workers tail one.
    pub(super) fn controller_machine(&self, workers: usize) -> ControllerSession {
        let replica = ReplicaDelivery {
            processes: workers,
            command_log: self.tails_log(),
            rules: lockstep_reconcile::DeliveryRules::AS_CHOSEN,
        };
        ControllerSession::new(workers, replica)
            .with_gate_mutant(self.gate_mutant)
            .with_delivery_mutant(self.delivery_mutant)
    }

    /// The controller's machine starts delivering `session` (connected to
    /// every process): with the strategy it takes from the policy's choice.
    pub(super) fn start_delivery(&self, machine: &mut ControllerSession, session: u64) -> bool {
        let choice = machine.session_choice(Some(self.session_strategy(session)));
        debug_assert_eq!(
            choice.fallback, None,
            "the model's choices need no fallback"
        );
        machine.start_delivery(choice.strategy).marker
    }

    /// The same model with a flaw planted in every worker's round book.
    pub fn with_mutant(mut self, mutant: RoundMutant) -> Self {
        self.mutant = mutant;
        self
    }

    /// Whether every session's commands are sequenced by process 0 (their
    /// source is the sequencer: broadcast), so only its channel carries
    /// them.
    pub(super) fn only_sequenced(&self) -> bool {
        self.sources().all(|s| s == Source::Sequencer)
    }

    /// Whether some session's commands are sequenced by process 0.
    pub(super) fn sequences(&self) -> bool {
        self.sources().any(|s| s == Source::Sequencer)
    }

    /// The source of each strategy some session uses.
    fn sources(&self) -> impl Iterator<Item = Source> {
        [Some(self.strategy), self.then]
            .into_iter()
            .flatten()
            .map(|s| rules(s).source())
    }

    /// Whether `msg` goes to the sequencer (a broadcast session's).
    pub(super) fn is_sequenced(&self, msg: &Msg) -> bool {
        rules(self.strategy_of(msg)).source() == Source::Sequencer
    }

    /// Whether some session's commands travel on the channels (every
    /// strategy but `log`).
    pub(super) fn uses_channels(&self) -> bool {
        self.sources().any(|s| s != Source::Log)
    }

    /// Sends one command of the controller's session as the controller's
    /// machine decides ([`ControllerSession::command_choice`],
    /// [`ControllerSession::delivery`]): appended to the log (whose socket
    /// copies only wake the workers, and are not modelled), or a copy to
    /// every channel, of which a sequenced strategy's workers take only
    /// the sequencer's (the others are not modelled either).
    pub(super) fn send(&self, s: &mut ComputeState, msg: Msg) {
        let machine = &s.ctl.machine;
        let strategy = machine
            .command_choice(Some(self.session_strategy(s.ctl.session)))
            .strategy;
        debug_assert_eq!(strategy, self.strategy_of(&msg));
        match machine.delivery(strategy, false) {
            Delivery::AppendThenCopies { .. } => s.stream.push(msg),
            Delivery::Copies | Delivery::PartsPerProcess => match rules(strategy).source() {
                Source::Sequencer => s.channels[0].push_back(msg),
                Source::Socket | Source::Log => {
                    for c in &mut s.channels {
                        c.push_back(msg.clone());
                    }
                }
            },
        }
    }

    /// A new session (the controller's machine was told the old one
    /// ended, or is new): Hello, then the target, after the history check
    /// if there is one.
    pub(super) fn start_session(&self, s: &mut ComputeState) {
        if s.ctl.machine.phase().is_connected() {
            s.ctl.machine.disconnected(0);
        } else {
            s.ctl.machine.connect();
        }
        s.ctl.machine.connected(s.workers.len());
        s.ctl.session += 1;
        let session = s.ctl.session;
        if self.start_delivery(&mut s.ctl.machine, session) {
            // The machine has every session's marker appended to the log,
            // whatever its strategy, before the Hellos (a log session's
            // Hello is its marker).
            s.stream.push(Msg::Hello { session });
        }
        self.send(s, Msg::Hello { session });
        s.ctl.machine.rehydrated(0);
        if self.history == HistoryCheck::Off {
            // No history check: the controller's bound for the reports
            // passes at once, and it completes unchecked.
            match s.ctl.machine.check_histories(1, 0) {
                HistoryStep::Complete { collective, .. } => self.complete(s, collective),
                step => unreachable!("an unchecked session completes, not {step:?}"),
            }
        }
    }

    /// InitializationComplete: the target, then the machine serves.
    pub(super) fn complete(&self, s: &mut ComputeState, collective: bool) {
        self.send_target(s, collective);
        s.ctl.machine.serving(0);
    }

    /// The target and InitializationComplete, after Hello.
    fn send_target(&self, s: &mut ComputeState, collective: bool) {
        let session = s.ctl.session;
        let keys = s.ctl.catalog.clone();
        let machine = &s.ctl.machine;
        let chosen = machine
            .command_choice(Some(self.session_strategy(session)))
            .strategy;
        let complete = machine.completion_strategy(chosen, collective);
        self.send(
            s,
            Msg::Target {
                session,
                seqno: 1,
                keys,
                complete,
            },
        );
        s.ctl.seqno = 2;
    }

    /// Restarts the replica: fresh processes, an empty mesh, a new session.
    pub(super) fn restart_replica(&self, s: &mut ComputeState) {
        s.replica_restarts += 1;
        for c in &mut s.channels {
            c.clear();
        }
        for inbox in &mut s.inboxes {
            inbox.clear();
        }
        s.sequenced.clear();
        // Fresh workers read the log from the next session's marker.
        let cursor = if self.tails_log() { s.stream.len() } else { 0 };
        let peers = s.workers.len();
        for i in 0..peers {
            s.workers[i] = self.fresh_worker(i, peers, cursor);
        }
        s.reports = vec![None; s.workers.len()];
        self.start_session(s);
    }

    /// The strategy of the commands of `msg`: that of its session.
    fn strategy_of(&self, msg: &Msg) -> Strategy {
        self.session_strategy(msg.session())
    }

    /// Worker `p` receives `msg` in its order: its session machine queues
    /// it, then runs until it waits.
    pub(super) fn receive(&self, s: &mut ComputeState, p: usize, msg: &Msg) {
        for cmd in msg.commands(self.strategy_of(msg)) {
            s.workers[p].machine.push(cmd);
        }
        self.run(s, p);
    }

    /// Worker `p` reads the next entry of the log (one read of one entry,
    /// or of a target's entries) through the machine, as the replica's
    /// worker does (`WorkerSession::read_log` over the model's in-memory
    /// log: `log` entries are queued, every session's marker releases what
    /// waits for it), then runs until it waits.
    pub(super) fn read_log(&self, s: &mut ComputeState, p: usize) {
        let mut log = StreamLog {
            stream: &s.stream,
            model: self,
        };
        let Ok(read) = s.workers[p].machine.read_log(&mut log, 1);
        debug_assert!(read > 0, "a read is enabled only with an entry to read");
        self.run(s, p);
    }

    /// Performs what worker `p`'s session machine hands out until it waits,
    /// as the replica's worker does.
    pub(super) fn run(&self, s: &mut ComputeState, p: usize) {
        loop {
            let w = &mut s.workers[p];
            let Some(action) = w.machine.next(&Runs(&w.installed, &w.log), 0) else {
                return;
            };
            match action {
                Action::Announce(record) => self.mesh_send(s, p, record),
                Action::Hello { cmd, .. } => {
                    if let (CmdKind::Hello(session), true) =
                        (cmd.kind, self.history != HistoryCheck::Off)
                    {
                        let digest = self.history_digest(&s.workers[p]);
                        s.reports[p] = Some((session, digest));
                        if session == s.ctl.session {
                            let nonce = s.ctl.machine.nonce();
                            s.ctl.machine.reported(p as u32, nonce, digest);
                        }
                    }
                }
                Action::Drop { id, .. } => w.drop_id(id),
                Action::Apply(cmd) => w.apply(&cmd),
                Action::ResetHistory | Action::Skipped { .. } => {}
                Action::Halt(_) => {
                    w.halted = true;
                    return;
                }
            }
        }
    }

    /// Worker `me` sends `record` on the mesh: every peer's queue gets it
    /// (its own machine read it when it announced it). Under `naive` no
    /// round is ever announced, so nothing reads the joins it sends and the
    /// model does not queue them.
    fn mesh_send(&self, s: &mut ComputeState, me: usize, record: MeshAnnouncement) {
        if self.strategy == Strategy::Naive
            && self.mismatch() != MismatchResolution::ReconcileCollectively
        {
            return;
        }
        for (w, inbox) in s.inboxes.iter_mut().enumerate() {
            if w != me {
                inbox.push_back((me, record.clone()));
            }
        }
    }

    /// The decision on worker `me`'s pending round after its machine read
    /// 0, 1, ... up to every record of its mesh queue (each record read
    /// once); empty without a pending round.
    pub(super) fn decisions(&self, s: &ComputeState, me: usize) -> Vec<BarrierDecision> {
        let w = &s.workers[me];
        let Some(first) = w.machine.decision() else {
            return Vec::new();
        };
        let mut machine = w.machine.clone();
        let mut out = vec![first];
        for (from, record) in &s.inboxes[me] {
            machine.on_mesh(*from, record.clone());
            out.extend(machine.decision());
        }
        out
    }

    /// The decision on worker `me`'s pending round after it read the next
    /// `read` records of its mesh queue.
    pub(super) fn decision(
        &self,
        s: &ComputeState,
        me: usize,
        read: usize,
    ) -> Option<BarrierDecision> {
        self.decisions(s, me).into_iter().nth(read)
    }
}

/// The model's durable log as a worker's machine reads it: one [`Msg`] per
/// offset, expanded into the commands the worker receives for it.
struct StreamLog<'a> {
    stream: &'a [Msg],
    model: &'a ComputeModel,
}

impl LogRead<Cmd> for StreamLog<'_> {
    type Error = std::convert::Infallible;

    fn read_from(&mut self, offset: u64, max: usize) -> Result<(Vec<Cmd>, u64), Self::Error> {
        let mut commands = Vec::new();
        let mut next = offset;
        for msg in self.stream.iter().skip(offset as usize).take(max) {
            commands.extend(msg.commands(self.model.strategy_of(msg)));
            next += 1;
        }
        Ok((commands, next))
    }
}
