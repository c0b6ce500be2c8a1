//! The environment's listeners (R1): which connections of the API and the
//! metrics endpoint are admitted, on [`lockstep_admission`]: the
//! environment's descriptor budget, one pool per port, and the proof of an
//! API connection.
//!
//! - The budget ([`process_budget`]): the soft descriptor limit raised to
//!   the hard one, [`ENVIRONMENT_RESERVE`] (or a quarter of the limit) kept
//!   for the catalog, command logs, process logs, the supervisor and the
//!   connections to replica processes, the rest split between the API and
//!   the metrics endpoint.
//! - An API connection is *proven* by a request whose credential was
//!   checked ([`prove_request`], called by the token check; without a token,
//!   by any request), not by bytes received: until then it holds a place in
//!   the API's small unproven pool, with one deadline for its whole
//!   handshake (TCP, TLS, the HTTP/2 preface, the first authenticated call),
//!   and past the pool's cap the oldest is closed.
//! - Until it is proven a connection may send at most
//!   [`API_UNPROVEN_READ_BYTES`] (a byte budget beside the descriptor
//!   one): past it, it is closed.
//! - The metrics endpoint answers one request per connection: its
//!   connections are unproven for their short life, in their own pool with
//!   the request head's deadline.
//! - The accept loop never ends on an error; EMFILE backs off.

use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Duration;

use lockstep_admission::{Budget, Pool, Proof, Share, Slot};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Descriptors the environment keeps for its own work beside its listeners:
/// the catalog (SQLite's database, `-wal` and `-shm`, or a PostgreSQL
/// pool), the replicas' command logs, process logs, the supervisor's pipes
/// and records, and one outgoing connection per replica process (so about
/// 200 replica processes within the least reserve; a larger limit's
/// quarter covers more).
pub const ENVIRONMENT_RESERVE: u64 = 512;

/// The most proven API connections (clients that showed the token).
pub const API_MAX_PROVEN: usize = 4096;

/// The API's pool of unproven connections, at most.
pub const API_UNPROVEN: usize = 64;

/// The time an API connection has, from its accept, to complete its whole
/// handshake: TLS, the HTTP/2 preface and a first call whose credential
/// was checked. Closed after it unless proven.
pub const API_HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// The HTTP/2 flow-control window the API grants a connection, and each of
/// its streams, before anything is read by a service (hyper's default,
/// stated): what a client may send before the server reads.
pub const API_CONNECTION_WINDOW: u32 = 1 << 20;

/// The most bytes an API connection may send before it is proven (TLS,
/// the HTTP/2 preface, health checks, reflection, the headers of a first
/// call): twice [`API_CONNECTION_WINDOW`], so that a client whose first
/// call carries a large body (which the server does not read before it
/// checked the token) is proven before it could reach it. Past it, the
/// connection is closed. Health and reflection answer requests of a few
/// bytes ([`crate::API_OPEN_MAX_REQUEST_BYTES`]), so a token-less caller
/// can make the environment hold little more than this per connection, and
/// [`API_UNPROVEN`] connections at once.
pub const API_UNPROVEN_READ_BYTES: usize = 2 * API_CONNECTION_WINDOW as usize;

/// [`API_UNPROVEN_READ_BYTES`], or none with every admission bound lifted
/// (`lockstep_admission::bounds_lifted`: the hostile campaign's negative
/// control, in a test build only).
pub fn unproven_read_bytes() -> usize {
    if lockstep_admission::bounds_lifted() {
        usize::MAX
    } else {
        API_UNPROVEN_READ_BYTES
    }
}

/// [`crate::API_OPEN_MAX_REQUEST_BYTES`], or tonic's default (4 MiB) with
/// every admission bound lifted (as [`unproven_read_bytes`]).
pub fn open_max_request_bytes() -> usize {
    if lockstep_admission::bounds_lifted() {
        4 << 20
    } else {
        crate::API_OPEN_MAX_REQUEST_BYTES
    }
}

