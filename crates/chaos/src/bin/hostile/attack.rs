//! The attackers, and what they see of the ports' admission bounds.
//!
//! Every connection an attacker holds is watched: when the port closes it,
//! and how many are open per port. With the bounds, a port keeps at most
//! its small unproven pool of them (the oldest closed past the cap) and
//! closes each at its deadline whatever it sent; a port that holds many
//! more for [`OVER_CAP_FOR`], or one that outlives its deadline by
//! [`DEADLINE_SLACK`], breaks R1. Calls without the token (or with a wrong
//! one, or scrapes with the API token) that are served break R1 too.

use super::*;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use plan::{Attack, Kind, Port};

/// What an attacker sees of one port.
pub(crate) struct PortWatch {
    /// The port.
    pub(crate) port: Port,
    /// Its address.
    pub(crate) addr: SocketAddr,
    /// The most unproven connections it may hold (its pool's cap at most).
    pub(crate) cap: usize,
    /// How long it may hold an unproven connection.
    pub(crate) deadline: Duration,
    /// Attackers' connections open now (connected, not seen closed).
    pub(crate) open: AtomicUsize,
    /// The most seen open at once.
    pub(crate) most: AtomicUsize,
    /// Connections made.
    pub(crate) made: AtomicUsize,
    /// Connections the port closed.
    pub(crate) closed: AtomicUsize,
    /// Whether a connection past its deadline was reported (once a port).
    outlived: AtomicBool,
}

impl PortWatch {
    /// The watch of `port` at `addr`.
    pub(crate) fn new(port: Port, addr: SocketAddr) -> PortWatch {
        let (cap, deadline) = match port {
            Port::Api => (
                lockstep_environment::listeners::API_UNPROVEN,
                lockstep_environment::listeners::API_HANDSHAKE_DEADLINE,
            ),
            Port::Metrics => (
                lockstep_environment::listeners::METRICS_UNPROVEN,
                METRICS_HEAD_TIMEOUT,
            ),
            Port::Controller(_) => (
                lockstep_replica::server::MAX_UNPROVEN_CONNECTIONS,
                lockstep_replica::server::HELLO_DEADLINE,
            ),
        };
        PortWatch {
            port,
            addr,
            cap,
            deadline,
            open: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            made: AtomicUsize::new(0),
            closed: AtomicUsize::new(0),
            outlived: AtomicBool::new(false),
        }
    }

    /// Counts a connection made, and open.
    fn opened(&self) {
        self.made.fetch_add(1, Relaxed);
        let now = self.open.fetch_add(1, Relaxed) + 1;
        self.most.fetch_max(now, Relaxed);
    }
}

/// Connects to `addr` within a second.
async fn connect(addr: SocketAddr) -> Option<TcpStream> {
    tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr))
        .await
        .ok()?
        .ok()
}

/// Connects to `addr`, trying again (a SYN dropped in a burst, a process
/// restarting) until `until`.
async fn connect_until(addr: SocketAddr, until: Instant, shared: &Shared) -> Option<TcpStream> {
    while Instant::now() < until && !shared.stopped() {
        if let Some(s) = connect(addr).await {
            return Some(s);
        }
        shared.pause(Duration::from_millis(100)).await;
    }
    None
}

