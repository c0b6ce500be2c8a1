//! A replica process from its command line, built from parts: the
//! `lockstep-replica` binary is [`Builder::new`] with the built-in family,
//! and a binary of one's own is the same with [`Builder::family`].
//!
//! A binary's `main` is one line:
//!
//! ```no_run
//! lockstep_replica::Builder::new()
//!     .family(lockstep_replica::family::PlanFamily)
//!     .main()
//! ```

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use lockstep_protocol::{Endpoint, ProcessIdentity, DEFAULT_MAX_FRAME_LEN};

use crate::family::{Family, PlanFamily};
use crate::server::{run, ReplicaConfig};

/// One process of a lockstep replica.
///
/// The argument names match the orchestrator's default replica template
/// (`lockstep-launch`'s `DEFAULT_REPLICA_ARGS`).
#[derive(Parser, Debug)]
#[command(name = "lockstep-replica", version = env!("CARGO_PKG_VERSION"))]
struct Args {
    /// The replica's catalog ID.
    #[arg(long)]
    replica_id: u64,
    /// This process's index, in 0..processes.
    #[arg(long)]
    process: u32,
    /// How many processes the replica has.
    #[arg(long)]
    processes: u32,
    /// Timely workers in this process.
    #[arg(long, default_value_t = 1)]
    workers: u32,
    /// Every process's timely address, comma-separated, in process order:
    /// `HOST:PORT` with HOST a name (a pod's DNS name, a host in /etc/hosts)
    /// or an IP. This process's own entry is the address it advertises to its
    /// peers. Names are looked up with retries until --cluster-timeout-secs.
    #[arg(long, value_delimiter = ',', required = true)]
    peers: Vec<Endpoint>,
    /// The port this process listens on for timely peers (must match its entry in --peers).
    #[arg(long)]
    timely_port: u16,
    /// The port this process listens on for controllers.
    #[arg(long)]
    controller_port: u16,
    /// Listening sockets this process inherits instead of binding its
    /// ports, as `NAME=FD,...` (`controller`, `timely`): the process
    /// orchestrator binds every port when it chooses it and hands each
    /// process its own, so no port is named before it is bound.
    #[arg(long, hide = true, env = "LOCKSTEP_LISTEN_FDS", default_value = "")]
    listen_fds: String,
    /// The address both ports are bound on (`0.0.0.0` for every interface, a
    /// pod IP). Default: the address this process's own --peers entry
    /// resolves to.
    #[arg(long, alias = "host")]
    listen_host: Option<std::net::IpAddr>,
    /// Seconds to resolve every peer and wait for it to connect before
    /// giving up (the Kubernetes backend gives pods its startup probe's
    /// allowance).
    #[arg(long, env = "LOCKSTEP_CLUSTER_TIMEOUT_SECS", default_value_t = 30)]
    cluster_timeout_secs: u64,
    /// The largest frame accepted from a controller or sent to one, in bytes
    /// (at least 64 KiB); peek answers larger than half of it go in parts.
    #[arg(long, env = "LOCKSTEP_MAX_FRAME_LEN", default_value_t = DEFAULT_MAX_FRAME_LEN,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(65536..=(1u64 << 30)))]
    max_frame_len: usize,
    /// The replica's command log, needed by commands sent with the `log`
    /// strategy: a SQLite file shared by its processes, or
    /// `postgres://USER@HOST:PORT/DB#NAME` (the password in `PGPASSWORD`).
    #[arg(long, env = "LOCKSTEP_COMMAND_LOG")]
    command_log: Option<lockstep_command_log::LogLocation>,
    /// The generation the orchestrator started this process in (every
    /// process of a replica is started together, as one generation): timely
    /// peers of another generation are refused.
    #[arg(long, env = "LOCKSTEP_GENERATION", default_value_t = 0)]
    generation: u64,
    /// Accept a Hello that proves the key on plain frames and never prove
    /// the key back, as before sessions were mutual: the negative control
    /// `no-mutual` of the security suite only.
    /// Only in a build with the `failpoints` feature (the test command's).
    #[cfg(feature = "failpoints")]
    #[arg(long, hide = true, env = "LOCKSTEP_INSECURE_ONE_WAY_PROOF")]
    insecure_one_way_proof: bool,
    /// The replica's free-form configuration (`CreateReplica`'s `config`),
    /// which a family's binary may read (`Builder::family_from_config`).
    #[arg(long, env = lockstep_protocol::REPLICA_CONFIG_ENV, default_value = "", hide = true)]
    replica_config: String,
    /// The log format on stderr: `text`, or `json` (one JSON object per
    /// line).
    #[arg(long, env = "LOCKSTEP_LOG_FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    log_format: String,
}

