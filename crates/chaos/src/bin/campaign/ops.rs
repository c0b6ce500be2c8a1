//! The operations and faults: one arm of [`Run::step`] per [`Op`], and the
//! requests in flight, peeks and subscribes they use.

use super::*;
use env::*;
use model::{multiset, Fate, Op, Rng, INPUTS};

impl Run {
    /// Runs operation `i`.
    pub(super) async fn step(&mut self, i: usize, op: Op) -> Result<(), Failure> {
        match self.crashed_for {
            Some(0) => {
                self.world.log(format!(
                    "{i} kill -9 environment (its controller crashed), start it again"
                ));
                self.restart_env(None).await?;
            }
            Some(n) => self.crashed_for = Some(n - 1),
            None => {}
        }
        let mut r = Rng::for_op(self.seed, i);
        if op.is_fault() {
            self.faults += 1;
        }
        match op {
            Op::Create => {
                let d = self.new_dataflow(i, &mut r)?;
                let res = self.client.create_dataflow(create_request(&d)).await;
                self.finish_create(i, d, res);
            }
            Op::Drop => {
                let live = self.world.live_dataflows(false);
                if live.is_empty() {
                    self.world.log(format!("{i} drop: nothing to drop"));
                    return Ok(());
                }
                let k = live[r.below(live.len() as u64) as usize];
                let res = self.drop_request(k).await;
                self.finish_drop(i, k, res);
            }
            Op::Write => {
                let input = INPUTS[r.below(3) as usize];
                let w = self.world.new_write(i, input, &mut r);
                let res = self.client.write_input(write_request(&w)).await;
                self.finish_write(i, w, res);
            }
            Op::Peek => {
                let live = self.world.live_dataflows(true);
                if live.is_empty() {
                    return Ok(());
                }
                let k = live[r.below(live.len() as u64) as usize];
                self.peek(i, k, "peek").await?;
            }
            Op::Subscribe => {
                let live = self.world.live_dataflows(true);
                if live.is_empty() {
                    return Ok(());
                }
                let k = live[r.below(live.len() as u64) as usize];
                self.subscribe(i, k).await?;
            }
            Op::ResumeSubscribe => {
                let live = self.world.live_dataflows(true);
                if live.is_empty() {
                    return Ok(());
                }
                let k = live[r.below(live.len() as u64) as usize];
                self.resume_subscribe(i, k, &mut r).await?;
            }
            Op::KillEnv => {
                self.world.log(format!("{i} kill -9 environment (idle)"));
                self.restart_env(None).await?;
            }
            Op::KillEnvInFlight => {
                let delay = Duration::from_millis(r.below(40));
                self.in_flight(i, &mut r, delay, None).await?;
            }
            Op::PartialBroadcast => {
                if self.processes < 2 {
                    self.world.log(format!(
                        "{i} partial broadcast: one process, so kill -9 with a request in flight"
                    ));
                    let delay = Duration::from_millis(r.below(40));
                    return self.in_flight(i, &mut r, delay, None).await;
                }
                let reach = if r.below(2) == 0 {
                    format!("{}", r.range(1, self.processes as u64 - 1))
                } else {
                    format!("last{}", r.range(1, self.processes as u64 - 1))
                };
                self.in_flight(i, &mut r, Duration::from_secs(3), Some(reach))
                    .await?;
            }
            Op::KillProcess | Op::StopCont => {
                let pids = self.pids().await.unwrap_or_default();
                if pids.is_empty() {
                    self.world
                        .log(format!("{i} {op:?}: no process listed (environment down?)"));
                    return Ok(());
                }
                let p = r.below(pids.len() as u64) as usize;
                let pid = pids[p];
                if op == Op::KillProcess {
                    let res = signal(pid, libc::SIGKILL);
                    self.world
                        .log(format!("{i} kill -9 process {p} (pid {pid}): {res:?}"));
                } else {
                    let ms = r.range(300, 4000);
                    let res = signal(pid, libc::SIGSTOP);
                    self.world.log(format!(
                        "{i} SIGSTOP process {p} (pid {pid}) for {ms} ms: {res:?}"
                    ));
                    // A write while it is stopped.
                    let input = INPUTS[r.below(3) as usize];
                    let w = self.world.new_write(i, input, &mut r);
                    let res = tokio::time::timeout(
                        Duration::from_millis(ms),
                        self.client.write_input(write_request(&w)),
                    )
                    .await;
                    match res {
                        Ok(res) => {
                            self.finish_write(i, w, res);
                            tokio::time::sleep(Duration::from_millis(ms / 2)).await;
                        }
                        Err(_) => {
                            self.world.log(format!(
                                "{i}  write to {input} at {} not answered while stopped: unknown",
                                w.time
                            ));
                            self.world.record_write(w, Fate::Unknown);
                        }
                    }
                    let _ = signal(pid, libc::SIGCONT);
                }
            }
            Op::RestartReplica => {
                let pids = self.pids().await.unwrap_or_default();
                for pid in &pids {
                    let _ = signal(*pid, libc::SIGKILL);
                }
                self.world
                    .log(format!("{i} restart the replica: kill -9 all of {pids:?}"));
            }
            Op::RestartStore => self.restart_store(i, &mut r).await?,
            Op::CutLink => self.cut_link(i, &mut r).await?,
            Op::Reconfigure => self.reconfigure(i, &mut r).await?,
            Op::SwapPolicy => {
                let to = if self.strategy == "naive" {
                    "naive".to_string()
                } else {
                    STRATEGIES[r.below(3) as usize].to_string()
                };
                let res = self.set_policy(&to).await;
                self.world
                    .log(format!("{i} swap the distribution policy to {to}: {res:?}"));
            }
        }
        Ok(())
    }

