//! The process: timely cluster, workers, and the controller connections.
//!
//! The controller connects to every process directly. A connection starts
//! with Hello, checked by [`lockstep_protocol::handshake::check_hello`]
//! (versions, epoch, replica shape); at an agreed version of 3 or more the
//! process answers with a `HelloResponse` (the version and its build)
//! before its workers' statuses. An accepted Hello makes that connection
//! the current one: a connection opened by an older controller session stops
//! being read and its responses stop. Under broadcast and log, workers may
//! start a session (a Hello from the mesh or the log) before this process
//! accepted that session's connection: their responses wait for it. Commands must arrive with consecutive
//! sequence numbers; a gap, a malformed frame or an unknown variant gets an
//! Error response and closes the connection, never a panic. Each accepted
//! command goes, in order, to every local worker.
//!
//! Before its Hello is proved (S1, R1), a connection costs a bounded amount
//! and cannot keep a proving controller out: at most
//! [`MAX_UNPROVEN_CONNECTIONS`] wait (controller handshakes and metrics
//! scrapes in one pool, `lockstep_admission`), a new one past the cap
//! closes the oldest, each has [`HELLO_DEADLINE`] for its whole first frame
//! (or its whole scrape), and those closed before proof are counted into at
//! most one log line per [`REFUSAL_LOG_INTERVAL`]. The caps come from the
//! process's descriptor budget ([`process_budget`]), and no failed accept
//! ends the server.

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use lockstep_protocol::handshake::check_hello;
use lockstep_protocol::{
    CodecError, Command, CommandKind, Endpoint, ErrorKind, ErrorResponse, ProcessIdentity,
    Response, ResponseKind, Update, WriteInput, HELLO_MAX_FRAME_LEN,
};
use lockstep_transport::secure::SecureCodec;
use lockstep_transport::ReplicaCodec;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

use crate::aggregate::Aggregator;
use crate::cluster;
use crate::metrics::Counted;
use crate::worker::{run_worker, session_of, FromWorker};

mod connection;
mod outbox;
mod unproven;

use connection::*;
use outbox::Outbox;
pub use outbox::MAX_PENDING_RESPONSES;
use unproven::*;
pub use unproven::{
    controller_share, HELLO_DEADLINE, MAX_PROVEN_CONNECTIONS, MAX_UNPROVEN_CONNECTIONS,
    REFUSAL_LOG_INTERVAL,
};

/// How a replica process is started.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    /// Who this process is.
    pub identity: ProcessIdentity,
    /// Every process's timely address (`host:port`, a name or an IP), in
    /// process order; this process's own entry is the address it advertises.
    pub timely_peers: Vec<Endpoint>,
    /// The address both listeners bind (`0.0.0.0`, a pod IP); `None`: the
    /// address this process's own `timely_peers` entry resolves to.
    pub listen_host: Option<IpAddr>,
    /// The port controllers connect to.
    pub controller_port: u16,
    /// Listening sockets inherited from the orchestrator, used instead of
    /// binding the ports.
    pub inherited: Inherited,
    /// The bound on resolving the peers and forming the timely cluster.
    pub cluster_timeout: Duration,
    /// The largest frame accepted.
    pub max_frame_len: usize,
    /// The command log of the `log` strategy, if the replica has one.
    pub command_log: Option<lockstep_command_log::LogLocation>,
    /// The replica's session key: when set, a Hello that does not prove it
    /// is refused before any other check (S1).
    pub session_key: Option<lockstep_protocol::SessionKey>,
    /// The generation the orchestrator started this process in: timely
    /// peers of another generation are refused (`cluster`).
    pub generation: u64,
    /// With a session key, accept a Hello that proves it on plain frames
    /// and never prove the key back, as before sessions were mutual. The
    /// negative control `no-mutual` of the security suite only.
    pub one_way_proof: bool,
    /// The dataflow family this process builds (the built-in one is
    /// [`crate::family::PlanFamily`]).
    pub family: Arc<dyn crate::family::Family>,
    /// The build version the process reports to controllers
    /// (`HelloResponse`): lockstep's, or a family binary's own
    /// ([`crate::Builder::version`]).
    pub build_version: String,
}

/// Listening sockets a process inherits (descriptor numbers), by port.
#[derive(Clone, Copy, Debug, Default)]
pub struct Inherited {
    /// The controller port's listener.
    pub controller: Option<std::os::fd::RawFd>,
    /// The timely port's listener.
    pub timely: Option<std::os::fd::RawFd>,
}

