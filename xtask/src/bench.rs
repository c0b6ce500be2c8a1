//! `cargo xtask bench [--quick] [--readme]`: runs the criterion suite in
//! `benches/` and reports it.
//!
//! It writes:
//! - `target/lockstep/bench.json`: one object per benchmark: its name, its
//!   median in nanoseconds, and its baseline and the ratio to it where one
//!   exists (the reporting contract of docs/invariants.md), plus bytes per second for
//!   the write benchmarks;
//! - `target/lockstep/bench-latency.svg` (copied to `docs/bench/latency.svg`):
//!   latency against process count, one line per strategy;
//! - `docs/bench/results.md`: the tables, the machine, the date and the
//!   command;
//! - with `--readme`, the text between `<!-- bench:start -->` and
//!   `<!-- bench:end -->` in docs/status.md: the generated Results section.
//!
//! It prints the reporting contract's Markdown table.
//!
//! Baselines: a strategy's figure (`strategies/{measurement}/{strategy}/{shape}`)
//! is compared with `broadcast`'s figure for the same measurement and shape;
//! a WASM policy's figure with the same logic in native Rust.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};

use crate::chart::{self, Panel, Point};
use crate::network::Network;
use crate::scale::Scale;
use crate::stages::Stages;
use crate::util::{cargo, root, run, step};

/// One measured benchmark.
#[derive(Clone)]
struct Row {
    name: String,
    median_ns: f64,
    /// Bytes per iteration, for throughput benchmarks.
    bytes: Option<u64>,
    /// Elements (rows) per iteration, for throughput benchmarks.
    elements: Option<u64>,
}

/// A strategy benchmark's name, split.
struct StrategyId<'a> {
    measurement: &'a str,
    strategy: &'a str,
    processes: u32,
    workers: u32,
}

/// The strategy baseline: `broadcast`, Materialize's way.
const BASELINE_STRATEGY: &str = "broadcast";
/// The strategies in report order (`log@postgres`: the log strategy with
/// its command log in PostgreSQL).
const STRATEGIES: [&str; 5] = ["broadcast", "barrier", "log", "naive", "log@postgres"];
/// The strategy measurements in report order, with their descriptions.
const MEASUREMENTS: [(&str, &str); 9] = [
    (
        "small_command",
        "small command until every worker applied it",
    ),
    ("peek", "peek of 100 rows"),
    ("install", "dataflow install until its frontier passes"),
    (
        "write_1KiB",
        "WriteInput of 1 KiB until the frontier passes",
    ),
    (
        "write_64KiB",
        "WriteInput of 64 KiB until the frontier passes",
    ),
    (
        "write_1MiB",
        "WriteInput of 1 MiB until the frontier passes",
    ),
    (
        "reconcile_10",
        "reconciliation of 10 dataflows after a controller restart",
    ),
    ("reconcile_100", "the same, 100 dataflows"),
    ("reconcile_1000", "the same, 1,000 dataflows"),
];
/// The marker pair `--readme` replaces the text between.
const README_START: &str = "<!-- bench:start -->";
const README_END: &str = "<!-- bench:end -->";

fn parse_strategy_id(name: &str) -> Option<StrategyId<'_>> {
    let mut parts = name.split('/');
    if parts.next()? != "strategies" {
        return None;
    }
    let measurement = parts.next()?;
    let strategy = parts.next()?;
    let (p, w) = parts.next()?.split_once('x')?;
    if parts.next().is_some() {
        return None;
    }
    Some(StrategyId {
        measurement,
        strategy,
        processes: p.parse().ok()?,
        workers: w.parse().ok()?,
    })
}

fn collect(dir: &Path, out: &mut Vec<Row>) -> anyhow::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if !path.is_dir() {
            continue;
        }
        let meta = path.join("new/benchmark.json");
        let est = path.join("new/estimates.json");
        if meta.exists() && est.exists() {
            let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&meta)?)?;
            let est: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&est)?)?;
            let name = meta["full_id"].as_str().unwrap_or_default().to_string();
            let median_ns = est["median"]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            let bytes = meta["throughput"]["Bytes"].as_u64();
            let elements = meta["throughput"]["Elements"].as_u64();
            out.push(Row {
                name,
                median_ns,
                bytes,
                elements,
            });
        } else {
            collect(&path, out)?;
        }
    }
    Ok(())
}

/// The benchmark `name` is compared with, if any.
fn baseline_of(name: &str) -> Option<String> {
    if let Some(id) = parse_strategy_id(name) {
        if id.strategy == BASELINE_STRATEGY {
            return None;
        }
        // A strategy on another store against itself on SQLite.
        let baseline = id
            .strategy
            .split_once('@')
            .map_or(BASELINE_STRATEGY, |(s, _)| s);
        return Some(format!(
            "strategies/{}/{baseline}/{}x{}",
            id.measurement, id.processes, id.workers
        ));
    }
    // The catalog on PostgreSQL against SQLite.
    if let Some(rest) = name.strip_prefix("stores/") {
        let (m, store) = rest.rsplit_once('/')?;
        return (store != "sqlite").then(|| format!("stores/{m}/sqlite"));
    }
    if name.contains("wasm") {
        return Some(name.replace("wasm", "native"));
    }
    // The user path against the core path (the same operation called in
    // process), and the core path's ingest against its like-for-like floor
    // (differential on the same 2x2 shape).
    if let Some(rest) = name.strip_prefix("api/") {
        let (m, path) = rest.rsplit_once('/')?;
        return match path {
            "grpc" => Some(format!("api/{m}/core")),
            "core" if m.starts_with("ingest") => Some(format!("api/{m}/floor_2x2")),
            _ => None,
        };
    }
    // How broadcast orders commands: the replica's exchange against
    // timely's Sequencer.
    if let Some(rest) = name.strip_prefix("sequencing/exchange/") {
        return Some(format!("sequencing/sequencer/{rest}"));
    }
    None
}

