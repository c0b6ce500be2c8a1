//! `lockstep`: the environment (controller) server and its CLI client.
//!
//! ```text
//! lockstep serve --state-dir DIR --listen 127.0.0.1:6875 --orphan-rule id-watermark
//! lockstep replica create r1 --processes 2 --workers 4
//! lockstep replica list -o json
//! lockstep replica drop r1
//! lockstep dataflow create --replica r1 --input 1 --export '101=reduce(get(1), [#0], count)'
//! lockstep input write --replica r1 --collection 1 --upper 1 --update 1,10@0
//! lockstep peek --replica r1 --collection 101 --at 0
//! lockstep subscribe --replica r1 --collection 101 --as-of 0 --until 5
//! lockstep demo
//! ```
//!
//! Exit codes: 0 success (`lockstep serve`: shut down by SIGTERM or SIGINT),
//! 1 error, 2 a usage error (clap's), 3 halted because another controller
//! took over (O3).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

mod compute_cli;
mod output;
use output::{print_json, Align, OutputArg, Table};
// The demo and the soak: harnesses the binary runs (`lockstep demo`,
// `lockstep soak`), not part of the library.
mod demo;
mod soak;
use compute_cli::status_err;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use lockstep_environment::proto::environment_client::EnvironmentClient;
use lockstep_environment::{proto, EnvError, Environment, EnvironmentConfig, ServiceTemplate};

/// The exit code of a controller that halted because another took over
/// (not 2, which clap gives a usage error).
const EXIT_HALTED: u8 = 3;

/// `json` makes the logs one JSON object per line (the replica processes
/// inherit it).
const LOG_FORMAT_ENV: &str = "LOCKSTEP_LOG_FORMAT";

#[derive(Parser)]
#[command(
    name = "lockstep",
    version,
    about = "lockstep's environment: controller server and CLI"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the environment: open the catalog, ensure replicas, remove orphans, serve.
    Serve(Box<ServeArgs>),
    /// A one-screen summary of a running environment: its epoch and orphan
    /// rule, and per replica its shape, processes, restarts and whether it
    /// serves (answers a ping).
    ///
    /// `-o json`: `{"server", "epoch", "orphan_rule", "orphans_removed": [NAME],
    /// "replicas": [{"name", "id", "processes", "workers_per_process",
    /// "running", "restarts", "frontier_lag": [N or null per process],
    /// "serving": "SERVING" | "NOT_SERVING" | "UNKNOWN" | null (not checked
    /// yet)}]}`.
    Status {
        #[command(flatten)]
        server: ServerArg,
        #[command(flatten)]
        output: OutputArg,
    },
    /// Manage replicas on a running environment.
    Replica {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        command: ReplicaCommand,
    },
    /// Manage dataflows on a running environment.
    Dataflow {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        command: compute_cli::DataflowCommand,
    },
    /// Write to input collections.
    Input {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        command: InputCommand,
    },
    /// Read a collection at a time (prints `row<TAB>count` lines).
    Peek {
        #[command(flatten)]
        server: ServerArg,
        /// The replica's name.
        #[arg(long)]
        replica: String,
        /// The collection.
        #[arg(long)]
        collection: u64,
        /// The time to read at.
        #[arg(long)]
        at: u64,
    },
    /// Stream a collection's changes (prints `time<TAB>row<TAB>diff` lines).
    Subscribe {
        #[command(flatten)]
        server: ServerArg,
        /// The replica's name.
        #[arg(long)]
        replica: String,
        /// The collection.
        #[arg(long)]
        collection: u64,
        /// Changes from this time on.
        #[arg(long, default_value_t = 0)]
        as_of: u64,
        /// Stop once the stream has passed this time.
        #[arg(long)]
        until: Option<u64>,
    },
    /// Policies: the conformance check, and the policies of a running
    /// environment (set, show).
    Policy {
        #[command(flatten)]
        server: ServerArg,
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// The demo: an environment, a 2x2 replica, three dataflows, every answer
    /// checked against a plain-Rust reference, the environment killed and
    /// restarted, the answers checked again.
    Demo {
        /// Keep the state directory (printed) instead of deleting it.
        #[arg(long)]
        keep: bool,
        /// Run the environment on this store (`postgres://USER@HOST:PORT/DB`,
        /// an empty database; the password in `PGPASSWORD`) instead of
        /// SQLite in the state directory.
        #[arg(long)]
        store: Option<String>,
        /// Run the replica's processes on this many simulated hosts
        /// (network namespaces; needs root), as `lockstep serve --hosts`.
        #[arg(long, default_value_t = 0)]
        hosts: usize,
    },
    /// Print a shell completion script, e.g. `lockstep completions bash >
    /// /etc/bash_completion.d/lockstep`, or `source <(lockstep completions
    /// bash)`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The soak (run it with `cargo xtask soak`): many rounds of writes,
    /// peeks, dataflows and subscriptions through the API, the environment
    /// killed and restarted between rounds; writes a JSON report.
    Soak {
        /// 25 rounds and 1,000,000 rows instead of 100 rounds and 6,000,000.
        #[arg(long)]
        quick: bool,
        /// Where the JSON report goes.
        #[arg(long)]
        out: PathBuf,
    },
}

