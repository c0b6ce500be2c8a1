//! Crash the real `lockstep` binary at every failpoint of create and drop
//! replica, restart it, and check that no orphan survives and no wanted
//! replica is lost (O1, O2), for every orphan rule. Needs the `failpoints`
//! feature (`cargo test -p lockstep-cli --features failpoints`).

use std::path::Path;

use lockstep_chaos::environment::{
    crash_scenario, Outcome, CREATE_FAILPOINTS, DROP_FAILPOINTS, VARIANTS,
};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_lockstep"))
}

async fn all_failpoints(rule: &str) {
    for fp in CREATE_FAILPOINTS.iter().chain(&DROP_FAILPOINTS) {
        let outcome = crash_scenario(bin(), rule, fp).await;
        assert_eq!(outcome, Outcome::Pass, "rule {rule}, crash at {fp}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_and_restart_with_the_epoch_rule() {
    all_failpoints("epoch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_and_restart_with_the_id_watermark_rule() {
    all_failpoints("id-watermark").await;
}

/// A single controller that crashes and restarts leaves no interleaving that
/// could fool even the negative control; it must clean up too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_and_restart_with_the_catalog_only_rule() {
    assert!(VARIANTS
        .iter()
        .any(|(v, must)| *v == "catalog-only" && !must));
    all_failpoints("catalog-only").await;
}