/// A duration in nanoseconds, for people.
pub fn human(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// `n` with commas between groups of three digits.
fn group_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn mib_per_s(bytes: u64, ns: f64) -> f64 {
    bytes as f64 / (ns / 1e9) / (1024.0 * 1024.0)
}

/// The measured figures of one run, with their baselines.
struct Report {
    rows: Vec<Row>,
    medians: BTreeMap<String, f64>,
    /// The network bench's wire counts (`$LOCKSTEP_BENCH_WIRE`'s lines).
    wire: String,
    /// The instruction counts (`instructions/{measurement}/{strategy}/{shape}`).
    instructions: Vec<Instructions>,
}

/// One instruction count: `benches/src/bin/instructions.rs`'s figure.
#[derive(serde::Deserialize)]
struct Instructions {
    name: String,
    instructions_per_op: u64,
    ops: u64,
}

impl Report {
    fn new(mut rows: Vec<Row>, wire: String, instructions: Vec<Instructions>) -> Report {
        rows.sort_by(|a, b| a.name.cmp(&b.name));
        let medians = rows.iter().map(|r| (r.name.clone(), r.median_ns)).collect();
        Report {
            rows,
            medians,
            wire,
            instructions,
        }
    }

    /// The instruction counts beside the wall-clock medians of the same
    /// operations in the same run.
    fn instructions_table(&self) -> String {
        let mut t = String::from(
            "| operation | strategy | shape | instructions per operation | wall-clock median |\n\
             | --- | --- | --- | ---: | ---: |\n",
        );
        for i in &self.instructions {
            let mut parts = i.name.split('/').skip(1);
            let (Some(m), Some(strategy), Some(shape)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let wall = self
                .medians
                .get(&format!("strategies/{m}/{strategy}/{shape}"))
                .map(|ns| human(*ns))
                .unwrap_or_else(|| "-".into());
            t.push_str(&format!(
                "| {m} | {strategy} | {shape} | {} | {wall} |\n",
                group_thousands(i.instructions_per_op)
            ));
        }
        t
    }

    /// The network bench's figures.
    fn network(&self) -> Network {
        Network::new(&self.medians, &self.wire)
    }

    /// The scale bench's figures.
    fn scale(&self) -> Scale<'_> {
        Scale::new(&self.medians)
    }

    /// The network and scale sections, if measured: with `## ` headings
    /// and charts beside results.md, or as README paragraphs with charts
    /// under `docs/bench/`.
    fn network_and_scale(&self, readme: bool) -> String {
        let mut s = String::new();
        let dir = if readme { "bench/" } else { "" };
        let network = self.network();
        if !network.is_empty() {
            s.push_str(if readme {
                "\nOver a modelled network (every connection delayed by a relay):\n\n"
            } else {
                "\n## Over a modelled network\n\n"
            });
            s.push_str(&format!(
                "![Latency against one-way delay, per strategy]({dir}network.svg)\n\n"
            ));
            s.push_str(&network.section());
        }
        let scale = self.scale();
        if !scale.is_empty() {
            s.push_str(if readme {
                "\nScale sweeps and ratios to the limit:\n\n"
            } else {
                "\n## Scale and limits\n\n"
            });
            s.push_str(&format!("![Scale sweeps]({dir}scale.svg)\n\n"));
            s.push_str(&scale.section());
        }
        s
    }

    /// A measured baseline of `name` and the ratio to it.
    fn ratio(&self, name: &str) -> Option<(String, f64)> {
        let base = baseline_of(name)?;
        let b = *self.medians.get(&base)?;
        Some((base, self.medians[name] / b))
    }

    fn json(&self) -> serde_json::Value {
        let objs: Vec<serde_json::Value> =
            self.rows
                .iter()
                .map(|r| {
                    let mut obj = serde_json::json!({ "name": r.name, "median_ns": r.median_ns });
                    if let Some((b, x)) = self.ratio(&r.name) {
                        obj["baseline"] = serde_json::json!(b);
                        obj["ratio"] = serde_json::json!(x);
                    }
                    if let Some(bytes) = r.bytes {
                        obj["bytes"] = serde_json::json!(bytes);
                        obj["mib_per_s"] = serde_json::json!(mib_per_s(bytes, r.median_ns));
                    }
                    if let Some(n) = r.elements {
                        obj["rows"] = serde_json::json!(n);
                        obj["rows_per_s"] = serde_json::json!(n as f64 / (r.median_ns / 1e9));
                    }
                    obj
                })
                .chain(self.instructions.iter().map(|i| {
                    serde_json::json!({
                        "name": i.name,
                        "instructions_per_op": i.instructions_per_op,
                        "ops": i.ops,
                    })
                }))
                .chain(self.all_goals().into_iter().enumerate().map(
                    |(i, (goal, measured, met))| {
                        serde_json::json!({
                            "name": format!("goals/{:02}", i + 1),
                            "goal": goal,
                            "measured": measured,
                            "met": met,
                        })
                    },
                ))
                .collect();
        serde_json::Value::Array(objs)
    }

    /// The reporting contract's table: every benchmark, its median, its
    /// baseline and the ratio.
    fn contract_table(&self, filter: impl Fn(&str) -> bool) -> String {
        let mut t = String::from(
            "| benchmark | median | baseline | ratio |\n| --- | ---: | --- | ---: |\n",
        );
        for r in self.rows.iter().filter(|r| filter(&r.name)) {
            let (base, ratio) = match self.ratio(&r.name) {
                Some((b, x)) => (b, format!("{x:.2}x")),
                None => ("-".into(), "-".into()),
            };
            let mut median = human(r.median_ns);
            if let Some(bytes) = r.bytes {
                median.push_str(&format!(" ({:.1} MiB/s)", mib_per_s(bytes, r.median_ns)));
            }
            if let Some(n) = r.elements {
                median.push_str(&format!(" ({:.0}k rows/s)", n as f64 / (r.median_ns / 1e6)));
            }
            t.push_str(&format!("| {} | {median} | {base} | {ratio} |\n", r.name));
        }
        t
    }

    /// The strategies that have at least one figure, in report order.
    fn strategies(&self) -> Vec<&'static str> {
        STRATEGIES
            .into_iter()
            .filter(|s| {
                self.rows
                    .iter()
                    .any(|r| parse_strategy_id(&r.name).is_some_and(|id| id.strategy == *s))
            })
            .collect()
    }

    /// The shapes measured, ordered by workers in all, then processes.
    fn shapes(&self) -> Vec<(u32, u32)> {
        let mut shapes: Vec<(u32, u32)> = self
            .rows
            .iter()
            .filter_map(|r| parse_strategy_id(&r.name).map(|id| (id.processes, id.workers)))
            .collect();
        shapes.sort_by_key(|&(p, w)| (p * w, p));
        shapes.dedup();
        shapes
    }

    /// One row per measurement and shape, one column per strategy: the
    /// median and, in brackets, the ratio to broadcast.
    fn strategy_table(&self, only_shape: Option<(u32, u32)>) -> String {
        let strategies = self.strategies();
        if strategies.is_empty() {
            return "No strategy was measured.\n".into();
        }
        let mut t = String::from("| measurement | shape |");
        for s in &strategies {
            t.push_str(&format!(" {s} |"));
        }
        t.push_str("\n| --- | --- |");
        for _ in &strategies {
            t.push_str(" ---: |");
        }
        t.push('\n');
        for (m, _) in MEASUREMENTS {
            for (p, w) in self.shapes() {
                if only_shape.is_some_and(|s| s != (p, w)) {
                    continue;
                }
                let mut line = format!("| {m} | {p}x{w} |");
                let mut any = false;
                for s in &strategies {
                    let name = format!("strategies/{m}/{s}/{p}x{w}");
                    match self.medians.get(&name) {
                        Some(&ns) => {
                            any = true;
                            line.push_str(&format!(" {}", human(ns)));
                            if let Some((_, x)) = self.ratio(&name) {
                                line.push_str(&format!(" ({x:.2}x)"));
                            }
                            line.push_str(" |");
                        }
                        None => line.push_str(" - |"),
                    }
                }
                if any {
                    t.push_str(&line);
                    t.push('\n');
                }
            }
        }
        t
    }

    fn panel(&self, measurement: &str, title: &str) -> Panel {
        let points = self
            .rows
            .iter()
            .filter_map(|r| {
                let id = parse_strategy_id(&r.name)?;
                (id.measurement == measurement).then(|| Point {
                    strategy: id.strategy.to_string(),
                    processes: id.processes,
                    workers: id.workers,
                    median_ns: r.median_ns,
                })
            })
            .collect();
        Panel {
            title: title.into(),
            x_label: "processes".into(),
            points,
        }
    }
}

