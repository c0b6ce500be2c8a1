//! A listener driven past the descriptor limit: its accepts fail with
//! EMFILE while the descriptors are out, and it serves again once they are
//! back (R1: no server stops on a resource error). Its own test binary: it
//! lowers the process's descriptor limit.

use std::time::Duration;

use lockstep_admission::{accept, AcceptErrors, ACCEPT_BACKOFF};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::test]
async fn an_accept_past_the_descriptor_limit_backs_off_and_serves_again() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, 256.min(hard), hard).unwrap();

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (failed_tx, mut failed_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut errors = AcceptErrors::new("test");
    let failures = errors.total_counter();
    let server = tokio::spawn(async move {
        for _ in 0..2 {
            let (mut s, _) = accept(&listener, &mut errors).await;
            let _ = failed_tx.send(errors.failed_total());
            let _ = s.write_all(b"k").await;
        }
        errors
    });
    // Served once.
    let mut first = TcpStream::connect(addr).await.unwrap();
    let mut b = [0u8; 1];
    assert_eq!(first.read(&mut b).await.unwrap(), 1);
    assert_eq!(failed_rx.recv().await, Some(0));

    // Exhaust the descriptors, leaving one for the client's socket; the
    // kernel completes its connection in the backlog, and the server's
    // accept fails with EMFILE.
    let mut hold = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        hold.push(f);
    }
    hold.pop();
    let pending = std::net::TcpStream::connect(addr).expect("connected in the backlog");
    // Bounded wait on the observable event: the server counted a failed
    // accept (polled while it backs off).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while failures.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no failed accept seen"
        );
        tokio::time::sleep(ACCEPT_BACKOFF / 4).await;
    }
    assert!(
        !server.is_finished(),
        "the accept loop goes on after EMFILE"
    );
    drop(hold);
    pending.set_nonblocking(true).unwrap();
    let mut pending = TcpStream::from_std(pending).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), pending.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(1))), "served again after EMFILE: {r:?}");
    let failed = failed_rx.recv().await.unwrap();
    assert!(failed > 0, "the second accept came after failed ones");
    let errors = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap();
    assert!(errors.failed_total() > 0);
}
