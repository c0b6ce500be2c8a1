//! Fault holes of issue 15, each on real `lockstep-replica` processes (the
//! binary next to the `lockstep` binary under test, or
//! `$LOCKSTEP_REPLICA_BIN`):
//!
//! - a port recorded for a replica process taken by a foreign listener: the
//!   orchestrator re-chooses every process's ports after repeated quick
//!   exits, the controller follows, and the replica answers again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lockstep_environment::chaos::Sandbox;
use lockstep_protocol::reference::evaluate;

mod common;
use common::*;

/// How long recovery may take on a slow shared machine.
const RECOVERY_BOUND: Duration = Duration::from_secs(60);

fn controller_addr(s: &lockstep_orchestrator::ServiceStatus, i: usize) -> SocketAddr {
    s.processes[i].addresses["controller"]
}

/// Waits (bounded) until process `pid` is gone.
async fn wait_gone(pid: u32) {
    let started = Instant::now();
    while proc_state(pid).is_some_and(|s| s != 'Z') && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_is_rechosen_for_every_process_and_the_replica_answers_again() {
    let sandbox = Sandbox::new().unwrap();
    let env = start(sandbox.path()).await;
    env.create_replica("r1", shape(2, 1)).await.unwrap();
    let plan = create_reduce(&env).await;
    let updates = vec![u(&[1, 10], 0, 1), u(&[2, 5], 0, 1), u(&[1, 20], 1, 1)];
    env.write_input("r1", 1, updates.clone(), 2).await.unwrap();
    let expected = evaluate(&plan, &BTreeMap::from([(1, updates)]), 1);
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the replica answers before the fault");
    let before = service(&env).await;
    let taken = controller_addr(&before, 1);

    // Kill process 1 and take its controller port before its supervisor
    // restarts it (the restart waits a poll and a backoff); if the
    // supervisor wins the race, kill the new process and try again.
    let started = Instant::now();
    let foreign = loop {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "could not take port {taken}"
        );
        if let Some(pid) = service(&env).await.processes[1].pid {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            wait_gone(pid).await;
        }
        if let Ok(l) = std::net::TcpListener::bind(taken) {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    // Process 1 cannot listen any more; after a few quick exits every
    // process gets new ports, the controller reconnects there, and the
    // replica answers again (rebuilt from the history).
    if let Err(last) = peek_until(&env, 101, 1, &expected, RECOVERY_BOUND).await {
        panic!(
            "no correct answer within {RECOVERY_BOUND:?} of taking {taken}; last: {last}; service: {:?}",
            service(&env).await
        );
    }
    let after = service(&env).await;
    assert!(after.processes.iter().all(|p| p.running), "{after:?}");
    for (old, new) in before.processes.iter().zip(&after.processes) {
        assert_ne!(
            old.addresses, new.addresses,
            "process {}: every process has new ports",
            old.index
        );
        assert_ne!(old.pid, new.pid, "process {} was restarted", old.index);
    }
    assert_eq!(
        foreign.local_addr().unwrap(),
        taken,
        "the foreign listener still holds the old port"
    );

    // The new ports are recorded: an environment restarted on the same
    // state directory adopts the processes on them and answers.
    drop(env);
    let env = start(sandbox.path()).await;
    let adopted = service(&env).await;
    assert_eq!(pids(&adopted), pids(&after), "adopted, not restarted");
    assert_eq!(
        controller_addr(&adopted, 0),
        controller_addr(&after, 0),
        "the recorded ports are the new ones"
    );
    peek_until(&env, 101, 1, &expected, Duration::from_secs(30))
        .await
        .expect("the new environment's controller answers on the new ports");
}
