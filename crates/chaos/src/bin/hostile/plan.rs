//! What one seed does, drawn from the seed alone: the replica's shape, the
//! attacks (which port, which kind, how many connections, when), the
//! process killed and when, and when the other user probes.

use super::*;

/// A small deterministic generator (splitmix64 to seed, xorshift64* to
/// draw): the seed is the whole plan.
pub(crate) struct Rng(u64);

impl Rng {
    /// The generator of `seed`.
    pub(crate) fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `lo..hi` (`lo` if the range is empty).
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next() % (hi - lo)
    }

    /// A duration in `lo..hi` milliseconds.
    pub(crate) fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }

    /// One of `items`.
    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.range(0, items.len() as u64) as usize]
    }
}

/// A port kind under attack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Port {
    /// The environment's gRPC API.
    Api,
    /// The environment's metrics endpoint.
    Metrics,
    /// Process `i`'s controller port (where it also serves its metrics).
    Controller(usize),
}

impl std::fmt::Display for Port {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Port::Api => write!(f, "api"),
            Port::Metrics => write!(f, "metrics"),
            Port::Controller(i) => write!(f, "controller-{i}"),
        }
    }
}

/// The HTTP/2 connection preface (what a gRPC client sends first).
pub(crate) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The preface's first 9 bytes, then nothing.
pub(crate) const H2_PREFACE_START: &[u8] = b"PRI * HTT";
/// The start of a TLS ClientHello: the record header and the handshake
/// header of a 508-byte hello, and its version, then nothing.
pub(crate) const TLS_HELLO: &[u8] = &[
    0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03, 0x5a, 0x5a,
];
/// A request head without its end (no empty line).
pub(crate) const PARTIAL_HEAD: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n";
/// A gRPC request line over HTTP/1.1, without its end.
pub(crate) const PARTIAL_GRPC_HEAD: &[u8] =
    b"POST /lockstep.environment.v1.Environment/ListReplicas HTTP/1.1\r\n";
/// A scrape's first byte, then nothing.
pub(crate) const G: &[u8] = b"G";
/// The start of a Noise handshake message: its two-byte length (48) and 10
/// of its 48 bytes.
pub(crate) const NOISE_PARTIAL: &[u8] = &[
    0x00, 0x30, 0x8f, 0x11, 0x42, 0x07, 0x99, 0x3c, 0x01, 0xe4, 0x6d, 0x20,
];
/// A whole Noise first message's worth of bytes (length 48 and 48 bytes),
/// for trickling.
pub(crate) const NOISE_MESSAGE: &[u8] = &[
    0x00, 0x30, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
    24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47,
    48,
];

/// What an attacker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Connections held open, nothing sent.
    Flood,
    /// Connections that send these bytes at once, then hold (half-open
    /// handshakes, scrapes without their end).
    HalfOpen(&'static str, &'static [u8]),
    /// Slowloris: these bytes one per second (again from the start when
    /// they run out); a connection the port closes is opened again.
    Trickle(&'static str, &'static [u8]),
    /// API calls without a token, each on a new connection.
    NoToken,
    /// API calls with a wrong token, each on a new connection.
    WrongToken,
    /// `GET /metrics` without the metrics token, or with the API token.
    UnauthorizedScrape,
    /// HTTP/2 connections without a token sending unfinished
    /// `grpc.health.v1.Health/Check` messages (each declares 4 MiB, sends
    /// 16 KiB) on stream after stream, up to [`UNFINISHED_BYTES`] a
    /// connection; one the port closes is opened again.
    UnfinishedMessages,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Flood => write!(f, "flood"),
            Kind::HalfOpen(what, _) => write!(f, "half-open {what}"),
            Kind::Trickle(what, _) => write!(f, "trickle {what}"),
            Kind::NoToken => write!(f, "calls without a token"),
            Kind::WrongToken => write!(f, "calls with a wrong token"),
            Kind::UnauthorizedScrape => write!(f, "scrapes without the metrics token"),
            Kind::UnfinishedMessages => write!(f, "unfinished health checks"),
        }
    }
}

/// One attacker.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attack {
    /// Where.
    pub(crate) port: Port,
    /// What.
    pub(crate) kind: Kind,
    /// Connections (or concurrent callers).
    pub(crate) count: usize,
    /// When it starts, from the start of the attack phase.
    pub(crate) start: Duration,
    /// How long it holds.
    pub(crate) hold: Duration,
}

impl std::fmt::Display for Attack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} x{} on {} at {:.1}s for {:.1}s",
            self.kind,
            self.count,
            self.port,
            self.start.as_secs_f64(),
            self.hold.as_secs_f64()
        )
    }
}

/// One seed's plan.
#[derive(Clone, Debug)]
pub(crate) struct SeedPlan {
    /// Workers per process (the replica has [`PROCESSES`] processes).
    pub(crate) workers: u32,
    /// The attackers.
    pub(crate) attacks: Vec<Attack>,
    /// The process killed with SIGKILL.
    pub(crate) kill: usize,
    /// When, from the start of the attack phase.
    pub(crate) kill_at: Duration,
    /// When the other user probes the state directory and the API.
    pub(crate) probe_at: Duration,
}

