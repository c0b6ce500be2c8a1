//! Serving the gRPC API: health (the server and each replica), reflection,
//! the token check, TLS, per-RPC metrics, bounded acceptance, and the
//! graceful shutdown; and the replica health loop.

use super::*;

/// Why [`Environment::serve_until`] stops serving.
#[derive(Clone, Copy, Debug)]
enum Stop {
    /// Another controller took over (O3).
    Halted,
    /// The caller's shutdown signal.
    Shutdown,
}

impl Environment {
    /// Step 4: serves the gRPC API on `listener` until this environment
    /// halts, which is returned as [`EnvError::Halted`]. In-flight requests
    /// are answered before it returns.
    pub async fn serve(self: Arc<Self>, listener: tokio::net::TcpListener) -> Result<(), EnvError> {
        self.serve_with(listener, None).await
    }

    /// [`serve`](Self::serve), with TLS when `tls` is given.
    pub async fn serve_with(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> Result<(), EnvError> {
        self.serve_until(listener, None, tls, std::future::pending(), HALT_GRACE)
            .await
    }

    /// [`serve_with`](Self::serve_with) until `shutdown` resolves (the
    /// `lockstep` binary: SIGTERM or SIGINT), then shuts down gracefully:
    ///
    /// 1. grpc.health.v1 says NOT_SERVING at once, for the server (`""`)
    ///    and the API service, so a watch or a probe sees it;
    /// 2. the listener closes (a new connection is refused) and every open
    ///    connection is told to go away (HTTP/2 GOAWAY: a call the client
    ///    sent before it learnt that is still served, a later one is refused);
    /// 3. calls in flight get up to `grace` to finish; whatever is still open
    ///    then is cut;
    /// 4. it returns `Ok(())`. Replica processes (or pods) are left running,
    ///    for the next environment to adopt.
    ///
    /// A halt still returns [`EnvError::Halted`], after [`HALT_GRACE`].
    ///
    /// With `local`, the same API (the same token check) is also served on
    /// that Unix socket, to peers of this user or root only: a client that
    /// finds it in the state directory knows whom it talks to before it
    /// sends the token.
    pub async fn serve_until(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        local: Option<tokio::net::UnixListener>,
        tls: Option<tonic::transport::ServerTlsConfig>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
        grace: std::time::Duration,
    ) -> Result<(), EnvError> {
        // Bounded acceptance (`listeners`, R1): a small pool of unproven
        // connections with one handshake deadline (the oldest closed
        // first), proven slots only for a request whose credential was
        // checked, an accept loop that backs off on EMFILE and never ends.
        // TCP_NODELAY is set on each (without it a small response waits for
        // the client's delayed ACK).
        let incoming = tokio_stream::wrappers::ReceiverStream::new(listeners::accept(
            listener,
            listeners::api_pool(&self.metrics()),
            listeners::unproven_read_bytes(),
        ));
        let logger = self.log_service_events();
        // grpc.health.v1: the API, and each replica as `replica/NAME`,
        // serving while it answers a ping (a replica's status to a token
        // holder only: `health`). Open to token-less callers: requests of a
        // few bytes only.
        let (health, _) = tonic_health::server::health_reporter();
        let open_limit = listeners::open_max_request_bytes();
        let health_service =
            tonic_health::pb::health_server::HealthServer::new(crate::health::HealthGate::new(
                tonic_health::server::HealthService::from_health_reporter(health.clone()),
                self.api_token.as_deref().map(server::TokenCheck::new),
            ))
            .max_decoding_message_size(open_limit);
        health
            .set_serving::<proto::environment_server::EnvironmentServer<server::EnvironmentService>>()
            .await;
        self.api_serving
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let checker = tokio::spawn(self.clone().report_replica_health(health.clone()));
        let (stopper, stop_rx) = self.spawn_stopper(health, shutdown, grace);
        let stopped = |mut rx: tokio::sync::watch::Receiver<Option<Stop>>| async move {
            let why = rx.wait_for(Option::is_some).await.map(|why| *why);
            match why {
                Ok(Some(why)) => why,
                // The stopper ended without a reason: never.
                _ => std::future::pending().await,
            }
        };
        let shutdown = {
            let rx = stop_rx.clone();
            futures::FutureExt::shared(Box::pin(async move {
                stopped(rx).await;
            }))
        };
        // Server reflection, v1 and v1alpha, over the API, the compute
        // protocol and the health service.
        let reflection_v1 = reflection()
            .build_v1()
            .expect("the built-in descriptor sets decode")
            .max_decoding_message_size(open_limit);
        let reflection_v1alpha = reflection()
            .build_v1alpha()
            .expect("the built-in descriptor sets decode")
            .max_decoding_message_size(open_limit);
        // With a token, every API call must carry it; health (but a
        // replica's) and reflection stay open (they say nothing about the
        // replicas).
        let service = server::EnvironmentService::new(self.clone());
        let (open, guarded) = match &self.api_token {
            None => (Some(service.into_server()), None),
            Some(token) => (
                None,
                Some(tonic::service::interceptor::InterceptedService::new(
                    service.into_server(),
                    server::TokenCheck::new(token),
                )),
            ),
        };
        // Per connection: a bounded number of concurrent streams and calls,
        // and HTTP/2 keepalive so that dead peers are found.
        let builder = || {
            tonic::transport::Server::builder()
                .initial_connection_window_size(listeners::API_CONNECTION_WINDOW)
                .initial_stream_window_size(listeners::API_CONNECTION_WINDOW)
                .max_concurrent_streams(Some(API_MAX_STREAMS))
                .concurrency_limit_per_connection(API_MAX_STREAMS as usize)
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        };
        // Without a token every call proves its connection (there is no
        // credential to check); with one, only the token check does.
        let open_api = self.api_token.is_none();
        let metrics = self.metrics();
        let routes = |builder: tonic::transport::Server| {
            builder
                .layer(tower::util::MapRequestLayer::new(log_call))
                .layer(tower::util::MapRequestLayer::new(
                    move |request: http::Request<tonic::body::Body>| {
                        if open_api {
                            listeners::prove_request(request.extensions());
                        }
                        request
                    },
                ))
                .layer(rpc_metrics::RpcMetricsLayer::new(metrics.clone()))
                .add_optional_service(open.clone())
                .add_optional_service(guarded.clone())
                .add_service(health_service.clone())
                .add_service(reflection_v1.clone())
                .add_service(reflection_v1alpha.clone())
        };
        let local_server = local.map(|local| {
            routes(builder()).serve_with_incoming_shutdown(
                tokio_stream::wrappers::ReceiverStream::new(listeners::accept_local(local)),
                shutdown.clone(),
            )
        });
        let mut tcp = builder();
        if let Some(tls) = tls {
            tcp = tcp
                .tls_config(tls)
                .map_err(|e| EnvError::Orchestrator(format!("TLS configuration: {e}")))?;
        }
        let tcp_server = routes(tcp).serve_with_incoming_shutdown(incoming, shutdown);
        let server = async move {
            match local_server {
                Some(local_server) => tokio::try_join!(tcp_server, local_server).map(|_| ()),
                None => tcp_server.await,
            }
        };
        // Once halted or shut down, in-flight requests get a bounded grace
        // period.
        let grace = async move {
            let bound = match stopped(stop_rx).await {
                Stop::Halted => HALT_GRACE,
                Stop::Shutdown => grace,
            };
            tokio::time::sleep(bound).await;
        };
        let result = tokio::select! {
            r = server => r.map_err(|e| EnvError::Orchestrator(format!("gRPC server failed: {e}"))),
            () = grace => {
                tracing::warn!("the grace period ended with calls still open; they are cut");
                Ok(())
            }
        };
        logger.abort();
        checker.abort();
        stopper.abort();
        result?;
        match self.halted() {
            Some(reason) => Err(EnvError::Halted(reason)),
            None => Ok(()),
        }
    }
}

impl Environment {
    /// Logs every service event (crashes, restarts) while the API serves;
    /// the task ends when the orchestrator's event stream does.
    fn log_service_events(&self) -> tokio::task::JoinHandle<()> {
        let mut events = self.orchestrator.watch_services();
        tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match events.recv().await {
                    Ok(e) => {
                        tracing::info!(service = %e.service, process = ?e.process, event = ?e.kind, "service event")
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::warn!("{n} service events were not logged")
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        })
    }

