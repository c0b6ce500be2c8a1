//! Readable traces of the compute model: state summaries and action
//! descriptions for counterexamples.

use lockstep_reconcile::{DataflowKey, MeshAnnouncement};

use super::state::{ComputeAction, ComputeState, Msg, LABELS};
use super::{ComputeModel, HistoryCheck};

impl ComputeModel {
    /// A one-line summary of a state: controller, then each worker.
    pub fn summary(&self, s: &ComputeState) -> String {
        let mut out = format!(
            "controller {} epoch {} session {} catalog [{}]",
            if s.ctl.up { "up" } else { "DOWN" },
            s.ctl.epoch,
            s.ctl.session,
            s.ctl
                .catalog
                .iter()
                .map(|k| self.label(k))
                .collect::<Vec<_>>()
                .join(",")
        );
        for (i, w) in s.workers.iter().enumerate() {
            let log: Vec<String> = w
                .log
                .iter()
                .map(|(idx, id, hash)| {
                    let key = DataflowKey {
                        id: *id,
                        hash: *hash,
                    };
                    format!("{}@{idx}", self.label(&key))
                })
                .collect();
            let inst: Vec<String> = w
                .installed
                .iter()
                .map(|(idx, k)| format!("{}@{idx}", self.label(k)))
                .collect();
            out.push_str(&format!(
                " | p{i}: built [{}] runs [{}]{}{}",
                log.join(","),
                inst.join(","),
                if w.machine.pending().is_some() {
                    " (at barrier)"
                } else if w.machine.holding() {
                    " (holds a session for its log marker)"
                } else {
                    ""
                },
                if w.halted { " HALTED" } else { "" }
            ));
        }
        out
    }

    /// A readable description of a step taken from `s`.
    pub fn describe(&self, s: &ComputeState, a: &ComputeAction) -> String {
        let show = |m: &Msg| match m {
            // Sessions of two strategies: say which.
            Msg::Hello { session } if self.then.is_some() => format!(
                "Hello(session {session}, {})",
                self.session_strategy(*session).name()
            ),
            Msg::Hello { session } => format!("Hello(session {session})"),
            Msg::Target {
                keys,
                session,
                complete,
                ..
            } => format!(
                "Target[{}]+InitializationComplete{}",
                keys.iter()
                    .map(|k| self.label(k))
                    .collect::<Vec<_>>()
                    .join(","),
                // The naive→barrier upgrade: say so.
                if *complete != self.session_strategy(*session) {
                    format!(" with {}", complete.name())
                } else {
                    String::new()
                }
            ),
            Msg::Create { key, .. } => format!("CreateDataflow {}", self.label(key)),
            Msg::Drop { id, .. } => format!("Drop {}", self.id_label(*id)),
        };
        match a {
            ComputeAction::Create(i) => format!("controller: create {}", LABELS[*i]),
            ComputeAction::Drop(i) => format!("controller: drop {}", LABELS[*i]),
            ComputeAction::Crash => "controller CRASHES (in-flight messages lost)".into(),
            ComputeAction::Restart if self.history != HistoryCheck::Off => {
                "controller restarts, sends Hello and awaits the history reports".into()
            }
            ComputeAction::Restart => "controller restarts, sends Hello and its target".into(),
            ComputeAction::DropConnection(p) => {
                format!("connection to p{p} DROPS; controller reconnects every process")
            }
            ComputeAction::ProcessCrash(p) => {
                format!("process p{p} DIES; the mesh fails and every worker stops")
            }
            ComputeAction::CheckHistories => {
                let reported: Vec<String> = s
                    .reports
                    .iter()
                    .flatten()
                    .map(|(_, d)| d.to_string())
                    .collect();
                format!(
                    "controller checks the reported history digests [{}]",
                    reported.join(", ")
                )
            }
            ComputeAction::RestartReplica => {
                "controller restarts the replica (fresh processes), sends Hello and its target"
                    .into()
            }
            ComputeAction::Receive(p) => match s.channels[*p].front() {
                Some(m) => format!("p{p} receives {}", show(m)),
                None => format!("p{p} receives nothing"),
            },
            ComputeAction::Decide(p, read) => {
                let records: Vec<String> = s.inboxes[*p]
                    .iter()
                    .take(*read)
                    .map(|(from, m)| match m {
                        MeshAnnouncement::Joined { session } => {
                            format!("p{from} joined session {session}")
                        }
                        MeshAnnouncement::Round {
                            announcement,
                            report: Some(r),
                            ..
                        } => format!(
                            "p{from} reconciles at round {} with [{}]",
                            announcement.seqno,
                            r.installed
                                .iter()
                                .map(|k| self.label(k))
                                .collect::<Vec<_>>()
                                .join(",")
                        ),
                        MeshAnnouncement::Round { announcement, .. } => {
                            format!("p{from} reached create round {}", announcement.seqno)
                        }
                    })
                    .collect();
                format!(
                    "p{p} reads [{}] from the mesh, then its barrier decides {:?}",
                    records.join("; "),
                    self.decision(s, *p, *read)
                )
            }
            ComputeAction::Apply(p) => match s.sequenced.get(s.workers[*p].cursor) {
                Some(m) => format!("p{p} applies {} from the sequencer's stream", show(m)),
                None => format!("p{p} applies nothing"),
            },
            ComputeAction::ReadLog(p) => match s.stream.get(s.workers[*p].log_position()) {
                Some(m) => format!("p{p} reads {} from the log", show(m)),
                None => format!("p{p} reads nothing"),
            },
        }
    }
}