/// Where a client command finds the environment.
#[derive(clap::Args)]
struct ServerArg {
    /// The environment's address.
    #[arg(
        long = "server",
        global = true,
        env = "LOCKSTEP_ADDR",
        default_value = "http://127.0.0.1:6875"
    )]
    url: String,
    /// A file holding the environment's API token (its first line); also
    /// read from LOCKSTEP_API_TOKEN.
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// The CA certificate (PEM) to check an https:// server against.
    #[arg(long, global = true)]
    tls_ca: Option<PathBuf>,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Load WASM policies, run the scenarios of their kind, and print one
    /// JSON line per policy (the reporting contract); exit 1 on a failure.
    Check {
        /// Policy files (.wasm components).
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Put a WASM policy in force on a running environment (its kind is
    /// read from the file); it must pass the conformance check first.
    Set {
        /// The policy (.wasm component); its name is the file name.
        file: PathBuf,
        /// Put it in force on this replica alone, over the
        /// environment-wide one (a distribution policy only).
        #[arg(long)]
        replica: Option<String>,
    },
    /// The policies in force on a running environment.
    ///
    /// `-o json`: `{"policies": [{"kind", "name", "hash" (null: native),
    /// "replica" (null: the whole environment), "since" (unix seconds, null:
    /// since start)}]}`.
    Show {
        #[command(flatten)]
        output: OutputArg,
    },
}

#[derive(Subcommand)]
enum InputCommand {
    /// Append updates to an input collection and advance its upper.
    Write {
        /// The replica's name.
        #[arg(long)]
        replica: String,
        /// The input collection.
        #[arg(long)]
        collection: u64,
        /// An update as `ROW@TIME[:DIFF]`, e.g. `1,10@0` or `1,10@2:-1` (repeat).
        #[arg(long = "update", allow_hyphen_values = true)]
        updates: Vec<String>,
        /// The new upper: every update's time must be below it.
        #[arg(long)]
        upper: u64,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Directory holding the catalog and the orchestrator state; must exist.
    #[arg(long)]
    state_dir: PathBuf,
    /// Address to serve the gRPC API on (port 0 picks one; the chosen address
    /// is printed as `lockstep: serving on ADDR`).
    #[arg(long, default_value = "127.0.0.1:6875")]
    listen: SocketAddr,
    /// The orphan rule.
    #[arg(long, value_enum, default_value_t = OrphanRule::IdWatermark)]
    orphan_rule: OrphanRule,
    /// The replica program (default: lockstep-replica beside this binary, or in PATH).
    #[arg(long)]
    service_binary: Option<PathBuf>,
    /// An argument template for replica processes (repeat for several; see
    /// `ServiceTemplate` for placeholders such as {process} and {peers:timely}).
    /// Default: the lockstep-replica arguments.
    #[arg(long = "service-arg", allow_hyphen_values = true)]
    service_args: Vec<String>,
    /// A WASM orphan policy (a component of the `orphans` world) instead of
    /// `--orphan-rule`, e.g. target/lockstep/policies/id-watermark.wasm. On a
    /// failing call it deletes nothing.
    #[arg(long)]
    orphan_policy: Option<PathBuf>,
    /// A WASM distribution policy (the `distribution` world) choosing the
    /// strategy of every command, e.g. target/lockstep/policies/barrier.wasm.
    /// Default: the native rule, `barrier` for every command. On a failing
    /// call the command is sent with `barrier`.
    #[arg(long)]
    distribution_policy: Option<PathBuf>,
    /// Seconds between background orphan removals while serving (0: only at start).
    #[arg(long, default_value_t = 30)]
    orphan_interval_secs: u64,
    /// The largest frame on a replica connection, in bytes (at least 64 KiB);
    /// replica processes get the same. Writes and peek answers larger than
    /// half of it travel in parts.
    #[arg(long, env = "LOCKSTEP_MAX_FRAME_LEN", default_value_t = lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(65536..=(1u64 << 30)))]
    max_frame_len: usize,
    /// How far, in timestamps, an input collection's since stays behind its
    /// upper: updates below it are compacted (a row inserted and retracted
    /// there leaves nothing) and reads below it are refused with
    /// OUT_OF_RANGE. Omitted: every time is kept, and storage grows with
    /// every distinct (row, time) written.
    #[arg(long)]
    compaction_lag: Option<u64>,
    /// A file holding the token every API call must carry
    /// (`authorization: Bearer TOKEN`; at least 16 characters; the file's
    /// first line). Also read from LOCKSTEP_API_TOKEN. Required to serve on
    /// an address that is not loopback.
    #[arg(long)]
    api_token_file: Option<PathBuf>,
    /// Serve the API over TLS with this certificate chain (PEM); needs
    /// --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text) on this address at
    /// /metrics (port 0 picks one; printed on the serving line).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Let a WASM distribution policy choose `naive`, the negative control
    /// (each worker reconciles alone; it breaks I1 under faults). Refused
    /// otherwise, with the fallback `barrier` used instead.
    #[arg(long)]
    experiments_allow_naive: bool,
    /// Never restart a replica on a controller event (a silent process,
    /// lost lockstep, a history mismatch): the negative control of the
    /// seeded campaign, which shows what those restarts repair.
    #[arg(long, hide = true)]
    experiments_no_replica_restarts: bool,
    /// Where the catalog and the replicas' command logs live: omitted, SQLite
    /// files in the state directory (the embedded default); or a PostgreSQL
    /// database, `postgres://USER@HOST:PORT/DB`, shared by environments on
    /// several machines. Keep the password out of the command line: set
    /// PGPASSWORD (or the whole string in LOCKSTEP_STORE).
    #[arg(long, env = "LOCKSTEP_STORE")]
    store: Option<String>,
    /// The largest answer the API sends (default 256 MiB, what this CLI
    /// accepts); a larger peek answer is refused with RESOURCE_EXHAUSTED
    /// (tests lower it).
    #[arg(long, hide = true, default_value_t = lockstep_environment::server::MAX_ANSWER_BYTES)]
    max_answer_bytes: usize,
    /// Let a stale ensure overwrite a newer controller's service (negative tests only).
    #[arg(long, hide = true)]
    unconditional_writes: bool,
    /// Where replicas run: supervised processes on this machine, or pods
    /// in a Kubernetes cluster (in-cluster service account, or KUBECONFIG).
    #[arg(long, value_enum, default_value_t = OrchestratorKind::Process)]
    orchestrator: OrchestratorKind,
    /// Place every replica's process i on simulated host i mod N: a network
    /// namespace of its own joined to this one by veth pairs (process
    /// backend only; needs root and iproute2; see docs/hosts.md). 0: every
    /// process on this host's loopback.
    #[arg(long, default_value_t = 0)]
    hosts: usize,
    /// The Kubernetes namespace of the replicas' objects.
    #[arg(long, default_value = "lockstep")]
    namespace: String,
    /// The container image of replica pods (it holds --service-binary).
    #[arg(long, default_value = "lockstep:latest")]
    kubernetes_image: String,
    /// On SIGTERM or SIGINT: how long calls in flight may take to finish
    /// after health turned NOT_SERVING and new calls are refused; then the
    /// process exits 0, leaving the replicas running for the next
    /// environment to adopt.
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    shutdown_grace_secs: u64,
    /// The label value (`lockstep/environment`) that tells this
    /// environment's objects from others' in the same namespace.
    #[arg(long, default_value = "lockstep")]
    kubernetes_environment: String,
    /// The resource requests of every replica pod's container, as
    /// `NAME=QUANTITY,...` (Kubernetes backend). Default: cpu=500m,memory=512Mi.
    #[arg(long, value_parser = lockstep_orchestrator_kubernetes::objects::PodResources::parse_list)]
    kubernetes_replica_requests: Option<std::collections::BTreeMap<String, String>>,
    /// The resource limits of every replica pod's container, as
    /// `NAME=QUANTITY,...` (Kubernetes backend). Default: memory=2Gi (no CPU
    /// limit: a throttled worker holds up its whole replica).
    #[arg(long, value_parser = lockstep_orchestrator_kubernetes::objects::PodResources::parse_list)]
    kubernetes_replica_limits: Option<std::collections::BTreeMap<String, String>>,
}

/// The orchestrator backend of `lockstep serve`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OrchestratorKind {
    /// Supervised OS processes on this machine (state in STATE_DIR/orchestrator).
    Process,
    /// Pods and headless Services in a Kubernetes namespace.
    Kubernetes,
}

#[derive(Clone, Copy, ValueEnum)]
enum OrphanRule {
    /// Delete services absent from the catalog with an older epoch.
    Epoch,
    /// Halt on a service ID at or above our next ID, else delete every service absent from the catalog.
    IdWatermark,
    /// Negative control: delete every service absent from the catalog.
    CatalogOnly,
}

impl OrphanRule {
    fn name(self) -> &'static str {
        match self {
            OrphanRule::Epoch => "epoch",
            OrphanRule::IdWatermark => "id-watermark",
            OrphanRule::CatalogOnly => "catalog-only",
        }
    }
}

