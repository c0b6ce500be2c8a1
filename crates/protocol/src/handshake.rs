//! The checks a replica process makes on `Hello`, the first frame of every
//! connection.
//!
//! A process started with a session key ([`SessionKey`]) first refuses a
//! Hello that does not prove the key (S1: only the environment drives a
//! replica): nothing an unauthenticated peer sends changes the process's
//! state. Then it refuses a Hello from another protocol version (naming both),
//! from a controller whose epoch is older than the newest it has seen (a stale
//! controller must not drive the replica after a newer one did), and for a
//! replica shape that is not its own.

use crate::types::{Command, CommandKind, ErrorKind, ErrorResponse, Hello};
use crate::PROTOCOL_VERSION;

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
    pub fn hello(&self, epoch: u64, nonce: u64) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
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
/// keyed BLAKE3 hash of its other fields ([`SessionKey::prove`]).
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; 32]);

/// The environment variable that carries a replica process's session key, as
/// 64 hex digits.
pub const SESSION_KEY_ENV: &str = "LOCKSTEP_SESSION_KEY";

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
    /// Different protocol versions.
    #[error("protocol version mismatch: this process speaks version {ours}, the controller version {theirs}")]
    VersionMismatch {
        /// This process's version.
        ours: u32,
        /// The controller's version.
        theirs: u32,
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
/// which is checked first.
pub fn check_hello(
    first: &Command,
    me: &ProcessIdentity,
    newest_epoch: u64,
    key: Option<&SessionKey>,
) -> Result<Hello, HandshakeError> {
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
    if hello.protocol_version != PROTOCOL_VERSION {
        return Err(HandshakeError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: hello.protocol_version,
        });
    }
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
    Ok(hello.clone())
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

    #[test]
    fn accepts_matching_hello() {
        let h = me().hello(5, 99);
        assert_eq!(check_hello(&cmd(h.clone()), &me(), 5, None), Ok(h));
    }

    #[test]
    fn version_mismatch_names_both_versions() {
        let mut h = me().hello(5, 99);
        h.protocol_version = PROTOCOL_VERSION + 1;
        let err = check_hello(&cmd(h), &me(), 0, None).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("version {PROTOCOL_VERSION}")),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("version {}", PROTOCOL_VERSION + 1)),
            "{msg}"
        );
        assert_eq!(err.to_response().kind, ErrorKind::VersionMismatch);
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
            Ok(signed.clone())
        );
        // No proof, a proof of another key, a tampered field, a forged
        // epoch: all refused, before the epoch or shape is even looked at.
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
