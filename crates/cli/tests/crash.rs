//! Crash the real `lockstep` binary at every failpoint of create and drop
//! replica, restart it, and check that no orphan survives and no wanted
//! replica is lost (O1, O2), for every orphan rule. Needs the `failpoints`
//! feature (`cargo test -p lockstep-cli --features failpoints`).

use std::path::Path;

use lockstep_chaos::environment::{
    cli, crash_scenario, Outcome, Sandbox, CREATE_FAILPOINTS, DROP_FAILPOINTS, VARIANTS,
};
use lockstep_environment::ServiceTemplate;

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

/// An environment that crashes in the middle of an upgrade that keeps
/// answering, its standby generation started, leaves that standby behind:
/// the next environment drops it at start and adopts the replica's own
/// processes (the same ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_left_by_a_crash_mid_upgrade_is_dropped_at_the_next_start() {
    let sandbox = Sandbox::new().unwrap();
    let mut a = sandbox.start_env(bin(), "epoch", None).await.unwrap();
    let (id, own) = keep_created(&sandbox, &a.url).await;
    a.kill().await.unwrap();

    let failpoint = "upgrade_after_standby_started";
    let mut b = sandbox
        .start_env(bin(), "epoch", Some(&format!("{failpoint}=panic")))
        .await
        .unwrap();
    let o = cli(bin(), &b.url, &["upgrade", "keep", "--keep-answering"])
        .await
        .unwrap();
    let (status, stderr) = b.wait_exit().await.unwrap();
    assert!(
        !status.success() && !o.status.success() && stderr.contains(failpoint),
        "the environment did not crash at {failpoint}: exit {status}; stderr:\n{stderr}"
    );
    let names: Vec<String> = sandbox
        .services()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    let standby = ServiceTemplate::standby_service_name(id);
    assert!(
        names.contains(&standby),
        "the standby was started: {names:?}"
    );

    let _c = sandbox.start_env(bin(), "epoch", None).await.unwrap();
    only_own_left(&sandbox, id, &own, "adopted").await;
}

/// A standby that never catches up (its processes do not answer) fails the
/// upgrade within its bound, naming why; the standby is dropped and the
/// replica's own processes are left as they were (not restarted), still
/// answering for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_whose_standby_never_catches_up_fails_and_leaves_the_replica_alone() {
    let sandbox = Sandbox::new().unwrap();
    let env = sandbox.start_env(bin(), "epoch", None).await.unwrap();
    let (id, own) = keep_created(&sandbox, &env.url).await;

    // The services are `sleep`: nothing answers a controller.
    let started = std::time::Instant::now();
    let o = cli(bin(), &env.url, &["upgrade", "keep", "--keep-answering"])
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the upgrade failed");
    assert!(
        err.contains("the standby of replica \"keep\" did not catch up within"),
        "{err}"
    );
    assert!(
        started.elapsed() < lockstep_environment::CATCH_UP_BOUND * 2,
        "bounded: {:?}",
        started.elapsed()
    );
    only_own_left(&sandbox, id, &own, "left as they were").await;
}

/// Creates replica "keep" (2 processes) through the environment at `url`;
/// its ID and its processes' identities.
async fn keep_created(sandbox: &Sandbox, url: &str) -> (u64, Vec<String>) {
    let o = cli(bin(), url, &["create", "keep", "--processes", "2"])
        .await
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let services = sandbox.services().await.unwrap();
    let id = services[0].id;
    (id, sandbox.identities(&services, id).unwrap())
}

/// Asserts that replica `id`'s own service is the only one (its standby was
/// dropped) and that its processes are still `own` (`how`: why they are).
async fn only_own_left(sandbox: &Sandbox, id: u64, own: &[String], how: &str) {
    let services = sandbox.services().await.unwrap();
    let names: Vec<&str> = services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        [ServiceTemplate::service_name(id)],
        "the standby was dropped"
    );
    assert_eq!(
        sandbox.identities(&services, id).unwrap(),
        own,
        "the replica's own processes were {how}, not restarted"
    );
}
