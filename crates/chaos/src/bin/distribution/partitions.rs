//! The `@hosts` variants of the distribution suite: real network partitions.
//!
//! Each scenario runs a 2x2 replica whose processes are on two simulated
//! hosts (`lockstep serve --hosts 2`'s network namespaces,
//! `lockstep_orchestrator::hosts`) and cuts a veth link instead of killing a
//! process: the **control** link between the controller and process 1, or
//! the **mesh** link between process 1 and process 0. A cut link is silence,
//! not a reset: what was sent is dropped, nobody is told. It is cut for
//! less than the heartbeat timeout (1 s: [`SHORT`]) or for more
//! ([`LONG`]; a cut control link lasts until the controller reported process
//! 1 silent), during a create or during reconciliation (from the moment the
//! controller reports every process connected and sent the history), and
//! then healed. Two more scenarios replace the controller while the link is
//! cut for long, as when an environment restarts during a partition: the
//! successor no longer wants the dataflow whose create reached process 0
//! and, on the control link, never reached process 1 over its socket.
//!
//! As the environment does, the harness restarts the replica through the
//! orchestrator when the controller reports a process silent (at most once
//! per 10 s). After healing, I1–I4 are checked as in every scenario.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_chaos::outcome::{violation, Failure};
use lockstep_controller::{Controller, Event};
use lockstep_orchestrator::hosts::Link;
use lockstep_orchestrator::Orchestrator;
use lockstep_protocol::CommandHistory;

use super::replica::{controller, Replica};
use super::variant::Variant;
use super::workload::{check, d1, d2, history, ready, x};

/// A cut shorter than the heartbeat timeout (1 s).
const SHORT: Duration = Duration::from_millis(400);
/// A cut longer than the heartbeat timeout.
const LONG: Duration = Duration::from_millis(2500);
/// How long a cut lasts in the scenarios that replace the controller: TCP's
/// retransmissions of what was sent into the cut back off (about 0.2, 0.6,
/// 1.4, 3.0, 6.2 s after the send), and the heal falls well before the next.
const TAKEOVER: Duration = Duration::from_millis(3500);
/// How long a silent process may take to be reported.
const SILENT_BOUND: Duration = Duration::from_secs(5);
/// The process whose links are cut (host 1).
const CUT: usize = 1;

/// The partition scenarios, run by every `@hosts` variant.
pub const SCENARIOS: [&str; 10] = [
    "control-cut-short-during-create",
    "control-cut-long-during-create",
    "mesh-cut-short-during-create",
    "mesh-cut-long-during-create",
    "control-cut-short-during-reconcile",
    "control-cut-long-during-reconcile",
    "mesh-cut-short-during-reconcile",
    "mesh-cut-long-during-reconcile",
    "control-cut-long-create-new-controller",
    "mesh-cut-long-create-new-controller",
];

/// Restarts the replica when a controller reports a process silent, as the
/// environment does: at most once per 10 s.
#[derive(Clone, Default)]
struct Restarter {
    last: Arc<Mutex<Option<Instant>>>,
}

impl Restarter {
    /// `controller(...)`, with its silent-process reports acted on.
    fn controller(&self, r: &Replica, epoch: u64, s: Variant, h: CommandHistory) -> Controller {
        let c = controller(r, epoch, s, h);
        let mut events = c.events();
        let orchestrator = Arc::clone(&r.orchestrator);
        let service = r.service.clone();
        let last = Arc::clone(&self.last);
        tokio::spawn(async move {
            while let Ok(e) = events.recv().await {
                if let Event::ProcessSilent { process, .. } = e {
                    let due = {
                        let mut last = last.lock().expect("not poisoned");
                        let due = last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
                        if due {
                            *last = Some(Instant::now());
                        }
                        due
                    };
                    if due {
                        eprintln!("process {process} is silent; restarting {service}");
                        if let Err(e) = orchestrator.restart_service(&service).await {
                            eprintln!("restarting {service} failed: {e}");
                        }
                    }
                }
            }
        });
        c
    }
}

/// Cuts (`up: false`) or heals one of process [`CUT`]'s links.
fn set_link(r: &Replica, link: Link, up: bool) -> Result<(), Failure> {
    let hosts = r
        .orchestrator
        .hosts()
        .ok_or_else(|| Failure::Harness("the replica is not on simulated hosts".into()))?;
    hosts
        .set_link(CUT, link, up)
        .map_err(|e| Failure::Harness(e.to_string()))
}

