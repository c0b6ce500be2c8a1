//! `lockstep-chaos-campaign`: a seeded random fault campaign on real
//! processes (`cargo xtask chaos campaign`).
//!
//! Each seed draws a replica shape (1-4 processes x 1-2 workers) and a
//! sequence of operations and faults, and drives a real `lockstep serve`
//! (its gRPC API) and the replica's real processes with them: dataflows
//! created from random plans over inputs 1-3 and dropped; writes of
//! inserts and retractions advancing the uppers; peeks; subscribes; the
//! environment killed with SIGKILL while idle, with a request in flight, or
//! with its controller crashed part-way through a broadcast (failpoint
//! `controller_partial_broadcast`) and started again on the same state
//! directory; a replica process killed with SIGKILL, or stopped (SIGSTOP)
//! and resumed; the distribution policy swapped at run time (SetPolicy);
//! the whole replica killed. Every request and its answer (or unknown fate)
//! is recorded; after the run the campaign checks:
//!
//! - **I2** the replica reaches the target within [`RECOVERY`] after the
//!   last fault: a fresh write to every input is acknowledged and every live
//!   dataflow answers a peek at the newest time;
//! - **I3** every acknowledged write is visible exactly once, every write
//!   of unknown fate wholly or not at all (each write inserts rows with
//!   unique IDs, so the peeks of the identity dataflows `get(k)` tell which
//!   happened), every peek and subscribe snapshot equals the plain-Rust
//!   reference at its time, over the writes that happened;
//! - **liveness of processes** exactly the catalog's replicas have
//!   processes, all of them alive.
//!
//! - **I1** (indirectly) the workers' creation logs are not exposed by the
//!   environment's API or by a per-process status. The campaign checks them
//!   through the environment's own history check, which compares every
//!   worker's creation log and installed dataflows each time the controller
//!   connects (every environment restart, every replica reconnect) and logs
//!   `workers disagree about what they applied` on a difference, with
//!   `creation_logs="differ"` when the creation logs differ (read from its
//!   stderr after every operation, which must be at `warn` or finer:
//!   `LOCKSTEP_CAMPAIGN_LOG`, default `warn`). Creation logs that differ are
//!   a violation of I1, even though the environment then repairs them: the
//!   workers did build different dataflows. Installed sets that differ alone
//!   (a drop that reached some processes before the controller crashed,
//!   which `barrier` leaves to the collective reconciliation) are counted as
//!   partial drops repaired; more of them than faults injected means a
//!   repair did not take (I4: each fault leaves at most one command
//!   applied by some processes only). At the end the campaign kills the environment
//!   once more and starts it again, so that one more clean connection is
//!   checked.
//!
//! Each seed's line also counts the partial drops repaired and the replica
//! restarts for lost lockstep.
//!
//! The negative control `naive` runs a WASM policy choosing `naive` for
//! every command under `lockstep serve --experiments-allow-naive
//! --experiments-no-replica-restarts`: the controller's crash part-way
//! through a command leaves workers that applied different commands, which
//! the next connection's history check reports (I1), or a dataflow built on
//! some workers only, which never answers (I2).
//!
//! Usage: `lockstep-chaos-campaign [--seeds A..B | --seed S] [--steps N]
//! [--strategy X ...] [--keep I,J,...] [--shrink]` (default, the quick set
//! `cargo xtask test` runs: seeds [`QUICK_SEEDS`] × [`QUICK_STEPS`]
//! operations and the shrunk [`REGRESSIONS`] for broadcast barrier log, and
//! seeds [`QUICK_NAIVE_SEEDS`] for naive). Prints one line per seed,
//! the replay command of a failing one, then the reporting contract's JSON
//! line per strategy (suite `campaign`). Exits non-zero if a strategy that
//! must pass had a violation, any seed had a harness error, or `naive` (the
//! negative control) was not caught.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::StreamExt;
use lockstep_chaos::environment::Sandbox;
use lockstep_chaos::outcome::{violation, Failure, Tally};
use lockstep_environment::proto;
use lockstep_environment::proto::environment_client::EnvironmentClient;
use lockstep_protocol::proto as wire;
use tokio::io::AsyncBufReadExt;
use tonic::transport::Channel;

