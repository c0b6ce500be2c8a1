//! The gRPC service: thin translation between the wire types and
//! [`Environment`]. New RPCs (dataflows, peeks, subscribes) go here too.

use std::sync::Arc;

use futures::StreamExt;
use lockstep_catalog::{ReplicaConfig, WriteError};
use tonic::{Request, Response, Status};

use crate::proto;
use crate::proto::environment_server::{Environment as EnvironmentApi, EnvironmentServer};
use crate::{EnvError, Environment, ReplicaInfo};

/// The `lockstep.environment.v1.Environment` service over an [`Environment`].
#[derive(Debug, Clone)]
pub struct EnvironmentService {
    env: Arc<Environment>,
}

impl EnvironmentService {
    /// Serves `env`.
    pub fn new(env: Arc<Environment>) -> Self {
        EnvironmentService { env }
    }

    /// The tonic server to add to a router, accepting requests up to
    /// [`MAX_REQUEST_BYTES`] (tonic's own default is 4 MiB, less than the
    /// largest request the API documents).
    pub fn into_server(self) -> EnvironmentServer<Self> {
        EnvironmentServer::new(self).max_decoding_message_size(MAX_REQUEST_BYTES)
    }
}

/// The API's limits, in one place (`lockstep-api`, which clients link):
/// the largest answer it sends (a larger peek answer is refused with
/// RESOURCE_EXHAUSTED, [`check_answer_len`]), the largest request it
/// accepts, and the shortest token.
pub use lockstep_api::{MAX_ANSWER_BYTES, MAX_REQUEST_BYTES, MIN_TOKEN_LEN};

/// RESOURCE_EXHAUSTED, naming the limit, if an answer of `len` encoded
/// bytes is over `limit`.
pub fn check_answer_len(what: &str, len: usize, limit: usize) -> Result<(), Status> {
    if len <= limit {
        return Ok(());
    }
    Err(Status::resource_exhausted(format!(
        "the {what} answer is {len} bytes, over the API's answer limit of {limit} bytes ({:.1} MiB): read a smaller collection, or one with fewer distinct rows",
        limit as f64 / f64::from(1u32 << 20)
    )))
}

impl EnvironmentService {}

pub use lockstep_metrics_http::constant_time_eq;

/// Checks every request's `authorization: Bearer TOKEN` (compared in
/// constant time); a request without it, or with another token, is
/// UNAUTHENTICATED before it reaches the service.
#[derive(Clone)]
pub struct TokenCheck {
    expected: Vec<u8>,
}

impl TokenCheck {
    /// A check of `token`.
    pub fn new(token: &str) -> Self {
        TokenCheck {
            expected: format!("Bearer {token}").into_bytes(),
        }
    }

    /// Whether `metadata` carries the token (compared in constant time).
    /// Proves nothing about the connection (the interceptor does that).
    pub(crate) fn holds(&self, metadata: &tonic::metadata::MetadataMap) -> bool {
        constant_time_eq(authorization(metadata), &self.expected)
    }
}

/// The `authorization` header's bytes (empty without one).
fn authorization(metadata: &tonic::metadata::MetadataMap) -> &[u8] {
    metadata
        .get("authorization")
        .map(|v| v.as_bytes())
        .unwrap_or_default()
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let given = authorization(request.metadata());
        if constant_time_eq(given, &self.expected) {
            // A checked credential is what proves a connection (R1).
            if crate::listeners::prove_request(request.extensions()) {
                Ok(request)
            } else {
                Err(Status::resource_exhausted(
                    "the environment's API has as many clients as its descriptor budget allows; try again later",
                ))
            }
        } else if given.is_empty() {
            Err(Status::unauthenticated(
                "this environment requires an API token (authorization: Bearer TOKEN); the lockstep CLI sends the one `lockstep serve` keeps in STATE_DIR/api.token with --state-dir DIR or LOCKSTEP_STATE_DIR, or --token-file FILE",
            ))
        } else {
            Err(Status::unauthenticated(
                "the API token is not this environment's",
            ))
        }
    }
}

