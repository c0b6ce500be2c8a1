//! Launching replicas through an orchestrator.
//!
//! The one place that writes the command line of the `lockstep-replica`
//! binary ([`ServiceTemplate`], [`DEFAULT_REPLICA_ARGS`]), the environment
//! its processes read (`with_*`), and the [`ReplicaAddrs`] a controller
//! needs from the service the orchestrator reports ([`replica_addrs`]). The
//! environment, the tests, the benchmarks and the fault suites launch
//! replicas only this way: there is no ad hoc launcher.

pub mod template;

use std::path::Path;

use lockstep_command_log::LogLocation;
use lockstep_controller::ReplicaAddrs;
use lockstep_orchestrator::{ServiceConfig, ServiceStatus};
use lockstep_protocol::Endpoint;

pub use template::{ReplicaShape, ServiceTemplate, DEFAULT_REPLICA_ARGS, REPLICA_PORTS};

/// The orchestrator service of a replica of `processes` processes with
/// `workers` timely workers each, running the `lockstep-replica` binary at
/// `binary` with [`DEFAULT_REPLICA_ARGS`].
pub fn replica_service(
    binary: &Path,
    replica_id: u64,
    processes: usize,
    workers: u32,
) -> ServiceConfig {
    replica_service_with_peers(binary, replica_id, processes, workers, |_, peers| peers)
}

/// [`replica_service`], with each process's `--peers` list passed through
/// `peers(process, timely_addresses)` first. The benchmarks' network model
/// puts a delaying relay between processes this way. A process's own entry
/// must stay its own timely address (the replica checks its port).
pub fn replica_service_with_peers(
    binary: &Path,
    replica_id: u64,
    processes: usize,
    workers: u32,
    peers: impl Fn(usize, Vec<String>) -> Vec<String> + Send + Sync + 'static,
) -> ServiceConfig {
    let shape = ReplicaShape {
        id: replica_id,
        name: ServiceTemplate::service_name(replica_id),
        processes,
        workers_per_process: workers,
        config: String::new(),
    };
    ServiceTemplate::new(binary).service_config_with_peers(&shape, peers)
}

/// The environment variable through which a replica process learns its
/// command log (`lockstep-replica --command-log`).
pub const COMMAND_LOG_ENV: &str = "LOCKSTEP_COMMAND_LOG";

/// Gives the replica service a command log at `location` (a SQLite file
/// shared by its processes, or a log in a PostgreSQL database), so that the
/// `log` strategy can be used; pass the same location in
/// [`ReplicaAddrs::command_log`]. A PostgreSQL password goes to the
/// processes in `PGPASSWORD`, never on their command line.
///
/// Creates the log now if it is missing, so that the replica's processes,
/// which start together, only read it: creating one SQLite file from several
/// processes at once makes all but one back off for up to ~200 ms. If that
/// fails, it is logged here and the replica processes report it clearly.
pub fn with_command_log(config: ServiceConfig, location: &LogLocation) -> ServiceConfig {
    if let Err(e) = lockstep_command_log::AnyLog::open(location) {
        tracing::warn!(%location, "cannot create the command log: {e}");
    }
    let config = config.env(COMMAND_LOG_ENV, location.to_string());
    match location.password() {
        Some(pw) => config.env("PGPASSWORD", pw),
        None => config,
    }
}

/// `config` with the replica's session key in its processes' environment
/// ([`lockstep_protocol::SESSION_KEY_ENV`]; never on the command line).
pub fn with_session_key(
    config: ServiceConfig,
    key: &lockstep_protocol::SessionKey,
) -> ServiceConfig {
    config.env(lockstep_protocol::SESSION_KEY_ENV, key.to_hex())
}

/// `config` with the replica's free-form configuration for its processes
/// (`LOCKSTEP_REPLICA_CONFIG`), if it has one: an empty one sets nothing,
/// so a replica without one keeps the service spec it always had.
pub fn with_replica_config(config: ServiceConfig, text: &str) -> ServiceConfig {
    if text.is_empty() {
        config
    } else {
        config.env(lockstep_protocol::REPLICA_CONFIG_ENV, text)
    }
}

/// `config` with the frame limit its processes use (`LOCKSTEP_MAX_FRAME_LEN`);
/// give the controller the same in [`ReplicaAddrs::max_frame_len`].
pub fn with_max_frame_len(config: ServiceConfig, max_frame_len: usize) -> ServiceConfig {
    config.env(MAX_FRAME_LEN_ENV, max_frame_len.to_string())
}

/// The environment variable a replica process reads its frame limit from.
pub const MAX_FRAME_LEN_ENV: &str = "LOCKSTEP_MAX_FRAME_LEN";

/// Why a service cannot be driven as a replica.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("service {service}: process {process} has no `controller` address")]
pub struct NoControllerPort {
    /// The service.
    pub service: String,
    /// The process.
    pub process: usize,
}

/// The controller addresses of a replica service.
pub fn replica_addrs(
    status: &ServiceStatus,
    workers_per_process: u32,
) -> Result<ReplicaAddrs, NoControllerPort> {
    let processes = status
        .processes
        .iter()
        .map(|p| {
            p.addresses
                .get("controller")
                .map(|a| Endpoint::from(*a))
                .ok_or(NoControllerPort {
                    service: status.name.clone(),
                    process: p.index,
                })
        })
        .collect::<Result<_, _>>()?;
    Ok(ReplicaAddrs {
        replica_id: status.id,
        processes,
        workers_per_process,
        command_log: None,
        session_key: None,
        one_way_proof: false,
        max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_configuration_reaches_the_processes_only_when_given() {
        let base = || ServiceConfig::new("replica-1", 1, "lockstep-replica");
        let with = with_replica_config(base(), "depth=3");
        assert_eq!(
            with.env
                .get(lockstep_protocol::REPLICA_CONFIG_ENV)
                .map(String::as_str),
            Some("depth=3")
        );
        // None given: the spec is what it always was (no restart on adoption).
        let without = with_replica_config(base(), "");
        assert_eq!(without.env, base().env);
    }
}
