//! The security suite's scenario table: every scenario by name (the forged,
//! replayed and misdirected Hellos, mesh spoofing and floods, oversized
//! frames, API tokens (on loopback too) and shapes, and the `attacks` ones),
//! and the list the suite runs.

use super::*;

fn code_is(r: Result<impl Sized, tonic::Status>, code: tonic::Code) -> bool {
    matches!(r, Err(s) if s.code() == code)
}

pub(super) async fn scenario(name: &str, id: u64, v: Variant) -> Result<(), Failure> {
    match name {
        "forged-hello-huge-epoch" => forged_hello_huge_epoch(id, v).await,
        "replayed-hello" => replayed_hello(id, v).await,
        "hello-for-another-replica" => hello_for_another_replica(id, v).await,
        "spoofed-mesh-peer"
        | "idle-mesh-connections"
        | "mesh-connection-flood"
        | "mesh-trickle" => mesh_attack(name, id, v).await,
        "huge-length-prefix" | "large-pre-hello-frame" => pre_hello_frame(name, id, v).await,
        "connection-flood" => connection_flood(id, v).await,
        "api-without-token" | "api-wrong-token" | "api-with-metrics-token" => {
            api_token_attack(name, v).await
        }
        "oversized-shape" | "oversized-plan" => oversized_request(name, v).await,
        "impostor-on-freed-port" => attacks::impostor_on_freed_port(id, v).await,
        "injected-frame" => attacks::injected_frame(id, v).await,
        "unproven-flood-during-reconnect" => attacks::unproven_flood_during_reconnect(id, v).await,
        "slow-handshake" => attacks::slow_handshake(id, v).await,
        "log-flood" => attacks::log_flood(id, v).await,
        "keyless-peer-gets-nothing" => attacks::keyless_peer_gets_nothing(id, v).await,
        "keys-at-rest-and-in-children" => attacks::keys_at_rest_and_in_children(v).await,
        "state-dir-open-to-others" => attacks::state_dir_open_to_others(v).await,
        "lying-worker-index" => attacks::lying_worker_index(id, v).await,
        "peek-parts-flood" => attacks::parts_flood(id, v).await,
        "api-connection-exhaustion" => attacks::api_connection_exhaustion(v).await,
        "metrics-off-loopback-without-token" => attacks::metrics_without_token(v, false).await,
        "metrics-on-loopback-without-token" => attacks::metrics_without_token(v, true).await,
        other => Err(Failure::Harness(format!("unknown scenario {other}"))),
    }
}

/// The scenarios that only mutual, per-frame authentication passes: the
/// negative control `no-mutual` must be caught by one of them.
pub(super) const MUTUAL_SCENARIOS: [&str; 2] = ["impostor-on-freed-port", "injected-frame"];

pub(super) const SCENARIOS: [&str; 28] = [
    "api-connection-exhaustion",
    "metrics-off-loopback-without-token",
    "metrics-on-loopback-without-token",
    "mesh-connection-flood",
    "mesh-trickle",
    "impostor-on-freed-port",
    "injected-frame",
    "unproven-flood-during-reconnect",
    "slow-handshake",
    "log-flood",
    "keyless-peer-gets-nothing",
    "keys-at-rest-and-in-children",
    "state-dir-open-to-others",
    "lying-worker-index",
    "peek-parts-flood",
    "forged-hello-huge-epoch",
    "replayed-hello",
    "hello-for-another-replica",
    "spoofed-mesh-peer",
    "idle-mesh-connections",
    "huge-length-prefix",
    "large-pre-hello-frame",
    "connection-flood",
    "api-without-token",
    "api-wrong-token",
    "api-with-metrics-token",
    "oversized-shape",
    "oversized-plan",
];

/// Scenario `forged-hello-huge-epoch`.
async fn forged_hello_huge_epoch(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    for (i, addr) in r.addrs.processes.iter().enumerate() {
        let forged = r.addrs.identity(i).hello(u64::MAX, u64::MAX);
        send_hello(ip_addr(addr), forged).await;
    }
    c.reconnect().map_err(|e| e.to_string())?;
    if let Err(e) = drives(&c, 1).await {
        return Err(violation(
            "S1",
            format!("after a forged Hello with epoch 2^64-1 the real controller no longer drives the replica: {e}"),
        ));
    }
    c.shutdown();
    Ok(())
}

