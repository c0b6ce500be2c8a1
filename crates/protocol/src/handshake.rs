//! The checks a replica process makes on `Hello`, the first frame of every
//! connection.
//!
//! A process started with a session key ([`SessionKey`]) first refuses a
//! Hello that does not prove the key (S1: only the environment drives a
//! replica): nothing an unauthenticated peer sends changes the process's
//! state. Then it refuses a Hello whose protocol versions do not overlap its
//! own (naming both ranges), from a controller whose epoch is older than the
//! newest it has seen (a stale controller must not drive the replica after a
//! newer one did), and for a replica shape that is not its own.
//!
//! **Version negotiation** (docs/compatibility.md). A Hello offers a range:
//! `protocol_version` is the lowest version the controller speaks and
//! `max_protocol_version` the highest (0: `protocol_version` only). The
//! lowest goes in `protocol_version` because a version-2 process (release
//! v0.2.0) accepts a Hello only when that field is exactly 2 and ignores the
//! field it does not know; so a controller of this build (2 ..= 3) drives
//! it at version 2, and a version-2 controller (2, no maximum) is accepted
//! here at version 2. The agreed version is [`negotiate`]'s: the highest
//! both speak.
//!
//! **Downgrade.** The Hello's `proof` covers the seven fields a version-2
//! process knows, not `max_protocol_version`: a version-2 process checks the
//! proof over exactly those, so covering the new field would lock every new
//! controller out of every old replica. The field is protected instead by
//! the session ([`crate::secure`]): with a session key, every frame, the
//! Hello included, is encrypted and authenticated under keys only the two
//! proven ends hold, so a peer in the middle cannot strip or lower it (an
//! altered record fails to decrypt and ends the connection). Without a key
//! (a replica started by hand) nothing is authenticated, versions included.
//! The no-mutual negative control of the security suite sends plain frames
//! with a proof: there a peer in the middle could strip the field, and the
//! worst it gets is version 2, which every build of this range speaks fully
//! (the process's build version is then not shown).

use crate::types::{Command, CommandKind, ErrorKind, ErrorResponse, Hello};
use crate::{MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};

/// The protocol versions this build speaks, `(lowest, highest)`.
pub const SUPPORTED_VERSIONS: (u32, u32) = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION);

/// The agreed version of two ranges `(lowest, highest)`: the highest version
/// both speak, or `None` when the ranges do not overlap.
pub fn negotiate(ours: (u32, u32), theirs: (u32, u32)) -> Option<u32> {
    let low = ours.0.max(theirs.0);
    let high = ours.1.min(theirs.1);
    (low <= high).then_some(high)
}

/// A Hello a process accepted, with the version agreed in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcceptedHello {
    /// The Hello.
    pub hello: Hello,
    /// The agreed protocol version ([`negotiate`] of this build's
    /// [`SUPPORTED_VERSIONS`] and the Hello's range).
    pub protocol_version: u32,
}

/// `version N` for a range of one, `version N to version M` otherwise.
fn range_text(range: (u32, u32)) -> String {
    if range.0 == range.1 {
        format!("version {}", range.0)
    } else {
        format!("version {} to version {}", range.0, range.1)
    }
}

/// Who a replica process is, as fixed by its command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessIdentity {
    /// The replica's catalog ID.
    pub replica_id: u64,
    /// This process's index.
    pub process_index: u32,
    /// How many processes the replica has.
    pub process_count: u32,
    /// Timely workers per process.
    pub workers_per_process: u32,
}

impl ProcessIdentity {
    /// The Hello a controller sends to this process.
    /// It offers every version this build speaks ([`SUPPORTED_VERSIONS`]):
    /// the lowest as `protocol_version`, the highest as
    /// `max_protocol_version`.
    pub fn hello(&self, epoch: u64, nonce: u64) -> Hello {
        Hello {
            protocol_version: MIN_PROTOCOL_VERSION,
            max_protocol_version: PROTOCOL_VERSION,
            epoch,
            nonce,
            replica_id: self.replica_id,
            process_index: self.process_index,
            process_count: self.process_count,
            workers_per_process: self.workers_per_process,
            proof: Vec::new(),
        }
    }
}

/// A replica's session key: 32 secret bytes that the environment gives the
/// replica's processes (in the environment variable [`SESSION_KEY_ENV`],
/// never on a command line) and its controller. A Hello proves it with the
/// keyed BLAKE3 hash of its other fields ([`SessionKey::sign`]).
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; 32]);

/// The environment variable that carries a replica process's session key, as
/// 64 hex digits.
pub const SESSION_KEY_ENV: &str = "LOCKSTEP_SESSION_KEY";

