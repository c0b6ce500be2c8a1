//! Bounded acceptance of the API's and the metrics endpoint's connections:
//! a flood of idle connections can neither exhaust the environment's file
//! descriptors nor keep a real client out, and an accept loop that fails
//! (EMFILE) backs off instead of spinning.
//!
//! - At most [`Limits::max_connections`] connections are open at once.
//! - A connection that has sent nothing yet is *unproven*; it must send its
//!   first bytes within [`Limits::first_bytes`] or it is closed.
//! - Past the cap, a new connection closes the oldest unproven one (the new
//!   one may be the real client); if every open connection has sent bytes,
//!   the new one is closed instead.
//! - Refusals are counted and logged as one summary line per interval.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The bounds of an acceptor.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// How long a new connection may stay silent.
    pub first_bytes: Duration,
    /// How long the accept loop waits after a failed accept (EMFILE).
    pub accept_backoff: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 512,
            first_bytes: Duration::from_secs(10),
            accept_backoff: Duration::from_millis(100),
        }
    }
}

/// At most one summary of refused connections per this interval.
const SUMMARY_INTERVAL: Duration = Duration::from_secs(10);

struct Entry {
    id: u64,
    proven: Arc<AtomicBool>,
    close: CancellationToken,
}

#[derive(Default)]
struct Book {
    open: VecDeque<Entry>,
    evicted: u64,
    refused: u64,
    silent: u64,
    failed_accepts: u64,
    last_summary: Option<Instant>,
}

impl Book {
    fn summarize(&mut self, what: &str) {
        let due = self
            .last_summary
            .is_none_or(|t| t.elapsed() >= SUMMARY_INTERVAL);
        let any = self.evicted + self.refused + self.silent + self.failed_accepts > 0;
        if due && any {
            tracing::warn!(
                endpoint = what,
                evicted = self.evicted,
                refused = self.refused,
                silent = self.silent,
                failed_accepts = self.failed_accepts,
                open = self.open.len(),
                "connections closed by the admission bounds since the last summary"
            );
            (self.evicted, self.refused, self.silent, self.failed_accepts) = (0, 0, 0, 0);
            self.last_summary = Some(Instant::now());
        }
    }
}

/// An accepted connection: marks itself proven at its first bytes, closes
/// when the acceptor says so, and leaves the book when dropped.
pub struct Admitted {
    stream: TcpStream,
    proven: Arc<AtomicBool>,
    close: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    book: Arc<Mutex<Book>>,
    id: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.book
            .lock()
            .expect("not poisoned")
            .open
            .retain(|e| e.id != self.id);
    }
}

impl Admitted {
    fn closed(&mut self, cx: &mut Context<'_>) -> bool {
        self.close.as_mut().poll(cx).is_ready()
    }
}

use std::future::Future;

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
        let before = buf.filled().len();
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.proven.store(true, Ordering::Relaxed);
        }
        r
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
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// Accepts on `listener` within `limits`; the admitted connections arrive
/// on the returned channel (its capacity is small: a consumer that stops
/// taking them stops the accepting). `what` names the endpoint in logs.
pub fn accept(
    listener: TcpListener,
    limits: Limits,
    what: &'static str,
) -> mpsc::Receiver<std::io::Result<Admitted>> {
    let (tx, rx) = mpsc::channel(16);
    let book: Arc<Mutex<Book>> = Arc::default();
    tokio::spawn(async move {
        let mut next = 0u64;
        loop {
            // Once the consumer is gone (a server shutting down), close the
            // listener at once, so new connections are refused rather than
            // accepted and left unanswered.
            let accepted = tokio::select! {
                r = listener.accept() => r,
                () = tx.closed() => return,
            };
            let (stream, _) = match accepted {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors (or another transient failure):
                    // back off instead of spinning on the error.
                    {
                        let mut b = book.lock().expect("not poisoned");
                        b.failed_accepts += 1;
                        tracing::debug!("accept failed: {e}");
                        b.summarize(what);
                    }
                    tokio::time::sleep(limits.accept_backoff).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            next += 1;
            let id = next;
            let proven = Arc::new(AtomicBool::new(false));
            let close = CancellationToken::new();
            {
                let mut b = book.lock().expect("not poisoned");
                if b.open.len() >= limits.max_connections {
                    match b
                        .open
                        .iter()
                        .position(|e| !e.proven.load(Ordering::Relaxed))
                    {
                        Some(i) => {
                            let oldest = b.open.remove(i).expect("in range");
                            oldest.close.cancel();
                            b.evicted += 1;
                        }
                        None => {
                            b.refused += 1;
                            b.summarize(what);
                            continue;
                        }
                    }
                }
                b.open.push_back(Entry {
                    id,
                    proven: Arc::clone(&proven),
                    close: close.clone(),
                });
                b.summarize(what);
            }
            // A connection silent past the bound is closed.
            {
                let (proven, close, book) = (Arc::clone(&proven), close.clone(), Arc::clone(&book));
                tokio::spawn(async move {
                    tokio::select! {
                        () = tokio::time::sleep(limits.first_bytes) => {
                            if !proven.load(Ordering::Relaxed) {
                                close.cancel();
                                let mut b = book.lock().expect("not poisoned");
                                b.silent += 1;
                                b.summarize(what);
                            }
                        }
                        () = close.cancelled() => {}
                    }
                });
            }
            let admitted = Admitted {
                stream,
                proven,
                close: Box::pin(close.cancelled_owned()),
                book: Arc::clone(&book),
                id,
            };
            if tx.send(Ok(admitted)).await.is_err() {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server(limits: Limits) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut rx = accept(listener, limits, "test");
        tokio::spawn(async move {
            while let Some(Ok(mut c)) = rx.recv().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = c.read(&mut b).await {
                        if n == 0 || c.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn echoes(s: &mut TcpStream) -> bool {
        if s.write_all(b"x").await.is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await,
            Ok(Ok(1))
        )
    }

    #[tokio::test]
    async fn a_flood_of_silent_connections_cannot_keep_a_client_out() {
        let limits = Limits {
            max_connections: 16,
            first_bytes: Duration::from_secs(30),
            accept_backoff: Duration::from_millis(10),
        };
        let addr = echo_server(limits).await;
        // A client that talks, then a flood past the cap.
        let mut early = TcpStream::connect(addr).await.unwrap();
        assert!(echoes(&mut early).await);
        let mut flood = Vec::new();
        for _ in 0..64 {
            flood.push(TcpStream::connect(addr).await.unwrap());
        }
        // A new client still gets in, and the one that talked is kept.
        let mut late = TcpStream::connect(addr).await.unwrap();
        assert!(echoes(&mut late).await, "the new client was kept out");
        assert!(echoes(&mut early).await, "a talking client was evicted");
        // The oldest silent ones were closed.
        let mut b = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(5), flood[0].read(&mut b)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    }

    #[tokio::test]
    async fn the_listener_closes_once_the_consumer_is_gone() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let rx = accept(listener, Limits::default(), "test");
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
    async fn a_silent_connection_is_closed_at_the_bound() {
        let limits = Limits {
            max_connections: 16,
            first_bytes: Duration::from_millis(300),
            accept_backoff: Duration::from_millis(10),
        };
        let addr = echo_server(limits).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut b)).await;
        assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
        assert!(started.elapsed() >= Duration::from_millis(250));
    }
}