/// The most bytes a metrics connection (never proven) may send: a request
/// head, many times over.
pub const METRICS_UNPROVEN_READ_BYTES: usize = 64 << 10;

/// The metrics endpoint's pool (every connection of it), at most.
pub const METRICS_UNPROVEN: usize = 64;

/// The shares of the environment's listeners.
fn shares() -> [Share; 2] {
    [
        Share {
            name: "api",
            weight: 7,
            max_proven: API_MAX_PROVEN,
            unproven: API_UNPROVEN,
        },
        Share {
            name: "metrics",
            weight: 1,
            max_proven: 4,
            unproven: METRICS_UNPROVEN,
        },
    ]
}

/// This process's budget, made once (the first call raises the soft
/// descriptor limit). A limit too small even for half of it as the reserve
/// is logged, and the least caps are used (4 of each kind per listener).
pub fn process_budget() -> &'static Budget {
    static BUDGET: OnceLock<Budget> = OnceLock::new();
    BUDGET.get_or_init(|| {
        let budget = Budget::for_process(ENVIRONMENT_RESERVE, &shares()).unwrap_or_else(|e| {
            tracing::error!("{e}; using the least caps");
            Budget::split(64, 32, &shares()).expect("64 is enough for the least caps")
        });
        tracing::info!("{}", budget.summary());
        budget
    })
}

/// The API port's pool, publishing its usage in `metrics`.
pub fn api_pool(metrics: &crate::metrics::Metrics) -> Pool {
    Pool::new("api", process_budget().caps("api"), API_HANDSHAKE_DEADLINE)
        .with_gauges(metrics.budget.used.clone())
}

/// The metrics port's pool, publishing its usage in `metrics`.
pub fn metrics_pool(metrics: &crate::metrics::Metrics) -> Pool {
    Pool::new(
        "metrics",
        process_budget().caps("metrics"),
        lockstep_metrics_http::HEAD_TIMEOUT,
    )
    .with_gauges(metrics.budget.used.clone())
}

/// What the API's services learn of a connection (a request extension):
/// its address, and the handle that proves it.
#[derive(Clone)]
pub struct AdmittedInfo {
    /// The TCP connection's addresses.
    pub tcp: tonic::transport::server::TcpConnectInfo,
    /// Proves the connection once a request's credential was checked.
    pub proof: Proof,
}

/// Proves the connection a request came on, found in its `extensions`
/// (plain or TLS). False if the connection's pool refused it (the proven
/// cap is full, or it was closed meanwhile); true if proven, or if the
/// request came on a connection this module did not admit.
pub fn prove_request(extensions: &http::Extensions) -> bool {
    let info = extensions.get::<AdmittedInfo>().or_else(|| {
        extensions
            .get::<tonic::transport::server::TlsConnectInfo<AdmittedInfo>>()
            .map(|t| t.get_ref())
    });
    info.is_none_or(|i| i.proof.prove())
}

/// An accepted connection: closes when its pool says so (evicted, past
/// the deadline unproven, refused a proven slot), and leaves the pool when
/// dropped.
pub struct Admitted {
    stream: TcpStream,
    slot: Slot,
    close: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    /// Bytes read while unproven.
    unproven_read: usize,
    /// The most bytes it may send while unproven.
    unproven_budget: usize,
}

impl Admitted {
    fn closed(&mut self, cx: &mut Context<'_>) -> bool {
        use std::future::Future;
        self.close.as_mut().poll(cx).is_ready()
    }
}

fn closed_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "closed by the admission bounds",
    )
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.closed(cx) {
            return Poll::Ready(Err(closed_error()));
        }
        let unproven = !self.slot.is_proven();
        if unproven && self.unproven_read > self.unproven_budget {
            tracing::debug!(
                read = self.unproven_read,
                "closing a connection that sent more than its budget before it was proven"
            );
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "sent more than an unproven connection may",
            )));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if unproven && matches!(read, Poll::Ready(Ok(()))) {
            self.unproven_read += buf.filled().len() - before;
        }
        read
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.closed(cx) {
            return Poll::Ready(Err(closed_error()));
        }
        Pin::new(&mut self.stream).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Admitted {
    type ConnectInfo = AdmittedInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        AdmittedInfo {
            tcp: self.stream.connect_info(),
            proof: self.slot.proof(),
        }
    }
}

