//! The client commands about replicas (`lockstep replica ...`, `lockstep
//! status`): listing, creating (with `--wait`), dropping, and their table
//! and JSON output.

use super::*;

#[derive(Subcommand)]
pub(crate) enum ReplicaCommand {
    /// Create a replica.
    Create {
        /// Its unique name.
        name: String,
        /// OS processes.
        #[arg(long, default_value_t = 1)]
        processes: u32,
        /// Workers per process.
        #[arg(long, default_value_t = 1)]
        workers: u32,
        /// Free-form configuration for the replica: its processes get it in
        /// LOCKSTEP_REPLICA_CONFIG, and a family binary made with
        /// `Builder::family_from_config` reads it (docs/embedding.md).
        #[arg(long, default_value = "")]
        config: String,
        /// Wait until the replica serves: every process connected to its
        /// controller and answering (grpc.health.v1 `replica/NAME` SERVING).
        /// Exit 1 if it does not within --timeout.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits, in seconds.
        #[arg(long, default_value_t = 60, value_name = "SECONDS", requires = "wait")]
        timeout: u64,
    },
    /// Restart every process of a replica as one new generation, on the
    /// program its service names. The replica rehydrates (its dataflows
    /// are built again); the catalog does not change.
    Restart {
        /// Its name.
        name: String,
        /// Wait until the replica serves again; exit 1 if it does not
        /// within --timeout.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits, in seconds.
        #[arg(long, default_value_t = 60, value_name = "SECONDS", requires = "wait")]
        timeout: u64,
    },
    /// Move a replica's processes to a new build, in place: put the new
    /// lockstep-replica at the program path the environment runs replicas
    /// from (`lockstep serve --service-binary`; replace the file by a
    /// rename, it is running), then run this. It restarts every process
    /// (`replica restart`), waits until the replica serves, and checks that
    /// every process reports build VERSION. Prints the builds before and
    /// after and how long the replica was down (restart to serving). Exit 1
    /// if a process reports another build (the binary was not replaced) or
    /// the replica does not serve within --timeout.
    ///
    /// With --keep-answering the replica's reads are answered throughout:
    /// the environment first starts a standby generation on the new build,
    /// lets it catch up and answer the replica's peeks while the replica's
    /// processes restart and catch up, then drops it (subscriptions stay
    /// with the replica and resume after the restart). Prints how long the
    /// standby answered reads instead of a downtime.
    Upgrade {
        /// Its name.
        name: String,
        /// The build every process must report afterwards (default: this
        /// lockstep's own version).
        #[arg(long, value_name = "VERSION")]
        to: Option<String>,
        /// How long to wait for the replica to serve and report, in seconds.
        #[arg(long, default_value_t = 120, value_name = "SECONDS")]
        timeout: u64,
        /// Keep reads answered: a standby generation serves them during the
        /// restart.
        #[arg(long)]
        keep_answering: bool,
    },
    /// Give a replica another shape without refusing a read: the
    /// environment starts a standby generation of the old shape, lets it
    /// catch up and answer the replica's peeks while the replica's
    /// processes are replaced by PROCESSES processes of WORKERS workers and
    /// catch up, then drops it. Writes go on throughout; subscriptions stay
    /// with the replica and resume after the replacement. Prints the shapes
    /// and how long the standby answered reads.
    Resize {
        /// Its name.
        name: String,
        /// The new number of processes (1 to 64).
        #[arg(long)]
        processes: u32,
        /// The new number of workers per process (1 to 64).
        #[arg(long)]
        workers: u32,
    },
    /// Drop a replica.
    Drop {
        /// Its name.
        name: String,
    },
    /// List replicas and their processes.
    ///
    /// `-o json`: `{"replicas": [{"id", "name", "processes",
    /// "workers_per_process", "config", "service" (null: none yet),
    /// "service_epoch", "read_holds", "read_hold_span" (open read holds on
    /// its inputs, and the timestamps by which they keep a since back),
    /// "live_dataflows", "dataflows_caught_up" (its dataflows, and those
    /// caught up with the writes to their inputs; null without a
    /// controller), "reconfiguration" (null, or the upgrade or resize under
    /// way: {"kind", "phase", "target_processes",
    /// "target_workers_per_process", "elapsed_ms", "phase_elapsed_ms",
    /// "standby_frontier_lag", "standby_dataflows_caught_up",
    /// "estimated_ms_left"}),
    /// "process_status": [{"index", "pid" (null: none, a
    /// pod), "running", "restarts", "addresses": {NAME: "HOST:PORT"},
    /// "metrics_url",
    /// "frontier_lag", "protocol_version", "build_version" (null: not
    /// known)}]}]}`.
    List {
        #[command(flatten)]
        output: OutputArg,
    },
}