impl Inherited {
    /// Parses `NAME=FD,...` (`controller`, `timely`; empty: none).
    pub fn parse(spec: &str) -> Result<Inherited, String> {
        let mut out = Inherited::default();
        for item in spec.split(',').filter(|i| !i.is_empty()) {
            let (name, fd) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} is not NAME=FD"))?;
            let fd: std::os::fd::RawFd = fd
                .parse()
                .ok()
                .filter(|fd| *fd > 2)
                .ok_or_else(|| format!("{item:?}: not a descriptor above 2"))?;
            match name {
                "controller" => out.controller = Some(fd),
                "timely" => out.timely = Some(fd),
                other => return Err(format!("unknown port name {other:?}")),
            }
        }
        Ok(out)
    }
}

/// The inherited listener at descriptor `fd`, checked: a TCP socket bound
/// to `addr` (else an error naming both).
fn inherited_listener(
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
) -> anyhow::Result<std::net::TcpListener> {
    use std::os::fd::FromRawFd;
    // SAFETY: the descriptor was named by the orchestrator that started
    // this process and is owned by nothing else in it; it is taken once,
    // here. What it is, is checked next.
    #[allow(unsafe_code)]
    let listener = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    let bound = listener
        .local_addr()
        .with_context(|| format!("inherited descriptor {fd} is not a listening socket"))?;
    if bound != addr {
        anyhow::bail!("inherited descriptor {fd} is bound to {bound}, not to {addr}");
    }
    Ok(listener)
}

/// The descriptors a replica process keeps for its own work beside the
/// controller port: its timely mesh (one socket per peer), its command
/// log (SQLite's database, `-wal` and `-shm`, or a PostgreSQL
/// connection), its log file, the runtime's own (epoll, eventfds) and
/// timely's threads.
pub const REPLICA_RESERVE: u64 = lockstep_admission::MIN_RESERVE;

/// A replica process's budget: the soft descriptor limit raised to the
/// hard one, [`REPLICA_RESERVE`] (or a quarter of the limit) kept, the
/// controller port's caps from the rest.
pub fn process_budget() -> anyhow::Result<lockstep_admission::Budget> {
    let budget = lockstep_admission::Budget::for_process(REPLICA_RESERVE, &[controller_share()])?;
    crate::metrics::METRICS.budget.set(&budget);
    Ok(budget)
}

struct Shared {
    newest_epoch: u64,
    generation: u64,
    /// The current connection, and responses waiting for their session's.
    outbox: Outbox,
}

struct Workers {
    senders: Vec<std_mpsc::Sender<Command>>,
    threads: Mutex<Vec<Thread>>,
    /// The global index of this process's first worker.
    first: usize,
    /// Workers in the replica.
    peers: usize,
}

impl Workers {
    /// Hands `cmd` to every worker of this process: a write that each
    /// worker takes from its own process's copy goes to each worker as the
    /// rows it owns, moved once ([`route_write`]); anything else as a copy
    /// each.
    fn send(&self, cmd: Command) {
        let local = self.senders.len();
        match route_write(cmd, self.first, self.peers, local) {
            // A closed channel means the worker is gone; the process is exiting.
            Routed::Each(each) => {
                for (s, cmd) in self.senders.iter().zip(each) {
                    let _ = s.send(cmd);
                }
            }
            Routed::Whole(cmd) => {
                for s in &self.senders {
                    let _ = s.send(cmd.clone());
                }
            }
        }
        for t in self.threads.lock().expect("not poisoned").iter() {
            t.unpark();
        }
    }
}

/// A command for this process's workers: one each, or the same for all.
#[derive(Debug, PartialEq)]
enum Routed {
    /// Local worker `i` takes the `i`th.
    Each(Vec<Command>),
    /// Every worker takes a copy.
    Whole(Command),
}

