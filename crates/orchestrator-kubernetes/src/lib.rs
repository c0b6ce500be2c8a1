//! lockstep's Kubernetes orchestrator backend: [`KubernetesOrchestrator`]
//! implements [`Orchestrator`] with kube and k8s-openapi.
//!
//! # Objects
//!
//! A service `NAME` of `scale` processes is, in the configured namespace:
//!
//! - a headless Service `NAME` (`clusterIP: None`): the service's **record**
//!   (labels [`EPOCH_LABEL`], [`ID_LABEL`], `lockstep/state: live`; the
//!   config's labels in an annotation) and the DNS domain of its pods;
//! - one pod `NAME-I` per process (hostname `NAME-I`, subdomain `NAME`), so
//!   process *I* is `NAME-I.NAME.NAMESPACE.svc.DOMAIN` for its peers, with
//!   `restartPolicy: Always` (the kubelet restarts a process that exits, as
//!   the process backend's supervisors do);
//! - a Secret `NAME-env` with the config's environment (the replica's session
//!   key among it), passed to the container with `envFrom`.
//!
//! Why pods and not a StatefulSet: the trait computes each process's
//! command line separately ([`ServiceAssignment`](lockstep_orchestrator::ServiceAssignment)),
//! and a StatefulSet has one pod template for all; and `restart_service`
//! must replace exactly the pods it read, with preconditions, which a
//! StatefulSet controller re-creating pods behind our back would race with.
//!
//! Every object carries `app.kubernetes.io/managed-by: lockstep` and
//! `lockstep/environment: ENV`, and an owner reference to the environment's
//! own object when one is configured.
//!
//! # Compare-and-swap
//!
//! Kubernetes writes are conditional on `metadata.resourceVersion` (a PUT
//! carrying a stale one is answered 409 Conflict), and deletes accept
//! `Preconditions { uid, resourceVersion }` (409 when they do not hold).
//! Every write here is one of those, decided on what was just read:
//!
//! - `ensure_service` reads the record, refuses a newer epoch
//!   ([`EnsureError::StaleEpoch`]) or a tombstone of a newer epoch
//!   ([`EnsureError::DroppedByNewer`]), then writes the record with the
//!   resourceVersion it read (or creates it). A 409 means someone wrote in
//!   between: it reads again and decides again (at most
//!   [`CONFLICT_ATTEMPTS`] times), never retries the same write blindly.
//!   Then the Secret and the pods: a pod with the same spec hash is kept and
//!   relabelled (adopted), a different one is deleted with preconditions and
//!   re-created. Finally it reads the record once more: if a newer
//!   controller took it over meanwhile, it deletes the pods it created (with
//!   preconditions) and refuses.
//! - `drop_service` turns the record into a tombstone (a write with the
//!   record's resourceVersion, or a create), then deletes the service's pods
//!   and Secret, each with the uid and resourceVersion it read. A 409 on a
//!   pod means it changed (re-created by someone else): it reads again and
//!   decides again.
//! - `restart_service` checks the record's epoch, deletes each pod with
//!   preconditions, waits until it is gone and creates it again with the
//!   same spec.
//!
//! The orphan rules are unchanged and see only [`list_services`]: they run
//! against this backend through the trait.
//!
//! # Testing without a cluster
//!
//! [`api_double::ApiServerDouble`] is a stateful in-memory Kubernetes API
//! server behind a real [`kube::Client`]: resourceVersions, uids,
//! preconditions, label selectors, list and watch, with fault injection.
//! The request-level tests (`tests/requests.rs`) use `tower-test` to pin
//! the exact HTTP requests.
//!
//! [`list_services`]: Orchestrator::list_services

pub mod api_double;
pub mod objects;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{
    Api, DeleteParams, ListParams, PostParams, Preconditions, WatchEvent, WatchParams,
};
use kube::{Client, ResourceExt};
use lockstep_orchestrator::{
    DropError, EnsureError, ListError, Orchestrator, ProcessStatus, RestartError, ServiceConfig,
    ServiceEvent, ServiceEventKind, ServiceStatus, StateError, EPOCH_LABEL, ID_LABEL,
};
use tokio::sync::broadcast;

use crate::objects::{
    ObjectContext, DROPPED_BY_LABEL, LABELS_ANNOTATION, PROCESS_LABEL, RESTARTS_ANNOTATION,
    SPEC_HASH_ANNOTATION, STATE_LABEL,
};

