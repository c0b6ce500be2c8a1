//! Criterion benchmarks of lockstep. The benchmarks live in `benches/`; this
//! library holds the fixtures they share.

use std::time::Duration;

use lockstep_plan::Plan;
use lockstep_protocol::{DataflowDescription, Row, Update};

pub mod harness;
pub mod ingest_floor;
pub mod relay;

/// `n` rows `[i, 10 i]` at time 0, the input the peek benchmarks read.
pub fn rows(n: i64) -> Vec<Update> {
    (0..n)
        .map(|i| Update {
            row: lockstep_plan::row(&[i, i * 10]),
            time: 0,
            diff: 1,
        })
        .collect()
}

/// A small dataflow description: a filter over one input, exported.
pub fn small_dataflow(id: u64) -> DataflowDescription {
    lockstep_plan::dataflow(
        id,
        0,
        vec![1],
        &[(1000 + id, Plan::Get { collection_id: 1 })],
        format!("bench-{id}"),
    )
}

/// Columns per row written by [`payload`]; each value takes 8 bytes on the
/// wire.
pub const COLUMNS: usize = 16;

/// A dataflow exporting `get(input)` as `export`.
pub fn dataflow_over(id: u64, input: u64, export: u64) -> DataflowDescription {
    lockstep_plan::dataflow(
        id,
        0,
        vec![input],
        &[(
            export,
            Plan::Get {
                collection_id: input,
            },
        )],
        format!("bench-write-{id}"),
    )
}

/// A write of `rows` at time `t`: inserted at odd times, retracted at even
/// ones, so that a collection written at 1, 2, 3, ... stays small.
pub fn alternating_write(rows: &[Row], t: u64) -> Vec<Update> {
    let diff = if t % 2 == 1 { 1 } else { -1 };
    rows.iter()
        .map(|row| Update {
            row: row.clone(),
            time: t,
            diff,
        })
        .collect()
}

/// Rows holding `bytes` bytes of row data: [`COLUMNS`] values per row, each
/// large enough to take 8 bytes as a protobuf varint.
pub fn payload(bytes: usize) -> Vec<Row> {
    let per_row = COLUMNS * 8;
    (0..bytes / per_row)
        .map(|r| {
            let values: Vec<i64> = (0..COLUMNS)
                .map(|c| (1i64 << 50) + (r * COLUMNS + c) as i64)
                .collect();
            lockstep_plan::row(&values)
        })
        .collect()
}

/// The encoded size of a whole WriteInput of `rows` to `collection_id`
/// (one process's copy when writes are not split; without the frame's
/// length prefix).
pub fn write_len(collection_id: u64, rows: &[Row]) -> usize {
    use lockstep_protocol::WireMessage as _;
    lockstep_protocol::Command {
        seqno: 1,
        strategy: lockstep_protocol::Strategy::Barrier,
        kind: lockstep_protocol::CommandKind::WriteInput(lockstep_protocol::WriteInput {
            collection_id,
            updates: rows
                .iter()
                .map(|row| Update {
                    row: row.clone(),
                    time: 1,
                    diff: 1,
                })
                .collect(),
            upper: 2,
            more: false,
            batch_digest: None,
        }),
    }
    .encode_to_vec()
    .len()
}

/// Real replicas for benchmarks, launched through the orchestrator's process
/// backend.
pub mod replica {
    use std::net::ToSocketAddrs;
    use std::path::PathBuf;
    use std::sync::Arc;
    use std::time::Duration;

    use crate::relay::{Link, Relay};
    use lockstep_protocol::Endpoint;

    use lockstep_controller::{Controller, ReplicaAddrs, Timeouts};
    use lockstep_orchestrator::process::{
        kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
    };
    use lockstep_orchestrator::Orchestrator;
    use lockstep_policy::FixedStrategy;
    use lockstep_protocol::{CommandHistory, Strategy};

    /// The `lockstep-replica` binary: `$LOCKSTEP_REPLICA_BIN`, or the release
    /// build in `$CARGO_TARGET_DIR` or this workspace's `target/` (`cargo
    /// xtask bench` builds it).
    pub fn binary() -> PathBuf {
        if let Ok(p) = std::env::var("LOCKSTEP_REPLICA_BIN") {
            return PathBuf::from(p);
        }
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
        let p = target.join("release/lockstep-replica");
        assert!(
            p.exists(),
            "{} is missing: run `cargo build --release -p lockstep-replica` (cargo xtask bench does) or set LOCKSTEP_REPLICA_BIN",
            p.display()
        );
        p
    }

