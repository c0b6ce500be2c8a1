//! The checks a replica makes on a dataflow's envelope before it builds it,
//! in one place: the replica's workers call [`validate_dataflow`] before
//! building, and the environment calls [`check_dataflow`] (the same checks,
//! plus the replica's decoder: frame limit and protobuf recursion limit)
//! before it records a dataflow. So the environment refuses exactly what a
//! replica would refuse, and a replica is never sent a dataflow it refuses.
//!
//! What is inside an export's description belongs to the dataflow's family,
//! which checks it too (for the built-in family, `lockstep_plan::plans`) and
//! reports what it refuses as [`InvalidDataflow::Description`].

use std::collections::BTreeSet;

use crate::codec::{CodecError, WireMessage};
use crate::types::{Command, CommandKind, DataflowDescription, Strategy};

/// Why a dataflow cannot be built. The messages do not name the dataflow
/// (it may have no ID yet); a replica prefixes its ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidDataflow {
    /// No exports.
    #[error("a dataflow must export at least one collection")]
    NoExports,
    /// Two exports share an ID, or an export reuses an input's ID.
    #[error(
        "collection ID {collection} is used twice (as two exports, or as an input and an export)"
    )]
    DuplicateCollection {
        /// The ID.
        collection: u64,
    },
    /// The dataflow is of a format (family) the process does not build.
    #[error("the dataflow is of format {format:?}; this process builds {builds:?}")]
    Format {
        /// The dataflow's format.
        format: String,
        /// The format the process builds.
        builds: String,
    },
    /// The dataflow's family refuses an export's description (it does not
    /// decode, reads an undeclared input, nests too deep, ...).
    #[error("{reason}")]
    Description {
        /// The export.
        export: u64,
        /// What the family says, naming the export.
        reason: String,
    },
}

/// Checks a description's envelope before building it: at least one export,
/// no collection ID used twice. The family checks the exports' descriptions.
pub fn validate_dataflow(desc: &DataflowDescription) -> Result<(), InvalidDataflow> {
    if desc.exports.is_empty() {
        return Err(InvalidDataflow::NoExports);
    }
    let mut seen: BTreeSet<u64> = desc.inputs.iter().copied().collect();
    for e in &desc.exports {
        if !seen.insert(e.collection_id) {
            return Err(InvalidDataflow::DuplicateCollection {
                collection: e.collection_id,
            });
        }
    }
    Ok(())
}

/// Checks that `desc` is of format `builds`, the one the process builds.
pub fn check_format(desc: &DataflowDescription, builds: &str) -> Result<(), InvalidDataflow> {
    if desc.format == builds {
        Ok(())
    } else {
        Err(InvalidDataflow::Format {
            format: desc.format.clone(),
            builds: builds.to_string(),
        })
    }
}

/// Why a replica would refuse a CreateDataflow.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The description breaks a rule of [`validate_dataflow`] or its family's.
    #[error(transparent)]
    Invalid(#[from] InvalidDataflow),
    /// Its command frame is larger than the replicas' frame limit.
    #[error(
        "the dataflow's command is {len} bytes, more than the replicas' frame limit of {max} bytes"
    )]
    TooLarge {
        /// The frame's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Its command frame does not decode with the replica's decoder.
    #[error("the dataflow's command would not decode on a replica: {0}")]
    Undecodable(CodecError),
}

/// Whether a replica whose frame limit is `max_frame_len` accepts `desc`:
/// the CreateDataflow command carrying it fits one frame, decodes with the
/// replica's decoder (protobuf's recursion limit included) back to the same
/// description, and passes [`validate_dataflow`]. Costs one encode and one
/// decode of the command.
pub fn check_dataflow(desc: &DataflowDescription, max_frame_len: usize) -> Result<(), Refused> {
    validate_dataflow(desc)?;
    // The largest sequence number encodes longest: the frame is never
    // longer than this one on any session.
    let cmd = Command {
        seqno: u64::MAX,
        strategy: Strategy::Barrier,
        kind: CommandKind::CreateDataflow(desc.clone()),
    };
    let bytes = cmd.encode_to_vec();
    if bytes.len() > max_frame_len {
        return Err(Refused::TooLarge {
            len: bytes.len(),
            max: max_frame_len,
        });
    }
    match Command::decode_from(&bytes) {
        Ok(Command {
            kind: CommandKind::CreateDataflow(decoded),
            ..
        }) if &decoded == desc => Ok(()),
        Ok(_) => Err(Refused::Undecodable(CodecError::Io(std::io::Error::other(
            "the command decodes to another description",
        )))),
        Err(e) => Err(Refused::Undecodable(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Export;

    fn desc() -> DataflowDescription {
        DataflowDescription {
            id: 7,
            as_of: 0,
            inputs: vec![1],
            exports: vec![Export {
                collection_id: 101,
                description: vec![0x0a, 0x02, 0x08, 0x01],
            }],
            debug_name: "t".into(),
            format: crate::DEFAULT_FORMAT.into(),
        }
    }

    #[test]
    fn a_command_over_the_frame_limit_is_refused() {
        let d = desc();
        let len = Command {
            seqno: u64::MAX,
            strategy: Strategy::Barrier,
            kind: CommandKind::CreateDataflow(d.clone()),
        }
        .encode_to_vec()
        .len();
        check_dataflow(&d, len).unwrap();
        match check_dataflow(&d, len - 1) {
            Err(Refused::TooLarge { len: l, max }) => assert_eq!((l, max), (len, len - 1)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn exports_and_ids_are_checked() {
        let mut d = desc();
        validate_dataflow(&d).unwrap();
        d.exports.push(d.exports[0].clone());
        assert_eq!(
            validate_dataflow(&d),
            Err(InvalidDataflow::DuplicateCollection { collection: 101 })
        );
        d.exports[1].collection_id = 1;
        assert_eq!(
            validate_dataflow(&d),
            Err(InvalidDataflow::DuplicateCollection { collection: 1 })
        );
        d.exports.clear();
        assert_eq!(validate_dataflow(&d), Err(InvalidDataflow::NoExports));
        check_format(&d, crate::DEFAULT_FORMAT).unwrap();
        let err = check_format(&d, "lockstep.example.other.v1").unwrap_err();
        assert_eq!(
            err.to_string(),
            "the dataflow is of format \"lockstep.plan.v1\"; this process builds \"lockstep.example.other.v1\""
        );
    }
}