/// Holds one connection to `watch`'s port until `until`, after sending
/// `first` (if any) at once, or `trickle` one byte per second. Returns
/// whether the port closed it (and when, from its connect).
async fn hold_one(
    watch: &PortWatch,
    mut sock: TcpStream,
    first: &[u8],
    trickle: &[u8],
    until: Instant,
    shared: &Shared,
) -> Option<Duration> {
    let connected = Instant::now();
    watch.opened();
    if !first.is_empty() {
        let _ = sock.write_all(first).await;
    }
    let (mut rd, mut wr) = sock.split();
    let mut buf = [0u8; 512];
    let mut next_byte = 0usize;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let closed = loop {
        tokio::select! {
            r = rd.read(&mut buf) => match r {
                // Whatever a port answers (an error, a 401), the attacker
                // reads on until it closes.
                Ok(n) if n > 0 => continue,
                _ => break true,
            },
            _ = tick.tick(), if !trickle.is_empty() => {
                let b = trickle[next_byte % trickle.len()];
                next_byte += 1;
                if wr.write_all(&[b]).await.is_err() {
                    break true;
                }
            }
            () = tokio::time::sleep_until(until.into()) => break false,
            () = shared.stop.cancelled() => break false,
        }
    };
    watch.open.fetch_sub(1, Relaxed);
    if closed {
        watch.closed.fetch_add(1, Relaxed);
        return Some(connected.elapsed());
    }
    // Still open at the end: past its deadline, the port kept an unproven
    // connection it must have closed.
    let lived = connected.elapsed();
    if lived > watch.deadline + DEADLINE_SLACK && !watch.outlived.swap(true, Relaxed) {
        shared.fail(violation(
            "R1",
            format!(
                "{}: an unproven connection stayed open {:.1} s (the port's deadline is {:?})",
                watch.port,
                lived.as_secs_f64(),
                watch.deadline
            ),
        ));
    }
    None
}

