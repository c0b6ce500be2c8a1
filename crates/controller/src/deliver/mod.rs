//! Delivering a command to the replica's processes: which strategy it is
//! sent with (`strategy_for`, `choose`), then what that strategy does with
//! it on the controller side (`broadcast_with` dispatches).
//!
//! Every command gets the session's next sequence number and one socket
//! copy per process; what differs is which copy a worker applies. Each
//! strategy's controller side is one [`Delivery`] type in the file named
//! after it, like its worker side (`lockstep_reconcile::worker`): `naive`,
//! `barrier`, `broadcast` and `log` (which also appends to the command log,
//! before the copies); [`delivery`] is the one place it is chosen. The partial-broadcast failpoint
//! may cut any of them short: `broadcast_with` arms the actor's
//! `CrashHook` for each command, and whatever writes the copies takes it.

mod barrier;
mod broadcast;
mod log;
mod naive;

use lockstep_policy::{CommandClass, CommandInfo};
use lockstep_protocol::{Command, CommandKind, Strategy, WireMessage};
use lockstep_reconcile::socket_ordered;

use crate::actor::Actor;

pub(crate) use log::LogBatch;

/// One strategy's controller side: how a numbered command that carries it
/// reaches the replica.
pub(crate) trait Delivery: Sync {
    /// Sends `cmd` to the replica's processes. The partial-broadcast
    /// failpoint may cut it short (the actor's `CrashHook` is armed).
    fn deliver(&self, actor: &mut Actor, cmd: Command);
    /// Whether it appends commands to the replica's command log (a choice
    /// of it for a replica without one gets the fallback, and a session
    /// started with it appends its start in one batch).
    fn appends_to_log(&self) -> bool {
        false
    }
}

/// The controller side of `strategy`: the one place each strategy's type is
/// chosen.
pub(crate) fn delivery(strategy: Strategy) -> &'static dyn Delivery {
    match strategy {
        Strategy::Naive => &naive::Naive,
        Strategy::Barrier => &barrier::Barrier,
        Strategy::Broadcast => &broadcast::Broadcast,
        Strategy::Log => &log::Log,
    }
}

impl Actor {
    /// Sends a command to every process (if connected).
    pub(crate) fn broadcast(&mut self, kind: CommandKind) {
        if !self.phase().is_connected() {
            return;
        }
        let strategy = self.strategy_for(&kind);
        match kind {
            // With a socket-ordered strategy each process applies its own
            // copy, and its workers keep only the rows they own: send each
            // process only those (`split_per_process`). Not with `broadcast`
            // (worker 0's copy goes to every worker) or `log` (one copy in
            // the log for all).
            CommandKind::WriteInput(w) if socket_ordered(strategy) && self.conns.len() > 1 => {
                let per_process = w.split_per_process(
                    self.conns.len(),
                    self.replica.workers_per_process as usize,
                    self.replica.max_frame_len / 2,
                );
                let parts = per_process.first().map_or(0, Vec::len);
                let mut per_process: Vec<_> = per_process.into_iter().map(Vec::into_iter).collect();
                for _ in 0..parts {
                    let kinds = per_process
                        .iter_mut()
                        .map(|p| CommandKind::WriteInput(p.next().expect("padded parts")))
                        .collect();
                    self.broadcast_each(kinds, strategy);
                }
            }
            // A write too large for one frame goes in parts, all with the
            // strategy chosen for the whole write.
            CommandKind::WriteInput(w) => {
                for part in w.split(self.replica.max_frame_len / 2) {
                    self.broadcast_with(CommandKind::WriteInput(part), strategy);
                }
            }
            kind => self.broadcast_with(kind, strategy),
        }
    }

    /// Sends a command to every process with `strategy`.
    pub(crate) fn broadcast_with(&mut self, kind: CommandKind, strategy: Strategy) {
        if !self.phase().is_connected() {
            return;
        }
        self.crash_hook.arm(kind.name());
        self.seqno += 1;
        if let CommandKind::CreateDataflow(d) = &kind {
            self.sent_creates.insert(self.seqno, d.id);
        }
        let cmd = Command {
            seqno: self.seqno,
            strategy,
            kind,
        };
        delivery(strategy).deliver(self, cmd);
    }

