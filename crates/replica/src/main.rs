//! `lockstep-replica`: one process of a lockstep replica, building the
//! built-in dataflow family (`lockstep-plan`). A replica of another family
//! is the same [`lockstep_replica::Builder`] with its own family.

fn main() {
    lockstep_replica::Builder::new().main()
}
