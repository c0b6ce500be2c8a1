//! The network-model part of `cargo xtask bench`'s report: the `network`
//! bench's latencies against one-way delay, the fitted number of delays on
//! each operation's critical path, the ratios to the hop-count limits, the
//! relay's own cost and the bytes a write puts on the wire per process.

use std::collections::BTreeMap;

use crate::bench::human;
use crate::chart::{Panel, Point};

/// The strategies of the network bench, in report order.
const STRATEGIES: [&str; 4] = ["broadcast", "barrier", "naive", "log"];
/// The delays swept, in microseconds.
const DELAYS_US: [u64; 4] = [0, 100, 250, 500];
/// The measurements, with what they are.
const MEASUREMENTS: [(&str, &str); 3] = [
    ("small_command", "small command until every worker answered"),
    ("install", "dataflow install until its frontier passes 0"),
    (
        "write_1MiB",
        "1 MiB write until a dataflow's frontier passes it",
    ),
];

/// One-way delays on a small command's critical path, by strategy: a
/// sequencer (broadcast) takes controller → worker 0 → mesh → every worker
/// → answer; the symmetric strategies controller → every worker → answer.
/// The log's store is on this machine, so its round trip is not delayed.
fn small_command_hops(strategy: &str) -> Option<f64> {
    match strategy {
        "broadcast" => Some(3.0),
        "barrier" | "naive" | "log" => Some(2.0),
        _ => None,
    }
}

/// A network benchmark's name, split: `network/{m}/{strategy}/{shape}/{point}`.
struct NetId<'a> {
    measurement: &'a str,
    strategy: &'a str,
    shape: &'a str,
    /// The delay in µs, or `None` for `direct` (no relays).
    delay_us: Option<u64>,
}

fn parse(name: &str) -> Option<NetId<'_>> {
    let mut parts = name.split('/');
    if parts.next()? != "network" {
        return None;
    }
    let measurement = parts.next()?;
    let strategy = parts.next()?;
    let shape = parts.next()?;
    let point = parts.next()?;
    let delay_us = match point {
        "direct" => None,
        p => Some(p.strip_suffix("us")?.parse().ok()?),
    };
    Some(NetId {
        measurement,
        strategy,
        shape,
        delay_us,
    })
}

/// The medians of the network bench, by (measurement, strategy, delay).
pub struct Network {
    shape: String,
    points: BTreeMap<(String, String, Option<u64>), f64>,
    tcp: BTreeMap<String, f64>,
    /// `strategy -> (process -> bytes from the controller)`, and the mesh
    /// total and the batch's bytes of row data.
    wire: BTreeMap<String, (Vec<u64>, u64, u64)>,
}

impl Network {
    /// The network figures among `medians`, with the wire counts
    /// (`$LOCKSTEP_BENCH_WIRE`'s lines).
    pub fn new(medians: &BTreeMap<String, f64>, wire: &str) -> Network {
        let mut shape = String::new();
        let mut points = BTreeMap::new();
        let mut tcp = BTreeMap::new();
        for (name, &ns) in medians {
            if let Some(point) = name.strip_prefix("network/tcp_rtt/") {
                tcp.insert(point.to_string(), ns);
            } else if let Some(id) = parse(name) {
                shape = id.shape.to_string();
                points.insert((id.measurement.into(), id.strategy.into(), id.delay_us), ns);
            }
        }
        let mut counts: BTreeMap<String, (Vec<u64>, u64, u64)> = BTreeMap::new();
        for line in wire.lines() {
            let f: Vec<&str> = line.split('\t').collect();
            if let [strategy, _shape, _process, sent, mesh, batch] = f[..] {
                let e = counts.entry(strategy.to_string()).or_default();
                e.0.push(sent.parse().unwrap_or(0));
                e.1 += mesh.parse::<u64>().unwrap_or(0);
                e.2 = batch.parse().unwrap_or(0);
            }
        }
        Network {
            shape,
            points,
            tcp,
            wire: counts,
        }
    }

