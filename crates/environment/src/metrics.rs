//! Prometheus metrics of the environment (`prometheus-client`), served as
//! OpenMetrics text on `lockstep serve --metrics-listen ADDR` at `/metrics`.
//!
//! What an operator needs to see without reading logs: API requests by
//! method and status code, with their latency; per replica the controller
//! sessions, disconnections, history mismatches and replica restarts by
//! reason, whether the replica serves (answers a ping), the updates its
//! inputs store, its dataflows, and per process how far its frontiers are
//! behind the writes; and the environment's epoch.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Labels of a replica restart.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestartLabels {
    /// The replica's name.
    pub replica: String,
    /// `silent`, `lockstep_lost` or `history_mismatch`.
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
    /// Per process, how many timestamps its slowest export is behind the
    /// writes to its inputs ([`lockstep_controller::Controller::process_lags`]);
    /// absent while the process has not reported every export.
    pub frontier_lag: Family<ProcessLabels, Gauge>,
    /// The epoch this environment owns.
    pub epoch: Gauge,
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
        let frontier_lag = Family::<ProcessLabels, Gauge>::default();
        let epoch = Gauge::default();
        let mut registry = Registry::with_prefix("lockstep");
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
            "process_frontier_lag",
            "Timestamps the process's slowest export is behind the writes to its inputs",
            frontier_lag.clone(),
        );
        registry.register("epoch", "The epoch this environment owns", epoch.clone());
        Metrics {
            registry,
            api_requests,
            api_seconds,
            sessions,
            disconnects,
            history_mismatches,
            restarts,
            serving,
            stored_updates,
            dataflows,
            frontier_lag,
            epoch,
        }
    }

    /// Records one API request.
    pub fn api(&self, method: &str, code: tonic::Code, took: Duration) {
        self.api_requests
            .get_or_create(&ApiLabels {
                method: method.to_string(),
                code: grpc_code_name(code).to_string(),
            })
            .inc();
        self.api_seconds
            .get_or_create(&MethodLabel {
                method: method.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// Serves `GET /metrics` on `listener` until the task is dropped; anything
/// else gets 404. Connections are bounded as the API's are
/// ([`crate::admission`]); a request head is read up to 8 KiB within 5 s in
/// all. With `token`, a request must carry `Authorization: Bearer TOKEN`
/// (401 otherwise): `lockstep serve` gives the API token when the endpoint
/// listens on a non-loopback address.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    token: Option<String>,
) {
    let mut incoming =
        crate::admission::accept(listener, crate::admission::Limits::default(), "metrics");
    let expected = token;
    while let Some(conn) = incoming.recv().await {
        let Ok(mut sock) = conn else { continue };
        let metrics = metrics.clone();
        let expected = expected.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut len = 0;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            // Read until the end of the request head (or the buffer is full),
            // within one deadline for the whole head.
            while len < buf.len() {
                match tokio::time::timeout_at(deadline, sock.read(&mut buf[len..])).await {
                    Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                    Ok(Ok(n)) => {
                        len += n;
                        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                }
            }
            let head = String::from_utf8_lossy(&buf[..len]);
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let authorized = match &expected {
                None => true,
                Some(want) => head.lines().any(|l| {
                    let Some((k, v)) = l.split_once(':') else {
                        return false;
                    };
                    // Bytes, not str slices: a header with multi-byte
                    // characters must not split one.
                    let v = v.trim().as_bytes();
                    k.trim().eq_ignore_ascii_case("authorization")
                        && v.len() > 7
                        && v[..7].eq_ignore_ascii_case(b"bearer ")
                        && crate::server::constant_time_eq(&v[7..], want.as_bytes())
                }),
            };
            let (status, body, kind) = if !authorized {
                (
                    "401 Unauthorized",
                    "a bearer token is required\n".to_string(),
                    "text/plain",
                )
            } else if head.starts_with("GET ") && path == "/metrics" {
                (
                    "200 OK",
                    metrics.encode(),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            } else {
                (
                    "404 Not Found",
                    "only GET /metrics\n".to_string(),
                    "text/plain",
                )
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(response.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
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
