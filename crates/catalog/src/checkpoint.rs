//! The SQLite catalog's WAL checkpoints, off the write path.
//!
//! SQLite checkpoints a WAL by default inside the commit that passes 1,000
//! pages: that commit then copies the WAL into the database file and syncs
//! it, and its writer waits (a 10,000-row write every few dozen paid about
//! 4x a write's median). The catalog turns that off and a thread of its own,
//! on a connection of its own, runs a passive checkpoint (which neither
//! waits for nor blocks a writer) every [`INTERVAL`]; the last connection
//! to close checkpoints what is left. A commit is durable once its WAL
//! frames are synced (`synchronous=FULL`), whichever runs the checkpoint.

use std::path::Path;
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

/// How often the checkpointer copies the WAL into the database file.
pub(crate) const INTERVAL: Duration = Duration::from_millis(250);

/// The checkpointer thread; dropped, it stops and is joined.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Turns the automatic checkpoint of `conn` off and starts the thread
    /// on a connection of its own to `path`. If that connection cannot be
    /// opened, the automatic checkpoint stays on (slower, not wrong).
    pub(crate) fn start(conn: &Connection, path: &Path) -> Checkpointer {
        let none = Checkpointer {
            stop: None,
            thread: None,
        };
        let own = match Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        ) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(path = %path.display(), "catalog checkpoints stay in the commits: {e}");
                return none;
            }
        };
        if let Err(e) = conn.pragma_update(None, "wal_autocheckpoint", 0) {
            tracing::warn!("catalog checkpoints stay in the commits: {e}");
            return none;
        }
        let (stop, stopped) = channel::<()>();
        let thread = std::thread::Builder::new()
            .name("catalog-checkpoint".into())
            .spawn(move || loop {
                match stopped.recv_timeout(INTERVAL) {
                    Err(RecvTimeoutError::Timeout) => {
                        // Passive: copies what no reader still needs; a
                        // busy database is simply tried again next time.
                        if let Err(e) =
                            own.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                        {
                            tracing::debug!("catalog checkpoint: {e}");
                        }
                    }
                    _ => return,
                }
            });
        match thread {
            Ok(thread) => Checkpointer {
                stop: Some(stop),
                thread: Some(thread),
            },
            Err(e) => {
                tracing::warn!("catalog checkpoints stay in the commits: {e}");
                let _ = conn.pragma_update(None, "wal_autocheckpoint", 1000);
                none
            }
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