/// The environment variable carrying a replica's free-form configuration
/// (`CreateReplica`'s `config`) to its processes, set only when it is not
/// empty; a family's binary reads it (`lockstep_replica::Builder::family_from_config`).
pub const REPLICA_CONFIG_ENV: &str = "LOCKSTEP_REPLICA_CONFIG";

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// A key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        SessionKey(bytes)
    }

    /// The key of replica `replica_id`, derived from the environment's
    /// master secret (so a restarted environment gives the same key, and the
    /// replica's processes are adopted unchanged).
    pub fn derive(master: &[u8; 32], replica_id: u64) -> Self {
        let mut h = blake3::Hasher::new_keyed(master);
        h.update(b"lockstep replica session key v1");
        h.update(&replica_id.to_le_bytes());
        SessionKey(*h.finalize().as_bytes())
    }

    /// Parses 64 hex digits.
    pub fn from_hex(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if !text.is_ascii() {
            return Err(
                "a session key is 64 hex digits, and this one has other characters".to_string(),
            );
        }
        if text.len() != 64 {
            return Err(format!(
                "a session key is 64 hex digits, not {} characters",
                text.len()
            ));
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                .map_err(|_| "a session key is 64 hex digits".to_string())?;
        }
        Ok(SessionKey(out))
    }

    /// The key's 32 bytes (the pre-shared key of a session's handshake,
    /// [`crate::secure`]).
    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The bearer token of the replica's `/metrics` endpoints (64 hex
    /// digits): derived from the key one way, so a scraper that holds it
    /// can read the metrics and nothing else (it proves no session).
    pub fn metrics_token(&self) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"lockstep replica metrics token v1");
        h.finalize().to_hex().to_string()
    }

    /// The key as 64 hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self, hello: &Hello) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&hello.protocol_version.to_le_bytes());
        h.update(&hello.epoch.to_le_bytes());
        h.update(&hello.nonce.to_le_bytes());
        h.update(&hello.replica_id.to_le_bytes());
        h.update(&hello.process_index.to_le_bytes());
        h.update(&hello.process_count.to_le_bytes());
        h.update(&hello.workers_per_process.to_le_bytes());
        h.finalize()
    }

    /// A proof for the timely mesh handshake of replica `replica_id`: process
    /// `from` answers process `to`, over both sides' nonces (the verifier's
    /// first). `role` tells the two directions apart, so that a proof cannot
    /// be reflected back to its sender.
    pub fn mesh_proof(
        &self,
        role: &[u8],
        replica_id: u64,
        from: u64,
        to: u64,
        nonces: (&[u8; 16], &[u8; 16]),
    ) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"lockstep mesh v1 ");
        h.update(role);
        h.update(&replica_id.to_le_bytes());
        h.update(&from.to_le_bytes());
        h.update(&to.to_le_bytes());
        h.update(nonces.0);
        h.update(nonces.1);
        *h.finalize().as_bytes()
    }

    /// Whether `proof` is [`mesh_proof`](Self::mesh_proof) of these fields
    /// (compared in constant time).
    pub fn verify_mesh_proof(
        &self,
        proof: &[u8; 32],
        role: &[u8],
        replica_id: u64,
        from: u64,
        to: u64,
        nonces: (&[u8; 16], &[u8; 16]),
    ) -> bool {
        blake3::Hash::from(*proof)
            == blake3::Hash::from(self.mesh_proof(role, replica_id, from, to, nonces))
    }

    /// `hello` with its proof of this key set.
    pub fn sign(&self, mut hello: Hello) -> Hello {
        hello.proof = self.mac(&hello).as_bytes().to_vec();
        hello
    }

    /// Whether `hello` proves this key (compared in constant time).
    pub fn verify(&self, hello: &Hello) -> bool {
        match <[u8; 32]>::try_from(hello.proof.as_slice()) {
            Ok(proof) => self.mac(hello) == blake3::Hash::from(proof),
            Err(_) => false,
        }
    }
}

/// Why a Hello was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The Hello does not prove the replica's session key.
    #[error("the Hello does not prove this replica's session key; refused before any other check")]
    Unauthenticated,
    /// The first frame was not a Hello.
    #[error("expected Hello as the first command, got {got}")]
    NotHello {
        /// The command's name.
        got: &'static str,
    },
    /// The Hello's protocol versions and this process's do not overlap.
    #[error("protocol version mismatch: this process speaks {}, the controller {}", range_text(*ours), range_text(*theirs))]
    VersionMismatch {
        /// This process's versions, `(lowest, highest)`.
        ours: (u32, u32),
        /// The controller's versions, `(lowest, highest)`.
        theirs: (u32, u32),
    },
    /// A stale controller.
    #[error("stale epoch: controller epoch {offered} is older than epoch {newest} already seen")]
    StaleEpoch {
        /// The Hello's epoch.
        offered: u64,
        /// The newest epoch this process has seen.
        newest: u64,
    },
    /// The Hello describes another replica shape.
    #[error("configuration mismatch: {field} is {got} in Hello but {expected} for this process")]
    ConfigMismatch {
        /// The field that differs.
        field: &'static str,
        /// This process's value.
        expected: u64,
        /// The Hello's value.
        got: u64,
    },
}