#[path = "campaign/model.rs"]
mod model;

use model::{identity_collection, multiset, Fate, Op, Rng, World, INPUTS};

const SUITE: &str = "campaign";
const REPLICA: &str = "c";
/// The bound on recovery after the last fault (I2): the environment
/// restarts a replica at most every 10 s (`REPLICA_RESTART_INTERVAL`).
const RECOVERY: Duration = Duration::from_secs(60);
/// The bound on one API call.
const CALL: Duration = Duration::from_secs(15);
/// The bound on one seed.
const SEED_BOUND: Duration = Duration::from_secs(360);
const STRATEGIES: [&str; 3] = ["broadcast", "barrier", "log"];

type Client = EnvironmentClient<Channel>;

fn target_debug() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("target/debug"))
}

fn lockstep_binary() -> PathBuf {
    target_debug().join("lockstep")
}

/// `target/lockstep`, beside `target/debug`.
fn lockstep_dir() -> PathBuf {
    target_debug()
        .parent()
        .map(|t| t.join("lockstep"))
        .unwrap_or_else(|| PathBuf::from("target/lockstep"))
}

/// The WASM distribution policy choosing `strategy` for every command:
/// the shipped ones (`cargo xtask build-policies`), and `naive.wasm`,
/// which `cargo xtask chaos campaign` builds for the negative control.
fn policy_file(strategy: &str) -> PathBuf {
    if strategy == "naive" {
        lockstep_dir().join("campaign-policies/naive.wasm")
    } else {
        lockstep_dir().join(format!("policies/{strategy}.wasm"))
    }
}

/// A running `lockstep serve`.
struct Env {
    child: tokio::process::Child,
    url: String,
}

impl Env {
    async fn start(state: &Path, naive: bool, failpoints: Option<&str>) -> Result<Env, String> {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state.join("campaign-env.stderr"))
            .map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(lockstep_binary());
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(state)
            .env(
                "LOCKSTEP_LOG",
                std::env::var("LOCKSTEP_CAMPAIGN_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        if naive {
            // The negative control: naive delivery, and none of the
            // environment's repairs (restarts on a silent process, lost
            // lockstep or a history mismatch) behind it.
            cmd.args([
                "--experiments-allow-naive",
                "--experiments-no-replica-restarts",
            ]);
        }
        match failpoints {
            Some(fp) => cmd.env("FAILPOINTS", fp),
            None => cmd.env_remove("FAILPOINTS"),
        };
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", lockstep_binary().display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = match tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            other => {
                let tail =
                    std::fs::read_to_string(state.join("campaign-env.stderr")).unwrap_or_default();
                let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                return Err(format!(
                    "lockstep serve did not serve ({other:?}); stderr tail: {tail}"
                ));
            }
        };
        let addr = line
            .strip_prefix("lockstep: serving on ")
            .and_then(|r| r.split_whitespace().next())
            .ok_or_else(|| format!("unexpected first line {line:?}"))?
            .to_string();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Env {
            child,
            url: format!("http://{addr}"),
        })
    }

    async fn client(&self) -> Result<Client, String> {
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone())
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .timeout(CALL)
            .connect()
            .await
            .map_err(|e| format!("connecting to {}: {e}", self.url))?;
        Ok(EnvironmentClient::new(channel))
    }

    /// SIGKILL, and reap it.
    async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// One seed's run: its sandbox, environment, client and model.
struct Run {
    seed: u64,
    strategy: String,
    processes: u32,
    sandbox: Sandbox,
    env: Env,
    client: Client,
    world: World,
    /// Faults injected (for the seed's line).
    faults: usize,
    /// The environment runs with its controller crashed at the failpoint:
    /// it is killed and started again after this many more operations.
    crashed_for: Option<usize>,
    /// How far the environment's stderr has been read for the history
    /// check's findings (see [`Run::workers_agreed`]).
    log_read: usize,
    /// History mismatches in installed sets alone (see
    /// [`Run::workers_agreed`]), for the seed's line.
    partial_drops: usize,
}