    /// What stops the server: a halt, or `shutdown` (health turns
    /// NOT_SERVING first). The receiver says which, once one happened.
    fn spawn_stopper(
        self: &Arc<Self>,
        health: tonic_health::server::HealthReporter,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
        grace: std::time::Duration,
    ) -> (
        tokio::task::JoinHandle<()>,
        tokio::sync::watch::Receiver<Option<Stop>>,
    ) {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(None::<Stop>);
        let me = self.clone();
        let stopper = tokio::spawn(async move {
            let why = tokio::select! {
                _ = me.wait_halted() => Stop::Halted,
                () = shutdown => {
                    me.api_serving.store(false, std::sync::atomic::Ordering::Relaxed);
                    health
                        .set_not_serving::<proto::environment_server::EnvironmentServer<server::EnvironmentService>>()
                        .await;
                    health
                        .set_service_status("", tonic_health::ServingStatus::NotServing)
                        .await;
                    tracing::info!(grace = ?grace, "shutting down: health NOT_SERVING, no new calls, in-flight calls get the grace period");
                    Stop::Shutdown
                }
            };
            let _ = stop_tx.send(Some(why));
        });
        (stopper, stop_rx)
    }
}

/// Server reflection over the API, the compute protocol and the health
/// service (built once for v1, once for v1alpha).
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

impl Environment {
    /// What the read holds on replica `replica_id`'s inputs keep back.
    pub fn read_holds(&self, replica_id: u64) -> crate::HoldsReport {
        self.inputs.lock().expect("poisoned").holds_of(replica_id)
    }

