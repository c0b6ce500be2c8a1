//! Encryption of the timely mesh after its handshake (S1).
//!
//! With a session key, every mesh link that [`super::connect_mesh`] proved
//! gets a Noise session of its own (`Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`
//! from `snow`, the replica's key as the pre-shared key, a prologue binding
//! the replica, the generation and both process indexes; the process with
//! the higher index, which connected, initiates). Fresh ephemeral keys make
//! each link's transport keys its own and forward secret.
//!
//! timely takes plain `TcpStream`s, so each link is relayed: timely gets
//! one end of a loopback connection made for the link (the other end
//! accepted only if it is that very connection), and two threads carry its
//! bytes over the proved socket in records (a 2-byte big-endian length,
//! then at most 65,535 bytes: ChaCha20-Poly1305 under a counter nonce per
//! direction). A record that fails to authenticate (altered, injected,
//! replayed, reordered, dropped) closes the link: timely sees its peer gone
//! and the process exits, to be restarted as a new generation — the same
//! path as a peer that died.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use lockstep_protocol::SessionKey;
use lockstep_transport::secure::{
    Handshake, HandshakeStep, SecureError, MAX_RECORD, MAX_RECORD_PLAIN,
};

use super::{read_exact_by, ClusterError, MeshId};

fn prologue(id: MeshId, a: usize, b: usize) -> Vec<u8> {
    let mut p = b"lockstep timely mesh v1".to_vec();
    p.extend_from_slice(&id.replica_id.to_le_bytes());
    p.extend_from_slice(&id.generation.to_le_bytes());
    p.extend_from_slice(&(a.min(b) as u64).to_le_bytes());
    p.extend_from_slice(&(a.max(b) as u64).to_le_bytes());
    p
}

/// The Noise handshake with `peer` over `s`, within `deadline`: the
/// transport crate's [`Handshake`], driven by blocking reads and writes.
fn handshake(
    s: &mut TcpStream,
    key: &SessionKey,
    id: MeshId,
    me: usize,
    peer: usize,
    deadline: Instant,
) -> std::io::Result<snow::StatelessTransportState> {
    let failed = |e: SecureError| match e {
        SecureError::NotProven => std::io::Error::other(format!(
            "mesh session: process {peer} did not prove the replica's key"
        )),
        SecureError::Io(e) => e,
        SecureError::Malformed(m) => {
            std::io::Error::other(format!("mesh session with process {peer}: {m}"))
        }
    };
    let mut hs = Handshake::new(key.bytes(), &prologue(id, me, peer), me > peer).map_err(failed)?;
    loop {
        match hs.next_step().map_err(failed)? {
            HandshakeStep::Send(message) => s.write_all(&message)?,
            HandshakeStep::Receive => {
                let mut len = [0u8; 2];
                read_exact_by(s, &mut len, deadline)?;
                let mut message = vec![0u8; Handshake::message_len(len).map_err(failed)?];
                read_exact_by(s, &mut message, deadline)?;
                hs.receive(&message).map_err(failed)?;
            }
            HandshakeStep::Done => break,
        }
    }
    s.set_read_timeout(None)?;
    hs.into_stateless().map_err(failed)
}

/// A loopback connection: the end timely gets and the end the relay keeps.
/// The accepted end is taken only if it is the connection just made (any
/// other local connection to the short-lived listener is dropped).
fn loopback_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0))?;
    let timely_end = TcpStream::connect(listener.local_addr()?)?;
    let ours: SocketAddr = timely_end.local_addr()?;
    loop {
        let (relay_end, from) = listener.accept()?;
        if from == ours {
            timely_end.set_nodelay(true)?;
            relay_end.set_nodelay(true)?;
            return Ok((timely_end, relay_end));
        }
    }
}

/// timely's bytes → records on the wire.
fn seal(
    mut plain: TcpStream,
    mut wire: TcpStream,
    t: Arc<snow::StatelessTransportState>,
    peer: usize,
) {
    let mut buf = vec![0u8; MAX_RECORD_PLAIN];
    let mut out = vec![0u8; 2 + MAX_RECORD];
    let mut nonce = 0u64;
    loop {
        let n = match plain.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let len = match t.write_message(nonce, &buf[..n], &mut out[2..]) {
            Ok(len) => len,
            Err(e) => {
                tracing::error!(peer, "mesh record to process {peer}: {e}");
                break;
            }
        };
        nonce += 1;
        out[..2].copy_from_slice(&(len as u16).to_be_bytes());
        if wire.write_all(&out[..2 + len]).is_err() {
            break;
        }
    }
    let _ = wire.shutdown(Shutdown::Write);
    let _ = plain.shutdown(Shutdown::Read);
}

