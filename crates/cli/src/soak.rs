//! The soak (`lockstep soak`, run by `cargo xtask soak [--quick]`): a real
//! environment (`lockstep serve`, this binary) and a 2x2 replica driven
//! through the gRPC API for many rounds, killed with SIGKILL and restarted
//! between rounds, to show that nothing acknowledged is lost and that costs
//! stay flat however long it runs (G1).
//!
//! Every round:
//! 1. (after the first) starts the environment again on the same state
//!    directory and measures the reconnection: from the start until a peek
//!    of the replica answers correctly (the controller connected, the
//!    replica reconciled and answers);
//! 2. writes batches of rows to input 1 (each batch inserts `batch_rows` new
//!    rows and retracts the batch before the previous one, so two batches are
//!    live), each followed by a peek of a count per bucket, both timed;
//! 3. creates and drops dataflows (every tenth peeked before its drop);
//! 4. subscribes to the counts, checks the first batch and cancels;
//! 5. peeks every live row and compares it with the reference;
//! 6. samples the resident memory of the environment and of every replica
//!    process and the bytes in the state directory.
//!
//! The environment runs with `--compaction-lag 4`: storage follows the live
//! rows. Each figure's `end_over_start` is the median of the last three
//! rounds over the median of rounds 2 to 4 (round 1 warms up, and has no
//! reconnection); the run is flat when every one is at most
//! [`FLAT_BOUND`]. Every answer is compared with a reference computed in
//! plain Rust; a wrong answer ends the run with an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use lockstep_orchestrator::process::rss_mib;
use lockstep_plan::reference::{evaluate, Multiset};
use lockstep_plan::text::parse_plan;
use lockstep_plan::Plan;
use lockstep_protocol::proto as wire;
use lockstep_protocol::Update;

use crate::serve_child::{start_env_with, Env};
use lockstep_environment::proto;

/// The bound on every figure's `end_over_start`.
pub const FLAT_BOUND: f64 = 1.5;
const REPLICA: &str = "soak";
const INPUT: u64 = 1;
const ALL: u64 = 101;
const COUNTS: u64 = 102;
const BUCKETS: i64 = 16;
const LAG: &str = "4";

/// How long the soak runs.
#[derive(Clone, Debug)]
pub struct SoakOptions {
    /// Rounds, with an environment restart between two.
    pub rounds: usize,
    /// Batches written per round.
    pub batches_per_round: u64,
    /// Rows inserted per batch.
    pub batch_rows: i64,
    /// Dataflows created and dropped per round.
    pub dataflows_per_round: u64,
}

impl SoakOptions {
    /// Quick mode: 25 rounds (24 restarts), 1,000,000 rows, 1,000 dataflows.
    pub fn quick() -> Self {
        SoakOptions {
            rounds: 25,
            batches_per_round: 4,
            batch_rows: 10_000,
            dataflows_per_round: 40,
        }
    }

    /// Full mode: 100 rounds, 6,000,000 rows, 4,000 dataflows.
    pub fn full() -> Self {
        SoakOptions {
            rounds: 100,
            batches_per_round: 6,
            batch_rows: 10_000,
            dataflows_per_round: 40,
        }
    }
}

/// One round's samples.
#[derive(Clone, Debug, Default)]
struct Sample {
    round: usize,
    rows_written: u64,
    write_p50_ms: f64,
    peek_p50_ms: f64,
    reconnect_ms: Option<f64>,
    rss_environment_mib: f64,
    rss_replica_mib: f64,
    disk_mib: f64,
}

/// How to read one figure from a sample.
type Figure = fn(&Sample) -> Option<f64>;

/// The figures whose flatness is checked, with how to read them.
const FIGURES: [(&str, Figure); 6] = [
    ("write_p50_ms", |s| Some(s.write_p50_ms)),
    ("peek_p50_ms", |s| Some(s.peek_p50_ms)),
    ("reconnect_ms", |s| s.reconnect_ms),
    ("rss_environment_mib", |s| Some(s.rss_environment_mib)),
    ("rss_replica_mib", |s| Some(s.rss_replica_mib)),
    ("disk_mib", |s| Some(s.disk_mib)),
];

fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// A dataflow on the soak replica reading its input, exporting `plan` as
/// `collection`.
fn create_request(prefix: &str, collection: u64, plan: &Plan) -> proto::CreateDataflowRequest {
    proto::CreateDataflowRequest {
        replica: REPLICA.into(),
        name: format!("{prefix}-{collection}"),
        inputs: vec![INPUT],
        exports: vec![wire::Export {
            collection_id: collection,
            description: lockstep_plan::encode(plan),
        }],
        as_of: 0,
        format: String::new(),
    }
}

/// What the soak drives and checks.
struct Driver {
    bin: PathBuf,
    state: PathBuf,
    opts: SoakOptions,
    /// The next batch (its time).
    batch: u64,
    next_dataflow: u64,
    rows_written: u64,
    dataflows_created: u64,
    all_plan: Plan,
    counts_plan: Plan,
}

impl Driver {
    fn batch_rows(&self, t: u64) -> impl Iterator<Item = Vec<u8>> + '_ {
        (0..self.opts.batch_rows).map(move |i| lockstep_plan::row(&[t as i64, i, i % BUCKETS]))
    }

    /// The live updates after batch `t`: batches t - 1 and t, at time t.
    fn live(&self, t: u64) -> Vec<Update> {
        let first = t.saturating_sub(1);
        (first..=t)
            .flat_map(|b| self.batch_rows(b).collect::<Vec<_>>())
            .map(|row| Update {
                row,
                time: t,
                diff: 1,
            })
            .collect()
    }

    fn reference(&self, plan: &Plan, t: u64) -> Multiset {
        evaluate(plan, &BTreeMap::from([(INPUT, self.live(t))]), t)
    }

    async fn write_batch(&mut self, c: &mut crate::api_client::Client) -> anyhow::Result<Duration> {
        let t = self.batch;
        let mut updates: Vec<wire::Update> = self
            .batch_rows(t)
            .map(|row| wire::Update {
                row,
                time: t,
                diff: 1,
            })
            .collect();
        if t >= 2 {
            updates.extend(self.batch_rows(t - 2).map(|row| wire::Update {
                row,
                time: t,
                diff: -1,
            }));
        }
        let started = Instant::now();
        c.write_input(proto::WriteInputRequest {
            replica: REPLICA.into(),
            collection_id: INPUT,
            updates,
            upper: t + 1,
        })
        .await
        .with_context(|| format!("writing batch {t}"))?;
        let took = started.elapsed();
        self.batch += 1;
        self.rows_written += self.opts.batch_rows as u64;
        Ok(took)
    }

    /// Peeks `collection` at the last written time and compares it with the
    /// reference of `plan`.
    async fn check_peek(
        &self,
        c: &mut crate::api_client::Client,
        collection: u64,
        plan: &Plan,
    ) -> anyhow::Result<Duration> {
        let t = self.batch - 1;
        let started = Instant::now();
        let rows = c
            .peek(proto::PeekRequest {
                replica: REPLICA.into(),
                collection_id: collection,
                timestamp: t,
            })
            .await
            .with_context(|| format!("peek of collection {collection} at {t}"))?
            .into_inner()
            .rows;
        let took = started.elapsed();
        let got: Multiset = rows.into_iter().map(|r| (r.values, r.diff)).collect();
        let expected = self.reference(plan, t);
        if got != expected {
            bail!(
                "peek of collection {collection} at {t}: {} rows, the reference has {} (nothing acknowledged may be lost)",
                got.len(),
                expected.len()
            );
        }
        Ok(took)
    }

    /// Creates and drops dataflows; every tenth is peeked before its drop.
    async fn churn_dataflows(&mut self, c: &mut crate::api_client::Client) -> anyhow::Result<()> {
        let plan = parse_plan("filter(get(1), #2 < 1)")?;
        for k in 0..self.opts.dataflows_per_round {
            let collection = 10_000 + self.next_dataflow;
            self.next_dataflow += 1;
            let created = c
                .create_dataflow(create_request("churn", collection, &plan))
                .await
                .context("creating a dataflow")?
                .into_inner()
                .dataflow
                .context("the created dataflow is missing")?;
            self.dataflows_created += 1;
            if k % 10 == 0 {
                self.check_peek(c, collection, &plan).await?;
            }
            c.drop_dataflow(proto::DropDataflowRequest { id: created.id })
                .await
                .context("dropping a dataflow")?;
        }
        Ok(())
    }

    /// Subscribes to the counts at the last written time, checks the first
    /// batch against the reference and cancels (drops the stream).
    async fn subscribe_and_cancel(&self, c: &mut crate::api_client::Client) -> anyhow::Result<()> {
        let t = self.batch - 1;
        let mut stream = c
            .subscribe(proto::SubscribeRequest {
                replica: REPLICA.into(),
                collection_id: COUNTS,
                as_of: t,
                resume: false,
            })
            .await
            .context("subscribing")?
            .into_inner();
        let first = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .context("no subscribe batch within 60 s")?
            .context("the subscription ended before its first batch")?
            .context("the subscription failed")?;
        let mut got = Multiset::new();
        for u in first.updates {
            *got.entry(u.row).or_default() += u.diff;
        }
        got.retain(|_, d| *d != 0);
        if got != self.reference(&self.counts_plan, t) {
            bail!("the subscription's snapshot at {t} differs from the reference");
        }
        drop(stream);
        Ok(())
    }

    /// The PIDs of the replica's processes.
    async fn replica_pids(&self, c: &mut crate::api_client::Client) -> anyhow::Result<Vec<u32>> {
        let r = c
            .list_replicas(proto::ListReplicasRequest::default())
            .await?
            .into_inner();
        Ok(r.replicas
            .iter()
            .find(|r| r.name == REPLICA)
            .context("the soak replica is not listed")?
            .process_status
            .iter()
            .map(|p| p.pid)
            .collect())
    }

    async fn setup(&mut self, c: &mut crate::api_client::Client) -> anyhow::Result<()> {
        c.create_replica(proto::CreateReplicaRequest {
            name: REPLICA.into(),
            processes: 2,
            workers_per_process: 2,
            ..Default::default()
        })
        .await
        .context("creating the soak replica")?;
        for (collection, plan) in [(ALL, &self.all_plan), (COUNTS, &self.counts_plan)] {
            c.create_dataflow(create_request("soak", collection, plan))
                .await
                .context("creating a soak dataflow")?;
        }
        Ok(())
    }

    async fn round(
        &mut self,
        round: usize,
        env: &Env,
        reconnect_ms: Option<f64>,
    ) -> anyhow::Result<Sample> {
        let mut c = env.client().await?;
        let mut writes = Vec::new();
        let mut peeks = Vec::new();
        for _ in 0..self.opts.batches_per_round {
            writes.push(self.write_batch(&mut c).await?);
            let counts = self.counts_plan.clone();
            peeks.push(self.check_peek(&mut c, COUNTS, &counts).await?);
        }
        self.churn_dataflows(&mut c).await?;
        self.subscribe_and_cancel(&mut c).await?;
        let all = self.all_plan.clone();
        self.check_peek(&mut c, ALL, &all).await?;
        let pids = self.replica_pids(&mut c).await?;
        let ms = |d: &Duration| d.as_secs_f64() * 1e3;
        Ok(Sample {
            round,
            rows_written: self.rows_written,
            write_p50_ms: median(writes.iter().map(ms).collect()),
            peek_p50_ms: median(peeks.iter().map(ms).collect()),
            reconnect_ms,
            rss_environment_mib: env.child.id().map_or(0.0, rss_mib),
            rss_replica_mib: pids.iter().map(|p| rss_mib(*p)).sum(),
            disk_mib: dir_bytes(&self.state) as f64 / (1024.0 * 1024.0),
        })
    }

    /// Starts the environment and waits until the replica answers a peek
    /// correctly; returns the environment and how long that took.
    async fn restart(&self) -> anyhow::Result<(Env, Duration)> {
        let started = Instant::now();
        let env = start_env_with(&self.bin, &self.state, &["--compaction-lag", LAG]).await?;
        let mut c = env.client().await?;
        let deadline = started + Duration::from_secs(120);
        let counts = self.counts_plan.clone();
        loop {
            match self.check_peek(&mut c, COUNTS, &counts).await {
                Ok(_) => return Ok((env, started.elapsed())),
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("not answering yet: {e:#}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e.context("no correct answer within 120 s of the restart")),
            }
        }
    }
}

