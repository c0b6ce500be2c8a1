//! The mesh's tests: handshakes, spoofed and idle peers, generations, keys.

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

/// Process 1 of a 2-process replica under key 1, on this thread: its mesh.
fn process_1(addrs: &[SocketAddr], timeout: Duration) -> Vec<Option<TcpStream>> {
    connect_mesh(addrs, addrs[1], 1, ID, Some(&key(1)), timeout).unwrap()
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
    let mut p1 = process_1(&addrs, Duration::from_secs(20));
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
    process_1(&addrs, Duration::from_secs(10));
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
    process_1(&addrs, Duration::from_secs(20));
    p0.join().unwrap().unwrap();
    assert!(
        started.elapsed() < HANDSHAKE_BOUND,
        "the flood held the real peer out for {:?}",
        started.elapsed()
    );
    drop(idle);
}