/// Records on the wire → timely's bytes; a record that does not
/// authenticate closes the link.
fn open(
    mut wire: TcpStream,
    mut plain: TcpStream,
    t: Arc<snow::StatelessTransportState>,
    peer: usize,
) {
    let mut record = vec![0u8; MAX_RECORD];
    let mut buf = vec![0u8; MAX_RECORD];
    let mut nonce = 0u64;
    loop {
        let mut len = [0u8; 2];
        if wire.read_exact(&mut len).is_err() {
            break;
        }
        let len = u16::from_be_bytes(len) as usize;
        if wire.read_exact(&mut record[..len]).is_err() {
            break;
        }
        match t.read_message(nonce, &record[..len], &mut buf) {
            Ok(n) => {
                nonce += 1;
                if plain.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(_) => {
                tracing::error!(
                    peer,
                    record = nonce,
                    "a timely mesh record from process {peer} does not authenticate (altered, injected, replayed or dropped on the way): closing the link"
                );
                let _ = wire.shutdown(Shutdown::Both);
                let _ = plain.shutdown(Shutdown::Both);
                return;
            }
        }
    }
    let _ = plain.shutdown(Shutdown::Write);
}

/// Sets up `link`'s session with process `peer` and returns the stream
/// timely uses for it, relayed encrypted over `link`.
pub(super) fn encrypt_link(
    mut link: TcpStream,
    key: &SessionKey,
    id: MeshId,
    me: usize,
    peer: usize,
    deadline: Instant,
) -> std::io::Result<TcpStream> {
    let transport = Arc::new(handshake(&mut link, key, id, me, peer, deadline)?);
    let (timely_end, relay_end) = loopback_pair()?;
    let (wire_in, plain_out) = (link.try_clone()?, relay_end.try_clone()?);
    let t = Arc::clone(&transport);
    std::thread::Builder::new()
        .name(format!("mesh-seal-{peer}"))
        .spawn(move || seal(relay_end, link, t, peer))?;
    std::thread::Builder::new()
        .name(format!("mesh-open-{peer}"))
        .spawn(move || open(wire_in, plain_out, transport, peer))?;
    Ok(timely_end)
}

/// Encrypts every link of a formed mesh (one thread per link, all within
/// `deadline`); `sockets[me]` stays `None`.
pub fn encrypt_mesh(
    sockets: Vec<Option<TcpStream>>,
    key: &SessionKey,
    id: MeshId,
    me: usize,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, ClusterError> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = sockets
            .into_iter()
            .enumerate()
            .map(|(peer, s)| {
                s.map(|s| scope.spawn(move || encrypt_link(s, key, id, me, peer, deadline)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                None => Ok(None),
                Some(h) => h
                    .join()
                    .map_err(|_| ClusterError::BadPeer("a mesh session thread panicked".into()))?
                    .map(Some)
                    .map_err(ClusterError::Io),
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const ID: MeshId = MeshId {
        replica_id: 9,
        generation: 1,
    };

    /// Two processes' ends of one link through an on-path relay that
    /// records what passes and may flip one byte of process 1's records.
    fn linked(
        key0: SessionKey,
        key1: SessionKey,
        flip_at: Option<usize>,
    ) -> (
        std::io::Result<TcpStream>,
        std::io::Result<TcpStream>,
        Arc<std::sync::Mutex<Vec<u8>>>,
    ) {
        let l0 = TcpListener::bind("127.0.0.1:0").unwrap();
        let relay = TcpListener::bind("127.0.0.1:0").unwrap();
        let (a0, ar) = (l0.local_addr().unwrap(), relay.local_addr().unwrap());
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen2 = Arc::clone(&seen);
        std::thread::spawn(move || {
            let (from1, _) = relay.accept().unwrap();
            let to0 = TcpStream::connect(a0).unwrap();
            let (mut r1, mut w0) = (from1.try_clone().unwrap(), to0.try_clone().unwrap());
            let (mut r0, mut w1) = (to0, from1);
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while let Ok(n) = r0.read(&mut b) {
                    if n == 0 || w1.write_all(&b[..n]).is_err() {
                        break;
                    }
                }
            });
            let mut b = [0u8; 4096];
            let mut at = 0usize;
            while let Ok(n) = r1.read(&mut b) {
                if n == 0 {
                    break;
                }
                if let Some(f) = flip_at {
                    if (at..at + n).contains(&f) {
                        b[f - at] ^= 0x01;
                    }
                }
                at += n;
                seen2.lock().unwrap().extend_from_slice(&b[..n]);
                if w0.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        let p0 = std::thread::spawn(move || {
            let (s, _) = l0.accept().unwrap();
            encrypt_link(s, &key0, ID, 0, 1, deadline)
        });
        let s1 = TcpStream::connect(ar).unwrap();
        let p1 = encrypt_link(s1, &key1, ID, 1, 0, deadline);
        (p0.join().unwrap(), p1, seen)
    }

    #[test]
    fn an_on_path_reader_sees_no_mesh_byte_in_the_clear() {
        let key = SessionKey::from_bytes([3; 32]);
        let (p0, p1, seen) = linked(key.clone(), key, None);
        let (mut p0, mut p1) = (p0.unwrap(), p1.unwrap());
        let secret = b"row 4711: a value only the replica may read".repeat(50);
        p1.write_all(&secret).unwrap();
        let mut got = vec![0u8; secret.len()];
        p0.read_exact(&mut got).unwrap();
        assert_eq!(got, secret, "the peer reads what timely sent");
        p0.write_all(b"back").unwrap();
        let mut back = [0u8; 4];
        p1.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"back");
        let wire = seen.lock().unwrap().clone();
        assert!(wire.len() > secret.len(), "the relay saw the records");
        assert!(
            !wire.windows(8).any(|w| secret.windows(8).any(|s| s == w)),
            "8 bytes of the plaintext crossed the wire in the clear"
        );
    }

    #[test]
    fn an_altered_record_closes_the_link() {
        let key = SessionKey::from_bytes([4; 32]);
        // The handshake's two messages are 2 + 48 bytes each way; flip a
        // byte inside process 1's first record.
        let (p0, p1, _) = linked(key.clone(), key, Some(50 + 10));
        let (mut p0, mut p1) = (p0.unwrap(), p1.unwrap());
        p1.write_all(&[7u8; 100]).unwrap();
        p0.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        let r = p0.read_to_end(&mut got);
        assert!(got.is_empty(), "altered bytes reached timely: {got:?}");
        assert!(
            !matches!(r, Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "{r:?}"
        );
    }

    #[test]
    fn a_peer_without_the_key_gets_no_session() {
        let (p0, p1, _) = linked(
            SessionKey::from_bytes([5; 32]),
            SessionKey::from_bytes([6; 32]),
            None,
        );
        assert!(p0.is_err() || p1.is_err());
    }
}
