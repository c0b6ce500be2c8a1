//! The built-in dataflow family of lockstep, format [`FORMAT`]: a small plan
//! language over rows of i64 (get, map, filter, join, reduce, arrange) that
//! every worker renders into the same differential-dataflow operators.
//!
//! The compute protocol carries dataflows it does not understand: an
//! export's description is the family's own bytes. This crate is what makes
//! those bytes a plan, and the one place that knows the plan language:
//!
//! - [`ir`]: the plan IR and its bounds ([`MAX_PLAN_DEPTH`]);
//! - [`wire`] and [`proto`]: its messages (`proto/lockstep/plan/v1`), and
//!   [`encode`] / [`decode`] of one export's description;
//! - [`export`] and [`plans`]: an export of a plan, and the checked plans of
//!   a dataflow (the protocol's envelope checks, then each description
//!   decoded, at most [`MAX_PLAN_DEPTH`] deep and reading declared inputs
//!   only); [`check`] adds the replica's frame limit, for the environment;
//! - [`rows`]: its rows (64-bit integers) and their encoding as the
//!   protocol's row bytes ([`row`] encodes one);
//! - [`text`]: the text syntax the CLI and the docs use;
//! - [`mod@reference`]: a plain-Rust evaluator the tests and fault suites compare
//!   answers with (invariant I3).
//!
//! The replica renders these plans (`lockstep-replica`'s `render`).

pub mod ir;
pub mod reference;
pub mod rows;
pub mod text;
pub mod wire;

pub use ir::*;
pub use rows::encode as row;

use lockstep_protocol::validate::{
    check_dataflow, check_format, validate_dataflow, InvalidDataflow, Refused,
};
use lockstep_protocol::{DataflowDescription, Export};
use prost::Message as _;

/// The generated wire types of `proto/lockstep/plan/v1`. Use [`ir`] inside
/// the code; these only at the edges.
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/lockstep.plan.v1.rs"));
}

/// The name of this family's format.
pub const FORMAT: &str = "lockstep.plan.v1";

/// Why an export's description is not a plan this family builds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The bytes are not an encoded plan.
    #[error("export {export}'s description is not a plan: {message}")]
    Undecodable {
        /// The export.
        export: u64,
        /// What the decoder said.
        message: String,
    },
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
    /// A plan nests deeper than this family allows.
    #[error("export {collection} nests {depth} levels deep (operators and expressions); at most {max} are allowed")]
    TooDeep {
        /// The export.
        collection: u64,
        /// Its depth.
        depth: usize,
        /// [`MAX_PLAN_DEPTH`].
        max: usize,
    },
}

impl PlanError {
    /// The export the error is about.
    pub fn export(&self) -> u64 {
        match self {
            PlanError::Undecodable { export, .. } | PlanError::UnknownCollection { export, .. } => {
                *export
            }
            PlanError::TooDeep { collection, .. } => *collection,
        }
    }
}

impl From<PlanError> for InvalidDataflow {
    fn from(e: PlanError) -> Self {
        InvalidDataflow::Description {
            export: e.export(),
            reason: e.to_string(),
        }
    }
}

/// The encoding of `plan` as an export's description.
pub fn encode(plan: &Plan) -> Vec<u8> {
    proto::Plan::from(plan.clone()).encode_to_vec()
}

/// The plan an export's description encodes, for export `export` (named in
/// the error). Refuses bytes that do not decode, or decode to a plan missing
/// a field or holding an unknown enum value.
pub fn decode(export: u64, bytes: &[u8]) -> Result<Plan, PlanError> {
    let undecodable = |message: String| PlanError::Undecodable { export, message };
    let wire = proto::Plan::decode(bytes).map_err(|e| undecodable(e.to_string()))?;
    Plan::try_from(wire).map_err(|e| undecodable(e.to_string()))
}

/// An export of collection `collection_id` computed by `plan`.
pub fn export(collection_id: u64, plan: &Plan) -> Export {
    Export {
        collection_id,
        description: encode(plan),
    }
}

/// An export's plan in the text syntax ([`text`]), for people; a description
/// that is not a plan of this family is shown as its length.
pub fn display(export: &Export) -> String {
    match decode(export.collection_id, &export.description) {
        Ok(plan) => plan.to_string(),
        Err(_) => format!("({} bytes, not a {FORMAT} plan)", export.description.len()),
    }
}