    pub(super) fn new_dataflow(
        &mut self,
        i: usize,
        r: &mut Rng,
    ) -> Result<model::DataflowRec, Failure> {
        let text = model::random_plan(r);
        let plan = model::parse(&text)?;
        let collection = self.world.next_collection;
        self.world.next_collection += 1;
        let _ = i;
        Ok(model::DataflowRec {
            collection,
            inputs: model::plan_inputs(&plan),
            text,
            plan,
            id: None,
            live: false,
            unknown: false,
            identity: false,
        })
    }

    pub(super) fn finish_create(
        &mut self,
        i: usize,
        mut d: model::DataflowRec,
        res: Result<tonic::Response<proto::CreateDataflowResponse>, tonic::Status>,
    ) {
        let fate = fate_of(&res);
        let what = match &res {
            Ok(_) => "ok".to_string(),
            Err(s) => code(s),
        };
        match res {
            Ok(ok) => {
                d.id = ok.into_inner().dataflow.map(|d| d.id);
                d.live = true;
            }
            Err(_) if fate == Fate::Unknown => d.unknown = true,
            Err(_) => {}
        }
        self.world.log(format!(
            "{i} create {} = {}: {what} ({fate:?})",
            d.collection, d.text
        ));
        self.world.dataflows.push(d);
    }

    pub(super) async fn drop_request(
        &mut self,
        k: usize,
    ) -> Result<tonic::Response<proto::DropDataflowResponse>, tonic::Status> {
        let id = self.world.dataflows[k].id.unwrap_or(0);
        self.client
            .drop_dataflow(proto::DropDataflowRequest { id })
            .await
    }

    pub(super) fn finish_drop(
        &mut self,
        i: usize,
        k: usize,
        res: Result<tonic::Response<proto::DropDataflowResponse>, tonic::Status>,
    ) {
        let fate = fate_of(&res);
        let d = &mut self.world.dataflows[k];
        match fate {
            Fate::Acked => d.live = false,
            Fate::Unknown => d.unknown = true,
            _ => {}
        }
        let line = format!(
            "{i} drop {} (id {:?}): {} ({fate:?})",
            d.collection,
            d.id,
            res.as_ref().map(|_| "ok".to_string()).unwrap_or_else(code)
        );
        self.world.log(line);
    }

    pub(super) fn finish_write(
        &mut self,
        i: usize,
        w: model::WriteRec,
        res: Result<tonic::Response<proto::WriteInputResponse>, tonic::Status>,
    ) {
        let fate = fate_of(&res);
        self.world.log(format!(
            "{i} write {} updates to {} at {}: {} ({fate:?})",
            w.updates.len(),
            w.input,
            w.time,
            res.as_ref().map(|_| "ok".to_string()).unwrap_or_else(code)
        ));
        if fate == Fate::Absent {
            // A refusal of the campaign's own write is its own bug.
            self.world.log(format!("{i}  (refused: {res:?})"));
        }
        self.world.record_write(w, fate);
    }