/// Cuts `link`, runs `during` (its result is not awaited: a command sent
/// into a partition may not complete until the link heals), holds the cut
/// for `hold` (or, for `until_silent`, until `c` reports process [`CUT`]
/// silent), then heals. A silent process that is never reported is an I2
/// violation.
async fn cut_for(
    r: &Replica,
    c: &Controller,
    link: Link,
    hold: Duration,
    until_silent: bool,
    during: impl FnOnce(),
) -> Result<(), Failure> {
    let mut events = c.events();
    set_link(r, link, false)?;
    during();
    let waited = if until_silent {
        tokio::time::timeout(SILENT_BOUND, async {
            loop {
                match events.recv().await {
                    Ok(Event::ProcessSilent { process, .. }) if process == CUT => return true,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return false,
                    _ => {}
                }
            }
        })
        .await
        .unwrap_or(false)
    } else {
        tokio::time::sleep(hold).await;
        true
    };
    set_link(r, link, true)?;
    if !waited {
        return Err(violation(
            "I2",
            format!(
                "process {CUT}, cut off from the controller, was not reported silent within {SILENT_BOUND:?}"
            ),
        ));
    }
    Ok(())
}

/// Waits until `c` reports every process connected and sent the history
/// (reconciliation has begun).
async fn connected(events: &mut tokio::sync::broadcast::Receiver<Event>) -> Result<(), Failure> {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.recv().await {
                Ok(Event::Connected { .. }) => return Ok(()),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    return Err(Failure::Harness("the controller stopped".into()))
                }
                _ => {}
            }
        }
    })
    .await
    .map_err(|_| Failure::Harness("the controller did not connect within 20 s".into()))?
}

/// Runs one partition scenario on `r` (2x2, on two simulated hosts).
pub async fn scenario_on(r: &Replica, name: &str, s: Variant) -> Result<(), Failure> {
    let restarter = Restarter::default();
    let base = vec![d1(s), d2(s)];
    let with_x = vec![d1(s), d2(s), x(s)];
    let a = restarter.controller(r, 1, s, history(s, &base));
    ready(&a, &base).await?;
    let (link, long) = match name.split('-').take(3).collect::<Vec<_>>()[..] {
        ["control", "cut", "short"] => (Link::Control, false),
        ["control", "cut", "long"] => (Link::Control, true),
        ["mesh", "cut", "short"] => (Link::Mesh, false),
        ["mesh", "cut", "long"] => (Link::Mesh, true),
        _ => return Err(Failure::Harness(format!("unknown scenario {name}"))),
    };
    let hold = if long { LONG } else { SHORT };
    // A long cut of the control link lasts until the silence is reported.
    let until_silent = long && link == Link::Control;
    if name.ends_with("during-create") {
        cut_for(r, &a, link, hold, until_silent, || {
            // Sent into the partition: its answer may come after the heal.
            let _ = a.create_dataflow(x(s));
        })
        .await?;
        check(s, &a, &with_x).await
    } else if name.ends_with("during-reconcile") {
        a.shutdown();
        let b = restarter.controller(r, 2, s, history(s, &with_x));
        let mut events = b.events();
        connected(&mut events).await?;
        // Reconciliation of process 1 runs into the partition; a long
        // one outlasts the heartbeat timeout.
        cut_for(r, &b, link, hold, false, || {}).await?;
        check(s, &b, &with_x).await
    } else if name.ends_with("create-new-controller") {
        // The controller is replaced while process 1 is cut off, right
        // after a create; the successor does not want that dataflow. The
        // cut lasts long enough (TAKEOVER) that the old connection's
        // retransmissions have backed off past the successor's first
        // connection after the heal: process 1 takes the successor's Hello
        // before the old controller's create arrives, and stops reading the
        // old connection, so its socket copy of the create is lost.
        let cut_at = Instant::now();
        set_link(r, link, false)?;
        let _ = a.create_dataflow(x(s));
        tokio::time::sleep(SHORT).await;
        a.shutdown();
        if link == Link::Mesh {
            let b = restarter.controller(r, 2, s, history(s, &base));
            tokio::time::sleep(TAKEOVER.saturating_sub(cut_at.elapsed())).await;
            set_link(r, link, true)?;
            return check(s, &b, &base).await;
        }
        // On the control link the successor reaches process 1 only after
        // the heal, and only then starts its heartbeats, over connections
        // opened after the heal: a process it finds silent is a hang the
        // network did not cause (I2), whatever a restart repairs after it.
        let b = controller(r, 2, s, history(s, &base));
        let mut events = b.events();
        tokio::time::sleep(TAKEOVER.saturating_sub(cut_at.elapsed())).await;
        set_link(r, link, true)?;
        let silent = async {
            loop {
                match events.recv().await {
                    Ok(Event::ProcessSilent {
                        process,
                        silent_for,
                    }) => return (process, silent_for),
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        std::future::pending::<()>().await
                    }
                    _ => {}
                }
            }
        };
        tokio::select! {
            result = check(s, &b, &base) => result,
            (process, silent_for) = silent => Err(violation(
                "I2",
                format!(
                    "process {process} went silent ({silent_for:?}) after the partition healed, every link up: a hang the network did not cause"
                ),
            )),
        }
    } else {
        Err(Failure::Harness(format!("unknown scenario {name}")))
    }
}