/// Maps an environment error to a gRPC status (see the proto's comments).
pub fn status(e: EnvError) -> Status {
    match &e {
        EnvError::Halted(_) => Status::failed_precondition(e.to_string()),
        EnvError::Catalog(WriteError::ReplicaExists(_)) => Status::already_exists(e.to_string()),
        EnvError::Catalog(WriteError::NoSuchReplica(_) | WriteError::NoSuchDataflow(_)) => {
            Status::not_found(e.to_string())
        }
        EnvError::Catalog(WriteError::Invalid(_)) => Status::invalid_argument(e.to_string()),
        EnvError::Catalog(_) => Status::internal(e.to_string()),
        EnvError::Orchestrator(_) => Status::unavailable(e.to_string()),
    }
}

/// One page of `items` (in ID order): at most `page_size` (0: 100, at most
/// 1,000) after the ID `token` names ("": from the start), and the token of
/// the next page ("" after the last).
pub fn paginate<T>(
    mut items: Vec<T>,
    page_size: u32,
    token: &str,
    id: impl Fn(&T) -> u64,
) -> Result<(Vec<T>, String), Status> {
    let size = match page_size {
        0 => 100,
        n => n.min(1000) as usize,
    };
    let after = if token.is_empty() {
        None
    } else {
        Some(token.parse::<u64>().map_err(|_| {
            Status::invalid_argument(format!("page_token {token:?} is not one this API returned"))
        })?)
    };
    items.sort_by_key(&id);
    let mut page: Vec<T> = items
        .into_iter()
        .filter(|t| after.is_none_or(|a| id(t) > a))
        .take(size + 1)
        .collect();
    let next = if page.len() > size {
        page.truncate(size);
        page.last().map(|t| id(t).to_string()).unwrap_or_default()
    } else {
        String::new()
    };
    Ok((page, next))
}

/// The wire form of a policy in force.
pub fn policy_to_proto(p: &crate::policies::PolicyInForce) -> proto::Policy {
    proto::Policy {
        kind: p.kind.clone(),
        name: p.name.clone(),
        hash: p.hash.clone(),
        since: p.since,
        replica: p.replica.clone().unwrap_or_default(),
    }
}

