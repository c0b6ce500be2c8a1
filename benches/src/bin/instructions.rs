//! Instruction counts per operation, a regression figure that the machine's
//! noise does not move: each replica process runs under valgrind's callgrind,
//! which counts the instructions it executes, and the controller (in this
//! process, not counted) drives it.
//!
//! For each strategy and shape, on a fresh replica: a batch of small commands
//! (StatusRequest until every worker answered), of installs (a small dataflow
//! until its frontier passes 0, then dropped), of 1 KiB writes (until the
//! frontier of a dataflow reading them passes), and one reconciliation of
//! 100 dataflows by a new controller at a new epoch (nothing rebuilt, which
//! is asserted). Before and after each batch it has callgrind dump every
//! process's counters (`callgrind_control --dump`, which also zeroes them),
//! and reports the instructions of the batch summed over the processes,
//! divided by the batch's operations. They include what the processes'
//! timer-driven polls execute while the batch runs (a worker parks for at
//! most 5 ms), which grows with the batch's duration under callgrind: two
//! runs on one machine agreed within about 10%, small commands at 1x1
//! within about 35%, against run-to-run spreads of 15-40% in wall-clock
//! medians.
//!
//! Usage: `instructions OUT.json` (`cargo xtask bench --instructions` runs it).
//! `$LOCKSTEP_REPLICA_BIN` is the replica (default: the release build);
//! `$LOCKSTEP_BENCH_QUICK=1` measures 1x1 only (else 1x1 and 2x2);
//! `$LOCKSTEP_BENCH_STRATEGIES` restricts the strategies.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use lockstep_benches::harness::{self, rt};
use lockstep_benches::replica::{self, BenchReplica};
use lockstep_benches::{alternating_write, dataflow_over, payload, small_dataflow};
use lockstep_protocol::{Strategy, Update};

/// How long one operation may take under callgrind (tens of times slower).
const OP_BOUND: Duration = Duration::from_secs(300);
/// Operations per batch.
const BATCH: u64 = 20;
/// The dataflow the writes are read by, and its export (apart from the
/// small dataflows' IDs and their exports, `1000 + ID`).
const WRITE_DATAFLOW: u64 = 90_000;
const WRITE_EXPORT: u64 = 90_001;
/// Dataflows installed for the reconciliation.
const RECONCILED: u64 = 100;

/// One figure: the instructions of one operation, summed over the processes.
#[derive(serde::Serialize)]
struct Figure {
    name: String,
    instructions_per_op: u64,
    ops: u64,
}

fn main() -> anyhow::Result<()> {
    let out = std::env::args()
        .nth(1)
        .context("usage: instructions OUT.json")?;
    which("valgrind")?;
    which("callgrind_control")?;
    let quick = std::env::var("LOCKSTEP_BENCH_QUICK").is_ok_and(|v| v == "1");
    let shapes: &[(usize, u32)] = if quick { &[(1, 1)] } else { &[(1, 1), (2, 2)] };
    let strategies: Vec<Strategy> = match std::env::var("LOCKSTEP_BENCH_STRATEGIES") {
        Ok(list) => list
            .split(',')
            .map(|s| s.trim().parse().map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?,
        Err(_) => Strategy::ALL.to_vec(),
    };
    let work = tempfile::tempdir()?;
    let mut figures = Vec::new();
    let mut replica_id = 7000;
    for &(p, w) in shapes {
        for &strategy in &strategies {
            replica_id += 1;
            let started = Instant::now();
            let id = format!("{strategy}/{p}x{w}");
            let dir = work.path().join(format!("{replica_id}"));
            std::fs::create_dir_all(&dir)?;
            let measured = measure(&dir, replica_id, strategy, p, w)
                .with_context(|| format!("instructions of {id}"))?;
            for (measurement, per_op, ops) in measured {
                eprintln!(
                    "instructions: {measurement}/{id}: {per_op} per operation ({ops} operations)"
                );
                figures.push(Figure {
                    name: format!("instructions/{measurement}/{id}"),
                    instructions_per_op: per_op,
                    ops,
                });
            }
            eprintln!("instructions: {id}: {:.1?}", started.elapsed());
        }
    }
    std::fs::write(&out, serde_json::to_string_pretty(&figures)?)
        .with_context(|| format!("writing {out}"))?;
    Ok(())
}

fn which(program: &str) -> anyhow::Result<()> {
    match Command::new(program).arg("--version").output() {
        Ok(_) => Ok(()),
        Err(e) => bail!("{program} is needed to count instructions (Debian: valgrind): {e}"),
    }
}

/// A script that runs the replica under callgrind, its counters dumped to
/// `dir/cg.PID.N`, and records its PID in `dir/pids`.
fn wrapper(dir: &Path) -> anyhow::Result<PathBuf> {
    let replica = replica::binary();
    let script = dir.join("replica-under-callgrind");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho $$ >> '{dir}/pids'\nexec valgrind --tool=callgrind --callgrind-out-file='{dir}/cg.%p' '{replica}' \"$@\"\n",
            dir = dir.display(),
            replica = replica.display()
        ),
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    Ok(script)
}