/// How often a write is decided again after a 409 Conflict before the call
/// gives up with an error.
pub const CONFLICT_ATTEMPTS: usize = 5;

/// How to build a [`KubernetesOrchestrator`].
#[derive(Clone, Debug)]
pub struct KubernetesOrchestratorConfig {
    /// The namespace of every object.
    pub namespace: String,
    /// The environment's name: objects are labelled with it and only its
    /// objects are listed.
    pub environment: String,
    /// The controller's epoch, which labels every service it ensures.
    pub epoch: u64,
    /// The container image of the processes (it holds the service program).
    pub image: String,
    /// The cluster's DNS domain.
    pub cluster_domain: String,
    /// Named port *k* of a service listens on `base_port + k` (every pod has
    /// its own IP, so the numbers are the same for every process).
    pub base_port: u16,
    /// The environment's own object (e.g. its Deployment): every object gets
    /// an owner reference to it, so deleting the environment deletes them.
    pub owner: Option<OwnerReference>,
    /// Whether `ensure_service` and `restart_service` refuse to overwrite a
    /// service with a newer epoch (O4). Only the negative tests turn it off.
    pub conditional_writes: bool,
    /// Whether deletes carry `Preconditions { uid, resourceVersion }`. Only
    /// the negative tests turn this off, to show what the preconditions stop.
    pub delete_preconditions: bool,
    /// How long `ensure_service` and `restart_service` wait for every pod to
    /// have an IP (its addresses) before returning the status as it is.
    pub ready_timeout: Duration,
    /// How long a delete may take to complete (a pod's graceful shutdown).
    pub delete_timeout: Duration,
    /// How often a wait polls.
    pub poll_interval: Duration,
}

impl KubernetesOrchestratorConfig {
    /// Defaults: environment `lockstep`, image `lockstep:latest`, domain
    /// `cluster.local`, ports from 2100, conditional writes on, 60 s waits.
    pub fn new(namespace: impl Into<String>, epoch: u64) -> Self {
        KubernetesOrchestratorConfig {
            namespace: namespace.into(),
            environment: "lockstep".to_string(),
            epoch,
            image: "lockstep:latest".to_string(),
            cluster_domain: "cluster.local".to_string(),
            base_port: 2100,
            owner: None,
            conditional_writes: true,
            delete_preconditions: true,
            ready_timeout: Duration::from_secs(60),
            delete_timeout: Duration::from_secs(60),
            poll_interval: Duration::from_millis(250),
        }
    }
}

/// The Kubernetes backend. Cheap to share behind an `Arc`; dropping it stops
/// its watch task.
pub struct KubernetesOrchestrator {
    config: KubernetesOrchestratorConfig,
    services: Api<Service>,
    pods: Api<Pod>,
    secrets: Api<Secret>,
    events: broadcast::Sender<ServiceEvent>,
    /// The pod watch, started by the first `watch_services`.
    watcher: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for KubernetesOrchestrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesOrchestrator")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Drop for KubernetesOrchestrator {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.lock().expect("poisoned").take() {
            w.abort();
        }
    }
}

