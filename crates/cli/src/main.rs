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

#[cfg(feature = "server")]
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

mod api_client;
mod compute_cli;
mod family_bytes;
mod output;
mod replica_cli;
use api_client::*;
use output::{print_json, Align, OutputArg, Table};
use replica_cli::*;
// What needs the environment library (feature `server`, on by default):
// `lockstep serve`, `policy check` (wasmtime), and the demo, a harness the
// binary runs. Without it the binary is the client alone. The soak is test
// machinery: only with feature `soak` (`cargo xtask soak` builds it).
#[cfg(feature = "server")]
mod demo;
#[cfg(feature = "server")]
mod serve_child;
#[cfg(feature = "server")]
mod serve_cli;
#[cfg(feature = "soak")]
mod soak;
use compute_cli::status_err;
#[cfg(feature = "server")]
use serve_cli::*;

use anyhow::Context;
#[cfg(feature = "server")]
use clap::ValueEnum;
use clap::{Parser, Subcommand};
use lockstep_api::proto;
use lockstep_api::proto::environment_client::EnvironmentClient;
#[cfg(feature = "server")]
use lockstep_environment::{EnvError, Environment, EnvironmentConfig, ServiceTemplate};

/// The exit code of a controller that halted because another took over
/// (not 2, which clap gives a usage error).
#[cfg(feature = "server")]
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
    /// The log format on stderr: `text`, or `json` (one JSON object per
    /// line, with the spans); the replica processes `lockstep serve` starts
    /// log the same way.
    #[arg(long, global = true, env = LOG_FORMAT_ENV, default_value = "text",
          value_parser = ["text", "json"])]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the environment: open the catalog, ensure replicas, remove orphans, serve.
    #[cfg(feature = "server")]
    Serve(Box<ServeArgs>),
    /// A one-screen summary of a running environment: its epoch, orphan
    /// rule and the dataflow format its replicas build, and per replica its
    /// shape, processes, restarts, lag, read holds, dataflows caught up and
    /// whether it serves (answers a ping); a line per reconfiguration under
    /// way.
    ///
    /// `-o json`: `{"server", "epoch", "orphan_rule", "format" (null: an
    /// environment too old to say), "orphans_removed": [NAME],
    /// "reconfigurations_settled": [LINE] (interrupted upgrades and resizes
    /// this environment settled at its start),
    /// "replicas": [{"name", "id", "processes", "workers_per_process",
    /// "running", "restarts", "frontier_lag": [N or null per process],
    /// "read_holds", "read_hold_span", "live_dataflows",
    /// "dataflows_caught_up" (null: no controller), "reconfiguration" (the
    /// phase, or null), "serving": "SERVING" | "NOT_SERVING" | "UNKNOWN" |
    /// null (not checked yet)}]}`.
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
    ///
    /// The environment is asked which format it serves. A row of the
    /// built-in family prints as its comma-separated integers; a row of
    /// another family as its text if it is printable (UTF-8, not empty, no
    /// control character but tab, no whitespace but space and tab, no
    /// invisible format character, not starting with `0x` or `@`: the text
    /// `input write --update TEXT@T` takes), else as `0x` and its bytes in
    /// hex. A text row may hold tabs: the count is the last field.
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
        /// Print every row as `0x` and its bytes in hex, whatever its
        /// family.
        #[arg(long)]
        hex: bool,
    },
    /// Stream a collection's changes (prints `time<TAB>row<TAB>diff` lines).
    ///
    /// Rows print as `peek` prints them (integers, text or hex, by the
    /// format the environment serves); a text row may hold tabs: the time
    /// is the first field, the diff the last.
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
        /// Print every row as `0x` and its bytes in hex, whatever its
        /// family.
        #[arg(long)]
        hex: bool,
        /// When the connection is lost (the environment restarted, the
        /// network cut), reconnect and resume after the last time fully
        /// received: every change printed exactly once. Gives up after
        /// --resume-timeout of trying.
        #[arg(long)]
        resume: bool,
        /// How long --resume keeps trying to reconnect.
        #[arg(long, default_value_t = 120, value_name = "SECONDS")]
        resume_timeout: u64,
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
    #[cfg(feature = "server")]
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
    /// Print the man page lockstep(1) (roff), e.g. `lockstep man | man -l -`;
    /// with `--out DIR`, write it and one page per subcommand
    /// (lockstep-serve.1, lockstep-replica.1, ...) to DIR.
    Man {
        /// The directory to write every page to.
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
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
    /// killed and restarted between rounds; writes a JSON report (built
    /// with feature `soak` only).
    #[cfg(feature = "soak")]
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
    /// `http://HOST:PORT`, `https://HOST:PORT`, or `HOST:PORT` (plain HTTP).
    #[arg(
        long = "server",
        global = true,
        env = "LOCKSTEP_ADDR",
        default_value = "http://127.0.0.1:6875",
        value_parser = server_url
    )]
    url: String,
    /// A file holding the environment's API token (its first line). Without
    /// it: LOCKSTEP_API_TOKEN, then the file LOCKSTEP_TOKEN_FILE names, then
    /// the token `lockstep serve` made in its state directory (--state-dir).
    #[arg(long, global = true)]
    token_file: Option<PathBuf>,
    /// The environment's state directory, whose `api.token` (made by
    /// `lockstep serve`, readable by its user only) this command sends.
    #[arg(long, global = true, env = "LOCKSTEP_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The CA certificate (PEM) to check an https:// server against.
    #[arg(long, global = true)]
    tls_ca: Option<PathBuf>,
    /// Send the API token over plain HTTP to a TCP address that nothing
    /// proves (e.g. a container's published port). Without it the client
    /// refuses to: it talks to the state directory's socket
    /// (`--state-dir`) or to an https:// address.
    #[arg(long, global = true, env = "LOCKSTEP_INSECURE_PLAINTEXT")]
    insecure_plaintext: bool,
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Load WASM policies, run the scenarios of their kind, and print one
    /// JSON line per policy (the reporting contract); exit 1 on a failure.
    #[cfg(feature = "server")]
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
        /// An update as `ROW@TIME[:DIFF]` (repeat): TIME is what follows the
        /// last `@` (a row may hold `@`), DIFF (default 1, negative
        /// retracts) what follows the `:` after it. ROW is, for every
        /// family, `0xHEX` (the row's bytes in hex) or `@FILE` (the bytes of
        /// FILE as they are; for the built-in family its encoding, the
        /// columns as varints: a packed protobuf `repeated int64`), e.g.
        /// `@row.bin@3`. Otherwise, by the
        /// format the environment serves: for the built-in family
        /// comma-separated integers, e.g. `1,10@0` or `1,10@2:-1` (nothing:
        /// the row of no columns); for another family TEXT, its UTF-8 bytes
        /// as written (never read as integers), e.g. `hello@0`. Write a row
        /// that starts with `0x` or `@` in a file.
        #[arg(long = "update", allow_hyphen_values = true)]
        updates: Vec<String>,
        /// The new upper: every update's time must be below it.
        #[arg(long)]
        upper: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logs(&cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lockstep: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        #[cfg(feature = "server")]
        Command::Serve(args) => serve_command(runtime, *args),
        Command::Status { server, output } => {
            finish(runtime.block_on(status_summary(server, output)))
        }
        Command::Man { out } => finish(man_pages(out)),
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
            hex,
        } => finish(runtime.block_on(async move {
            compute_cli::peek(&mut connect(&server).await?, replica, collection, at, hex).await
        })),
        Command::Subscribe {
            server,
            replica,
            collection,
            as_of,
            until,
            hex,
            resume,
            resume_timeout,
        } => finish(runtime.block_on(async move {
            compute_cli::subscribe(
                &mut connect(&server).await?,
                replica,
                collection,
                as_of,
                until,
                hex,
                resume.then(|| std::time::Duration::from_secs(resume_timeout)),
            )
            .await
        })),
        #[cfg(feature = "server")]
        Command::Policy {
            command: PolicyCommand::Check { files },
            ..
        } => policy_check(&files),
        Command::Policy {
            server,
            command: PolicyCommand::Set { file, replica },
        } => finish(runtime.block_on(policy_set(server, file, replica))),
        Command::Policy {
            server,
            command: PolicyCommand::Show { output },
        } => finish(runtime.block_on(policy_show(server, output))),
        #[cfg(feature = "server")]
        Command::Demo { keep, store, hosts } => {
            finish(runtime.block_on(demo::run(keep, store, hosts)))
        }
        #[cfg(feature = "soak")]
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

