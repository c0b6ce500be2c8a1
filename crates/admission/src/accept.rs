//! An accept that never fails: a server does not stop on a resource error.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

/// How long an accept loop waits after a failed accept for lack of a
/// resource (EMFILE, ENFILE, ENOMEM, ENOBUFS) before it tries again.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The failed accepts of one listener since its last log line: at most
/// one line per [`crate::SUMMARY_INTERVAL`].
#[derive(Debug)]
pub struct AcceptErrors {
    name: &'static str,
    failed: u64,
    total: std::sync::Arc<std::sync::atomic::AtomicU64>,
    last: Option<String>,
    last_logged: Option<Instant>,
}

impl AcceptErrors {
    /// The failed accepts of the listener `name`.
    pub fn new(name: &'static str) -> AcceptErrors {
        AcceptErrors {
            name,
            failed: 0,
            total: Default::default(),
            last: None,
            last_logged: None,
        }
    }

    /// Failed accepts since this was made.
    pub fn failed_total(&self) -> u64 {
        self.total.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A counter of [`AcceptErrors::failed_total`] that others can read
    /// while the accept loop owns this.
    pub fn total_counter(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        std::sync::Arc::clone(&self.total)
    }

    fn note(&mut self, e: &std::io::Error) {
        self.failed += 1;
        self.total
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.last = Some(e.to_string());
        let due = self
            .last_logged
            .is_none_or(|t| t.elapsed() >= crate::SUMMARY_INTERVAL);
        if due {
            tracing::warn!(
                listener = self.name,
                failed = self.failed,
                last = self.last.as_deref().unwrap_or(""),
                "accepts failed since the last summary; backing off and serving on (at most one line per {:?})",
                crate::SUMMARY_INTERVAL
            );
            self.failed = 0;
            self.last_logged = Some(Instant::now());
        }
    }
}

/// Whether a failed accept is the lack of a resource, which only time (a
/// connection closing) cures.
fn lacks_resource(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc_codes::EMFILE | libc_codes::ENFILE | libc_codes::ENOMEM | libc_codes::ENOBUFS)
    )
}

/// The errno values of a lack of resource (Linux).
mod libc_codes {
    pub const EMFILE: i32 = nix::errno::Errno::EMFILE as i32;
    pub const ENFILE: i32 = nix::errno::Errno::ENFILE as i32;
    pub const ENOMEM: i32 = nix::errno::Errno::ENOMEM as i32;
    pub const ENOBUFS: i32 = nix::errno::Errno::ENOBUFS as i32;
}

/// The next connection on `listener`. Never an error: a failed accept is
/// counted into `errors`, and for the lack of a resource the call waits
/// [`ACCEPT_BACKOFF`] (not spinning while descriptors are out) before it
/// tries again; any other failure (a connection reset before it was
/// accepted) is tried again at once.
pub async fn accept(listener: &TcpListener, errors: &mut AcceptErrors) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                errors.note(&e);
                if lacks_resource(&e) {
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                } else {
                    tokio::task::yield_now().await;
                }
            }
        }
    }
}
