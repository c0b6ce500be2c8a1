use std::sync::atomic::{AtomicUsize, Ordering};

use lockstep_controller::ReplicaAddrs;
use lockstep_orchestrator::{DropError, EnsureError, ListError, ServiceConfig, ServiceEvent};
use lockstep_protocol::ErrorResponse;

use super::requests::encode_write;
use super::*;

#[test]
fn a_stored_write_goes_through_the_protocols_checks() {
    let w = WriteInput {
        collection_id: 7,
        updates: vec![Update {
            row: vec![1, 2],
            time: 3,
            diff: -1,
        }],
        upper: 4,
        more: true,
        batch_digest: Some([1, 2, 3, 4]),
    };
    // Stored as the consolidated write alone.
    let back = decode_write(&encode_write(&w)).expect("round trip");
    assert_eq!(back.updates, w.updates);
    assert_eq!((back.more, back.batch_digest), (false, None));
    // A digest of 3 lanes is refused, naming the field (the copy this
    // replaced dropped the digest unchecked).
    let bad = wire::WriteInput {
        collection_id: 7,
        batch_digest: vec![1, 2, 3],
        ..Default::default()
    }
    .encode_to_vec();
    let err = decode_write(&bad).expect_err("3 lanes").to_string();
    assert!(err.contains("WriteInput.batch_digest"), "{err}");
}

/// Counts restarts; refuses them as stale when told to.
struct Fake {
    restarts: AtomicUsize,
    stale: bool,
    /// When each restart happened.
    at: std::sync::Mutex<Vec<Instant>>,
}

#[async_trait::async_trait]
impl Orchestrator for Fake {
    fn epoch(&self) -> u64 {
        1
    }
    async fn ensure_service(&self, _: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        Err(EnsureError::Invalid("the fake ensures nothing".into()))
    }
    async fn drop_service(&self, _: &str) -> Result<bool, DropError> {
        Ok(false)
    }
    async fn restart_service(&self, name: &str) -> Result<ServiceStatus, RestartError> {
        if self.stale {
            return Err(RestartError::StaleEpoch {
                service: name.to_string(),
                stored: 2,
                ours: 1,
            });
        }
        self.at.lock().unwrap().push(Instant::now());
        self.restarts.fetch_add(1, Ordering::SeqCst);
        Ok(ServiceStatus {
            name: name.to_string(),
            id: 1,
            epoch: 1,
            labels: BTreeMap::new(),
            processes: Vec::new(),
        })
    }
    async fn list_services(&self) -> Result<Vec<ServiceStatus>, ListError> {
        Ok(Vec::new())
    }
    fn watch_services(&self) -> broadcast::Receiver<ServiceEvent> {
        broadcast::channel(1).1
    }
}

/// A watcher over a controller of a replica that does not exist (so
/// every ping fails), fed events by hand.
fn watcher(
    fake: Arc<Fake>,
) -> (
    broadcast::Sender<Event>,
    watch::Receiver<Option<String>>,
    JoinHandle<()>,
) {
    let (tx, halted, task, _) = watcher_with_metrics(fake);
    (tx, halted, task)
}

/// [`watcher`], and the metrics its watcher counts into.
fn watcher_with_metrics(
    fake: Arc<Fake>,
) -> (
    broadcast::Sender<Event>,
    watch::Receiver<Option<String>>,
    JoinHandle<()>,
    Arc<crate::metrics::Metrics>,
) {
    let metrics: Arc<crate::metrics::Metrics> = Default::default();
    let controller = Controller::start(
        ReplicaAddrs {
            replica_id: 1,
            processes: vec!["127.0.0.1:1".parse().unwrap()],
            workers_per_process: 1,
            command_log: None,
            session_key: None,
            one_way_proof: false,
            max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
        },
        1,
        CommandHistory::new(),
        Box::new(FixedStrategy(lockstep_controller::DeliveryRules::FALLBACK)),
        Timeouts::default(),
    );
    let (halt, halted) = watch::channel(None);
    let w = Watcher {
        metrics: metrics.clone(),
        replica: "r1".into(),
        service: "replica-1".into(),
        controller,
        restarter: Restarter {
            orchestrator: fake,
            halt,
            epoch: 1,
            catalog: None,
        },
        interval: INTERVAL,
        ping_bound: Duration::from_millis(100),
        restarts: Arc::new(true.into()),
    };
    let (tx, rx) = broadcast::channel(16);
    let services = w.restarter.orchestrator.watch_services();
    (tx, halted, tokio::spawn(w.run(rx, services)), metrics)
}

