//! The checks after the last fault: I2 (the replica reaches the target
//! within the recovery bound), I3 (every write's fate, every answer against
//! the reference) and live processes for exactly the catalog's replicas.

use super::*;
use env::*;
use model::{identity_collection, Fate, Rng, INPUTS};

impl Run {
    /// After the last fault: the replica reaches the target within
    /// [`RECOVERY`] (I2), every write's fate and every answer check out
    /// (I3), exactly the catalog's replica has live processes.
    pub(super) async fn check(&mut self, steps: usize) -> Result<String, Failure> {
        if self.crashed_for.is_some() {
            self.world.log(format!(
                "{steps} kill -9 environment (its controller crashed), start it again"
            ));
            self.restart_env(None).await?;
        }
        let started = Instant::now();
        let deadline = started + RECOVERY;
        let i = steps;
        // A fresh write to every input, acknowledged (each failed attempt
        // is a write of unknown fate; the next one uses the next time), all
        // at one time: under a compaction lag a dataflow reading several
        // inputs is readable only where every input's since is below every
        // input's upper, so the inputs' uppers are brought together (a
        // write's upper may jump).
        let mut round = 0;
        loop {
            let top = INPUTS
                .iter()
                .map(|k| self.world.next_time.get(k).copied().unwrap_or(0))
                .max()
                .unwrap_or(0);
            let uppers: BTreeSet<u64> = INPUTS
                .iter()
                .map(|k| self.world.acked_upper.get(k).copied().unwrap_or(0))
                .collect();
            if round > 0 && uppers.len() == 1 {
                break;
            }
            for (n, k) in INPUTS.into_iter().enumerate() {
                if round > 0 && self.world.acked_upper.get(&k) == Some(&top) {
                    continue;
                }
                self.world.next_time.insert(k, top);
                let mut r = Rng::for_op(self.seed, steps + n + 3 * round);
                loop {
                    let w = self.world.new_write(i, k, &mut r);
                    let res = self.client.write_input(write_request(&w)).await;
                    let ok = res.is_ok();
                    self.finish_write(i, w, res);
                    if ok {
                        break;
                    }
                    if Instant::now() > deadline {
                        return Err(violation(
                            "I2",
                            format!(
                                "no write to input {k} was acknowledged within {RECOVERY:?} after the last fault"
                            ),
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
            round += 1;
        }
        // Every live dataflow answers at the newest time.
        for k in self.world.live_dataflows(true) {
            loop {
                if self.peek(i, k, "final peek").await? {
                    break;
                }
                if Instant::now() > deadline {
                    let d = &self.world.dataflows[k];
                    return Err(violation(
                        "I2",
                        format!(
                            "dataflow {} ({}) did not answer a peek at the newest time within {RECOVERY:?} after the last fault",
                            d.collection, d.text
                        ),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        let recovered = started.elapsed();
        self.world
            .log(format!("recovered in {:.1} s", recovered.as_secs_f64()));
        self.resolve_writes()?;
        // Every answer equals the reference at its time.
        for a in &self.world.answers {
            let want = self.world.reference(&a.plan, a.time);
            if a.rows != want {
                let text = self
                    .world
                    .dataflows
                    .iter()
                    .find(|d| d.collection == a.collection)
                    .map(|d| d.text.clone())
                    .unwrap_or_default();
                return Err(violation(
                    "I3",
                    format!(
                        "op {}: {} of {} ({text}) at {}: {}",
                        a.op,
                        a.how,
                        a.collection,
                        a.time,
                        model::diff(&a.rows, &want)
                    ),
                ));
            }
        }
        // Every following subscription's stream against the reference.
        self.check_follows().await?;
        // Exactly the catalog's replica has processes, all alive.
        let listed = self
            .client
            .list_replicas(proto::ListReplicasRequest::default())
            .await
            .map_err(|e| format!("listing replicas: {}", code(&e)))?
            .into_inner()
            .replicas;
        let names: Vec<&str> = listed.iter().map(|r| r.name.as_str()).collect();
        if names != [REPLICA] {
            return Err(violation(
                "O1",
                format!("the catalog lists replicas {names:?}, not [{REPLICA:?}]"),
            ));
        }
        let rep = &listed[0];
        let pids: Vec<u32> = rep.process_status.iter().map(|p| p.pid).collect();
        let restarts: u32 = rep.process_status.iter().map(|p| p.restarts).sum();
        if pids.len() != self.processes as usize || pids.iter().any(|p| !alive(*p)) {
            return Err(violation(
                "I2",
                format!(
                    "the replica of {} processes has processes {pids:?}, not all alive",
                    self.processes
                ),
            ));
        }
        let services = self
            .sandbox
            .services()
            .await
            .map_err(|e| format!("listing services: {e:#}"))?;
        let service_pids: BTreeSet<u32> = services
            .iter()
            .flat_map(|s| s.processes.iter().filter_map(|p| p.pid))
            .filter(|p| alive(*p))
            .collect();
        if services.len() != 1 || service_pids != pids.iter().copied().collect() {
            return Err(violation(
                "O2",
                format!(
                    "{} services with live processes {service_pids:?}; the catalog's replica has {pids:?}",
                    services.len()
                ),
            ));
        }
        // I1 through the recovery, then through the environment's own
        // history check on a last connection.
        self.workers_agreed(steps)?;
        let log_path = self.sandbox.path().join("campaign-env.stderr");
        let offset = std::fs::metadata(&log_path).map(|m| m.len()).unwrap_or(0);
        self.world.log(format!(
            "{i} kill -9 environment for the I1 probe, start it again"
        ));
        self.restart_env(None).await?;
        let probe_deadline = Instant::now() + RECOVERY;
        let k = self
            .world
            .dataflows
            .iter()
            .position(|d| d.identity)
            .ok_or_else(|| "no identity dataflow".to_string())?;
        while !self.peek(i, k, "probe peek").await? {
            if Instant::now() > probe_deadline {
                return Err(violation(
                    "I2",
                    format!("after a last restart of the environment (no fault) the replica did not answer within {RECOVERY:?}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        if let Some(a) = self.world.answers.last() {
            let want = self.world.reference(&a.plan, a.time);
            if a.rows != want {
                return Err(violation(
                    "I3",
                    format!(
                        "after a last restart of the environment, {} at {}: {}",
                        a.collection,
                        a.time,
                        model::diff(&a.rows, &want)
                    ),
                ));
            }
        }
        let text = std::fs::read(&log_path).unwrap_or_default();
        let last = String::from_utf8_lossy(&text[(offset as usize).min(text.len())..]).into_owned();
        self.workers_agreed(steps)?;
        let unchecked = last.contains("without the history check");
        let lost = String::from_utf8_lossy(&text)
            .matches("lost lockstep")
            .count();
        Ok(format!(
            "recovered in {:.1} s, {restarts} process restarts, {} partial drops repaired, {lost} lost-lockstep reports{}",
            recovered.as_secs_f64(),
            self.partial_drops,
            if unchecked { ", I1 probe: NOT CHECKED (a worker did not answer Hello in time)" } else { ", I1 probe ok" }
        ))
    }

    /// Reads every write's fate off the final identity peeks: each
    /// acknowledged write visible exactly once, each unknown one wholly or
    /// not at all.
    pub(super) fn resolve_writes(&mut self) -> Result<(), Failure> {
        for k in INPUTS {
            let c = identity_collection(k);
            let Some(final_answer) = self
                .world
                .answers
                .iter()
                .rev()
                .find(|a| a.collection == c && a.how == "final peek")
                .cloned()
            else {
                return Err(Failure::Harness(format!(
                    "no final peek of the identity of {k}"
                )));
            };
            let t = final_answer.time;
            let mut lines = Vec::new();
            for w in self
                .world
                .writes
                .iter_mut()
                .filter(|w| w.input == k && w.fate == Fate::Unknown)
            {
                if w.time > t {
                    // Past the final read: it cannot matter.
                    w.fate = Fate::Resolved(false);
                    continue;
                }
                let first = &w.updates[0].row;
                let seen = final_answer.rows.get(first).copied().unwrap_or(0);
                w.fate = Fate::Resolved(seen > 0);
                lines.push(format!(
                    "  resolved: write of op {} to {k} at {} is {}",
                    w.op,
                    w.time,
                    if seen > 0 { "visible" } else { "absent" }
                ));
            }
            self.world.history.extend(lines);
            let want = self.world.reference(&final_answer.plan, t);
            if final_answer.rows != want {
                return Err(violation(
                    "I3",
                    format!(
                        "input {k} at {t} is not exactly the acknowledged writes (each once) and the unknown ones wholly or not at all: {}",
                        model::diff(&final_answer.rows, &want)
                    ),
                ));
            }
        }
        Ok(())
    }
}