/// How a goal is measured.
enum GoalFigure {
    /// One benchmark's median, against a bound in nanoseconds.
    Median(&'static str, f64),
    /// The largest, over the shapes, of `measurement`'s ratio of the first
    /// strategy to the second, against a bound.
    WorstRatio(&'static str, &'static str, &'static str, f64),
    /// The largest median of `measurement`, over strategies and shapes,
    /// against a bound in nanoseconds.
    WorstMedian(&'static str, f64),
    /// The ratio of one benchmark's median to another's, against a bound.
    Ratio(&'static str, &'static str, f64),
    /// The largest, over `strategies`, of `measurement`'s median on shape
    /// `PxW` over its floor (the sum of the medians named), against a
    /// bound: the cost against what the machine itself costs for the same
    /// bytes, measured in the same run (`benches/benches/floors.rs`,
    /// `stores.rs`).
    FloorRatio {
        measurement: &'static str,
        strategies: &'static [&'static str],
        shape: &'static str,
        floor: &'static [&'static str],
        bound: f64,
    },
}

/// The strategies whose floor is the wire and timely alone: broadcast and
/// barrier (naive is the negative control; `log` and `log@postgres` add
/// their store to the floor, in goals of their own).
const WIRE_STRATEGIES: &[&str] = &["broadcast", "barrier"];

/// The issues' goals that this suite measures.
const GOALS: [(&str, GoalFigure); 19] = [
    (
        "a 2x2 replica is ready (Hello answered) in under 100 ms",
        GoalFigure::Median("replica/start_2x2_to_hello_answered", 100e6),
    ),
    (
        "create, peek and drop of a small dataflow in under 2 ms",
        GoalFigure::Median("replica/create_peek_drop_small_dataflow", 2e6),
    ),
    (
        "barrier install within 1.5x of naive",
        GoalFigure::WorstRatio("install", "barrier", "naive", 1.5),
    ),
    (
        "small command within 1.5x of its floor at 1x1 (a loopback round trip of its frame)",
        GoalFigure::FloorRatio {
            measurement: "small_command",
            strategies: WIRE_STRATEGIES,
            shape: "1x1",
            floor: &["floors/tcp_round_trip/small/1"],
            bound: 1.5,
        },
    ),
    (
        "small command within 2x of its floor at 2x2 (round trips to 2 processes at once)",
        GoalFigure::FloorRatio {
            measurement: "small_command",
            strategies: WIRE_STRATEGIES,
            shape: "2x2",
            floor: &["floors/tcp_round_trip/small/2"],
            bound: 2.0,
        },
    ),
    (
        "install within 1.5x of its floor at 1x1 (a round trip of its frame + timely's own build)",
        GoalFigure::FloorRatio {
            measurement: "install",
            strategies: WIRE_STRATEGIES,
            shape: "1x1",
            floor: &[
                "floors/tcp_round_trip/install/1",
                "limits/install/timely/1x1",
            ],
            bound: 1.5,
        },
    ),
    (
        "install within 2x of its floor at 2x2 (round trips to 2 processes + timely's own build on a 2x2 cluster)",
        GoalFigure::FloorRatio {
            measurement: "install",
            strategies: WIRE_STRATEGIES,
            shape: "2x2",
            floor: &[
                "floors/tcp_round_trip/install/2",
                "limits/install/timely/2x2",
            ],
            bound: 2.0,
        },
    ),
    (
        "log small command within 1.5x of its floor at 1x1 (a round trip + a SQLite append read back)",
        GoalFigure::FloorRatio {
            measurement: "small_command",
            strategies: &["log"],
            shape: "1x1",
            floor: &[
                "floors/tcp_round_trip/small/1",
                "stores/log_append_read/sqlite",
            ],
            bound: 1.5,
        },
    ),
    (
        "log@postgres small command within 2x of its floor at 1x1 (a round trip + the server's fenced insert read back)",
        GoalFigure::FloorRatio {
            measurement: "small_command",
            strategies: &["log@postgres"],
            shape: "1x1",
            floor: &[
                "floors/tcp_round_trip/small/1",
                "stores/fenced_insert_read/postgres",
            ],
            bound: 2.0,
        },
    ),
    (
        "1,000 unchanged dataflows reconciled in under 2 s, none rebuilt",
        GoalFigure::WorstMedian("reconcile_1000", 2e9),
    ),
    (
        "a WASM distribution decision in at most 1 µs",
        GoalFigure::Median("policy/choose_wasm", 1e3),
    ),
    (
        "classifying 10,000 services (WASM) in under 10 ms",
        GoalFigure::Median("policy/classify_10000_wasm", 10e6),
    ),
    (
        "loading a policy cold in under 50 ms",
        GoalFigure::Median("policy/load_cold", 50e6),
    ),
    (
        "API: Peek of 100 rows, p50 at most 2 ms",
        GoalFigure::Median("api/peek_100/grpc", 2e6),
    ),
    (
        "API: WriteInput of 100 rows, p50 at most 3 ms",
        GoalFigure::Median("api/write_100/grpc", 3e6),
    ),
    (
        "API: ingest in 10k-row batches at 500k rows/s or more (a batch in at most 20 ms)",
        GoalFigure::Median("api/ingest_10k/grpc", 20e6),
    ),
    (
        "API peek within 2x of the core path",
        GoalFigure::Ratio("api/peek_100/grpc", "api/peek_100/core", 2.0),
    ),
    (
        "API write within 2x of the core path",
        GoalFigure::Ratio("api/write_100/grpc", "api/write_100/core", 2.0),
    ),
    (
        "API ingest within 2x of the core path",
        GoalFigure::Ratio("api/ingest_10k/grpc", "api/ingest_10k/core", 2.0),
    ),
];

impl Report {
    /// The goals table: each goal, what was measured, and whether it is met.
    fn goals_table(&self) -> String {
        let mut t = String::from("| goal | measured | met |\n| --- | --- | --- |\n");
        for (goal, measured, met) in self.all_goals() {
            let met = match met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "-",
            };
            t.push_str(&format!("| {goal} | {measured} | {met} |\n"));
        }
        t
    }

