//! What a replica pod's container tells the kubelet and the log collector:
//! its probes and its log format.
//!
//! A replica process answers `GET /healthz` on its controller port to
//! anyone (`lockstep_metrics_http::HEALTH_PATH`: it says only that the
//! process serves; the metrics beside it need the metrics token off
//! loopback). The kubelet's probes use it: the startup probe gives a process
//! up to [`STARTUP_SECS`] to form its timely mesh and listen; the liveness
//! probe restarts a container that stops answering (the backend then
//! restarts its whole service: shared fate); readiness marks the pod.

use k8s_openapi::api::core::v1::{EnvVar, HTTPGetAction, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The named port the probes reach (a service without one gets none).
pub const PROBED_PORT: &str = "controller";

/// How long a replica process may take to answer its first probe.
pub const STARTUP_SECS: i32 = 120;

/// How long a replica process in a pod waits for its peers to form the
/// timely mesh (`LOCKSTEP_CLUSTER_TIMEOUT_SECS`, read by
/// `lockstep-replica --cluster-timeout-secs`): as long as the startup probe
/// allows, so a peer whose image is still being pulled on another node does
/// not make the others give up and the replica flap.
pub fn cluster_timeout_env() -> EnvVar {
    EnvVar {
        name: "LOCKSTEP_CLUSTER_TIMEOUT_SECS".to_string(),
        value: Some(STARTUP_SECS.to_string()),
        ..EnvVar::default()
    }
}

/// The log format of every replica process in a pod: one JSON object per
/// line (`LOCKSTEP_LOG_FORMAT=json`), what a cluster's log collector parses.
pub fn log_format_env() -> EnvVar {
    EnvVar {
        name: "LOCKSTEP_LOG_FORMAT".to_string(),
        value: Some("json".to_string()),
        ..EnvVar::default()
    }
}

/// The container's startup, liveness and readiness probes, if it has the
/// [`PROBED_PORT`].
pub fn probes(has_probed_port: bool) -> [Option<Probe>; 3] {
    if !has_probed_port {
        return [None, None, None];
    }
    let probe = |period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(lockstep_metrics_http::HEALTH_PATH.to_string()),
            port: IntOrString::String(PROBED_PORT.to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(2),
        failure_threshold: Some(failures),
        ..Probe::default()
    };
    [
        Some(probe(1, STARTUP_SECS)),
        Some(probe(10, 3)),
        Some(probe(5, 2)),
    ]
}