/// Splits a write among this process's `local` workers (global indexes
/// `first..first + local` of `peers`): each gets the updates of the rows
/// it owns ([`crate::worker::owner`], the rule a worker keeps rows by),
/// moved, where each would otherwise take a copy of all of them and drop
/// the rest. Only a write every worker applies from its own process's copy
/// ([`lockstep_reconcile::socket_ordered`]: never one a sequencer forwards
/// or the log holds), in one part, carrying the whole write's digest (a
/// worker's history counts the whole write), and whose every update lies
/// below its upper (one that does not is refused by every worker alike, so
/// each sees all of it). Anything else comes back as it was.
fn route_write(cmd: Command, first: usize, peers: usize, local: usize) -> Routed {
    let routable = local > 1
        && lockstep_reconcile::socket_ordered(cmd.strategy)
        && matches!(&cmd.kind, CommandKind::WriteInput(w)
            if !w.more
                && w.batch_digest.is_some()
                && w.updates.iter().all(|u| u.time < w.upper));
    if !routable {
        return Routed::Whole(cmd);
    }
    let Command {
        seqno,
        strategy,
        kind: CommandKind::WriteInput(write),
    } = cmd
    else {
        unreachable!("checked above")
    };
    let mut shares: Vec<Vec<Update>> = vec![Vec::new(); local];
    for u in write.updates {
        let owner = crate::worker::owner(&u.row, peers);
        // Another process's row (a whole write): no worker here keeps it.
        if let Some(share) = owner.checked_sub(first).and_then(|i| shares.get_mut(i)) {
            share.push(u);
        }
    }
    Routed::Each(
        shares
            .into_iter()
            .map(|updates| Command {
                seqno,
                strategy,
                kind: CommandKind::WriteInput(WriteInput {
                    collection_id: write.collection_id,
                    updates,
                    upper: write.upper,
                    more: false,
                    batch_digest: write.batch_digest,
                }),
            })
            .collect(),
    )
}

/// Makes every panic, on any thread, end the process: a timely peer that died
/// poisons the cluster, and a half-alive process must not pretend to work.
pub fn install_panic_exit() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        eprintln!("lockstep-replica: a thread panicked; exiting so the replica can be restarted");
        std::process::exit(70);
    }));
}

/// On SIGTERM (a pod deleted, `kill`), exits at once with 0, whatever the
/// process is doing (forming its cluster included; as PID 1 of a container
/// SIGTERM would otherwise be ignored). Nothing needs flushing: the next
/// generation rebuilds from the controller's history, and the peers see
/// the mesh close as they would a crash (shared fate).
fn exit_on_sigterm() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let mut terminate = runtime
        .block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        })
        .context("installing the SIGTERM handler")?;
    std::thread::Builder::new()
        .name("sigterm".into())
        .spawn(move || {
            runtime.block_on(terminate.recv());
            tracing::info!("SIGTERM: exiting");
            std::process::exit(0);
        })?;
    Ok(())
}