    /// Every goal row of the report: [`GOALS`], the network's, the scale
    /// sweeps' and the stages'.
    fn all_goals(&self) -> Vec<(String, String, Option<bool>)> {
        let mut goals = self.goals();
        goals.extend(self.network().goals());
        goals.extend(self.scale().goals());
        goals.extend(Stages::new(&self.medians).goals());
        goals
    }

    /// The goals of [`GOALS`]: goal, what was measured, met.
    fn goals(&self) -> Vec<(String, String, Option<bool>)> {
        let mut out = Vec::new();
        for (goal, figure) in &GOALS {
            let (measured, met) = match figure {
                GoalFigure::Median(name, bound) => match self.medians.get(*name) {
                    Some(&ns) => (format!("{} (`{name}`)", human(ns)), Some(ns <= *bound)),
                    None => ("not measured".into(), None),
                },
                GoalFigure::WorstRatio(m, a, b, bound) => {
                    let worst = self
                        .shapes()
                        .into_iter()
                        .filter_map(|(p, w)| {
                            let x = self.medians.get(&format!("strategies/{m}/{a}/{p}x{w}"))?;
                            let y = self.medians.get(&format!("strategies/{m}/{b}/{p}x{w}"))?;
                            Some((x / y, p, w))
                        })
                        .max_by(|x, y| x.0.total_cmp(&y.0));
                    match worst {
                        Some((r, p, w)) => (
                            format!("{r:.2}x at worst ({p}x{w}; {m}, {a} / {b})"),
                            Some(r <= *bound),
                        ),
                        None => ("not measured".into(), None),
                    }
                }
                GoalFigure::Ratio(a, b, bound) => {
                    match (self.medians.get(*a), self.medians.get(*b)) {
                        (Some(x), Some(y)) => {
                            let r = x / y;
                            (format!("{r:.2}x (`{a}` / `{b}`)"), Some(r <= *bound))
                        }
                        _ => ("not measured".into(), None),
                    }
                }
                GoalFigure::FloorRatio {
                    measurement,
                    strategies,
                    shape,
                    floor,
                    bound,
                } => {
                    let floor_ns: Option<f64> =
                        floor.iter().map(|f| self.medians.get(*f).copied()).sum();
                    let worst = strategies
                        .iter()
                        .filter_map(|s| {
                            let ns = self
                                .medians
                                .get(&format!("strategies/{measurement}/{s}/{shape}"))?;
                            Some((*s, ns))
                        })
                        .max_by(|x, y| x.1.total_cmp(y.1));
                    match (worst, floor_ns) {
                        (Some((s, ns)), Some(f)) => {
                            let r = ns / f;
                            let met = r <= *bound;
                            let bounded = if met {
                                String::new()
                            } else {
                                self.floor_bound(measurement, shape, floor, f)
                            };
                            (
                                format!(
                                    "{r:.2}x at worst ({s}: {} over a floor of {}){bounded}",
                                    human(*ns),
                                    human(f)
                                ),
                                Some(met),
                            )
                        }
                        _ => ("not measured".into(), None),
                    }
                }
                GoalFigure::WorstMedian(m, bound) => {
                    let worst = self
                        .rows
                        .iter()
                        .filter(|r| {
                            parse_strategy_id(&r.name).is_some_and(|id| id.measurement == *m)
                        })
                        .max_by(|x, y| x.median_ns.total_cmp(&y.median_ns));
                    match worst {
                        Some(r) => (
                            format!("{} at worst (`{}`)", human(r.median_ns), r.name),
                            Some(r.median_ns <= *bound),
                        ),
                        None => ("not measured".into(), None),
                    }
                }
            };
            out.push((goal.to_string(), measured, met));
        }
        out
    }
}

