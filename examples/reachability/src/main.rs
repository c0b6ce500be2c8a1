//! `lockstep-replica-reachability`: a replica process that builds the
//! reachability family instead of the built-in plan language. The whole
//! binary is the replica's builder with another family.

fn main() {
    lockstep_replica::Builder::new()
        .family(lockstep_example_reachability::Reachability)
        .version(env!("CARGO_PKG_VERSION"))
        .main()
}
