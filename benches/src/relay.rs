//! A network model for the benchmarks: a TCP relay that holds every chunk
//! it forwards for a fixed one-way delay, and optionally paces it to a
//! bandwidth.
//!
//! The kernel of the bench machines has no `netem`, so the delay is added in
//! user space: a [`Relay`] listens on a loopback port and forwards each
//! connection it accepts to its target. Each direction of each connection
//! has a reader thread, which stamps every chunk with the time it arrived,
//! and a writer thread, which sleeps until that time plus the [`Link`]'s
//! delay (then, with a bandwidth cap, for the chunk's transmission time)
//! before it writes the chunk on. Chunks keep their order; a chunk that
//! arrives while an earlier one waits waits its own full delay, so the
//! delay is the same for every byte, like a long wire.
//!
//! The relay accepts a connection before it connects on to the target, so
//! a target that does not listen yet is retried every 5 ms for up to 20 s
//! (where a real network would refuse the connection and the client would
//! retry).
//!
//! The link's settings are read for every chunk, so one running replica can
//! be measured at several delays. The relay's own cost (two extra socket
//! hops and two thread wake-ups per chunk) is measured by the `network`
//! bench at a delay of 0, against the same operation without relays.
//!
//! Writer threads ask the kernel for a 1 ns timer slack
//! (`PR_SET_TIMERSLACK`), so that a sleep of 100 µs is not rounded up by the
//! default 50 µs slack.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The settings of a modelled link, shared by every relay of a replica and
/// read for every chunk.
#[derive(Debug, Default)]
pub struct Link {
    delay_us: AtomicU64,
    bits_per_sec: AtomicU64,
}

impl Link {
    /// A link with no delay and no bandwidth cap.
    pub fn new() -> Arc<Link> {
        Arc::new(Link::default())
    }

    /// Sets the one-way delay every chunk is held for, in each direction.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// The one-way delay.
    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us.load(Ordering::Relaxed))
    }

    /// Caps each direction of each connection at `bits_per_sec` (0: no cap).
    pub fn set_bandwidth(&self, bits_per_sec: u64) {
        self.bits_per_sec.store(bits_per_sec, Ordering::Relaxed);
    }

    /// How long `bytes` take on the wire at the cap (zero without a cap).
    fn transmission(&self, bytes: usize) -> Duration {
        match self.bits_per_sec.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            bps => Duration::from_nanos((bytes as u64 * 8).saturating_mul(1_000_000_000) / bps),
        }
    }
}

/// What a relay has forwarded, in bytes, since it started.
#[derive(Debug, Default)]
pub struct Counters {
    /// From the connecting side to the target.
    pub to_target: AtomicU64,
    /// From the target back to the connecting side.
    pub from_target: AtomicU64,
}

/// A delaying TCP relay on a loopback port; see the module docs. It stops
/// accepting when dropped; connections it already forwards end when either
/// side closes.
pub struct Relay {
    addr: SocketAddr,
    target: Arc<Mutex<Option<SocketAddr>>>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

/// How long an accepted connection waits for the relay's target to be set
/// and to accept.
const TARGET_WAIT: Duration = Duration::from_secs(20);

impl Relay {
    /// Starts a relay on `127.0.0.1` with an unset target (see
    /// [`Relay::set_target`]): a connection accepted before the target is
    /// set waits for it.
    pub fn start(link: Arc<Link>) -> io::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let target = Arc::new(Mutex::new(None));
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (t, c, s) = (target.clone(), counters.clone(), stop.clone());
        std::thread::Builder::new()
            .name(format!("relay-{}", addr.port()))
            .spawn(move || accept_loop(listener, link, t, c, s))?;
        Ok(Relay {
            addr,
            target,
            counters,
            stop,
        })
    }

    /// Starts a relay to `target`.
    pub fn to(target: SocketAddr, link: Arc<Link>) -> io::Result<Relay> {
        let r = Relay::start(link)?;
        r.set_target(target);
        Ok(r)
    }

    /// Where the relay listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets (or changes, for later connections) where the relay forwards.
    pub fn set_target(&self, target: SocketAddr) {
        *self.target.lock().expect("relay target") = Some(target);
    }

    /// The bytes forwarded so far.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

fn accept_loop(
    listener: TcpListener,
    link: Arc<Link>,
    target: Arc<Mutex<Option<SocketAddr>>>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(inbound) = conn else { continue };
        let (link, target, counters) = (link.clone(), target.clone(), counters.clone());
        let _ = std::thread::Builder::new()
            .name("relay-conn".into())
            .spawn(move || {
                // A connection that cannot reach the target is closed: its
                // peer sees the refusal as it would without the relay.
                let _ = forward(inbound, &link, &target, &counters);
            });
    }
}