/// Scenario `replayed-hello`.
async fn replayed_hello(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let nonce = c.statuses().await.map_err(|e| e.to_string())?[0].nonce;
    let answer = send_hello(ip_addr(&r.addrs.processes[1]), r.addrs.hello(1, 1, nonce)).await;
    let still = c.statuses().await.map_err(|e| e.to_string())?;
    // Refused: with a key, not even answered (no session).
    if !(answer.is_none() || is_error(&answer))
        || still.iter().any(|s| s.nonce != nonce)
        || drives(&c, 1).await.is_err()
    {
        return Err(violation(
            "S1",
            "a replayed Hello took the controller's session over".into(),
        ));
    }
    c.shutdown();
    Ok(())
}

/// Scenario `hello-for-another-replica`.
async fn hello_for_another_replica(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let mut other = r.addrs.identity(0).hello(2, 1);
    other.replica_id = id + 1000;
    if let Some(key) = v.key(id + 1000) {
        other = key.sign(other);
    }
    let answer = send_hello(ip_addr(&r.addrs.processes[0]), other).await;
    if !(answer.is_none() || is_error(&answer)) || drives(&c, 1).await.is_err() {
        return Err(violation(
            "S1",
            "a Hello for another replica was taken".into(),
        ));
    }
    c.shutdown();
    Ok(())
}