/// Every replica, page by page.
pub(crate) async fn all_replicas(client: &mut Client) -> anyhow::Result<Vec<proto::Replica>> {
    let mut all = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_replicas(proto::ListReplicasRequest {
                page_size: 1000,
                page_token,
            })
            .await
            .map_err(status_err)?
            .into_inner();
        all.extend(page.replicas);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}

/// `lockstep status`.
pub(crate) async fn status_summary(server: ServerArg, output: OutputArg) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::HealthCheckRequest;
    let mut client = connect(&server).await?;
    let status = client
        .get_status(proto::GetStatusRequest {})
        .await
        .map_err(status_err)?
        .into_inner();
    let replicas = all_replicas(&mut client).await?;
    let mut health = connect_health(&server).await?;
    let mut rows = Vec::new();
    for r in &replicas {
        // The health status's name, or None: not checked yet; Err: unknown.
        let serving: Result<Option<ServingStatus>, String> = match health
            .check(HealthCheckRequest {
                service: format!("replica/{}", r.name),
            })
            .await
        {
            Ok(h) => Ok(Some(h.into_inner().status())),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(s.message().to_string()),
        };
        rows.push((r, serving));
    }
    let running = |r: &proto::Replica| r.process_status.iter().filter(|p| p.running).count();
    let restarts = |r: &proto::Replica| r.process_status.iter().map(|p| p.restarts).sum::<u32>();
    if output.json() {
        let replicas: Vec<serde_json::Value> = rows
            .iter()
            .map(|(r, serving)| {
                let serving = match serving {
                    Ok(Some(s)) => Some(s.as_str_name()),
                    Ok(None) => None,
                    Err(_) => Some("UNKNOWN"),
                };
                serde_json::json!({
                    "name": r.name,
                    "id": r.id,
                    "processes": r.processes,
                    "workers_per_process": r.workers_per_process,
                    "running": running(r),
                    "restarts": restarts(r),
                    "frontier_lag": r.process_status.iter().map(|p| p.frontier_lag).collect::<Vec<_>>(),
                    "read_holds": r.read_holds,
                    "read_hold_span": r.read_hold_span,
                    "live_dataflows": r.live_dataflows,
                    "dataflows_caught_up": r.dataflows_caught_up,
                    "reconfiguration": r.reconfiguration.as_ref().map(|c| &c.phase),
                    "serving": serving,
                })
            })
            .collect();
        return print_json(&serde_json::json!({
            "server": server.url,
            "epoch": status.epoch,
            "orphan_rule": status.orphan_rule,
            "format": (!status.format.is_empty()).then_some(&status.format),
            "orphans_removed": status.orphans_removed,
            "reconfigurations_settled": status.reconfigurations_settled,
            "replicas": replicas,
        }));
    }
    // "" from an environment older than the field, which says nothing.
    let format = if status.format.is_empty() {
        "(not reported)".to_string()
    } else {
        status.format.clone()
    };
    println!(
        "environment {}: epoch {}, orphan rule {}, format {}, {} replica(s)",
        server.url,
        status.epoch,
        status.orphan_rule,
        format,
        replicas.len()
    );
    let mut table = Table::new(&[
        ("REPLICA", Align::Left),
        ("ID", Align::Right),
        ("SHAPE", Align::Right),
        ("RUNNING", Align::Right),
        ("RESTARTS", Align::Right),
        ("LAG", Align::Right),
        ("HOLDS", Align::Right),
        ("CAUGHT UP", Align::Right),
        ("SERVING", Align::Left),
    ]);
    for (r, serving) in &rows {
        let serving = match serving {
            Ok(Some(ServingStatus::Serving)) => "yes".to_string(),
            Ok(Some(ServingStatus::NotServing)) => "no".to_string(),
            Ok(Some(other)) => format!("{other:?}").to_lowercase(),
            Ok(None) => "not checked yet".to_string(),
            Err(m) => format!("unknown ({m})"),
        };
        // Per process, comma-separated; `?` where it is not known.
        let lag = r
            .process_status
            .iter()
            .map(|p| p.frontier_lag.map_or("?".to_string(), |l| l.to_string()))
            .collect::<Vec<_>>()
            .join(",");
        table.row(vec![
            r.name.clone(),
            r.id.to_string(),
            format!("{}x{}", r.processes, r.workers_per_process),
            format!("{}/{}", running(r), r.processes),
            restarts(r).to_string(),
            lag,
            // Open read holds, and the span they keep a since back.
            match r.read_holds {
                0 => "0".to_string(),
                n => format!("{n} ({} behind)", r.read_hold_span),
            },
            // Its dataflows caught up with the writes, of its live ones.
            match (r.dataflows_caught_up, r.live_dataflows) {
                (Some(c), Some(n)) => format!("{c}/{n}"),
                _ => "?".to_string(),
            },
            serving,
        ]);
    }
    table.print();
    for line in &status.reconfigurations_settled {
        println!("settled at start: {line}");
    }
    for (r, _) in &rows {
        if let Some(c) = &r.reconfiguration {
            println!("{}: {}", r.name, reconfiguration_line(r, c));
        }
    }
    Ok(())
}