/// Runs one replica process until it is killed (or SIGTERM).
pub fn run(config: ReplicaConfig) -> anyhow::Result<()> {
    exit_on_sigterm()?;
    let id = config.identity;
    let me = id.process_index as usize;
    let workers = id.workers_per_process as usize;
    if config.timely_peers.len() != id.process_count as usize {
        anyhow::bail!(
            "{} timely addresses given for a replica of {} processes",
            config.timely_peers.len(),
            id.process_count
        );
    }
    if me >= config.timely_peers.len() {
        anyhow::bail!(
            "process index {me} is out of range for {} processes",
            id.process_count
        );
    }
    if workers == 0 {
        anyhow::bail!("a process needs at least one worker");
    }
    let started = std::time::Instant::now();
    let budget = process_budget()?;
    tracing::info!("{}", budget.summary());
    let timely_addrs = cluster::resolve_peers(&config.timely_peers, config.cluster_timeout)?;
    let listen_ip = config.listen_host.unwrap_or(timely_addrs[me].ip());
    let controller_addr = SocketAddr::new(listen_ip, config.controller_port);
    let listener = match config.inherited.controller {
        Some(fd) => inherited_listener(fd, controller_addr)?,
        None => std::net::TcpListener::bind(controller_addr)
            .with_context(|| format!("cannot listen for controllers on {controller_addr}"))?,
    };
    listener.set_nonblocking(true)?;
    if let Some(location) = &config.command_log {
        // Fail fast, before forming the cluster, on a log that cannot be
        // used. The launcher normally created it already (reading needs no
        // lock); a process started by hand creates it.
        if lockstep_command_log::AnyLog::open_reader(location).is_err() {
            lockstep_command_log::AnyLog::open(location)?;
        }
    }

    let mesh_id = cluster::MeshId {
        replica_id: id.replica_id,
        generation: config.generation,
    };
    let formed_by = std::time::Instant::now() + config.cluster_timeout;
    let timely_addr = SocketAddr::new(listen_ip, timely_addrs[me].port());
    let timely_listener = match config.inherited.timely {
        Some(fd) => inherited_listener(fd, timely_addr)?,
        None => std::net::TcpListener::bind(timely_addr).map_err(|source| {
            cluster::ClusterError::Bind {
                addr: timely_addr,
                source,
            }
        })?,
    };
    // Kept open for the process's life (never accepted on again): its port
    // stays bound, so no other socket takes it while the environment that
    // holds it too is down.
    let sockets = cluster::connect_mesh_on(
        &timely_listener,
        &timely_addrs,
        me,
        mesh_id,
        config.session_key.as_ref(),
        config.cluster_timeout,
    )?;
    // With a key, the mesh is encrypted after its handshake (S1).
    let sockets = match &config.session_key {
        Some(key) => cluster::encrypt_mesh(sockets, key, mesh_id, me, formed_by)?,
        None => sockets,
    };
    crate::metrics::METRICS
        .mesh_peers
        .set(sockets.iter().flatten().count() as i64);
    let (builders, guard) = cluster::allocators(sockets, me, workers)?;
    tracing::info!(elapsed = ?started.elapsed(), generation = config.generation, "timely cluster formed");

    let (tx, rx) = mpsc::unbounded_channel::<FromWorker>();
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..workers {
        let (s, r) = std_mpsc::channel();
        senders.push(s);
        receivers.push(Some(r));
    }
    let receivers = Arc::new(Mutex::new(receivers));
    let handles = Arc::new(Workers {
        senders,
        threads: Mutex::new(Vec::new()),
        first: me * workers,
        peers: id.process_count as usize * workers,
    });
    let handles2 = Arc::clone(&handles);
    let command_log = config.command_log.clone();
    let family = Arc::clone(&config.family);
    let _guards = timely::execute::execute_from(
        builders,
        Box::new(guard),
        timely::WorkerConfig::default(),
        move |worker| {
            let local = worker.index() % workers;
            handles2
                .threads
                .lock()
                .expect("not poisoned")
                .push(std::thread::current());
            let commands = receivers.lock().expect("not poisoned")[local]
                .take()
                .expect("each local worker starts once");
            let log = command_log.as_ref().map(|location| {
                lockstep_command_log::AnyLog::open_reader(location).unwrap_or_else(|e| {
                    // Opened once already above: only a vanished file or an
                    // unreachable database gets here.
                    panic!("worker {}: {e}", worker.index())
                })
            });
            run_worker(
                worker,
                commands,
                tx.clone(),
                workers,
                log,
                Arc::clone(&family),
            );
        },
    )
    .map_err(|e| anyhow::anyhow!("starting timely workers: {e}"))?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve(listener, config, budget, handles, rx))
}

