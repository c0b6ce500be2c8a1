//! Attacks on a replica process's controller port by other local
//! connections: unproven connections that crowd the real controller out,
//! slow handshakes, a flood of refused connections in the log, and a peer
//! without the key replaying a real Hello.

use bytes::BytesMut;
use tokio_util::codec::Encoder;

use crate::*;

/// More idle unproven connections than a process admits, held open on every
/// process while the controller reconnects: it still gets in at once.
pub(crate) async fn unproven_flood_during_reconnect(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let mut flood = Vec::new();
    for p in &r.addrs.processes {
        for _ in 0..lockstep_replica::server::MAX_UNPROVEN_CONNECTIONS + 16 {
            if let Ok(s) = TcpStream::connect(ip_addr(p)).await {
                flood.push(s);
            }
        }
    }
    c.reconnect().map_err(|e| e.to_string())?;
    let bound = lockstep_replica::server::HELLO_DEADLINE;
    let result = tokio::time::timeout(bound, drives(&c, 1)).await;
    drop(flood);
    c.shutdown();
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(violation("S1", format!("during the flood: {e}"))),
        Err(_) => Err(violation(
            "S1",
            format!("idle unproven connections kept the controller out for {bound:?}"),
        )),
    }
}

/// Peers that trickle a byte at a time hold no handshake past its deadline,
/// and the controller is served meanwhile.
pub(crate) async fn slow_handshake(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let addr = ip_addr(&r.addrs.processes[0]);
    let mut slow = Vec::new();
    for _ in 0..8 {
        slow.push(TcpStream::connect(addr).await.map_err(|e| e.to_string())?);
    }
    let started = tokio::time::Instant::now();
    let bound = lockstep_replica::server::HELLO_DEADLINE + Duration::from_secs(3);
    let mut open = slow.len();
    c.reconnect().map_err(|e| e.to_string())?;
    let served = drives(&c, 1).await;
    // One byte per 200 ms each, until the process closes them.
    while open > 0 && started.elapsed() < bound {
        tokio::time::sleep(Duration::from_millis(200)).await;
        open = 0;
        for s in &mut slow {
            let mut b = [0u8; 1];
            let closed = matches!(
                tokio::time::timeout(Duration::from_millis(1), s.read(&mut b)).await,
                Ok(Ok(0)) | Ok(Err(_))
            );
            if !closed && s.write_all(&[0]).await.is_ok() {
                open += 1;
            }
        }
    }
    c.shutdown();
    served.map_err(|e| violation("S1", format!("during slow handshakes: {e}")))?;
    if open > 0 {
        return Err(violation(
            "S1",
            format!("{open} trickling handshakes were still open after {bound:?}"),
        ));
    }
    Ok(())
}

/// Hundreds of refused connections must not grow the process's log line by
/// line (one summary per interval).
pub(crate) async fn log_flood(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica_logging(id, 2, v, "info").await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let log = r.dir.path().join(format!("logs/replica-{id}-0.log"));
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let before = size(&log);
    let addr = ip_addr(&r.addrs.processes[0]);
    for _ in 0..500 {
        if let Ok(mut s) = TcpStream::connect(addr).await {
            let _ = s.write_all(&[0xff; 8]).await;
        }
    }
    // Until the process has handled them: the controller is still served.
    drives(&c, 1).await?;
    c.shutdown();
    let grown = size(&log).saturating_sub(before);
    if grown > 16 << 10 {
        return Err(violation(
            "S1",
            format!("500 refused connections grew the process log by {grown} bytes"),
        ));
    }
    Ok(())
}

/// A peer without the key sends a copy of a real Hello: it gets no answer at
/// all (with a key, nothing is read before the session is set up).
pub(crate) async fn keyless_peer_gets_nothing(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let addr = ip_addr(&r.addrs.processes[0]);
    let mut hello = BytesMut::new();
    ControllerCodec::default()
        .encode(
            Command {
                seqno: 0,
                strategy: Strategy::Barrier,
                kind: CommandKind::Hello(r.addrs.hello(0, 1, 1)),
            },
            &mut hello,
        )
        .map_err(|e| e.to_string())?;
    // The process listens (a refused connection would be a harness error,
    // not a pass): then what a keyless peer's Hello gets.
    TcpStream::connect(addr)
        .await
        .map_err(|e| Failure::Harness(format!("process 0 does not listen: {e}")))?;
    let answer = first_answer(addr, &hello).await;
    c.shutdown();
    match answer {
        None => Ok(()),
        Some(a) => Err(violation(
            "S1",
            format!("a peer without the key was answered {:?}", a.kind),
        )),
    }
}