/// The attack kinds of a port.
fn kinds(port: Port) -> &'static [Kind] {
    match port {
        Port::Api => &[
            Kind::Flood,
            Kind::HalfOpen("tls-hello", TLS_HELLO),
            Kind::HalfOpen("h2-preface", H2_PREFACE_START),
            Kind::HalfOpen("http1-head", PARTIAL_GRPC_HEAD),
            Kind::Trickle("h2-preface", H2_PREFACE),
            Kind::NoToken,
            Kind::WrongToken,
            Kind::UnfinishedMessages,
        ],
        Port::Metrics => &[
            Kind::Flood,
            Kind::HalfOpen("G", G),
            Kind::HalfOpen("partial-head", PARTIAL_HEAD),
            Kind::Trickle("partial-head", PARTIAL_HEAD),
            Kind::UnauthorizedScrape,
        ],
        Port::Controller(_) => &[
            Kind::Flood,
            Kind::HalfOpen("noise", NOISE_PARTIAL),
            Kind::HalfOpen("G", G),
            Kind::HalfOpen("partial-head", PARTIAL_HEAD),
            Kind::Trickle("noise", NOISE_MESSAGE),
            Kind::Trickle("partial-head", PARTIAL_HEAD),
        ],
    }
}

/// How many connections (or callers) an attack of `kind` on `port` uses.
fn count(rng: &mut Rng, port: Port, kind: Kind) -> usize {
    let (lo, hi) = match (kind, port) {
        (Kind::Flood, Port::Controller(_)) => (100, 300),
        (Kind::Flood, _) => (100, 600),
        (Kind::HalfOpen(..), _) => (20, 120),
        (Kind::Trickle(..), _) => (10, 40),
        (Kind::NoToken | Kind::WrongToken | Kind::UnauthorizedScrape, _) => (2, 6),
        (Kind::UnfinishedMessages, _) => (8, 24),
    };
    rng.range(lo, hi + 1) as usize
}

/// The plan of `seed`.
pub(crate) fn generate(seed: u64) -> SeedPlan {
    let mut rng = Rng::new(seed);
    let workers = rng.range(1, 3) as u32;
    let attack_ms = ATTACK.as_millis() as u64;
    // Always: more idle connections on the API than the environment has
    // descriptors (its limit is ENV_NOFILE), held longer than a call's
    // bound. With the admission bounds the port keeps at most its small
    // unproven pool of them; without, they take every descriptor, and a
    // token holder's next connection waits past its bound (the negative
    // control is caught).
    let start = rng.millis(300, 2_000);
    let mut attacks = vec![Attack {
        port: Port::Api,
        kind: Kind::Flood,
        count: rng.range(ENV_NOFILE + 90, ENV_NOFILE + 200) as usize,
        start,
        hold: ATTACK - start - Duration::from_millis(500),
    }];
    // Always: memory before proof, token-less connections sending
    // unfinished messages. With the byte budget each is closed past it;
    // without, the environment buffers them (the negative control's
    // memory is caught).
    let start = rng.millis(300, 2_000);
    attacks.push(Attack {
        port: Port::Api,
        kind: Kind::UnfinishedMessages,
        count: rng.range(16, 25) as usize,
        start,
        hold: ATTACK - start - Duration::from_millis(500),
    });
    // Then a random mix on every port.
    let mut ports = vec![Port::Api, Port::Metrics];
    ports.extend((0..PROCESSES as usize).map(Port::Controller));
    for port in ports {
        for _ in 0..rng.range(1, 4) {
            let kind = rng.pick(kinds(port));
            let count = count(&mut rng, port, kind);
            let start = rng.millis(0, 4_000);
            let longest = attack_ms - start.as_millis() as u64 - 300;
            let hold = rng.millis(4_000.min(longest), longest);
            attacks.push(Attack {
                port,
                kind,
                count,
                start,
                hold,
            });
        }
    }
    SeedPlan {
        workers,
        attacks,
        kill: rng.range(0, PROCESSES as u64) as usize,
        kill_at: rng.millis(1_500, 5_000),
        probe_at: rng.millis(500, 6_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_is_its_plan() {
        let (a, b) = (generate(7), generate(7));
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_ne!(format!("{a:?}"), format!("{:?}", generate(8)));
    }

    #[test]
    fn every_plan_floods_the_api_past_the_environment_limit_and_ends_in_time() {
        for seed in 0..500 {
            let p = generate(seed);
            let flood = &p.attacks[0];
            assert_eq!((flood.port, flood.kind), (Port::Api, Kind::Flood));
            assert!(flood.count as u64 > ENV_NOFILE + 64);
            assert!(flood.hold > OP_BOUND + Duration::from_secs(1), "{flood}");
            assert_eq!(
                (p.attacks[1].port, p.attacks[1].kind),
                (Port::Api, Kind::UnfinishedMessages)
            );
            for a in &p.attacks {
                assert!(a.start + a.hold <= ATTACK, "seed {seed}: {a}");
            }
            assert!(p.kill < PROCESSES as usize);
        }
    }
}
