//! Prometheus metrics of the environment (`prometheus-client`), served as
//! OpenMetrics text on `lockstep serve --metrics-listen ADDR` at `/metrics`.
//!
//! What an operator needs to see without reading logs: API requests by
//! method and status code, with their latency; per replica the controller
//! sessions, disconnections, history mismatches and replica restarts by
//! reason, whether the replica serves (answers a ping), the updates its
//! inputs store, its dataflows, and per process how far its frontiers are
//! behind the writes; and the environment's epoch.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

mod endpoint;

pub use endpoint::{scrape_targets, serve, TARGETS_PATH};

/// Labels of an API request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// The RPC.
    pub method: String,
    /// Its gRPC status code (`Ok`, `NotFound`, ...).
    pub code: String,
}

/// The label of an RPC.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    /// The RPC.
    pub method: String,
}

/// The label of a replica.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabel {
    /// The replica's name.
    pub replica: String,
}

/// The labels of one process of a replica.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProcessLabels {
    /// The replica's name.
    pub replica: String,
    /// The process's index.
    pub process: String,
}

/// The generations [`GenerationLabels`] names.
pub const GENERATIONS: [&str; 2] = ["own", "standby"];

/// A replica and a phase of its reconfiguration
/// ([`crate::ReconfigurationPhase::name`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// The replica's name.
    pub replica: String,
    /// The phase.
    pub phase: String,
}

/// A replica and one of its generations: `own` (its processes) or
/// `standby` (during a reconfiguration).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GenerationLabels {
    /// The replica's name.
    pub replica: String,
    /// `own` or `standby`.
    pub generation: String,
}

/// The label of this build.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// The crate version.
    pub version: &'static str,
}

/// Every reason a replica is restarted for (the `reason` label of
/// [`Metrics::restarts`]).
pub const RESTART_REASONS: [&str; 4] =
    ["silent", "lockstep_lost", "history_mismatch", "unreachable"];

/// Labels of a replica restart.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestartLabels {
    /// The replica's name.
    pub replica: String,
    /// One of [`RESTART_REASONS`].
    pub reason: String,
}

fn latency_histogram() -> Histogram {
    // 100 µs to ~6.5 s.
    Histogram::new(exponential_buckets(1e-4, 2.0, 17))
}

