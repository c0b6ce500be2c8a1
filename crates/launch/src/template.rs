//! How a replica becomes an orchestrator service: the program and an
//! argument template expanded per process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lockstep_orchestrator::{ServiceAssignment, ServiceConfig};

/// What a replica's command line is written from (the catalog's replica,
/// or a test's).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaShape {
    /// The replica's ID.
    pub id: u64,
    /// The replica's name.
    pub name: String,
    /// Its process count.
    pub processes: usize,
    /// Timely workers per process.
    pub workers_per_process: u32,
    /// Its free-form configuration (`{config}`).
    pub config: String,
}

/// Rewrites a process's timely peer list (`process`, the addresses).
type PeersHook = Arc<dyn Fn(usize, Vec<String>) -> Vec<String> + Send + Sync>;

/// The named ports every replica process gets.
pub const REPLICA_PORTS: [&str; 2] = ["timely", "controller"];

/// The arguments a replica process gets when no template is given, for the
/// `lockstep-replica` binary.
pub const DEFAULT_REPLICA_ARGS: [&str; 8] = [
    "--replica-id={replica-id}",
    "--process={process}",
    "--processes={processes}",
    "--workers={workers}",
    "--timely-port={port:timely}",
    "--controller-port={port:controller}",
    "--peers={peers:timely}",
    "--listen-host={listen-host}",
];

/// The program and argument template of replica services.
///
/// Placeholders, expanded for each process:
///
/// | placeholder | value |
/// | --- | --- |
/// | `{replica-id}`, `{replica-name}` | the catalog replica |
/// | `{process}`, `{processes}` | this process's index, the process count |
/// | `{workers}` | workers per process |
/// | `{config}` | the replica's free-form config |
/// | `{port:NAME}` | this process's port `NAME` (`timely`, `controller`) |
/// | `{addr:NAME}` | this process's `host:port` as its peers reach it |
/// | `{peers:NAME}` | every process's `host:port` for `NAME`, comma-separated, in process order |
/// | `{listen-host}` | the address this process binds (`127.0.0.1`; `0.0.0.0` on a simulated host or a pod) |
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceTemplate {
    /// The program: a path, or a bare name looked up in `PATH`.
    pub program: PathBuf,
    /// The argument template.
    pub args: Vec<String>,
}

impl ServiceTemplate {
    /// `program` with [`DEFAULT_REPLICA_ARGS`].
    pub fn new(program: &Path) -> Self {
        ServiceTemplate {
            program: program.to_path_buf(),
            args: DEFAULT_REPLICA_ARGS.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// `lockstep-replica` (next to the running executable if it is there,
    /// else from `PATH`) with [`DEFAULT_REPLICA_ARGS`].
    pub fn lockstep_replica() -> Self {
        let beside = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join("lockstep-replica")))
            .filter(|p| p.is_file());
        Self::new(&beside.unwrap_or_else(|| PathBuf::from("lockstep-replica")))
    }

    /// The service name of a replica.
    pub fn service_name(replica_id: u64) -> String {
        format!("replica-{replica_id}")
    }

    /// The service name of a replica's standby generation: the second
    /// service an upgrade that keeps answering starts beside the replica's
    /// own, and drops when it is done (`docs/compatibility.md`).
    pub fn standby_service_name(replica_id: u64) -> String {
        format!("replica-{replica_id}-standby")
    }

    /// The orchestrator service for a replica.
    pub fn service_config(&self, replica: &ReplicaShape) -> ServiceConfig {
        self.service_config_with_peers(replica, |_, peers| peers)
    }

    /// [`Self::service_config`], with `{peers:timely}` passed through
    /// `peers(process, addresses)` first.
    pub fn service_config_with_peers(
        &self,
        replica: &ReplicaShape,
        peers: impl Fn(usize, Vec<String>) -> Vec<String> + Send + Sync + 'static,
    ) -> ServiceConfig {
        let template = self.args.clone();
        let r = replica.clone();
        let peers: PeersHook = Arc::new(peers);
        let mut config = ServiceConfig::new(
            Self::service_name(replica.id),
            replica.id,
            self.program.clone(),
        )
        .scale(replica.processes)
        .label("replica-name", replica.name.clone())
        .args(move |a| template.iter().map(|t| expand(t, &r, a, &peers)).collect());
        for p in REPLICA_PORTS {
            config = config.port(p);
        }
        config
    }
}

