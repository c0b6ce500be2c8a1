//! One seed: its setup (a harness error if it fails), the attack phase
//! (the workload, the attackers, the kill, the other user, the legitimate
//! scrapes, all at once), the final check and the teardown.

use super::*;

use std::sync::atomic::Ordering::Relaxed;

use attack::PortWatch;
use plan::Port;
use workload::Workload;

/// What the attackers and checkers know of the environment.
#[derive(Clone)]
pub(crate) struct EnvView {
    /// Its PID.
    pub(crate) pid: u32,
    /// Its API (and the token, for the legitimate client).
    pub(crate) api: Api,
    /// Its metrics endpoint.
    pub(crate) metrics: SocketAddr,
    /// The metrics token.
    pub(crate) metrics_token: String,
}

/// Kills the replica's processes when the seed ends, however it ends.
pub(crate) struct Teardown(pub(crate) PathBuf);

impl Drop for Teardown {
    fn drop(&mut self) {
        let _ = lockstep_orchestrator::process::kill_all_services(&self.0);
    }
}

/// Runs seed `seed` of `variant`: its outcome and a line of what happened.
pub(crate) async fn run(seed: u64, variant: Variant) -> (Result<(), Failure>, String) {
    let plan = plan::generate(seed);
    let shape = format!("{PROCESSES}x{}", plan.workers);
    let started = Instant::now();
    let shared = Arc::new(Shared::default());
    let outcome = match run_plan(seed, variant, &plan, &shared).await {
        Ok(()) => shared.outcome(),
        // A failed setup or teardown step, unless something was found first.
        Err(e) => shared.outcome().and(Err(e)),
    };
    let s = &shared.stats;
    let mut line = if !variant.attacks() {
        "this control's door only, no attack phase".to_string()
    } else {
        format!(
        "{shape}, {} attacks, {} attacker connections, {} writes, {} peeks, {} status calls, {} scrapes, {} unauthenticated calls and {} scrapes refused",
        plan.attacks.len(),
        s.connections.load(Relaxed),
        s.writes.load(Relaxed),
        s.peeks.load(Relaxed),
        s.status_calls.load(Relaxed),
        s.scrapes.load(Relaxed),
        s.refused_calls.load(Relaxed),
        s.refused_scrapes.load(Relaxed),
        )
    };
    for f in shared.more_findings() {
        line.push_str("; also ");
        line.push_str(&f);
    }
    for n in shared.notes() {
        line.push_str("; ");
        line.push_str(&n);
    }
    line.push_str(&format!("; {:.1} s", started.elapsed().as_secs_f64()));
    (outcome, line)
}

/// The seed's steps; a setup step that fails is a harness error.
async fn run_plan(
    seed: u64,
    variant: Variant,
    plan: &plan::SeedPlan,
    shared: &Arc<Shared>,
) -> Result<(), Failure> {
    let state = tempfile::Builder::new()
        .prefix("lockstep-hostile-")
        .tempdir()
        .map_err(|e| format!("a state directory: {e}"))?;
    let _teardown = Teardown(state.path().join(lockstep_environment::ORCHESTRATOR_DIR));
    let out = env::out_dir();
    let _ = std::fs::create_dir_all(&out);
    let log = out.join(format!("{}-seed-{seed}.env.log", variant.name()));
    let mut env = Env::start(state.path(), &log, variant).await?;
    // Exhaustion within reach: the environment's descriptors limited now.
    limit_descriptors(env.pid, ENV_NOFILE).await?;
    let view = EnvView {
        pid: env.pid,
        api: env.api.clone(),
        metrics: env.metrics,
        metrics_token: env.metrics_token.clone(),
    };
    let result = if variant.attacks() {
        let result = attack_phase(state.path(), plan, &view, shared).await;
        // Memory under the whole mix: the environment's peak and each
        // replica process's, bounded.
        let peak = lockstep_orchestrator::process::peak_rss_mib(env.pid);
        let replica: Vec<f64> = match view.api.processes(SETUP_BOUND).await {
            Ok(procs) => procs
                .iter()
                .map(|p| lockstep_orchestrator::process::peak_rss_mib(p.pid))
                .collect(),
            // Unmeasured is not within the bound: a harness error, unless
            // something was found already (the listing may fail for it).
            Err(e) => {
                if shared.outcome().is_ok() {
                    shared.fail(Failure::Harness(format!(
                        "listing the replica to measure its processes' memory: {e}"
                    )));
                }
                Vec::new()
            }
        };
        let baseline = *shared.baseline_mib.lock().expect("not poisoned");
        let shown: Vec<String> = replica.iter().map(|m| format!("{m:.0}")).collect();
        shared.note(format!(
            "peak RSS: environment {peak:.0} MiB ({baseline:.0} at the attacks' start), replica processes {} MiB",
            shown.join(", ")
        ));
        record_peaks(peak, &replica);
        if let Some(high) = replica.iter().copied().find(|m| *m > REPLICA_PEAK_MIB) {
            shared.fail(violation(
                "R1",
                format!(
                    "a replica process's peak memory reached {high:.0} MiB under the attack mix (bound {REPLICA_PEAK_MIB:.0} MiB)"
                ),
            ));
        }
        let bound = baseline + env_budget_mib() + ENV_SLACK_MIB;
        if peak > bound {
            shared.fail(violation(
                "R1",
                format!(
                    "the environment's peak memory reached {peak:.0} MiB under the attack mix (bound {bound:.0} MiB: {baseline:.0} at the attacks' start, the byte budget's {:.0} and {ENV_SLACK_MIB:.0})",
                    env_budget_mib()
                ),
            ));
        }
        result
    } else {
        Ok(())
    };
    if other_user::can_switch_user() {
        doors::run(state.path(), &view.api, variant, seed, shared).await;
    } else if variant.attacks() {
        shared.note(
            "not root: the doors of another user's state directory and listener skipped".into(),
        );
    } else {
        shared.fail(Failure::Harness(format!(
            "{} needs root: its door is tried as uid {}",
            variant.name(),
            other_user::OTHER_UID
        )));
    }
    env.kill().await;
    result
}

