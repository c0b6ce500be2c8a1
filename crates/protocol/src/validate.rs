//! The checks a replica makes before it builds a dataflow, in one place:
//! the replica's workers call [`validate_dataflow`] before building, and the
//! environment calls [`check_dataflow`] (the same checks, plus the replica's
//! decoder: frame limit and protobuf recursion limit) before it records a
//! dataflow. So the environment refuses exactly what a replica would refuse,
//! and a replica is never sent a dataflow it refuses.

use std::collections::BTreeSet;

use crate::codec::{CodecError, WireMessage};
use crate::types::{Command, CommandKind, DataflowDescription, Strategy, MAX_PLAN_DEPTH};

/// Why a dataflow description cannot be built. The messages do not name the
/// dataflow (it may have no ID yet); a replica prefixes its ID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidDataflow {
    /// A Get names a collection the dataflow does not list as an input.
    #[error(
        "export {export} reads collection {collection}, which is not among the inputs {inputs:?}"
    )]
    UnknownCollection {
        /// The export whose plan reads it.
        export: u64,
        /// The collection read.
        collection: u64,
        /// The declared inputs.
        inputs: Vec<u64>,
    },
    /// No exports.
    #[error("a dataflow must export at least one collection")]
    NoExports,
    /// A plan nests deeper than the protocol allows.
    #[error("export {collection} nests {depth} levels deep (operators and expressions); at most {max} are allowed")]
    TooDeep {
        /// The export.
        collection: u64,
        /// Its depth.
        depth: usize,
        /// [`MAX_PLAN_DEPTH`].
        max: usize,
    },
    /// Two exports share an ID, or an export reuses an input's ID.
    #[error(
        "collection ID {collection} is used twice (as two exports, or as an input and an export)"
    )]
    DuplicateCollection {
        /// The ID.
        collection: u64,
    },
}

/// Checks a description before building it: at least one export, every
/// plan at most [`MAX_PLAN_DEPTH`] deep and reading declared inputs only,
/// no collection ID used twice.
pub fn validate_dataflow(desc: &DataflowDescription) -> Result<(), InvalidDataflow> {
    if desc.exports.is_empty() {
        return Err(InvalidDataflow::NoExports);
    }
    let inputs: BTreeSet<u64> = desc.inputs.iter().copied().collect();
    let mut seen = inputs.clone();
    for e in &desc.exports {
        let depth = e.plan.depth();
        if depth > MAX_PLAN_DEPTH {
            return Err(InvalidDataflow::TooDeep {
                collection: e.collection_id,
                depth,
                max: MAX_PLAN_DEPTH,
            });
        }
        if !seen.insert(e.collection_id) {
            return Err(InvalidDataflow::DuplicateCollection {
                collection: e.collection_id,
            });
        }
        if let Some(c) = e.plan.inputs().into_iter().find(|c| !inputs.contains(c)) {
            return Err(InvalidDataflow::UnknownCollection {
                export: e.collection_id,
                collection: c,
                inputs: desc.inputs.clone(),
            });
        }
    }
    Ok(())
}

/// Why a replica would refuse a CreateDataflow.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// The description breaks a rule of [`validate_dataflow`].
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
    use crate::text::parse_plan;
    use crate::types::{Export, Plan};

    fn desc(plan: Plan) -> DataflowDescription {
        DataflowDescription {
            id: 7,
            as_of: 0,
            inputs: vec![1],
            exports: vec![Export {
                collection_id: 101,
                plan,
            }],
            debug_name: "t".into(),
        }
    }

    /// `map(map(...get(1)...))`, `depth` levels in all.
    fn nested(depth: usize) -> Plan {
        let mut plan = parse_plan("get(1)").unwrap();
        for _ in 1..depth {
            plan = Plan::Map {
                input: Box::new(plan),
                exprs: vec![],
            };
        }
        assert_eq!(plan.depth(), depth);
        plan
    }

    #[test]
    fn the_depth_limit_is_checked_and_every_accepted_plan_decodes() {
        let max = crate::DEFAULT_MAX_FRAME_LEN;
        check_dataflow(&desc(nested(MAX_PLAN_DEPTH)), max).unwrap();
        match check_dataflow(&desc(nested(MAX_PLAN_DEPTH + 1)), max) {
            Err(Refused::Invalid(InvalidDataflow::TooDeep { depth, .. })) => {
                assert_eq!(depth, MAX_PLAN_DEPTH + 1)
            }
            other => panic!("{other:?}"),
        }
        // Past the depth check, the decoder's own limit would refuse it: a
        // check of the decoding alone must not be what keeps plans out.
        let too_deep_to_decode = desc(nested(60));
        let cmd = Command {
            seqno: 1,
            strategy: Strategy::Barrier,
            kind: CommandKind::CreateDataflow(too_deep_to_decode),
        };
        assert!(Command::decode_from(&cmd.encode_to_vec()).is_err());
    }

    #[test]
    fn a_command_over_the_frame_limit_is_refused() {
        let d = desc(nested(3));
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
    fn inputs_exports_and_ids_are_checked() {
        let mut d = desc(parse_plan("get(2)").unwrap());
        assert_eq!(
            validate_dataflow(&d),
            Err(InvalidDataflow::UnknownCollection {
                export: 101,
                collection: 2,
                inputs: vec![1]
            })
        );
        d.exports[0].plan = parse_plan("get(1)").unwrap();
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
    }
}