#[derive(Subcommand)]
enum ReplicaCommand {
    /// Create a replica.
    Create {
        /// Its unique name.
        name: String,
        /// OS processes.
        #[arg(long, default_value_t = 1)]
        processes: u32,
        /// Workers per process.
        #[arg(long, default_value_t = 1)]
        workers: u32,
        /// Free-form configuration for the replica.
        #[arg(long, default_value = "")]
        config: String,
        /// Wait until the replica serves: every process connected to its
        /// controller and answering (grpc.health.v1 `replica/NAME` SERVING).
        /// Exit 1 if it does not within --timeout.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits, in seconds.
        #[arg(long, default_value_t = 60, value_name = "SECONDS", requires = "wait")]
        timeout: u64,
    },
    /// Drop a replica.
    Drop {
        /// Its name.
        name: String,
    },
    /// List replicas and their processes.
    ///
    /// `-o json`: `{"replicas": [{"id", "name", "processes",
    /// "workers_per_process", "config", "service" (null: none yet),
    /// "service_epoch", "process_status": [{"index", "pid" (null: none, a
    /// pod), "running", "restarts", "addresses": {NAME: "HOST:PORT"},
    /// "frontier_lag", "protocol_version", "build_version" (null: not
    /// known)}]}]}`.
    List {
        #[command(flatten)]
        output: OutputArg,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The level from LOCKSTEP_LOG (default info); with LOCKSTEP_LOG_FORMAT=json
    // one JSON object per line, with the spans (a controller's `replica`).
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOCKSTEP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    if std::env::var(LOG_FORMAT_ENV).is_ok_and(|f| f == "json") {
        logs.json().init();
    } else {
        logs.init();
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockstep: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Serve(args) => {
            // A panic anywhere (a failpoint included) crashes the controller,
            // as a real crash would, instead of killing one request's task.
            let default_hook = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                default_hook(info);
                std::process::abort();
            }));
            let _failpoints = fail::FailScenario::setup();
            let result = runtime.block_on(serve(*args));
            // Do not wait for tasks still blocked (a connection cut at the
            // end of the grace period, a blocking read): replicas run on.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => match e.downcast_ref::<EnvError>() {
                    Some(EnvError::Halted(reason)) => {
                        eprintln!("lockstep: halting: another controller took over: {reason}");
                        ExitCode::from(EXIT_HALTED)
                    }
                    _ => {
                        eprintln!("lockstep: error: {e:#}");
                        ExitCode::FAILURE
                    }
                },
            }
        }
        Command::Status { server, output } => {
            finish(runtime.block_on(status_summary(server, output)))
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "lockstep", &mut script);
            finish(output::write_stdout(&script))
        }
        Command::Replica { server, command } => finish(runtime.block_on(client(server, command))),
        Command::Dataflow { server, command } => finish(runtime.block_on(async move {
            compute_cli::dataflow(&mut connect(&server).await?, command).await
        })),
        Command::Input {
            server,
            command:
                InputCommand::Write {
                    replica,
                    collection,
                    updates,
                    upper,
                },
        } => finish(runtime.block_on(async move {
            compute_cli::write_input(
                &mut connect(&server).await?,
                replica,
                collection,
                updates,
                upper,
            )
            .await
        })),
        Command::Peek {
            server,
            replica,
            collection,
            at,
        } => finish(runtime.block_on(async move {
            compute_cli::peek(&mut connect(&server).await?, replica, collection, at).await
        })),
        Command::Subscribe {
            server,
            replica,
            collection,
            as_of,
            until,
        } => finish(runtime.block_on(async move {
            compute_cli::subscribe(
                &mut connect(&server).await?,
                replica,
                collection,
                as_of,
                until,
            )
            .await
        })),
        Command::Policy {
            command: PolicyCommand::Check { files },
            ..
        } => policy_check(&files),
        Command::Policy {
            server,
            command: PolicyCommand::Set { file, replica },
        } => finish(runtime.block_on(async move {
            let wasm =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let p = connect(&server)
                .await?
                .set_policy(proto::SetPolicyRequest {
                    name: lockstep_policy_host::policy_name(&file),
                    wasm,
                    replica: replica.unwrap_or_default(),
                })
                .await
                .map_err(status_err)?
                .into_inner()
                .policy
                .context("no policy in the answer")?;
            if p.replica.is_empty() {
                println!("{} policy {} ({}) in force", p.kind, p.name, p.hash);
            } else {
                println!(
                    "{} policy {} ({}) in force on replica {}",
                    p.kind, p.name, p.hash, p.replica
                );
            }
            Ok(())
        })),
        Command::Policy {
            server,
            command: PolicyCommand::Show { output },
        } => finish(runtime.block_on(async move {
            let list = connect(&server)
                .await?
                .list_policies(proto::ListPoliciesRequest {})
                .await
                .map_err(status_err)?
                .into_inner()
                .policies;
            if output.json() {
                let policies: Vec<serde_json::Value> = list
                    .iter()
                    .map(|p| {
                        serde_json::json!({
                            "kind": p.kind,
                            "name": p.name,
                            "hash": (!p.hash.is_empty()).then_some(&p.hash),
                            "replica": (!p.replica.is_empty()).then_some(&p.replica),
                            "since": (p.since != 0).then_some(p.since),
                        })
                    })
                    .collect();
                return print_json(&serde_json::json!({ "policies": policies }));
            }
            let mut table = Table::new(&[
                ("KIND", Align::Left),
                ("REPLICA", Align::Left),
                ("NAME", Align::Left),
                ("HASH", Align::Left),
                ("SINCE", Align::Left),
            ]);
            for p in list {
                let since = if p.since == 0 {
                    "start".to_string()
                } else {
                    format!("{} (unix)", p.since)
                };
                let hash = if p.hash.is_empty() { "-" } else { &p.hash };
                let replica = if p.replica.is_empty() {
                    "(all)"
                } else {
                    &p.replica
                };
                table.row(vec![
                    p.kind.clone(),
                    replica.to_string(),
                    p.name.clone(),
                    hash.to_string(),
                    since,
                ]);
            }
            table.print();
            Ok(())
        })),
        Command::Demo { keep, store, hosts } => {
            finish(runtime.block_on(demo::run(keep, store, hosts)))
        }
        Command::Soak { quick, out } => {
            use soak::{run, SoakOptions};
            let opts = if quick {
                SoakOptions::quick()
            } else {
                SoakOptions::full()
            };
            finish(runtime.block_on(run(opts, quick, &out)).map(|_| ()))
        }
    }
}

