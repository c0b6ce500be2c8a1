//! Delivering a command to the replica's processes: the shell of the
//! session machine's delivery decisions ([`lockstep_reconcile::delivery`]).
//!
//! The machine decides which strategy a command is sent with (the session's
//! pinned one, the policy's choice, the fallback) and how it reaches the
//! processes ([`Delivery`]: copies, a write's per-process parts, an append
//! to the command log first); each strategy's rules are its module in
//! `lockstep_reconcile::strategy`. This file asks the policy and performs
//! the decision: it writes the socket copies, and the log's appends are in
//! `log.rs`. Every command gets the session's next sequence number. The
//! partial-broadcast failpoint may cut any delivery short: `broadcast_with`
//! arms the actor's `CrashHook` for each command, and whatever writes the
//! copies takes it.

use lockstep_policy::{CommandClass, CommandInfo};
use lockstep_protocol::{Command, CommandKind, Strategy};
use lockstep_reconcile::{Choice, Delivery, Fallback};

use super::Actor;

impl Actor {
    /// Sends a command to every process (if connected).
    pub(crate) fn broadcast(&mut self, kind: CommandKind) {
        if !self.phase().is_connected() {
            return;
        }
        let strategy = self.strategy_for(&kind);
        let write = matches!(kind, CommandKind::WriteInput(_));
        match (self.session.delivery(strategy, write), kind) {
            // Each process applies its own copy, and its workers keep only
            // the rows they own: send each process only those
            // (`split_per_process`).
            (Delivery::PartsPerProcess, CommandKind::WriteInput(w)) => {
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
            (_, CommandKind::WriteInput(w)) => {
                for part in w.split(self.replica.max_frame_len / 2) {
                    self.broadcast_with(CommandKind::WriteInput(part), strategy);
                }
            }
            (_, kind) => self.broadcast_with(kind, strategy),
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
        match self.session.delivery(strategy, false) {
            Delivery::AppendThenCopies { batched } => self.deliver_log(cmd, batched),
            Delivery::Copies | Delivery::PartsPerProcess => self.send_copies(cmd),
        }
    }

    /// Sends process `i` the command `kinds[i]`, all under one sequence
    /// number ([`Delivery::PartsPerProcess`]: a write split per process).
    /// The partial-broadcast failpoint may cut it short.
    fn broadcast_each(&mut self, kinds: Vec<CommandKind>, strategy: Strategy) {
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

    /// Writes a copy of `cmd` to every process ([`Delivery::Copies`]), or,
    /// if the failpoint's hook is armed, to the processes it reaches, and
    /// then crashes.
    pub(super) fn send_copies(&mut self, cmd: Command) {
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

    /// The strategy of a command in this session: the session's own if
    /// its start pinned one (the policy is not asked), else the policy's
    /// choice as the session machine takes it
    /// ([`lockstep_reconcile::ControllerSession::command_choice`]).
    pub(super) fn strategy_for(&mut self, kind: &CommandKind) -> Strategy {
        if let Some(pinned) = self.session.pinned() {
            return pinned;
        }
        let chosen = self.ask_policy(kind);
        let choice = self.session.command_choice(chosen);
        Self::say_fallback(choice);
        choice.strategy
    }

    /// The strategy of a session's Hello (`first`): the policy's choice as
    /// the session machine takes it
    /// ([`lockstep_reconcile::ControllerSession::session_choice`]).
    pub(super) fn session_strategy(&mut self, first: &CommandKind) -> Strategy {
        let chosen = self.ask_policy(first);
        let choice = self.session.session_choice(chosen);
        Self::say_fallback(choice);
        choice.strategy
    }

    /// Says why the policy's choice was not taken, if it was not.
    fn say_fallback(choice: Choice) {
        let fallback = choice.strategy;
        match choice.fallback {
            // Said with the policy's error (`ask_policy`).
            None | Some(Fallback::PolicyFailed) => {}
            Some(Fallback::NoCommandLog) => tracing::warn!(
                %fallback,
                "the policy chose the log strategy but the replica has no command log; using the fallback"
            ),
            Some(Fallback::NaiveRefused) => tracing::warn!(
                %fallback,
                "the distribution policy chose naive, the negative control; refused (a build with the test hooks allows it with --experiments-allow-naive), using the fallback"
            ),
            Some(Fallback::PinsSession) => tracing::warn!(
                %fallback,
                "the policy chose an ordering strategy for a command of a socket-ordered session; using the fallback (choose it for Hello to use it for a whole session)"
            ),
        }
    }

    /// What the policy chooses for `kind` (`None`: it failed, and says why).
    fn ask_policy(&mut self, kind: &CommandKind) -> Option<Strategy> {
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
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "distribution policy failed; using the fallback");
                None
            }
        }
    }
}

/// The encoded size of a command, for policies: its wire form's length,
/// computed without encoding or copying it (every write passes here).
fn encoded_size(kind: &CommandKind) -> u64 {
    lockstep_protocol::command_encoded_len(0, Strategy::Naive, kind) as u64
}
