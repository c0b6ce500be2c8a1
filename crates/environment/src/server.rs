//! The gRPC service: thin translation between the wire types and
//! [`Environment`]. New RPCs (dataflows, peeks, subscribes) go here too.

use std::sync::Arc;

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

    /// The tonic server to add to a router.
    pub fn into_server(self) -> EnvironmentServer<Self> {
        EnvironmentServer::new(self)
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

    async fn drop_replica(
        &self,
        request: Request<proto::DropReplicaRequest>,
    ) -> Result<Response<proto::DropReplicaResponse>, Status> {
        let r = request.into_inner();
        let replica = self.env.drop_replica(&r.name).await.map_err(status)?;
        Ok(Response::new(proto::DropReplicaResponse { id: replica.id }))
    }

    async fn list_replicas(
        &self,
        _request: Request<proto::ListReplicasRequest>,
    ) -> Result<Response<proto::ListReplicasResponse>, Status> {
        let list = self.env.list_replicas().await.map_err(status)?;
        Ok(Response::new(proto::ListReplicasResponse {
            replicas: list.iter().map(to_proto).collect(),
        }))
    }

    async fn get_status(
        &self,
        _request: Request<proto::GetStatusRequest>,
    ) -> Result<Response<proto::GetStatusResponse>, Status> {
        Ok(Response::new(proto::GetStatusResponse {
            epoch: self.env.epoch(),
            orphan_rule: self.env.orphan_rule(),
            orphans_removed: self.env.orphans_removed(),
        }))
    }
}