impl HandshakeError {
    /// The error response a process sends before closing the connection.
    pub fn to_response(&self) -> ErrorResponse {
        let kind = match self {
            HandshakeError::Unauthenticated => ErrorKind::Unauthenticated,
            HandshakeError::NotHello { .. } => ErrorKind::Sequence,
            HandshakeError::VersionMismatch { .. } => ErrorKind::VersionMismatch,
            HandshakeError::StaleEpoch { .. } => ErrorKind::StaleEpoch,
            HandshakeError::ConfigMismatch { .. } => ErrorKind::ConfigMismatch,
        };
        ErrorResponse {
            kind,
            message: self.to_string(),
            seqno: 0,
        }
    }
}

/// Checks the first command of a connection. `newest_epoch` is the newest
/// controller epoch this process has accepted so far (0 if none); `key` is
/// the replica's session key, if it has one: then a Hello must prove it,
/// which is checked first. An accepted Hello comes back with the agreed
/// protocol version.
pub fn check_hello(
    first: &Command,
    me: &ProcessIdentity,
    newest_epoch: u64,
    key: Option<&SessionKey>,
) -> Result<AcceptedHello, HandshakeError> {
    let CommandKind::Hello(hello) = &first.kind else {
        return Err(HandshakeError::NotHello {
            got: first.kind.name(),
        });
    };
    if let Some(key) = key {
        if !key.verify(hello) {
            return Err(HandshakeError::Unauthenticated);
        }
    }
    let Some(protocol_version) = negotiate(SUPPORTED_VERSIONS, hello.version_range()) else {
        return Err(HandshakeError::VersionMismatch {
            ours: SUPPORTED_VERSIONS,
            theirs: hello.version_range(),
        });
    };
    if hello.epoch < newest_epoch {
        return Err(HandshakeError::StaleEpoch {
            offered: hello.epoch,
            newest: newest_epoch,
        });
    }
    let checks: [(&'static str, u64, u64); 4] = [
        ("replica_id", me.replica_id, hello.replica_id),
        (
            "process_index",
            me.process_index.into(),
            hello.process_index.into(),
        ),
        (
            "process_count",
            me.process_count.into(),
            hello.process_count.into(),
        ),
        (
            "workers_per_process",
            me.workers_per_process.into(),
            hello.workers_per_process.into(),
        ),
    ];
    for (field, expected, got) in checks {
        if expected != got {
            return Err(HandshakeError::ConfigMismatch {
                field,
                expected,
                got,
            });
        }
    }
    Ok(AcceptedHello {
        hello: hello.clone(),
        protocol_version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Strategy;

    #[test]
    fn a_key_of_64_bytes_that_are_not_ascii_is_an_error_not_a_panic() {
        // 32 two-byte characters: 64 bytes, no character boundary at 1.
        let text = "é".repeat(32);
        assert_eq!(text.len(), 64);
        assert!(SessionKey::from_hex(&text).is_err());
        let key = SessionKey::from_bytes([7; 32]);
        assert_eq!(SessionKey::from_hex(&key.to_hex()).unwrap(), key);
    }

    fn me() -> ProcessIdentity {
        ProcessIdentity {
            replica_id: 7,
            process_index: 1,
            process_count: 2,
            workers_per_process: 2,
        }
    }

    fn cmd(hello: Hello) -> Command {
        Command {
            seqno: 0,
            strategy: Strategy::Barrier,
            kind: CommandKind::Hello(hello),
        }
    }

    fn accepted(hello: Hello, protocol_version: u32) -> Result<AcceptedHello, HandshakeError> {
        Ok(AcceptedHello {
            hello,
            protocol_version,
        })
    }

    #[test]
    fn accepts_matching_hello() {
        let h = me().hello(5, 99);
        assert_eq!(h.version_range(), (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION));
        assert_eq!(
            check_hello(&cmd(h.clone()), &me(), 5, None),
            accepted(h, PROTOCOL_VERSION)
        );
    }

    #[test]
    fn negotiation_takes_the_highest_common_version() {
        assert_eq!(negotiate((2, 3), (2, 3)), Some(3));
        assert_eq!(negotiate((2, 3), (2, 2)), Some(2));
        assert_eq!(negotiate((2, 2), (2, 3)), Some(2));
        assert_eq!(negotiate((3, 4), (2, 3)), Some(3));
        assert_eq!(negotiate((2, 3), (4, 5)), None);
        assert_eq!(negotiate((3, 3), (2, 2)), None);
    }

    #[test]
    fn a_version_2_hello_is_accepted_at_version_2() {
        // What a v0.2.0 controller sends: exactly 2, no maximum.
        let mut h = me().hello(5, 99);
        h.protocol_version = 2;
        h.max_protocol_version = 0;
        assert_eq!(h.version_range(), (2, 2));
        assert_eq!(check_hello(&cmd(h.clone()), &me(), 5, None), accepted(h, 2));
        // A maximum below the minimum means the minimum only.
        let mut h = me().hello(5, 99);
        h.protocol_version = 3;
        h.max_protocol_version = 1;
        assert_eq!(check_hello(&cmd(h.clone()), &me(), 5, None), accepted(h, 3));
    }

    #[test]
    fn version_mismatch_names_both_ranges() {
        let mut h = me().hello(5, 99);
        h.protocol_version = PROTOCOL_VERSION + 1;
        h.max_protocol_version = PROTOCOL_VERSION + 2;
        let err = check_hello(&cmd(h), &me(), 0, None).unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            format!(
                "protocol version mismatch: this process speaks version {MIN_PROTOCOL_VERSION} to version {PROTOCOL_VERSION}, the controller version {} to version {}",
                PROTOCOL_VERSION + 1,
                PROTOCOL_VERSION + 2
            )
        );
        assert_eq!(err.to_response().kind, ErrorKind::VersionMismatch);
        // Below the range: a version-1 controller.
        let mut h = me().hello(5, 99);
        h.protocol_version = 1;
        h.max_protocol_version = 0;
        let err = check_hello(&cmd(h), &me(), 0, None).unwrap_err();
        assert_eq!(
            err,
            HandshakeError::VersionMismatch {
                ours: SUPPORTED_VERSIONS,
                theirs: (1, 1)
            }
        );
        assert!(
            err.to_string().ends_with("the controller version 1"),
            "{err}"
        );
    }

    #[test]
    fn stale_epoch_is_refused() {
        let err = check_hello(&cmd(me().hello(3, 1)), &me(), 4, None).unwrap_err();
        assert_eq!(
            err,
            HandshakeError::StaleEpoch {
                offered: 3,
                newest: 4
            }
        );
    }

    #[test]
    fn wrong_shape_is_refused() {
        let mut h = me().hello(1, 1);
        h.process_count = 3;
        let err = check_hello(&cmd(h), &me(), 0, None).unwrap_err();
        assert!(matches!(
            err,
            HandshakeError::ConfigMismatch {
                field: "process_count",
                ..
            }
        ));
    }

    #[test]
    fn first_command_must_be_hello() {
        let c = Command {
            seqno: 0,
            strategy: Strategy::Naive,
            kind: CommandKind::InitializationComplete,
        };
        assert!(matches!(
            check_hello(&c, &me(), 0, None),
            Err(HandshakeError::NotHello { .. })
        ));
    }

    #[test]
    fn a_session_key_is_proved_before_anything_else() {
        let key = SessionKey::derive(&[9; 32], 7);
        assert_eq!(SessionKey::from_hex(&key.to_hex()), Ok(key.clone()));
        assert_ne!(key, SessionKey::derive(&[9; 32], 8));
        let signed = key.sign(me().hello(3, 1));
        assert_eq!(
            check_hello(&cmd(signed.clone()), &me(), 0, Some(&key)),
            accepted(signed.clone(), PROTOCOL_VERSION)
        );
        // No proof, a proof of another key, a tampered field, a forged
        // epoch: all refused, before the epoch or shape is even looked at.
        // `max_protocol_version` is not covered by the proof (a version-2
        // process checks the proof over the seven fields it knows); the
        // session's encryption protects it (see the module docs).
        let mut lowered = signed.clone();
        lowered.max_protocol_version = 0;
        assert!(key.verify(&lowered));
        let other = SessionKey::derive(&[9; 32], 8);
        let mut tampered = signed.clone();
        tampered.epoch = u64::MAX;
        let mut short = signed.clone();
        short.proof.truncate(31);
        for h in [
            me().hello(u64::MAX, 1),
            other.sign(me().hello(3, 1)),
            tampered,
            short,
        ] {
            let err = check_hello(&cmd(h), &me(), 5, Some(&key)).unwrap_err();
            assert_eq!(err, HandshakeError::Unauthenticated);
            assert_eq!(err.to_response().kind, ErrorKind::Unauthenticated);
        }
        assert!(SessionKey::from_hex("zz").is_err());
        assert_eq!(format!("{key:?}"), "SessionKey(..)");
    }
}
