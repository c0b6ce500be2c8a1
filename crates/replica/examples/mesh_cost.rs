//! What encrypting the timely mesh costs one link, plain against encrypted
//! in one run: the round trip of a 64-byte message and the throughput of a
//! 64 MiB stream between two "processes" (threads with their own mesh
//! ends, over loopback), formed by `connect_mesh` without a key (plain) and
//! with one (`encrypt_mesh`: a Noise session and a relay per link).
//!
//! `cargo run --release -p lockstep-replica --example mesh_cost`

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lockstep_protocol::SessionKey;
use lockstep_replica::cluster::{connect_mesh, encrypt_mesh, MeshId};

const ID: MeshId = MeshId {
    replica_id: 1,
    generation: 1,
};

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Both ends of one link: process 0's socket to 1 and process 1's to 0.
fn link(key: Option<&SessionKey>) -> (TcpStream, TcpStream) {
    let addrs = vec![free_addr(), free_addr()];
    let (a, k) = (addrs.clone(), key.cloned());
    let p0 = std::thread::spawn(move || {
        let s = connect_mesh(&a, a[0], 0, ID, k.as_ref(), Duration::from_secs(10)).unwrap();
        match &k {
            Some(k) => encrypt_mesh(s, k, ID, 0, Instant::now() + Duration::from_secs(10)).unwrap(),
            None => s,
        }
    });
    let s = connect_mesh(&addrs, addrs[1], 1, ID, key, Duration::from_secs(10)).unwrap();
    let mut s1 = match key {
        Some(k) => encrypt_mesh(s, k, ID, 1, Instant::now() + Duration::from_secs(10)).unwrap(),
        None => s,
    };
    let mut s0 = p0.join().unwrap();
    (s0[1].take().unwrap(), s1[0].take().unwrap())
}

/// The median round trip of a 64-byte message, over `n` trips.
fn round_trip(a: &mut TcpStream, b: &mut TcpStream, n: usize) -> Duration {
    let mut echo = b.try_clone().unwrap();
    let t = std::thread::spawn(move || {
        let mut m = [0u8; 64];
        for _ in 0..n {
            echo.read_exact(&mut m).unwrap();
            echo.write_all(&m).unwrap();
        }
    });
    let mut times = Vec::with_capacity(n);
    let mut m = [7u8; 64];
    for _ in 0..n {
        let started = Instant::now();
        a.write_all(&m).unwrap();
        a.read_exact(&mut m).unwrap();
        times.push(started.elapsed());
    }
    t.join().unwrap();
    times.sort();
    times[n / 2]
}

/// MB/s of `total` bytes from `a` to `b` in 1 MiB writes.
fn throughput(a: &mut TcpStream, b: &mut TcpStream, total: usize) -> f64 {
    let mut sink = b.try_clone().unwrap();
    let t = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        let mut left = total;
        while left > 0 {
            let n = sink.read(&mut buf).unwrap();
            assert!(n > 0);
            left -= n.min(left);
        }
    });
    let chunk = vec![42u8; 1 << 20];
    let started = Instant::now();
    for _ in 0..total / chunk.len() {
        a.write_all(&chunk).unwrap();
    }
    t.join().unwrap();
    total as f64 / started.elapsed().as_secs_f64() / 1e6
}

fn main() {
    let key = SessionKey::from_bytes([9; 32]);
    println!("case\tround trip (64 B, median of 2000)\tthroughput (64 MiB)");
    for rep in 0..3 {
        for (name, k) in [("plain", None), ("encrypted", Some(&key))] {
            let (mut a, mut b) = link(k);
            let rt = round_trip(&mut a, &mut b, 2000);
            let mbs = throughput(&mut a, &mut b, 64 << 20);
            println!(
                "{name} #{rep}\t{:.1} µs\t{mbs:.0} MB/s",
                rt.as_secs_f64() * 1e6
            );
        }
    }
}
