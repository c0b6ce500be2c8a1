//! Forming the timely cluster of one replica over TCP.
//!
//! timely's own `create_sockets` retries in one-second steps, which makes a
//! replica take seconds to start. Here every process listens on its timely
//! address, connects to the processes with a lower index (retrying every
//! 10 ms), and accepts the ones with a higher index; each connection starts
//! with a small header (magic, replica ID, process index) so that a stray or
//! stale peer of another replica is refused rather than wired in. The whole
//! wait is bounded: a cluster that does not form in time is an error, never a
//! silent hang. The sockets are then handed to
//! `initialize_networking_from_sockets`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use timely::communication::allocator::zero_copy::initialize::{
    initialize_networking_from_sockets, CommsGuard,
};
use timely::communication::allocator::{AllocatorBuilder, ProcessBuilder};
use timely::communication::Hooks;

const MAGIC: u64 = 0x6c6f_636b_7374_6570; // "lockstep"

/// Why the cluster could not form.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Binding our own timely address failed.
    #[error("cannot listen on timely address {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The peers did not all connect in time.
    #[error("timely cluster did not form within {timeout:?}: still missing processes {missing:?}")]
    Timeout {
        /// The bound.
        timeout: Duration,
        /// Processes not connected.
        missing: Vec<usize>,
    },
    /// A peer sent a header of another replica or process.
    #[error("refused timely peer: {0}")]
    BadPeer(String),
    /// Another I/O failure.
    #[error("timely networking: {0}")]
    Io(#[from] std::io::Error),
}

fn header(replica_id: u64, index: usize) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&MAGIC.to_be_bytes());
    h[8..16].copy_from_slice(&replica_id.to_be_bytes());
    h[16..].copy_from_slice(&(index as u64).to_be_bytes());
    h
}

/// Connects this process to every peer. `addrs[i]` is process i's timely
/// address. Returns one socket per process, `None` at `me`.
pub fn connect_mesh(
    addrs: &[SocketAddr],
    me: usize,
    replica_id: u64,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, ClusterError> {
    let deadline = Instant::now() + timeout;
    let n = addrs.len();
    let listener = TcpListener::bind(addrs[me]).map_err(|source| ClusterError::Bind {
        addr: addrs[me],
        source,
    })?;
    listener.set_nonblocking(true)?;
    let mut sockets: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();

    // Connect to lower-index peers, accept higher-index ones, interleaved so
    // that neither side waits on the other.
    let mut pending_connect: Vec<usize> = (0..me).collect();
    loop {
        pending_connect.retain(|&i| {
            match TcpStream::connect_timeout(&addrs[i], Duration::from_millis(100)) {
                Ok(mut s) => {
                    let ok =
                        s.set_nodelay(true).is_ok() && s.write_all(&header(replica_id, me)).is_ok();
                    if ok {
                        sockets[i] = Some(s);
                    }
                    !ok
                }
                Err(_) => true,
            }
        });
        loop {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(Duration::from_secs(2)))?;
                    let mut h = [0u8; 24];
                    if s.read_exact(&mut h).is_err() {
                        continue; // a probe or a dead peer: ignore it
                    }
                    s.set_read_timeout(None)?;
                    let magic = u64::from_be_bytes(h[..8].try_into().expect("8 bytes"));
                    let rid = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
                    let idx = u64::from_be_bytes(h[16..].try_into().expect("8 bytes")) as usize;
                    if magic != MAGIC || rid != replica_id || idx <= me || idx >= n {
                        tracing::warn!(
                            magic,
                            rid,
                            idx,
                            "refusing a timely connection that is not one of our peers"
                        );
                        continue;
                    }
                    s.set_nodelay(true)?;
                    sockets[idx] = Some(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        let missing: Vec<usize> = (0..n)
            .filter(|&i| i != me && sockets[i].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(sockets);
        }
        if Instant::now() >= deadline {
            return Err(ClusterError::Timeout { timeout, missing });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Builds timely's allocators for `workers` local workers over the sockets.
pub fn allocators(
    sockets: Vec<Option<TcpStream>>,
    me: usize,
    workers: usize,
) -> Result<(Vec<AllocatorBuilder>, CommsGuard), ClusterError> {
    // The typed (mpsc) intra-process allocator, as timely's own cluster
    // configuration uses by default.
    let hooks = Hooks::default();
    let process =
        ProcessBuilder::new_typed_vector(workers, hooks.refill.clone(), hooks.spill.clone());
    let (builders, guard) =
        initialize_networking_from_sockets(process, sockets, me, workers, hooks)?;
    Ok((
        builders.into_iter().map(AllocatorBuilder::Tcp).collect(),
        guard,
    ))
}
