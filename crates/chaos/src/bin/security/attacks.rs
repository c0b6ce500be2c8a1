//! The attacks of issue 27: an impostor on a freed controller port, frames
//! injected into a proven session, unproven connections that crowd the real
//! controller out, slow handshakes, log floods, secrets at rest and in child
//! processes, and a replica process that lies (worker indices, endless peek
//! parts). `no-mutual` (the old one-way proof) must be caught by the first
//! two, `open` by those and the ones that need a key.

use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use lockstep_protocol::secure::{self, SecureCodec};
use lockstep_protocol::{ReplicaCodec, Response};
use tokio_util::codec::{Decoder, Encoder};

use super::*;

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
pub(super) async fn impostor_on_freed_port(id: u64, v: Variant) -> Result<(), Failure> {
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
    lockstep_protocol::ReplicaCodec::new(lockstep_protocol::DEFAULT_MAX_FRAME_LEN)
        .encode(
            Response {
                process_index: 0,
                kind: ResponseKind::PeekResponse(lockstep_protocol::PeekResponse {
                    peek_id,
                    result: lockstep_protocol::PeekResult::Rows(vec![(vec![999_999], 1)]),
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
pub(super) async fn injected_frame(id: u64, v: Variant) -> Result<(), Failure> {
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

/// More idle unproven connections than a process admits, held open on every
/// process while the controller reconnects: it still gets in at once.
pub(super) async fn unproven_flood_during_reconnect(id: u64, v: Variant) -> Result<(), Failure> {
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
pub(super) async fn slow_handshake(id: u64, v: Variant) -> Result<(), Failure> {
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
pub(super) async fn log_flood(id: u64, v: Variant) -> Result<(), Failure> {
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
pub(super) async fn keyless_peer_gets_nothing(id: u64, v: Variant) -> Result<(), Failure> {
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

/// Every file of the state directory that holds or derives a key is 0600 in
/// a 0700 directory; a replica process's environment holds none of the
/// environment's own secrets (its API token).
pub(super) async fn keys_at_rest_and_in_children(_v: Variant) -> Result<(), Failure> {
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    let token = "a-token-that-must-stay-in-the-environment";
    let env_vars = [("LOCKSTEP_API_TOKEN".to_string(), PathBuf::from(token))];
    let mut env = EnvProcess::start_with_env(
        &lockstep_binary(),
        state.path(),
        "id-watermark",
        None,
        &[],
        &env_vars,
    )
    .await
    .map_err(|e| format!("starting lockstep serve: {e:#}"))?;
    let mut client = api(&env.url, Some(token)).await?;
    let created = client
        .create_replica(proto::CreateReplicaRequest {
            name: "r".into(),
            processes: 1,
            workers_per_process: 1,
            config: String::new(),
        })
        .await;
    let result = (|| {
        created.map_err(|e| Failure::Harness(format!("creating a replica: {e}")))?;
        use std::os::unix::fs::PermissionsExt;
        let mut wide = Vec::new();
        let mut in_records = Vec::new();
        let orchestrator = state.path().join("orchestrator");
        let mut check = |p: PathBuf, want: u32| {
            let mode = std::fs::metadata(&p)
                .map(|m| m.permissions().mode() & 0o777)
                .unwrap_or(0);
            if mode & !want != 0 {
                wide.push(format!("{} is {mode:o}", p.display()));
            }
        };
        check(state.path().join("session.secret"), 0o600);
        check(orchestrator.clone(), 0o700);
        check(orchestrator.join("services"), 0o700);
        for entry in std::fs::read_dir(orchestrator.join("services"))
            .map_err(|e| e.to_string())?
            .flatten()
        {
            check(entry.path(), 0o600);
            // No secret in a service record: the environment (the session
            // key) has its own file.
            if entry.path().extension().is_some_and(|e| e == "json")
                && std::fs::read_to_string(entry.path())
                    .unwrap_or_default()
                    .contains("LOCKSTEP_SESSION_KEY")
            {
                in_records.push(format!("{} holds the session key", entry.path().display()));
            }
        }
        if !wide.is_empty() {
            return Err(violation(
                "S1",
                format!("secrets readable by other users: {}", wide.join(", ")),
            ));
        }
        if !in_records.is_empty() {
            return Err(violation("S1", in_records.join(", ")));
        }
        Ok(())
    })();
    // The replica's processes (`sleep` here) and what they were given.
    let leaked = std::fs::read_dir("/proc")
        .map_err(|e| e.to_string())?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| std::fs::read(format!("/proc/{pid}/environ")).ok())
        .filter(|environ| {
            let marker = format!(
                "LOCKSTEP_ORCHESTRATOR={}",
                state.path().join("orchestrator").display()
            );
            environ.split(|b| *b == 0).any(|kv| kv == marker.as_bytes())
        })
        .any(|environ| {
            environ
                .split(|b| *b == 0)
                .any(|kv| kv.starts_with(b"LOCKSTEP_API_TOKEN="))
        });
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    result?;
    if leaked {
        return Err(violation(
            "S1",
            "a replica process inherited the environment's API token".into(),
        ));
    }
    Ok(())
}

/// `lockstep serve` refuses a state directory that other users can write.
pub(super) async fn state_dir_writable_by_others(_v: Variant) -> Result<(), Failure> {
    use std::os::unix::fs::PermissionsExt;
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o777))
        .map_err(|e| e.to_string())?;
    let started =
        EnvProcess::start(&lockstep_binary(), state.path(), "id-watermark", None, &[]).await;
    match started {
        Err(e) if format!("{e:#}").contains("writable by other users") => Ok(()),
        Err(e) => Err(Failure::Harness(format!(
            "lockstep serve failed otherwise: {e:#}"
        ))),
        Ok(mut env) => {
            let _ = env.kill().await;
            let _ = kill_all_services(&state.path().join("orchestrator"));
            Err(violation(
                "S1",
                "lockstep serve ran on a state directory every user can write".into(),
            ))
        }
    }
}

/// A fake process 0 of a one-process replica that holds the key (a
/// compromised process): it answers every status request with `status`,
/// and after the Hello, with `flood`, sends that many bytes of peek parts.
async fn lying_process(
    v: Variant,
    id: u64,
    status: Option<Response>,
    flood: usize,
) -> Result<
    (
        ReplicaAddrs,
        tokio::task::JoinHandle<()>,
        Arc<tokio::sync::Notify>,
    ),
    String,
> {
    // Told when a flood ended: every byte sent, or the connection cut.
    let flood_done = Arc::new(tokio::sync::Notify::new());
    let done = Arc::clone(&flood_done);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let key = v.key(id);
    let one_way = v == Variant::NoMutual;
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let key = key.clone();
            let status = status.clone();
            let done = Arc::clone(&done);
            tokio::spawn(async move {
                let session = match &key {
                    Some(k) if !one_way => match secure::respond(&mut s, k, id, 0).await {
                        Ok(session) => Some(session),
                        Err(_) => return,
                    },
                    _ => None,
                };
                let mut framed = Framed::new(
                    s,
                    SecureCodec::new(
                        ReplicaCodec::new(lockstep_protocol::DEFAULT_MAX_FRAME_LEN),
                        session,
                    ),
                );
                while let Some(Ok(cmd)) = framed.next().await {
                    match cmd.kind {
                        CommandKind::Hello(_) if flood > 0 => {
                            let part = Response {
                                process_index: 0,
                                kind: ResponseKind::PeekResponse(lockstep_protocol::PeekResponse {
                                    peek_id: 1,
                                    result: lockstep_protocol::PeekResult::Part(vec![
                                        (
                                            vec![0; 1024],
                                            1
                                        );
                                        64
                                    ]),
                                }),
                            };
                            let mut sent = 0;
                            while sent < flood {
                                if framed.send(part.clone()).await.is_err() {
                                    break;
                                }
                                sent += 64 * 1024 * 8;
                            }
                            done.notify_one();
                        }
                        CommandKind::StatusRequest { .. } => {
                            if let Some(r) = &status {
                                if framed.send(r.clone()).await.is_err() {
                                    return;
                                }
                            }
                        }
                        _ => {}
                    }
                }
            });
        }
    });
    let addrs = ReplicaAddrs {
        replica_id: id,
        processes: vec![addr.into()],
        workers_per_process: 1,
        command_log: None,
        session_key: v.key(id),
        one_way_proof: one_way,
        max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
    };
    Ok((addrs, task, flood_done))
}

/// Waits (bounded) for the controller to end a session with a reason
/// containing `about`.
async fn session_ended(c: &Controller, about: &str) -> Result<bool, Failure> {
    let mut events = c.events();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(200), events.recv()).await {
            Ok(Ok(lockstep_controller::Event::Disconnected { reason, .. }))
                if reason.contains(about) =>
            {
                return Ok(true)
            }
            Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return Ok(false),
            _ => {}
        }
    }
    Ok(false)
}

/// A process that answers for a worker it does not host (it would pass the
/// history check for its peers) is cut off.
pub(super) async fn lying_worker_index(id: u64, v: Variant) -> Result<(), Failure> {
    let lie = Response {
        process_index: 0,
        kind: ResponseKind::Status(lockstep_protocol::Status {
            worker_index: 5,
            epoch: 1,
            nonce: 1,
            applied_seqno: 0,
            history_hash: None,
            creation_log: Vec::new(),
            installed: Vec::new(),
        }),
    };
    let (addrs, task, _) = lying_process(v, id, Some(lie), 0).await?;
    let c = controller(&addrs);
    let ended = session_ended(&c, "does not own").await?;
    c.shutdown();
    task.abort();
    if ended {
        Ok(())
    } else {
        Err(violation(
            "S1",
            "a process answered for worker 5 of a one-worker replica and kept its session".into(),
        ))
    }
}

/// A process that floods the controller with 512 MiB of peek parts is cut
/// off or ignored: the controller's memory stays bounded.
pub(super) async fn parts_flood(id: u64, v: Variant) -> Result<(), Failure> {
    let before = rss_mib(std::process::id());
    let (addrs, task, flood_done) = lying_process(v, id, None, 512 << 20).await?;
    let c = controller(&addrs);
    // Until the flood ended (every byte sent, or the connection cut by the
    // controller), within 120 s: then what the controller kept is all it
    // will keep of it.
    let ended = tokio::time::timeout(Duration::from_secs(120), flood_done.notified()).await;
    let after = rss_mib(std::process::id());
    c.shutdown();
    task.abort();
    if ended.is_err() {
        return Err(Failure::Harness(
            "the flood of peek parts neither ended nor was cut within 120 s".into(),
        ));
    }
    if after - before > 200.0 {
        return Err(violation(
            "S1",
            format!(
                "a flood of peek parts grew the controller by {:.0} MiB",
                after - before
            ),
        ));
    }
    Ok(())
}

/// With the environment's descriptors limited to 256, 400 idle connections
/// to the API (no token, no bytes) must not keep a token holder out.
pub(super) async fn api_connection_exhaustion(v: Variant) -> Result<(), Failure> {
    let (mut env, state) = start_env(v).await?;
    let pid = env
        .pid()
        .ok_or_else(|| "lockstep serve has no PID".to_string())?;
    let limited = std::process::Command::new("prlimit")
        .args([format!("--pid={pid}"), "--nofile=256:256".into()])
        .status()
        .map_err(|e| Failure::Harness(format!("prlimit: {e}")))?;
    if !limited.success() {
        return Err(Failure::Harness(format!("prlimit failed: {limited}")));
    }
    let addr: SocketAddr = env
        .url
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut flood = Vec::new();
    for _ in 0..400 {
        if let Ok(s) = TcpStream::connect(addr).await {
            flood.push(s);
        }
    }
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        let mut client = api(&env.url, Some(TOKEN)).await?;
        client
            .list_replicas(proto::ListReplicasRequest::default())
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    drop(flood);
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    match served {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(violation(
            "S1",
            format!("400 idle connections kept a token holder out of the API: {e}"),
        )),
        Err(_) => Err(violation(
            "S1",
            "400 idle connections kept a token holder out of the API for 10 s".into(),
        )),
    }
}

/// The metrics endpoint off loopback answers only with the API token.
pub(super) async fn metrics_off_loopback_without_token(v: Variant) -> Result<(), Failure> {
    let state = tempfile::tempdir().map_err(|e| e.to_string())?;
    let token_file = state.path().join("api.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).map_err(|e| e.to_string())?;
    let token_file = token_file.to_string_lossy().into_owned();
    let mut args = vec!["--metrics-listen", "0.0.0.0:0"];
    if v != Variant::Open {
        args.extend(["--api-token-file", &token_file]);
    }
    let mut env = EnvProcess::start(
        &lockstep_binary(),
        state.path(),
        "id-watermark",
        None,
        &args,
    )
    .await
    .map_err(|e| format!("starting lockstep serve: {e:#}"))?;
    let port = env
        .serving_line
        .rsplit_once("metrics on http://")
        .and_then(|(_, r)| r.split('/').next())
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| format!("no metrics address in {:?}", env.serving_line))?;
    let get = |auth: Option<&str>| {
        let auth = auth
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        async move {
            let mut s = TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(|e| e.to_string())?;
            s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n").as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            let mut out = String::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
                .await
                .map_err(|_| "no answer within 10 s".to_string())?
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(out)
        }
    };
    let without = get(None).await;
    let with = get(Some(TOKEN)).await;
    let _ = env.kill().await;
    let _ = kill_all_services(&state.path().join("orchestrator"));
    let without = without?;
    if without.starts_with("HTTP/1.1 200") {
        return Err(violation(
            "S1",
            "the metrics endpoint off loopback answered without a token".into(),
        ));
    }
    let with = with?;
    if !with.starts_with("HTTP/1.1 200") {
        return Err(Failure::Harness(format!(
            "the metrics endpoint refused the token: {}",
            with.lines().next().unwrap_or("")
        )));
    }
    Ok(())
}