/// Accepts on `listener` into `pool`, each connection allowed
/// `unproven_budget` bytes before it is proven; the admitted connections arrive on
/// the returned channel (its capacity is small: a consumer that stops
/// taking them stops the accepting). The loop never ends on an error (out
/// of descriptors it backs off), only when the consumer is gone.
pub fn accept(
    listener: TcpListener,
    pool: Pool,
    unproven_budget: usize,
) -> mpsc::Receiver<std::io::Result<Admitted>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let mut errors = lockstep_admission::AcceptErrors::new(pool.name());
        loop {
            // Once the consumer is gone (a server shutting down), close the
            // listener at once, so new connections are refused rather than
            // accepted and left unanswered.
            // A permit first: evicted connections not closed yet still
            // count, so a starved machine cannot run the process out of
            // descriptors.
            let ready = tokio::select! {
                r = pool.ready() => r,
                () = tx.closed() => return,
            };
            let (stream, _) = tokio::select! {
                r = lockstep_admission::accept(&listener, &mut errors) => r,
                () = tx.closed() => return,
            };
            let _ = stream.set_nodelay(true);
            let slot = pool.admit_ready(ready);
            let close = Box::pin(slot.close_token().cancelled_owned());
            let admitted = Admitted {
                stream,
                slot,
                close,
                unproven_read: 0,
                unproven_budget,
            };
            if tx.send(Ok(admitted)).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// Accepts on the state directory's Unix socket: a connection whose peer
/// runs as another user than this process's (or root) is closed at once
/// (the socket is 0600 in a 0700 directory, so none should reach it). No
/// pool: only this user reaches it, and every call still shows the token.
/// The loop never ends on an error (it backs off), only when the consumer
/// is gone.
pub fn accept_local(
    listener: tokio::net::UnixListener,
) -> mpsc::Receiver<std::io::Result<tokio::net::UnixStream>> {
    let (tx, rx) = mpsc::channel(16);
    let me = nix::unistd::geteuid().as_raw();
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                () = tx.closed() => return,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("accepting on the local API socket: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            match stream.peer_cred() {
                Ok(cred) if cred.uid() == me || cred.uid() == 0 => {}
                Ok(cred) => {
                    tracing::warn!(
                        uid = cred.uid(),
                        "refused a local API connection of another user"
                    );
                    continue;
                }
                Err(e) => {
                    tracing::warn!("refused a local API connection whose peer is unknown: {e}");
                    continue;
                }
            }
            if tx.send(Ok(stream)).await.is_err() {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_admission::Caps;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What the echo server's connections may send unproven.
    const ECHO_BUDGET: usize = 4096;

    /// An echo server whose connections are proven by their first byte
    /// `p` (standing in for a checked credential).
    async fn echo_server(caps: Caps, deadline: Duration) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut rx = accept(listener, Pool::new("test", caps, deadline), ECHO_BUDGET);
        tokio::spawn(async move {
            while let Some(Ok(mut c)) = rx.recv().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = c.read(&mut b).await {
                        if n > 0 && b[0] == b'p' {
                            use tonic::transport::server::Connected;
                            c.connect_info().proof.prove();
                        }
                        if n == 0 || c.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn echoes(s: &mut TcpStream, byte: u8) -> bool {
        if s.write_all(&[byte]).await.is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await,
            Ok(Ok(1))
        )
    }

    #[tokio::test]
    async fn bytes_without_a_proof_hold_no_slot_and_a_flood_cannot_keep_a_client_out() {
        let caps = Caps {
            proven: 8,
            unproven: 16,
        };
        let addr = echo_server(caps, Duration::from_secs(30)).await;
        // A client that proves itself, then a flood past the cap that
        // sends bytes (an HTTP/2 preface, say) but no proof.
        let mut early = TcpStream::connect(addr).await.unwrap();
        assert!(echoes(&mut early, b'p').await);
        let mut flood = Vec::new();
        for _ in 0..64 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let _ = s.write_all(b"PRI * HTTP/2.0").await;
            flood.push(s);
        }
        // A new client still gets in, and the one that proved is kept.
        let mut late = TcpStream::connect(addr).await.unwrap();
        assert!(echoes(&mut late, b'p').await, "the new client was kept out");
        assert!(
            echoes(&mut early, b'p').await,
            "a proven client was evicted"
        );
        // The oldest talking-but-unproven ones were closed.
        let mut b = [0u8; 64];
        let mut closed = false;
        let deadline = Instant::now() + Duration::from_secs(5);
        while !closed && Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_secs(5), flood[0].read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => closed = true,
                Ok(Ok(_)) => {}
                Err(_) => break,
            }
        }
        assert!(closed, "the oldest unproven connection was not closed");
    }

    #[tokio::test]
    async fn the_listener_closes_once_the_consumer_is_gone() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let caps = Caps {
            proven: 4,
            unproven: 4,
        };
        let rx = accept(
            listener,
            Pool::new("test", caps, Duration::from_secs(5)),
            usize::MAX,
        );
        drop(rx);
        // Bounded: the accept loop notices at once, without a connection.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match TcpStream::connect(addr).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => break,
                // A connection caught as the listener closed.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                Err(e) => panic!("{e}"),
                Ok(_) => {
                    assert!(Instant::now() < deadline, "still listening");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    #[tokio::test]
    async fn an_unproven_connection_is_closed_at_the_deadline_even_if_it_talks() {
        let caps = Caps {
            proven: 4,
            unproven: 16,
        };
        let addr = echo_server(caps, Duration::from_millis(300)).await;
        let mut talker = TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        assert!(echoes(&mut talker, b'x').await, "served while unproven");
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(5), talker.read(&mut b)).await;
        assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
        assert!(started.elapsed() >= Duration::from_millis(250));
    }

    /// The byte budget: an unproven connection that keeps sending is closed
    /// once it sent more than its budget (well before the handshake
    /// deadline); a proven one sends as much as it likes.
    #[tokio::test]
    async fn an_unproven_connection_is_closed_past_its_byte_budget_a_proven_one_is_not() {
        let addr = echo_server(
            Caps {
                unproven: 4,
                proven: 4,
            },
            Duration::from_secs(30),
        )
        .await;
        let started = Instant::now();
        let mut unproven = TcpStream::connect(addr).await.unwrap();
        let mut sent = 0;
        let mut echoed = vec![0u8; 1 << 16];
        let closed = loop {
            if unproven.write_all(&[b'x'; 512]).await.is_err() {
                break true;
            }
            sent += 512;
            match tokio::time::timeout(Duration::from_secs(5), unproven.read(&mut echoed)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break true,
                Ok(Ok(_)) => {}
                Err(_) => break false,
            }
            assert!(
                sent < 1 << 20,
                "an unproven connection sent {sent} bytes and is open"
            );
        };
        assert!(
            closed,
            "an unproven connection was neither answered nor closed"
        );
        assert!(
            sent <= ECHO_BUDGET + 1024,
            "closed only after {sent} bytes (budget {ECHO_BUDGET})"
        );
        assert!(started.elapsed() < Duration::from_secs(10));

        let mut proven = TcpStream::connect(addr).await.unwrap();
        proven.write_all(b"p").await.unwrap();
        let mut b = [0u8; 1];
        proven.read_exact(&mut b).await.unwrap();
        for _ in 0..(4 * ECHO_BUDGET / 512) {
            proven.write_all(&[b'y'; 512]).await.unwrap();
            let mut got = 0;
            while got < 512 {
                let n = proven.read(&mut echoed).await.unwrap();
                assert!(n > 0, "a proven connection was closed");
                got += n;
            }
        }
    }
}