/// A replica process to be run: its dataflow family, and its command line
/// (the arguments of `lockstep-replica --help`, which the environment's
/// replica template passes).
pub struct Builder {
    family: Arc<dyn Family>,
    configured: Option<FromConfig>,
    version: &'static str,
}

/// Makes a family from the replica's configuration.
type FromConfig = Box<dyn Fn(&str) -> Result<Arc<dyn Family>, String>>;

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder")
            .field("family", &self.family)
            .field("configured", &self.configured.is_some())
            .field("version", &self.version)
            .finish()
    }
}

impl Default for Builder {
    fn default() -> Self {
        Builder::new()
    }
}

impl Builder {
    /// A process that builds the built-in family ([`PlanFamily`]).
    pub fn new() -> Self {
        Builder {
            family: Arc::new(PlanFamily),
            configured: None,
            version: env!("CARGO_PKG_VERSION"),
        }
    }

    /// Builds dataflows with the family `make` returns for the replica's
    /// free-form configuration (`CreateReplica`'s `config`, in
    /// `LOCKSTEP_REPLICA_CONFIG`; `""` when it has none). An `Err` ends the
    /// process with exit code 2 and the message: a configuration the family
    /// refuses never runs.
    pub fn family_from_config<F: Family>(
        mut self,
        make: impl Fn(&str) -> Result<F, String> + 'static,
    ) -> Self {
        self.configured = Some(Box::new(move |config: &str| {
            make(config).map(|f| Arc::new(f) as Arc<dyn Family>)
        }));
        self
    }

    /// The family for the replica's configuration `config`.
    fn family_for(&self, config: &str) -> Result<Arc<dyn Family>, String> {
        match &self.configured {
            Some(make) => make(config),
            None => Ok(Arc::clone(&self.family)),
        }
    }

    /// The build version this binary reports: `--version`, the
    /// `HelloResponse` every controller session gets, and so
    /// `ListReplicas`' `build_version` and what `lockstep replica upgrade
    /// --to VERSION` waits for. Default: lockstep's own version; a family's
    /// binary gives its own (`env!("CARGO_PKG_VERSION")` of its crate).
    pub fn version(mut self, version: &'static str) -> Self {
        self.version = version;
        self
    }

    /// Builds dataflows with `family` instead (see [`crate::family`] for
    /// its contract).
    pub fn family(mut self, family: impl Family) -> Self {
        self.family = Arc::new(family);
        self.configured = None;
        self
    }

    /// The command line this process parses: `lockstep-replica`'s
    /// arguments, reporting [`version`](Self::version) for `--version`.
    fn command(&self) -> clap::Command {
        use clap::CommandFactory;
        Args::command().version(self.version)
    }