/// The PIDs of the processes under callgrind.
fn pids(dir: &Path) -> anyhow::Result<Vec<u32>> {
    let text = std::fs::read_to_string(dir.join("pids")).context("the replica's PIDs")?;
    text.lines()
        .map(|l| l.trim().parse().context("a PID"))
        .collect()
}

/// Has every process dump (and zero) its counters; the instructions counted
/// since the last dump, summed.
fn dump(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for pid in pids(dir)? {
        let before = dumps(dir, pid)?;
        let out = Command::new("callgrind_control")
            .args(["--dump", &pid.to_string()])
            .output()
            .context("callgrind_control")?;
        if !out.status.success() {
            bail!(
                "callgrind_control --dump {pid}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // The dump is written by the process itself: wait for it (bounded).
        let deadline = Instant::now() + Duration::from_secs(60);
        let path = loop {
            let now = dumps(dir, pid)?;
            if let Some(p) = now.into_iter().find(|p| !before.contains(p)) {
                if let Some(n) = totals(&p)? {
                    total += n;
                    break p;
                }
            }
            if Instant::now() > deadline {
                bail!("process {pid} wrote no dump within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        std::fs::remove_file(path)?;
    }
    Ok(total)
}

/// The dump files of process `pid`.
fn dumps(dir: &Path, pid: u32) -> anyhow::Result<Vec<PathBuf>> {
    let prefix = format!("cg.{pid}.");
    Ok(std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .collect())
}

/// The event total of a complete callgrind dump (`totals:` or `summary:`).
fn totals(path: &Path) -> anyhow::Result<Option<u64>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .rev()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next()?.parse().ok()))
}

/// (measurement, instructions per operation, operations) for one replica.
fn measure(
    dir: &Path,
    replica_id: u64,
    strategy: Strategy,
    p: usize,
    w: u32,
) -> anyhow::Result<Vec<(String, u64, u64)>> {
    let rt = rt();
    let _guard = rt.enter();
    let program = wrapper(dir)?;
    let r: BenchReplica = rt.block_on(replica::start_program(&program, replica_id, p, w));
    let ctl = replica::controller(&r, strategy);
    macro_rules! op {
        ($what:expr, $fut:expr) => {
            harness::op(&rt, $what, OP_BOUND, $fut)
        };
    }
    op!("status", ctl.statuses());
    let mut out = Vec::new();
    let mut batch = |name: &str, ops: u64, f: &mut dyn FnMut()| -> anyhow::Result<()> {
        // Twice unmeasured first (first-use costs), then a batch.
        f();
        f();
        dump(dir)?;
        for _ in 0..ops {
            f();
        }
        let n = dump(dir)?;
        out.push((name.to_string(), n / ops, ops));
        Ok(())
    };

    batch("small_command", BATCH, &mut || op!("ping", ctl.ping()))?;

    ctl.write_input(1, vec![], 1)?;
    let mut next = 20_000u64;
    batch("install", BATCH, &mut || {
        next += 1;
        let d = small_dataflow(next);
        ctl.create_dataflow(d.clone()).expect("create");
        op!("install", ctl.wait_for_frontier(1000 + next, 0));
        ctl.drop_dataflow(&d).expect("drop");
    })?;

    ctl.write_input(2, vec![], 1)?;
    ctl.create_dataflow(dataflow_over(WRITE_DATAFLOW, 2, WRITE_EXPORT))?;
    op!("install", ctl.wait_for_frontier(WRITE_EXPORT, 0));
    let rows = payload(1024);
    let mut time = 1u64;
    batch("write_1KiB", BATCH, &mut || {
        let t = time;
        time += 1;
        ctl.write_input(2, alternating_write(&rows, t), t + 1)
            .expect("write");
        op!("write", ctl.wait_for_frontier(WRITE_EXPORT, t));
    })?;

    // A write of 10,000 small rows (the batch of the stages bench), fewer
    // of them: each is about 3 ms natively.
    let mut time = 1_000u64;
    batch("write_10k", 5, &mut || {
        let t = time;
        time += 1;
        let updates = (0..10_000i64)
            .map(|i| Update {
                row: lockstep_plan::row(&[i, t as i64]),
                time: t,
                diff: 1,
            })
            .collect();
        ctl.write_input(2, updates, t + 1).expect("write");
        op!("write", ctl.wait_for_frontier(WRITE_EXPORT, t));
    })?;

    for d in 1..=RECONCILED {
        ctl.create_dataflow(small_dataflow(d))?;
    }
    op!("install", ctl.wait_for_frontier(1000 + RECONCILED, 0));
    let before = op!("status", ctl.statuses());
    let history = op!("history", ctl.history());
    ctl.shutdown();
    dump(dir)?;
    let c = replica::controller_with(&r, strategy, 2, history);
    let after = op!("reconcile", c.statuses());
    let n = dump(dir)?;
    replica::assert_nothing_rebuilt(&before, &after);
    out.push((format!("reconcile_{RECONCILED}"), n, 1));
    c.shutdown();
    Ok(out)
}