/// Connects `inbound` to the target and starts both directions.
fn forward(
    inbound: TcpStream,
    link: &Arc<Link>,
    target: &Mutex<Option<SocketAddr>>,
    counters: &Arc<Counters>,
) -> io::Result<()> {
    let deadline = Instant::now() + TARGET_WAIT;
    let to = loop {
        if let Some(t) = *target.lock().expect("relay target") {
            break t;
        }
        if Instant::now() > deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no relay target"));
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    // The target may not listen yet (a replica's processes start one after
    // another, and the relay accepted before the target was up): retry, as
    // the replica's own mesh does when it connects directly, rather than
    // close a connection the peer already counts as made.
    let outbound = loop {
        match TcpStream::connect(to) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    let up = (inbound.try_clone()?, outbound.try_clone()?);
    let down = (outbound, inbound);
    let c = counters.clone();
    pipe(up.0, up.1, link.clone(), move |n| {
        c.to_target.fetch_add(n, Ordering::Relaxed);
    })?;
    let c = counters.clone();
    pipe(down.0, down.1, link.clone(), move |n| {
        c.from_target.fetch_add(n, Ordering::Relaxed);
    })
}

/// One direction: a reader thread stamps chunks, a writer thread delays and
/// writes them.
fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    link: Arc<Link>,
    count: impl Fn(u64) + Send + 'static,
) -> io::Result<()> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::Builder::new()
        .name("relay-read".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                            break;
                        }
                    }
                }
            }
            // Dropping `tx` ends the writer after the chunks in flight.
        })?;
    std::thread::Builder::new()
        .name("relay-write".into())
        .spawn(move || {
            fine_timer_slack();
            // When the link is free again, with a bandwidth cap.
            let mut free = Instant::now();
            while let Ok((arrived, chunk)) = rx.recv() {
                let start = (arrived + link.delay()).max(free);
                let done = start + link.transmission(chunk.len());
                free = done;
                sleep_until(done);
                if to.write_all(&chunk).is_err() {
                    break;
                }
                count(chunk.len() as u64);
            }
            let _ = to.shutdown(Shutdown::Write);
        })?;
    Ok(())
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// Asks for a 1 ns timer slack on this thread, so that short sleeps end on
/// time (the default slack is 50 µs). Best effort: the relay works without.
fn fine_timer_slack() {
    let _ = nix::sys::prctl::set_timerslack(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on loopback; returns its address.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let mut s = s.unwrap();
                std::thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    let _ = io::copy(&mut r, &mut s);
                });
            }
        });
        addr
    }

    #[test]
    fn a_relay_forwards_bytes_in_order_and_counts_them() {
        let link = Link::new();
        let relay = Relay::to(echo(), link).unwrap();
        let mut s = TcpStream::connect(relay.addr()).unwrap();
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let mut w = s.try_clone().unwrap();
        let data = sent.clone();
        let writer = std::thread::spawn(move || w.write_all(&data).unwrap());
        let mut got = vec![0u8; sent.len()];
        s.read_exact(&mut got).unwrap();
        writer.join().unwrap();
        assert!(got == sent, "the relay changed or reordered bytes");
        // The relay counts a chunk after forwarding it: the last count may
        // land just after the client read the bytes. Wait for it, bounded.
        let want = sent.len() as u64;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let counts = || {
            (
                relay.counters().to_target.load(Ordering::Relaxed),
                relay.counters().from_target.load(Ordering::Relaxed),
            )
        };
        while counts() != (want, want) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(counts(), (want, want));
    }

    #[test]
    fn a_round_trip_through_a_delaying_relay_takes_at_least_two_delays() {
        let link = Link::new();
        link.set_delay(Duration::from_millis(20));
        let relay = Relay::to(echo(), link).unwrap();
        let mut s = TcpStream::connect(relay.addr()).unwrap();
        let t = Instant::now();
        s.write_all(b"ping").unwrap();
        let mut got = [0u8; 4];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ping");
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "a 20 ms link answered a round trip in {:?}",
            t.elapsed()
        );
    }

    #[test]
    fn a_bandwidth_cap_paces_a_transfer() {
        let link = Link::new();
        // 8 Mbit/s: 100 kB take 100 ms.
        link.set_bandwidth(8_000_000);
        let relay = Relay::to(echo(), link).unwrap();
        let mut s = TcpStream::connect(relay.addr()).unwrap();
        let mut w = s.try_clone().unwrap();
        let t = Instant::now();
        std::thread::spawn(move || w.write_all(&[7u8; 100_000]).unwrap());
        let mut got = vec![0u8; 100_000];
        s.read_exact(&mut got).unwrap();
        // Each direction is paced: at least 100 ms each way, overlapping.
        assert!(
            t.elapsed() >= Duration::from_millis(100),
            "100 kB over 8 Mbit/s took {:?}",
            t.elapsed()
        );
    }
}
