//! The stage breakdown of a write in `cargo xtask bench`'s report (the
//! `stages` bench): each stage of a 10,000-row write against its floor
//! measured in the same run, their sum against the whole write, and the
//! goals that rest on them.

use std::collections::BTreeMap;

use crate::bench::human;

const PREFIX: &str = "stages/ingest_10k/";

/// One stage: its bench name (without [`PREFIX`]; `None` for a stage that
/// is only its floor), what it is, the floors it is held to (summed), and
/// what bounds it where the floor is not work the stage can do (summed;
/// empty: none measured).
struct Stage {
    name: Option<&'static str>,
    what: &'static str,
    floor: &'static [&'static str],
    floor_what: &'static str,
    bound: &'static [&'static str],
    bound_what: &'static str,
}

/// The stages of a write, in path order.
const STAGES: [Stage; 7] = [
    Stage {
        name: Some("api_decode"),
        what: "API decode (prost, then the environment's conversion)",
        floor: &["floor_row_copies"],
        floor_what: "every row copied into a row of its own",
        bound: &["bound_prost_decode"],
        bound_what: "prost decoding the request by itself (10,000 nested messages)",
    },
    Stage {
        name: Some("validate"),
        what: "validation (every row checked)",
        floor: &["floor_memcpy"],
        floor_what: "the request's bytes copied once",
        bound: &["bound_row_reads"],
        bound_what:
            "every row's bytes read once (10,000 allocations of their own), checking nothing",
    },
    Stage {
        name: Some("durable_append"),
        what: "durable catalog append (encoded, fenced SQLite transaction)",
        floor: &["floor_sqlite_insert"],
        floor_what: "the same bytes inserted in a bare SQLite file, same durability",
        bound: &[],
        bound_what: "",
    },
    Stage {
        name: Some("encode_seal"),
        what: "controller encode and encryption (its codec)",
        floor: &["floor_memcpy", "floor_cipher_seal"],
        floor_what: "a copy of the bytes + snow's encryption of them",
        bound: &["bound_prost_encode", "floor_cipher_seal"],
        bound_what:
            "prost encoding the command's wire form (10,000 nested messages) + snow's encryption",
    },
    Stage {
        name: None,
        what: "wire (loopback TCP, acknowledged)",
        floor: &["floor_tcp"],
        floor_what: "the sealed bytes over TCP: lockstep adds nothing here",
        bound: &[],
        bound_what: "",
    },
    Stage {
        name: Some("open_decode"),
        what: "replica decryption and decode (its codec)",
        floor: &["floor_cipher_open", "floor_row_copies"],
        floor_what: "snow's decryption + every row copied out",
        bound: &[],
        bound_what: "",
    },
    Stage {
        name: Some("replica_ingest"),
        what: "replica ingest (a worker applies it until its export passes)",
        floor: &["floor_differential"],
        floor_what: "differential's own ingest of the same rows into an arrangement",
        bound: &[],
        bound_what: "",
    },
];

/// What a stage must stay within, as a multiple of its floor.
const STAGE_BOUND: f64 = 2.0;

/// The stage figures among a run's medians.
pub struct Stages<'a> {
    medians: &'a BTreeMap<String, f64>,
}

/// One stage's figures: its median (if it has one of its own), its floor,
/// its bound (if measured).
struct Measured {
    stage: &'static Stage,
    median: Option<f64>,
    floor: f64,
    bound: Option<f64>,
}

impl Measured {
    /// "A, Nx of WHAT (B)", for a stage with a median and a measured bound.
    fn against_bound(&self) -> Option<String> {
        let (ns, bound) = (self.median?, self.bound?);
        Some(format!(
            "{}: {}, {:.2}x of its bound, {} ({})",
            self.stage.what,
            human(ns),
            ns / bound,
            self.stage.bound_what,
            human(bound)
        ))
    }
}