    /// A request in flight when the environment dies: after `delay`
    /// (plain), or with the controller crashed part-way through the
    /// broadcast of the request's command (`reach`: the failpoint's value).
    pub(super) async fn in_flight(
        &mut self,
        i: usize,
        r: &mut Rng,
        delay: Duration,
        reach: Option<String>,
    ) -> Result<(), Failure> {
        if reach.is_none() {
            // The kill below ends a crashed controller too.
            self.crashed_for = None;
        }
        let live = self.world.live_dataflows(false);
        let what = match (r.below(4), reach.is_some()) {
            (0, _) | (1, true) => "create-dataflow",
            (2, _) if !live.is_empty() => "allow-compaction",
            _ => "write-input",
        };
        if let (Some(reach), "create-dataflow") = (&reach, what) {
            return self.partial_create(i, r, reach).await;
        }
        if let Some(reach) = &reach {
            self.world.log(format!(
                "{i} restart the environment with its controller crashing after a {what} reached processes {reach}"
            ));
            let fp = format!("controller_partial_broadcast=return({what}:{reach})");
            self.restart_env(Some(&fp)).await?;
            self.crashed_for = Some(r.range(1, 4) as usize);
        }
        let mut client = self.client.clone();
        match what {
            "create-dataflow" => {
                let d = self.new_dataflow(i, r)?;
                let req = create_request(&d);
                let task = tokio::spawn(async move { client.create_dataflow(req).await });
                let res = self.await_or_kill(task, delay).await;
                self.finish_create(i, d, res);
            }
            "allow-compaction" => {
                let k = live[r.below(live.len() as u64) as usize];
                let id = self.world.dataflows[k].id.unwrap_or(0);
                let task = tokio::spawn(async move {
                    client
                        .drop_dataflow(proto::DropDataflowRequest { id })
                        .await
                });
                let res = self.await_or_kill(task, delay).await;
                self.finish_drop(i, k, res);
            }
            _ => {
                let input = INPUTS[r.below(3) as usize];
                let w = self.world.new_write(i, input, r);
                let req = write_request(&w);
                let task = tokio::spawn(async move { client.write_input(req).await });
                let res = self.await_or_kill(task, delay).await;
                self.finish_write(i, w, res);
            }
        }
        if let Some(n) = self.crashed_for {
            self.world.log(format!(
                "{i}  the environment keeps running for {n} more operations"
            ));
            return Ok(());
        }
        self.world.log(format!(
            "{i}  kill -9 environment (a {what} in flight), start it again"
        ));
        self.restart_env(None).await
    }

    /// The hard case: the controller crashes part-way through the
    /// broadcast of a create (the failpoint fires on 15% of creates, so
    /// usually after the replay of a reconnection: creates are sent until
    /// one fails), then, with the controller down, that dataflow is dropped
    /// and another created (both in the catalog only); the environment runs
    /// a few more operations, then is killed and started again.
    pub(super) async fn partial_create(
        &mut self,
        i: usize,
        r: &mut Rng,
        reach: &str,
    ) -> Result<(), Failure> {
        self.world.log(format!(
            "{i} restart the environment with its controller crashing on 15% of creates, after processes {reach}"
        ));
        let fp = format!("controller_partial_broadcast=15%return(create-dataflow:{reach})");
        self.restart_env(Some(&fp)).await?;
        self.crashed_for = Some(r.range(0, 2) as usize);
        for _ in 0..8 {
            let d = self.new_dataflow(i, r)?;
            let res = tokio::time::timeout(
                Duration::from_secs(5),
                self.client.create_dataflow(create_request(&d)),
            )
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer")));
            let failed = res.is_err();
            self.finish_create(i, d, res);
            if failed {
                break;
            }
        }
        // Drop the last one (its fate is resolved from the catalog, which
        // answers with the controller down), and create another.
        self.resolve_dataflows().await?;
        if let Some(k) = self.world.dataflows.iter().rposition(|d| !d.identity) {
            if self.world.dataflows[k].live {
                let res = self.drop_request(k).await;
                self.finish_drop(i, k, res);
            }
        }
        let d = self.new_dataflow(i, r)?;
        let res = tokio::time::timeout(
            Duration::from_secs(5),
            self.client.create_dataflow(create_request(&d)),
        )
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer")));
        self.finish_create(i, d, res);
        Ok(())
    }

