//! `lockstep-replica` exits with 0 within a second of SIGTERM, formed or
//! still forming its cluster: a deleted pod need not wait out its grace
//! period (PID 1 of a container ignores a SIGTERM it has no handler for).

use std::time::{Duration, Instant};

/// A free port, never one this test binary handed out before: the tests
/// run at once, and the kernel may give a port just freed by one test to
/// another, whose `listening` would then see the wrong process listen and
/// signal its own before that one installed its handler.
fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Starts a replica process of `processes` (only process 0 runs: with 2,
/// it waits for its missing peer, forming).
fn start(processes: u32) -> (std::process::Child, u16, u16) {
    let ports: Vec<u16> = (0..processes).map(|_| free_port()).collect();
    let controller = free_port();
    let peers = ports
        .iter()
        .map(|p| format!("127.0.0.1:{p}"))
        .collect::<Vec<_>>()
        .join(",");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep-replica"))
        .args(["--replica-id", "1", "--process", "0", "--workers", "1"])
        .args(["--processes", &processes.to_string()])
        .args(["--timely-port", &ports[0].to_string()])
        .args(["--controller-port", &controller.to_string()])
        .args(["--peers", &peers])
        .env("RUST_LOG", "warn")
        .spawn()
        .unwrap();
    (child, controller, ports[0])
}

/// Waits (bounded) until something listens on `port`.
fn listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SIGTERM to `child`: its exit status and how long it took.
fn terminate(child: &mut std::process::Child) -> (std::process::ExitStatus, Duration) {
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return (status, started.elapsed());
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("still running 10 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_serving_process_exits_within_a_second_of_sigterm() {
    let (mut child, controller, _) = start(1);
    // Serving: its controller port accepts.
    listening(controller);
    let (status, took) = terminate(&mut child);
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
}

#[test]
fn a_forming_process_exits_within_a_second_of_sigterm() {
    let (mut child, _, timely) = start(2);
    // Forming: its timely port listens (the handler is installed before),
    // and its peer never comes.
    listening(timely);
    let (status, took) = terminate(&mut child);
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
}
