//! Attacks on the path between the controller and a replica process: an
//! impostor on the controller port a dead process freed, and an on-path
//! relay that injects a forged frame into a proven session. `no-mutual`
//! (the old one-way proof) must be caught by these two.

use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use lockstep_protocol::Response;
use lockstep_transport::ReplicaCodec;
use tokio_util::codec::{Decoder, Encoder};

use crate::*;

/// Binds `port` on 127.0.0.1, retrying while it is still taken (5 s).
async fn bind_retry(port: u16) -> Result<tokio::net::TcpListener, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            Ok(l) => return Ok(l),
            Err(e) if tokio::time::Instant::now() > deadline => {
                return Err(format!("cannot bind the freed port {port}: {e}"))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// The first command a byte stream holds as plain frames, if any.
fn plain_command(bytes: &[u8]) -> Option<Command> {
    let mut buf = BytesMut::from(bytes);
    ReplicaCodec::new(lockstep_protocol::DEFAULT_MAX_FRAME_LEN)
        .decode(&mut buf)
        .ok()
        .flatten()
}

/// A replica's process dies and a local user binds its controller port
/// before it is restarted: the controller must send that impostor nothing (no Hello, no
/// history, no peek) and take nothing from it.
pub(crate) async fn impostor_on_freed_port(id: u64, v: Variant) -> Result<(), Failure> {
    // One process, so that its loss leaves nothing else to reach.
    let mut m = ManualReplica::with_processes(id, v, 1)?;
    m.spawn(0)?;
    let c = controller(&m.addrs()?);
    drives(&c, 0).await?;
    let mut events = c.events();
    m.kill(0);
    let listener = bind_retry(m.controller[0]).await?;
    let received: Arc<Mutex<Vec<u8>>> = Arc::default();
    let sink = Arc::clone(&received);
    let impostor = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let sink = Arc::clone(&sink);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    sink.lock()
                        .expect("not poisoned")
                        .extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    let _ = c.reconnect();
    // Until the controller either refuses the impostor (a failed connect)
    // or has sent it a whole frame: both are observable, within 30 s.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut refused = false;
    let sent = loop {
        if let Some(cmd) = plain_command(&received.lock().expect("not poisoned")) {
            break Some(cmd);
        }
        if refused && !received.lock().expect("not poisoned").is_empty() {
            break None;
        }
        if tokio::time::Instant::now() > deadline {
            impostor.abort();
            c.shutdown();
            return Err(Failure::Harness(
                "the controller neither refused nor reached the impostor within 30 s".into(),
            ));
        }
        match tokio::time::timeout(Duration::from_millis(50), events.recv()).await {
            // A failed connect once the impostor was reached: it did not
            // prove the key (it answered wrong, or not at all in time).
            Ok(Ok(lockstep_controller::Event::ConnectFailed { .. })) => {
                refused |= !received.lock().expect("not poisoned").is_empty();
            }
            Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => break None,
            _ => {}
        }
    };
    impostor.abort();
    c.shutdown();
    match sent {
        Some(cmd) => Err(violation(
            "S1",
            format!(
                "the controller sent {} to a process that did not prove the replica's key",
                cmd.kind.name()
            ),
        )),
        None => Ok(()),
    }
}

/// The forged answer an on-path attacker puts before the real one.
fn forged_answer(peek_id: u64) -> Vec<u8> {
    let mut out = BytesMut::new();
    lockstep_transport::ReplicaCodec::new(lockstep_protocol::DEFAULT_MAX_FRAME_LEN)
        .encode(
            Response {
                process_index: 0,
                kind: ResponseKind::PeekResponse(lockstep_protocol::PeekResponse {
                    peek_id,
                    result: lockstep_protocol::PeekResult::Rows(vec![(
                        lockstep_plan::row(&[999_999]),
                        1,
                    )]),
                }),
            },
            &mut out,
        )
        .expect("encodes");
    out.to_vec()
}

/// Splits the whole units (frames with a 4-byte length, records with a
/// 2-byte one) off the front of `buf`.
fn units(buf: &mut Vec<u8>, prefix: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        if buf.len() < prefix {
            return out;
        }
        let len = if prefix == 4 {
            u32::from_be_bytes(buf[..4].try_into().expect("4 bytes")) as usize
        } else {
            u16::from_be_bytes(buf[..2].try_into().expect("2 bytes")) as usize
        };
        if buf.len() < prefix + len {
            return out;
        }
        out.push(buf.drain(..prefix + len).collect());
    }
}