/// Runs `attack` against `watch`'s port, from `t0 + start` for its hold.
pub(crate) async fn run(
    attack: Attack,
    watch: Arc<PortWatch>,
    t0: Instant,
    env: EnvView,
    shared: Arc<Shared>,
) {
    let begin = t0 + attack.start;
    let until = begin + attack.hold;
    tokio::select! {
        () = tokio::time::sleep_until(begin.into()) => {}
        () = shared.stop.cancelled() => return,
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..attack.count {
        let watch = watch.clone();
        let shared = shared.clone();
        let env = env.clone();
        tasks.spawn(async move {
            // A burst, in waves of 64 connections 10 ms apart.
            shared
                .pause(Duration::from_millis(10 * (i / 64) as u64))
                .await;
            match attack.kind {
                Kind::Flood => {
                    if let Some(s) = connect_until(watch.addr, until, &shared).await {
                        hold_one(&watch, s, &[], &[], until, &shared).await;
                    }
                }
                Kind::HalfOpen(_, bytes) => {
                    if let Some(s) = connect_until(watch.addr, until, &shared).await {
                        hold_one(&watch, s, bytes, &[], until, &shared).await;
                    }
                }
                Kind::Trickle(_, bytes) => {
                    // Spread the trickles over the first second.
                    shared
                        .pause(Duration::from_millis(37 * i as u64 % 1000))
                        .await;
                    while Instant::now() < until && !shared.stopped() {
                        match connect(watch.addr).await {
                            Some(s) => {
                                hold_one(&watch, s, &[], bytes, until, &shared).await;
                            }
                            None => shared.pause(Duration::from_millis(200)).await,
                        }
                        // Closed by the port: a slowloris comes back.
                        shared.pause(Duration::from_millis(500)).await;
                    }
                }
                Kind::NoToken | Kind::WrongToken => {
                    let token =
                        (attack.kind == Kind::WrongToken).then(|| format!("{}x", "0".repeat(63)));
                    unauthorized_calls(&env.api, token, until, &shared).await;
                }
                Kind::UnauthorizedScrape => {
                    // Odd callers show the API token, even ones none.
                    let token = (i % 2 == 1).then(|| env.api.token.clone());
                    unauthorized_scrapes(watch.addr, token, until, &shared).await;
                }
                Kind::UnfinishedMessages => {
                    while Instant::now() < until && !shared.stopped() {
                        match connect(watch.addr).await {
                            Some(s) => unfinished_messages(&watch, s, until, &shared).await,
                            None => shared.pause(Duration::from_millis(200)).await,
                        }
                        shared.pause(Duration::from_millis(200)).await;
                    }
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// One token-less HTTP/2 connection on `sock`: unfinished health checks
/// ([`lockstep_chaos::unproven::unfinished_health_checks`]), up to
/// [`UNFINISHED_BYTES`], then held until `until` or until the port closes
/// it. Counted among the port's open connections meanwhile.
async fn unfinished_messages(watch: &PortWatch, sock: TcpStream, until: Instant, shared: &Shared) {
    watch.opened();
    let closed = tokio::select! {
        closed = lockstep_chaos::unproven::unfinished_health_checks(sock, UNFINISHED_BYTES, until) => closed,
        () = shared.stop.cancelled() => false,
    };
    watch.open.fetch_sub(1, Relaxed);
    if closed {
        watch.closed.fetch_add(1, Relaxed);
    }
}

/// API calls without the token (or with `token`, a wrong one) on new
/// connections until `until`: every one must be refused.
async fn unauthorized_calls(api: &Api, token: Option<String>, until: Instant, shared: &Shared) {
    while Instant::now() < until && !shared.stopped() {
        let call = async {
            let mut c = api
                .client_with(token.as_deref(), Duration::from_secs(2))
                .await
                .ok()?;
            Some(
                c.list_replicas(proto::ListReplicasRequest::default())
                    .await
                    .map(|_| ()),
            )
        };
        match tokio::time::timeout(Duration::from_secs(3), call).await {
            Ok(Some(Ok(()))) => {
                shared.fail(violation(
                    "R1",
                    format!(
                        "an API call {} was served",
                        if token.is_some() {
                            "with a wrong token"
                        } else {
                            "without a token"
                        }
                    ),
                ));
                return;
            }
            Ok(Some(Err(s))) if s.code() == tonic::Code::Unauthenticated => {
                shared.stats.refused_calls.fetch_add(1, Relaxed);
            }
            _ => {}
        }
        shared.pause(Duration::from_millis(200)).await;
    }
}

/// `GET /metrics` on `addr` with `Authorization: Bearer TOKEN` (if any)
/// on a new connection: the status line, if it answered within 3 s.
pub(crate) async fn scrape(addr: SocketAddr, token: Option<&str>) -> Result<String, String> {
    let go = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n").as_bytes())
            .await
            .map_err(|e| format!("sending: {e}"))?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)
            .await
            .map_err(|e| format!("reading: {e}"))?;
        let text = String::from_utf8_lossy(&out);
        Ok(text.lines().next().unwrap_or("(nothing)").to_string())
    };
    tokio::time::timeout(Duration::from_secs(3), go)
        .await
        .map_err(|_| "no answer within 3 s".to_string())?
}

/// Scrapes without the metrics token (none, or `token`: the API token)
/// until `until`: none may be answered 200.
async fn unauthorized_scrapes(
    addr: SocketAddr,
    token: Option<String>,
    until: Instant,
    shared: &Shared,
) {
    while Instant::now() < until && !shared.stopped() {
        if let Ok(status) = scrape(addr, token.as_deref()).await {
            if status.starts_with("HTTP/1.1 200") {
                shared.fail(violation(
                    "R1",
                    format!(
                        "the metrics endpoint answered a scrape {}: {status}",
                        if token.is_some() {
                            "with the API token"
                        } else {
                            "without a token"
                        }
                    ),
                ));
                return;
            }
            shared.stats.refused_scrapes.fetch_add(1, Relaxed);
        }
        shared.pause(Duration::from_millis(200)).await;
    }
}

/// Watches `watch`'s port until `until`: the attackers' connections it
/// holds open must not stay above its cap (with [`OVER_CAP_SLACK`]) for
/// [`OVER_CAP_FOR`].
pub(crate) async fn watch_cap(watch: Arc<PortWatch>, until: Instant, shared: Arc<Shared>) {
    let mut over_since: Option<Instant> = None;
    while Instant::now() < until && !shared.stopped() {
        let open = watch.open.load(Relaxed);
        if open > watch.cap + OVER_CAP_SLACK {
            let since = *over_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= OVER_CAP_FOR {
                shared.fail(violation(
                    "R1",
                    format!(
                        "{} held {open} unproven connections for {:.1} s (its pool holds at most {})",
                        watch.port,
                        since.elapsed().as_secs_f64(),
                        watch.cap
                    ),
                ));
                return;
            }
        } else {
            over_since = None;
        }
        shared.pause(Duration::from_millis(250)).await;
    }
}