/// Expands the placeholders of one argument.
fn expand(
    template: &str,
    replica: &ReplicaShape,
    a: &ServiceAssignment<'_>,
    peers: &PeersHook,
) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            out.push_str(&rest[open..]);
            return out;
        };
        let key = &after[..close];
        let value = match key {
            "replica-id" => Some(replica.id.to_string()),
            "replica-name" => Some(replica.name.clone()),
            "process" => Some(a.process.to_string()),
            "processes" => Some(a.scale.to_string()),
            "workers" => Some(replica.workers_per_process.to_string()),
            "config" => Some(replica.config.clone()),
            "listen-host" => Some(a.listen_host.to_string()),
            _ => match key.split_once(':') {
                Some(("port", n)) if a.ports[a.process].contains_key(n) => {
                    Some(a.port(n).to_string())
                }
                Some(("addr", n)) if a.ports[a.process].contains_key(n) => Some(a.addr(n)),
                Some(("peers", "timely")) if a.ports[a.process].contains_key("timely") => {
                    Some(peers(a.process, a.peer_addrs("timely")).join(","))
                }
                Some(("peers", n)) if a.ports[a.process].contains_key(n) => {
                    Some(a.peer_addrs(n).join(","))
                }
                _ => None,
            },
        };
        match value {
            Some(v) => out.push_str(&v),
            // Unknown placeholders are kept verbatim.
            None => out.push_str(&rest[open..open + close + 2]),
        }
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn placeholders_expand_per_process() {
        let replica = ReplicaShape {
            id: 7,
            name: "r1".into(),
            processes: 2,
            workers_per_process: 3,
            config: "x=1".into(),
        };
        let same: PeersHook = Arc::new(|_, p| p);
        let ports: Vec<BTreeMap<String, u16>> = vec![
            [
                ("timely".to_string(), 1000),
                ("controller".to_string(), 2000),
            ]
            .into(),
            [
                ("timely".to_string(), 1001),
                ("controller".to_string(), 2001),
            ]
            .into(),
        ];
        let a = ServiceAssignment {
            process: 1,
            scale: 2,
            host: "127.0.0.1",
            hosts: &["127.0.0.1".to_string(), "127.0.0.1".to_string()],
            listen_host: "127.0.0.1",
            ports: &ports,
        };
        let args: Vec<String> = DEFAULT_REPLICA_ARGS
            .iter()
            .map(|t| expand(t, &replica, &a, &same))
            .collect();
        assert_eq!(
            args,
            [
                "--replica-id=7",
                "--process=1",
                "--processes=2",
                "--workers=3",
                "--timely-port=1001",
                "--controller-port=2001",
                "--peers=127.0.0.1:1000,127.0.0.1:1001",
                "--listen-host=127.0.0.1",
            ]
        );
        assert_eq!(
            expand(
                "{replica-name}/{config}/{addr:controller}",
                &replica,
                &a,
                &same
            ),
            "r1/x=1/127.0.0.1:2001"
        );
        assert_eq!(
            expand("{nope} {port:nope} {", &replica, &a, &same),
            "{nope} {port:nope} {"
        );
        // The peers hook rewrites the timely peer list only (a relay in
        // front of the other process, as the benchmarks' network model).
        let relay: PeersHook = Arc::new(|process, mut addrs: Vec<String>| {
            addrs[1 - process] = "127.0.0.9:9".into();
            addrs
        });
        assert_eq!(
            expand("{peers:timely} {peers:controller}", &replica, &a, &relay),
            "127.0.0.9:9,127.0.0.1:1001 127.0.0.1:2000,127.0.0.1:2001"
        );
    }
}