/// Logs to stderr: the level from LOCKSTEP_LOG (default info); with
/// `--log-format json` (or LOCKSTEP_LOG_FORMAT=json) one JSON object per
/// line with its message and fields at the top level, and the spans (a controller's `replica`). The variable is set for
/// the replica processes to inherit (the orchestrator passes it on); nothing
/// else runs yet, so setting it is safe.
fn init_logs(format: &str) {
    if format == "json" {
        std::env::set_var(LOG_FORMAT_ENV, "json");
    }
    // No ANSI colour where stderr is not a terminal (a file, a pipe, CI).
    let logs = tracing_subscriber::fmt()
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOCKSTEP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    if format == "json" {
        logs.json().flatten_event(true).init();
    } else {
        logs.init();
    }
}

/// `lockstep serve`: exit 3 on a halt (O3), 1 on another error.
#[cfg(feature = "server")]
fn serve_command(runtime: tokio::runtime::Runtime, args: ServeArgs) -> ExitCode {
    // A panic anywhere (a failpoint included) crashes the controller,
    // as a real crash would, instead of killing one request's task.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        std::process::abort();
    }));
    let _failpoints = fail::FailScenario::setup();
    let result = runtime.block_on(serve(args));
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

/// `lockstep policy set FILE [--replica R]`.
async fn policy_set(
    server: ServerArg,
    file: PathBuf,
    replica: Option<String>,
) -> anyhow::Result<()> {
    let wasm = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let p = connect(&server)
        .await?
        .set_policy(proto::SetPolicyRequest {
            // Its file name without the extension, as
            // `lockstep_policy_host::policy_name` says.
            name: file.file_stem().map_or_else(
                || file.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            ),
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
}

/// `lockstep policy show`: the policies in force, as a table or JSON.
async fn policy_show(server: ServerArg, output: OutputArg) -> anyhow::Result<()> {
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
}

#[cfg(feature = "server")]
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

/// The man pages (`clap_mangen`, from the same definitions as `--help`).
fn man_pages(out: Option<PathBuf>) -> anyhow::Result<()> {
    use clap::CommandFactory;
    let cmd = Cli::command();
    match out {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(cmd, &dir)
                .with_context(|| format!("writing the man pages to {}", dir.display()))?;
            println!("man pages written to {}", dir.display());
            Ok(())
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(cmd).render(&mut page)?;
            output::write_stdout(&page)
        }
    }
}

fn finish(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockstep: error: {}", describe_error(&e));
            ExitCode::FAILURE
        }
    }
}

/// A `--server` value: `HOST:PORT` without a scheme is `http://HOST:PORT`.
fn server_url(value: &str) -> Result<String, String> {
    let url = if value.contains("://") {
        value.to_string()
    } else {
        format!("http://{value}")
    };
    match url.parse::<tonic::codegen::http::Uri>() {
        Ok(uri) if uri.host().is_some() && matches!(uri.scheme_str(), Some("http" | "https")) => {
            Ok(url)
        }
        _ => Err(format!(
            "{value:?} is not an address: give HOST:PORT, http://HOST:PORT or https://HOST:PORT"
        )),
    }
}

/// An error's chain in lockstep's words: an answer of the API as its gRPC
/// code's name and the environment's message (`NOT_FOUND: no replica r9`),
/// not tonic's English description of the code.
fn describe_error(e: &anyhow::Error) -> String {
    e.chain()
        .map(|cause| match cause.downcast_ref::<tonic::Status>() {
            Some(status) => format!("{}: {}", code_name(status.code()), status.message()),
            None => cause.to_string(),
        })
        .collect::<Vec<_>>()
        .join(": ")
}

/// The name gRPC gives `code` (`NOT_FOUND`, `UNAUTHENTICATED`, ...).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
