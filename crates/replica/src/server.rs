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
//! Before its Hello is proved (S1), a connection costs a bounded amount and
//! cannot keep a proving controller out: at most
//! [`MAX_UNPROVEN_CONNECTIONS`] wait, a new one past the cap closes the
//! oldest, each has [`HELLO_DEADLINE`] for its whole first frame, and those
//! closed before proof are counted into at most one log line per
//! [`REFUSAL_LOG_INTERVAL`].

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::Duration;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use lockstep_protocol::handshake::check_hello;
use lockstep_protocol::secure::SecureCodec;
use lockstep_protocol::{
    CodecError, Command, CommandKind, Endpoint, ErrorKind, ErrorResponse, ProcessIdentity,
    ReplicaCodec, Response, ResponseKind, HELLO_MAX_FRAME_LEN,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

use crate::aggregate::Aggregator;
use crate::cluster;
use crate::worker::{run_worker, session_of, FromWorker};

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
}

struct Shared {
    newest_epoch: u64,
    generation: u64,
    writer: Option<mpsc::UnboundedSender<Response>>,
    /// The session (see `session_of`) of the current connection.
    writer_session: lockstep_reconcile::Session,
    /// The newest session the local workers started.
    workers_session: lockstep_reconcile::Session,
    /// Responses produced while no connection of the workers' session was
    /// current. Under broadcast
    /// and log a worker can start a session (a Hello read from the mesh or
    /// the log) before this process accepted that session's connection;
    /// what it answers then waits here for the connection. Emptied when a
    /// newer session starts; bounded by [`MAX_PENDING_RESPONSES`].
    pending: std::collections::VecDeque<Response>,
}

/// The most responses kept while no controller is connected.
pub const MAX_PENDING_RESPONSES: usize = 100_000;

struct Workers {
    senders: Vec<std_mpsc::Sender<Command>>,
    threads: Mutex<Vec<Thread>>,
}

impl Workers {
    fn send(&self, cmd: &Command) {
        for s in &self.senders {
            // A closed channel means the worker is gone; the process is exiting.
            let _ = s.send(cmd.clone());
        }
        for t in self.threads.lock().expect("not poisoned").iter() {
            t.unpark();
        }
    }
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

/// Runs one replica process until it is killed.
pub fn run(config: ReplicaConfig) -> anyhow::Result<()> {
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
    let timely_addrs = cluster::resolve_peers(&config.timely_peers, config.cluster_timeout)?;
    let listen_ip = config.listen_host.unwrap_or(timely_addrs[me].ip());
    let controller_addr = SocketAddr::new(listen_ip, config.controller_port);
    let listener = std::net::TcpListener::bind(controller_addr)
        .with_context(|| format!("cannot listen for controllers on {controller_addr}"))?;
    listener.set_nonblocking(true)?;
    if let Some(location) = &config.command_log {
        // Fail fast, before forming the cluster, on a log that cannot be
        // used. The launcher normally created it already (reading needs no
        // lock); a process started by hand creates it.
        if lockstep_command_log::AnyLog::open_reader(location).is_err() {
            lockstep_command_log::AnyLog::open(location)?;
        }
    }

    let sockets = cluster::connect_mesh(
        &timely_addrs,
        SocketAddr::new(listen_ip, timely_addrs[me].port()),
        me,
        cluster::MeshId {
            replica_id: id.replica_id,
            generation: config.generation,
        },
        config.session_key.as_ref(),
        config.cluster_timeout,
    )?;
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
    });
    let handles2 = Arc::clone(&handles);
    let command_log = config.command_log.clone();
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
            run_worker(worker, commands, tx.clone(), workers, log);
        },
    )
    .map_err(|e| anyhow::anyhow!("starting timely workers: {e}"))?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve(listener, config, handles, rx))
}

