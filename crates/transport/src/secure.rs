//! Session security: a mutually authenticated, encrypted channel between a
//! controller and one replica process.
//!
//! A replica started with a [`SessionKey`] accepts a controller connection
//! only after a Noise handshake (`Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`,
//! from the `snow` crate; nothing here is a cipher, MAC or handshake of our
//! own):
//!
//! 1. the controller (initiator) sends its ephemeral key, authenticated
//!    with the replica's key as the pre-shared key;
//! 2. the replica (responder) answers with its own ephemeral key,
//!    authenticated the same way. The controller checks it: a process that
//!    cannot prove the key (an impostor bound to a freed port) gets nothing
//!    more, no Hello, no history, no peeks.
//!
//! Both ends thereby prove the key, and both derive fresh transport keys
//! bound to this connection (ephemeral Diffie–Hellman: forward secret). The
//! prologue binds the replica ID and the process index, so a handshake for
//! one process does not complete with another. Every frame after that is
//! encrypted and authenticated with ChaCha20-Poly1305 under a counter nonce:
//! a forged, altered, replayed, reordered or dropped record fails to decrypt
//! and ends the connection ([`SecureCodec`]).
//!
//! On the wire a handshake message and a record are each a 2-byte
//! big-endian length and that many bytes (a Noise message is at most 65,535
//! bytes). A frame of the protocol ([`crate::FrameCodec`]) is encrypted in as
//! many records as it needs.
//!
//! A replica started without a key (by hand, for a test) speaks plain frames;
//! [`SecureCodec`] then passes them through unchanged.

use std::io;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::{Decoder, Encoder};

use lockstep_protocol::{CodecError, SessionKey};

/// The Noise protocol every secured session uses.
pub const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";

/// The longest Noise message.
const MAX_RECORD: usize = 65535;
/// The authentication tag of every record.
const TAG_LEN: usize = 16;
/// The most plaintext one record carries.
const MAX_RECORD_PLAIN: usize = MAX_RECORD - TAG_LEN;
/// The longest handshake message accepted (an ephemeral key, a tag and an
/// empty payload are 48 bytes).
const MAX_HANDSHAKE_MESSAGE: usize = 256;

/// Why a session could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SecureError {
    /// The other end does not hold the replica's session key (or speaks
    /// for another replica or process).
    #[error("the peer did not prove the replica's session key")]
    NotProven,
    /// The transport failed during the handshake.
    #[error("session handshake: {0}")]
    Io(#[from] io::Error),
    /// The other end sent something that is not a handshake message.
    #[error("session handshake: {0}")]
    Malformed(String),
}

/// The transport keys of one set-up session.
pub struct Session(Box<snow::TransportState>);

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session(..)")
    }
}

fn prologue(replica_id: u64, process_index: u32) -> Vec<u8> {
    let mut p = b"lockstep compute session v1".to_vec();
    p.extend_from_slice(&replica_id.to_le_bytes());
    p.extend_from_slice(&process_index.to_le_bytes());
    p
}

fn noise(e: snow::Error) -> SecureError {
    SecureError::Malformed(e.to_string())
}

/// A Noise builder of [`NOISE_PARAMS`] with `key` as the pre-shared key
/// and `prologue` bound: the controller sessions' and the timely mesh
/// links' (`lockstep_replica::cluster`) one way to set up a session.
pub fn builder<'a>(
    key: &'a [u8; 32],
    prologue: &'a [u8],
) -> Result<snow::Builder<'a>, SecureError> {
    let params: snow::params::NoiseParams = NOISE_PARAMS.parse().map_err(noise)?;
    snow::Builder::new(params)
        .prologue(prologue)
        .map_err(noise)?
        .psk(0, key)
        .map_err(noise)
}

async fn write_message<S: AsyncWrite + Unpin>(s: &mut S, message: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(2 + message.len());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message);
    s.write_all(&out).await?;
    s.flush().await
}

async fn read_message<S: AsyncRead + Unpin>(s: &mut S) -> Result<Vec<u8>, SecureError> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len).await?;
    let len = u16::from_be_bytes(len) as usize;
    if len > MAX_HANDSHAKE_MESSAGE {
        return Err(SecureError::Malformed(format!(
            "a handshake message of {len} bytes (at most {MAX_HANDSHAKE_MESSAGE})"
        )));
    }
    let mut message = vec![0u8; len];
    s.read_exact(&mut message).await?;
    Ok(message)
}

/// The controller's side: proves the key to process `process_index` of
/// replica `replica_id` and requires it to prove the key back. The caller
/// bounds the time it may take.
pub async fn initiate<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &SessionKey,
    replica_id: u64,
    process_index: u32,
) -> Result<Session, SecureError> {
    handshake(s, key, replica_id, process_index, true).await
}

/// The replica process's side: requires the controller to prove the key,
/// then proves it back. The caller bounds the time it may take.
pub async fn respond<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &SessionKey,
    replica_id: u64,
    process_index: u32,
) -> Result<Session, SecureError> {
    handshake(s, key, replica_id, process_index, false).await
}