    /// A running replica and its orchestrator; killed on drop.
    pub struct BenchReplica {
        /// The orchestrator's state directory.
        pub dir: tempfile::TempDir,
        /// The orchestrator.
        pub orchestrator: ProcessOrchestrator,
        /// Where the controller connects.
        pub addrs: ReplicaAddrs,
        /// The relays of the network model ([`start_relayed`]): each
        /// process's timely port, then each process's controller port.
        pub relays: Vec<Arc<Relay>>,
    }

    impl Drop for BenchReplica {
        fn drop(&mut self) {
            let _ = kill_all_services(self.dir.path());
        }
    }

    /// Starts a replica of `processes` x `workers`, its command log a
    /// SQLite file.
    pub async fn start(replica_id: u64, processes: usize, workers: u32) -> BenchReplica {
        start_on(replica_id, processes, workers, None).await
    }

    /// Starts a replica of `processes` x `workers` running `program` (a
    /// replica binary, or a script that runs one, e.g. under valgrind), its
    /// command log a SQLite file.
    pub async fn start_program(
        program: &std::path::Path,
        replica_id: u64,
        processes: usize,
        workers: u32,
    ) -> BenchReplica {
        start_with(program, replica_id, processes, workers, None).await
    }

    /// Starts a replica of `processes` x `workers`; its command log is the
    /// log `replica-ID` in the PostgreSQL database at `postgres`, or a
    /// SQLite file in its directory.
    pub async fn start_on(
        replica_id: u64,
        processes: usize,
        workers: u32,
        postgres: Option<&str>,
    ) -> BenchReplica {
        start_with(&binary(), replica_id, processes, workers, postgres).await
    }