/// What the environment's controller logs when its history check on a
/// connection finds workers that applied different commands (I1).
const DISAGREEMENT: &str = "workers disagree";

fn code(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// Fates of an answer: success, or an error that says nothing was done
/// (the request was refused as a whole), or unknown.
fn fate_of<T>(r: &Result<T, tonic::Status>) -> Fate {
    match r {
        Ok(_) => Fate::Acked,
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::InvalidArgument
                    | tonic::Code::NotFound
                    | tonic::Code::AlreadyExists
                    | tonic::Code::OutOfRange
            ) =>
        {
            Fate::Absent
        }
        Err(_) => Fate::Unknown,
    }
}

fn write_request(w: &model::WriteRec) -> proto::WriteInputRequest {
    proto::WriteInputRequest {
        replica: REPLICA.into(),
        collection_id: w.input,
        updates: w
            .updates
            .iter()
            .map(|u| wire::Update {
                row: u.row.clone(),
                time: u.time,
                diff: u.diff,
            })
            .collect(),
        upper: w.time + 1,
    }
}

fn create_request(d: &model::DataflowRec) -> proto::CreateDataflowRequest {
    proto::CreateDataflowRequest {
        replica: REPLICA.into(),
        name: format!("c{}", d.collection),
        inputs: d.inputs.clone(),
        exports: vec![wire::Export {
            collection_id: d.collection,
            plan: Some(d.plan.clone().into()),
        }],
        as_of: 0,
    }
}

fn signal(pid: u32, sig: libc::c_int) -> Result<(), String> {
    if pid == 0 {
        return Err("no PID".into());
    }
    // kill(2) through the `kill` command keeps this crate free of unsafe code.
    let name = match sig {
        libc::SIGKILL => "KILL",
        libc::SIGSTOP => "STOP",
        _ => "CONT",
    };
    let ok = std::process::Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed"))
    }
}

fn alive(pid: u32) -> bool {
    // A zombie still answers kill(0): read its state.
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().next())
        .unwrap_or("X");
    !matches!(state, "Z" | "X")
}

impl Run {
    async fn setup(
        seed: u64,
        strategy: &str,
        processes: u32,
        workers: u32,
    ) -> Result<Run, Failure> {
        let sandbox = Sandbox::new().map_err(|e| format!("sandbox: {e:#}"))?;
        let env = Env::start(sandbox.path(), strategy == "naive", None).await?;
        let client = env.client().await?;
        let mut run = Run {
            seed,
            strategy: strategy.to_string(),
            processes,
            sandbox,
            env,
            client,
            world: World::new(),
            faults: 0,
            crashed_for: None,
            log_read: 0,
            partial_drops: 0,
        };
        run.set_policy(strategy)
            .await
            .map_err(|e| Failure::Harness(format!("setting the policy {strategy}: {e}")))?;
        run.client
            .create_replica(proto::CreateReplicaRequest {
                name: REPLICA.into(),
                processes,
                workers_per_process: workers,
                config: String::new(),
            })
            .await
            .map_err(|e| format!("creating the replica: {}", code(&e)))?;
        run.world.log(format!(
            "setup: replica {processes}x{workers}, policy {strategy}"
        ));
        // The identity dataflows, and a first write to every input.
        for k in INPUTS {
            let text = format!("get({k})");
            let plan = model::parse(&text)?;
            let mut d = model::DataflowRec {
                collection: identity_collection(k),
                text,
                plan,
                inputs: vec![k],
                id: None,
                live: true,
                unknown: false,
                identity: true,
            };
            let created = run
                .client
                .create_dataflow(create_request(&d))
                .await
                .map_err(|e| format!("creating the identity dataflow of {k}: {}", code(&e)))?;
            d.id = created.into_inner().dataflow.map(|d| d.id);
            run.world.dataflows.push(d);
            let mut r = Rng::new(seed ^ k);
            let w = run.world.new_write(usize::MAX, k, &mut r);
            run.client
                .write_input(write_request(&w))
                .await
                .map_err(|e| format!("the first write to {k}: {}", code(&e)))?;
            run.world.record_write(w, Fate::Acked);
        }
        Ok(run)
    }