/// An on-path relay in front of process 0: on its first connection, as
/// soon as a peek passes (plain frames: it reads the peek's ID) or at the
/// next unit (encrypted: it cannot), it puts a forged answer with a row no
/// write contains before the replica's own units.
async fn injecting_relay(
    listener: tokio::net::TcpListener,
    upstream: SocketAddr,
    secure_session: bool,
) {
    let prefix = if secure_session { 2 } else { 4 };
    let mut first = true;
    while let Ok((down, _)) = listener.accept().await {
        let Ok(up) = TcpStream::connect(upstream).await else {
            continue;
        };
        let inject = first;
        first = false;
        let (mut dr, mut dw) = down.into_split();
        let (mut ur, mut uw) = up.into_split();
        let (peek_tx, mut peek_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 16];
            let mut pending = Vec::new();
            while let Ok(n) = dr.read(&mut buf).await {
                if n == 0 || uw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
                if inject && !secure_session {
                    pending.extend_from_slice(&buf[..n]);
                    for unit in units(&mut pending, 4) {
                        if let Some(Command {
                            kind: CommandKind::Peek(p),
                            ..
                        }) = plain_command(&unit)
                        {
                            let _ = peek_tx.send(p.peek_id);
                        }
                    }
                }
            }
        });
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 16];
            let mut pending = Vec::new();
            let mut injected = !inject;
            loop {
                tokio::select! {
                    Some(peek_id) = peek_rx.recv(), if !injected => {
                        injected = true;
                        if dw.write_all(&forged_answer(peek_id)).await.is_err() {
                            return;
                        }
                    }
                    r = ur.read(&mut buf) => {
                        let n = match r { Ok(0) | Err(_) => return, Ok(n) => n };
                        pending.extend_from_slice(&buf[..n]);
                        for unit in units(&mut pending, prefix) {
                            if !injected && secure_session {
                                injected = true;
                                if dw.write_all(&forged_answer(0)).await.is_err() {
                                    return;
                                }
                            }
                            if dw.write_all(&unit).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            }
        });
    }
}

/// Frames injected into a proven session by an on-path attacker must never
/// be taken as the replica's: every peek answers exactly what was written.
pub(crate) async fn injected_frame(id: u64, v: Variant) -> Result<(), Failure> {
    let mut m = ManualReplica::new(id, v)?;
    m.spawn(0)?;
    m.spawn(1)?;
    let mut addrs = m.addrs()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let relay_addr = listener.local_addr().map_err(|e| e.to_string())?;
    let upstream = ip_addr(&addrs.processes[0]);
    addrs.processes[0] = relay_addr.into();
    let relay = tokio::spawn(injecting_relay(
        listener,
        upstream,
        v == Variant::Authenticated,
    ));
    let c = controller(&addrs);
    let result = async {
        // The first write and peek go through the relay's first connection.
        c.create_dataflow(identity_dataflow())
            .map_err(|e| e.to_string())?;
        c.write_input(
            1,
            vec![Update {
                row: vec![0],
                time: 0,
                diff: 1,
            }],
            1,
        )
        .map_err(|e| e.to_string())?;
        let mut answers = Vec::new();
        for _ in 0..5 {
            match c.peek(101, 0).await {
                Ok(mut rows) => {
                    rows.sort();
                    answers.push(rows);
                    if answers.len() >= 2 {
                        break;
                    }
                }
                Err(_) => continue,
            }
        }
        Ok::<_, String>(answers)
    }
    .await;
    relay.abort();
    c.shutdown();
    let answers = result?;
    if answers.is_empty() {
        return Err(violation(
            "S1",
            "after an injected frame the controller no longer answers peeks".into(),
        ));
    }
    for rows in &answers {
        if rows != &vec![(vec![0], 1)] {
            return Err(violation(
                "S1",
                format!("a frame injected into the session was taken as the replica's: a peek answered {rows:?}"),
            ));
        }
    }
    Ok(())
}