    /// Waits `delay` for the task, then kills the environment (unless its
    /// controller crashed at the failpoint: then it keeps running a few more
    /// operations); the task's answer, or an unknown fate.
    pub(super) async fn await_or_kill<T: Send + 'static>(
        &mut self,
        task: tokio::task::JoinHandle<Result<T, tonic::Status>>,
        delay: Duration,
    ) -> Result<T, tonic::Status> {
        if self.crashed_for.is_some() {
            return match tokio::time::timeout(delay, task).await {
                Ok(Ok(res)) => res,
                Ok(Err(e)) => Err(tonic::Status::unknown(format!("task: {e}"))),
                Err(_) => Err(tonic::Status::deadline_exceeded("no answer")),
            };
        }
        tokio::time::sleep(delay).await;
        self.env.kill().await;
        match tokio::time::timeout(Duration::from_secs(10), task).await {
            Ok(Ok(res)) => res,
            Ok(Err(e)) => Err(tonic::Status::unknown(format!("task: {e}"))),
            Err(_) => Err(tonic::Status::deadline_exceeded("no answer after the kill")),
        }
    }

    /// Peeks dataflow `k` at the newest readable time; records the answer.
    pub(super) async fn peek(
        &mut self,
        i: usize,
        k: usize,
        how: &'static str,
    ) -> Result<bool, Failure> {
        let d = self.world.dataflows[k].clone();
        let Some(t) = self.world.read_time(&d.inputs) else {
            return Ok(false);
        };
        let res = self.client.peek(peek_request(d.collection, t)).await;
        match res {
            Ok(rows) => {
                let rows = multiset(
                    rows.into_inner()
                        .rows
                        .into_iter()
                        .map(|r| (r.values, r.diff)),
                );
                self.world.answer(i, how, &d, t, rows);
                Ok(true)
            }
            Err(s) => {
                self.world
                    .log(format!("{i} {how} {} at {t}: {}", d.collection, code(&s)));
                if s.code() == tonic::Code::NotFound && !d.unknown {
                    return Err(violation(
                        "I3",
                        format!(
                            "op {i}: peek of live dataflow {} ({}) answered NOT_FOUND",
                            d.collection, d.text
                        ),
                    ));
                }
                Ok(false)
            }
        }
    }

    /// Subscribes to dataflow `k` as of the newest readable time and
    /// records its snapshot (the updates at or before that time).
    pub(super) async fn subscribe(&mut self, i: usize, k: usize) -> Result<(), Failure> {
        let d = self.world.dataflows[k].clone();
        let Some(t) = self.world.read_time(&d.inputs) else {
            return Ok(());
        };
        if let Some(got) = self
            .read_subscription(i, "subscribe", &d, t, false, t)
            .await
        {
            self.world.answer(i, "subscribe", &d, t, multiset(got));
        }
        Ok(())
    }

    /// Subscribes to `d` as of `as_of` (resuming after it if `resume`) and
    /// reads the stream through `through`: every update at or before it, or
    /// `None` (logged as `how`) if the subscription was refused or did not
    /// get there within 10 s.
    pub(super) async fn read_subscription(
        &mut self,
        i: usize,
        how: &str,
        d: &model::DataflowRec,
        as_of: u64,
        resume: bool,
        through: u64,
    ) -> Option<Vec<(lockstep_protocol::Row, i64)>> {
        let opened = self
            .client
            .subscribe(proto::SubscribeRequest {
                replica: REPLICA.into(),
                collection_id: d.collection,
                as_of,
                resume,
            })
            .await;
        let got = match opened {
            Ok(s) => read_through(&mut s.into_inner(), through).await,
            Err(s) => {
                self.world.log(format!(
                    "{i} {how} {} as of {as_of}: {}",
                    d.collection,
                    code(&s)
                ));
                return None;
            }
        };
        if got.is_none() {
            self.world.log(format!(
                "{i} {how} {} as of {as_of}: not through {through} within 10 s",
                d.collection
            ));
        }
        got
    }
}

/// Reads `stream` until its upper passes `t` (within 10 s): every update at
/// or before `t`, or `None` if the stream ended or stalled first.
async fn read_through(
    stream: &mut tonic::Streaming<wire::SubscribeResponse>,
    t: u64,
) -> Option<Vec<(lockstep_protocol::Row, i64)>> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.next()).await {
            Ok(Some(Ok(batch))) => {
                got.extend(
                    batch
                        .updates
                        .into_iter()
                        .filter(|u| u.time <= t)
                        .map(|u| (u.row, u.diff)),
                );
                if batch.upper.iter().all(|u| *u > t) {
                    return Some(got);
                }
            }
            _ => return None,
        }
    }
}

/// A peek of the replica's `collection` at `t`.
pub(super) fn peek_request(collection: u64, t: u64) -> proto::PeekRequest {
    proto::PeekRequest {
        replica: REPLICA.into(),
        collection_id: collection,
        timestamp: t,
    }
}