    /// Whether the network bench ran.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty() && self.tcp.is_empty()
    }

    fn get(&self, m: &str, s: &str, d: Option<u64>) -> Option<f64> {
        self.points.get(&(m.into(), s.into(), d)).copied()
    }

    /// The least-squares slope of latency against one-way delay: the number
    /// of delays on the critical path. Needs every delay point.
    fn slope(&self, m: &str, s: &str) -> Option<f64> {
        let pts: Vec<(f64, f64)> = DELAYS_US
            .iter()
            .map(|&d| Some((d as f64 * 1e3, self.get(m, s, Some(d))?)))
            .collect::<Option<_>>()?;
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        Some(sxy / sxx)
    }

    /// The chart's panels: latency against delay, one line per strategy.
    pub fn panels(&self) -> Vec<Panel> {
        MEASUREMENTS
            .iter()
            .map(|(m, what)| Panel {
                title: format!("{what} ({})", self.shape),
                x_label: "one-way delay (µs)".into(),
                points: self
                    .points
                    .iter()
                    .filter(|((pm, _, d), _)| pm == m && d.is_some())
                    .map(|((_, s, d), &ns)| Point {
                        strategy: s.clone(),
                        processes: d.unwrap_or(0) as u32,
                        workers: 1,
                        median_ns: ns,
                    })
                    .collect(),
            })
            .collect()
    }

    /// The report section.
    pub fn section(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "Every connection of a {} replica (controller to process, and process to process \
             on the timely mesh) goes through a relay that holds each chunk for the one-way \
             delay (`benches/src/relay.rs`; the kernel has no netem). One replica per strategy \
             is measured at each delay. `hops` is the least-squares slope of latency against \
             delay: the number of one-way delays on the operation's critical path. The figures \
             are `median (ratio to broadcast at the same delay)`.\n\n",
            self.shape
        ));
        for (m, what) in MEASUREMENTS {
            s.push_str(&format!("`{m}`: {what}.\n\n| strategy |"));
            for d in DELAYS_US {
                s.push_str(&format!(" {d} µs |"));
            }
            s.push_str(" hops |\n| --- |");
            for _ in DELAYS_US {
                s.push_str(" ---: |");
            }
            s.push_str(" ---: |\n");
            for st in STRATEGIES {
                if DELAYS_US
                    .iter()
                    .all(|&d| self.get(m, st, Some(d)).is_none())
                {
                    continue;
                }
                s.push_str(&format!("| {st} |"));
                for d in DELAYS_US {
                    match self.get(m, st, Some(d)) {
                        Some(ns) => {
                            s.push_str(&format!(" {}", human(ns)));
                            if st != "broadcast" {
                                if let Some(b) = self.get(m, "broadcast", Some(d)) {
                                    s.push_str(&format!(" ({:.2}x)", ns / b));
                                }
                            }
                            s.push_str(" |");
                        }
                        None => s.push_str(" - |"),
                    }
                }
                match self.slope(m, st) {
                    Some(h) => s.push_str(&format!(" {h:.2} |\n")),
                    None => s.push_str(" - |\n"),
                }
            }
            s.push('\n');
        }
        s.push_str(&self.limits_paragraph());
        s.push_str(&self.overhead_paragraph());
        s.push_str(&self.wire_paragraph());
        s
    }

    /// The small command's measured hops beside the hop-count limit.
    fn limits_paragraph(&self) -> String {
        let mut s = String::from(
            "Hop-count limits for the small command (one-way delays on the critical path): \
             a sequencer needs 3 (controller to worker 0, worker 0 to the others, answers \
             back), a symmetric send 2; the latency ratio of a symmetric strategy to broadcast \
             tends to 2/3 as the delay grows.\n\n\
             | strategy | limit | measured hops | ratio to broadcast at 250 µs | at 500 µs |\n\
             | --- | ---: | ---: | ---: | ---: |\n",
        );
        for st in STRATEGIES {
            let Some(limit) = small_command_hops(st) else {
                continue;
            };
            let Some(h) = self.slope("small_command", st) else {
                continue;
            };
            let ratio = |d| -> String {
                match (
                    self.get("small_command", st, Some(d)),
                    self.get("small_command", "broadcast", Some(d)),
                ) {
                    (Some(x), Some(b)) => format!("{:.2}x", x / b),
                    _ => "-".into(),
                }
            };
            s.push_str(&format!(
                "| {st} | {limit:.0} | {h:.2} | {} | {} |\n",
                ratio(250),
                ratio(500)
            ));
        }
        s.push_str(
            "\nInstall adds the barrier round (barrier: one all-to-all exchange on the mesh \
             before the dataflow is built) and timely's own progress exchange before the \
             frontier passes 0; the log strategy's store round trip stays on this machine \
             (a SQLite file), so it adds no delay here.\n\n",
        );
        s
    }

    fn overhead_paragraph(&self) -> String {
        let mut s = String::new();
        if let (Some(direct), Some(zero)) = (self.tcp.get("direct"), self.tcp.get("0us")) {
            s.push_str(&format!(
                "The relay's own cost: a 64-byte TCP round trip takes {} directly and {} \
                 through a relay at 0 µs (+{} for two relayed hops)",
                human(*direct),
                human(*zero),
                human(zero - direct)
            ));
            let at: Vec<String> = DELAYS_US[1..]
                .iter()
                .filter_map(|d| {
                    let ns = self.tcp.get(&format!("{d}us"))?;
                    Some(format!(
                        "{} at {d} µs (2 x {d} µs = {} µs)",
                        human(*ns),
                        2 * d
                    ))
                })
                .collect();
            if !at.is_empty() {
                s.push_str(&format!("; {}", at.join(", ")));
            }
            s.push_str(".\n");
        }
        for (m, _) in MEASUREMENTS {
            if let (Some(direct), Some(zero)) = (
                self.get(m, "broadcast", None),
                self.get(m, "broadcast", Some(0)),
            ) {
                s.push_str(&format!(
                    "Broadcast `{m}` without relays: {}, with relays at 0 µs: {} ({:.2}x).\n",
                    human(direct),
                    human(zero),
                    zero / direct
                ));
            }
        }
        s.push('\n');
        s
    }

    fn wire_paragraph(&self) -> String {
        if self.wire.is_empty() {
            return String::new();
        }
        let mut s = String::from(
            "Bytes on the wire for one 1 MiB write (1,048,576 bytes of row data; the batch is \
             the encoded size of the whole write, what one unsplit copy takes), counted on the \
             relays: what the controller sent each process, and what the processes sent each \
             other on the mesh (for every strategy this includes the dataflow's own exchange \
             of rows to the workers that arrange them).\n\n\
             | strategy | batch | per process (largest) | / (batch / processes) | mesh total |\n\
             | --- | ---: | ---: | ---: | ---: |\n",
        );
        for st in STRATEGIES {
            let Some((sent, mesh, batch)) = self.wire.get(st) else {
                continue;
            };
            let largest = sent.iter().copied().max().unwrap_or(0);
            let share = *batch as f64 / sent.len().max(1) as f64;
            s.push_str(&format!(
                "| {st} | {batch} | {largest} | {:.2}x | {mesh} |\n",
                largest as f64 / share
            ));
        }
        s.push_str(
            "\n`barrier` and `naive` writes are split per process at the controller (each \
             process gets the rows its workers own); `broadcast` and `log` send every process \
             the whole batch (broadcast's worker 0 also forwards its copy on the mesh).\n\n",
        );
        s
    }

    /// The goals this section measures: goal, what was measured, met.
    pub fn goals(&self) -> Vec<(String, String, Option<bool>)> {
        let mut goals = Vec::new();
        let limit = 2.0 / 3.0;
        let mut worst: Option<(f64, &str, u64)> = None;
        for st in ["barrier", "naive"] {
            for d in [250u64, 500] {
                if let (Some(x), Some(b)) = (
                    self.get("small_command", st, Some(d)),
                    self.get("small_command", "broadcast", Some(d)),
                ) {
                    let r = x / b;
                    if worst.is_none_or(|w| r > w.0) {
                        worst = Some((r, st, d));
                    }
                }
            }
        }
        goals.push((
            "small command at >= 250 µs one-way: barrier and naive within 10% of 2/3 of broadcast"
                .to_string(),
            match worst {
                Some((r, st, d)) => format!(
                    "{r:.2}x at worst ({st}, {d} µs; limit {limit:.2}x, bound {:.2}x)",
                    limit * 1.1
                ),
                None => "not measured".into(),
            },
            worst.map(|w| w.0 <= limit * 1.1),
        ));
        let w = match (
            self.get("write_1MiB", "barrier", Some(250)),
            self.get("write_1MiB", "broadcast", Some(250)),
        ) {
            (Some(x), Some(b)) => Some(x / b),
            _ => None,
        };
        goals.push((
            "1 MiB write at 250 µs one-way: symmetric (barrier) at most 0.5x of broadcast".into(),
            w.map_or("not measured".into(), |r| {
                format!("{r:.2}x ({})", self.shape)
            }),
            w.map(|r| r <= 0.5),
        ));
        let bytes = self.wire.get("barrier").map(|(sent, _, batch)| {
            let largest = sent.iter().copied().max().unwrap_or(0) as f64;
            largest / (*batch as f64 / sent.len().max(1) as f64)
        });
        goals.push((
            "bytes from the controller per process per write at most 1.1x batch / processes".into(),
            bytes.map_or("not measured".into(), |r| format!("{r:.2}x (barrier)")),
            bytes.map(|r| r <= 1.1),
        ));
        goals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slopes_count_the_delays_on_the_path() {
        let mut medians = BTreeMap::new();
        for d in DELAYS_US {
            let ns = 100_000.0 + 3.0 * d as f64 * 1e3;
            medians.insert(format!("network/small_command/broadcast/4x1/{d}us"), ns);
            let ns = 90_000.0 + 2.0 * d as f64 * 1e3;
            medians.insert(format!("network/small_command/barrier/4x1/{d}us"), ns);
        }
        medians.insert("network/small_command/broadcast/4x1/direct".into(), 80e3);
        let wire: String = (0..4)
            .map(|i| format!("barrier\t4x1\t{i}\t1100000\t0\t1048576\n"))
            .collect();
        let n = Network::new(&medians, &wire);
        assert!((n.slope("small_command", "broadcast").unwrap() - 3.0).abs() < 1e-9);
        assert!((n.slope("small_command", "barrier").unwrap() - 2.0).abs() < 1e-9);
        let goals = n.goals();
        // 1,090 µs / 1,600 µs = 0.68 at 500 µs; 590 / 850 = 0.69 at 250 µs.
        assert_eq!(goals[0].2, Some(true), "{:?}", goals[0]);
        assert_eq!(goals[1].2, None);
        // Each process received 1.05x the whole batch: 4.2x its share.
        assert_eq!(goals[2].2, Some(false), "{:?}", goals[2]);
        let s = n.section();
        assert!(s.contains("| barrier | 2 | 2.00 |"), "{s}");
        assert!(s.contains("with relays at 0 µs"), "{s}");
    }
}