pub(crate) async fn client(server: ServerArg, command: ReplicaCommand) -> anyhow::Result<()> {
    let mut client = connect(&server).await?;
    match command {
        ReplicaCommand::Create {
            name,
            processes,
            workers,
            config,
            wait,
            timeout,
        } => {
            let r = client
                .create_replica(proto::CreateReplicaRequest {
                    name: name.clone(),
                    processes,
                    workers_per_process: workers,
                    config,
                })
                .await
                .map_err(status_err)?
                .into_inner();
            if let Some(r) = r.replica {
                println!("created replica {} (id {})", r.name, r.id);
                print_processes(&r);
            }
            if wait {
                let took =
                    wait_serving(&server, &name, std::time::Duration::from_secs(timeout)).await?;
                println!("replica {name} serving after {:.1} s", took.as_secs_f64());
            }
        }
        ReplicaCommand::Restart {
            name,
            wait,
            timeout,
        } => {
            let answer = restart(&mut client, &name, false).await?;
            let r = replica_of(&answer)?;
            println!("restarted replica {} (id {})", r.name, r.id);
            print_processes(r);
            if wait {
                let took =
                    wait_serving(&server, &name, std::time::Duration::from_secs(timeout)).await?;
                println!("replica {name} serving after {:.1} s", took.as_secs_f64());
            }
        }
        ReplicaCommand::Upgrade {
            name,
            to,
            timeout,
            keep_answering,
        } => {
            let to = to.unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string());
            let before = builds(&find_replica(&mut client, &name).await?);
            let started = std::time::Instant::now();
            let timeout = std::time::Duration::from_secs(timeout);
            let answered = with_progress(
                &client,
                &name,
                restart(&mut client.clone(), &name, keep_answering),
            )
            .await?;
            let restarted = replica_of(&answered)?;
            let pids: Vec<u32> = restarted.process_status.iter().map(|p| p.pid).collect();
            let after = loop {
                let r = find_replica(&mut client, &name).await?;
                let now: Vec<u32> = r.process_status.iter().map(|p| p.pid).collect();
                let known = r
                    .process_status
                    .iter()
                    .all(|p| p.protocol_version.is_some());
                if known && now == pids && !pids.is_empty() {
                    let wrong: Vec<String> = r
                        .process_status
                        .iter()
                        .filter(|p| p.build_version.as_deref() != Some(to.as_str()))
                        .map(|p| format!("process {} reports {}", p.index, build_of(p)))
                        .collect();
                    if !wrong.is_empty() {
                        anyhow::bail!(
                            "replica {name} restarted, but not on build {to}: {}; put the new lockstep-replica at the path the environment runs replicas from (lockstep serve --service-binary) and run this again",
                            wrong.join(", ")
                        );
                    }
                    wait_serving(&server, &name, timeout.saturating_sub(started.elapsed())).await?;
                    break builds(&r);
                }
                if started.elapsed() >= timeout {
                    anyhow::bail!(
                        "replica {name} serves, but not every process reported its version within {} s",
                        timeout.as_secs()
                    );
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            };
            if keep_answering {
                println!(
                    "replica {name} upgraded: {before} -> {after}; reads answered throughout (standby caught up after {:.2} s, answered the replica's reads for {:.2} s)",
                    answered.standby_ready_ms as f64 / 1000.0,
                    answered.standby_served_ms as f64 / 1000.0
                );
            } else {
                let down = started.elapsed();
                println!(
                    "replica {name} upgraded: {before} -> {after}; down {:.2} s (restart to serving)",
                    down.as_secs_f64()
                );
            }
        }
        ReplicaCommand::Resize {
            name,
            processes,
            workers,
        } => {
            let before = find_replica(&mut client, &name).await?;
            let request = proto::ResizeReplicaRequest {
                name: name.clone(),
                processes,
                workers_per_process: workers,
            };
            let answered = with_progress(&client, &name, client.clone().resize_replica(request))
                .await
                .map_err(status_err)?
                .into_inner();
            let after = answered
                .replica
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("ResizeReplica answered without the replica"))?;
            println!(
                "replica {name} resized: {}x{} -> {}x{} (processes x workers); reads answered throughout (standby caught up after {:.2} s, answered the replica's reads for {:.2} s)",
                before.processes,
                before.workers_per_process,
                after.processes,
                after.workers_per_process,
                answered.standby_ready_ms as f64 / 1000.0,
                answered.standby_served_ms as f64 / 1000.0
            );
        }
        ReplicaCommand::Drop { name } => {
            let r = client
                .drop_replica(proto::DropReplicaRequest { name: name.clone() })
                .await
                .map_err(status_err)?
                .into_inner();
            println!("dropped replica {name} (id {})", r.id);
        }
        ReplicaCommand::List { output } => {
            let replicas = all_replicas(&mut client).await?;
            if output.json() {
                let replicas: Vec<serde_json::Value> = replicas.iter().map(replica_json).collect();
                return print_json(&serde_json::json!({ "replicas": replicas }));
            }
            let mut table = Table::new(&[
                ("ID", Align::Right),
                ("NAME", Align::Left),
                ("PROCESSES", Align::Right),
                ("WORKERS", Align::Right),
                ("SERVICE", Align::Left),
                ("EPOCH", Align::Right),
            ]);
            for r in &replicas {
                let service = if r.service.is_empty() {
                    "-"
                } else {
                    &r.service
                };
                table.row(vec![
                    r.id.to_string(),
                    r.name.clone(),
                    r.processes.to_string(),
                    r.workers_per_process.to_string(),
                    service.to_string(),
                    r.service_epoch.to_string(),
                ]);
            }
            // Each replica's line, then its processes' lines.
            let lines = table.lines();
            println!("{}", lines[0]);
            for (line, r) in lines[1..].iter().zip(&replicas) {
                println!("{line}");
                print_processes(r);
            }
        }
    }
    Ok(())
}

