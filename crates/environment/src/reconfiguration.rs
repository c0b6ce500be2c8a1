//! The durable record of a reconfiguration (an upgrade that keeps
//! answering, a resize: `upgrade.rs`): written to the catalog before its
//! standby starts, rewritten at each phase, removed when it ends. An
//! environment killed part-way leaves it; the next start settles it
//! ([`Environment::settle_reconfigurations`]): the standby is gone by then
//! (`drop_leftover_standbys`), the replica runs at the shape its catalog
//! names, and the record says which that was: a resize whose new shape
//! reached the catalog completed, any other interrupted reconfiguration
//! did not (call it again). What was settled is logged and shown by
//! `GetStatus` (`reconfigurations_settled`, `lockstep status`). An
//! interrupted reconfiguration is not resumed.
//!
//! The record is JSON in the catalog's settings (`reconfiguration/ID`):
//! `{"kind", "from": [P, W], "to": [P, W], "phase", "started_unix_ms",
//! "deadline_unix_ms"}`; the deadline is when its catch-ups run out
//! (twice `CATCH_UP_BOUND` and the drains after its start).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::*;
use crate::compute::{ComputeError, Reconfiguration};

/// Milliseconds since the Unix epoch.
fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How long after its start a reconfiguration's catch-ups and drains run
/// out.
fn deadline_after() -> Duration {
    2 * crate::CATCH_UP_BOUND + Duration::from_secs(40)
}

impl Environment {
    /// Writes replica `replica`'s record of `rc` (its phase now); the
    /// first write of a reconfiguration, before anything starts.
    pub(crate) fn record_reconfiguration(
        &self,
        replica: &Replica,
        rc: &Reconfiguration,
    ) -> Result<(), ComputeError> {
        let started = SystemTime::now() - rc.started.elapsed();
        let record = serde_json::json!({
            "kind": rc.kind,
            "from": [replica.config.processes, replica.config.workers_per_process],
            "to": [rc.target.0, rc.target.1],
            "phase": rc.phase.name(),
            "started_unix_ms": unix_ms(started),
            "deadline_unix_ms": unix_ms(started + deadline_after()),
        });
        let mut catalog = self.catalog.lock().expect("poisoned");
        catalog
            .record_reconfiguration(replica.id, Some(&record.to_string()))
            .map_err(|e| ComputeError::Env(self.catalog_error(e)))
    }

    /// Removes replica `replica_id`'s record (its reconfiguration ended);
    /// a failure is logged: the next start settles what is left.
    pub(crate) fn clear_reconfiguration(&self, replica_id: u64) {
        let mut catalog = self.catalog.lock().expect("poisoned");
        if let Err(e) = catalog.record_reconfiguration(replica_id, None) {
            tracing::warn!(
                replica = replica_id,
                "the reconfiguration record was left: {e}"
            );
        }
    }

    /// Settles every reconfiguration record an earlier environment left
    /// (see the module docs): called at start, after the leftover standbys
    /// are dropped. Returns what it settled, one line each.
    pub fn settle_reconfigurations(&self) -> anyhow::Result<Vec<String>> {
        let records = self
            .catalog
            .lock()
            .expect("poisoned")
            .reconfigurations()
            .map_err(|e| anyhow::anyhow!("reading the reconfiguration records: {e}"))?;
        let mut settled = Vec::new();
        for (id, text) in records {
            let line = self.settled_line(id, &text);
            tracing::warn!(replica = id, "{line}");
            self.catalog
                .lock()
                .expect("poisoned")
                .record_reconfiguration(id, None)
                .map_err(|e| self.catalog_error(e))?;
            settled.push(line);
        }
        self.reconfigurations_settled
            .lock()
            .expect("poisoned")
            .extend(settled.iter().cloned());
        Ok(settled)
    }

    /// What replica `id`'s record `text` settles to, in a line.
    fn settled_line(&self, id: u64, text: &str) -> String {
        let replica = self
            .view
            .lock()
            .expect("poisoned")
            .replicas
            .get(&id)
            .cloned();
        let Some(replica) = replica else {
            return format!("a reconfiguration of replica {id}, which was dropped since, was interrupted: nothing to settle");
        };
        let record: serde_json::Value = serde_json::from_str(text).unwrap_or_default();
        let shape = |k: &str| -> Option<(u32, u32)> {
            let v = record.get(k)?.as_array()?;
            Some((v.first()?.as_u64()? as u32, v.get(1)?.as_u64()? as u32))
        };
        let kind = record.get("kind").and_then(|k| k.as_str()).unwrap_or("?");
        let phase = record.get("phase").and_then(|k| k.as_str()).unwrap_or("?");
        let now = (replica.config.processes, replica.config.workers_per_process);
        let outcome = match (kind, shape("from"), shape("to")) {
            ("resize", _, Some(to)) if to == now => {
                "completed: the catalog names the new shape".to_string()
            }
            ("resize", _, Some((p, w))) => {
                format!(
                    "rolled back: the catalog still names {}x{}, not {p}x{w}",
                    now.0, now.1
                )
            }
            ("upgrade", ..) => {
                "not completed: its processes may not have been restarted; upgrade it again"
                    .to_string()
            }
            _ => format!("unreadable record {text:?}: the replica is as its catalog names it"),
        };
        format!(
            "the {kind} of replica {:?} was interrupted in phase {phase} by the environment's end; {outcome} ({}x{})",
            replica.name, now.0, now.1
        )
    }

    /// What [`settle_reconfigurations`](Self::settle_reconfigurations)
    /// settled at this environment's start.
    pub fn reconfigurations_settled(&self) -> Vec<String> {
        self.reconfigurations_settled
            .lock()
            .expect("poisoned")
            .clone()
    }
}