fn report_json(
    samples: &[Sample],
    driver: &Driver,
    restarts: usize,
    wall: Duration,
    quick: bool,
) -> serde_json::Value {
    let rounds: Vec<serde_json::Value> = samples
        .iter()
        .map(|s| {
            serde_json::json!({
                "round": s.round,
                "rows_written": s.rows_written,
                "write_p50_ms": s.write_p50_ms,
                "peek_p50_ms": s.peek_p50_ms,
                "reconnect_ms": s.reconnect_ms,
                "rss_environment_mib": s.rss_environment_mib,
                "rss_replica_mib": s.rss_replica_mib,
                "disk_mib": s.disk_mib,
            })
        })
        .collect();
    let mut figures = serde_json::Map::new();
    let n = samples.len();
    for (name, get) in FIGURES {
        let start = median(samples.iter().skip(1).take(3).filter_map(get).collect());
        let end = median(
            samples
                .iter()
                .skip(n.saturating_sub(3))
                .filter_map(get)
                .collect(),
        );
        figures.insert(
            name.to_string(),
            serde_json::json!({ "start": start, "end": end, "end_over_start": end / start }),
        );
    }
    serde_json::json!({
        "quick": quick,
        "rounds": rounds,
        "rows_written": driver.rows_written,
        "dataflows_created": driver.dataflows_created,
        "environment_restarts": restarts,
        "wall_secs": wall.as_secs_f64(),
        "flat_bound": FLAT_BOUND,
        "figures": figures,
    })
}