impl Report {
    /// What bounds a missed floor goal, measured in the same run: the same
    /// measurement under `naive` (every strategy's path with no
    /// coordination at all: the controller's session, the process's
    /// connection and its workers' loop) plus the floor's store if it has
    /// one (naive has none), and the floor with the bare
    /// round trip replaced by `floors/worker_handoff` (the round trip to
    /// servers whose connection hands every frame to worker threads and
    /// back, as a replica process's does). Empty when neither was measured.
    fn floor_bound(&self, measurement: &str, shape: &str, floor: &[&str], floor_ns: f64) -> String {
        let mut parts = Vec::new();
        // Naive has no store: a floor's store (the log's) is added to it.
        let stores: Option<f64> = floor
            .iter()
            .filter(|f| f.starts_with("stores/"))
            .map(|f| self.medians.get(*f).copied())
            .sum();
        let naive = self
            .medians
            .get(&format!("strategies/{measurement}/naive/{shape}"));
        if let (Some(&naive), Some(stores)) = (naive, stores) {
            let plus = if stores > 0.0 {
                format!(" + the floor's store {}", human(stores))
            } else {
                String::new()
            };
            parts.push(format!(
                "the same under naive, which coordinates nothing{plus}, {} ({:.2}x the floor)",
                human(naive + stores),
                (naive + stores) / floor_ns
            ));
        }
        let frame = if measurement == "install" {
            "install"
        } else {
            "small"
        };
        let handoff = format!("floors/worker_handoff/{frame}/{shape}");
        let rest: Option<f64> = floor
            .iter()
            .filter(|f| !f.starts_with("floors/tcp_round_trip/"))
            .map(|f| self.medians.get(*f).copied())
            .sum();
        if let (Some(&h), Some(rest)) = (self.medians.get(&handoff), rest) {
            parts.push(format!(
                "the floor with each process's hand-off to its worker threads and back {} (`{handoff}`)",
                human(h + rest)
            ));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!("; bounded by: {}", parts.join("; "))
        }
    }
}

/// Facts about the machine and the tree, for the report.
struct Machine {
    cores: String,
    kernel: String,
    cpu: String,
    date: String,
    commit: String,
}

fn output(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

impl Machine {
    fn probe() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let mut commit = output("git", &["rev-parse", "--short", "HEAD"]);
        // The report's own outputs do not count as changes to what was measured.
        let changed = output(
            "git",
            &[
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!README.md",
                ":!docs/status.md",
                ":!docs",
            ],
        );
        if !changed.is_empty() {
            commit.push_str(" (with uncommitted changes)");
        }
        Machine {
            cores: output("nproc", &[]),
            kernel: output("uname", &["-sr"]),
            cpu,
            date: output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            commit,
        }
    }
}

/// What one run was: how it was invoked and how long it took.
struct RunInfo {
    command: String,
    quick: bool,
    wall_secs: f64,
    skipped: Vec<String>,
}

fn machine_paragraph(m: &Machine, run: &RunInfo) -> String {
    format!(
        "One run of `{}` on {}: {} cores ({}), {}, commit {}. It took {:.0} s of wall time, \
         building included. {} The machine is shared, so read ratios measured in the same run \
         rather than absolute figures.\n",
        run.command,
        m.date,
        m.cores,
        m.cpu,
        m.kernel,
        m.commit,
        run.wall_secs,
        if run.quick {
            "Strategy figures are criterion medians of 10 samples after 0.3 s of warm-up and \
             1 s of measurement each (quick mode); the rest had 0.5 s of warm-up and 1 s of \
             measurement."
        } else {
            "Strategy figures are criterion medians of 20 samples after 1 s of warm-up and 3 s \
             of measurement each."
        }
    )
}

fn skipped_paragraph(run: &RunInfo) -> String {
    if run.skipped.is_empty() {
        return String::new();
    }
    let mut s = String::from(
        "Where a strategy failed on a shape, the suite reported it, kept the figures measured \
         before the failure and went on with the next one. Failures in this run:\n\n",
    );
    for line in &run.skipped {
        let mut parts = line.splitn(3, '\t');
        let strategy = parts.next().unwrap_or("?");
        let shape = parts.next().unwrap_or("?");
        let why = parts.next().unwrap_or("?");
        s.push_str(&format!("- `{strategy}` on {shape}: {why}\n"));
    }
    s.push('\n');
    s
}

const HOW_TO_READ: &str = "Each strategy figure is `median (ratio to broadcast)` for the same \
measurement on the same replica shape (processes x workers per process), every replica a set \
of real OS processes on this machine (`log@postgres`: the log strategy with its command log in \
a PostgreSQL server on this machine; its ratio is to `log` on SQLite). Reconciliation figures are the time from starting a new \
controller at a new epoch until every worker reported a full status; every iteration checks \
that no dataflow was rebuilt (creation logs unchanged).";

const STORES: &str = "The same work on both stores, in one run: the catalog's fenced writes \
(`stores/…`, PostgreSQL against SQLite) and the log strategy with its command log in PostgreSQL \
(`log@postgres`, against `log` on a SQLite file). The PostgreSQL server runs on this machine, so \
these figures hold its round trips on loopback, not a network's.";

const INSTRUCTIONS: &str = "Instructions each operation executes in the replica's processes \
(summed over them), counted by valgrind's callgrind while the controller drives them from outside \
(`benches/src/bin/instructions.rs`): a regression figure the shared machine's load does not move, \
beside the wall-clock median of the same operation in this run. A count includes the processes' \
timer-driven polls while the operation runs (longer under callgrind): two runs agreed within \
about 10% (small commands at 1x1, about 35%). `cargo xtask bench --instructions` measures them \
alone.";

