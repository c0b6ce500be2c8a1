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
mod tests {
    use super::*;

    const ID: MeshId = MeshId {
        replica_id: 7,
        generation: 3,
    };

    fn free_addr() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    }

    fn key(b: u8) -> SessionKey {
        SessionKey::from_bytes([b; 32])
    }

    /// Connects to `addr` until it listens.
    fn dial(addr: SocketAddr) -> TcpStream {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(s) = TcpStream::connect(addr) {
                return s;
            }
            assert!(Instant::now() < deadline, "nothing listens on {addr}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Process 0 of a 2-process replica, on its own thread.
    fn process_0(
        addrs: Vec<SocketAddr>,
        key: Option<SessionKey>,
        timeout: Duration,
    ) -> std::thread::JoinHandle<Result<Vec<Option<TcpStream>>, ClusterError>> {
        std::thread::spawn(move || connect_mesh(&addrs, addrs[0], 0, ID, key.as_ref(), timeout))
    }

    #[test]
    fn a_spoofed_peer_and_idle_connections_are_refused_and_the_real_peer_is_wired_in() {
        let addrs = vec![free_addr(), free_addr()];
        let p0 = process_0(addrs.clone(), Some(key(1)), Duration::from_secs(20));
        // Idle connections: they must not hold formation.
        let idle: Vec<TcpStream> = (0..8).map(|_| dial(addrs[0])).collect();
        // A spoofed process 1: the right header, no key.
        let mut spoof = dial(addrs[0]);
        spoof.write_all(&header(ID, 1, &[0; 16])).unwrap();
        let mut answer = [0u8; 48];
        spoof.read_exact(&mut answer).unwrap();
        spoof.write_all(&[0u8; 32]).unwrap();
        // The real process 1.
        let started = Instant::now();
        let mut p1 = connect_mesh(
            &addrs,
            addrs[1],
            1,
            ID,
            Some(&key(1)),
            Duration::from_secs(20),
        )
        .unwrap();
        let mut p0 = p0.join().unwrap().unwrap();
        assert!(
            started.elapsed() < HANDSHAKE_BOUND,
            "idle connections held formation for {:?}",
            started.elapsed()
        );
        // Process 0's peer 1 is the real process 1, not the spoof.
        p1[0].as_mut().unwrap().write_all(b"real").unwrap();
        let mut got = [0u8; 4];
        p0[1].as_mut().unwrap().read_exact(&mut got).unwrap();
        assert_eq!(&got, b"real");
        // The spoof was closed.
        spoof
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut rest = Vec::new();
        assert_eq!(spoof.read_to_end(&mut rest).unwrap_or(0), 0);
        drop(idle);
    }

    #[test]
    fn a_peer_with_another_key_never_joins() {
        never_joins(ID, key(2));
    }

    /// Process 1 with `id` and `key` never joins process 0 (`ID`, key 1):
    /// both give up at the bound, process 0 still missing process 1.
    fn never_joins(id: MeshId, key1: SessionKey) {
        let addrs = vec![free_addr(), free_addr()];
        let p0 = process_0(addrs.clone(), Some(key(1)), Duration::from_secs(2));
        let p1 = connect_mesh(&addrs, addrs[1], 1, id, Some(&key1), Duration::from_secs(2));
        assert!(matches!(p1, Err(ClusterError::Timeout { .. })), "{p1:?}");
        match p0.join().unwrap() {
            Err(ClusterError::Timeout { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn peers_resolve_by_name_after_retries_and_a_bad_peer_is_named_at_the_bound() {
        let peers: Vec<Endpoint> = ["127.0.0.1:7000", "late.example:7001", "localhost:7002"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        // A name that resolves on the third lookup.
        let mut late_lookups = 0;
        let resolved = resolve_peers_with(&peers, Duration::from_secs(10), |p| {
            if p.host() == "late.example" {
                late_lookups += 1;
                if late_lookups < 3 {
                    return Err(std::io::Error::other("no such host yet"));
                }
                return Ok(vec!["10.0.0.1:7001".parse().unwrap()]);
            }
            Ok(vec![format!("127.0.0.1:{}", p.port()).parse().unwrap()])
        })
        .unwrap();
        assert_eq!(late_lookups, 3);
        assert_eq!(
            resolved,
            ["127.0.0.1:7000", "10.0.0.1:7001", "127.0.0.1:7002"]
                .map(|s| s.parse::<SocketAddr>().unwrap())
        );
        // A name that never resolves: the error names it, at the bound.
        let started = Instant::now();
        let err = resolve_peers_with(&peers, Duration::from_millis(300), |p| {
            if p.host() == "late.example" {
                Err(std::io::Error::other("no such host"))
            } else {
                Ok(vec!["127.0.0.1:1".parse().unwrap()])
            }
        })
        .unwrap_err();
        assert!(started.elapsed() >= Duration::from_millis(300));
        let msg = err.to_string();
        assert!(
            msg.contains("timely peer 1 (late.example:7001)") && msg.contains("no such host"),
            "{msg}"
        );
        // The system resolver: IP literals need no lookup; `localhost` is in /etc/hosts.
        let resolved = resolve_peers(&peers[..1], Duration::from_secs(1)).unwrap();
        assert_eq!(
            resolved,
            vec!["127.0.0.1:7000".parse::<SocketAddr>().unwrap()]
        );
        let local = resolve_peers(&peers[2..], Duration::from_secs(5)).unwrap();
        assert!(local[0].ip().is_loopback(), "{local:?}");
    }

    #[test]
    fn without_a_key_the_header_is_enough() {
        let addrs = vec![free_addr(), free_addr()];
        let p0 = process_0(addrs.clone(), None, Duration::from_secs(10));
        connect_mesh(&addrs, addrs[1], 1, ID, None, Duration::from_secs(10)).unwrap();
        p0.join().unwrap().unwrap();
    }

    #[test]
    fn a_peer_of_another_generation_never_joins() {
        let older = MeshId {
            generation: ID.generation - 1,
            ..ID
        };
        never_joins(older, key(1));
    }

    #[test]
    fn a_trickling_peer_is_cut_at_the_handshake_deadline() {
        let addrs = vec![free_addr(), free_addr()];
        let p0 = process_0(addrs.clone(), Some(key(1)), Duration::from_secs(20));
        let mut slow = dial(addrs[0]);
        let started = Instant::now();
        // One byte of the header every 500 ms: each read is within its
        // timeout, the whole handshake is not.
        let closed = loop {
            std::thread::sleep(Duration::from_millis(500));
            if slow.write_all(&[0x6c]).is_err() || started.elapsed() > Duration::from_secs(10) {
                break started.elapsed();
            }
            slow.set_read_timeout(Some(Duration::from_millis(1)))
                .unwrap();
            let mut b = [0u8; 1];
            if let Ok(0) = slow.read(&mut b) {
                break started.elapsed();
            }
        };
        assert!(
            closed < HANDSHAKE_BOUND + Duration::from_secs(2),
            "a trickling peer held its handshake for {closed:?}"
        );
        connect_mesh(
            &addrs,
            addrs[1],
            1,
            ID,
            Some(&key(1)),
            Duration::from_secs(10),
        )
        .unwrap();
        p0.join().unwrap().unwrap();
    }

    #[test]
    fn a_flood_of_idle_connections_cannot_keep_the_real_peer_out() {
        let addrs = vec![free_addr(), free_addr()];
        let p0 = process_0(addrs.clone(), Some(key(1)), Duration::from_secs(20));
        // More idle connections than handshakes may run at once, kept open.
        let idle: Vec<TcpStream> = (0..MAX_PENDING_HANDSHAKES + 16)
            .map(|_| dial(addrs[0]))
            .collect();
        let started = Instant::now();
        connect_mesh(
            &addrs,
            addrs[1],
            1,
            ID,
            Some(&key(1)),
            Duration::from_secs(20),
        )
        .unwrap();
        p0.join().unwrap().unwrap();
        assert!(
            started.elapsed() < HANDSHAKE_BOUND,
            "the flood held the real peer out for {:?}",
            started.elapsed()
        );
        drop(idle);
    }
}
