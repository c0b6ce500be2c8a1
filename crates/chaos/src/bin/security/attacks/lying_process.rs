//! Attacks by a replica process that holds the key and lies (a compromised
//! process): answers for a worker it does not host, and endless peek parts.

use std::sync::Arc;

use lockstep_protocol::Response;
use lockstep_transport::secure::{self, SecureCodec};
use lockstep_transport::ReplicaCodec;

use crate::*;

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
pub(crate) async fn lying_worker_index(id: u64, v: Variant) -> Result<(), Failure> {
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
pub(crate) async fn parts_flood(id: u64, v: Variant) -> Result<(), Failure> {
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