async fn serve(
    listener: std::net::TcpListener,
    config: ReplicaConfig,
    workers: Arc<Workers>,
    mut from_workers: mpsc::UnboundedReceiver<FromWorker>,
) -> anyhow::Result<()> {
    let listener = TcpListener::from_std(listener)?;
    let shared = Arc::new(Mutex::new(Shared {
        newest_epoch: 0,
        generation: 0,
        writer: None,
        writer_session: 0,
        workers_session: 0,
        pending: std::collections::VecDeque::new(),
    }));
    let process_index = config.identity.process_index;
    let local_workers = config.identity.workers_per_process as usize;

    // Worker responses -> the current connection.
    let shared2 = Arc::clone(&shared);
    tokio::spawn(async move {
        let mut agg = Aggregator::new(local_workers);
        while let Some(msg) = from_workers.recv().await {
            if let FromWorker::NewSession { session, .. } = &msg {
                if agg.session() != Some(*session) {
                    let mut s = shared2.lock().expect("not poisoned");
                    s.pending.clear();
                    s.workers_session = s.workers_session.max(*session);
                }
            }
            for kind in agg.on(msg) {
                let response = Response {
                    process_index,
                    kind,
                };
                let mut s = shared2.lock().expect("not poisoned");
                match &s.writer {
                    Some(w) if s.writer_session >= s.workers_session => {
                        let _ = w.send(response);
                    }
                    _ => {
                        if s.pending.len() == MAX_PENDING_RESPONSES {
                            s.pending.pop_front();
                            tracing::warn!(
                                "no controller connected; dropping the oldest kept response"
                            );
                        }
                        s.pending.push_back(response);
                    }
                }
            }
        }
    });

    // Connections that have not proved a Hello yet, capped (S1): past the
    // cap the OLDEST unproven one is closed and the new one admitted, so a
    // flood of idle connections costs a bounded amount and can never keep
    // a proving controller out. What is refused before proof is counted
    // and summarized, not logged line by line.
    let admission = Arc::new(Mutex::new(Admission::default()));
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
    loop {
        let (sock, peer) = listener.accept().await?;
        let (id, cancel) = {
            let mut a = admission.lock().expect("not poisoned");
            let evicted = a.admit();
            if let Some(oldest) = evicted {
                oldest.cancel();
            }
            a.queue
                .back()
                .map(|(id, c)| (*id, c.clone()))
                .expect("admitted")
        };
        let unproven = Unproven {
            admission: Some(Arc::clone(&admission)),
            id,
        };
        let _ = sock.set_nodelay(true);
        tracing::debug!(%peer, "controller connected");
        let shared = Arc::clone(&shared);
        let workers = Arc::clone(&workers);
        let config = config.clone();
        let refusals = Arc::clone(&refusals);
        tokio::spawn(async move {
            match connection(sock, config, shared, workers, unproven, cancel).await {
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

/// Connections a process keeps while they have not proved a Hello; past
/// it, the oldest of them is closed to admit a new one.
pub const MAX_UNPROVEN_CONNECTIONS: usize = 64;

/// The time a connection has, from its accept, to deliver a whole first
/// frame (its Hello) and have it checked; after it, it is closed.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// At most one summary line of connections refused before proof per this
/// interval (a key-less client must not be able to grow the log).
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The unproven connections, oldest first, each with the token that closes
/// it.
#[derive(Default)]
struct Admission {
    next_id: u64,
    queue: std::collections::VecDeque<(u64, tokio_util::sync::CancellationToken)>,
}

impl Admission {
    /// Admits one more connection (the last of the queue); returns the
    /// oldest one's token if the cap made room by evicting it.
    fn admit(&mut self) -> Option<tokio_util::sync::CancellationToken> {
        let evicted = if self.queue.len() >= MAX_UNPROVEN_CONNECTIONS {
            self.queue.pop_front().map(|(_, c)| c)
        } else {
            None
        };
        self.next_id += 1;
        self.queue
            .push_back((self.next_id, tokio_util::sync::CancellationToken::new()));
        evicted
    }
}

/// Holds a connection's place among the unproven until dropped or
/// [`Unproven::proven`].
struct Unproven {
    admission: Option<Arc<Mutex<Admission>>>,
    id: u64,
}

impl Unproven {
    fn proven(&mut self) {
        if let Some(a) = self.admission.take() {
            let mut a = a.lock().expect("not poisoned");
            if let Some(i) = a.queue.iter().position(|(id, _)| *id == self.id) {
                a.queue.remove(i);
            }
        }
    }
}

impl Drop for Unproven {
    fn drop(&mut self) {
        self.proven();
    }
}

/// Why a connection ended before it proved a Hello: counted, not logged
/// one by one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Refusal {
    /// Closed to admit a newer connection past [`MAX_UNPROVEN_CONNECTIONS`].
    Evicted,
    /// No checked Hello within [`HELLO_DEADLINE`].
    TimedOut,
    /// Closed by the peer before a first frame.
    Closed,
    /// A first frame that does not decode (or is too long).
    Malformed,
    /// A Hello refused by the checks (proof, version, epoch, shape).
    RefusedHello,
    /// A Hello not newer than the current session.
    Replayed,
    /// No session: the peer did not prove the session key.
    NotProven,
}

impl Refusal {
    fn name(self) -> &'static str {
        match self {
            Refusal::Evicted => "evicted",
            Refusal::TimedOut => "timed_out",
            Refusal::Closed => "closed",
            Refusal::Malformed => "malformed",
            Refusal::RefusedHello => "refused_hello",
            Refusal::Replayed => "replayed",
            Refusal::NotProven => "not_proven",
        }
    }
}

/// How a connection ended, if not cleanly.
enum Ended {
    /// Before its Hello was proved and accepted: counted.
    Unproven((Refusal, String)),
    /// After: logged.
    Proven(anyhow::Error),
}

impl From<anyhow::Error> for Ended {
    fn from(e: anyhow::Error) -> Self {
        Ended::Proven(e)
    }
}

/// The connections refused before proof since the last summary line.
#[derive(Default)]
struct Refusals {
    counts: std::collections::BTreeMap<Refusal, u64>,
    last: Option<(SocketAddr, String)>,
    last_logged: Option<std::time::Instant>,
}

impl Refusals {
    /// Counts one refusal; logs a summary if none was logged within the
    /// interval.
    fn note(&mut self, (refusal, detail): (Refusal, String), peer: SocketAddr) {
        *self.counts.entry(refusal).or_default() += 1;
        self.last = Some((peer, format!("{}: {detail}", refusal.name())));
        self.flush();
    }

    /// Logs the summary of what was counted, unless one was logged within
    /// the interval; at most one line.
    fn flush(&mut self) {
        if self.counts.is_empty() {
            return;
        }
        if self
            .last_logged
            .is_some_and(|t| t.elapsed() < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        let total: u64 = self.counts.values().sum();
        let by_reason = self
            .counts
            .iter()
            .map(|(r, n)| format!("{}:{n}", r.name()))
            .collect::<Vec<_>>()
            .join(",");
        let (peer, last) = self.last.take().expect("set with the counts");
        tracing::warn!(
            total,
            %by_reason,
            %peer,
            %last,
            "controller-port connections closed before a proved Hello (summary, at most one line per {:?})",
            REFUSAL_LOG_INTERVAL
        );
        self.counts.clear();
        self.last_logged = Some(std::time::Instant::now());
    }
}

/// What a process sends instead of a response of `len` bytes, over the frame
/// limit `max`: the peek's error answer, or an error.
fn too_large(process_index: u32, peek_id: Option<u64>, len: usize, max: usize) -> Response {
    tracing::warn!(
        len,
        max,
        ?peek_id,
        "a response exceeds the frame limit; answering with an error"
    );
    match peek_id {
        Some(peek_id) => Response {
            process_index,
            kind: ResponseKind::PeekResponse(lockstep_protocol::PeekResponse {
                peek_id,
                result: lockstep_protocol::PeekResult::Error(format!(
                    "the answer of process {process_index} is {len} bytes, over the frame limit of {max} bytes; peek a narrower collection"
                )),
            }),
        },
        None => error_response(
            process_index,
            ErrorKind::InvalidCommand,
            format!("a response of {len} bytes exceeds the frame limit of {max} bytes and was dropped"),
            0,
        ),
    }
}

fn error_response(process_index: u32, kind: ErrorKind, message: String, seqno: u64) -> Response {
    Response {
        process_index,
        kind: ResponseKind::Error(ErrorResponse {
            kind,
            message,
            seqno,
        }),
    }
}

/// Reads and checks a connection's first frame; a refusal is answered (an
/// Error response) and returned with its reason.
async fn handshake(
    framed: &mut Framed<TcpStream, SecureCodec<ReplicaCodec>>,
    config: &ReplicaConfig,
    shared: &Mutex<Shared>,
) -> Result<(Command, lockstep_protocol::Hello, u32), (Refusal, String)> {
    let me = config.identity.process_index;
    let first = match framed.next().await {
        None => return Err((Refusal::Closed, "closed before a Hello".into())),
        Some(Err(e)) => {
            let _ = framed
                .send(error_response(me, ErrorKind::Malformed, e.to_string(), 0))
                .await;
            return Err((Refusal::Malformed, format!("malformed first frame: {e}")));
        }
        Some(Ok(cmd)) => cmd,
    };
    let newest = shared.lock().expect("not poisoned").newest_epoch;
    let (hello, protocol_version) = match check_hello(
        &first,
        &config.identity,
        newest,
        config.session_key.as_ref(),
    ) {
        Ok(accepted) => (accepted.hello, accepted.protocol_version),
        Err(e) => {
            let _ = framed
                .send(Response {
                    process_index: me,
                    kind: ResponseKind::Error(e.to_response()),
                })
                .await;
            return Err((Refusal::RefusedHello, format!("refused Hello: {e}")));
        }
    };
    // A Hello of a session that is not newer than the current one is a
    // replay (or a duplicate): taking it would cut the current controller
    // off. Every real connection attempt carries a new nonce.
    let current = shared.lock().expect("not poisoned").writer_session;
    let session = session_of(hello.epoch, hello.nonce);
    if current != 0 && session <= current {
        let _ = framed
            .send(error_response(
                me,
                ErrorKind::StaleEpoch,
                format!(
                    "Hello of epoch {} nonce {} is not newer than the current session; replayed or duplicated, refused",
                    hello.epoch, hello.nonce
                ),
                0,
            ))
            .await;
        return Err((
            Refusal::Replayed,
            format!(
                "refused a replayed Hello (epoch {}, nonce {})",
                hello.epoch, hello.nonce
            ),
        ));
    }
    Ok((first, hello, protocol_version))
}

async fn connection(
    sock: TcpStream,
    config: ReplicaConfig,
    shared: Arc<Mutex<Shared>>,
    workers: Arc<Workers>,
    mut unproven: Unproven,
    evict: tokio_util::sync::CancellationToken,
) -> Result<(), Ended> {
    let me = config.identity.process_index;
    // Until a Hello is accepted, frames are capped at HELLO_MAX_FRAME_LEN:
    // nothing sent before the handshake makes the process buffer or decode
    // more than that.
    //
    // Handshake: with a session key, first the session (the controller
    // proves the key, this process proves it back, and every frame after
    // is encrypted and authenticated: `lockstep_protocol::secure`), then the
    // whole first frame, its checks and any refusal sent, all within one
    // deadline; closed at once if a newer connection evicts it.
    let setup = async {
        let mut sock = sock;
        let session = match (&config.session_key, config.one_way_proof) {
            (Some(key), false) => Some(
                lockstep_protocol::secure::respond(&mut sock, key, config.identity.replica_id, me)
                    .await
                    .map_err(|e| (Refusal::NotProven, format!("no session: {e}")))?,
            ),
            _ => None,
        };
        let mut framed = Framed::new(
            sock,
            SecureCodec::new(
                ReplicaCodec::new(config.max_frame_len.min(HELLO_MAX_FRAME_LEN)),
                session,
            ),
        );
        let accepted = handshake(&mut framed, &config, &shared).await?;
        Ok::<_, (Refusal, String)>((framed, accepted))
    };
    let (mut framed, (first, hello, protocol_version)) = tokio::select! {
        () = evict.cancelled() => {
            return Err(Ended::Unproven((Refusal::Evicted, format!(
                "{MAX_UNPROVEN_CONNECTIONS} connections were waiting for their Hello; closed the oldest"
            ))));
        }
        r = tokio::time::timeout(HELLO_DEADLINE, setup) => match r {
            Err(_) => {
                return Err(Ended::Unproven((
                    Refusal::TimedOut,
                    format!("no Hello within {HELLO_DEADLINE:?}"),
                )))
            }
            Ok(Err(refusal)) => return Err(Ended::Unproven(refusal)),
            Ok(Ok(accepted)) => accepted,
        },
    };
    unproven.proven();
    framed
        .codec_mut()
        .inner_mut()
        .set_max_frame_len(config.max_frame_len);
    let (mut sink, mut stream) = framed.split();

    // This connection becomes the current one.
    let (wtx, mut wrx) = mpsc::unbounded_channel::<Response>();
    let generation = {
        let mut s = shared.lock().expect("not poisoned");
        if hello.epoch < s.newest_epoch {
            return Err(
                anyhow::anyhow!("stale epoch {} (newest {})", hello.epoch, s.newest_epoch).into(),
            );
        }
        s.newest_epoch = hello.epoch;
        s.generation += 1;
        s.writer_session = session_of(hello.epoch, hello.nonce);
        // From version 3 on, the agreed version and this build come first,
        // before any Status of the session (a version-2 controller would
        // not know the message, so it gets none).
        if protocol_version >= 3 {
            let _ = wtx.send(Response {
                process_index: me,
                kind: ResponseKind::HelloResponse(lockstep_protocol::HelloResponse {
                    protocol_version,
                    build_version: env!("CARGO_PKG_VERSION").to_string(),
                }),
            });
        }
        if s.writer_session >= s.workers_session {
            for r in s.pending.drain(..) {
                let _ = wtx.send(r);
            }
        }
        s.writer = Some(wtx);
        workers.send(&first);
        s.generation
    };
    tracing::info!(
        epoch = hello.epoch,
        nonce = hello.nonce,
        protocol_version,
        "controller session started"
    );

    let max_frame_len = config.max_frame_len;
    let writer = tokio::spawn(async move {
        while let Some(r) = wrx.recv().await {
            // A peek answer too large for one frame goes in parts.
            let r = match r.kind {
                ResponseKind::PeekResponse(p) => {
                    let process_index = r.process_index;
                    let mut parts = p.split(max_frame_len / 2).into_iter();
                    let last = parts.next_back().expect("at least one part");
                    let mut failed = false;
                    for part in parts {
                        let part = Response {
                            process_index,
                            kind: ResponseKind::PeekResponse(part),
                        };
                        if sink.send(part).await.is_err() {
                            failed = true;
                            break;
                        }
                    }
                    if failed {
                        break;
                    }
                    Response {
                        process_index,
                        kind: ResponseKind::PeekResponse(last),
                    }
                }
                kind => Response { kind, ..r },
            };
            let process_index = r.process_index;
            let peek_id = match &r.kind {
                ResponseKind::PeekResponse(p) => Some(p.peek_id),
                _ => None,
            };
            match sink.send(r).await {
                Ok(()) => {}
                // A response too large for one frame is answered with an
                // error instead (the codec checks the length before writing
                // anything): the process must not go silent, be restarted
                // and be asked the same peek again, forever.
                Err(CodecError::FrameTooLarge { len, max }) => {
                    let replacement = too_large(process_index, peek_id, len, max);
                    if sink.send(replacement).await.is_err() {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        let _ = sink.close().await;
    });

    let mut expected = 1u64;
    let result = loop {
        let next = stream.next().await;
        let current = shared.lock().expect("not poisoned").generation == generation;
        if !current {
            break Ok(()); // a newer controller session took over
        }
        let cmd: Command = match next {
            None => break Ok(()),
            Some(Err(CodecError::Io(e))) => break Err(anyhow::anyhow!("connection lost: {e}")),
            Some(Err(e)) => {
                send_current(
                    &shared,
                    generation,
                    error_response(me, ErrorKind::Malformed, e.to_string(), expected),
                );
                break Err(anyhow::anyhow!("malformed frame: {e}"));
            }
            Some(Ok(cmd)) => cmd,
        };
        if matches!(cmd.kind, CommandKind::Hello(_)) || cmd.seqno != expected {
            let msg = if matches!(cmd.kind, CommandKind::Hello(_)) {
                "Hello in the middle of a connection".to_string()
            } else {
                format!("expected sequence number {expected}, got {}", cmd.seqno)
            };
            send_current(
                &shared,
                generation,
                error_response(me, ErrorKind::Sequence, msg.clone(), cmd.seqno),
            );
            break Err(anyhow::anyhow!(msg));
        }
        expected += 1;
        let s = shared.lock().expect("not poisoned");
        if s.generation != generation {
            break Ok(());
        }
        workers.send(&cmd);
    };
    {
        let mut s = shared.lock().expect("not poisoned");
        if s.generation == generation {
            s.writer = None;
        }
    }
    // Give queued responses (an error, say) a moment to leave.
    let _ = tokio::time::timeout(Duration::from_millis(200), writer).await;
    result.map_err(Ended::Proven)
}

fn send_current(shared: &Arc<Mutex<Shared>>, generation: u64, r: Response) {
    let s = shared.lock().expect("not poisoned");
    if s.generation == generation {
        if let Some(w) = &s.writer {
            let _ = w.send(r);
        }
    }
}