/// Runs the soak; writes the report to `out` (JSON) and returns it. An
/// error means a harness failure or a wrong answer; flatness is judged by
/// the caller from the report.
pub async fn run(opts: SoakOptions, quick: bool, out: &Path) -> anyhow::Result<serde_json::Value> {
    let started = Instant::now();
    let bin = std::env::current_exe().context("locating the lockstep binary")?;
    let dir = tempfile::Builder::new()
        .prefix("lockstep-soak-")
        .tempdir()?;
    let state = dir.path().to_path_buf();
    let mut driver = Driver {
        bin,
        state: state.clone(),
        opts: opts.clone(),
        batch: 0,
        next_dataflow: 0,
        rows_written: 0,
        dataflows_created: 0,
        all_plan: parse_plan("get(1)")?,
        counts_plan: parse_plan("reduce(get(1), [#2], count)")?,
    };
    let result = async {
        let mut samples = Vec::new();
        let mut env = start_env_with(&driver.bin, &state, &["--compaction-lag", LAG]).await?;
        driver.setup(&mut env.client().await?).await?;
        let mut restarts = 0;
        for round in 0..opts.rounds {
            let reconnect = if round == 0 {
                None
            } else {
                env.child.kill().await.context("killing the environment")?;
                env.child.wait().await?;
                restarts += 1;
                let (e, took) = driver.restart().await?;
                env = e;
                Some(took.as_secs_f64() * 1e3)
            };
            let sample = driver.round(round, &env, reconnect).await?;
            println!(
                "soak: round {:>3}/{}: {:>9} rows, write p50 {:>6.2} ms, peek p50 {:>6.2} ms, reconnect {}, RSS env {:>6.1} MiB, replica {:>6.1} MiB, disk {:>6.1} MiB",
                round + 1,
                opts.rounds,
                sample.rows_written,
                sample.write_p50_ms,
                sample.peek_p50_ms,
                sample
                    .reconnect_ms
                    .map_or("-".to_string(), |ms| format!("{ms:.0} ms")),
                sample.rss_environment_mib,
                sample.rss_replica_mib,
                sample.disk_mib
            );
            samples.push(sample);
        }
        let _ = env.child.kill().await;
        Ok::<_, anyhow::Error>(report_json(&samples, &driver, restarts, started.elapsed(), quick))
    }
    .await;
    let _ = lockstep_orchestrator::process::kill_all_services(
        &state.join(lockstep_environment::ORCHESTRATOR_DIR),
    );
    let report = result?;
    if let Some(parent) = out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    Ok(report)
}