/// Sends a Disconnected event and waits until the watcher counted it:
/// every event sent before it has been handled too (one task, in order).
async fn probe(tx: &broadcast::Sender<Event>, metrics: &crate::metrics::Metrics) {
    let label = crate::metrics::ReplicaLabel {
        replica: "r1".into(),
    };
    let before = metrics.disconnects.get_or_create(&label).get();
    tx.send(Event::Disconnected {
        process: 0,
        reason: "probe".into(),
    })
    .unwrap();
    eventually("the watcher to handle the events before the probe", || {
        metrics.disconnects.get_or_create(&label).get() > before
    })
    .await;
}

const INTERVAL: Duration = Duration::from_secs(1);

async fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn silent() -> Event {
    Event::ProcessSilent {
        process: 1,
        silent_for: Duration::from_secs(2),
    }
}

fn error(kind: ErrorKind) -> Event {
    Event::ReplicaError {
        process: 0,
        error: ErrorResponse {
            kind,
            message: "diverged".into(),
            seqno: 3,
        },
    }
}

#[test]
fn only_silence_lost_lockstep_and_a_restart_verdict_call_for_a_restart() {
    let (label, text) = restart_reason(&silent()).unwrap();
    assert_eq!(label, "silent");
    assert!(text.contains("process 1"));
    let (label, text) = restart_reason(&error(ErrorKind::LockstepLost)).unwrap();
    assert_eq!(label, "lockstep_lost");
    assert!(text.contains("lost lockstep: diverged"));
    assert_eq!(restart_reason(&error(ErrorKind::InvalidCommand)), None);
    assert!(restart_reason(&Event::HistoryMismatch {
        distinct_digests: 2,
        action: lockstep_policy::MismatchAction::RestartReplica,
    })
    .unwrap()
    .1
    .contains("2 different worker histories"));
    assert_eq!(
        restart_reason(&Event::HistoryMismatch {
            distinct_digests: 2,
            action: lockstep_policy::MismatchAction::ReconcileCollectively,
        }),
        None
    );
    assert_eq!(restart_reason(&Event::Connected { nonce: 1 }), None);
    assert_eq!(
        restart_reason(&Event::Disconnected {
            process: 0,
            reason: "eof".into()
        }),
        None
    );
}

#[test]
fn a_replica_that_served_and_cannot_be_reached_is_lost_one_still_starting_is_not() {
    let after = Duration::from_secs(30);
    let failed = || Event::ConnectFailed {
        reason: "connection refused".into(),
    };
    let lost = || Event::Disconnected {
        process: 0,
        reason: "eof".into(),
    };
    let mut reach = Reach::default();
    // Never served (its pods still starting): never lost.
    reach.on_event(&failed());
    assert_eq!(reach.deadline(after), None);
    // Served, then disconnected: lost `after` past the disconnection.
    reach.on_event(&Event::Connected { nonce: 1 });
    assert_eq!(reach.deadline(after), None);
    let before = Instant::now();
    reach.on_event(&lost());
    let at = reach.deadline(after).unwrap();
    assert!(at >= before + after && at <= Instant::now() + after);
    // Failed attempts do not move it.
    reach.on_event(&failed());
    assert_eq!(reach.deadline(after), Some(at));
    let (label, text) = reach.lost();
    assert_eq!(label, "unreachable");
    assert!(text.contains("after it served"), "{text}");
    assert!(crate::metrics::RESTART_REASONS.contains(&label));
    // Given once: the restarted processes must serve again first.
    reach.on_event(&failed());
    assert_eq!(reach.deadline(after), None);
    // A session in between clears it.
    reach.on_event(&Event::Connected { nonce: 2 });
    reach.on_event(&lost());
    reach.on_event(&Event::Connected { nonce: 3 });
    assert_eq!(reach.deadline(after), None);
    // Processes started again (by the orchestrator) must serve first.
    reach.on_event(&lost());
    reach.restarted();
    reach.on_event(&failed());
    assert_eq!(reach.deadline(after), None);
}

