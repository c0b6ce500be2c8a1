//! `lockstep-replica`: one process of a lockstep replica.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use lockstep_protocol::{ProcessIdentity, DEFAULT_MAX_FRAME_LEN};
use lockstep_replica::{run, ReplicaConfig};

/// One process of a lockstep replica.
#[derive(Parser, Debug)]
#[command(name = "lockstep-replica", version)]
struct Args {
    /// The replica's catalog ID.
    #[arg(long)]
    replica_id: u64,
    /// This process's index, in 0..process-count.
    #[arg(long)]
    process_index: u32,
    /// Timely workers in this process.
    #[arg(long, default_value_t = 1)]
    workers: u32,
    /// Every process's timely address, comma-separated, in process order.
    #[arg(long, value_delimiter = ',', required = true)]
    timely_addrs: Vec<SocketAddr>,
    /// Where controllers connect.
    #[arg(long)]
    listen: SocketAddr,
    /// Seconds to wait for every peer before giving up.
    #[arg(long, default_value_t = 30)]
    cluster_timeout_secs: u64,
    /// The largest frame accepted from a controller, in bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_FRAME_LEN)]
    max_frame_len: usize,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    lockstep_replica::server::install_panic_exit();
    let args = Args::parse();
    let config = ReplicaConfig {
        identity: ProcessIdentity {
            replica_id: args.replica_id,
            process_index: args.process_index,
            process_count: args.timely_addrs.len() as u32,
            workers_per_process: args.workers,
        },
        timely_addrs: args.timely_addrs,
        listen: args.listen,
        cluster_timeout: Duration::from_secs(args.cluster_timeout_secs),
        max_frame_len: args.max_frame_len,
    };
    if let Err(e) = run(config) {
        eprintln!("lockstep-replica: error: {e:#}");
        std::process::exit(1);
    }
}