/// Scenarios `spoofed-mesh-peer`, `idle-mesh-connections`, `mesh-connection-flood`, `mesh-trickle`.
async fn mesh_attack(name: &str, id: u64, v: Variant) -> Result<(), Failure> {
    let (mut m, first) = ManualReplica::first_listening(id, v).await?;
    let timely0: SocketAddr = format!("127.0.0.1:{}", m.timely[0])
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut held = Vec::new();
    if name == "spoofed-mesh-peer" {
        // Process 1's header, first; without the key.
        let mut s = first;
        s.write_all(&mesh_header(id, 1))
            .await
            .map_err(|e| e.to_string())?;
        if v == Variant::Authenticated {
            let mut answer = [0u8; 48];
            let _ = tokio::time::timeout(Duration::from_secs(3), s.read_exact(&mut answer)).await;
            let _ = s.write_all(&[0u8; 32]).await;
        }
        held.push(s);
    } else if name == "mesh-trickle" {
        // Peers that send the header a byte at a time, slower than
        // any per-read bound but never done.
        held.push(first);
        for _ in 1..8 {
            let s = dial(timely0).await?;
            held.push(s);
        }
        let mut trickling: Vec<TcpStream> = std::mem::take(&mut held);
        tokio::spawn(async move {
            for _ in 0..100 {
                for s in &mut trickling {
                    let _ = s.write_all(&[0x6c]).await;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
    } else {
        // More idle connections than the mesh handshakes at once.
        let n = if name == "mesh-connection-flood" {
            100
        } else {
            20
        };
        held.push(first);
        for _ in 1..n {
            held.push(dial(timely0).await?);
        }
    }
    m.spawn(1)?;
    let c = controller(&m.addrs()?);
    let result = tokio::time::timeout(Duration::from_secs(30), drives(&c, 0)).await;
    c.shutdown();
    drop(held);
    match result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(violation(
            "S1",
            format!("{name}: the real processes did not form a working replica: {e}"),
        )),
        Err(_) => Err(violation(
            "S1",
            format!("{name}: the real processes did not form a working replica within 30 s"),
        )),
    }
}

/// Scenarios `huge-length-prefix`, `large-pre-hello-frame`.
async fn pre_hello_frame(name: &str, id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let addr = ip_addr(&r.addrs.processes[0]);
    let answer = if name == "huge-length-prefix" {
        first_answer(addr, &(1u32 << 30).to_be_bytes()).await
    } else {
        let len: u32 = 60 << 20;
        let mut sock = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        sock.write_all(&len.to_be_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..60 {
            if sock.write_all(&zeros).await.is_err() {
                break;
            }
        }
        answer_on(sock).await
    };
    let rss = rss_mib(lockstep_chaos::pid_of(&r.orchestrator, 0).await?);
    if rss > 200.0 {
        return Err(violation(
            "S1",
            format!("{name}: process 0 grew to {rss:.0} MiB before any Hello"),
        ));
    }
    if let Some(a) = &answer {
        if !matches!(a.kind, ResponseKind::Error(_)) {
            return Err(violation("S1", format!("{name}: answered {a:?}")));
        }
    }
    drives(&c, 1).await.map_err(|e| {
        violation(
            "S1",
            format!("{name}: the controller no longer drives: {e}"),
        )
    })?;
    c.shutdown();
    Ok(())
}

/// Scenario `connection-flood`.
async fn connection_flood(id: u64, v: Variant) -> Result<(), Failure> {
    let r = start_replica(id, 2, v).await?;
    let c = controller(&r.addrs);
    drives(&c, 0).await?;
    let mut flood = Vec::new();
    for _ in 0..200 {
        if let Ok(s) = TcpStream::connect(ip_addr(&r.addrs.processes[0])).await {
            flood.push(s);
        }
    }
    let rss = rss_mib(lockstep_chaos::pid_of(&r.orchestrator, 0).await?);
    let result = drives(&c, 1).await;
    drop(flood);
    c.shutdown();
    if rss > 200.0 {
        return Err(violation(
            "S1",
            format!("a connection flood grew process 0 to {rss:.0} MiB"),
        ));
    }
    result.map_err(|e| {
        violation(
            "S1",
            format!("under a connection flood the controller no longer drives: {e}"),
        )
    })
}

/// Scenarios `api-without-token`, `api-wrong-token`, `api-with-metrics-token`.
async fn api_token_attack(name: &str, v: Variant) -> Result<(), Failure> {
    // On loopback: by default the API asks its token there too.
    let (mut env, state) = start_env(v).await?;
    // The read-only metrics token `lockstep serve` made (`open`
    // makes none: any other token stands for it).
    let metrics_token = match v {
        Variant::Open => "a-metrics-token-of-no-environment".to_string(),
        _ => metrics_token(state.path())?,
    };
    let token = match name {
        "api-wrong-token" => Some("a-wrong-but-long-token"),
        "api-with-metrics-token" => Some(metrics_token.as_str()),
        _ => None,
    };
    let mut client = api(&env.url, token).await?;
    let r = client
        .list_replicas(proto::ListReplicasRequest::default())
        .await;
    let _ = env.kill().await;
    if code_is(r, tonic::Code::Unauthenticated) {
        Ok(())
    } else {
        Err(violation("S1", format!("{name}: the API served the call")))
    }
}

/// Scenarios `oversized-shape`, `oversized-plan`.
async fn oversized_request(name: &str, v: Variant) -> Result<(), Failure> {
    let (mut env, _state) = start_env(v).await?;
    let mut client = api(&env.url, env.token.as_deref()).await?;
    let refused = if name == "oversized-shape" {
        code_is(
            client
                .create_replica(proto::CreateReplicaRequest {
                    name: "huge".into(),
                    processes: 10_000,
                    workers_per_process: 1_000_000,
                    config: String::new(),
                })
                .await,
            tonic::Code::InvalidArgument,
        )
    } else {
        client
            .create_replica(proto::CreateReplicaRequest {
                name: "r".into(),
                processes: 1,
                workers_per_process: 1,
                config: String::new(),
            })
            .await
            .map_err(|e| format!("creating a replica: {e}"))?;
        let mut plan = Plan::Get { collection_id: 1 };
        for _ in 0..48 {
            plan = Plan::Filter {
                input: Box::new(plan),
                predicates: vec![],
            };
        }
        code_is(
            client
                .create_dataflow(proto::CreateDataflowRequest {
                    replica: "r".into(),
                    name: "deep".into(),
                    inputs: vec![1],
                    exports: vec![lockstep_protocol::proto::Export {
                        collection_id: 101,
                        description: lockstep_plan::encode(&plan),
                    }],
                    as_of: 0,
                    format: String::new(),
                })
                .await,
            tonic::Code::InvalidArgument,
        )
    };
    let _ = env.kill().await;
    let _ = kill_all_services(&_state.path().join("orchestrator"));
    if refused {
        Ok(())
    } else {
        Err(violation(
            "S1",
            format!("{name} was not refused with INVALID_ARGUMENT"),
        ))
    }
}
