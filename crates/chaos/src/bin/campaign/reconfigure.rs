//! The `+reconfigure` variants' operation ([`Op::Reconfigure`]): a resize
//! to a drawn shape (two times in three) or an upgrade that keeps
//! answering, with a fault part-way through one time in three each: the
//! environment SIGKILLed after a drawn delay (then started again), or one
//! replica process SIGKILLed. The call may succeed or fail (a killed
//! process can fail a catch-up, which rolls a resize back); what must hold
//! is what every seed checks (the answers, the processes, the services).
//! The replica's shape afterwards is read back: its processes are checked
//! against it.
//!
//! Unless the environment is killed, a reader peeks the live dataflows
//! throughout (one every [`READ_EVERY`]); every answer is checked against
//! the reference (I3). A reconfiguration with no fault must refuse no read
//! and hold none up for longer than [`READ_HOLD_BOUND`] (I6). The
//! `+reconfigure` variants start each standby's processes
//! [`STANDBY_DELAY`] late (the environment's failpoint `standby_failpoints`
//! gives them the replica's `replica_start=sleep(MS)`), so a standby that
//! answered reads before its lag closed would hold them up for seconds:
//! the negative control `+early-switch` (failpoint `reads_switch_early`)
//! does, and reconfigures with no fault so that every one is checked.

use super::*;
use env::*;
use model::Rng;

/// The bound on a reconfiguration's answer when the environment is not
/// killed: its catch-ups and drains run out well before (I2: no silent
/// hang).
const ANSWER_BOUND: Duration = Duration::from_secs(150);

/// How often the reader peeks during a reconfiguration.
const READ_EVERY: Duration = Duration::from_millis(20);

/// The longest a peek may wait during a reconfiguration with no fault
/// (I6). A peek of a caught-up generation takes tens of milliseconds here
/// (docs/environment.md); one sent to a standby whose processes have not
/// started waits at least [`STANDBY_DELAY`], twice this.
const READ_HOLD_BOUND: Duration = Duration::from_millis(STANDBY_DELAY.as_millis() as u64 / 2);

/// How late each standby's processes start in the `+reconfigure` variants.
pub(super) const STANDBY_DELAY: Duration = Duration::from_millis(3000);

/// A peek the reader sent during a reconfiguration: the dataflow (its index
/// in the world), the time, how long the answer took and the answer.
type Read = (
    usize,
    u64,
    Duration,
    Result<lockstep_plan::reference::Multiset, tonic::Status>,
);

impl Run {
    /// Runs [`Op::Reconfigure`] (see the module docs).
    pub(super) async fn reconfigure(&mut self, i: usize, r: &mut Rng) -> Result<(), Failure> {
        let resize = r.below(3) != 0;
        let (p, w) = (r.range(1, 4) as u32, r.range(1, 2) as u32);
        // The negative control is checked on every reconfiguration.
        let fault = if self.reads_switch_early {
            2
        } else {
            r.below(3)
        };
        let delay = Duration::from_millis(r.range(0, 1500));
        let what = if resize {
            format!("resize to {p}x{w}")
        } else {
            "upgrade --keep-answering".to_string()
        };
        // Reads are held to I6 only in a reconfiguration with no fault, of a
        // replica that answers reads before it starts (not one still
        // rebuilding after the last operation's fault, nor one whose
        // environment runs with its controller crashed), and only the reads
        // it answered then (not one a compaction has passed).
        let mut targets = self.read_targets();
        let mut checked = false;
        if fault == 2 {
            match self.answered(&targets).await {
                Some(answered) if self.crashed_for.is_none() && !answered.is_empty() => {
                    (targets, checked) = (answered, true);
                }
                _ => self.world.log(format!(
                    "{i} {what}: the replica does not answer reads before it: its reads are not held to I6"
                )),
            }
        }
        let mut client = self.client.clone();
        let task = tokio::spawn(async move {
            if resize {
                let req = proto::ResizeReplicaRequest {
                    name: REPLICA.into(),
                    processes: p,
                    workers_per_process: w,
                };
                client.resize_replica(req).await.map(drop)
            } else {
                let req = proto::RestartReplicaRequest {
                    name: REPLICA.into(),
                    keep_answering: true,
                };
                client.restart_replica(req).await.map(drop)
            }
        });
        let res = match fault {
            0 => {
                let crashed = self.crashed_for.is_some();
                let res = self.await_or_kill(task, delay).await;
                self.world.log(format!(
                    "{i} {what}, kill -9 environment {} ms in, start it again: {}",
                    delay.as_millis(),
                    outcome(&res)
                ));
                if !crashed {
                    self.restart_env(None).await?;
                }
                res
            }
            _ => {
                if fault == 1 {
                    tokio::time::sleep(delay).await;
                    let pids = self.pids().await.unwrap_or_default();
                    if !pids.is_empty() {
                        let pid = pids[r.below(pids.len() as u64) as usize];
                        let _ = signal(pid, libc::SIGKILL);
                        self.world.log(format!(
                            "{i} {what}: kill -9 replica process {pid} {} ms in",
                            delay.as_millis()
                        ));
                    }
                }
                let (answered, reads) = self
                    .reading(&targets, tokio::time::timeout(ANSWER_BOUND, task))
                    .await;
                let res = match answered {
                    Ok(Ok(res)) => res,
                    Ok(Err(e)) => return Err(Failure::Harness(format!("{what}: task: {e}"))),
                    Err(_) => {
                        return Err(violation(
                            "I2",
                            format!("{what} not answered within {ANSWER_BOUND:?}"),
                        ))
                    }
                };
                self.world.log(format!("{i} {what}: {}", outcome(&res)));
                self.check_reads(i, &what, reads, checked)?;
                res
            }
        };
        drop(res);
        // The shape the catalog names now, which the processes must have.
        let listed = self
            .client
            .list_replicas(proto::ListReplicasRequest::default())
            .await
            .map_err(|e| Failure::Harness(format!("list replicas after {what}: {}", code(&e))))?
            .into_inner();
        if let Some(replica) = listed.replicas.iter().find(|r| r.name == REPLICA) {
            if replica.processes != self.processes {
                self.world.log(format!(
                    "{i}  the replica has {} processes of {} workers now",
                    replica.processes, replica.workers_per_process
                ));
            }
            self.processes = replica.processes;
        }
        Ok(())
    }
}

