//! A running replica reconfigured, beside the same replica built from
//! nothing, through the environment (in this process, the process
//! orchestrator, the release `lockstep-replica`, `barrier`):
//!
//! - `reconfigure/create/{n}/2x2`: a new 2x2 replica created, `n` small
//!   dataflows (each `get(1)`, arranged) created on it through
//!   `Environment::create_dataflow`, and 1,000 rows written to input 1 at
//!   time 0, until its controller reports every dataflow caught up (each
//!   export past time 0 on every process): what dropping a replica and creating it at another
//!   shape costs before it answers again (and every read meanwhile waits or
//!   is refused);
//! - `reconfigure/resize/{n}/2x2_4x1`: `Environment::resize_replica_answering`
//!   of a replica holding `n` such dataflows, from 2x2 to 4x1 and back,
//!   one per iteration, until the call returns (its new processes caught
//!   up with the standby, the standby dropped). Its reads are answered
//!   throughout, by the standby meanwhile: a resize rebuilds the replica
//!   twice (the standby, then the new processes), so it takes longer than
//!   a create and refuses nothing.
//!
//! `n` is 1,000 (100 with `--quick`). Needs the release replica: `cargo
//! build --release -p lockstep-replica`.

#![allow(missing_docs)] // criterion_group! generates undocumented functions

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode};
use lockstep_benches::harness::{self, rt};
use lockstep_benches::replica;
use lockstep_catalog::ReplicaConfig;
use lockstep_environment::{Environment, EnvironmentConfig, ServiceTemplate};
use lockstep_plan::text::parse_plan;

/// The input every dataflow reads.
const INPUT: u64 = 1;
/// The rows written to it at time 0.
const ROWS: i64 = 1_000;
/// The bound on a replica's dataflows catching up.
const CATCH_UP: Duration = Duration::from_secs(300);

/// Dataflows per replica.
fn dataflows() -> u64 {
    if harness::quick() {
        100
    } else {
        1_000
    }
}

/// An environment in a fresh directory; its replicas' processes are
/// stopped when it is dropped.
struct Fixture {
    dir: tempfile::TempDir,
    env: Arc<Environment>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // The processes outlive the environment (it would adopt them on a
        // restart): stop them.
        let _ = lockstep_orchestrator::process::kill_all_services(
            &self.dir.path().join(lockstep_environment::ORCHESTRATOR_DIR),
        );
    }
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let env = Environment::start(EnvironmentConfig::new(
        dir.path(),
        lockstep_policy::native_orphan_rule("id-watermark").unwrap(),
        ServiceTemplate::new(&replica::binary()),
    ))
    .await
    .unwrap();
    Fixture { dir, env }
}

/// Creates replica `name` (2x2) with `n` dataflows and waits until its
/// controller reports every one caught up.
async fn build(env: &Environment, name: &str, n: u64) {
    env.create_replica(
        name,
        ReplicaConfig {
            processes: 2,
            workers_per_process: 2,
            config: String::new(),
        },
    )
    .await
    .unwrap();
    let plan = parse_plan(&format!("get({INPUT})")).unwrap();
    for i in 0..n {
        env.create_dataflow(
            name,
            &format!("d{i}"),
            0,
            vec![INPUT],
            vec![lockstep_plan::export(100 + i, &plan)],
        )
        .await
        .unwrap();
    }
    // Rows every dataflow must take in before it catches up (upper 1).
    let rows = (0..ROWS)
        .map(|i| lockstep_protocol::Update {
            row: lockstep_plan::row(&[i, 7]),
            time: 0,
            diff: 1,
        })
        .collect();
    env.write_input(name, INPUT, rows, 1).await.unwrap();
    caught_up(env, name, n).await;
}

/// Waits until replica `name`'s controller reports `n` dataflows caught up.
async fn caught_up(env: &Environment, name: &str, n: u64) {
    let started = Instant::now();
    loop {
        if let Some(c) = env.replica_controller(name) {
            if let Ok(c) = c.caught_up().await {
                if c.dataflows as u64 == n && c.caught_up as u64 == n {
                    return;
                }
            }
        }
        assert!(
            started.elapsed() < CATCH_UP,
            "replica {name}'s {n} dataflows did not catch up within {CATCH_UP:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn reconfigure(c: &mut Criterion) {
    let rt = rt();
    let n = dataflows();
    let fixture = rt.block_on(fixture());
    let env = fixture.env.clone();
    let mut g = c.benchmark_group("reconfigure");
    harness::timings(&mut g, 10, 1000);
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);

    let mut created = 0u64;
    g.bench_function(format!("create/{n}/2x2"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                created += 1;
                let name = format!("c{created}");
                total += rt.block_on(async {
                    let t = Instant::now();
                    build(&env, &name, n).await;
                    let took = t.elapsed();
                    env.drop_replica(&name).await.unwrap();
                    took
                });
            }
            total
        })
    });

    rt.block_on(build(&env, "r", n));
    let mut wide = false;
    g.bench_function(format!("resize/{n}/2x2_4x1"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                wide = !wide;
                let (p, w) = if wide { (4, 1) } else { (2, 2) };
                total += rt.block_on(async {
                    let t = Instant::now();
                    env.resize_replica_answering("r", p, w)
                        .await
                        .unwrap_or_else(|e| panic!("resize to {p}x{w}: {e}"));
                    t.elapsed()
                });
            }
            total
        })
    });
    g.finish();
    drop(fixture);
}

criterion_group!(benches, reconfigure);
criterion_main!(benches);
