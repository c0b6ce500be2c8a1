//! Criterion benchmarks of lockstep. The benchmarks live in `benches/`; this
//! library holds the fixtures they share.

use lockstep_protocol::{DataflowDescription, Export, Plan};

/// A small dataflow description: a filter over one input, exported.
pub fn small_dataflow(id: u64) -> DataflowDescription {
    DataflowDescription {
        id,
        as_of: 0,
        inputs: vec![1],
        exports: vec![Export {
            collection_id: 1000 + id,
            plan: Plan::Get { collection_id: 1 },
        }],
        debug_name: format!("bench-{id}"),
    }
}