/// The wire form of a replica and its service.
pub fn to_proto(info: &ReplicaInfo) -> proto::Replica {
    let r = &info.replica;
    proto::Replica {
        id: r.id,
        name: r.name.clone(),
        processes: r.config.processes,
        workers_per_process: r.config.workers_per_process,
        config: r.config.config.clone(),
        service: info
            .service
            .as_ref()
            .map(|s| s.name.clone())
            .unwrap_or_default(),
        service_epoch: info.service.as_ref().map(|s| s.epoch).unwrap_or_default(),
        // Filled in by `list_replicas`, which asks the environment.
        read_holds: 0,
        read_hold_span: 0,
        reconfiguration: None,
        live_dataflows: None,
        dataflows_caught_up: None,
        process_status: info
            .service
            .iter()
            .flat_map(|s| &s.processes)
            .map(|p| proto::ReplicaProcess {
                index: p.index as u32,
                pid: p.pid.unwrap_or(0),
                running: p.running,
                addresses: p
                    .addresses
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_string()))
                    .collect(),
                restarts: p.restarts,
                metrics_url: p
                    .addresses
                    .get("controller")
                    .map(|a| format!("http://{a}/metrics"))
                    .unwrap_or_default(),
                frontier_lag: None,
                protocol_version: None,
                build_version: None,
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl EnvironmentApi for EnvironmentService {
    async fn create_replica(
        &self,
        request: Request<proto::CreateReplicaRequest>,
    ) -> Result<Response<proto::CreateReplicaResponse>, Status> {
        async {
            let r = request.into_inner();
            let info = self
                .env
                .create_replica(
                    &r.name,
                    ReplicaConfig {
                        processes: r.processes,
                        workers_per_process: r.workers_per_process,
                        config: r.config,
                    },
                )
                .await
                .map_err(status)?;
            Ok(Response::new(proto::CreateReplicaResponse {
                replica: Some(to_proto(&info)),
            }))
        }
        .await
    }

    async fn drop_replica(
        &self,
        request: Request<proto::DropReplicaRequest>,
    ) -> Result<Response<proto::DropReplicaResponse>, Status> {
        async {
            let r = request.into_inner();
            let replica = self.env.drop_replica(&r.name).await.map_err(status)?;
            Ok(Response::new(proto::DropReplicaResponse { id: replica.id }))
        }
        .await
    }

    async fn restart_replica(
        &self,
        request: Request<proto::RestartReplicaRequest>,
    ) -> Result<Response<proto::RestartReplicaResponse>, Status> {
        async {
            let r = request.into_inner();
            if r.keep_answering {
                let done = self
                    .env
                    .upgrade_replica_answering(&r.name)
                    .await
                    .map_err(compute_status)?;
                return Ok(Response::new(proto::RestartReplicaResponse {
                    replica: Some(to_proto(&done.info)),
                    standby_ready_ms: done.standby_ready.as_millis() as u64,
                    standby_served_ms: done.standby_served.as_millis() as u64,
                }));
            }
            let info = self.env.restart_replica(&r.name).await.map_err(status)?;
            Ok(Response::new(proto::RestartReplicaResponse {
                replica: Some(to_proto(&info)),
                ..Default::default()
            }))
        }
        .await
    }

    async fn resize_replica(
        &self,
        request: Request<proto::ResizeReplicaRequest>,
    ) -> Result<Response<proto::ResizeReplicaResponse>, Status> {
        async {
            let r = request.into_inner();
            let done = self
                .env
                .resize_replica_answering(&r.name, r.processes, r.workers_per_process)
                .await
                .map_err(compute_status)?;
            Ok(Response::new(proto::ResizeReplicaResponse {
                replica: Some(to_proto(&done.info)),
                standby_ready_ms: done.standby_ready.as_millis() as u64,
                standby_served_ms: done.standby_served.as_millis() as u64,
            }))
        }
        .await
    }

    async fn list_replicas(
        &self,
        request: Request<proto::ListReplicasRequest>,
    ) -> Result<Response<proto::ListReplicasResponse>, Status> {
        async {
            let r = request.into_inner();
            let list = self.env.list_replicas().await.map_err(status)?;
            let (page, next_page_token) =
                paginate(list, r.page_size, &r.page_token, |i| i.replica.id)?;
            let mut replicas: Vec<proto::Replica> = page.iter().map(to_proto).collect();
            for r in &mut replicas {
                let holds = self.env.read_holds(r.id);
                r.read_holds = holds.holds as u32;
                r.read_hold_span = holds.held_span;
                let reconfiguration = self.env.reconfiguration(r.id).await;
                if let Some(rs) = &reconfiguration {
                    let rc = &rs.reconfiguration;
                    r.reconfiguration = Some(proto::ReplicaReconfiguration {
                        kind: rc.kind.to_string(),
                        phase: rc.phase.name().to_string(),
                        target_processes: rc.target.0,
                        target_workers_per_process: rc.target.1,
                        elapsed_ms: rc.started.elapsed().as_millis() as u64,
                        standby_frontier_lag: rs.standby_lag,
                        standby_dataflows_caught_up: rs
                            .standby_caught_up
                            .map(|c| c.caught_up as u32),
                        phase_elapsed_ms: rc.phase_started.elapsed().as_millis() as u64,
                        estimated_ms_left: rs.estimated_left.map(|d| d.as_millis() as u64),
                    });
                }
                let Some(c) = self.env.replica_controller(&r.name) else {
                    continue;
                };
                // Asked once: a reconfiguration's status holds it already.
                let caught_up = match reconfiguration {
                    Some(rs) => rs.own_caught_up,
                    None => c.caught_up().await.ok(),
                };
                if let Some(caught_up) = caught_up {
                    r.live_dataflows = Some(caught_up.dataflows as u32);
                    r.dataflows_caught_up = Some(caught_up.caught_up as u32);
                }
                if let Ok(lags) = c.process_lags().await {
                    for (p, lag) in r.process_status.iter_mut().zip(lags) {
                        p.frontier_lag = lag;
                    }
                }
                if let Ok(versions) = c.process_versions().await {
                    for (p, v) in r.process_status.iter_mut().zip(versions) {
                        p.protocol_version = v.as_ref().map(|v| v.protocol_version);
                        p.build_version = v.and_then(|v| v.build_version);
                    }
                }
            }
            Ok(Response::new(proto::ListReplicasResponse {
                replicas,
                next_page_token,
            }))
        }
        .await
    }

    async fn get_status(
        &self,
        _request: Request<proto::GetStatusRequest>,
    ) -> Result<Response<proto::GetStatusResponse>, Status> {
        async {
            Ok(Response::new(proto::GetStatusResponse {
                epoch: self.env.epoch(),
                orphan_rule: self.env.orphan_rule(),
                orphans_removed: self.env.orphans_removed(),
                reconfigurations_settled: self.env.reconfigurations_settled(),
                format: self.env.compute.format(),
            }))
        }
        .await
    }

    async fn create_dataflow(
        &self,
        request: Request<proto::CreateDataflowRequest>,
    ) -> Result<Response<proto::CreateDataflowResponse>, Status> {
        async {
            let r = request.into_inner();
            let exports = r
                .exports
                .into_iter()
                .map(|e| lockstep_protocol::Export {
                    collection_id: e.collection_id,
                    description: e.description,
                })
                .collect();
            let desc = self
                .env
                .create_dataflow_of(&r.format, &r.replica, &r.name, r.as_of, r.inputs, exports)
                .await
                .map_err(compute_status)?;
            Ok(Response::new(proto::CreateDataflowResponse {
                dataflow: Some(desc.into()),
            }))
        }
        .await
    }

    async fn drop_dataflow(
        &self,
        request: Request<proto::DropDataflowRequest>,
    ) -> Result<Response<proto::DropDataflowResponse>, Status> {
        async {
            self.env
                .drop_dataflow(request.into_inner().id)
                .await
                .map_err(compute_status)?;
            Ok(Response::new(proto::DropDataflowResponse {}))
        }
        .await
    }

    async fn list_dataflows(
        &self,
        request: Request<proto::ListDataflowsRequest>,
    ) -> Result<Response<proto::ListDataflowsResponse>, Status> {
        async {
            let r = request.into_inner();
            let list = self.env.list_dataflows().map_err(compute_status)?;
            let (page, next_page_token) =
                paginate(list, r.page_size, &r.page_token, |(_, d)| d.id)?;
            Ok(Response::new(proto::ListDataflowsResponse {
                next_page_token,
                dataflows: page
                    .into_iter()
                    .map(|(replica, d)| proto::list_dataflows_response::Entry {
                        replica,
                        dataflow: Some(d.into()),
                    })
                    .collect(),
            }))
        }
        .await
    }

    async fn write_input(
        &self,
        request: Request<proto::WriteInputRequest>,
    ) -> Result<Response<proto::WriteInputResponse>, Status> {
        async {
            let r = request.into_inner();
            let updates = r
                .updates
                .into_iter()
                .map(lockstep_protocol::Update::from)
                .collect();
            self.env
                .write_input(&r.replica, r.collection_id, updates, r.upper)
                .await
                .map_err(compute_status)?;
            Ok(Response::new(proto::WriteInputResponse {}))
        }
        .await
    }

    async fn peek(
        &self,
        request: Request<proto::PeekRequest>,
    ) -> Result<Response<proto::PeekResponse>, Status> {
        async {
            let r = request.into_inner();
            let rows = self
                .env
                .peek(&r.replica, r.collection_id, r.timestamp)
                .await
                .map_err(compute_status)?;
            let answer = proto::PeekResponse {
                rows: rows
                    .into_iter()
                    .map(|(values, diff)| lockstep_protocol::proto::Row { values, diff })
                    .collect(),
            };
            check_answer_len(
                "peek",
                prost::Message::encoded_len(&answer),
                self.env.max_answer_bytes(),
            )?;
            Ok(Response::new(answer))
        }
        .await
    }

    async fn set_policy(
        &self,
        request: Request<proto::SetPolicyRequest>,
    ) -> Result<Response<proto::SetPolicyResponse>, Status> {
        async {
            let r = request.into_inner();
            let p = self
                .env
                .set_policy_on(
                    Some(r.replica.as_str()).filter(|r| !r.is_empty()),
                    &r.name,
                    r.wasm,
                )
                .await
                .map_err(compute_status)?;
            Ok(Response::new(proto::SetPolicyResponse {
                policy: Some(policy_to_proto(&p)),
            }))
        }
        .await
    }

    async fn list_policies(
        &self,
        _request: Request<proto::ListPoliciesRequest>,
    ) -> Result<Response<proto::ListPoliciesResponse>, Status> {
        Ok(Response::new(proto::ListPoliciesResponse {
            policies: self
                .env
                .policies_in_force()
                .iter()
                .map(policy_to_proto)
                .collect(),
        }))
    }

    type SubscribeStream = std::pin::Pin<
        Box<
            dyn futures::Stream<Item = Result<lockstep_protocol::proto::SubscribeResponse, Status>>
                + Send,
        >,
    >;

    async fn subscribe(
        &self,
        request: Request<proto::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        async {
            let r = request.into_inner();
            let rx = self
                .env
                .subscribe(&r.replica, r.collection_id, r.as_of)
                .map_err(compute_status)?;
            // Bounded: a client that stops reading is cut off by the
            // controller (`SUBSCRIBE_CHANNEL_BATCHES`), not buffered.
            // A resumed stream leaves out what the client holds: every
            // update at or before the resume point (the snapshot advances
            // older updates to as_of; later ones keep their times).
            let resume_after = r.resume.then_some(r.as_of);
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |b| {
                let mut b = b.map_err(compute_status)?;
                if let Some(after) = resume_after {
                    b.updates.retain(|u| u.time > after);
                }
                let kind: lockstep_protocol::proto::response::Kind =
                    lockstep_protocol::ResponseKind::SubscribeResponse(b).into();
                match kind {
                    lockstep_protocol::proto::response::Kind::SubscribeResponse(s) => Ok(s),
                    _ => Err(Status::internal("not a subscribe batch")),
                }
            });
            Ok(Response::new(Box::pin(stream) as Self::SubscribeStream))
        }
        .await
    }
}

/// Maps a compute error to a gRPC status.
pub fn compute_status(e: crate::compute::ComputeError) -> Status {
    use crate::compute::ComputeError as E;
    match e {
        E::Env(e) => status(e),
        E::NoSuchReplica(_) | E::NoSuchDataflow(_) | E::NoSuchCollection { .. } => {
            Status::not_found(e.to_string())
        }
        E::Invalid(_) => Status::invalid_argument(e.to_string()),
        E::OutOfRange(_) => Status::out_of_range(e.to_string()),
        E::AlreadyExists(_) => Status::already_exists(e.to_string()),
        E::Unavailable(_) => Status::unavailable(e.to_string()),
        E::Controller(lockstep_controller::ControllerError::Timeout { .. }) => {
            Status::deadline_exceeded(e.to_string())
        }
        // FAILED_PRECONDITION is kept for a fenced controller.
        E::Controller(lockstep_controller::ControllerError::Replica(_)) => {
            Status::internal(e.to_string())
        }
        E::Controller(lockstep_controller::ControllerError::Dropped { .. }) => {
            Status::not_found(e.to_string())
        }
        E::Controller(_) => Status::unavailable(e.to_string()),
        E::Corrupt(_) => Status::data_loss(e.to_string()),
        E::Refused(_) => Status::internal(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_over_the_limit_is_resource_exhausted_naming_the_limit() {
        assert!(check_answer_len("peek", MAX_ANSWER_BYTES, MAX_ANSWER_BYTES).is_ok());
        let e = check_answer_len("peek", MAX_ANSWER_BYTES + 1, MAX_ANSWER_BYTES).unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(
            e.message()
                .contains(&format!("limit of {MAX_ANSWER_BYTES} bytes (256.0 MiB)")),
            "{}",
            e.message()
        );
    }

    #[test]
    fn pages_cover_every_item_once_in_id_order() {
        let items: Vec<u64> = vec![9, 3, 7, 1, 5];
        let mut seen = Vec::new();
        let mut token = String::new();
        loop {
            let (page, next) = paginate(items.clone(), 2, &token, |i| *i).unwrap();
            assert!(page.len() <= 2);
            seen.extend(page);
            if next.is_empty() {
                break;
            }
            token = next;
        }
        assert_eq!(seen, vec![1, 3, 5, 7, 9]);
        let (all, next) = paginate(items.clone(), 0, "", |i| *i).unwrap();
        assert_eq!((all.len(), next.as_str()), (5, ""));
        let bad = paginate(items, 2, "not-a-token", |i| *i).unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    }
}