/// `docs/bench/results.md`: everything.
fn results_md(report: &Report, m: &Machine, run: &RunInfo) -> String {
    let mut s = String::from("# Benchmark results\n\n");
    s.push_str("Generated by `cargo xtask bench`; do not edit by hand.\n\n");
    s.push_str(&machine_paragraph(m, run));
    s.push_str(&format!(
        "\nTo reproduce: `{}`. The raw figures are in `target/lockstep/bench.json`.\n\n",
        run.command
    ));
    s.push_str("![Latency against process count, per strategy](latency.svg)\n\n");
    s.push_str("## Against the issues' goals\n\n");
    s.push_str(&report.goals_table());
    s.push_str("\n## Strategies\n\n");
    s.push_str(HOW_TO_READ);
    s.push_str("\n\n");
    for (m, what) in MEASUREMENTS {
        s.push_str(&format!("- `{m}`: {what}\n"));
    }
    s.push('\n');
    s.push_str(&skipped_paragraph(run));
    s.push_str(&report.strategy_table(None));
    s.push_str(&report.network_and_scale(false));
    if !report.instructions.is_empty() {
        s.push_str("\n## Instruction counts\n\n");
        s.push_str(INSTRUCTIONS);
        s.push_str("\n\n");
        s.push_str(&report.instructions_table());
    }
    let stages = Stages::new(&report.medians).section();
    if !stages.is_empty() {
        s.push_str("\n## Stages of a write\n\n");
        s.push_str(&stages);
    }
    s.push_str("\n## Stores\n\n");
    s.push_str(STORES);
    s.push_str("\n\n");
    s.push_str(&report.contract_table(|n| {
        n.starts_with("stores/") || parse_strategy_id(n).is_some_and(|id| id.strategy.contains('@'))
    }));
    s.push_str("\n## Every benchmark\n\n");
    s.push_str("The reporting contract's table (`target/lockstep/bench.json` holds the same).\n\n");
    s.push_str(&report.contract_table(|_| true));
    s
}

/// The README's Results section.
fn readme_section(report: &Report, m: &Machine, run: &RunInfo) -> String {
    let mut s = String::from("### Results\n\n");
    s.push_str(
        "<!-- Generated by `cargo xtask bench --readme` from one run; do not edit by hand. -->\n\n",
    );
    s.push_str(&machine_paragraph(m, run));
    s.push_str(&format!(
        "\nTo reproduce: `{}`. Every figure, for every shape, is in \
         [bench/results.md](bench/results.md).\n\n",
        run.command
    ));
    s.push_str("![Latency against process count, per strategy](bench/latency.svg)\n\n");
    s.push_str(HOW_TO_READ);
    s.push_str(" The table shows the 2x2 replica; the chart and results.md show every shape.\n\n");
    s.push_str(&skipped_paragraph(run));
    let shape = report
        .shapes()
        .into_iter()
        .find(|s| *s == (2, 2))
        .or_else(|| report.shapes().last().copied());
    s.push_str(&report.strategy_table(shape));
    s.push_str(&report.network_and_scale(true));
    s.push_str("\nAgainst the issues' goals:\n\n");
    s.push_str(&report.goals_table());
    s.push_str("\nPolicies, protocol and replica start:\n\n");
    s.push_str(&report.contract_table(|n| parse_strategy_id(n).is_none()));
    s
}

fn replace_between_markers(text: &str, section: &str) -> anyhow::Result<String> {
    let Some(start) = text.find(README_START) else {
        bail!("docs/status.md has no {README_START} marker");
    };
    let Some(end) = text[start..].find(README_END).map(|e| start + e) else {
        bail!("docs/status.md has no {README_END} marker after {README_START}");
    };
    Ok(format!(
        "{}{README_START}\n{}{}",
        &text[..start],
        section.trim_end().to_string() + "\n",
        &text[end..]
    ))
}

/// Builds what the benchmarks need, runs them, writes the report.
/// Counts instructions per operation (`benches/src/bin/instructions.rs`,
/// on the release replica, which must be built) into
/// `target/lockstep/instructions.json`; the counts, or why there are none.
fn instructions(quick: bool) -> Result<Vec<Instructions>, String> {
    let found = Command::new("valgrind").arg("--version").output();
    if found.is_err() {
        return Err("instruction counts: valgrind is not installed (Debian: valgrind)".into());
    }
    step(if quick {
        "instruction counts under callgrind (quick: 1x1)"
    } else {
        "instruction counts under callgrind (1x1, 2x2)"
    });
    let out = root().join("target/lockstep/instructions.json");
    let mut cmd = crate::util::cargo_run_release("lockstep-benches", "instructions");
    cmd.arg(&out);
    if quick {
        cmd.env("LOCKSTEP_BENCH_QUICK", "1");
    } else {
        cmd.env_remove("LOCKSTEP_BENCH_QUICK");
    }
    run(cmd).map_err(|e| format!("instruction counts: {e:#}"))?;
    let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", out.display()))
}

/// `cargo xtask bench --instructions`: the instruction counts alone.
pub fn instructions_only(quick: bool) -> anyhow::Result<()> {
    step("building the release replica");
    let mut cmd = cargo();
    cmd.args(["build", "--release", "--quiet", "-p", "lockstep-replica"]);
    run(cmd)?;
    let counts = instructions(quick).map_err(anyhow::Error::msg)?;
    let report = Report::new(Vec::new(), String::new(), counts);
    println!("\n{}", report.instructions_table());
    eprintln!("xtask: wrote target/lockstep/instructions.json");
    Ok(())
}