fn policy_check(files: &[PathBuf]) -> ExitCode {
    let mut ok = true;
    for file in files {
        match lockstep_policy_host::conformance::check(file) {
            Ok(lines) => {
                print!("{}", lockstep_policy_host::conformance::report(&lines));
                ok &= lines.iter().all(|l| l.ok());
            }
            Err(e) => {
                eprintln!("lockstep: policy {}: {e}", file.display());
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockstep: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Every replica, page by page.
async fn all_replicas(client: &mut Client) -> anyhow::Result<Vec<proto::Replica>> {
    let mut all = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_replicas(proto::ListReplicasRequest {
                page_size: 1000,
                page_token,
            })
            .await
            .map_err(status_err)?
            .into_inner();
        all.extend(page.replicas);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}

/// `lockstep status`.
async fn status_summary(server: ServerArg, output: OutputArg) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let mut client = connect(&server).await?;
    let status = client
        .get_status(proto::GetStatusRequest {})
        .await
        .map_err(status_err)?
        .into_inner();
    let replicas = all_replicas(&mut client).await?;
    let mut health = HealthClient::new(connect_channel(&server).await?);
    let mut rows = Vec::new();
    for r in &replicas {
        // The health status's name, or None: not checked yet; Err: unknown.
        let serving: Result<Option<ServingStatus>, String> = match health
            .check(HealthCheckRequest {
                service: format!("replica/{}", r.name),
            })
            .await
        {
            Ok(h) => Ok(Some(h.into_inner().status())),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(s.message().to_string()),
        };
        rows.push((r, serving));
    }
    let running = |r: &proto::Replica| r.process_status.iter().filter(|p| p.running).count();
    let restarts = |r: &proto::Replica| r.process_status.iter().map(|p| p.restarts).sum::<u32>();
    if output.json() {
        let replicas: Vec<serde_json::Value> = rows
            .iter()
            .map(|(r, serving)| {
                let serving = match serving {
                    Ok(Some(s)) => Some(s.as_str_name()),
                    Ok(None) => None,
                    Err(_) => Some("UNKNOWN"),
                };
                serde_json::json!({
                    "name": r.name,
                    "id": r.id,
                    "processes": r.processes,
                    "workers_per_process": r.workers_per_process,
                    "running": running(r),
                    "restarts": restarts(r),
                    "frontier_lag": r.process_status.iter().map(|p| p.frontier_lag).collect::<Vec<_>>(),
                    "serving": serving,
                })
            })
            .collect();
        return print_json(&serde_json::json!({
            "server": server.url,
            "epoch": status.epoch,
            "orphan_rule": status.orphan_rule,
            "orphans_removed": status.orphans_removed,
            "replicas": replicas,
        }));
    }
    println!(
        "environment {}: epoch {}, orphan rule {}, {} replica(s)",
        server.url,
        status.epoch,
        status.orphan_rule,
        replicas.len()
    );
    let mut table = Table::new(&[
        ("REPLICA", Align::Left),
        ("ID", Align::Right),
        ("SHAPE", Align::Right),
        ("RUNNING", Align::Right),
        ("RESTARTS", Align::Right),
        ("LAG", Align::Right),
        ("SERVING", Align::Left),
    ]);
    for (r, serving) in &rows {
        let serving = match serving {
            Ok(Some(ServingStatus::Serving)) => "yes".to_string(),
            Ok(Some(ServingStatus::NotServing)) => "no".to_string(),
            Ok(Some(other)) => format!("{other:?}").to_lowercase(),
            Ok(None) => "not checked yet".to_string(),
            Err(m) => format!("unknown ({m})"),
        };
        // Per process, comma-separated; `?` where it is not known.
        let lag = r
            .process_status
            .iter()
            .map(|p| p.frontier_lag.map_or("?".to_string(), |l| l.to_string()))
            .collect::<Vec<_>>()
            .join(",");
        table.row(vec![
            r.name.clone(),
            r.id.to_string(),
            format!("{}x{}", r.processes, r.workers_per_process),
            format!("{}/{}", running(r), r.processes),
            restarts(r).to_string(),
            lag,
            serving,
        ]);
    }
    table.print();
    Ok(())
}

/// Adds the API token, if there is one, to every request.
#[derive(Clone)]
struct AddToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for AddToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// An API client that sends the token.
type Client = EnvironmentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
>;

async fn connect(server: &ServerArg) -> anyhow::Result<Client> {
    let token = api_token(server.token_file.as_deref())?
        .map(|t| format!("Bearer {t}").parse())
        .transpose()
        .context("the API token is not a valid header value")?;
    let channel = connect_channel(server).await?;
    Ok(
        EnvironmentClient::with_interceptor(channel, AddToken(token))
            .max_decoding_message_size(lockstep_environment::server::MAX_ANSWER_BYTES)
            .max_encoding_message_size(lockstep_environment::server::MAX_REQUEST_BYTES),
    )
}

async fn connect_channel(arg: &ServerArg) -> anyhow::Result<tonic::transport::Channel> {
    let server = &arg.url;
    let mut endpoint = tonic::transport::Endpoint::from_shared(server.to_string())
        .with_context(|| format!("bad server address {server:?}"))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(60));
    if let Some(ca) = &arg.tls_ca {
        let pem = std::fs::read(ca)
            .with_context(|| format!("reading the TLS CA certificate {}", ca.display()))?;
        endpoint = endpoint
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
            )
            .context("TLS configuration")?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to the environment at {server}"))?;
    Ok(channel)
}

/// The API token from `file`, or from LOCKSTEP_API_TOKEN.
fn api_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let token = match file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the API token file {}", path.display()))?
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string(),
        ),
        None => std::env::var(API_TOKEN_ENV)
            .ok()
            .map(|t| t.trim().to_string()),
    };
    match token {
        Some(t) if t.len() < lockstep_environment::server::MIN_TOKEN_LEN => anyhow::bail!(
            "an API token has at least {} characters",
            lockstep_environment::server::MIN_TOKEN_LEN
        ),
        Some(t) if !t.chars().all(|c| c.is_ascii_graphic()) => {
            anyhow::bail!("an API token holds printable ASCII only")
        }
        t => Ok(t),
    }
}