/// A failed API call, in the trait's error type: the "path" names the call.
fn api_error(what: &str, e: kube::Error) -> StateError {
    StateError::Io {
        path: format!("kubernetes API: {what}").into(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// A write that met [`CONFLICT_ATTEMPTS`] conflicts in a row.
fn too_many_conflicts(what: &str) -> StateError {
    StateError::Io {
        path: format!("kubernetes API: {what}").into(),
        source: std::io::Error::other(format!(
            "{CONFLICT_ATTEMPTS} conflicting writes in a row (409); giving up"
        )),
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn label_u64(labels: &BTreeMap<String, String>, key: &str) -> Option<u64> {
    labels.get(key).and_then(|v| v.parse().ok())
}

/// What a service's record says.
#[derive(Debug)]
enum Record {
    Missing,
    Live { epoch: u64, service: Box<Service> },
    Dropped { by: u64, service: Box<Service> },
}

/// The preconditions of a delete: exactly the object that was read.
pub fn preconditions_of<K: kube::Resource>(object: &K) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            uid: object.meta().uid.clone(),
            resource_version: object.meta().resource_version.clone(),
        }),
        ..DeleteParams::default()
    }
}

impl KubernetesOrchestrator {
    /// A backend talking to the API server behind `client` (a real cluster's,
    /// from `kube::Client::try_default()`, or [`api_double::ApiServerDouble`]),
    /// Sends no request until called; the first
    /// [`watch_services`](Orchestrator::watch_services) starts a task that
    /// watches the environment's pods.
    pub fn new(client: Client, config: KubernetesOrchestratorConfig) -> Self {
        let ns = config.namespace.as_str();
        let (events, _) = broadcast::channel(1024);
        KubernetesOrchestrator {
            services: Api::namespaced(client.clone(), ns),
            pods: Api::namespaced(client.clone(), ns),
            secrets: Api::namespaced(client, ns),
            config,
            events,
            watcher: std::sync::Mutex::new(None),
        }
    }

    fn delete_params<K: kube::Resource>(&self, object: &K) -> DeleteParams {
        if self.config.delete_preconditions {
            preconditions_of(object)
        } else {
            DeleteParams::default()
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KubernetesOrchestratorConfig {
        &self.config
    }

    fn context(&self) -> ObjectContext {
        ObjectContext {
            namespace: self.config.namespace.clone(),
            environment: self.config.environment.clone(),
            epoch: self.config.epoch,
            image: self.config.image.clone(),
            cluster_domain: self.config.cluster_domain.clone(),
            base_port: self.config.base_port,
            owner: self.config.owner.clone(),
        }
    }

    async fn read_record(&self, name: &str) -> Result<Record, StateError> {
        let Some(service) = self
            .services
            .get_opt(name)
            .await
            .map_err(|e| api_error("read service", e))?
        else {
            return Ok(Record::Missing);
        };
        let labels = service.labels();
        if labels.get(objects::MANAGED_BY_LABEL).map(String::as_str) != Some(objects::MANAGED_BY) {
            return Err(StateError::Corrupt {
                path: format!("kubernetes: service {name}").into(),
                reason: "a Service of this name exists and is not managed by lockstep".into(),
            });
        }
        Ok(match labels.get(STATE_LABEL).map(String::as_str) {
            Some("dropped") => Record::Dropped {
                by: label_u64(labels, DROPPED_BY_LABEL).unwrap_or(0),
                service: Box::new(service),
            },
            _ => Record::Live {
                epoch: label_u64(labels, EPOCH_LABEL).unwrap_or(0),
                service: Box::new(service),
            },
        })
    }

    async fn service_pods(&self, name: &str) -> Result<Vec<Pod>, StateError> {
        let lp =
            ListParams::default().labels(&objects::pods_selector(&self.config.environment, name));
        let mut pods = self
            .pods
            .list(&lp)
            .await
            .map_err(|e| api_error("list pods", e))?
            .items;
        pods.sort_by_key(pod_index);
        Ok(pods)
    }

    /// Writes the record (CAS on the resourceVersion read), deciding again
    /// on a 409. Returns the written record.
    async fn write_record(&self, config: &ServiceConfig) -> Result<Service, EnsureError> {
        let ours = self.config.epoch;
        let ctx = self.context();
        for _ in 0..CONFLICT_ATTEMPTS {
            let mut desired = objects::service(&ctx, config);
            let result = match self.read_record(&config.name).await? {
                Record::Live { epoch, .. } if self.config.conditional_writes && epoch > ours => {
                    return Err(EnsureError::StaleEpoch {
                        service: config.name.clone(),
                        stored: epoch,
                        ours,
                    })
                }
                Record::Dropped { by, .. } if self.config.conditional_writes && by > ours => {
                    return Err(EnsureError::DroppedByNewer {
                        service: config.name.clone(),
                        dropped_at: by,
                        ours,
                    })
                }
                Record::Missing => self.services.create(&PostParams::default(), &desired).await,
                Record::Live { service, .. } | Record::Dropped { service, .. } => {
                    // The CAS: this write holds only if nobody wrote since our read.
                    desired.metadata.resource_version = service.resource_version();
                    desired.metadata.uid = service.uid();
                    self.services
                        .replace(&config.name, &PostParams::default(), &desired)
                        .await
                }
            };
            match result {
                Ok(s) => return Ok(s),
                Err(e) if is_conflict(&e) => {
                    tracing::info!(service = %config.name, "record changed under us (409): reading again");
                }
                Err(e) => return Err(api_error("write service", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("service {}", config.name)).into())
    }

    async fn write_secret(&self, config: &ServiceConfig) -> Result<(), StateError> {
        let name = objects::secret_name(&config.name);
        for _ in 0..CONFLICT_ATTEMPTS {
            let mut desired = objects::secret(&self.context(), config);
            let result = match self
                .secrets
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read secret", e))?
            {
                None => self.secrets.create(&PostParams::default(), &desired).await,
                Some(s) if s.data == desired.data && s.labels() == desired.labels() => {
                    return Ok(())
                }
                Some(s) => {
                    desired.metadata.resource_version = s.resource_version();
                    self.secrets
                        .replace(&name, &PostParams::default(), &desired)
                        .await
                }
            };
            match result {
                Ok(_) => return Ok(()),
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(api_error("write secret", e)),
            }
        }
        Err(too_many_conflicts(&format!("secret {name}")))
    }

    /// Deletes `pod` exactly as read (uid and resourceVersion preconditions)
    /// and waits until it is gone. `Ok(false)`: the precondition failed (409),
    /// the pod changed since it was read.
    async fn delete_pod_as_read(&self, pod: &Pod) -> Result<bool, StateError> {
        let name = pod.name_any();
        match self.pods.delete(&name, &self.delete_params(pod)).await {
            Ok(_) => {}
            Err(e) if is_conflict(&e) => return Ok(false),
            Err(e) if is_not_found(&e) => return Ok(true),
            Err(e) => return Err(api_error("delete pod", e)),
        }
        self.wait_gone(&name, pod.uid()).await?;
        Ok(true)
    }

    /// Waits (bounded) until no pod `name` with `uid` exists.
    async fn wait_gone(&self, name: &str, uid: Option<String>) -> Result<(), StateError> {
        let deadline = tokio::time::Instant::now() + self.config.delete_timeout;
        loop {
            match self.pods.get_opt(name).await {
                Ok(None) => return Ok(()),
                Ok(Some(p)) if p.uid() != uid => return Ok(()),
                Ok(Some(_)) if tokio::time::Instant::now() >= deadline => {
                    return Err(StateError::Io {
                        path: format!("kubernetes API: pod {name}").into(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "still there {:?} after its delete",
                                self.config.delete_timeout
                            ),
                        ),
                    })
                }
                Ok(Some(_)) => tokio::time::sleep(self.config.poll_interval).await,
                Err(e) => return Err(api_error("read pod", e)),
            }
        }
    }

    /// Makes process `index`'s pod run `argv`: keeps (relabels) a pod with
    /// the same spec, replaces a different one, creates a missing one.
    /// Returns the pod's uid if it created one.
    async fn ensure_pod(
        &self,
        config: &ServiceConfig,
        index: usize,
        argv: &[String],
    ) -> Result<Option<String>, EnsureError> {
        let ctx = self.context();
        let name = objects::pod_name(&config.name, index);
        for _ in 0..CONFLICT_ATTEMPTS {
            let desired = objects::pod(&ctx, config, index, argv.to_vec(), 0);
            let existing = self
                .pods
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read pod", e))?;
            let result = match existing {
                None => self
                    .pods
                    .create(&PostParams::default(), &desired)
                    .await
                    .map(|p| p.uid()),
                Some(p) if p.metadata.deletion_timestamp.is_some() => {
                    self.wait_gone(&name, p.uid()).await?;
                    continue;
                }
                Some(p)
                    if p.annotations().get(SPEC_HASH_ANNOTATION)
                        == desired.annotations().get(SPEC_HASH_ANNOTATION) =>
                {
                    // Adopt: relabel with our epoch, CAS on what we read.
                    if p.labels() == desired.labels() {
                        return Ok(None);
                    }
                    let mut relabelled = p.clone();
                    relabelled.metadata.labels = desired.metadata.labels.clone();
                    self.pods
                        .replace(&name, &PostParams::default(), &relabelled)
                        .await
                        .map(|_| None)
                }
                Some(p) => {
                    // A different spec: replace the pod we read, and only it.
                    self.delete_pod_as_read(&p).await?;
                    continue;
                }
            };
            match result {
                Ok(created) => return Ok(created),
                Err(e) if is_conflict(&e) => {
                    tracing::info!(pod = %name, "pod changed under us (409): reading again");
                }
                Err(e) => return Err(api_error("write pod", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("pod {name}")).into())
    }

    /// Waits (bounded by `ready_timeout`) until every pod has an IP, then
    /// returns the status.
    async fn status_when_ready(&self, record: &Service) -> Result<ServiceStatus, StateError> {
        let deadline = tokio::time::Instant::now() + self.config.ready_timeout;
        loop {
            let pods = self.service_pods(&record.name_any()).await?;
            let status = self.status_of(record, &pods);
            let ready = pods.iter().all(|p| pod_ip(p).is_some());
            if ready || tokio::time::Instant::now() >= deadline {
                return Ok(status);
            }
            tokio::time::sleep(self.config.poll_interval).await;
        }
    }

    fn status_of(&self, record: &Service, pods: &[Pod]) -> ServiceStatus {
        let labels = record.labels();
        let mut all: BTreeMap<String, String> = record
            .annotations()
            .get(LABELS_ANNOTATION)
            .and_then(|j| serde_json::from_str(j).ok())
            .unwrap_or_default();
        let epoch = label_u64(labels, EPOCH_LABEL).unwrap_or(0);
        let id = label_u64(labels, ID_LABEL).unwrap_or(0);
        all.insert(EPOCH_LABEL.to_string(), epoch.to_string());
        all.insert(ID_LABEL.to_string(), id.to_string());
        let ports: Vec<(String, u16)> = record
            .spec
            .as_ref()
            .and_then(|s| s.ports.as_ref())
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| Some((p.name.clone()?, u16::try_from(p.port).ok()?)))
                    .collect()
            })
            .unwrap_or_default();
        ServiceStatus {
            name: record.name_any(),
            id,
            epoch,
            labels: all,
            processes: pods
                .iter()
                .filter_map(|p| {
                    let index = pod_index(p);
                    (index != usize::MAX).then(|| ProcessStatus {
                        index,
                        pid: None,
                        running: pod_running(p),
                        addresses: pod_ip(p)
                            .map(|ip| {
                                ports
                                    .iter()
                                    .map(|(n, port)| (n.clone(), SocketAddr::new(ip, *port)))
                                    .collect()
                            })
                            .unwrap_or_default(),
                        restarts: pod_restarts(p),
                    })
                })
                .collect(),
        }
    }

    async fn ensure(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        objects::validate_name(&config.name).map_err(EnsureError::Invalid)?;
        if config.scale == 0 {
            return Err(EnsureError::Invalid(format!(
                "service {} needs at least one process",
                config.name
            )));
        }
        let ours = self.config.epoch;
        let record = self.write_record(&config).await?;
        self.write_secret(&config).await?;
        let argv = objects::process_args(&self.context(), &config);
        let mut created = Vec::new();
        for (i, argv) in argv.iter().enumerate() {
            if let Some(uid) = self.ensure_pod(&config, i, argv).await? {
                created.push((objects::pod_name(&config.name, i), uid));
            }
        }
        // Pods of a larger earlier scale go.
        for p in self.service_pods(&config.name).await? {
            if pod_index(&p) >= config.scale {
                self.delete_pod_as_read(&p).await?;
            }
        }
        // Did a newer controller take the record over while we wrote pods?
        // Then its deletes may have missed the pods we created: remove them.
        match self.read_record(&config.name).await? {
            Record::Live { epoch, .. } if self.config.conditional_writes && epoch > ours => {
                self.remove_created(&created).await;
                return Err(EnsureError::StaleEpoch {
                    service: config.name,
                    stored: epoch,
                    ours,
                });
            }
            Record::Dropped { by, .. } if self.config.conditional_writes && by > ours => {
                self.remove_created(&created).await;
                return Err(EnsureError::DroppedByNewer {
                    service: config.name,
                    dropped_at: by,
                    ours,
                });
            }
            _ => {}
        }
        for (name, _) in &created {
            let index = name.rsplit('-').next().and_then(|i| i.parse().ok());
            let _ = self.events.send(ServiceEvent {
                service: config.name.clone(),
                process: index,
                kind: ServiceEventKind::Started { pid: 0 },
            });
        }
        Ok(self.status_when_ready(&record).await?)
    }

    async fn remove_created(&self, created: &[(String, String)]) {
        for (name, uid) in created {
            if let Ok(Some(p)) = self.pods.get_opt(name).await {
                if p.uid().as_deref() == Some(uid.as_str()) {
                    let _ = self.delete_pod_as_read(&p).await;
                }
            }
        }
    }

    async fn drop_inner(&self, name: &str) -> Result<bool, DropError> {
        objects::validate_name(name).map_err(DropError::Invalid)?;
        let ours = self.config.epoch;
        let ctx = self.context();
        // 1. The record becomes a tombstone with the highest dropping epoch.
        let mut existed = false;
        let mut written = false;
        let mut tombstone_version = None;
        for _ in 0..CONFLICT_ATTEMPTS {
            let result = match self.read_record(name).await? {
                Record::Missing => {
                    existed = false;
                    self.services
                        .create(
                            &PostParams::default(),
                            &objects::tombstone(&ctx, name, ours),
                        )
                        .await
                }
                Record::Dropped { by, service } if by >= ours => {
                    existed = false;
                    written = true;
                    tombstone_version = service.resource_version();
                    break;
                }
                Record::Live { service, .. } | Record::Dropped { service, .. } => {
                    existed = service.labels().get(STATE_LABEL).map(String::as_str) == Some("live");
                    let by = label_u64(service.labels(), DROPPED_BY_LABEL)
                        .unwrap_or(0)
                        .max(ours);
                    let mut t = objects::tombstone(&ctx, name, by);
                    t.metadata.resource_version = service.resource_version();
                    t.metadata.uid = service.uid();
                    self.services
                        .replace(name, &PostParams::default(), &t)
                        .await
                }
            };
            match result {
                Ok(t) => {
                    written = true;
                    tombstone_version = t.resource_version();
                    break;
                }
                Err(e) if is_conflict(&e) => {
                    tracing::info!(
                        service = name,
                        "record changed under us (409): reading again"
                    )
                }
                Err(e) => return Err(api_error("write tombstone", e).into()),
            }
        }
        if !written {
            return Err(too_many_conflicts(&format!("service {name}")).into());
        }
        // 2. Every pod and the Secret, each exactly as read. The drop took
        // effect when the tombstone was written: if the record changed since
        // (a newer controller re-created the service), what exists now is
        // its, not ours to delete.
        for _ in 0..CONFLICT_ATTEMPTS {
            if !self.tombstone_unchanged(name, &tombstone_version).await? {
                tracing::info!(service = name, "re-created since our drop: leaving it");
                return Ok(existed);
            }
            let pods = self.service_pods(name).await?;
            if pods.is_empty() {
                break;
            }
            let mut conflicts = 0;
            for p in &pods {
                if !self.delete_pod_as_read(p).await? {
                    tracing::info!(pod = %p.name_any(), "pod changed under us (409): reading again");
                    conflicts += 1;
                }
            }
            if conflicts == 0 {
                break;
            }
        }
        if !self.tombstone_unchanged(name, &tombstone_version).await? {
            return Ok(existed);
        }
        let secret_name = objects::secret_name(name);
        for _ in 0..CONFLICT_ATTEMPTS {
            match self.secrets.get_opt(&secret_name).await {
                Ok(None) => break,
                Ok(Some(s)) => match self
                    .secrets
                    .delete(&secret_name, &self.delete_params(&s))
                    .await
                {
                    Ok(_) => break,
                    Err(e) if is_conflict(&e) || is_not_found(&e) => continue,
                    Err(e) => return Err(api_error("delete secret", e).into()),
                },
                Err(e) => return Err(api_error("read secret", e).into()),
            }
        }
        if existed {
            tracing::info!(service = name, "dropped");
            let _ = self.events.send(ServiceEvent {
                service: name.to_string(),
                process: None,
                kind: ServiceEventKind::Dropped,
            });
        }
        Ok(existed)
    }

    /// Whether the record is still the tombstone we wrote (or read).
    async fn tombstone_unchanged(
        &self,
        name: &str,
        version: &Option<String>,
    ) -> Result<bool, StateError> {
        Ok(match self.read_record(name).await? {
            Record::Dropped { service, .. } => service.resource_version() == *version,
            _ => false,
        })
    }

    async fn restart_inner(&self, name: &str) -> Result<ServiceStatus, RestartError> {
        objects::validate_name(name).map_err(RestartError::Invalid)?;
        let ours = self.config.epoch;
        let record = match self.read_record(name).await? {
            Record::Missing | Record::Dropped { .. } => {
                return Err(RestartError::NoSuchService(name.to_string()))
            }
            Record::Live { epoch, .. } if self.config.conditional_writes && epoch > ours => {
                return Err(RestartError::StaleEpoch {
                    service: name.to_string(),
                    stored: epoch,
                    ours,
                })
            }
            Record::Live { service, .. } => service,
        };
        for p in self.service_pods(name).await? {
            let mut current = p;
            let mut replaced = false;
            for _ in 0..CONFLICT_ATTEMPTS {
                if self.delete_pod_as_read(&current).await? {
                    replaced = true;
                    break;
                }
                // 409: the pod changed since we read it. Read again; if the
                // record is no longer ours to act on, stop.
                if let Record::Live { epoch, .. } = self.read_record(name).await? {
                    if self.config.conditional_writes && epoch > ours {
                        return Err(RestartError::StaleEpoch {
                            service: name.to_string(),
                            stored: epoch,
                            ours,
                        });
                    }
                }
                match self.pods.get_opt(&current.name_any()).await {
                    Ok(Some(p)) => current = p,
                    Ok(None) => {
                        replaced = true;
                        break;
                    }
                    Err(e) => return Err(api_error("read pod", e).into()),
                }
            }
            if !replaced {
                return Err(too_many_conflicts(&format!("pod {}", current.name_any())).into());
            }
            // The same pod again: same spec, labels and name (same DNS name).
            let mut again = current.clone();
            again.metadata.resource_version = None;
            again.metadata.uid = None;
            again.metadata.creation_timestamp = None;
            again.metadata.deletion_timestamp = None;
            again.metadata.managed_fields = None;
            again.status = None;
            let restarts = pod_annotation_u32(&current, RESTARTS_ANNOTATION) + 1;
            again
                .metadata
                .annotations
                .get_or_insert_with(BTreeMap::new)
                .insert(RESTARTS_ANNOTATION.to_string(), restarts.to_string());
            let index = pod_index(&current);
            match self.pods.create(&PostParams::default(), &again).await {
                Ok(_) => {
                    let _ = self.events.send(ServiceEvent {
                        service: name.to_string(),
                        process: Some(index),
                        kind: ServiceEventKind::Started { pid: 0 },
                    });
                }
                Err(e) => {
                    return Err(RestartError::Spawn {
                        service: name.to_string(),
                        process: index,
                        program: current
                            .spec
                            .as_ref()
                            .and_then(|s| s.containers.first())
                            .and_then(|c| c.command.as_ref())
                            .and_then(|c| c.first())
                            .cloned()
                            .unwrap_or_default()
                            .into(),
                        source: std::io::Error::other(e.to_string()),
                    })
                }
            }
        }
        Ok(self.status_when_ready(&record).await?)
    }

    async fn list_inner(&self) -> Result<Vec<ServiceStatus>, StateError> {
        let lp = ListParams::default().labels(&objects::live_selector(&self.config.environment));
        let records = self
            .services
            .list(&lp)
            .await
            .map_err(|e| api_error("list services", e))?
            .items;
        let lp =
            ListParams::default().labels(&objects::environment_selector(&self.config.environment));
        let pods = self
            .pods
            .list(&lp)
            .await
            .map_err(|e| api_error("list pods", e))?
            .items;
        let mut out: Vec<ServiceStatus> = records
            .iter()
            .map(|r| {
                let name = r.name_any();
                let mut mine: Vec<Pod> = pods
                    .iter()
                    .filter(|p| p.labels().get(objects::SERVICE_LABEL) == Some(&name))
                    .cloned()
                    .collect();
                mine.sort_by_key(pod_index);
                self.status_of(r, &mine)
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

fn pod_index(p: &Pod) -> usize {
    p.labels()
        .get(PROCESS_LABEL)
        .and_then(|i| i.parse().ok())
        .unwrap_or(usize::MAX)
}

fn pod_ip(p: &Pod) -> Option<IpAddr> {
    p.status.as_ref()?.pod_ip.as_ref()?.parse().ok()
}

fn pod_running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

fn pod_annotation_u32(p: &Pod, key: &str) -> u32 {
    p.annotations()
        .get(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Replacements by `restart_service` plus the kubelet's in-place restarts.
fn pod_restarts(p: &Pod) -> u32 {
    let kubelet: i32 = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).sum())
        .unwrap_or(0);
    pod_annotation_u32(p, RESTARTS_ANNOTATION) + u32::try_from(kubelet).unwrap_or(0)
}

fn container_restarts(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).sum())
        .unwrap_or(0)
}

/// Watches the environment's pods and turns what happens to them into
/// [`ServiceEvent`]s. A watch that ends or fails (the API server drops it,
/// or answers 410 Gone) is followed by a fresh list and a new watch from
/// the list's resourceVersion, so no change is missed for long.
async fn watch_pods(pods: Api<Pod>, selector: String, events: broadcast::Sender<ServiceEvent>) {
    let mut known: BTreeMap<String, (Option<String>, i32)> = BTreeMap::new();
    loop {
        let list = match pods.list(&ListParams::default().labels(&selector)).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("listing pods for the watch failed: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        let mut now = BTreeMap::new();
        for p in &list.items {
            now.insert(p.name_any(), (p.uid(), container_restarts(p)));
        }
        // What changed while we were not watching.
        for (name, (uid, _)) in &known {
            if now.get(name).map(|(u, _)| u) != Some(uid) {
                emit_exit(&events, name, "deleted while the watch was down");
            }
        }
        known = now;
        let wp = WatchParams::default().labels(&selector).timeout(290);
        let stream = match pods.watch(&wp, &version).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("watching pods failed: {e}; listing again");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut stream = std::pin::pin!(stream.into_stream());
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(p)) => {
                    known.insert(p.name_any(), (p.uid(), container_restarts(&p)));
                }
                Ok(WatchEvent::Modified(p)) => {
                    let restarts = container_restarts(&p);
                    let before = known.insert(p.name_any(), (p.uid(), restarts));
                    if before.is_some_and(|(_, r)| restarts > r) {
                        emit_exit(
                            &events,
                            &p.name_any(),
                            "the container exited; the kubelet restarted it",
                        );
                    }
                }
                Ok(WatchEvent::Deleted(p)) => {
                    known.remove(&p.name_any());
                    emit_exit(&events, &p.name_any(), "pod deleted");
                }
                Ok(WatchEvent::Bookmark(_)) => {}
                Ok(WatchEvent::Error(status)) => {
                    tracing::info!("watch error {}: listing again", status.code);
                    break;
                }
                Err(e) => {
                    tracing::info!("watch failed: {e}; listing again");
                    break;
                }
            }
        }
        tracing::debug!("pod watch ended; listing and watching again");
    }
}

fn emit_exit(events: &broadcast::Sender<ServiceEvent>, pod: &str, status: &str) {
    let (service, index) = match pod.rsplit_once('-') {
        Some((s, i)) => (s.to_string(), i.parse().ok()),
        None => (pod.to_string(), None),
    };
    let _ = events.send(ServiceEvent {
        service,
        process: index,
        kind: ServiceEventKind::Exited {
            pid: 0,
            status: status.to_string(),
        },
    });
}

#[async_trait::async_trait]
impl Orchestrator for KubernetesOrchestrator {
    fn epoch(&self) -> u64 {
        self.config.epoch
    }

    async fn ensure_service(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        self.ensure(config).await
    }

    async fn drop_service(&self, name: &str) -> Result<bool, DropError> {
        self.drop_inner(name).await
    }

    async fn restart_service(&self, name: &str) -> Result<ServiceStatus, RestartError> {
        self.restart_inner(name).await
    }

    async fn list_services(&self) -> Result<Vec<ServiceStatus>, ListError> {
        Ok(self.list_inner().await?)
    }

    fn watch_services(&self) -> broadcast::Receiver<ServiceEvent> {
        let receiver = self.events.subscribe();
        let mut watcher = self.watcher.lock().expect("poisoned");
        if watcher.is_none() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                *watcher = Some(runtime.spawn(watch_pods(
                    self.pods.clone(),
                    objects::environment_selector(&self.config.environment),
                    self.events.clone(),
                )));
            }
        }
        receiver
    }
}

/// The owner reference of the environment's own object, for
/// [`KubernetesOrchestratorConfig::owner`].
pub fn owner_reference(api_version: &str, kind: &str, name: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: api_version.to_string(),
        kind: kind.to_string(),
        name: name.to_string(),
        uid: uid.to_string(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    }
}