pub fn bench(quick: bool, readme: bool) -> anyhow::Result<()> {
    let started = Instant::now();
    step("building the release replica and the policies");
    let mut cmd = cargo();
    cmd.args(["build", "--release", "--quiet", "-p", "lockstep-replica"]);
    run(cmd)?;
    crate::policies::build_all()?;
    let criterion_dir = root().join("target/criterion");
    if criterion_dir.exists() {
        // Only this run's figures go into the report.
        std::fs::remove_dir_all(&criterion_dir).context("clearing old criterion results")?;
    }
    let out_dir = root().join("target/lockstep");
    std::fs::create_dir_all(&out_dir)?;
    let skips = out_dir.join("bench-skipped.tsv");
    let wire = out_dir.join("bench-wire.tsv");
    for f in [&skips, &wire] {
        if f.exists() {
            std::fs::remove_file(f)?;
        }
    }
    step(if quick {
        "criterion (quick)"
    } else {
        "criterion"
    });
    let mut cmd = cargo();
    cmd.args(["bench", "-p", "lockstep-benches", "--benches", "--"]);
    if quick {
        // The strategies bench sets its own shorter times (it reads
        // LOCKSTEP_BENCH_QUICK); these apply to the others.
        cmd.args(["--warm-up-time", "0.5", "--measurement-time", "1"]);
        cmd.env("LOCKSTEP_BENCH_QUICK", "1");
    } else {
        cmd.env_remove("LOCKSTEP_BENCH_QUICK");
    }
    cmd.env("LOCKSTEP_BENCH_SKIPS", &skips);
    cmd.env("LOCKSTEP_BENCH_WIRE", &wire);
    run(cmd)?;

    let mut skipped: Vec<String> = std::fs::read_to_string(&skips)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let counts = instructions(quick).unwrap_or_else(|why| {
        skipped.push(format!("(instruction counts)\tevery shape\t{why}"));
        Vec::new()
    });
    let mut rows = Vec::new();
    collect(&criterion_dir, &mut rows)?;
    let report = Report::new(
        rows,
        std::fs::read_to_string(&wire).unwrap_or_default(),
        counts,
    );
    let mut command = String::from("cargo xtask bench");
    if quick {
        command.push_str(" --quick");
    }
    if readme {
        command.push_str(" --readme");
    }
    let run_info = RunInfo {
        command,
        quick,
        wall_secs: started.elapsed().as_secs_f64(),
        skipped,
    };
    let machine = Machine::probe();

    let json_path = out_dir.join("bench.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report.json())?)?;

    let svg = chart::svg(
        "lockstep: latency against process count, per strategy",
        &format!(
            "{}, {} cores, {}",
            machine.date, machine.cores, run_info.command
        ),
        &[
            report.panel(
                "small_command",
                "small command until every worker applied it",
            ),
            report.panel("install", "dataflow install"),
            report.panel("peek", "peek of 100 rows"),
            report.panel("reconcile_1000", "reconciliation of 1,000 dataflows"),
        ],
    );
    let svg_path = out_dir.join("bench-latency.svg");
    std::fs::write(&svg_path, &svg)?;
    let docs = root().join("docs/bench");
    std::fs::create_dir_all(&docs)?;
    std::fs::write(docs.join("latency.svg"), &svg)?;
    let network = report.network();
    if !network.is_empty() {
        let svg = chart::svg(
            "lockstep: latency against one-way delay, per strategy",
            &format!(
                "{}, {} cores, {}; every connection through a delaying relay",
                machine.date, machine.cores, run_info.command
            ),
            &network.panels(),
        );
        std::fs::write(docs.join("network.svg"), &svg)?;
    }
    let scale = report.scale();
    if !scale.is_empty() {
        let svg = chart::svg(
            "lockstep: costs against scale (barrier)",
            &format!(
                "{}, {} cores, {}",
                machine.date, machine.cores, run_info.command
            ),
            &scale.panels(),
        );
        std::fs::write(docs.join("scale.svg"), &svg)?;
    }
    std::fs::write(
        docs.join("results.md"),
        results_md(&report, &machine, &run_info),
    )?;

    println!("\n{}", report.contract_table(|_| true));
    println!("{}", report.strategy_table(None));
    for line in &run_info.skipped {
        eprintln!("xtask: bench: not measured: {}", line.replace('\t', " "));
    }
    if readme {
        let path = root().join("docs/status.md");
        let text = std::fs::read_to_string(&path)?;
        let new = replace_between_markers(&text, &readme_section(&report, &machine, &run_info))?;
        std::fs::write(&path, new)?;
        eprintln!("xtask: bench: replaced the Results section of docs/status.md");
    }
    eprintln!(
        "xtask: wrote {} ({} benchmarks), {}, docs/bench/latency.svg and docs/bench/results.md in {:.0} s",
        json_path.display(),
        report.rows.len(),
        svg_path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_ids_parse_and_compare_with_broadcast() {
        let id = parse_strategy_id("strategies/write_1MiB/barrier/4x1").unwrap();
        assert_eq!(
            (id.measurement, id.strategy, id.processes, id.workers),
            ("write_1MiB", "barrier", 4, 1)
        );
        assert!(parse_strategy_id("replica/start_2x2_to_hello_answered").is_none());
        assert_eq!(
            baseline_of("strategies/peek/log/2x2").as_deref(),
            Some("strategies/peek/broadcast/2x2")
        );
        assert_eq!(baseline_of("strategies/peek/broadcast/2x2"), None);
        assert_eq!(
            baseline_of("policy/choose_wasm").as_deref(),
            Some("policy/choose_native")
        );
        assert_eq!(
            baseline_of("sequencing/exchange/1MiB").as_deref(),
            Some("sequencing/sequencer/1MiB")
        );
        assert_eq!(baseline_of("sequencing/sequencer/small"), None);
        assert_eq!(
            baseline_of("api/peek_100/grpc").as_deref(),
            Some("api/peek_100/core")
        );
        assert_eq!(
            baseline_of("api/ingest_10k/core").as_deref(),
            Some("api/ingest_10k/floor_2x2")
        );
        assert_eq!(baseline_of("api/peek_100/core"), None);
        assert_eq!(baseline_of("api/ingest_10k/differential"), None);
    }

    /// A benchmark's row with only its median.
    fn row(name: &str, ns: f64) -> Row {
        Row {
            name: name.into(),
            median_ns: ns,
            bytes: None,
            elements: None,
        }
    }

    #[test]
    fn goals_take_the_worst_shape() {
        let report = Report::new(
            vec![
                row("strategies/install/barrier/1x1", 120.0),
                row("strategies/install/naive/1x1", 100.0),
                row("strategies/install/barrier/2x2", 300.0),
                row("strategies/install/naive/2x2", 100.0),
                row("policy/load_cold", 10e6),
            ],
            String::new(),
            Vec::new(),
        );
        let t = report.goals_table();
        assert!(t.contains("| barrier install within 1.5x of naive | 3.00x at worst (2x2; install, barrier / naive) | **no** |"), "{t}");
        assert!(
            t.contains(
                "| loading a policy cold in under 50 ms | 10.00 ms (`policy/load_cold`) | yes |"
            ),
            "{t}"
        );
        assert!(t.contains("not measured | - |"), "{t}");
    }

    #[test]
    fn a_floor_goal_divides_the_worst_strategy_by_the_summed_floor() {
        let report = Report::new(
            vec![
                row("strategies/install/broadcast/1x1", 200e3),
                row("strategies/install/barrier/1x1", 300e3),
                row("strategies/install/naive/1x1", 900e3),
                row("strategies/install/log/1x1", 950e3),
                row("floors/tcp_round_trip/install/1", 80e3),
                row("limits/install/timely/1x1", 20e3),
                row("strategies/small_command/barrier/1x1", 100e3),
            ],
            String::new(),
            Vec::new(),
        );
        let t = report.goals_table();
        assert!(
            t.contains("| install within 1.5x of its floor at 1x1 (a round trip of its frame + timely's own build) | 3.00x at worst (barrier: 300.0 µs over a floor of 100.0 µs); bounded by: the same under naive, which coordinates nothing, 900.0 µs (9.00x the floor) | **no** |"),
            "{t}"
        );
        // With the hand-off measured, the bound adds timely's build to it.
        let mut rows = vec![
            row("strategies/install/barrier/1x1", 300e3),
            row("floors/tcp_round_trip/install/1", 80e3),
            row("floors/worker_handoff/install/1x1", 95e3),
            row("limits/install/timely/1x1", 20e3),
        ];
        let t = Report::new(rows.clone(), String::new(), Vec::new()).goals_table();
        assert!(
            t.contains("3.00x at worst (barrier: 300.0 µs over a floor of 100.0 µs); bounded by: the floor with each process's hand-off to its worker threads and back 115.0 µs (`floors/worker_handoff/install/1x1`) | **no** |"),
            "{t}"
        );
        // A log goal's naive bound adds the store naive does not pay.
        let t = Report::new(
            vec![
                row("strategies/small_command/log/1x1", 300e3),
                row("strategies/small_command/naive/1x1", 90e3),
                row("floors/tcp_round_trip/small/1", 60e3),
                row("stores/log_append_read/sqlite", 40e3),
            ],
            String::new(),
            Vec::new(),
        )
        .goals_table();
        assert!(
            t.contains("3.00x at worst (log: 300.0 µs over a floor of 100.0 µs); bounded by: the same under naive, which coordinates nothing + the floor's store 40.0 µs, 130.0 µs (1.30x the floor) | **no** |"),
            "{t}"
        );
        // A goal met names no bound.
        rows[0] = row("strategies/install/barrier/1x1", 120e3);
        let t = Report::new(rows, String::new(), Vec::new()).goals_table();
        assert!(
            t.contains("1.20x at worst (barrier: 120.0 µs over a floor of 100.0 µs) | yes |"),
            "{t}"
        );
        // No floor measured: not measured, neither met nor missed.
        assert!(
            t.contains("| small command within 1.5x of its floor at 1x1 (a loopback round trip of its frame) | not measured | - |"),
            "{t}"
        );
    }

    #[test]
    fn readme_markers_are_replaced_and_the_rest_kept() {
        let text = "a\n<!-- bench:start -->\nold\n<!-- bench:end -->\nb\n";
        let new = replace_between_markers(text, "### Results\n\nnew\n").unwrap();
        assert_eq!(
            new,
            "a\n<!-- bench:start -->\n### Results\n\nnew\n<!-- bench:end -->\nb\n"
        );
        assert!(replace_between_markers("no markers", "x").is_err());
    }

    #[test]
    fn instruction_counts_sit_beside_the_same_operations_wall_clock() {
        let report = Report::new(
            vec![row("strategies/install/barrier/1x1", 250e3)],
            String::new(),
            vec![
                Instructions {
                    name: "instructions/install/barrier/1x1".into(),
                    instructions_per_op: 1_234_567,
                    ops: 20,
                },
                Instructions {
                    name: "instructions/reconcile_100/barrier/1x1".into(),
                    instructions_per_op: 42,
                    ops: 1,
                },
            ],
        );
        let t = report.instructions_table();
        assert!(
            t.contains("| install | barrier | 1x1 | 1,234,567 | 250.0 µs |"),
            "{t}"
        );
        assert!(
            t.contains("| reconcile_100 | barrier | 1x1 | 42 | - |"),
            "{t}"
        );
        let json = report.json();
        assert!(
            json.as_array()
                .unwrap()
                .iter()
                .any(|o| o["name"] == "instructions/install/barrier/1x1"
                    && o["instructions_per_op"] == 1_234_567),
            "{json}"
        );
    }

    #[test]
    fn bench_json_holds_every_goal_row_of_the_report() {
        let report = Report::new(
            vec![
                row("policy/choose_wasm", 300.0),
                row("policy/load_cold", 60e6),
            ],
            String::new(),
            Vec::new(),
        );
        let json = report.json();
        let goals: Vec<&serde_json::Value> = json
            .as_array()
            .unwrap()
            .iter()
            .filter(|o| o["name"].as_str().unwrap().starts_with("goals/"))
            .collect();
        assert_eq!(goals.len(), report.all_goals().len());
        let goal = |text: &str| {
            goals
                .iter()
                .find(|o| o["goal"].as_str().unwrap().starts_with(text))
                .unwrap_or_else(|| panic!("no goal {text} in {json}"))
        };
        assert_eq!(goal("a WASM distribution decision")["met"], true);
        assert_eq!(goal("loading a policy cold")["met"], false);
        assert_eq!(
            goal("a 2x2 replica is ready")["met"],
            serde_json::Value::Null
        );
    }
}