    /// I1 at every connection: the environment's controller compares every
    /// worker's creation log and installed dataflows each time it connects
    /// (after every environment restart and every replica reconnect) and
    /// logs [`DISAGREEMENT`] on a difference, saying whether the creation
    /// logs differ. It then repairs it, but workers whose creation logs
    /// differ did build different dataflows: a violation of I1, whatever
    /// came after. Installed sets that differ alone (a drop that reached some
    /// processes before the controller crashed, which `barrier` leaves to the
    /// collective reconciliation) are counted, and must be gone by the end
    /// (the final checks). Reads what the environment logged since the last
    /// call.
    fn workers_agreed(&mut self, i: usize) -> Result<(), Failure> {
        // Only what was logged since the last call: the log grows with the
        // run, and this runs after every operation.
        let mut new = Vec::new();
        (|| -> std::io::Result<()> {
            use std::io::{Read, Seek, SeekFrom};
            let mut f = std::fs::File::open(self.sandbox.path().join("campaign-env.stderr"))?;
            f.seek(SeekFrom::Start(self.log_read as u64))?;
            f.read_to_end(&mut new)?;
            Ok(())
        })()
        .map_err(|e| Failure::Harness(format!("reading the environment's log: {e}")))?;
        self.log_read += new.len();
        let new = String::from_utf8_lossy(&new);
        for line in new.lines().filter(|l| l.contains(DISAGREEMENT)) {
            let line = strip_ansi(line);
            if line.contains("creation_logs=\"same\"") {
                self.partial_drops += 1;
                // Each fault leaves at most one command applied by some
                // processes only, which the next connection repairs. More
                // mismatches than faults: a repair did not take (I4).
                if self.partial_drops > self.faults {
                    return Err(violation(
                        "I4",
                        format!(
                            "by operation {i}, {} history checks found installed sets that differ after {} faults: a collective reconciliation did not repair what a fault left: {line}",
                            self.partial_drops, self.faults
                        ),
                    ));
                }
                continue;
            }
            return Err(violation(
                "I1",
                format!(
                    "by operation {i}, the history check on a connection found workers that built different dataflows: {line}"
                ),
            ));
        }
        Ok(())
    }

    async fn set_policy(&mut self, strategy: &str) -> Result<(), String> {
        let file = policy_file(strategy);
        let wasm = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        self.client
            .set_policy(proto::SetPolicyRequest {
                name: strategy.into(),
                wasm,
                replica: String::new(),
            })
            .await
            .map_err(|e| code(&e))?;
        Ok(())
    }

    async fn pids(&mut self) -> Result<Vec<u32>, String> {
        let r = self
            .client
            .list_replicas(proto::ListReplicasRequest::default())
            .await
            .map_err(|e| code(&e))?
            .into_inner();
        Ok(r.replicas
            .iter()
            .find(|r| r.name == REPLICA)
            .map(|r| r.process_status.iter().map(|p| p.pid).collect())
            .unwrap_or_default())
    }

    /// kill -9 the environment (it must be gone), then start it again on
    /// the same state directory, and resolve what the catalog holds.
    async fn restart_env(&mut self, failpoints: Option<&str>) -> Result<(), Failure> {
        self.crashed_for = None;
        self.env.kill().await;
        self.env = Env::start(self.sandbox.path(), self.strategy == "naive", failpoints).await?;
        self.client = self.env.client().await?;
        if failpoints.is_none() {
            self.resolve_dataflows().await?;
        }
        Ok(())
    }