#[tokio::test]
async fn restarts_are_rate_limited_and_a_reason_within_the_interval_is_checked_again() {
    let fake = Arc::new(Fake {
        restarts: AtomicUsize::new(0),
        stale: false,
        at: Default::default(),
    });
    let (tx, _halted, task, metrics) = watcher_with_metrics(fake.clone());
    let count = || fake.restarts.load(Ordering::SeqCst);

    tx.send(Event::Connected { nonce: 1 }).unwrap();
    tx.send(error(ErrorKind::InvalidCommand)).unwrap();
    probe(&tx, &metrics).await;
    assert_eq!(count(), 0, "nothing to restart for");

    tx.send(silent()).unwrap();
    eventually("the first restart", || count() == 1).await;

    // A burst (every worker reports the halt) within the interval: no
    // restart now, one check when the interval ends.
    for _ in 0..4 {
        tx.send(error(ErrorKind::LockstepLost)).unwrap();
    }
    probe(&tx, &metrics).await;
    // The replica does not answer the ping (it does not exist): restarted.
    eventually("the deferred restart", || count() == 2).await;
    let at = fake.at.lock().unwrap().clone();
    assert!(
        at[1] - at[0] >= INTERVAL,
        "restarted again {:?} after the first, within the interval",
        at[1] - at[0]
    );
    probe(&tx, &metrics).await;
    assert_eq!(count(), 2, "the burst gave one restart, not four");
    assert!(!task.is_finished());
    task.abort();
}

#[tokio::test]
async fn a_newer_controllers_service_halts_the_environment() {
    let fake = Arc::new(Fake {
        restarts: AtomicUsize::new(0),
        stale: true,
        at: Default::default(),
    });
    let (tx, mut halted, task) = watcher(fake);
    tx.send(silent()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), halted.wait_for(|h| h.is_some()))
        .await
        .expect("halted")
        .unwrap();
    assert!(halted
        .borrow()
        .as_deref()
        .unwrap()
        .contains("another controller took over"));
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the watcher stops")
        .unwrap();
}

#[tokio::test]
async fn fenced_out_of_the_command_log_halts_the_environment_and_a_broken_log_does_not() {
    let fake = Arc::new(Fake {
        restarts: AtomicUsize::new(0),
        stale: false,
        at: Default::default(),
    });
    let (tx, mut halted, task) = watcher(fake.clone());
    tx.send(Event::LogFailed {
        message: "disk I/O error".into(),
        fenced: false,
    })
    .unwrap();
    tx.send(Event::LogFailed {
        message: "epoch 1 is fenced out by epoch 2".into(),
        fenced: true,
    })
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), halted.wait_for(|h| h.is_some()))
        .await
        .expect("halted")
        .unwrap();
    let reason = halted.borrow().clone().unwrap();
    assert!(reason.contains("fenced out by epoch 2"), "{reason}");
    assert_eq!(
        fake.restarts.load(Ordering::SeqCst),
        0,
        "a log failure is no reason to restart the replica"
    );
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the watcher stops")
        .unwrap();
}

/// One set of delivery rules, decided here and applied by the controller's
/// machine: the fallback strategy, `naive` refused unless allowed; the
/// policy itself reaches the machine unwrapped (no policy: the native rule,
/// the fallback strategy).
#[test]
fn the_environment_decides_one_set_of_delivery_rules_and_hands_the_policy_over_unwrapped() {
    use lockstep_controller::DeliveryRules;
    let compute = Compute::default();
    let d = compute.distribution_for(1);
    assert_eq!(d.rules, DeliveryRules::shipped(false));
    assert_eq!(d.rules.fallback, DeliveryRules::FALLBACK);
    assert_eq!(d.policy.name(), DeliveryRules::FALLBACK.name());
    compute.set_naive_allowed(true);
    assert!(compute.distribution_for(1).rules.naive_allowed);
}