    /// Parses this process's command line, sets up its logs, and runs it
    /// until it ends: exits with 2 on bad arguments, 1 on an error, 0
    /// otherwise (it never returns).
    pub fn main(self) -> ! {
        use clap::FromArgMatches;
        let args = self.command().get_matches();
        let args = Args::from_arg_matches(&args).unwrap_or_else(|e| e.exit());
        let family = match self.family_for(&args.replica_config) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("lockstep-replica: error: the replica's configuration: {e}");
                std::process::exit(2);
            }
        };
        // The level from RUST_LOG (default info); with `--log-format json` (or
        // LOCKSTEP_LOG_FORMAT=json, inherited from `lockstep serve`) one JSON
        // object per line.
        // No ANSI colour where stderr is not a terminal (its log file).
        let logs = tracing_subscriber::fmt()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_writer(std::io::stderr);
        if args.log_format == "json" {
            logs.json().flatten_event(true).init();
        } else {
            logs.init();
        }
        crate::server::install_panic_exit();
        // Test hooks: FAILPOINTS="name=actions;..." (feature `failpoints` only).
        #[cfg(feature = "failpoints")]
        std::mem::forget(fail::FailScenario::setup());
        // A process that starts late (the campaign's standbys:
        // `replica_start=sleep(MS)`).
        fail::fail_point!("replica_start");
        if args.peers.len() != args.processes as usize {
            eprintln!(
                "lockstep-replica: error: --peers lists {} addresses but --processes is {}",
                args.peers.len(),
                args.processes
            );
            std::process::exit(2);
        }
        if args.peers.get(args.process as usize).map(|a| a.port()) != Some(args.timely_port) {
            eprintln!(
                "lockstep-replica: error: --timely-port {} is not process {}'s entry in --peers",
                args.timely_port, args.process
            );
            std::process::exit(2);
        }
        let config = ReplicaConfig {
            identity: ProcessIdentity {
                replica_id: args.replica_id,
                process_index: args.process,
                process_count: args.processes,
                workers_per_process: args.workers,
            },
            timely_peers: args.peers,
            listen_host: args.listen_host,
            controller_port: args.controller_port,
            inherited: match crate::server::Inherited::parse(&args.listen_fds) {
                Ok(inherited) => inherited,
                Err(e) => {
                    eprintln!("lockstep-replica: error: LOCKSTEP_LISTEN_FDS: {e}");
                    std::process::exit(2);
                }
            },
            cluster_timeout: Duration::from_secs(args.cluster_timeout_secs),
            max_frame_len: args.max_frame_len,
            command_log: args.command_log,
            generation: args.generation,
            #[cfg(feature = "failpoints")]
            one_way_proof: args.insecure_one_way_proof,
            #[cfg(not(feature = "failpoints"))]
            one_way_proof: false,
            family,
            build_version: self.version.to_string(),
            session_key: match std::env::var(lockstep_protocol::SESSION_KEY_ENV) {
                Ok(hex) => match lockstep_protocol::SessionKey::from_hex(&hex) {
                    Ok(k) => Some(k),
                    Err(e) => {
                        eprintln!(
                            "lockstep-replica: error: {}: {e}",
                            lockstep_protocol::SESSION_KEY_ENV
                        );
                        std::process::exit(2);
                    }
                },
                Err(_) => {
                    tracing::warn!(
                        "no {} set: any peer that reaches the controller port can drive this process",
                        lockstep_protocol::SESSION_KEY_ENV
                    );
                    None
                }
            },
        };
        if let Err(e) = run(config) {
            eprintln!("lockstep-replica: error: {e:#}");
            std::process::exit(1);
        }
        std::process::exit(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_is_made_from_the_replica_configuration() {
        let b = Builder::new().family_from_config(|config: &str| match config {
            "" | "plan" => Ok(PlanFamily),
            other => Err(format!("unknown setting {other:?}")),
        });
        assert_eq!(b.family_for("").unwrap().format(), lockstep_plan::FORMAT);
        assert_eq!(
            b.family_for("plan").unwrap().format(),
            lockstep_plan::FORMAT
        );
        assert!(b.family_for("nonsense").unwrap_err().contains("nonsense"));
        // A fixed family takes no configuration.
        let fixed = Builder::new().family(PlanFamily);
        assert!(fixed.family_for("anything").is_ok());
    }

    #[test]
    fn version_reports_the_family_version() {
        assert_eq!(
            Builder::new().command().render_version().trim(),
            format!("lockstep-replica {}", env!("CARGO_PKG_VERSION"))
        );
        let family = Builder::new().version("9.8.7");
        assert_eq!(
            family.command().render_version().trim(),
            "lockstep-replica 9.8.7"
        );
        // What the process parses: `--version` is the family's.
        let err = family
            .command()
            .try_get_matches_from(["my-family", "--version"])
            .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::DisplayVersion);
        assert!(err.to_string().contains("9.8.7"), "{err}");
    }
}