    /// Resolves creates and drops of unknown fate from the catalog.
    async fn resolve_dataflows(&mut self) -> Result<(), Failure> {
        if !self.world.dataflows.iter().any(|d| d.unknown) {
            return Ok(());
        }
        let mut listed = std::collections::BTreeMap::new();
        let mut token = String::new();
        loop {
            let page = self
                .client
                .list_dataflows(proto::ListDataflowsRequest {
                    page_size: 1000,
                    page_token: token.clone(),
                })
                .await
                .map_err(|e| format!("listing dataflows: {}", code(&e)))?
                .into_inner();
            for e in page.dataflows {
                if let Some(d) = e.dataflow {
                    for x in &d.exports {
                        listed.insert(x.collection_id, d.id);
                    }
                }
            }
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        let mut lines = Vec::new();
        for d in self.world.dataflows.iter_mut().filter(|d| d.unknown) {
            d.unknown = false;
            match listed.get(&d.collection) {
                Some(id) => {
                    d.live = true;
                    d.id = Some(*id);
                }
                None => d.live = false,
            }
            lines.push(format!(
                "  resolved: dataflow {} ({}) is {}",
                d.collection,
                d.text,
                if d.live { "live" } else { "absent" }
            ));
        }
        self.world.history.extend(lines);
        Ok(())
    }

    /// Runs operation `i`.
    async fn step(&mut self, i: usize, op: Op) -> Result<(), Failure> {
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

    fn new_dataflow(&mut self, i: usize, r: &mut Rng) -> Result<model::DataflowRec, Failure> {
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

    fn finish_create(
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

    async fn drop_request(
        &mut self,
        k: usize,
    ) -> Result<tonic::Response<proto::DropDataflowResponse>, tonic::Status> {
        let id = self.world.dataflows[k].id.unwrap_or(0);
        self.client
            .drop_dataflow(proto::DropDataflowRequest { id })
            .await
    }

    fn finish_drop(
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

    fn finish_write(
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
    async fn in_flight(
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
    async fn partial_create(&mut self, i: usize, r: &mut Rng, reach: &str) -> Result<(), Failure> {
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
    async fn await_or_kill<T: Send + 'static>(
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
    async fn peek(&mut self, i: usize, k: usize, how: &'static str) -> Result<bool, Failure> {
        let d = self.world.dataflows[k].clone();
        let Some(t) = self.world.read_time(&d.inputs) else {
            return Ok(false);
        };
        let res = self
            .client
            .peek(proto::PeekRequest {
                replica: REPLICA.into(),
                collection_id: d.collection,
                timestamp: t,
            })
            .await;
        match res {
            Ok(rows) => {
                let rows = multiset(
                    rows.into_inner()
                        .rows
                        .into_iter()
                        .map(|r| (r.values, r.diff)),
                );
                self.world.log(format!(
                    "{i} {how} {} at {t}: {} rows",
                    d.collection,
                    rows.len()
                ));
                self.world.answers.push(model::Answer {
                    op: i,
                    how,
                    collection: d.collection,
                    plan: d.plan,
                    time: t,
                    rows,
                });
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
    async fn subscribe(&mut self, i: usize, k: usize) -> Result<(), Failure> {
        let d = self.world.dataflows[k].clone();
        let Some(t) = self.world.read_time(&d.inputs) else {
            return Ok(());
        };
        let res = self
            .client
            .subscribe(proto::SubscribeRequest {
                replica: REPLICA.into(),
                collection_id: d.collection,
                as_of: t,
            })
            .await;
        let mut stream = match res {
            Ok(s) => s.into_inner(),
            Err(s) => {
                self.world.log(format!(
                    "{i} subscribe {} at {t}: {}",
                    d.collection,
                    code(&s)
                ));
                return Ok(());
            }
        };
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let complete = loop {
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
                        break true;
                    }
                }
                _ => break false,
            }
        };
        drop(stream);
        if complete {
            let rows = multiset(got);
            self.world.log(format!(
                "{i} subscribe {} at {t}: snapshot of {} rows",
                d.collection,
                rows.len()
            ));
            self.world.answers.push(model::Answer {
                op: i,
                how: "subscribe",
                collection: d.collection,
                plan: d.plan,
                time: t,
                rows,
            });
        } else {
            self.world.log(format!(
                "{i} subscribe {} at {t}: no complete snapshot within 10 s",
                d.collection
            ));
        }
        Ok(())
    }

    /// After the last fault: the replica reaches the target within
    /// [`RECOVERY`] (I2), every write's fate and every answer check out
    /// (I3), exactly the catalog's replica has live processes.
    async fn check(&mut self, steps: usize) -> Result<String, Failure> {
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
        // is a write of unknown fate; the next one uses the next time).
        for (n, k) in INPUTS.into_iter().enumerate() {
            let mut r = Rng::for_op(self.seed, steps + n);
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
    fn resolve_writes(&mut self) -> Result<(), Failure> {
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

/// A log line without its terminal colours.
fn strip_ansi(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Runs one seed with `keep` (indices of the operations to run; all if
/// `None`): its outcome and a line of what happened.
async fn run_seed(
    seed: u64,
    steps: usize,
    strategy: &str,
    keep: Option<&BTreeSet<usize>>,
    history_file: &Path,
) -> (Result<(), Failure>, String) {
    let plan = model::generate(seed, steps);
    let started = Instant::now();
    let mut run = match Run::setup(seed, strategy, plan.processes, plan.workers).await {
        Ok(r) => r,
        Err(e) => return (Err(e), format!("{}x{}", plan.processes, plan.workers)),
    };
    let mut outcome = Ok(());
    for (i, op) in plan.ops.iter().enumerate() {
        if keep.is_some_and(|k| !k.contains(&i)) {
            continue;
        }
        if let Err(e) = run.step(i, *op).await.and_then(|()| run.workers_agreed(i)) {
            outcome = Err(e);
            break;
        }
    }
    let mut detail = String::new();
    if outcome.is_ok() {
        match run.check(steps).await {
            Ok(d) => detail = d,
            Err(e) => outcome = Err(e),
        }
    }
    let restarts = run
        .pids()
        .await
        .map(|p| format!("{p:?}"))
        .unwrap_or_default();
    run.world.log(format!("end: pids {restarts}; {outcome:?}"));
    let _ = std::fs::write(history_file, run.world.history.join("\n") + "\n");
    run.env.kill().await;
    let _ = std::fs::copy(
        run.sandbox.path().join("campaign-env.stderr"),
        history_file.with_extension("env.log"),
    );
    drop(run);
    let line = format!(
        "{}x{}, {} faults, {:.0} s{}{}",
        plan.processes,
        plan.workers,
        plan.ops
            .iter()
            .enumerate()
            .filter(|(i, o)| o.is_fault() && keep.is_none_or(|k| k.contains(i)))
            .count(),
        started.elapsed().as_secs_f64(),
        if detail.is_empty() { "" } else { ", " },
        detail
    );
    (outcome, line)
}

async fn bounded_seed(
    seed: u64,
    steps: usize,
    strategy: &str,
    keep: Option<&BTreeSet<usize>>,
    history_file: &Path,
) -> (Result<(), Failure>, String) {
    match tokio::time::timeout(
        SEED_BOUND,
        run_seed(seed, steps, strategy, keep, history_file),
    )
    .await
    {
        Ok(r) => r,
        Err(_) => (
            Err(Failure::Harness(format!(
                "the seed did not end within {SEED_BOUND:?}"
            ))),
            String::new(),
        ),
    }
}

fn same_failure(a: &Result<(), Failure>, b: &Result<(), Failure>) -> bool {
    match (a, b) {
        (
            Err(Failure::Violation { invariant: x, .. }),
            Err(Failure::Violation { invariant: y, .. }),
        ) => x == y,
        _ => false,
    }
}

/// Drops chunks of operations while the seed still fails with the same
/// invariant (at most `budget`); the operations kept.
async fn shrink(
    seed: u64,
    steps: usize,
    strategy: &str,
    failure: &Result<(), Failure>,
    budget: Duration,
    scratch: &Path,
) -> BTreeSet<usize> {
    let started = Instant::now();
    let mut kept: Vec<usize> = (0..steps).collect();
    let mut chunk = kept.len().div_ceil(2);
    while chunk >= 1 && started.elapsed() < budget {
        let mut start = 0;
        let mut progressed = false;
        while start < kept.len() && started.elapsed() < budget {
            let candidate: BTreeSet<usize> = kept
                .iter()
                .enumerate()
                .filter(|(j, _)| *j < start || *j >= start + chunk)
                .map(|(_, i)| *i)
                .collect();
            let (o, _) = bounded_seed(seed, steps, strategy, Some(&candidate), scratch).await;
            if same_failure(&o, failure) {
                eprintln!(
                    "campaign: shrink {strategy} seed {seed}: {} operations still fail",
                    candidate.len()
                );
                kept = candidate.into_iter().collect();
                progressed = true;
            } else {
                start += chunk;
            }
        }
        if !progressed {
            chunk /= 2;
        }
    }
    kept.into_iter().collect()
}

struct Args {
    seeds: Vec<u64>,
    steps: usize,
    strategies: Vec<String>,
    keep: Option<BTreeSet<usize>>,
    shrink: bool,
    /// The quick set (no `--seeds`, `--seed` or `--keep`): the
    /// [`REGRESSIONS`] run too.
    regressions: bool,
}

/// The quick set's seeds (`cargo xtask test`): 1–8, and the seeds that
/// found a defect in a longer run (9 and 20: see [`REGRESSIONS`]).
const QUICK_SEEDS: [u64; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 20];

/// The quick set's seeds for the negative control `naive`: more than for
/// the others, since whether a seed catches it depends on where the
/// controller's crashes land (3 to 6 of 10 seeds caught it in single runs).
const QUICK_NAIVE_SEEDS: std::ops::RangeInclusive<u64> = 1..=20;

/// The quick set's operations per seed.
const QUICK_STEPS: usize = 60;

/// Shrunk histories of defects the campaign found, kept as regressions:
/// (seed, operations the seed draws, the operations kept). Run for every
/// strategy that must pass in the quick set.
///
/// - seed 6, 50 operations, kept 19,20,28,29,30: after an environment
///   restart a restarted replica answered an earlier controller's peek
///   replayed from the command log, and the new controller, whose peek IDs
///   restarted at 1, took it for its own (I3; found as barrier seeds 6 and
///   9, broadcast and log seed 20; fixed by epoch-carrying request IDs).
const REGRESSIONS: [(u64, usize, &[usize]); 1] = [(6, 50, &[19, 20, 28, 29, 30])];

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        seeds: QUICK_SEEDS.to_vec(),
        steps: QUICK_STEPS,
        strategies: Vec::new(),
        keep: None,
        shrink: false,
        regressions: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--seeds" => {
                args.regressions = false;
                let v = value("--seeds")?;
                let (a, b) = v
                    .split_once("..")
                    .ok_or("--seeds A..B (B excluded; A..=B includes it)")?;
                let (b, inclusive) = match b.strip_prefix('=') {
                    Some(b) => (b, true),
                    None => (b, false),
                };
                let a: u64 = a.parse().map_err(|e| format!("--seeds: {e}"))?;
                let b: u64 = b.parse().map_err(|e| format!("--seeds: {e}"))?;
                args.seeds = if inclusive {
                    (a..=b).collect()
                } else {
                    (a..b).collect()
                };
            }
            "--seed" => {
                args.regressions = false;
                args.seeds = vec![value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?]
            }
            "--steps" => {
                args.steps = value("--steps")?
                    .parse()
                    .map_err(|e| format!("--steps: {e}"))?
            }
            "--strategy" => args.strategies.push(value("--strategy")?),
            "--keep" => {
                args.regressions = false;
                let v = value("--keep")?;
                args.keep = Some(
                    v.split(',')
                        .filter(|s| !s.is_empty())
                        .map(|s| s.parse().map_err(|e| format!("--keep: {e}")))
                        .collect::<Result<_, _>>()?,
                );
            }
            "--shrink" => args.shrink = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if args.strategies.is_empty() {
        args.strategies = ["broadcast", "barrier", "log", "naive"]
            .map(String::from)
            .to_vec();
    }
    for s in &args.strategies {
        if !STRATEGIES.contains(&s.as_str()) && s != "naive" {
            return Err(format!(
                "unknown strategy {s:?} (broadcast, barrier, log, naive)"
            ));
        }
    }
    Ok(args)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lockstep-chaos-campaign: {e}");
            std::process::exit(2);
        }
    };
    let mut missing: Vec<PathBuf> =
        vec![lockstep_binary(), target_debug().join("lockstep-replica")];
    missing.extend(STRATEGIES.iter().map(|s| policy_file(s)));
    if args.strategies.iter().any(|s| s == "naive") {
        missing.push(policy_file("naive"));
    }
    missing.retain(|p| !p.exists());
    if !missing.is_empty() {
        eprintln!(
            "lockstep-chaos-campaign: missing {missing:?}: build them (cargo xtask chaos campaign does)"
        );
        std::process::exit(2);
    }
    let out_dir = lockstep_dir().join("campaign");
    let _ = std::fs::create_dir_all(&out_dir);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut ok = true;
    for strategy in &args.strategies {
        let negative = strategy == "naive";
        let mut tally = Tally::default();
        let seeds: Vec<u64> = if args.regressions && negative {
            QUICK_NAIVE_SEEDS.collect()
        } else {
            args.seeds.clone()
        };
        let mut cases: Vec<(u64, usize, Option<BTreeSet<usize>>)> = seeds
            .iter()
            .map(|&seed| (seed, args.steps, args.keep.clone()))
            .collect();
        if args.regressions && !negative {
            cases.extend(
                REGRESSIONS.iter().map(|&(seed, steps, keep)| {
                    (seed, steps, Some(keep.iter().copied().collect()))
                }),
            );
        }
        for (seed, steps, keep) in cases {
            let keep_arg = keep
                .as_ref()
                .map(|k| {
                    let k: Vec<String> = k.iter().map(|i| i.to_string()).collect();
                    format!(" --keep {}", k.join(","))
                })
                .unwrap_or_default();
            let history = out_dir.join(format!(
                "{strategy}-seed-{seed}{}.log",
                if keep.is_some() { "-kept" } else { "" }
            ));
            let (outcome, line) =
                runtime.block_on(bounded_seed(seed, steps, strategy, keep.as_ref(), &history));
            let what = tally.record(&outcome);
            eprintln!("campaign: {strategy} seed {seed}{keep_arg} ({line}): {what}");
            if outcome.is_err() {
                eprintln!(
                    "campaign:   history: {}\ncampaign:   replay: cargo xtask chaos campaign --seed {seed} --steps {steps} --strategy {strategy}{keep_arg}",
                    history.display(),
                );
                if args.shrink && matches!(outcome, Err(Failure::Violation { .. })) {
                    let scratch = out_dir.join(format!("{strategy}-seed-{seed}-shrink.log"));
                    let kept = runtime.block_on(shrink(
                        seed,
                        steps,
                        strategy,
                        &outcome,
                        Duration::from_secs(300),
                        &scratch,
                    ));
                    let kept: Vec<String> = kept.iter().map(|i| i.to_string()).collect();
                    eprintln!(
                        "campaign:   shrunk to {} operations: cargo xtask chaos campaign --seed {seed} --steps {steps} --strategy {strategy} --keep {}",
                        kept.len(),
                        kept.join(",")
                    );
                }
            }
        }
        println!("{}", tally.summary_line(SUITE, strategy, negative));
        ok &= tally.ok(negative);
    }
    std::process::exit(if ok { 0 } else { 1 });
}