impl<'a> Stages<'a> {
    /// The stage figures among `medians`.
    pub fn new(medians: &'a BTreeMap<String, f64>) -> Stages<'a> {
        Stages { medians }
    }

    fn get(&self, name: &str) -> Option<f64> {
        self.medians.get(&format!("{PREFIX}{name}")).copied()
    }

    /// What bounds an ingest of 10,000-row batches whose path holds the
    /// stages named (their bench names, or `floor_tcp` for the wire): their
    /// medians summed, one after the other, as a throughput ratio to
    /// differential's own ingest of the same batch; `None` if a figure is
    /// missing.
    pub fn ingest_bound(&self, path: &[&str]) -> Option<String> {
        let sum: f64 = path.iter().map(|s| self.get(s)).sum::<Option<f64>>()?;
        let differential = self.get("floor_differential")?;
        let replica = self.get("replica_ingest")?;
        Some(format!(
            "bounded by: the stages on its path ({}) take {} a batch one after the other, \
             at most {:.2}x of differential's {}; the replica's ingest alone {} ({:.2}x)",
            path.join(", "),
            human(sum),
            differential / sum,
            human(differential),
            human(replica),
            differential / replica
        ))
    }

    /// Every stage with its floor, if the bench ran.
    fn measured(&self) -> Option<Vec<Measured>> {
        STAGES
            .iter()
            .map(|stage| {
                let floor = stage
                    .floor
                    .iter()
                    .map(|f| self.get(f))
                    .sum::<Option<f64>>()?;
                let median = match stage.name {
                    Some(n) => Some(self.get(n)?),
                    None => None,
                };
                let bound = match stage.bound {
                    [] => None,
                    names => names.iter().map(|f| self.get(f)).sum::<Option<f64>>(),
                };
                Some(Measured {
                    stage,
                    median,
                    floor,
                    bound,
                })
            })
            .collect()
    }

    /// The report's section: the table, the sum against the whole write.
    pub fn section(&self) -> String {
        let Some(stages) = self.measured() else {
            return String::new();
        };
        let mut s = String::from(
            "One write of 10,000 rows (the batch of `limits/ingest_1M` and `api/ingest_10k`, \
             about 110 KB) through each stage of its path, every stage the production code's own \
             functions on the same bytes, beside its floor: what the machine costs for that \
             stage's work with no lockstep code, measured in the same run \
             (`benches/benches/stages.rs`). The replica's ingest is one worker (1x1).\n\n\
             | stage | median | floor | floor median | ratio |\n| --- | ---: | --- | ---: | ---: |\n",
        );
        let mut sum = 0.0;
        let mut floors = 0.0;
        for m in &stages {
            let cost = m.median.unwrap_or(m.floor);
            sum += cost;
            floors += m.floor;
            let (median, ratio) = match m.median {
                Some(ns) => (human(ns), format!("{:.2}x", ns / m.floor)),
                None => ("-".into(), "-".into()),
            };
            s.push_str(&format!(
                "| {} | {median} | {} | {} | {ratio} |\n",
                m.stage.what,
                m.stage.floor_what,
                human(m.floor)
            ));
        }
        s.push_str(&format!(
            "| **sum** | {} | | {} | {:.2}x |\n",
            human(sum),
            human(floors),
            sum / floors
        ));
        let bounded: Vec<String> = stages.iter().filter_map(Measured::against_bound).collect();
        if !bounded.is_empty() {
            s.push_str(
                "\nWhere a floor is not work the stage could do, what bounds the stage, \
                 measured in the same run:\n\n",
            );
            for b in bounded {
                s.push_str(&format!("- {b}\n"));
            }
        }
        let whole = [
            (
                "api/ingest_10k/grpc",
                "through the gRPC API, 2x2, batches back to back",
            ),
            (
                "api/ingest_10k/core",
                "through the environment in process, 2x2",
            ),
        ];
        for (name, what) in whole {
            if let Some(ns) = self.medians.get(name) {
                s.push_str(&format!(
                    "\nThe whole write {what} (`{name}`): {} a batch, {:.2}x the stages' sum.",
                    human(*ns),
                    ns / sum
                ));
            }
        }
        s.push_str(
            "\nThe whole write also holds what no stage above has: the environment's and the \
             controller's in-memory input logs, the split per process and the waits between \
             stages; batches back to back overlap one batch's replica ingest with the next one's \
             append.\n",
        );
        s
    }

    /// The goals on the stages: goal, what was measured, met.
    pub fn goals(&self) -> Vec<(String, String, Option<bool>)> {
        let Some(stages) = self.measured() else {
            return vec![(
                format!("every stage of a 10,000-row write within {STAGE_BOUND}x of its floor"),
                "not measured".into(),
                None,
            )];
        };
        let worst = stages
            .iter()
            .filter_map(|m| m.median.map(|ns| (ns / m.floor, ns, m)))
            .max_by(|a, b| a.0.total_cmp(&b.0));
        let mut out = Vec::new();
        if let Some((r, ns, m)) = worst {
            out.push((
                format!("every stage of a 10,000-row write within {STAGE_BOUND}x of its floor"),
                format!(
                    "{r:.2}x at worst ({}: {} over a floor of {}){}",
                    m.stage.what,
                    human(ns),
                    human(m.floor),
                    m.against_bound()
                        .map(|b| format!("; bounded by: {b}"))
                        .unwrap_or_default()
                ),
                Some(r <= STAGE_BOUND),
            ));
        }
        // With the durable write included: the environment's ingest against
        // its like-for-like floor (differential alone on the same 2x2
        // shape, rows, exports and state growth), with differential alone
        // in one worker beside it as a reported figure; if durability alone
        // costs more than the floor's ingest, the stages' goal stands for it.
        let durable = self.get("floor_sqlite_insert");
        let core = self.medians.get("api/ingest_10k/core");
        let floor = self.medians.get("api/ingest_10k/floor_2x2");
        let raw = self.medians.get("api/ingest_10k/differential");
        if let (Some(durable), Some(core), Some(floor)) = (durable, core, floor) {
            let ratio = floor / core;
            let alone = if durable > *floor {
                format!(
                    "durability alone costs more: a bare SQLite insert of the batch takes {} \
                     against the floor's {}, so at most {:.2}x if the two overlapped fully",
                    human(durable),
                    human(*floor),
                    floor / durable
                )
            } else {
                format!(
                    "a bare SQLite insert of the batch takes {} against the floor's {}",
                    human(durable),
                    human(*floor)
                )
            };
            let raw = raw
                .map(|raw| {
                    format!(
                        "; differential alone in one worker, one export, rows made before the \
                         clock: {} a batch ({:.2}x)",
                        human(*raw),
                        raw / core
                    )
                })
                .unwrap_or_default();
            let bound = self
                .ingest_bound(&[
                    "api_decode",
                    "validate",
                    "durable_append",
                    "encode_seal",
                    "floor_tcp",
                    "open_decode",
                    "replica_ingest",
                ])
                .filter(|_| ratio < 0.5)
                .map(|b| format!("; {b}"))
                .unwrap_or_default();
            out.push((
                "ingest in 10,000-row batches, durable write included, at 0.5x or more of its \
                 like-for-like floor (differential on the same 2x2 shape, rows, exports and \
                 state growth)"
                    .into(),
                format!(
                    "{ratio:.2}x (`api/ingest_10k/floor_2x2` / `api/ingest_10k/core`); {alone}{raw}{bound}"
                ),
                Some(ratio >= 0.5),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn medians(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    fn all(replica_ingest: f64) -> BTreeMap<String, f64> {
        medians(&[
            ("api_decode", 100.0),
            ("validate", 10.0),
            ("durable_append", 1000.0),
            ("encode_seal", 100.0),
            ("open_decode", 100.0),
            ("replica_ingest", replica_ingest),
            ("floor_row_copies", 60.0),
            ("floor_memcpy", 10.0),
            ("floor_sqlite_insert", 900.0),
            ("floor_cipher_seal", 50.0),
            ("floor_cipher_open", 50.0),
            ("floor_tcp", 30.0),
            ("floor_differential", 400.0),
        ])
        .into_iter()
        .map(|(k, v)| (format!("{PREFIX}{k}"), v))
        .collect()
    }

    #[test]
    fn the_worst_stage_against_its_summed_floor_decides_the_goal() {
        let m = all(700.0);
        let goals = Stages::new(&m).goals();
        assert_eq!(goals.len(), 1, "no API figures, no durable-ingest goal");
        // api_decode: 100 / 60 = 1.67; replica_ingest 700 / 400 = 1.75.
        assert!(goals[0].1.starts_with("1.75x"), "{}", goals[0].1);
        assert_eq!(goals[0].2, Some(true));
        let m = all(900.0);
        let goals = Stages::new(&m).goals();
        assert!(goals[0].1.starts_with("2.25x"), "{}", goals[0].1);
        assert_eq!(goals[0].2, Some(false));
        let section = Stages::new(&m).section();
        // The wire stage counts its floor; the sum is every stage's cost.
        let sum = 100.0 + 10.0 + 1000.0 + 100.0 + 30.0 + 100.0 + 900.0;
        assert!(
            section.contains(&format!("| **sum** | {} |", human(sum))),
            "{section}"
        );
    }

    /// A stage's measured bound is stated beside its floor, and in the
    /// goal when that stage is the worst; without one, nothing is said.
    #[test]
    fn a_measured_bound_is_stated_where_the_floor_is_not_the_stages_work() {
        let mut m = all(700.0);
        m.insert(format!("{PREFIX}validate"), 100.0);
        let goals = Stages::new(&m).goals();
        assert!(!goals[0].1.contains("bounded by"), "{}", goals[0].1);
        m.insert(format!("{PREFIX}bound_row_reads"), 40.0);
        let goals = Stages::new(&m).goals();
        // validate: 100 / 10 = 10x, the worst; 2.50x of its bound.
        assert!(goals[0].1.starts_with("10.00x"), "{}", goals[0].1);
        assert!(
            goals[0]
                .1
                .contains("bounded by: validation (every row checked)")
                && goals[0].1.contains("2.50x of its bound"),
            "{}",
            goals[0].1
        );
        assert!(Stages::new(&m).section().contains("2.50x of its bound"));
    }

    #[test]
    fn durable_ingest_states_the_durable_floor_when_it_costs_more() {
        let mut m = all(700.0);
        m.insert("api/ingest_10k/core".into(), 4000.0);
        m.insert("api/ingest_10k/differential".into(), 1000.0);
        m.insert("api/ingest_10k/floor_2x2".into(), 800.0);
        let goals = Stages::new(&m).goals();
        assert_eq!(goals.len(), 2);
        assert!(goals[1].1.starts_with("0.20x"), "{}", goals[1].1);
        assert!(
            goals[1].1.contains("durability alone costs more")
                && goals[1].1.contains("one worker")
                && goals[1].1.contains("(0.25x)"),
            "{}",
            goals[1].1
        );
        // The miss names its bound: the path's stages summed, 100 + 10 +
        // 1000 + 100 + 30 + 100 + 700 = 2040 against differential's 400.
        assert!(
            goals[1].1.contains("take 2.0 µs a batch one after the other, at most 0.20x of differential's 400 ns; the replica's ingest alone 700 ns (0.57x)"),
            "{}",
            goals[1].1
        );
        let path = ["encode_seal", "floor_tcp", "open_decode", "replica_ingest"];
        assert!(Stages::new(&m)
            .ingest_bound(&path)
            .unwrap()
            .contains("take 930 ns a batch"));
        m.remove(&format!("{PREFIX}open_decode"));
        assert_eq!(Stages::new(&m).ingest_bound(&path), None);
        assert_eq!(goals[1].2, Some(false));
    }

    #[test]
    fn nothing_measured_is_said_so() {
        let m = medians(&[]);
        assert!(Stages::new(&m).section().is_empty());
        assert_eq!(Stages::new(&m).goals()[0].1, "not measured");
    }
}