/// Both sides of the handshake: the initiator writes the first message and
/// reads the second, the responder the other way round. A message that
/// does not authenticate is [`SecureError::NotProven`].
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &SessionKey,
    replica_id: u64,
    process_index: u32,
    initiator: bool,
) -> Result<Session, SecureError> {
    let prologue = prologue(replica_id, process_index);
    let builder = builder(key.bytes(), &prologue)?;
    let mut hs = if initiator {
        builder.build_initiator()
    } else {
        builder.build_responder()
    }
    .map_err(noise)?;
    let mut buf = [0u8; MAX_HANDSHAKE_MESSAGE];
    for writes in [initiator, !initiator] {
        if writes {
            let n = hs.write_message(&[], &mut buf).map_err(noise)?;
            write_message(s, &buf[..n]).await?;
        } else {
            let message = read_message(s).await?;
            hs.read_message(&message, &mut buf)
                .map_err(|_| SecureError::NotProven)?;
        }
    }
    Ok(Session(Box::new(hs.into_transport_mode().map_err(noise)?)))
}

/// A codec that encrypts what `C` encodes and decrypts what `C` decodes,
/// record by record, under a [`Session`]; without one it is `C` unchanged.
#[derive(Debug)]
pub struct SecureCodec<C> {
    inner: C,
    session: Option<Session>,
    /// Decrypted bytes not yet decoded into a frame.
    plain: BytesMut,
    /// One encoded frame before encryption.
    scratch: BytesMut,
}

impl<C> SecureCodec<C> {
    /// `inner` under `session` (`None`: plain frames).
    pub fn new(inner: C, session: Option<Session>) -> Self {
        SecureCodec {
            inner,
            session,
            plain: BytesMut::new(),
            scratch: BytesMut::new(),
        }
    }

    /// The frame codec inside.
    pub fn inner_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    /// Whether frames are encrypted.
    pub fn is_secure(&self) -> bool {
        self.session.is_some()
    }
}

fn unauthenticated() -> CodecError {
    CodecError::Io(io::Error::new(
        io::ErrorKind::InvalidData,
        "a record failed authentication (forged, altered, replayed or reordered): ending the session",
    ))
}

impl<C: Decoder<Error = CodecError>> Decoder for SecureCodec<C> {
    type Item = C::Item;
    type Error = CodecError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<C::Item>, CodecError> {
        let Some(session) = &mut self.session else {
            return self.inner.decode(src);
        };
        loop {
            // The inner codec bounds the frame (its length prefix is checked
            // against its maximum before anything more is kept).
            if let Some(item) = self.inner.decode(&mut self.plain)? {
                return Ok(Some(item));
            }
            if src.len() < 2 {
                return Ok(None);
            }
            let len = u16::from_be_bytes([src[0], src[1]]) as usize;
            if len < TAG_LEN {
                return Err(unauthenticated());
            }
            if src.len() < 2 + len {
                src.reserve(2 + len - src.len());
                return Ok(None);
            }
            src.advance(2);
            let record = src.split_to(len);
            let start = self.plain.len();
            self.plain.resize(start + len, 0);
            let n = session
                .0
                .read_message(&record, &mut self.plain[start..])
                .map_err(|_| unauthenticated())?;
            self.plain.truncate(start + n);
        }
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<C::Item>, CodecError> {
        if self.session.is_none() {
            return self.inner.decode_eof(src);
        }
        match self.decode(src)? {
            Some(item) => Ok(Some(item)),
            None if src.is_empty() && self.plain.is_empty() => Ok(None),
            None => Err(CodecError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed inside a record",
            ))),
        }
    }
}

impl<T, C: Encoder<T, Error = CodecError>> Encoder<T> for SecureCodec<C> {
    type Error = CodecError;