/// The environment's metrics.
pub struct Metrics {
    registry: Registry,
    /// API requests by method and status code.
    pub api_requests: Family<ApiLabels, Counter>,
    /// API request latency by method, in seconds.
    pub api_seconds: Family<MethodLabel, Histogram, fn() -> Histogram>,
    /// Controller sessions that reached serving, per replica.
    pub sessions: Family<ReplicaLabel, Counter>,
    /// Lost connections to replica processes, per replica.
    pub disconnects: Family<ReplicaLabel, Counter>,
    /// History checks that found the workers disagree, per replica.
    pub history_mismatches: Family<ReplicaLabel, Counter>,
    /// Replica restarts through the orchestrator, per replica and reason.
    pub restarts: Family<RestartLabels, Counter>,
    /// 1 while the replica answers a ping, else 0.
    pub serving: Family<ReplicaLabel, Gauge>,
    /// Input updates the catalog stores for the replica (consolidated).
    pub stored_updates: Family<ReplicaLabel, Gauge>,
    /// Live dataflows of the replica.
    pub dataflows: Family<ReplicaLabel, Gauge>,
    /// Open read holds (subscriptions, peeks in flight) on the replica's
    /// inputs.
    pub read_holds: Family<ReplicaLabel, Gauge>,
    /// The largest span (timestamps) by which a read hold keeps one of the
    /// replica's input collections' since behind the compaction lag's.
    pub read_hold_span: Family<ReplicaLabel, Gauge>,
    /// Per process, how many timestamps its slowest export is behind the
    /// writes to its inputs ([`lockstep_controller::Controller::process_lags`]);
    /// absent while the process has not reported every export.
    pub frontier_lag: Family<ProcessLabels, Gauge>,
    /// 1 for the phase of the replica's reconfiguration under way (an
    /// upgrade that keeps answering, a resize); no series without one.
    pub reconfiguration_phase: Family<PhaseLabels, Gauge>,
    /// Per generation of the replica (`own`, and `standby` while there is
    /// one), its live dataflows caught up with the writes to their inputs
    /// ([`lockstep_controller::Controller::caught_up`]).
    pub dataflows_caught_up: Family<GenerationLabels, Gauge>,
    /// The epoch this environment owns.
    pub epoch: Gauge,
    /// Catalog transactions that stored input writes (one per group
    /// commit).
    pub input_commits: Counter,
    /// Input writes stored; over `input_commits`, writes per commit.
    pub input_writes_stored: Counter,
    /// The descriptor budget (R1): limit, reserve, and each listener's caps
    /// and open connections (`api`, `metrics`).
    pub budget: lockstep_admission::BudgetMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every metric, registered.
    pub fn new() -> Self {
        let api_requests = Family::<ApiLabels, Counter>::default();
        let api_seconds: Family<MethodLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        let sessions = Family::<ReplicaLabel, Counter>::default();
        let disconnects = Family::<ReplicaLabel, Counter>::default();
        let history_mismatches = Family::<ReplicaLabel, Counter>::default();
        let restarts = Family::<RestartLabels, Counter>::default();
        let serving = Family::<ReplicaLabel, Gauge>::default();
        let stored_updates = Family::<ReplicaLabel, Gauge>::default();
        let dataflows = Family::<ReplicaLabel, Gauge>::default();
        let read_holds = Family::<ReplicaLabel, Gauge>::default();
        let read_hold_span = Family::<ReplicaLabel, Gauge>::default();
        let frontier_lag = Family::<ProcessLabels, Gauge>::default();
        let reconfiguration_phase = Family::<PhaseLabels, Gauge>::default();
        let dataflows_caught_up = Family::<GenerationLabels, Gauge>::default();
        let epoch = Gauge::default();
        let input_commits = Counter::default();
        let input_writes_stored = Counter::default();
        // The root holds the standard, unprefixed `process_*` series; every
        // series of the environment's own is `lockstep_environment_*` (a
        // replica process's are `lockstep_replica_*`).
        let mut root = Registry::default();
        lockstep_metrics_http::process::register(&mut root);
        let registry = root.sub_registry_with_prefix("lockstep_environment");
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "build_info",
            "1, labelled with this build's version",
            build_info,
        );
        registry.register(
            "api_requests",
            "API requests by method and status code",
            api_requests.clone(),
        );
        registry.register(
            "api_request_seconds",
            "API request latency by method",
            api_seconds.clone(),
        );
        registry.register(
            "controller_sessions",
            "Controller sessions that reached serving",
            sessions.clone(),
        );
        registry.register(
            "controller_disconnects",
            "Lost connections to replica processes",
            disconnects.clone(),
        );
        registry.register(
            "history_mismatches",
            "History checks that found the workers disagree",
            history_mismatches.clone(),
        );
        registry.register(
            "replica_restarts",
            "Replica restarts through the orchestrator, by reason",
            restarts.clone(),
        );
        registry.register(
            "replica_serving",
            "1 while the replica answers a ping",
            serving.clone(),
        );
        registry.register(
            "input_updates_stored",
            "Input updates the catalog stores (consolidated)",
            stored_updates.clone(),
        );
        registry.register("dataflows", "Live dataflows", dataflows.clone());
        registry.register(
            "read_holds",
            "Open read holds (subscriptions, peeks in flight) on the replica's inputs",
            read_holds.clone(),
        );
        registry.register(
            "read_hold_span",
            "Timestamps by which a read hold keeps an input's since behind the compaction lag's",
            read_hold_span.clone(),
        );
        registry.register(
            "process_frontier_lag",
            "Timestamps the process's slowest export is behind the writes to its inputs",
            frontier_lag.clone(),
        );
        registry.register(
            "reconfiguration_phase",
            "1 for the phase of the replica's reconfiguration under way",
            reconfiguration_phase.clone(),
        );
        registry.register(
            "dataflows_caught_up",
            "Live dataflows of a generation of the replica caught up with the writes to their inputs",
            dataflows_caught_up.clone(),
        );
        registry.register("epoch", "The epoch this environment owns", epoch.clone());
        registry.register(
            "input_commits",
            "Catalog transactions that stored input writes (one per group commit)",
            input_commits.clone(),
        );
        registry.register(
            "input_writes_stored",
            "Input writes stored in the catalog",
            input_writes_stored.clone(),
        );
        let budget = lockstep_admission::BudgetMetrics::default();
        budget.register(registry);
        budget.set(crate::listeners::process_budget());
        Metrics {
            budget,
            registry: root,
            api_requests,
            api_seconds,
            sessions,
            disconnects,
            history_mismatches,
            restarts,
            serving,
            stored_updates,
            dataflows,
            read_holds,
            read_hold_span,
            frontier_lag,
            reconfiguration_phase,
            dataflows_caught_up,
            epoch,
            input_commits,
            input_writes_stored,
        }
    }

    /// Removes every series labelled with replica `name` (of `processes`
    /// processes): a dropped replica's series end with it.
    pub fn forget_replica(&self, name: &str, processes: u32) {
        let label = ReplicaLabel {
            replica: name.to_string(),
        };
        for family in [&self.sessions, &self.disconnects, &self.history_mismatches] {
            family.remove(&label);
        }
        for family in [
            &self.serving,
            &self.stored_updates,
            &self.dataflows,
            &self.read_holds,
            &self.read_hold_span,
        ] {
            family.remove(&label);
        }
        for reason in RESTART_REASONS {
            self.restarts.remove(&RestartLabels {
                replica: name.to_string(),
                reason: reason.to_string(),
            });
        }
        self.forget_processes(name, 0..processes);
        self.reconfiguring(name, None);
        for generation in GENERATIONS {
            self.caught_up(name, generation, None);
        }
    }

    /// Replica `name`'s reconfiguration is in `phase` (`None`: none).
    pub fn reconfiguring(&self, name: &str, phase: Option<&str>) {
        for p in crate::ReconfigurationPhase::ALL.map(crate::ReconfigurationPhase::name) {
            let labels = PhaseLabels {
                replica: name.to_string(),
                phase: p.to_string(),
            };
            if Some(p) == phase {
                self.reconfiguration_phase.get_or_create(&labels).set(1);
            } else {
                self.reconfiguration_phase.remove(&labels);
            }
        }
    }

    /// Replica `name`'s `generation` (one of [`GENERATIONS`]) has
    /// `caught_up` dataflows caught up (`None`: not known, no series).
    pub fn caught_up(&self, name: &str, generation: &str, caught_up: Option<usize>) {
        let labels = GenerationLabels {
            replica: name.to_string(),
            generation: generation.to_string(),
        };
        match caught_up {
            Some(n) => {
                self.dataflows_caught_up
                    .get_or_create(&labels)
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            None => {
                self.dataflows_caught_up.remove(&labels);
            }
        }
    }

    /// Forgets the per-process series of processes `indexes` of replica
    /// `name` (dropped, or gone with a resize to fewer processes).
    pub fn forget_processes(&self, name: &str, indexes: std::ops::Range<u32>) {
        for process in indexes {
            self.frontier_lag.remove(&ProcessLabels {
                replica: name.to_string(),
                process: process.to_string(),
            });
        }
    }

    /// Records how long an API call took to its response headers.
    pub fn api_latency(&self, method: &str, took: Duration) {
        self.api_seconds
            .get_or_create(&MethodLabel {
                method: method.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// Counts one ended API call with its status code.
    pub fn api_code(&self, method: &str, code: tonic::Code) {
        self.api_requests
            .get_or_create(&ApiLabels {
                method: method.to_string(),
                code: grpc_code_name(code).to_string(),
            })
            .inc();
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// A gRPC status code as the gRPC specification spells it (`OK`,
/// `INVALID_ARGUMENT`, ...), the label value other gRPC servers' metrics use.
pub fn grpc_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_endpoint_serves_these_metrics() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        metrics.epoch.set(7);
        tokio::spawn(serve(listener, metrics, None, None));
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out))
            .await
            .expect("the endpoint answers and closes within 10 s")
            .unwrap();
        let out = String::from_utf8_lossy(&out);
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert!(out.contains("lockstep_environment_epoch 7"), "{out}");
        assert!(
            out.contains(&format!(
                "lockstep_environment_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{out}"
        );
        assert!(out.contains("\nprocess_resident_memory_bytes "), "{out}");
        assert!(out.contains("\nprocess_cpu_seconds_total "), "{out}");
    }

    #[test]
    fn a_dropped_replicas_series_end_with_it() {
        let m = Metrics::new();
        let label = |r: &str| ReplicaLabel {
            replica: r.to_string(),
        };
        for r in ["gone", "kept"] {
            m.sessions.get_or_create(&label(r)).inc();
            m.disconnects.get_or_create(&label(r)).inc();
            m.history_mismatches.get_or_create(&label(r)).inc();
            m.serving.get_or_create(&label(r)).set(1);
            m.stored_updates.get_or_create(&label(r)).set(5);
            m.dataflows.get_or_create(&label(r)).set(2);
            m.read_holds.get_or_create(&label(r)).set(1);
            m.read_hold_span.get_or_create(&label(r)).set(3);
            for reason in RESTART_REASONS {
                m.restarts
                    .get_or_create(&RestartLabels {
                        replica: r.to_string(),
                        reason: reason.to_string(),
                    })
                    .inc();
            }
            for p in 0..2 {
                m.frontier_lag
                    .get_or_create(&ProcessLabels {
                        replica: r.to_string(),
                        process: p.to_string(),
                    })
                    .set(0);
            }
            m.reconfiguring(r, Some("hydrating"));
            m.caught_up(r, "own", Some(1));
            m.caught_up(r, "standby", Some(0));
        }
        let before = m.encode();
        assert!(before.contains("replica=\"gone\""), "{before}");
        m.forget_replica("gone", 2);
        let after = m.encode();
        assert!(!after.contains("replica=\"gone\""), "{after}");
        // Every series of the other replica is still there.
        let kept = |text: &str| text.matches("replica=\"kept\"").count();
        assert_eq!(kept(&after), kept(&before));
        assert!(kept(&after) >= 8 + 3 + 2 + 3, "{after}");
    }

    #[test]
    fn a_reconfiguration_shows_its_one_phase_and_each_generation_caught_up() {
        let m = Metrics::new();
        m.reconfiguring("r", Some("standby-hydrating"));
        m.reconfiguring("r", Some("hydrating"));
        m.caught_up("r", "own", Some(2));
        m.caught_up("r", "standby", Some(3));
        let text = m.encode();
        assert!(
            text.contains(
                "lockstep_environment_reconfiguration_phase{replica=\"r\",phase=\"hydrating\"} 1"
            ),
            "{text}"
        );
        assert!(!text.contains("phase=\"standby-hydrating\""), "{text}");
        assert!(
            text.contains(
                "lockstep_environment_dataflows_caught_up{replica=\"r\",generation=\"standby\"} 3"
            ),
            "{text}"
        );
        // Done: no phase, no standby.
        m.reconfiguring("r", None);
        m.caught_up("r", "standby", None);
        let text = m.encode();
        assert!(!text.contains("reconfiguration_phase{"), "{text}");
        assert!(!text.contains("generation=\"standby\""), "{text}");
        assert!(text.contains("generation=\"own\"} 2"), "{text}");
    }

    #[test]
    fn every_process_is_a_target_labelled_with_its_replica_and_index() {
        let replica = |id: u64, name: &str, processes: u32| lockstep_catalog::Replica {
            id,
            name: name.to_string(),
            config: lockstep_catalog::ReplicaConfig {
                processes,
                workers_per_process: 1,
                config: String::new(),
            },
        };
        let replicas =
            std::collections::BTreeMap::from([(1, replica(1, "a", 2)), (2, replica(2, "b", 1))]);
        let doc: serde_json::Value =
            serde_json::from_str(&scrape_targets("10.0.0.1:9090", &replicas)).unwrap();
        let groups = doc.as_array().unwrap();
        let seen: Vec<(String, String, String)> = groups
            .iter()
            .map(|g| {
                assert_eq!(g["targets"], serde_json::json!(["10.0.0.1:9090"]));
                let l = &g["labels"];
                // One instance per process, although all share an address.
                assert_eq!(
                    l["instance"].as_str().unwrap(),
                    format!(
                        "{}/{}",
                        l["replica"].as_str().unwrap(),
                        l["process"].as_str().unwrap()
                    )
                );
                (
                    l["replica"].as_str().unwrap().to_string(),
                    l["process"].as_str().unwrap().to_string(),
                    l["__metrics_path__"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want = |r: &str, p: &str| {
            (
                r.to_string(),
                p.to_string(),
                format!("/metrics/replicas/{r}/{p}"),
            )
        };
        assert_eq!(seen, vec![want("a", "0"), want("a", "1"), want("b", "0")]);
        assert_eq!(scrape_targets("x", &Default::default()), "[]");
    }
}
