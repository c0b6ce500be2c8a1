//! A replica process's Prometheus metrics (`prometheus-client`), served as
//! OpenMetrics text at `GET /metrics` on the process's controller port (the
//! port the orchestrator assigns; `ListReplicas` reports the address as
//! the process's `metrics_url`).
//!
//! One registry per process ([`METRICS`]): what its workers applied (by
//! command kind and strategy), how long they waited at barrier rounds and
//! for log entries, what they have installed, how far each export's
//! frontier is behind its inputs, its timely mesh, its controller
//! connections (bytes, sessions, refusals before proof) and its build;
//! and the standard `process_*` series (CPU, memory, descriptors).
//! Nothing in it is data: counts, durations, IDs and the build version.
//!
//! Off loopback, a process with a session key answers only a request that
//! bears [`lockstep_protocol::SessionKey::metrics_token`] (the environment
//! knows it; the key itself never leaves the environment).

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The labels of an applied command.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    /// Its kind (`create-dataflow`, `write-input`, ...).
    pub kind: &'static str,
    /// The strategy it was sent with.
    pub strategy: &'static str,
}

/// The label of one timely worker (its global index).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker's global index.
    pub worker: u64,
}

/// The labels of one export on one worker.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExportLabels {
    /// The exported collection's ID.
    pub export: u64,
    /// The worker's global index.
    pub worker: u64,
}

/// The direction of bytes on a connection.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    /// `in` (read) or `out` (written).
    pub direction: &'static str,
}

/// Why a connection ended before it proved a Hello.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `timed_out`, `not_proven`, `malformed`, ...
    pub reason: &'static str,
}

/// The build of this process.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// The Cargo package version.
    pub version: &'static str,
}

fn wait_histogram() -> Histogram {
    // 10 µs to ~2.6 s.
    Histogram::new(exponential_buckets(1e-5, 2.0, 19))
}

/// Every metric of a replica process.
pub struct ReplicaMetrics {
    registry: Registry,
    /// Commands a worker applied, by kind and strategy.
    pub commands_applied: Family<CommandLabels, Counter>,
    /// Seconds a worker waited at a barrier round (from the round's start
    /// to its decision).
    pub barrier_wait: Histogram,
    /// Seconds from a log command's socket copy reaching a worker to the
    /// worker reading commands from the log.
    pub log_wait: Histogram,
    /// Seconds one read of the command log took.
    pub log_read: Histogram,
    /// Dataflows installed, per worker.
    pub dataflows_installed: Family<WorkerLabel, Gauge>,
    /// Timestamps an export's frontier is behind its inputs' uppers, per
    /// export and worker (0 once caught up; gone when dropped).
    pub frontier_lag: Family<ExportLabels, Gauge>,
    /// Other processes of the replica the timely mesh is connected to.
    pub mesh_peers: Gauge,
    /// Bytes on controller connections, by direction.
    pub controller_bytes: Family<DirectionLabel, Counter>,
    /// Controller sessions accepted (proved Hellos).
    pub sessions: Counter,
    /// Connections on the controller port closed before a proved Hello.
    pub refused: Family<ReasonLabel, Counter>,
    /// 1, labelled with this build's version.
    pub build_info: Family<BuildLabels, Gauge>,
    /// The descriptor budget (R1): limit, reserve, and the controller
    /// port's caps and open connections.
    pub budget: lockstep_admission::BudgetMetrics,
}

/// The process's metrics.
pub static METRICS: LazyLock<ReplicaMetrics> = LazyLock::new(ReplicaMetrics::new);

impl ReplicaMetrics {
    fn new() -> Self {
        let m = ReplicaMetrics {
            registry: Registry::default(),
            commands_applied: Family::default(),
            barrier_wait: wait_histogram(),
            log_wait: wait_histogram(),
            log_read: wait_histogram(),
            dataflows_installed: Family::default(),
            frontier_lag: Family::default(),
            mesh_peers: Gauge::default(),
            controller_bytes: Family::default(),
            sessions: Counter::default(),
            refused: Family::default(),
            build_info: Family::default(),
            budget: Default::default(),
        };
        m.build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        // The standard, unprefixed `process_*` series at the root; the
        // process's own under `lockstep_replica_`.
        let mut root = Registry::default();
        lockstep_metrics_http::process::register(&mut root);
        let registry = root.sub_registry_with_prefix("lockstep_replica");
        m.budget.register(registry);
        registry.register(
            "commands_applied",
            "Commands a worker applied, by kind and strategy",
            m.commands_applied.clone(),
        );
        registry.register(
            "barrier_wait_seconds",
            "Seconds a worker waited at a barrier round",
            m.barrier_wait.clone(),
        );
        registry.register(
            "log_wait_seconds",
            "Seconds from a log command's socket copy to the worker's next read of the command log",
            m.log_wait.clone(),
        );
        registry.register(
            "log_read_seconds",
            "Seconds one read of the command log took",
            m.log_read.clone(),
        );
        registry.register(
            "dataflows_installed",
            "Dataflows installed, per worker",
            m.dataflows_installed.clone(),
        );
        registry.register(
            "frontier_lag",
            "Timestamps an export's frontier is behind its inputs' uppers, per export and worker",
            m.frontier_lag.clone(),
        );
        registry.register(
            "mesh_peers",
            "Other processes of the replica the timely mesh is connected to",
            m.mesh_peers.clone(),
        );
        registry.register(
            "controller_bytes",
            "Bytes on controller connections, by direction",
            m.controller_bytes.clone(),
        );
        registry.register(
            "sessions",
            "Controller sessions accepted (proved Hellos)",
            m.sessions.clone(),
        );
        registry.register(
            "connections_refused",
            "Controller-port connections closed before a proved Hello, by reason",
            m.refused.clone(),
        );
        registry.register(
            "build_info",
            "1, labelled with this build's version",
            m.build_info.clone(),
        );
        ReplicaMetrics {
            registry: root,
            ..m
        }
    }

    /// Counts one applied command.
    pub fn applied(&self, kind: &'static str, strategy: &'static str) {
        self.commands_applied
            .get_or_create(&CommandLabels { kind, strategy })
            .inc();
    }

    /// Counts `n` bytes in `direction` (`in` or `out`).
    pub fn bytes(&self, direction: &'static str, n: usize) {
        self.controller_bytes
            .get_or_create(&DirectionLabel { direction })
            .inc_by(n as u64);
    }

    /// Records a wait in `histogram`.
    pub fn observe(histogram: &Histogram, waited: Duration) {
        histogram.observe(waited.as_secs_f64());
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// A stream that counts the bytes read from and written to it into
/// [`ReplicaMetrics::controller_bytes`].
pub struct Counted<S>(pub S);

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.0).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            METRICS.bytes("in", n);
        }
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.0).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            METRICS.bytes("out", *n);
        }
        r
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_names_every_family_and_ends_with_eof() {
        METRICS.applied("create-dataflow", "barrier");
        METRICS
            .frontier_lag
            .get_or_create(&ExportLabels {
                export: 101,
                worker: 0,
            })
            .set(3);
        let text = METRICS.encode();
        assert!(
            text.contains(
                "lockstep_replica_commands_applied_total{kind=\"create-dataflow\",strategy=\"barrier\"}"
            ),
            "{text}"
        );
        assert!(
            text.contains("lockstep_replica_frontier_lag{export=\"101\",worker=\"0\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("lockstep_replica_build_info{version="),
            "{text}"
        );
        assert!(text.contains("\nprocess_open_fds "), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
