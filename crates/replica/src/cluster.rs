//! Forming the timely cluster of one replica over TCP.
//!
//! The peers are `host:port` [`Endpoint`]s, names or IP literals, in process
//! order; [`resolve_peers`] looks each up, retrying (a pod's DNS name may
//! appear only once the pod is scheduled) within a bound, and an unresolvable
//! peer is an error naming it. A process listens on its own entry's address
//! (the address it advertises) unless a listen address is given (`0.0.0.0`,
//! a pod IP).
//!
//! timely's own `create_sockets` retries in one-second steps, which makes a
//! replica take seconds to start. Here every process listens on its timely
//! address, connects to the processes with a lower index (retrying every
//! 10 ms), and accepts the ones with a higher index. Each connection starts
//! with a handshake:
//!
//! 1. the connecting process `c` sends a header (magic, replica ID, `c`) and
//!    a fresh 16-byte nonce;
//! 2. with a session key, the accepting process `a` answers its own nonce
//!    and a proof (`SessionKey::mesh_proof`, role "accept", over both
//!    nonces); `c` checks it and answers its proof (role "connect");
//!    without a key (a replica started by hand) there is no proof;
//! 3. `a` wires the connection in as peer `c` only if the header names one
//!    of its higher-index peers of this replica, the proof holds, and peer
//!    `c` is not connected yet: a second connection claiming the same index
//!    is refused, never put in place of the first.
//!
//! The header also carries the process's *generation* (the orchestrator
//! starts every process of a replica together as one generation, and a
//! restart of any process starts a new one): a peer of another generation is
//! refused, so two generations never form one cluster.
//!
//! Each accepted connection is handshaken on its own thread with a 2 s bound
//! on the whole handshake, not on each read, so a peer that trickles bytes
//! cannot hold it longer. At most [`MAX_PENDING_HANDSHAKES`] run at once;
//! when they are all taken, the *oldest* is closed to make room for the new
//! one, so a flood of unproven connections delays a real peer by at most one
//! handshake instead of keeping it out. The whole wait is
//! bounded: a cluster that does not form in time is an error, never a
//! silent hang. With a session key every link is then encrypted
//! ([`encrypt_mesh`]: a Noise session per link, timely's bytes relayed in
//! authenticated records), and the sockets are handed to
//! `initialize_networking_from_sockets`.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_protocol::{Endpoint, SessionKey};

mod encrypt;
pub use encrypt::encrypt_mesh;
use timely::communication::allocator::zero_copy::initialize::{
    initialize_networking_from_sockets, CommsGuard,
};
use timely::communication::allocator::{AllocatorBuilder, ProcessBuilder};
use timely::communication::Hooks;

const MAGIC: u64 = 0x6c6f_636b_7374_6570; // "lockstep"
/// How long one side of a mesh handshake waits for the other.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(2);
/// Accepted connections handshaken at once; a new one beyond this closes the
/// oldest.
pub const MAX_PENDING_HANDSHAKES: usize = 64;

/// At most one summary line of refused mesh connections per interval.
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Who a process is on the mesh: its replica and its generation. Peers must
/// agree on both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshId {
    /// The replica's catalog ID.
    pub replica_id: u64,
    /// The generation the orchestrator started this process in.
    pub generation: u64,
}

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
    /// A peer's address could not be resolved within the bound.
    #[error("cannot resolve timely peer {process} ({peer}) within {timeout:?}: {reason}")]
    Resolve {
        /// The peer's process index.
        process: usize,
        /// Its address as given.
        peer: Endpoint,
        /// The bound.
        timeout: Duration,
        /// The last lookup's failure.
        reason: String,
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

/// The header's length: magic, replica ID, generation, index, nonce.
const HEADER_LEN: usize = 48;

fn header(id: MeshId, index: usize, nonce: &[u8; 16]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC.to_be_bytes());
    h[8..16].copy_from_slice(&id.replica_id.to_be_bytes());
    h[16..24].copy_from_slice(&id.generation.to_be_bytes());
    h[24..32].copy_from_slice(&(index as u64).to_be_bytes());
    h[32..].copy_from_slice(nonce);
    h
}