impl Run {
    /// What the reader peeks: each live dataflow (its index in the world
    /// and collection) at its newest readable time.
    fn read_targets(&self) -> Vec<(usize, u64, u64)> {
        self.world
            .live_dataflows(true)
            .into_iter()
            .filter_map(|k| {
                let d = &self.world.dataflows[k];
                Some((k, d.collection, self.world.read_time(&d.inputs)?))
            })
            .collect()
    }

    /// The targets the replica answers now, each within [`CALL`]; `None` if
    /// it does not answer reads now (one not answered in time, or refused
    /// as unavailable). A target refused otherwise (compacted past its
    /// time, say) is left out.
    async fn answered(&self, targets: &[(usize, u64, u64)]) -> Option<Vec<(usize, u64, u64)>> {
        let mut client = self.client.clone();
        let mut answered = Vec::new();
        for &target in targets {
            let (_, collection, t) = target;
            match tokio::time::timeout(CALL, client.peek(ops::peek_request(collection, t))).await {
                Ok(Ok(_)) => answered.push(target),
                Ok(Err(s)) if s.code() != tonic::Code::Unavailable => {}
                _ => return None,
            }
        }
        Some(answered)
    }

    /// Awaits `call` while peeking `targets` every [`READ_EVERY`]: its
    /// output and every read sent meanwhile (the last one finished after
    /// the call ends, so that no read goes unjudged; each bounded by
    /// [`CALL`], past which it counts as refused).
    async fn reading<T>(
        &self,
        targets: &[(usize, u64, u64)],
        call: impl std::future::Future<Output = T>,
    ) -> (T, Vec<Read>) {
        let mut reads = Vec::new();
        let done = std::cell::Cell::new(false);
        let call = async {
            let out = call.await;
            done.set(true);
            out
        };
        let mut client = self.client.clone();
        let reader = async {
            for &(k, collection, t) in targets.iter().cycle() {
                if done.get() {
                    break;
                }
                let sent = Instant::now();
                let peek = client.peek(ops::peek_request(collection, t));
                let res = match tokio::time::timeout(CALL, peek).await {
                    Ok(res) => res.map(|rows| {
                        model::multiset(
                            rows.into_inner()
                                .rows
                                .into_iter()
                                .map(|r| (r.values, r.diff)),
                        )
                    }),
                    Err(_) => Err(tonic::Status::deadline_exceeded(format!(
                        "no answer within {CALL:?}"
                    ))),
                };
                reads.push((k, t, sent.elapsed(), res));
                tokio::time::sleep(READ_EVERY).await;
            }
        };
        let (out, ()) = tokio::join!(call, reader);
        (out, reads)
    }

    /// Checks the reads sent during reconfiguration `i` (`what`): every
    /// answer against the reference (I3, at the seed's end); with no fault
    /// (`unfaulted`), none refused and none held up longer than
    /// [`READ_HOLD_BOUND`] (I6).
    fn check_reads(
        &mut self,
        i: usize,
        what: &str,
        reads: Vec<Read>,
        unfaulted: bool,
    ) -> Result<(), Failure> {
        let (mut answered, mut refused, mut longest) = (0, 0, Duration::ZERO);
        let mut broken = None;
        for (k, t, took, res) in reads {
            let d = &self.world.dataflows[k];
            longest = longest.max(took);
            match res {
                Ok(rows) => {
                    answered += 1;
                    self.world.answers.push(model::Answer {
                        op: i,
                        how: "peek during a reconfiguration",
                        collection: d.collection,
                        plan: d.plan.clone(),
                        time: t,
                        rows,
                    });
                    if unfaulted && took > READ_HOLD_BOUND && broken.is_none() {
                        broken = Some(format!(
                            "op {i}: {what} with no fault held a peek of {} at {t} up for {} ms",
                            d.collection,
                            took.as_millis()
                        ));
                    }
                }
                Err(s) => {
                    refused += 1;
                    if unfaulted && broken.is_none() {
                        broken = Some(format!(
                            "op {i}: {what} with no fault refused a peek of {} at {t}: {}",
                            d.collection,
                            code(&s)
                        ));
                    }
                }
            }
        }
        self.world.log(format!(
            "{i}  reads during it: {answered} answered, {refused} refused, the longest {} ms",
            longest.as_millis()
        ));
        match broken {
            Some(what) => Err(violation("I6", what)),
            None => Ok(()),
        }
    }
}

/// A call's outcome in the history.
fn outcome(res: &Result<(), tonic::Status>) -> String {
    match res {
        Ok(()) => "done".to_string(),
        Err(s) => format!("{:?}: {}", s.code(), s.message()),
    }
}