/// Restarts replica `name` (RestartReplica, keeping its reads answered if
/// `keep_answering`).
async fn restart(
    client: &mut Client,
    name: &str,
    keep_answering: bool,
) -> anyhow::Result<proto::RestartReplicaResponse> {
    Ok(client
        .restart_replica(proto::RestartReplicaRequest {
            name: name.to_string(),
            keep_answering,
        })
        .await
        .map_err(status_err)?
        .into_inner())
}

/// Runs `call`, printing replica `name`'s reconfiguration on stderr once a
/// second meanwhile ([`reconfiguration_line`]), while ListReplicas shows
/// one.
async fn with_progress<T>(
    client: &Client,
    name: &str,
    call: impl std::future::Future<Output = T>,
) -> T {
    let mut poller = client.clone();
    let progress = async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            if let Ok(r) = find_replica(&mut poller, name).await {
                if let Some(c) = &r.reconfiguration {
                    eprintln!("{name}: {}", reconfiguration_line(&r, c));
                }
            }
        }
    };
    tokio::select! {
        out = call => out,
        never = progress => never,
    }
}

/// The replica as RestartReplica restarted it.
fn replica_of(answer: &proto::RestartReplicaResponse) -> anyhow::Result<&proto::Replica> {
    answer
        .replica
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("RestartReplica answered without the replica"))
}