/// `read_exact` with one deadline for the whole read, however the bytes
/// trickle in.
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[filled..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// 16 unpredictable bytes.
fn nonce() -> std::io::Result<[u8; 16]> {
    let mut n = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

/// The connecting side of a handshake with peer `to`; the stream is ready
/// for timely once it returns.
fn connect_peer(
    addr: SocketAddr,
    me: usize,
    to: usize,
    id: MeshId,
    key: Option<&SessionKey>,
) -> std::io::Result<TcpStream> {
    let replica_id = id.replica_id;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(100))?;
    s.set_nodelay(true)?;
    let mine = nonce()?;
    s.write_all(&header(id, me, &mine))?;
    if let Some(key) = key {
        let deadline = Instant::now() + HANDSHAKE_BOUND;
        let mut answer = [0u8; 48];
        read_exact_by(&mut s, &mut answer, deadline)?;
        let theirs: [u8; 16] = answer[..16].try_into().expect("16 bytes");
        let proof: [u8; 32] = answer[16..].try_into().expect("32 bytes");
        if !key.verify_mesh_proof(
            &proof,
            b"accept",
            replica_id,
            to as u64,
            me as u64,
            (&mine, &theirs),
        ) {
            return Err(std::io::Error::other(format!(
                "timely peer {to} at {addr} does not prove the replica's session key"
            )));
        }
        let ours = key.mesh_proof(
            b"connect",
            replica_id,
            me as u64,
            to as u64,
            (&theirs, &mine),
        );
        s.write_all(&ours)?;
        s.set_read_timeout(None)?;
    }
    Ok(s)
}

/// The accepting side of a handshake: the peer's index and the stream, or
/// why it was refused.
fn accept_peer(
    mut s: TcpStream,
    me: usize,
    n: usize,
    id: MeshId,
    key: Option<&SessionKey>,
) -> Result<(usize, TcpStream), String> {
    let replica_id = id.replica_id;
    let deadline = Instant::now() + HANDSHAKE_BOUND;
    let io = |e: std::io::Error| e.to_string();
    s.set_nonblocking(false).map_err(io)?;
    let mut h = [0u8; HEADER_LEN];
    read_exact_by(&mut s, &mut h, deadline).map_err(|e| format!("no header: {e}"))?;
    let word = |i: usize| u64::from_be_bytes(h[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let (magic, rid, generation, idx) = (word(0), word(1), word(2), word(3));
    let theirs: [u8; 16] = h[32..].try_into().expect("16 bytes");
    if magic != MAGIC || rid != replica_id || idx <= me as u64 || idx >= n as u64 {
        return Err(format!(
            "not one of our peers (magic {magic:#x}, replica {rid}, process {idx})"
        ));
    }
    if generation != id.generation {
        return Err(format!(
            "process {idx} is of generation {generation}, this process of generation {}",
            id.generation
        ));
    }
    if let Some(key) = key {
        let mine = nonce().map_err(io)?;
        let proof = key.mesh_proof(b"accept", replica_id, me as u64, idx, (&theirs, &mine));
        let mut answer = [0u8; 48];
        answer[..16].copy_from_slice(&mine);
        answer[16..].copy_from_slice(&proof);
        s.write_all(&answer).map_err(io)?;
        let mut back = [0u8; 32];
        read_exact_by(&mut s, &mut back, deadline)
            .map_err(|e| format!("process {idx} sent no proof: {e}"))?;
        if !key.verify_mesh_proof(
            &back,
            b"connect",
            replica_id,
            idx,
            me as u64,
            (&mine, &theirs),
        ) {
            return Err(format!(
                "a connection claiming to be process {idx} does not prove the replica's session key"
            ));
        }
    }
    s.set_read_timeout(None).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    Ok((idx as usize, s))
}

/// How often a peer's name is looked up again while it does not resolve.
const RESOLVE_RETRY: Duration = Duration::from_millis(100);

/// Resolves every peer with the system resolver (`getaddrinfo`: `/etc/hosts`,
/// then DNS), retrying each one that does not resolve every 100 ms until
/// `timeout` has passed since the call; see [`resolve_peers_with`].
pub fn resolve_peers(
    peers: &[Endpoint],
    timeout: Duration,
) -> Result<Vec<SocketAddr>, ClusterError> {
    resolve_peers_with(peers, timeout, |peer| {
        use std::net::ToSocketAddrs;
        if let Some(addr) = peer.socket_addr() {
            return Ok(vec![addr]);
        }
        Ok((peer.host(), peer.port()).to_socket_addrs()?.collect())
    })
}

/// Resolves every peer with `lookup`, in process order, retrying a peer whose
/// lookup fails or finds nothing until `timeout` has passed since the call.
/// Takes the first address a lookup returns. Error: the first peer that did
/// not resolve in time, named by index and address, with the last failure.
pub fn resolve_peers_with(
    peers: &[Endpoint],
    timeout: Duration,
    mut lookup: impl FnMut(&Endpoint) -> std::io::Result<Vec<SocketAddr>>,
) -> Result<Vec<SocketAddr>, ClusterError> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(peers.len());
    for (process, peer) in peers.iter().enumerate() {
        loop {
            let reason = match lookup(peer) {
                Ok(addrs) => match addrs.first() {
                    Some(addr) => {
                        out.push(*addr);
                        break;
                    }
                    None => "the name has no address".to_string(),
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(ClusterError::Resolve {
                    process,
                    peer: peer.clone(),
                    timeout,
                    reason,
                });
            }
            tracing::debug!(process, %peer, %reason, "timely peer does not resolve yet");
            std::thread::sleep(
                RESOLVE_RETRY.min(deadline.saturating_duration_since(Instant::now())),
            );
        }
    }
    Ok(out)
}

/// Connects this process to every peer. `addrs[i]` is process i's timely
/// address (resolved); this process listens on `bind` (its own entry, or
/// the configured listen address). With `key`, every peer must prove it.
/// Returns one socket per process, `None` at `me`.
pub fn connect_mesh(
    addrs: &[SocketAddr],
    bind: SocketAddr,
    me: usize,
    id: MeshId,
    key: Option<&SessionKey>,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, ClusterError> {
    let listener =
        TcpListener::bind(bind).map_err(|source| ClusterError::Bind { addr: bind, source })?;
    connect_mesh_on(&listener, addrs, me, id, key, timeout)
}

/// [`connect_mesh`] on a listener already bound (one the orchestrator
/// bound and this process inherited), which the caller keeps: while it
/// is open no other socket can take its port.
pub fn connect_mesh_on(
    listener: &TcpListener,
    addrs: &[SocketAddr],
    me: usize,
    id: MeshId,
    key: Option<&SessionKey>,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>, ClusterError> {
    let deadline = Instant::now() + timeout;
    let n = addrs.len();
    listener.set_nonblocking(true)?;
    let mut sockets: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let (accepted_tx, accepted) = mpsc::channel::<Result<(usize, TcpStream), String>>();
    // The handshakes in progress, oldest first: a handle to close each.
    let pending: Arc<Mutex<VecDeque<(u64, TcpStream)>>> = Arc::default();
    let mut next_handshake = 0u64;

    // Connect to lower-index peers, accept higher-index ones, interleaved so
    // that neither side waits on the other.
    let mut pending_connect: Vec<usize> = (0..me).collect();
    let (mut refused, mut evicted, mut last_refusal) = (0u64, 0u64, None::<String>);
    let mut last_summary = Instant::now() - REFUSAL_LOG_INTERVAL;
    loop {
        pending_connect.retain(|&i| match connect_peer(addrs[i], me, i, id, key) {
            Ok(s) => {
                sockets[i] = Some(s);
                false
            }
            Err(e) => {
                if e.kind() == std::io::ErrorKind::Other {
                    tracing::warn!("{e}");
                }
                true
            }
        });
        loop {
            match listener.accept() {
                Ok((s, from)) => {
                    let Ok(handle) = s.try_clone() else { continue };
                    let token = next_handshake;
                    next_handshake += 1;
                    {
                        let mut pending = pending.lock().expect("not poisoned");
                        if pending.len() >= MAX_PENDING_HANDSHAKES {
                            // Make room by closing the oldest: the newest
                            // may be the real peer.
                            if let Some((_, oldest)) = pending.pop_front() {
                                let _ = oldest.shutdown(std::net::Shutdown::Both);
                                evicted += 1;
                            }
                        }
                        pending.push_back((token, handle));
                    }
                    let (tx, pending, key) = (accepted_tx.clone(), pending.clone(), key.cloned());
                    std::thread::spawn(move || {
                        let r = accept_peer(s, me, n, id, key.as_ref())
                            .map_err(|e| format!("{from}: {e}"));
                        pending
                            .lock()
                            .expect("not poisoned")
                            .retain(|(t, _)| *t != token);
                        let _ = tx.send(r);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // Out of descriptors (or a connection reset before its
                // accept): counted, and formation goes on (R1); the bound
                // still ends it.
                Err(e) => {
                    refused += 1;
                    last_refusal = Some(format!("accept failed: {e}"));
                    break;
                }
            }
        }
        while let Ok(r) = accepted.try_recv() {
            match r {
                Ok((idx, s)) if sockets[idx].is_none() => sockets[idx] = Some(s),
                Ok((idx, _)) => tracing::warn!(
                    process = idx,
                    "refusing a second timely connection from a process already connected"
                ),
                Err(e) => {
                    refused += 1;
                    last_refusal = Some(e);
                }
            }
        }
        // Refusals are logged as one summary line per interval, whatever
        // their number: unproven peers cannot fill the disk.
        if (refused > 0 || evicted > 0) && last_summary.elapsed() >= REFUSAL_LOG_INTERVAL {
            tracing::warn!(
                refused,
                evicted,
                last = last_refusal.as_deref().unwrap_or(""),
                "refused timely connections since the last summary"
            );
            (refused, evicted, last_refusal) = (0, 0, None);
            last_summary = Instant::now();
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

#[cfg(test)]
mod tests;