    fn encode(&mut self, item: T, dst: &mut BytesMut) -> Result<(), CodecError> {
        let Some(session) = &mut self.session else {
            return self.inner.encode(item, dst);
        };
        self.scratch.clear();
        self.inner.encode(item, &mut self.scratch)?;
        for chunk in self.scratch.chunks(MAX_RECORD_PLAIN) {
            let start = dst.len();
            dst.resize(start + 2 + chunk.len() + TAG_LEN, 0);
            let n = session
                .0
                .write_message(chunk, &mut dst[start + 2..])
                .map_err(|e| CodecError::Io(io::Error::other(e.to_string())))?;
            dst[start..start + 2].copy_from_slice(&(n as u16).to_be_bytes());
            dst.truncate(start + 2 + n);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ControllerCodec, ReplicaCodec};
    use lockstep_protocol::{Command, CommandKind, Response};

    fn key(b: u8) -> SessionKey {
        SessionKey::from_bytes([b; 32])
    }

    async fn pair(
        controller_key: SessionKey,
        replica_key: SessionKey,
        replica_index: u32,
    ) -> (Result<Session, SecureError>, Result<Session, SecureError>) {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let c = async move { initiate(&mut a, &controller_key, 7, 1).await };
        let r = async move { respond(&mut b, &replica_key, 7, replica_index).await };
        tokio::join!(c, r)
    }

    fn command(n: u64) -> Command {
        Command {
            seqno: n,
            strategy: lockstep_protocol::Strategy::Barrier,
            kind: CommandKind::StatusRequest {
                full: n.is_multiple_of(2),
            },
        }
    }

    #[tokio::test]
    async fn both_ends_prove_the_key_or_nothing_is_set_up() {
        let (c, r) = pair(key(1), key(1), 1).await;
        assert!(c.is_ok() && r.is_ok());
        // An impostor without the key: the controller learns it at once.
        let (c, r) = pair(key(1), key(2), 1).await;
        assert!(matches!(r, Err(SecureError::NotProven)), "{r:?}");
        assert!(c.is_err(), "{c:?}");
        // The key of the replica, but the handshake meant for another process.
        let (c, _) = pair(key(1), key(1), 2).await;
        assert!(c.is_err(), "{c:?}");
    }

    #[tokio::test]
    async fn frames_round_trip_and_a_forged_replayed_or_reordered_record_is_refused() {
        let (c, r) = pair(key(1), key(1), 1).await;
        let mut controller = SecureCodec::new(ControllerCodec::new(1 << 24), Some(c.unwrap()));
        let mut replica = SecureCodec::new(ReplicaCodec::new(1 << 24), Some(r.unwrap()));
        // A large frame takes several records and round-trips.
        let big = Command {
            kind: CommandKind::UpdateConfiguration([("k".to_string(), "v".repeat(200_000))].into()),
            ..command(1)
        };
        let mut wire = BytesMut::new();
        controller.encode(big.clone(), &mut wire).unwrap();
        controller.encode(command(2), &mut wire).unwrap();
        controller.encode(command(3), &mut wire).unwrap();
        assert!(wire.len() > MAX_RECORD, "several records");
        let all = wire.clone();
        // Byte by byte, as a socket may deliver it.
        let mut src = BytesMut::new();
        let mut got = Vec::new();
        for b in all.iter() {
            src.extend_from_slice(&[*b]);
            while let Some(cmd) = replica.decode(&mut src).unwrap() {
                got.push(cmd);
            }
        }
        assert_eq!(got, vec![big, command(2), command(3)]);

        // Replayed: the first record again.
        let mut replay = BytesMut::from(&all[..]);
        assert!(replica.decode(&mut replay).is_err());

        // Forged: one bit flipped in a fresh session's record.
        let (c, r) = pair(key(1), key(1), 1).await;
        let mut controller = SecureCodec::new(ControllerCodec::new(1 << 24), Some(c.unwrap()));
        let mut replica = SecureCodec::new(ReplicaCodec::new(1 << 24), Some(r.unwrap()));
        let mut wire = BytesMut::new();
        controller.encode(command(1), &mut wire).unwrap();
        let last = wire.len() - 1;
        wire[last] ^= 1;
        assert!(replica.decode(&mut wire).is_err());

        // Reordered: the second record before the first.
        let (c, r) = pair(key(1), key(1), 1).await;
        let mut controller = SecureCodec::new(ControllerCodec::new(1 << 24), Some(c.unwrap()));
        let mut replica = SecureCodec::new(ReplicaCodec::new(1 << 24), Some(r.unwrap()));
        let (mut first, mut second) = (BytesMut::new(), BytesMut::new());
        controller.encode(command(1), &mut first).unwrap();
        controller.encode(command(2), &mut second).unwrap();
        assert!(replica.decode(&mut second).is_err());

        // And responses the other way round, too.
        let (c, r) = pair(key(1), key(1), 1).await;
        let mut controller = SecureCodec::new(ControllerCodec::new(1 << 24), Some(c.unwrap()));
        let mut replica = SecureCodec::new(ReplicaCodec::new(1 << 24), Some(r.unwrap()));
        let response = Response {
            process_index: 1,
            kind: lockstep_protocol::ResponseKind::Error(lockstep_protocol::ErrorResponse {
                kind: lockstep_protocol::ErrorKind::Malformed,
                message: "m".into(),
                seqno: 9,
            }),
        };
        let mut wire = BytesMut::new();
        replica.encode(response.clone(), &mut wire).unwrap();
        assert_eq!(controller.decode(&mut wire).unwrap(), Some(response));
    }

    #[tokio::test]
    async fn a_huge_handshake_message_is_refused_before_it_is_read() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let r = tokio::spawn(async move { respond(&mut b, &key(1), 7, 1).await });
        a.write_all(&u16::MAX.to_be_bytes()).await.unwrap();
        assert!(matches!(r.await.unwrap(), Err(SecureError::Malformed(_))));
    }

    #[test]
    fn without_a_session_frames_pass_through() {
        let mut plain = SecureCodec::new(ControllerCodec::new(1 << 20), None);
        let mut reference = ControllerCodec::new(1 << 20);
        let (mut a, mut b) = (BytesMut::new(), BytesMut::new());
        plain.encode(command(4), &mut a).unwrap();
        reference.encode(command(4), &mut b).unwrap();
        assert_eq!(a, b);
        assert!(!plain.is_secure());
    }
}