    /// The controller of the replica named `name`, if one runs.
    pub fn replica_controller(&self, name: &str) -> Option<lockstep_controller::Controller> {
        let id = self
            .view
            .lock()
            .expect("poisoned")
            .replicas
            .values()
            .find(|r| r.name == name)?
            .id;
        self.compute.controller(id)
    }

    /// The environment's metrics (served by `lockstep serve --metrics-listen`).
    pub fn metrics(&self) -> Arc<metrics::Metrics> {
        self.compute.metrics()
    }

    /// Every [`HEALTH_INTERVAL`], sets each replica's health (`replica/NAME`)
    /// to SERVING if its controller answered a ping within the interval,
    /// NOT_SERVING otherwise; a dropped replica's status is cleared.
    async fn report_replica_health(
        self: Arc<Self>,
        mut health: tonic_health::server::HealthReporter,
    ) {
        use tonic_health::ServingStatus;
        // Health service name -> (replica name, processes).
        let mut known: std::collections::BTreeMap<String, (String, u32)> = Default::default();
        loop {
            let replicas: Vec<Replica> = self
                .view
                .lock()
                .expect("poisoned")
                .replicas
                .values()
                .cloned()
                .collect();
            let mut now = std::collections::BTreeMap::new();
            for r in replicas {
                let controller = self.compute.controller(r.id);
                let answered = match &controller {
                    Some(c) => matches!(
                        tokio::time::timeout(HEALTH_INTERVAL, c.ping()).await,
                        Ok(Ok(()))
                    ),
                    None => false,
                };
                let lags = match &controller {
                    Some(c) => tokio::time::timeout(HEALTH_INTERVAL, c.process_lags())
                        .await
                        .ok()
                        .and_then(Result::ok),
                    None => None,
                }
                .unwrap_or_else(|| vec![None; r.config.processes as usize]);
                let name = crate::health::replica_service(&r.name);
                let status = if answered {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                health.set_service_status(&name, status).await;
                now.insert(name, (r.name.clone(), r.config.processes));
                let metrics = self.metrics();
                let label = metrics::ReplicaLabel {
                    replica: r.name.clone(),
                };
                metrics.serving.get_or_create(&label).set(answered as i64);
                for (i, lag) in lags.into_iter().enumerate() {
                    let labels = metrics::ProcessLabels {
                        replica: r.name.clone(),
                        process: i.to_string(),
                    };
                    match lag {
                        Some(lag) => {
                            metrics
                                .frontier_lag
                                .get_or_create(&labels)
                                .set(i64::try_from(lag).unwrap_or(i64::MAX));
                        }
                        None => {
                            metrics.frontier_lag.remove(&labels);
                        }
                    }
                }
                metrics
                    .stored_updates
                    .get_or_create(&label)
                    .set(self.inputs.lock().expect("poisoned").stored_updates(r.id) as i64);
                let holds = self.read_holds(r.id);
                metrics
                    .read_holds
                    .get_or_create(&label)
                    .set(holds.holds as i64);
                metrics
                    .read_hold_span
                    .get_or_create(&label)
                    .set(i64::try_from(holds.held_span).unwrap_or(i64::MAX));
                let dataflows = self
                    .view
                    .lock()
                    .expect("poisoned")
                    .dataflows
                    .values()
                    .filter(|d| d.replica_id == r.id)
                    .count();
                metrics
                    .dataflows
                    .get_or_create(&label)
                    .set(dataflows as i64);
                let reconfiguration =
                    tokio::time::timeout(HEALTH_INTERVAL, self.reconfiguration(r.id))
                        .await
                        .ok()
                        .flatten();
                let own = match (&reconfiguration, &controller) {
                    (Some(rs), _) => rs.own_caught_up,
                    (None, Some(c)) => tokio::time::timeout(HEALTH_INTERVAL, c.caught_up())
                        .await
                        .ok()
                        .and_then(Result::ok),
                    (None, None) => None,
                };
                metrics.caught_up(&r.name, "own", own.map(|c| c.caught_up));
                metrics.caught_up(
                    &r.name,
                    "standby",
                    reconfiguration
                        .as_ref()
                        .and_then(|rs| rs.standby_caught_up)
                        .map(|c| c.caught_up),
                );
                metrics.reconfiguring(
                    &r.name,
                    reconfiguration
                        .as_ref()
                        .map(|rs| rs.reconfiguration.phase.name()),
                );
            }
            for (gone, (replica, processes)) in &known {
                if !now.contains_key(gone) {
                    health.clear_service_status(gone).await;
                    // Again after the drop's own: this loop may have set
                    // its gauges while the drop ran.
                    self.metrics().forget_replica(replica, *processes);
                }
            }
            known = now;
            tokio::time::sleep(HEALTH_INTERVAL).await;
        }
    }
}

/// Logs (at debug) every call as it arrives, before it is routed or its
/// token checked: what was in flight when something happened.
fn log_call<B>(request: http::Request<B>) -> http::Request<B> {
    tracing::debug!(path = %request.uri().path(), "API call received");
    request
}

/// How often replica health is checked, and how long a ping may take.
const HEALTH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