/// Where clients and `lockstep serve` find the API token.
const API_TOKEN_ENV: &str = "LOCKSTEP_API_TOKEN";

/// Resolves on the first SIGTERM or SIGINT (the handlers are installed when
/// it is called, so a signal that arrives during start-up is kept and acted
/// on once the environment serves).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name}: shutting down gracefully");
    })
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    let token = api_token(args.api_token_file.as_deref())?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let read = |p: &PathBuf, what: &str| {
                std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
            };
            Some(tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(read(cert, "certificate")?, read(key, "key")?),
            ))
        }
        _ => None,
    };
    if token.is_none() && !args.listen.ip().is_loopback() {
        anyhow::bail!(
            "refusing to serve the API on {} without a token: anyone who reaches it could drive every replica; give --api-token-file (or LOCKSTEP_API_TOKEN), or listen on a loopback address",
            args.listen
        );
    }
    // Bind first: failing to listen must not fence the running controller.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let metrics_listener = match args.metrics_listen {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("cannot listen on {a} for metrics"))?,
        ),
        None => None,
    };
    let mut service = ServiceTemplate::lockstep_replica();
    if let Some(program) = args.service_binary {
        service.program = program;
    }
    if !args.service_args.is_empty() {
        service.args = args.service_args;
    }
    let orphan_policy: Box<dyn lockstep_policy::OrphanPolicy + Send> = match &args.orphan_policy {
        Some(path) => {
            let p = lockstep_policy_host::WasmOrphanPolicy::load(path, Default::default())
                .with_context(|| format!("loading the orphan policy {}", path.display()))?;
            Box::new(lockstep_policy_host::SafeOrphans::new(p))
        }
        None => lockstep_policy::native_orphan_rule(args.orphan_rule.name())
            .expect("every OrphanRule value names a native rule"),
    };
    if let Some(path) = &args.distribution_policy {
        // Load once now, so that a bad file fails the start with a clear error.
        lockstep_policy_host::WasmDistributionPolicy::load(path, Default::default())
            .with_context(|| format!("loading the distribution policy {}", path.display()))?;
    }
    let orphan_in_force = match &args.orphan_policy {
        Some(p) => p.display().to_string(),
        None => format!("native {}", args.orphan_rule.name()),
    };
    let distribution_in_force = match &args.distribution_policy {
        Some(p) => p.display().to_string(),
        None => "native barrier".to_string(),
    };
    tracing::info!(
        orphan_policy = %orphan_in_force,
        distribution_policy = %distribution_in_force,
        "policies in force"
    );
    if let Some(store) = &args.store {
        if store_has_password(store) {
            tracing::warn!(
                "the --store URL carries a password, which other users can read in the process list if it was given on the command line: set PGPASSWORD (or the whole URL in LOCKSTEP_STORE) instead"
            );
        }
    }
    let token_for_metrics = token.clone();
    let config = EnvironmentConfig {
        state_dir: args.state_dir,
        orphan_policy,
        service,
        conditional_writes: !args.unconditional_writes,
        distribution_policy: args.distribution_policy,
        max_frame_len: args.max_frame_len,
        compaction_lag: args.compaction_lag,
        api_token: token,
        allow_naive: args.experiments_allow_naive,
        store: args.store,
    };
    let env = match args.orchestrator {
        OrchestratorKind::Process if args.hosts > 0 => {
            Environment::start_with(
                config,
                lockstep_environment::process_orchestrator_on_hosts(args.hosts),
            )
            .await?
        }
        OrchestratorKind::Process => Environment::start(config).await?,
        OrchestratorKind::Kubernetes if args.hosts > 0 => {
            anyhow::bail!("--hosts places processes on simulated hosts of the process backend; pods already run on their own network stacks")
        }
        OrchestratorKind::Kubernetes => {
            let client = kube::Client::try_default()
                .await
                .context("connecting to the Kubernetes API server")?;
            let namespace = args.namespace;
            let image = args.kubernetes_image;
            let environment = args.kubernetes_environment;
            let mut resources =
                lockstep_orchestrator_kubernetes::objects::PodResources::replica_default();
            if let Some(requests) = args.kubernetes_replica_requests {
                resources.requests = requests;
            }
            if let Some(limits) = args.kubernetes_replica_limits {
                resources.limits = limits;
            }
            // The master secret of the replicas' session keys lives in the
            // cluster (Secret ENVIRONMENT-master), not in the state
            // directory: a pod's emptyDir would lose it on every restart,
            // and with it every replica's key, Secret and pod.
            let master = {
                let mut c = lockstep_orchestrator_kubernetes::KubernetesOrchestratorConfig::new(
                    namespace.clone(),
                    0,
                );
                c.environment = environment.clone();
                lockstep_orchestrator_kubernetes::KubernetesOrchestrator::new(client.clone(), c)
                    .master_secret()
                    .await
                    .context("reading (or creating) the master secret in the cluster")?
            };
            let factory: lockstep_environment::OrchestratorFactory = Box::new(move |p| {
                let mut c = lockstep_orchestrator_kubernetes::KubernetesOrchestratorConfig::new(
                    namespace, p.epoch,
                );
                c.image = image;
                c.environment = environment;
                c.resources = resources;
                c.conditional_writes = p.conditional_writes;
                Ok(std::sync::Arc::new(
                    lockstep_orchestrator_kubernetes::KubernetesOrchestrator::new(client, c),
                ))
            });
            Environment::start_with_secret(config, factory, Some(master)).await?
        }
    };
    env.set_max_answer_bytes(args.max_answer_bytes);
    if args.experiments_no_replica_restarts {
        tracing::warn!("replica restarts on controller events are off (experiment)");
        env.set_replica_restarts(false);
    }
    let metrics_note = match metrics_listener {
        Some(l) => {
            let at = l.local_addr()?;
            // Off loopback, the metrics need the API token too.
            let token = (!at.ip().is_loopback())
                .then(|| token_for_metrics.clone())
                .flatten();
            tokio::spawn(lockstep_environment::metrics::serve(
                l,
                env.metrics(),
                token,
            ));
            format!(", metrics on http://{at}/metrics")
        }
        None => String::new(),
    };
    println!(
        "lockstep: serving on {addr} (epoch {}){metrics_note}",
        env.epoch()
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    tracing::info!(%addr, epoch = env.epoch(), "serving");
    let background = (args.orphan_interval_secs > 0).then(|| {
        env.spawn_orphan_removal(std::time::Duration::from_secs(args.orphan_interval_secs))
    });
    // A replica whose ensure failed (after its catalog write) is retried.
    let retry = env.spawn_replica_retry(std::time::Duration::from_secs(5));
    let grace = std::time::Duration::from_secs(args.shutdown_grace_secs);
    let result = env.serve_until(listener, tls, shutdown, grace).await;
    retry.abort();
    if let Some(task) = background {
        task.abort();
    }
    result?;
    Ok(())
}