    /// Sends process `i` the command `kinds[i]`, all under one sequence
    /// number, with a socket-ordered `strategy` (`barrier` or `naive`,
    /// whose controller side is only the copies): a write split per process.
    /// The partial-broadcast failpoint may cut it short.
    fn broadcast_each(&mut self, kinds: Vec<CommandKind>, strategy: Strategy) {
        debug_assert!(socket_ordered(strategy));
        let Some(first) = kinds.first() else { return };
        self.crash_hook.arm(first.name());
        let crash = self.crash_hook.take();
        self.seqno += 1;
        let n = self.conns.len();
        for (i, kind) in kinds.into_iter().enumerate() {
            if crash.as_ref().is_some_and(|reach| !reach.reaches(i, n)) {
                continue;
            }
            let cmd = Command {
                seqno: self.seqno,
                strategy,
                kind,
            };
            self.write(i, cmd);
        }
        if crash.is_some() {
            self.crash();
        }
    }

    /// Writes a copy of `cmd` to every process (the whole controller side
    /// of the socket-ordered strategies and `broadcast`), or, if the failpoint's
    /// hook is armed, to the processes it reaches, and then crashes.
    fn send_copies(&mut self, cmd: Command) {
        if let Some(reach) = self.crash_hook.take() {
            self.write_reached(&cmd, reach);
            self.crash();
            return;
        }
        for i in 0..self.conns.len() {
            self.write(i, cmd.clone());
        }
    }

    /// Writes `cmd` to process `i`'s connection; a closed one is dropped
    /// (its reader reports why).
    pub(crate) fn write(&mut self, i: usize, cmd: Command) {
        if let Some(c) = &self.conns[i] {
            if c.writer.send(cmd).is_err() {
                self.conns[i] = None;
            }
        }
    }

    /// The strategy of a command in this session (see `session_strategy`):
    /// a session started with a strategy that is not socket-ordered
    /// (`broadcast`, `log`) sends every command with it, since its workers
    /// apply only that order; in a socket-ordered session the policy
    /// chooses among the socket-ordered ones.
    pub(crate) fn strategy_for(&mut self, kind: &CommandKind) -> Strategy {
        match self.session_strategy {
            s if !socket_ordered(s) => s,
            _ => match self.choose(kind) {
                s if !socket_ordered(s) => {
                    tracing::warn!(
                        chosen = %s,
                        session = %self.session_strategy,
                        fallback = %self.fallback,
                        "the policy chose an ordering strategy for a command of a socket-ordered session; using the fallback (choose it for Hello to use it for a whole session)"
                    );
                    self.fallback
                }
                s => s,
            },
        }
    }

    /// What the policy chooses for `kind`; a log choice without a command
    /// log, or a failing policy, gets the fallback.
    pub(crate) fn choose(&mut self, kind: &CommandKind) -> Strategy {
        let info = CommandInfo {
            class: CommandClass::of(kind),
            size_bytes: encoded_size(kind),
            dataflow_id: match kind {
                CommandKind::CreateDataflow(d) => Some(d.id),
                CommandKind::Schedule { dataflow_id } => Some(*dataflow_id),
                _ => None,
            },
            process_count: self.replica.processes.len() as u32,
            workers_per_process: self.replica.workers_per_process,
            reconciling: self.phase().reconciling(),
        };
        match self.policy.choose(&info) {
            Ok(s) if delivery(s).appends_to_log() && self.replica.command_log.is_none() => {
                tracing::warn!(fallback = %self.fallback, "the policy chose the log strategy but the replica has no command log; using the fallback");
                self.fallback
            }
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, fallback = %self.fallback, "distribution policy failed; using the fallback");
                self.fallback
            }
        }
    }
}

/// The encoded size of a command, for policies: its wire form's length,
/// computed without encoding it (every write passes here).
fn encoded_size(kind: &CommandKind) -> u64 {
    Command {
        seqno: 0,
        strategy: Strategy::Naive,
        kind: kind.clone(),
    }
    .encoded_len() as u64
}
