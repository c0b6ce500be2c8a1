//! The `+reconfigure` variants' operation ([`Op::Reconfigure`]): a resize
//! to a drawn shape (two times in three) or an upgrade that keeps
//! answering, with a fault part-way through one time in three each: the
//! environment SIGKILLed after a drawn delay (then started again), or one
//! replica process SIGKILLed. The call may succeed or fail (a killed
//! process can fail a catch-up, which rolls a resize back); what must hold
//! is what every seed checks (the answers, the processes, the services).
//! The replica's shape afterwards is read back: its processes are checked
//! against it.

use super::*;
use env::*;
use model::Rng;

/// The bound on a reconfiguration's answer when the environment is not
/// killed: its catch-ups and drains run out well before (I2: no silent
/// hang).
const ANSWER_BOUND: Duration = Duration::from_secs(150);

impl Run {
    /// Runs [`Op::Reconfigure`] (see the module docs).
    pub(super) async fn reconfigure(&mut self, i: usize, r: &mut Rng) -> Result<(), Failure> {
        let resize = r.below(3) != 0;
        let (p, w) = (r.range(1, 4) as u32, r.range(1, 2) as u32);
        let fault = r.below(3);
        let delay = Duration::from_millis(r.range(0, 1500));
        let what = if resize {
            format!("resize to {p}x{w}")
        } else {
            "upgrade --keep-answering".to_string()
        };
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
                let res = match tokio::time::timeout(ANSWER_BOUND, task).await {
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

/// A call's outcome in the history.
fn outcome(res: &Result<(), tonic::Status>) -> String {
    match res {
        Ok(()) => "done".to_string(),
        Err(s) => format!("{:?}: {}", s.code(), s.message()),
    }
}