/// A dataflow of this family: `exports` are `(collection ID, plan)`.
pub fn dataflow(
    id: u64,
    as_of: u64,
    inputs: Vec<u64>,
    exports: &[(u64, Plan)],
    debug_name: impl Into<String>,
) -> DataflowDescription {
    DataflowDescription {
        id,
        as_of,
        inputs,
        exports: exports.iter().map(|(c, p)| export(*c, p)).collect(),
        debug_name: debug_name.into(),
        format: FORMAT.into(),
    }
}

/// The plans of `desc`, `(collection ID, plan)` in export order, checked:
/// its format is [`FORMAT`], the protocol's envelope rules
/// ([`validate_dataflow`]), then every
/// description decodes, nests at most [`MAX_PLAN_DEPTH`] deep and reads
/// declared inputs only. A replica's workers build only what passes.
pub fn plans(desc: &DataflowDescription) -> Result<Vec<(u64, Plan)>, InvalidDataflow> {
    check_format(desc, FORMAT)?;
    validate_dataflow(desc)?;
    desc.exports
        .iter()
        .map(|e| {
            let plan = decode(e.collection_id, &e.description)?;
            check_plan(e.collection_id, &plan, &desc.inputs)?;
            Ok((e.collection_id, plan))
        })
        .collect()
}

fn check_plan(export: u64, plan: &Plan, inputs: &[u64]) -> Result<(), PlanError> {
    let depth = plan.depth();
    if depth > MAX_PLAN_DEPTH {
        return Err(PlanError::TooDeep {
            collection: export,
            depth,
            max: MAX_PLAN_DEPTH,
        });
    }
    if let Some(c) = plan.inputs().into_iter().find(|c| !inputs.contains(c)) {
        return Err(PlanError::UnknownCollection {
            export,
            collection: c,
            inputs: inputs.to_vec(),
        });
    }
    Ok(())
}

/// Whether a replica whose frame limit is `max_frame_len` builds `desc`:
/// [`plans`], and the protocol's [`check_dataflow`] (one frame, decodes back
/// to the same description). What the environment checks before it records
/// a dataflow, so that it refuses exactly what a replica would.
pub fn check(desc: &DataflowDescription, max_frame_len: usize) -> Result<(), Refused> {
    plans(desc)?;
    check_dataflow(desc, max_frame_len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::parse_plan;

    fn desc(plan: Plan) -> DataflowDescription {
        dataflow(7, 0, vec![1], &[(101, plan)], "t")
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
        let max = lockstep_protocol::DEFAULT_MAX_FRAME_LEN;
        check(&desc(nested(MAX_PLAN_DEPTH)), max).unwrap();
        let err = check(&desc(nested(MAX_PLAN_DEPTH + 1)), max).unwrap_err();
        assert_eq!(
            err.to_string(),
            PlanError::TooDeep {
                collection: 101,
                depth: MAX_PLAN_DEPTH + 1,
                max: MAX_PLAN_DEPTH
            }
            .to_string()
        );
        // Past the depth check, the decoder's own limit would refuse it: a
        // check of the decoding alone must not be what keeps plans out.
        let too_deep_to_decode = encode(&nested(60));
        assert!(matches!(
            decode(101, &too_deep_to_decode),
            Err(PlanError::Undecodable { export: 101, .. })
        ));
    }

    #[test]
    fn inputs_and_descriptions_are_checked() {
        let mut d = desc(parse_plan("get(2)").unwrap());
        assert_eq!(
            plans(&d),
            Err(PlanError::UnknownCollection {
                export: 101,
                collection: 2,
                inputs: vec![1]
            }
            .into())
        );
        d.exports[0].description = vec![0xff, 0xff];
        assert!(matches!(
            plans(&d),
            Err(InvalidDataflow::Description { export: 101, .. })
        ));
        // An empty description is a plan without its node.
        d.exports[0].description.clear();
        let err = plans(&d).unwrap_err().to_string();
        assert!(err.contains("missing field `node`"), "{err}");
        d.exports[0] = export(101, &parse_plan("get(1)").unwrap());
        assert_eq!(
            plans(&d).unwrap(),
            vec![(101, Plan::Get { collection_id: 1 })]
        );
        // Another family's dataflow is refused by its format, before its
        // descriptions are read.
        d.format = "lockstep.example.reachability.v1".into();
        assert!(matches!(plans(&d), Err(InvalidDataflow::Format { .. })));
    }
}