/// Replica `name` as ListReplicas shows it.
async fn find_replica(client: &mut Client, name: &str) -> anyhow::Result<proto::Replica> {
    all_replicas(client)
        .await?
        .into_iter()
        .find(|r| r.name == name)
        .ok_or_else(|| anyhow::anyhow!("no replica named {name}"))
}

/// What a process reports of its build.
fn build_of(p: &proto::ReplicaProcess) -> String {
    match (p.protocol_version, &p.build_version) {
        (Some(v), Some(b)) => format!("build {b} (protocol {v})"),
        (Some(v), None) => format!("no build version (protocol {v})"),
        (None, _) => "nothing yet".to_string(),
    }
}

/// The builds a replica's processes report, as one phrase.
fn builds(r: &proto::Replica) -> String {
    let mut all: Vec<String> = r.process_status.iter().map(build_of).collect();
    all.dedup();
    all.join(", ")
}

/// Waits (bounded by `timeout`) until replica `name` serves: its
/// grpc.health.v1 status `replica/NAME` is SERVING (its controller reached
/// every process). Returns how long that took.
pub(crate) async fn wait_serving(
    server: &ServerArg,
    name: &str,
    timeout: std::time::Duration,
) -> anyhow::Result<std::time::Duration> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::HealthCheckRequest;
    let started = std::time::Instant::now();
    let mut health = connect_health(server).await?;
    let mut last = "not checked yet".to_string();
    let mut shown = started;
    loop {
        match health
            .check(HealthCheckRequest {
                service: format!("replica/{name}"),
            })
            .await
        {
            Ok(h) if h.get_ref().status() == ServingStatus::Serving => return Ok(started.elapsed()),
            Ok(h) => last = h.into_inner().status().as_str_name().to_string(),
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => return Err(status_err(s)),
        }
        if started.elapsed() >= timeout {
            anyhow::bail!(
                "replica {name} did not serve within {} s (health: {last})",
                timeout.as_secs()
            );
        }
        // Progress, once a second, on stderr.
        if shown.elapsed() >= std::time::Duration::from_secs(1) {
            shown = std::time::Instant::now();
            eprintln!(
                "{name}: waiting to serve ({:.0} s of {} s; health: {last})",
                started.elapsed().as_secs_f64(),
                timeout.as_secs()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A replica in the JSON of `lockstep replica list -o json`.
pub(crate) fn replica_json(r: &proto::Replica) -> serde_json::Value {
    let processes: Vec<serde_json::Value> = r
        .process_status
        .iter()
        .map(|p| {
            serde_json::json!({
                "index": p.index,
                "pid": (p.pid != 0).then_some(p.pid),
                "running": p.running,
                "restarts": p.restarts,
                "addresses": p.addresses.iter().collect::<std::collections::BTreeMap<_, _>>(),
                "metrics_url": p.metrics_url,
                "frontier_lag": p.frontier_lag,
                "protocol_version": p.protocol_version,
                "build_version": p.build_version,
            })
        })
        .collect();
    serde_json::json!({
        "id": r.id,
        "name": r.name,
        "processes": r.processes,
        "workers_per_process": r.workers_per_process,
        "config": r.config,
        "service": (!r.service.is_empty()).then_some(&r.service),
        "service_epoch": r.service_epoch,
        "read_holds": r.read_holds,
        "read_hold_span": r.read_hold_span,
        "live_dataflows": r.live_dataflows,
        "dataflows_caught_up": r.dataflows_caught_up,
        "reconfiguration": r.reconfiguration.as_ref().map(|c| serde_json::json!({
            "kind": c.kind,
            "phase": c.phase,
            "target_processes": c.target_processes,
            "target_workers_per_process": c.target_workers_per_process,
            "elapsed_ms": c.elapsed_ms,
            "phase_elapsed_ms": c.phase_elapsed_ms,
            "standby_frontier_lag": c.standby_frontier_lag,
            "standby_dataflows_caught_up": c.standby_dataflows_caught_up,
            "estimated_ms_left": c.estimated_ms_left,
        })),
        "process_status": processes,
    })
}

/// One line on a reconfiguration of replica `r` under way: what, where,
/// how long, how far each generation has caught up, and the estimate.
pub(crate) fn reconfiguration_line(
    r: &proto::Replica,
    c: &proto::ReplicaReconfiguration,
) -> String {
    let of = |n: Option<u32>| {
        let total = r
            .live_dataflows
            .map_or_else(|| "?".to_string(), |t| t.to_string());
        format!(
            "{}/{total}",
            n.map_or_else(|| "?".to_string(), |n| n.to_string())
        )
    };
    let lag = c
        .standby_frontier_lag
        .map_or_else(|| "?".to_string(), |l| l.to_string());
    let left = c
        .estimated_ms_left
        .map(|ms| format!(", about {:.1} s left", ms as f64 / 1000.0))
        .unwrap_or_default();
    format!(
        "{} to {}x{}: {} ({:.1} s, {:.1} s in all); dataflows caught up: standby {}, replica {}; standby lag {lag}{left}",
        c.kind,
        c.target_processes,
        c.target_workers_per_process,
        c.phase,
        c.phase_elapsed_ms as f64 / 1000.0,
        c.elapsed_ms as f64 / 1000.0,
        of(c.standby_dataflows_caught_up),
        of(r.dataflows_caught_up),
    )
}

pub(crate) fn print_processes(r: &proto::Replica) {
    if let Some(c) = &r.reconfiguration {
        println!("  reconfiguring: {}", reconfiguration_line(r, c));
    }
    for p in &r.process_status {
        let addrs: Vec<String> = p
            .addresses
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        // The agreed protocol version and the build, once the process
        // answered this session's Hello (the build from version 3 on).
        let version = match (p.protocol_version, &p.build_version) {
            (Some(v), Some(b)) => format!(" protocol {v} build {b}"),
            (Some(v), None) => format!(" protocol {v}"),
            (None, _) => String::new(),
        };
        println!(
            "    process {} pid {} {} restarts {} {}{version}",
            p.index,
            p.pid,
            if p.running { "running" } else { "down" },
            p.restarts,
            addrs.join(" ")
        );
    }
}