async fn client(server: ServerArg, command: ReplicaCommand) -> anyhow::Result<()> {
    let mut client = connect(&server).await?;
    match command {
        ReplicaCommand::Create {
            name,
            processes,
            workers,
            config,
            wait,
            timeout,
        } => {
            let r = client
                .create_replica(proto::CreateReplicaRequest {
                    name: name.clone(),
                    processes,
                    workers_per_process: workers,
                    config,
                })
                .await
                .map_err(status_err)?
                .into_inner();
            if let Some(r) = r.replica {
                println!("created replica {} (id {})", r.name, r.id);
                print_processes(&r);
            }
            if wait {
                let took =
                    wait_serving(&server, &name, std::time::Duration::from_secs(timeout)).await?;
                println!("replica {name} serving after {:.1} s", took.as_secs_f64());
            }
        }
        ReplicaCommand::Drop { name } => {
            let r = client
                .drop_replica(proto::DropReplicaRequest { name: name.clone() })
                .await
                .map_err(status_err)?
                .into_inner();
            println!("dropped replica {name} (id {})", r.id);
        }
        ReplicaCommand::List { output } => {
            let replicas = all_replicas(&mut client).await?;
            if output.json() {
                let replicas: Vec<serde_json::Value> = replicas.iter().map(replica_json).collect();
                return print_json(&serde_json::json!({ "replicas": replicas }));
            }
            let mut table = Table::new(&[
                ("ID", Align::Right),
                ("NAME", Align::Left),
                ("PROCESSES", Align::Right),
                ("WORKERS", Align::Right),
                ("SERVICE", Align::Left),
                ("EPOCH", Align::Right),
            ]);
            for r in &replicas {
                let service = if r.service.is_empty() {
                    "-"
                } else {
                    &r.service
                };
                table.row(vec![
                    r.id.to_string(),
                    r.name.clone(),
                    r.processes.to_string(),
                    r.workers_per_process.to_string(),
                    service.to_string(),
                    r.service_epoch.to_string(),
                ]);
            }
            // Each replica's line, then its processes' lines.
            let lines = table.lines();
            println!("{}", lines[0]);
            for (line, r) in lines[1..].iter().zip(&replicas) {
                println!("{line}");
                print_processes(r);
            }
        }
    }
    Ok(())
}

