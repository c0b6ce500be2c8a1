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

/// The longest Noise message: the most a record's 2-byte length announces.
pub const MAX_RECORD: usize = 65535;
/// The authentication tag of every record.
const TAG_LEN: usize = 16;
/// The most plaintext one record carries.
pub const MAX_RECORD_PLAIN: usize = MAX_RECORD - TAG_LEN;
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

/// A Noise handshake of [`NOISE_PARAMS`], with no I/O of its own: the
/// controller sessions' ([`initiate`], [`respond`], async) and the timely
/// mesh links' (`lockstep_replica::cluster`, blocking) one way to set up a
/// session. The driver sends each [`HandshakeStep::Send`] as it is,
/// reads a message for each [`HandshakeStep::Receive`] (its 2-byte length
/// checked by [`Handshake::message_len`], then [`Handshake::receive`]),
/// and stops at [`HandshakeStep::Done`].
pub struct Handshake {
    state: snow::HandshakeState,
    /// Whether this side writes the next message.
    writes: bool,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handshake(..)")
    }
}

/// What a [`Handshake`]'s driver does next.
#[derive(Debug, PartialEq, Eq)]
pub enum HandshakeStep {
    /// Send these bytes (a message with its 2-byte big-endian length).
    Send(Vec<u8>),
    /// Read the other side's next message.
    Receive,
    /// The handshake is done: take its transport keys.
    Done,
}

impl Handshake {
    /// A handshake with `key` as the pre-shared key and `prologue` bound;
    /// the initiator writes the first message.
    pub fn new(key: &[u8; 32], prologue: &[u8], initiator: bool) -> Result<Handshake, SecureError> {
        let params: snow::params::NoiseParams = NOISE_PARAMS.parse().map_err(noise)?;
        let builder = snow::Builder::new(params)
            .prologue(prologue)
            .map_err(noise)?
            .psk(0, key)
            .map_err(noise)?;
        let state = if initiator {
            builder.build_initiator()
        } else {
            builder.build_responder()
        }
        .map_err(noise)?;
        Ok(Handshake {
            state,
            writes: initiator,
        })
    }

    /// The next step; a `Send` is taken as sent.
    pub fn next_step(&mut self) -> Result<HandshakeStep, SecureError> {
        if self.state.is_handshake_finished() {
            return Ok(HandshakeStep::Done);
        }
        if !self.writes {
            return Ok(HandshakeStep::Receive);
        }
        let mut out = vec![0u8; 2 + MAX_HANDSHAKE_MESSAGE];
        let n = self
            .state
            .write_message(&[], &mut out[2..])
            .map_err(noise)?;
        out[..2].copy_from_slice(&(n as u16).to_be_bytes());
        out.truncate(2 + n);
        self.writes = false;
        Ok(HandshakeStep::Send(out))
    }

    /// The length of the message a 2-byte prefix announces; a length no
    /// handshake message has is [`SecureError::Malformed`], before
    /// anything is read or kept.
    pub fn message_len(prefix: [u8; 2]) -> Result<usize, SecureError> {
        let len = u16::from_be_bytes(prefix) as usize;
        if len > MAX_HANDSHAKE_MESSAGE {
            return Err(SecureError::Malformed(format!(
                "a handshake message of {len} bytes (at most {MAX_HANDSHAKE_MESSAGE})"
            )));
        }
        Ok(len)
    }

    /// Takes the other side's message: [`SecureError::NotProven`] if it
    /// does not authenticate (another key, replica, process or link).
    pub fn receive(&mut self, message: &[u8]) -> Result<(), SecureError> {
        let mut buf = [0u8; MAX_HANDSHAKE_MESSAGE];
        self.state
            .read_message(message, &mut buf)
            .map_err(|_| SecureError::NotProven)?;
        self.writes = true;
        Ok(())
    }

    /// The transport keys of a finished handshake, a counter nonce kept
    /// per direction.
    pub fn into_session(self) -> Result<Session, SecureError> {
        Ok(Session(Box::new(
            self.state.into_transport_mode().map_err(noise)?,
        )))
    }

    /// The transport keys of a finished handshake, the nonce given with
    /// each record (two threads, one per direction, share them).
    pub fn into_stateless(self) -> Result<snow::StatelessTransportState, SecureError> {
        self.state.into_stateless_transport_mode().map_err(noise)
    }
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

/// Drives a [`Handshake`] over `s`.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &SessionKey,
    replica_id: u64,
    process_index: u32,
    initiator: bool,
) -> Result<Session, SecureError> {
    let mut hs = Handshake::new(key.bytes(), &prologue(replica_id, process_index), initiator)?;
    loop {
        match hs.next_step()? {
            HandshakeStep::Send(message) => {
                s.write_all(&message).await?;
                s.flush().await?;
            }
            HandshakeStep::Receive => {
                let mut len = [0u8; 2];
                s.read_exact(&mut len).await?;
                let mut message = vec![0u8; Handshake::message_len(len)?];
                s.read_exact(&mut message).await?;
                hs.receive(&message)?;
            }
            HandshakeStep::Done => return hs.into_session(),
        }
    }
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

    /// Runs two handshakes against each other, message by message.
    fn drive(a: &mut Handshake, b: &mut Handshake) -> Result<(), SecureError> {
        loop {
            match (a.next_step()?, b.next_step()?) {
                (HandshakeStep::Done, HandshakeStep::Done) => return Ok(()),
                (HandshakeStep::Send(m), HandshakeStep::Receive) => {
                    let len = Handshake::message_len([m[0], m[1]])?;
                    assert_eq!(len, m.len() - 2);
                    b.receive(&m[2..])?;
                }
                (HandshakeStep::Receive, HandshakeStep::Send(m)) => a.receive(&m[2..])?,
                steps => panic!("out of turn: {steps:?}"),
            }
        }
    }

    #[test]
    fn the_handshake_machine_takes_turns_and_its_stateless_keys_interoperate() {
        // The mesh's use: prologues bind the link; the higher index initiates.
        let mut a = Handshake::new(&[3; 32], b"link 0-1", true).unwrap();
        let mut b = Handshake::new(&[3; 32], b"link 0-1", false).unwrap();
        drive(&mut a, &mut b).unwrap();
        let (a, b) = (a.into_stateless().unwrap(), b.into_stateless().unwrap());
        let mut record = [0u8; 64];
        let n = a.write_message(0, b"timely bytes", &mut record).unwrap();
        let mut plain = [0u8; 64];
        let m = b.read_message(0, &record[..n], &mut plain).unwrap();
        assert_eq!(&plain[..m], b"timely bytes");
        // Another link's prologue, or another key: not proven.
        for (key, prologue) in [([3; 32], &b"link 0-2"[..]), ([4; 32], &b"link 0-1"[..])] {
            let mut a = Handshake::new(&[3; 32], b"link 0-1", true).unwrap();
            let mut b = Handshake::new(&key, prologue, false).unwrap();
            assert!(matches!(drive(&mut a, &mut b), Err(SecureError::NotProven)));
        }
        assert!(matches!(
            Handshake::message_len(257u16.to_be_bytes()),
            Err(SecureError::Malformed(_))
        ));
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
