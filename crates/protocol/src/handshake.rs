//! The checks a replica process makes on `Hello`, the first frame of every
//! connection.
//!
//! A process refuses a Hello from another protocol version (naming both), from
//! a controller whose epoch is older than the newest it has seen (a stale
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
        }
    }
}

/// Why a Hello was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
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
/// controller epoch this process has accepted so far (0 if none).
pub fn check_hello(
    first: &Command,
    me: &ProcessIdentity,
    newest_epoch: u64,
) -> Result<Hello, HandshakeError> {
    let CommandKind::Hello(hello) = &first.kind else {
        return Err(HandshakeError::NotHello {
            got: first.kind.name(),
        });
    };
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
        assert_eq!(check_hello(&cmd(h.clone()), &me(), 5), Ok(h));
    }

    #[test]
    fn version_mismatch_names_both_versions() {
        let mut h = me().hello(5, 99);
        h.protocol_version = PROTOCOL_VERSION + 1;
        let err = check_hello(&cmd(h), &me(), 0).unwrap_err();
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
        let err = check_hello(&cmd(me().hello(3, 1)), &me(), 4).unwrap_err();
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
        let err = check_hello(&cmd(h), &me(), 0).unwrap_err();
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
            check_hello(&c, &me(), 0),
            Err(HandshakeError::NotHello { .. })
        ));
    }
}