/// Keeps the highest peaks seen ([`PEAKS`]).
fn record_peaks(env: f64, replica: &[f64]) {
    let mut p = PEAKS.lock().expect("not poisoned");
    p.0 = p.0.max(env);
    p.1 = replica.iter().fold(p.1, |a, b| a.max(*b));
}

/// Creates the replica and its dataflow, then runs everything at once.
async fn attack_phase(
    state: &Path,
    plan: &plan::SeedPlan,
    view: &EnvView,
    shared: &Arc<Shared>,
) -> Result<(), Failure> {
    let api = &view.api;
    let harness = |what: &str, e: String| Failure::Harness(format!("{what}: {e}"));
    let mut c = api
        .client(SETUP_BOUND)
        .await
        .map_err(|e| harness("connecting", e))?;
    c.create_replica(proto::CreateReplicaRequest {
        name: REPLICA.into(),
        processes: PROCESSES,
        workers_per_process: plan.workers,
        config: String::new(),
    })
    .await
    .map_err(|s| harness("creating the replica", code(&s)))?;
    c.create_dataflow(workload::create_request())
        .await
        .map_err(|s| harness("creating the dataflow", code(&s)))?;
    drop(c);
    // The replica serves: a first write and peek (a harness error if not).
    let mut work = Workload::new(api.clone(), shared.clone());
    let setup = async {
        work.write(Some(SETUP_BOUND)).await?;
        work.peek(Some(SETUP_BOUND)).await
    };
    setup.await.map_err(|f| match f {
        // Not answered in time: the replica never served, before any attack.
        Failure::Violation { invariant, what } if invariant == "R1" => {
            harness("the replica did not serve", what)
        }
        other => other,
    })?;
    let procs = api
        .processes(SETUP_BOUND)
        .await
        .map_err(|e| harness("listing the replica", e))?;
    let pids: Vec<u32> = procs.iter().map(|p| p.pid).collect();
    if procs.len() != PROCESSES as usize || procs.iter().any(|p| !p.running || p.pid == 0) {
        return Err(harness("the replica's processes", format!("{procs:?}")));
    }
    for p in &procs {
        limit_descriptors(p.pid, REPLICA_NOFILE).await?;
    }
    // The ports under attack.
    let mut watches = vec![
        Arc::new(PortWatch::new(Port::Api, api.addr)),
        Arc::new(PortWatch::new(Port::Metrics, view.metrics)),
    ];
    for (i, p) in procs.iter().enumerate() {
        let addr = p
            .controller
            .ok_or_else(|| harness("process addresses", format!("{p:?}")))?;
        watches.push(Arc::new(PortWatch::new(Port::Controller(i), addr)));
    }
    *shared.baseline_mib.lock().expect("not poisoned") =
        lockstep_orchestrator::process::peak_rss_mib(view.pid);
    let t0 = Instant::now();
    let end = t0 + ATTACK;
    let mut tasks = tokio::task::JoinSet::new();
    for a in &plan.attacks {
        let w = watches
            .iter()
            .find(|w| w.port == a.port)
            .expect("a watch per port")
            .clone();
        tasks.spawn(attack::run(*a, w, t0, view.clone(), shared.clone()));
    }
    for w in &watches {
        tasks.spawn(attack::watch_cap(w.clone(), end, shared.clone()));
    }
    let killed_port = procs[plan.kill]
        .controller
        .ok_or_else(|| harness("process addresses", format!("{procs:?}")))?;
    tasks.spawn(kill_and_watch(
        api.clone(),
        pids,
        (plan.kill, killed_port),
        t0 + plan.kill_at,
        shared.clone(),
    ));
    tasks.spawn(legitimate_scrapes(view.clone(), end, shared.clone()));
    tasks.spawn(token_holder_gets_in(api.clone(), end, shared.clone()));
    if other_user::can_switch_user() {
        let (state, view, shared) = (state.to_path_buf(), view.clone(), shared.clone());
        let at = t0 + plan.probe_at;
        tasks.spawn(async move {
            shared.pause_until(at).await;
            if shared.stopped() {
                return;
            }
            if let Err(f) = other_user::probe(&state, &view, &shared).await {
                shared.fail(f);
            }
        });
    } else {
        shared.note("not root: the other user's probe skipped".into());
    }
    // The workload, here, until the end of the attack phase (or its first
    // finding).
    let mut failed = false;
    while Instant::now() < end && !shared.stopped() {
        let r = async {
            work.write(None).await?;
            work.write(None).await?;
            work.peek(None).await
        };
        if let Err(f) = r.await {
            shared.fail(f);
            failed = true;
            break;
        }
        shared.pause(WORKLOAD_PAUSE).await;
    }
    // Every attacker and checker ends by itself (bounded); past that, a
    // harness error.
    let joined = tokio::time::timeout(RESTART_BOUND + Duration::from_secs(10), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if joined.is_err() {
        shared.fail(Failure::Harness(
            "an attacker or checker did not end in time".into(),
        ));
    }
    tasks.abort_all();
    // The final check: the replica serves the token holder, every write
    // there (after the restart allowance, if the kill's restart was never
    // seen: then it was reported already).
    if !shared.stopped() && !failed {
        if let Err(f) = async {
            work.write(None).await?;
            work.peek(None).await
        }
        .await
        {
            shared.fail(f);
        }
    }
    let s = &shared.stats;
    s.writes.store(work.model.writes, Relaxed);
    s.peeks.store(work.model.peeks, Relaxed);
    let made: usize = watches.iter().map(|w| w.made.load(Relaxed)).sum();
    s.connections.store(made, Relaxed);
    let most: Vec<String> = watches
        .iter()
        .map(|w| format!("{} {}", w.port, w.most.load(Relaxed)))
        .collect();
    shared.note(format!("most open at once: {}", most.join(", ")));
    Ok(())
}

/// At `at`, kills process `index` (its PID `pids[index]` from the setup)
/// with SIGKILL; its controller port (`port`) must not be free for
/// another socket meanwhile (the orchestrator holds it); then the replica
/// must be back (every process running, that one with a new PID) within
/// [`RESTART_BOUND`], seen through ListReplicas. Its new processes get
/// their descriptors limited too.
async fn kill_and_watch(
    api: Api,
    pids: Vec<u32>,
    (index, port): (usize, SocketAddr),
    at: Instant,
    shared: Arc<Shared>,
) {
    shared.pause_until(at).await;
    if shared.stopped() {
        return;
    }
    let old = pids[index];
    if let Err(e) = kill9(old).await {
        shared.fail(Failure::Harness(format!("killing process {index}: {e}")));
        return;
    }
    let killed = Instant::now();
    shared.recovering(killed + RESTART_BOUND);
    // A squatter binding the process's controller port as fast as it can
    // for 2 s from the kill: the moment the dying process lets go of it,
    // it would be taken, before any restart binds it again.
    let squatting = Instant::now() + Duration::from_secs(2);
    while Instant::now() < squatting && !shared.stopped() {
        if std::net::TcpListener::bind(port).is_ok() {
            shared.fail(violation(
                "R1",
                format!(
                    "process {index}'s controller port {port} was free for another socket after its SIGKILL"
                ),
            ));
            return;
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
    let mut last = String::from("not listed yet");
    while killed.elapsed() < RESTART_BOUND && !shared.stopped() {
        let left = RESTART_BOUND.saturating_sub(killed.elapsed());
        match api.processes(left.min(Duration::from_secs(3))).await {
            Ok(procs)
                if procs.len() == pids.len()
                    && procs.iter().all(|p| p.running && p.pid != 0)
                    && procs[index].pid != old =>
            {
                let back = killed.elapsed();
                shared.recovering(Instant::now());
                shared.note(format!(
                    "process {index} killed, back in {:.1} s",
                    back.as_secs_f64()
                ));
                for p in procs {
                    // Best effort: a process of the new generation may be
                    // replaced meanwhile.
                    let _ = limit_descriptors(p.pid, REPLICA_NOFILE).await;
                }
                return;
            }
            Ok(procs) => last = format!("{procs:?}"),
            Err(e) => last = e,
        }
        shared.pause(Duration::from_millis(200)).await;
    }
    if !shared.stopped() {
        shared.fail(violation(
            "R1",
            format!(
                "process {index} (PID {old}), killed with SIGKILL, was not back within {RESTART_BOUND:?}: {last}"
            ),
        ));
    }
}

/// A scrape with the metrics token, on a new connection, about every
/// second until `end`: each must be answered 200 within [`OP_BOUND`]
/// (retried meanwhile).
async fn legitimate_scrapes(view: EnvView, end: Instant, shared: Arc<Shared>) {
    while Instant::now() < end && !shared.stopped() {
        let started = Instant::now();
        loop {
            match attack::scrape(view.metrics, Some(&view.metrics_token)).await {
                Ok(s) if s.starts_with("HTTP/1.1 200") => break,
                Ok(s) if s.starts_with("HTTP/1.1 401") => {
                    shared.fail(violation(
                        "R1",
                        format!("a scrape with the metrics token was refused: {s}"),
                    ));
                    return;
                }
                other => {
                    if started.elapsed() >= OP_BOUND {
                        shared.fail(violation(
                            "R1",
                            format!(
                                "a scrape with the metrics token was not answered within {OP_BOUND:?}: {other:?}"
                            ),
                        ));
                        return;
                    }
                }
            }
            shared.pause(RETRY_PAUSE).await;
            if shared.stopped() {
                return;
            }
        }
        shared.stats.scrapes.fetch_add(1, Relaxed);
        shared.pause(Duration::from_secs(1)).await;
    }
}

/// A token holder's GetStatus, on a new connection, about every second
/// until `end`: each must be answered within [`OP_BOUND`] (retried
/// meanwhile), whatever the replica does: the API itself keeps no token
/// holder out (R1), with no allowance for a process restart.
async fn token_holder_gets_in(api: Api, end: Instant, shared: Arc<Shared>) {
    while Instant::now() < end && !shared.stopped() {
        let started = Instant::now();
        loop {
            let left = OP_BOUND.saturating_sub(started.elapsed());
            let call = async {
                let mut c = api.client(left).await?;
                c.get_status(proto::GetStatusRequest {})
                    .await
                    .map_err(|s| code(&s))
            };
            let last = match tokio::time::timeout(left.min(ATTEMPT), call).await {
                Ok(Ok(_)) => break,
                Ok(Err(e)) if e.starts_with("Unauthenticated") => {
                    shared.fail(violation(
                        "R1",
                        format!("a call with the token was refused: {e}"),
                    ));
                    return;
                }
                Ok(Err(e)) => e,
                Err(_) => format!("no answer within {:.1} s", left.min(ATTEMPT).as_secs_f64()),
            };
            if started.elapsed() >= OP_BOUND {
                shared.fail(violation(
                    "R1",
                    format!(
                        "a token holder's new connection was kept out of the API for {:.1} s: {last}",
                        started.elapsed().as_secs_f64()
                    ),
                ));
                return;
            }
            shared.pause(RETRY_PAUSE).await;
            if shared.stopped() {
                return;
            }
        }
        shared.stats.status_calls.fetch_add(1, Relaxed);
        shared.pause(Duration::from_secs(1)).await;
    }
}
