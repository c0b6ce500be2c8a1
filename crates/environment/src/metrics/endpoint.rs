//! The metrics endpoint: `/metrics`, the health path, the scrape targets
//! of every replica process and the relay of their own metrics, over
//! `lockstep_metrics_http`.

use std::sync::Arc;

use super::Metrics;

/// Serves the metrics endpoint on `listener` until the task is dropped
/// ([`lockstep_metrics_http`]: anything but a known `GET` gets 404, the
/// request head within 5 s, keep-alive off); connections are bounded as the
/// API's are ([`crate::listeners`]):
///
/// - `GET /metrics`: these metrics;
/// - `GET /healthz` (to anyone, no token): 200 while the API serves, 503
///   while it does not (shutting down, halted): the Deployment's probes,
///   which work whether or not the API speaks TLS;
/// - `GET /metrics/targets` (with `replicas`): every replica process as a
///   Prometheus HTTP service discovery target (`http_sd_configs`): this
///   endpoint's address, the relay path as `__metrics_path__`, and the
///   labels `replica` and `process` ([`scrape_targets`]);
/// - `GET /metrics/replicas/NAME/INDEX` (with `replicas`): process INDEX of
///   replica NAME's own metrics, fetched from it with its metrics token
///   ([`crate::Environment::replica_metrics`]), so that a scraper needs one
///   address and one token for every process; 404 for an unknown replica
///   or process, 502 when the process does not answer.
///
/// With `token`, a request must carry `Authorization: Bearer TOKEN` (401
/// otherwise): `lockstep serve` gives the API token when the endpoint
/// listens on a non-loopback address.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    replicas: Option<Arc<crate::Environment>>,
    token: Option<String>,
) {
    let at: Arc<str> = listener
        .local_addr()
        .map_or_else(|_| "localhost".into(), |a| a.to_string().into());
    let mut incoming = crate::listeners::accept(
        listener,
        crate::listeners::metrics_pool(&metrics),
        crate::listeners::METRICS_UNPROVEN_READ_BYTES,
    );
    let token: Option<Arc<str>> = token.map(Arc::from);
    let handler: lockstep_metrics_http::Handler = Arc::new(move |path: String| {
        let metrics = metrics.clone();
        let replicas = replicas.clone();
        let at = at.clone();
        Box::pin(async move { answer(&path, &at, &metrics, replicas.as_deref()).await })
    });
    while let Some(conn) = incoming.recv().await {
        let Ok(sock) = conn else { continue };
        tokio::spawn(lockstep_metrics_http::serve_connection(
            sock,
            handler.clone(),
            token.clone(),
        ));
    }
}

/// What the endpoint answers for `path`.
async fn answer(
    path: &str,
    at: &str,
    metrics: &Metrics,
    replicas: Option<&crate::Environment>,
) -> lockstep_metrics_http::Answer {
    use lockstep_metrics_http::Answer;
    if path == "/metrics" {
        return Answer::Metrics(metrics.encode());
    }
    if path == lockstep_metrics_http::HEALTH_PATH {
        // 503 unless the API serves: the Deployment's probes (plain HTTP,
        // whether or not the API speaks TLS).
        return match replicas {
            Some(env) if !env.api_serving() => Answer::Unavailable(
                "the API is not serving (starting, shutting down or halted)".into(),
            ),
            _ => Answer::Metrics("ok\n".into()),
        };
    }
    if let (TARGETS_PATH, Some(env)) = (path, replicas) {
        return Answer::Json(scrape_targets(at, &env.replicas()));
    }
    let relayed = path
        .strip_prefix("/metrics/replicas/")
        .and_then(|rest| rest.split_once('/'))
        .and_then(|(name, index)| Some((name, index.parse::<usize>().ok()?)));
    match (relayed, replicas) {
        (Some((name, index)), Some(env)) => env.replica_metrics(name, index).await,
        _ => Answer::NotFound(
            "only GET /metrics, /metrics/targets and /metrics/replicas/NAME/INDEX".into(),
        ),
    }
}

/// The path of the Prometheus HTTP service discovery document.
pub const TARGETS_PATH: &str = "/metrics/targets";

/// Every process of `replicas` as a Prometheus HTTP service discovery
/// target group: scraped at `at` (this endpoint; a scrape config behind a
/// Service rewrites `__address__`), on its relay path, labelled with its
/// replica's name and its process index, its `instance` `NAME/INDEX` (every
/// process is its own instance though all share one address). One scrape
/// credential (the metrics token) serves them all.
pub fn scrape_targets(
    at: &str,
    replicas: &std::collections::BTreeMap<u64, lockstep_catalog::Replica>,
) -> String {
    let groups: Vec<serde_json::Value> = replicas
        .values()
        .flat_map(|r| {
            (0..r.config.processes).map(move |i| {
                serde_json::json!({
                    "targets": [at],
                    "labels": {
                        "__metrics_path__": format!("/metrics/replicas/{}/{i}", r.name),
                        "instance": format!("{}/{i}", r.name),
                        "replica": r.name,
                        "process": i.to_string(),
                    }
                })
            })
        })
        .collect();
    serde_json::Value::Array(groups).to_string()
}
