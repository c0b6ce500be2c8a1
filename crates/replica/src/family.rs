//! The replica's extension point: the dataflow family it builds.
//!
//! The compute protocol carries dataflows it does not understand: an
//! export's description is its family's bytes. A replica process is built
//! with one [`Family`], which turns a [`DataflowDescription`] into what a
//! worker renders ([`Family::prepare`]) and renders it on that worker
//! ([`Prepared::render`]). Everything else (sessions, strategies, inputs,
//! peeks, subscribes, reconciliation, the creation log) is the replica's and
//! the same for every family.
//!
//! The contract a family keeps, because timely needs every worker to build
//! the same dataflows in the same order:
//!
//! - [`Family::prepare`] sees only dataflows of its [`Family::format`] (the
//!   replica refuses the others, [`prepare`]) and is a pure function of the
//!   description: every worker of every process decides the same (accept or
//!   refuse, with the same message), on every build of the family. No clock,
//!   no randomness, no worker index, no I/O.
//! - [`Prepared::render`] builds the same timely operators in the same order
//!   on every worker, reads only the inputs it is given, and returns one
//!   collection per export, in the description's export order.
//! - It never panics on a description it accepted; a description it cannot
//!   build is refused by `prepare`, before anything is built, so no worker is
//!   left with half a dataflow.
//!
//! Rows are bytes in the family's encoding ([`lockstep_protocol::Row`]):
//! the replica stores, routes and arranges them without reading them; a
//! family decodes the rows of the inputs it reads and encodes the rows of
//! its exports. A row the family cannot decode is dropped from what it
//! renders (the same row on every worker, so alike everywhere); the
//! environment refuses such rows before they are written. The built-in
//! family is [`PlanFamily`] (`lockstep-plan`).

use std::collections::BTreeMap;
use std::fmt;

use differential_dataflow::VecCollection;
use lockstep_plan::{rows, Plan};
use lockstep_protocol::validate::InvalidDataflow;
use lockstep_protocol::{DataflowDescription, Row};

use crate::render::{render, PlanColl};

/// A collection of encoded rows at u64 times with i64 multiplicities: what a
/// family's rendering reads (inputs) and returns (exports).
pub type Coll<'s> = VecCollection<'s, u64, Row, i64>;

/// A dataflow family: what a replica builds for a CreateDataflow. See the
/// module documentation for the contract.
pub trait Family: fmt::Debug + Send + Sync + 'static {
    /// The format name of the dataflows it builds: the replica refuses a
    /// dataflow whose `format` is another, naming both.
    fn format(&self) -> &str;

    /// Checks `desc` and returns what a worker renders for it, or why it
    /// cannot be built (the envelope's rules,
    /// [`lockstep_protocol::validate::validate_dataflow`], included).
    /// Deterministic: every worker decides the same.
    fn prepare(&self, desc: &DataflowDescription) -> Result<Box<dyn Prepared>, InvalidDataflow>;
}

/// A checked dataflow, ready to render on a worker.
pub trait Prepared {
    /// Renders every export over `inputs` (one collection per declared
    /// input), returning `(collection ID, collection)` in export order.
    fn render<'s>(&self, inputs: &BTreeMap<u64, Coll<'s>>) -> Vec<(u64, Coll<'s>)>;
}

/// `family.prepare(desc)` for a dataflow of the family's format; a dataflow
/// of another format is refused without being read
/// ([`lockstep_protocol::validate::check_format`]).
pub fn prepare(
    family: &dyn Family,
    desc: &DataflowDescription,
) -> Result<Box<dyn Prepared>, InvalidDataflow> {
    lockstep_protocol::validate::check_format(desc, family.format())?;
    family.prepare(desc)
}

/// The built-in family: the plan language of `lockstep-plan`, format
/// [`lockstep_plan::FORMAT`], rendered by [`crate::render`].
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanFamily;

struct Plans(Vec<(u64, Plan)>);

impl Family for PlanFamily {
    fn format(&self) -> &str {
        lockstep_plan::FORMAT
    }

    fn prepare(&self, desc: &DataflowDescription) -> Result<Box<dyn Prepared>, InvalidDataflow> {
        Ok(Box::new(Plans(lockstep_plan::plans(desc)?)))
    }
}

impl Prepared for Plans {
    fn render<'s>(&self, inputs: &BTreeMap<u64, Coll<'s>>) -> Vec<(u64, Coll<'s>)> {
        // An export that is an input as it is keeps the input's bytes (a
        // row that is not a plan row is dropped, as decoding would): no
        // decode and encode per row.
        let passthrough = |plan: &Plan| match plan {
            Plan::Get { collection_id } => Some(*collection_id),
            _ => None,
        };
        // Each input the other plans read is decoded once for the dataflow;
        // a row that is not a plan row is dropped.
        let mut decoded: BTreeMap<u64, PlanColl<'s>> = BTreeMap::new();
        for (_, plan) in self.0.iter().filter(|(_, p)| passthrough(p).is_none()) {
            for id in plan.inputs() {
                if let (Some(coll), false) = (inputs.get(&id), decoded.contains_key(&id)) {
                    let values = coll.clone().flat_map(|row: Row| rows::decode(&row).ok());
                    decoded.insert(id, values);
                }
            }
        }
        self.0
            .iter()
            .map(|(collection, plan)| {
                let exported = match passthrough(plan) {
                    Some(id) => inputs[&id]
                        .clone()
                        .filter(|row: &Row| rows::check(row).is_ok()),
                    None => render(plan, &decoded).map(|values| rows::encode(&values)),
                };
                (*collection, exported)
            })
            .collect()
    }
}