/// Waits (bounded by `timeout`) until replica `name` serves: its
/// grpc.health.v1 status `replica/NAME` is SERVING (its controller reached
/// every process). Returns how long that took.
async fn wait_serving(
    server: &ServerArg,
    name: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<std::time::Duration> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let started = std::time::Instant::now();
    let mut health = HealthClient::new(connect_channel(server).await?);
    let mut last = "not checked yet".to_string();
    loop {
        match health
            .check(HealthCheckRequest {
                service: format!("replica/{name}"),
            })
            .await
        {
            Ok(h) if h.get_ref().status() == ServingStatus::Serving => return Ok(started.elapsed()),
            Ok(h) => last = h.into_inner().status().as_str_name().to_string(),
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return Err(status_err(s)),
        }
        if started.elapsed() >= timeout {
            anyhow::bail!(
                "replica {name} did not serve within {} s (health: {last})",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A replica in the JSON of `lockstep replica list -o json`.
fn replica_json(r: &proto::Replica) -> serde_json::Value {
    let processes: Vec<serde_json::Value> = r
        .process_status
        .iter()
        .map(|p| {
            serde_json::json!({
                "index": p.index,
                "pid": (p.pid != 0).then_some(p.pid),
                "running": p.running,
                "restarts": p.restarts,
                "addresses": p.addresses.iter().collect::<std::collections::BTreeMap<_, _>>(),
                "frontier_lag": p.frontier_lag,
                "protocol_version": p.protocol_version,
                "build_version": p.build_version,
            })
        })
        .collect();
    serde_json::json!({
        "id": r.id,
        "name": r.name,
        "processes": r.processes,
        "workers_per_process": r.workers_per_process,
        "config": r.config,
        "service": (!r.service.is_empty()).then_some(&r.service),
        "service_epoch": r.service_epoch,
        "process_status": processes,
    })
}

fn print_processes(r: &proto::Replica) {
    for p in &r.process_status {
        let addrs: Vec<String> = p
            .addresses
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        // The agreed protocol version and the build, once the process
        // answered this session's Hello (the build from version 3 on).
        let version = match (p.protocol_version, &p.build_version) {
            (Some(v), Some(b)) => format!(" protocol {v} build {b}"),
            (Some(v), None) => format!(" protocol {v}"),
            (None, _) => String::new(),
        };
        println!(
            "    process {} pid {} {} restarts {} {}{version}",
            p.index,
            p.pid,
            if p.running { "running" } else { "down" },
            p.restarts,
            addrs.join(" ")
        );
    }
}

/// Whether a `postgres://USER:PASSWORD@HOST/...` URL carries a password.
fn store_has_password(url: &str) -> bool {
    let Some(rest) = url.split_once("://").map(|(_, r)| r) else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

#[cfg(test)]
mod store_url_tests {
    use super::store_has_password;

    #[test]
    fn a_password_in_the_store_url_is_noticed() {
        assert!(store_has_password("postgres://u:secret@db:5432/x"));
        assert!(!store_has_password("postgres://u@db:5432/x"));
        assert!(!store_has_password("postgres://db:5432/x"));
        assert!(!store_has_password("postgres://u@db:5432/x?opt=a:b"));
    }
}