async fn serve(
    listener: std::net::TcpListener,
    config: ReplicaConfig,
    budget: lockstep_admission::Budget,
    workers: Arc<Workers>,
    mut from_workers: mpsc::UnboundedReceiver<FromWorker>,
) -> anyhow::Result<()> {
    let listener = TcpListener::from_std(listener)?;
    let shared = Arc::new(Mutex::new(Shared {
        newest_epoch: 0,
        generation: 0,
        outbox: Outbox::default(),
    }));
    let process_index = config.identity.process_index;
    let local_workers = config.identity.workers_per_process as usize;

    // Worker responses -> the current connection.
    let shared2 = Arc::clone(&shared);
    tokio::spawn(async move {
        let mut agg = Aggregator::new(local_workers);
        while let Some(msg) = from_workers.recv().await {
            if let FromWorker::NewSession { session, .. } = &msg {
                shared2
                    .lock()
                    .expect("not poisoned")
                    .outbox
                    .workers_started(*session);
            }
            for kind in agg.on(msg) {
                let response = Response {
                    process_index,
                    kind,
                };
                shared2
                    .lock()
                    .expect("not poisoned")
                    .outbox
                    .deliver(response);
            }
        }
    });

    // Connections that have not proved a Hello yet (controller handshakes
    // and metrics scrapes alike) share one small pool with one deadline
    // (S1, R1): past its cap the OLDEST unproven one is closed and the new
    // one admitted, so a flood of idle connections costs a bounded amount
    // and can never keep a proving controller out. A proven controller
    // holds one of the few proven slots. What is refused before proof is
    // counted and summarized, not logged line by line.
    let pool =
        lockstep_admission::Pool::new("controller", budget.caps("controller"), HELLO_DEADLINE)
            .with_gauges(crate::metrics::METRICS.budget.used.clone());
    let refusals = Arc::new(Mutex::new(Refusals::default()));
    {
        let refusals = Arc::clone(&refusals);
        tokio::spawn(async move {
            // Checked ten times an interval: a summary is due once the
            // interval since the last one has passed.
            let mut tick = tokio::time::interval(REFUSAL_LOG_INTERVAL / 10);
            loop {
                tick.tick().await;
                refusals.lock().expect("not poisoned").flush();
            }
        });
    }
    // The accept never fails: out of descriptors it backs off and goes on
    // (R1: no server stops on a resource error).
    let mut accept_errors = lockstep_admission::AcceptErrors::new("controller");
    loop {
        // A permit first: evicted connections not closed yet still count,
        // so a starved machine cannot run the process out of descriptors.
        let ready = pool.ready().await;
        let (sock, peer) = lockstep_admission::accept(&listener, &mut accept_errors).await;
        let slot = pool.admit_ready(ready);
        let _ = sock.set_nodelay(true);
        tracing::debug!(%peer, "controller connected");
        let shared = Arc::clone(&shared);
        let workers = Arc::clone(&workers);
        let config = config.clone();
        let refusals = Arc::clone(&refusals);
        tokio::spawn(async move {
            match connection(sock, config, shared, workers, slot).await {
                Ok(()) => {}
                Err(Ended::Unproven(reason)) => {
                    refusals.lock().expect("not poisoned").note(reason, peer);
                }
                Err(Ended::Proven(e)) => {
                    tracing::warn!(%peer, "controller connection ended: {e}");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_protocol::Strategy;

    fn write(rows: i64, upper: u64, digest: bool) -> Command {
        let w = WriteInput {
            collection_id: 7,
            updates: (0..rows)
                .map(|i| Update {
                    row: lockstep_plan::row(&[i]),
                    time: 1,
                    diff: 1,
                })
                .collect(),
            upper,
            more: false,
            batch_digest: None,
        };
        let w = if digest { w.digested() } else { w };
        Command {
            seqno: 3,
            strategy: Strategy::Barrier,
            kind: CommandKind::WriteInput(w),
        }
    }

    fn rows_of(cmd: &Command) -> Vec<Update> {
        match &cmd.kind {
            CommandKind::WriteInput(w) => w.updates.clone(),
            _ => panic!("not a write"),
        }
    }

    /// Each local worker gets exactly the rows it would have kept of a
    /// copy of the whole write, with the write's digest, sequence number
    /// and upper; nothing is routed that a worker must see whole.
    #[test]
    fn a_write_is_routed_to_the_workers_that_keep_its_rows() {
        // Process 1 of a 2x2 replica: global workers 2 and 3.
        let cmd = write(1000, 2, true);
        let whole = rows_of(&cmd);
        let Routed::Each(routed) = route_write(cmd.clone(), 2, 4, 2) else {
            panic!("not routed")
        };
        assert_eq!(routed.len(), 2);
        for (i, r) in routed.iter().enumerate() {
            let kept: Vec<Update> = whole
                .iter()
                .filter(|u| crate::worker::owner(&u.row, 4) == 2 + i)
                .cloned()
                .collect();
            assert!(!kept.is_empty());
            assert_eq!(rows_of(r), kept);
            let (CommandKind::WriteInput(a), CommandKind::WriteInput(b)) = (&r.kind, &cmd.kind)
            else {
                unreachable!()
            };
            assert_eq!((r.seqno, a.upper, a.batch_digest), (3, 2, b.batch_digest));
        }
        // Not routed: a sequencer's or the log's command, a write without
        // the whole write's digest, one part of several, one with an
        // update at or past its upper, a process of one worker.
        for strategy in [Strategy::Broadcast, Strategy::Log] {
            let mut c = cmd.clone();
            c.strategy = strategy;
            assert_eq!(route_write(c.clone(), 2, 4, 2), Routed::Whole(c));
        }
        let c = write(10, 2, false);
        assert_eq!(route_write(c.clone(), 2, 4, 2), Routed::Whole(c));
        let c = write(10, 1, true);
        assert_eq!(route_write(c.clone(), 2, 4, 2), Routed::Whole(c));
        let mut c = write(10, 2, true);
        if let CommandKind::WriteInput(w) = &mut c.kind {
            w.more = true;
        }
        assert_eq!(route_write(c.clone(), 2, 4, 2), Routed::Whole(c));
        assert_eq!(route_write(cmd.clone(), 0, 1, 1), Routed::Whole(cmd));
    }
}