    async fn start_with(
        program: &std::path::Path,
        replica_id: u64,
        processes: usize,
        workers: u32,
        postgres: Option<&str>,
    ) -> BenchReplica {
        let dir = tempfile::tempdir().expect("tempdir");
        let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1))
            .expect("orchestrator");
        let log = match postgres {
            Some(url) => lockstep_controller::LogLocation::Postgres {
                url: url.to_string(),
                name: format!("replica-{replica_id}"),
            },
            None => lockstep_controller::LogLocation::Sqlite(dir.path().join("command-log.sqlite")),
        };
        let service = lockstep_launch::replica_service(program, replica_id, processes, workers);
        let addrs = ensure(&orchestrator, service, log, workers).await;
        BenchReplica {
            dir,
            orchestrator,
            addrs,
            relays: Vec::new(),
        }
    }

    /// Has `orchestrator` run `service` with its command log at `log` (and
    /// its processes logging errors only); returns the controller's
    /// addresses.
    async fn ensure(
        orchestrator: &ProcessOrchestrator,
        service: lockstep_orchestrator::ServiceConfig,
        log: lockstep_controller::LogLocation,
        workers: u32,
    ) -> ReplicaAddrs {
        let config = lockstep_launch::with_command_log(service, &log).env("RUST_LOG", "error");
        let status = orchestrator
            .ensure_service(config)
            .await
            .expect("ensure replica");
        let mut addrs = lockstep_launch::replica_addrs(&status, workers).expect("controller ports");
        addrs.command_log = Some(log);
        addrs
    }

    /// Starts a replica of `processes` x `workers` (command log: a SQLite
    /// file) whose every connection goes through a [`Relay`] on `link`: each
    /// process reaches each other process's timely port through a relay, and
    /// the controller reaches each process through one. The link's delay
    /// can change while the replica runs.
    pub async fn start_relayed(
        replica_id: u64,
        processes: usize,
        workers: u32,
        link: Arc<Link>,
    ) -> BenchReplica {
        let dir = tempfile::tempdir().expect("tempdir");
        let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(dir.path(), 1))
            .expect("orchestrator");
        let log = lockstep_controller::LogLocation::Sqlite(dir.path().join("command-log.sqlite"));
        let mesh: Vec<Arc<Relay>> = (0..processes)
            .map(|_| Arc::new(Relay::start(link.clone()).expect("relay")))
            .collect();
        let m = mesh.clone();
        let service = lockstep_launch::replica_service_with_peers(
            &binary(),
            replica_id,
            processes,
            workers,
            {
                move |process, peers| {
                    peers
                        .into_iter()
                        .enumerate()
                        .map(|(j, real)| {
                            let target = real
                                .to_socket_addrs()
                                .ok()
                                .and_then(|mut a| a.next())
                                .expect("a peer address");
                            m[j].set_target(target);
                            if j == process {
                                real
                            } else {
                                m[j].addr().to_string()
                            }
                        })
                        .collect()
                }
            },
        );
        let mut addrs = ensure(&orchestrator, service, log, workers).await;
        let mut relays = mesh;
        for endpoint in &mut addrs.processes {
            let target = endpoint.socket_addr().expect("a controller socket address");
            let relay = Relay::to(target, link.clone()).expect("relay");
            *endpoint = Endpoint::from(relay.addr());
            relays.push(Arc::new(relay));
        }
        BenchReplica {
            dir,
            orchestrator,
            addrs,
            relays,
        }
    }

    /// The last `n` lines of each of the replica's process logs.
    pub fn log_tail(r: &BenchReplica, n: usize) -> String {
        let mut out = String::new();
        let Ok(entries) = std::fs::read_dir(r.dir.path().join("logs")) else {
            return out;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {}\n", path.display()));
            for l in &lines[lines.len().saturating_sub(n)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Asserts that every worker of `before` reports the same creation log in
    /// `after`: reconciliation rebuilt nothing.
    pub fn assert_nothing_rebuilt(
        before: &[lockstep_protocol::Status],
        after: &[lockstep_protocol::Status],
    ) {
        assert_eq!(before.len(), after.len(), "a worker is missing");
        for (x, y) in before.iter().zip(after) {
            assert_eq!(
                x.creation_log, y.creation_log,
                "worker {} rebuilt a dataflow",
                y.worker_index
            );
        }
    }

    /// A controller of `r` with one strategy for every command.
    pub fn controller(r: &BenchReplica, strategy: Strategy) -> Controller {
        controller_with(r, strategy, 1, CommandHistory::new())
    }

    /// A controller of `r` at `epoch`, rehydrating `history`.
    pub fn controller_with(
        r: &BenchReplica,
        strategy: Strategy,
        epoch: u64,
        history: CommandHistory,
    ) -> Controller {
        Controller::start(
            r.addrs.clone(),
            epoch,
            history,
            Box::new(FixedStrategy(strategy)),
            Timeouts {
                request: Duration::from_secs(30),
                ..Timeouts::default()
            },
        )
    }
}

/// Records a benchmark that was not measured: `what` (a strategy or a
/// store), `shape` and why, as one tab-separated line appended to the file
/// named by `$LOCKSTEP_BENCH_SKIPS` if set (`cargo xtask bench` reports
/// them). Only the first line of `why` is kept.
pub fn record_skip(what: &str, shape: &str, why: &str) {
    use std::io::Write as _;
    let why = why.lines().next().unwrap_or_default().replace('\t', " ");
    if let Ok(path) = std::env::var("LOCKSTEP_BENCH_SKIPS") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{what}\t{shape}\t{why}");
        }
    }
}

/// Differential by itself, the limit the replica's ingest is held to:
/// `batches` into an `InputSession` feeding an arrangement in one timely
/// worker in this process, batch `i` at time `first + i`, the input
/// advanced past each batch as it goes in. With `wait_each`, every batch is
/// stepped until the probe passes it (one write at a time); without, the
/// batches go in back to back and the probe is awaited once. The rows are
/// made by the caller, before the clock starts; the time from the first
/// batch until the probe passes the last.
pub fn differential_ingest<D>(batches: Vec<Vec<D>>, first: u64, wait_each: bool) -> Duration
where
    D: differential_dataflow::ExchangeData + differential_dataflow::Hashable + Sync,
{
    timely::execute_directly(move |worker| {
        use differential_dataflow::input::InputSession;
        use timely::dataflow::operators::Probe;
        let mut input: InputSession<u64, D, i64> = InputSession::new();
        let probe = timely::dataflow::ProbeHandle::new();
        worker.dataflow::<u64, _, _>(|scope| {
            input
                .to_collection(scope)
                .arrange_by_self()
                .stream
                .probe_with(&probe);
        });
        input.advance_to(first);
        let end = first + batches.len() as u64;
        let start = std::time::Instant::now();
        for (t, batch) in (first..).zip(batches) {
            for row in batch {
                input.update_at(row, t, 1);
            }
            input.advance_to(t + 1);
            input.flush();
            while wait_each && probe.less_than(&(t + 1)) {
                worker.step();
            }
        }
        while probe.less_than(&end) {
            worker.step();
        }
        start.elapsed()
    })
}
