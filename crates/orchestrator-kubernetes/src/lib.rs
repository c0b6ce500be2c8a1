//! lockstep's Kubernetes orchestrator backend: [`KubernetesOrchestrator`]
//! implements [`Orchestrator`] with kube and k8s-openapi.
//!
//! # Objects
//!
//! A service `NAME` of `scale` processes is, in the configured namespace:
//!
//! - a headless Service `NAME` (`clusterIP: None`): the service's **record**
//!   (labels [`EPOCH_LABEL`], [`ID_LABEL`], `lockstep/state: live`; the
//!   config's labels, the current *generation* and the pods' template
//!   ([`objects::PodTemplate`]) in annotations) and the DNS domain of its
//!   pods;
//! - one pod `NAME-I` per process (hostname `NAME-I`, subdomain `NAME`), so
//!   process *I* is `NAME-I.NAME.NAMESPACE.svc.DOMAIN` for its peers, with
//!   its generation in the env [`objects::GENERATION_ENV`]
//!   (`LOCKSTEP_GENERATION`) and the label [`objects::GENERATION_KEY`], and
//!   `restartPolicy: Always` (the kubelet restarts a container that exits in
//!   place; the backend then restarts the whole service, see *Shared fate*);
//! - a Secret `NAME-env` with the config's environment (the replica's session
//!   key among it), passed to the container with `envFrom`, labelled with
//!   the epoch that wrote it: it is replaced only by a write with the
//!   resourceVersion read, and never by a controller older than that epoch
//!   ([`EnsureError::StaleEpoch`]).
//!
//! And once per environment, a Secret `ENVIRONMENT-master`: the master
//! secret every replica's session key is derived from
//! ([`KubernetesOrchestrator::master_secret`]; created once, never replaced).
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
//!   The write keeps the record's generation. Then the Secret and the pods:
//!   if none exists, every pod is created in the record's generation; if
//!   every pod has the spec hash of its process in that generation (the
//!   hash covers program, image, arguments, environment, ports and the
//!   generation) and none died, they are kept and relabelled (adopted);
//!   anything else (a changed spec, a pod missing, dead or of another
//!   generation) is a whole restart as `restart_service` does it, with the
//!   new spec. Finally it reads the record once more: if a newer
//!   controller took it over meanwhile, it deletes the pods it created (with
//!   preconditions) and refuses.
//! - `drop_service` turns the record into a tombstone (a write with the
//!   record's resourceVersion, or a create), then deletes the service's pods
//!   and Secret, each with the uid and resourceVersion it read. A 409 on a
//!   pod means it changed (re-created by someone else): it reads again and
//!   decides again.
//! - `restart_service` is kill all, then start all: it checks the record's
//!   epoch, raises the record's generation by one (a write with the
//!   resourceVersion read; a 409 is read and decided again, a newer epoch
//!   refused), deletes every pod with preconditions, waits until all are
//!   gone, reads the record again (still ours, still our generation) and
//!   only then creates every pod from the record's template in the new
//!   generation.
//!
//! # Shared fate
//!
//! The processes of a replica form one timely cluster and must start
//! together: a process started alone joins peers of another incarnation,
//! which panic on the closed sockets of the one that died, and with the
//! kubelet restarting each container in place (each with its own
//! CrashLoopBackOff) they may never form a mesh again. So, as in the process
//! backend, a service's pods live and die as one generation (the replica's
//! mesh refuses a peer of another generation), and the backend restarts the
//! whole service as a new generation when one of its pods dies:
//!
//! - While it runs: the pod watch (started by the first
//!   [`watch_services`](Orchestrator::watch_services)) tells a shared-fate
//!   task of every container restart (`restartCount` up), failed pod
//!   (phase `Failed`) and deleted pod. The task gathers them for
//!   [`KubernetesOrchestratorConfig::shared_fate_delay`] (1 s), so pods
//!   dying together cause one restart, then, under this orchestrator's lock
//!   of the service (its own ensure, drop and restart hold it too, so their
//!   deletes and creates are never taken for deaths), reads the record and
//!   the pods and restarts the service as a whole if a pod of the current
//!   generation is missing, being deleted, failed, restarted in place, or
//!   of another generation or spec. Not a service of a newer epoch, not a
//!   dropped one, and not one whose generation moved since it looked
//!   (someone else restarted it): those end quietly. A restart that fails
//!   is tried again after a second.
//! - Across an environment restart: every list of the watch (the first, and
//!   each re-list after a dropped watch) checks every live service the same
//!   way, so a pod that died while no environment ran (its container
//!   `restartCount` above 0: a fresh pod starts at 0) restarts the whole
//!   service; a service where nothing died keeps its pods.
//!
//! The bound: a death is acted on within the watch's latency plus the
//! delay, and the new generation runs after the old pods' graceful shutdown
//! (at most [`KubernetesOrchestratorConfig::delete_timeout`]). Between the
//! death and the restart the kubelet may restart the container in place
//! (`restartPolicy: Always`); that incarnation is replaced with the rest.
//!
//! The orphan rules are unchanged and see only [`list_services`]: they run
//! against this backend through the trait.
//!
//! # Testing without a cluster
//!
//! `lockstep_kube_double::ApiServerDouble` (its own crate,
//! `crates/kube-double`: test machinery stays out of this library) is a
//! stateful in-memory Kubernetes API server behind a real [`kube::Client`]:
//! resourceVersions, uids, preconditions, label selectors, list and watch,
//! with fault injection.
//! The request-level tests (`tests/requests.rs`) use `tower-test` to pin
//! the exact HTTP requests.
//!
//! [`list_services`]: Orchestrator::list_services

pub mod objects;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
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
use tokio::sync::{broadcast, mpsc};

use crate::objects::{
    ObjectContext, PodTemplate, DROPPED_BY_LABEL, GENERATION_KEY, LABELS_ANNOTATION, PROCESS_LABEL,
    RESTARTS_ANNOTATION, SERVICE_LABEL, SPEC_HASH_ANNOTATION, STATE_LABEL, TEMPLATE_ANNOTATION,
};

/// How often a write is decided again after a 409 Conflict before the call
/// gives up with an error.
pub const CONFLICT_ATTEMPTS: usize = 5;

/// How long the shared-fate task waits before it retries a whole restart
/// that failed (an API error, a pod that would not go).
const SHARED_FATE_RETRY: Duration = Duration::from_secs(1);

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
    /// Whether the backend restarts a whole service (a new generation) when
    /// one of its pods dies (shared fate; see the crate docs). On by
    /// default; only tests of the watch alone turn it off.
    pub shared_fate: bool,
    /// How long the shared-fate task gathers pod deaths before it acts, so
    /// that pods dying together cause one restart.
    pub shared_fate_delay: Duration,
}

impl KubernetesOrchestratorConfig {
    /// Defaults: environment `lockstep`, image `lockstep:latest`, domain
    /// `cluster.local`, ports from 2100, conditional writes on, 60 s waits,
    /// shared fate on with a 1 s delay.
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
            shared_fate: true,
            shared_fate_delay: Duration::from_secs(1),
        }
    }
}

/// The Kubernetes backend. Cheap to share behind an `Arc`; dropping it stops
/// its watch and shared-fate tasks.
pub struct KubernetesOrchestrator {
    inner: Arc<Inner>,
    /// The pod watch and the shared-fate task, started by the first
    /// `watch_services`.
    tasks: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

/// What the orchestrator and its tasks share.
struct Inner {
    config: KubernetesOrchestratorConfig,
    services: Api<Service>,
    pods: Api<Pod>,
    secrets: Api<Secret>,
    events: broadcast::Sender<ServiceEvent>,
    /// One lock per service: this orchestrator's ensure, drop, restart and
    /// shared-fate restarts of a service never interleave, so the
    /// shared-fate check never sees a half-done write of our own.
    locks: std::sync::Mutex<BTreeMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for KubernetesOrchestrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesOrchestrator")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Drop for KubernetesOrchestrator {
    fn drop(&mut self) {
        for task in self.tasks.lock().expect("poisoned").drain(..) {
            task.abort();
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

/// The record's current generation (0 if it has none).
fn generation_of(record: &Service) -> u64 {
    label_u64(record.annotations(), GENERATION_KEY).unwrap_or(0)
}

/// The pod template kept in the record.
fn template_of(record: &Service) -> Result<PodTemplate, StateError> {
    record
        .annotations()
        .get(TEMPLATE_ANNOTATION)
        .and_then(|t| serde_json::from_str(t).ok())
        .ok_or_else(|| StateError::Corrupt {
            path: format!("kubernetes: service {}", record.name_any()).into(),
            reason: format!(
                "the record has no readable {TEMPLATE_ANNOTATION} annotation: ensure the service again"
            ),
        })
}

/// Why a whole restart of a service of our own stopped short, besides an
/// error of the API.
#[derive(Debug)]
enum GenerationError {
    /// A newer epoch owns the record: not ours to act on.
    Stale { stored: u64 },
    /// The record is gone (`None`) or a tombstone (`Some(by)`).
    Gone { dropped_by: Option<u64> },
    /// Someone else started another generation meanwhile.
    Superseded,
    /// A pod could not be created.
    Spawn {
        process: usize,
        program: String,
        source: std::io::Error,
    },
    /// The API failed.
    State(StateError),
}

impl From<StateError> for GenerationError {
    fn from(e: StateError) -> Self {
        GenerationError::State(e)
    }
}

impl GenerationError {
    fn into_restart(self, name: &str, ours: u64) -> RestartError {
        match self {
            GenerationError::Stale { stored } => RestartError::StaleEpoch {
                service: name.to_string(),
                stored,
                ours,
            },
            GenerationError::Gone { .. } => RestartError::NoSuchService(name.to_string()),
            GenerationError::Superseded => RestartError::State(StateError::Io {
                path: format!("kubernetes: service {name}").into(),
                source: std::io::Error::other(
                    "another whole restart started a newer generation meanwhile",
                ),
            }),
            GenerationError::Spawn {
                process,
                program,
                source,
            } => RestartError::Spawn {
                service: name.to_string(),
                process,
                program: program.into(),
                source,
            },
            GenerationError::State(e) => RestartError::State(e),
        }
    }

    fn into_ensure(self, name: &str, ours: u64) -> EnsureError {
        match self {
            GenerationError::Stale { stored } => EnsureError::StaleEpoch {
                service: name.to_string(),
                stored,
                ours,
            },
            GenerationError::Gone {
                dropped_by: Some(by),
            } => EnsureError::DroppedByNewer {
                service: name.to_string(),
                dropped_at: by,
                ours,
            },
            GenerationError::Spawn {
                program, source, ..
            } => EnsureError::Spawn {
                service: name.to_string(),
                program: program.into(),
                source,
            },
            GenerationError::State(e) => EnsureError::State(e),
            other => EnsureError::State(StateError::Io {
                path: format!("kubernetes: service {name}").into(),
                source: std::io::Error::other(format!(
                    "the record changed while its pods were replaced: {other:?}"
                )),
            }),
        }
    }
}

/// What the pod watch asks the shared-fate task to look at.
#[derive(Debug)]
enum Check {
    /// Every live service (after a list: what happened while nobody watched).
    All,
    /// One service, whose pod died or went.
    Service(String),
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
    /// from `kube::Client::try_default()`, or the tests' API server double),
    /// Sends no request until called; the first
    /// [`watch_services`](Orchestrator::watch_services) starts a task that
    /// watches the environment's pods and, with
    /// [`KubernetesOrchestratorConfig::shared_fate`], the task that restarts
    /// a service whose pod died.
    pub fn new(client: Client, config: KubernetesOrchestratorConfig) -> Self {
        let ns = config.namespace.as_str();
        let (events, _) = broadcast::channel(1024);
        KubernetesOrchestrator {
            inner: Arc::new(Inner {
                services: Api::namespaced(client.clone(), ns),
                pods: Api::namespaced(client.clone(), ns),
                secrets: Api::namespaced(client, ns),
                config,
                events,
                locks: std::sync::Mutex::new(BTreeMap::new()),
            }),
            tasks: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KubernetesOrchestratorConfig {
        &self.inner.config
    }

    /// The environment's master secret, from which every replica's session
    /// key is derived: 32 bytes in the Secret `ENVIRONMENT-master`
    /// ([`objects::master_secret_name`]). Read if it exists; otherwise
    /// created once with 32 bytes from the OS's random source (a create is
    /// atomic: if another environment created it first, 409, its bytes are
    /// read back). Never replaced, so every start of the environment gets the
    /// same key for each replica (the state directory of a pod is an
    /// emptyDir, which a file there would not survive).
    pub async fn master_secret(&self) -> Result<[u8; 32], StateError> {
        self.inner.master_secret().await
    }
}

impl Inner {
    fn delete_params<K: kube::Resource>(&self, object: &K) -> DeleteParams {
        if self.config.delete_preconditions {
            preconditions_of(object)
        } else {
            DeleteParams::default()
        }
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

    /// This orchestrator's lock of service `name`.
    async fn lock(&self, name: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = Arc::clone(
            self.locks
                .lock()
                .expect("poisoned")
                .entry(name.to_string())
                .or_default(),
        );
        lock.lock_owned().await
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

    /// The record if it is live and ours to act on (not of a newer epoch).
    async fn live_record(&self, name: &str) -> Result<Service, GenerationError> {
        match self.read_record(name).await? {
            Record::Missing => Err(GenerationError::Gone { dropped_by: None }),
            Record::Dropped { by, .. } => Err(GenerationError::Gone {
                dropped_by: Some(by),
            }),
            Record::Live { epoch, .. }
                if self.config.conditional_writes && epoch > self.config.epoch =>
            {
                Err(GenerationError::Stale { stored: epoch })
            }
            Record::Live { service, .. } => Ok(*service),
        }
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
    /// on a 409. It keeps the stored generation (a new record starts at 1,
    /// one over a tombstone at the tombstone's generation + 1). Returns the
    /// written record.
    async fn write_record(
        &self,
        config: &ServiceConfig,
        template: &PodTemplate,
    ) -> Result<Service, EnsureError> {
        let ours = self.config.epoch;
        let ctx = self.context();
        for _ in 0..CONFLICT_ATTEMPTS {
            let read = self.read_record(&config.name).await?;
            let generation = match &read {
                Record::Missing => 1,
                Record::Dropped { service, .. } => generation_of(service) + 1,
                Record::Live { service, .. } => generation_of(service),
            };
            let mut desired = objects::service(&ctx, config, generation, template);
            let result = match read {
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

    /// Writes the Secret with the service's environment (its session key):
    /// created if missing, kept if equal, else replaced by a write with the
    /// resourceVersion read. Fenced like the record: a Secret labelled with
    /// a newer epoch is that controller's, and is not overwritten
    /// ([`EnsureError::StaleEpoch`]).
    async fn write_secret(&self, config: &ServiceConfig) -> Result<(), EnsureError> {
        let name = objects::secret_name(&config.name);
        let ours = self.config.epoch;
        for _ in 0..CONFLICT_ATTEMPTS {
            let mut desired = objects::secret(&self.context(), config);
            let result = match self
                .secrets
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read secret", e))?
            {
                None => self.secrets.create(&PostParams::default(), &desired).await,
                Some(s)
                    if self.config.conditional_writes
                        && label_u64(s.labels(), EPOCH_LABEL).is_some_and(|e| e > ours) =>
                {
                    return Err(EnsureError::StaleEpoch {
                        service: config.name.clone(),
                        stored: label_u64(s.labels(), EPOCH_LABEL).unwrap_or(0),
                        ours,
                    })
                }
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
                Err(e) => return Err(api_error("write secret", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("secret {name}")).into())
    }

    async fn master_secret(&self) -> Result<[u8; 32], StateError> {
        let name = objects::master_secret_name(&self.config.environment);
        let corrupt = |reason: String| StateError::Corrupt {
            path: format!("kubernetes: secret {name}").into(),
            reason,
        };
        for _ in 0..CONFLICT_ATTEMPTS {
            match self
                .secrets
                .get_opt(&name)
                .await
                .map_err(|e| api_error("read secret", e))?
            {
                Some(s) => {
                    if s.labels()
                        .get(objects::MANAGED_BY_LABEL)
                        .map(String::as_str)
                        != Some(objects::MANAGED_BY)
                    {
                        return Err(corrupt(
                            "a Secret of this name exists and is not managed by lockstep".into(),
                        ));
                    }
                    let bytes = s
                        .data
                        .as_ref()
                        .and_then(|d| d.get(objects::MASTER_SECRET_KEY))
                        .map(|b| b.0.as_slice())
                        .unwrap_or_default();
                    return <[u8; 32]>::try_from(bytes).map_err(|_| {
                        corrupt(format!(
                            "its {:?} holds {} bytes, not 32: delete it only if no replica of this environment runs",
                            objects::MASTER_SECRET_KEY,
                            bytes.len()
                        ))
                    });
                }
                None => {
                    let mut secret = [0u8; 32];
                    std::io::Read::read_exact(
                        &mut std::fs::File::open("/dev/urandom").map_err(|source| {
                            StateError::Io {
                                path: "/dev/urandom".into(),
                                source,
                            }
                        })?,
                        &mut secret,
                    )
                    .map_err(|source| StateError::Io {
                        path: "/dev/urandom".into(),
                        source,
                    })?;
                    let desired = objects::master_secret(&self.context(), &secret);
                    match self.secrets.create(&PostParams::default(), &desired).await {
                        Ok(_) => {
                            tracing::info!(secret = %name, "created the master secret");
                            return Ok(secret);
                        }
                        // Another environment created it first: read theirs.
                        Err(e) if is_conflict(&e) => continue,
                        Err(e) => return Err(api_error("create secret", e)),
                    }
                }
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

    /// The objects' context for pods of `record`: labelled with the record's
    /// epoch (a whole restart does not take a service over).
    fn context_of(&self, record: &Service) -> ObjectContext {
        let mut ctx = self.context();
        ctx.epoch = label_u64(record.labels(), EPOCH_LABEL).unwrap_or(ctx.epoch);
        ctx
    }

    /// Creates every pod of `record`'s template in `generation`; `restarts`
    /// gives each one's [`RESTARTS_ANNOTATION`]. Returns (name, uid) of each.
    async fn create_pods(
        &self,
        record: &Service,
        template: &PodTemplate,
        generation: u64,
        restarts: impl Fn(usize) -> u32,
    ) -> Result<Vec<(String, String)>, GenerationError> {
        let ctx = self.context_of(record);
        let name = record.name_any();
        let id = label_u64(record.labels(), ID_LABEL).unwrap_or(0);
        let mut created = Vec::new();
        for i in 0..template.argv.len() {
            let pod = objects::pod(&ctx, &name, id, template, i, generation, restarts(i));
            match self.pods.create(&PostParams::default(), &pod).await {
                Ok(p) => created.push((p.name_any(), p.uid().unwrap_or_default())),
                Err(e) if is_conflict(&e) => {
                    // Someone created it between our delete and our create.
                    let now = self.live_record(&name).await?;
                    if generation_of(&now) != generation {
                        return Err(GenerationError::Superseded);
                    }
                    return Err(api_error("create pod", e).into());
                }
                Err(e) => {
                    return Err(GenerationError::Spawn {
                        process: i,
                        program: template.program.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })
                }
            }
        }
        Ok(created)
    }

    /// Compare-and-swap of the record's generation to one more than it is.
    /// With `expected`, only if it still is `expected` (a shared-fate restart
    /// decided on it: if it moved, someone else restarted the service).
    async fn bump_generation(
        &self,
        name: &str,
        mut record: Service,
        expected: Option<u64>,
    ) -> Result<Service, GenerationError> {
        for _ in 0..CONFLICT_ATTEMPTS {
            let generation = generation_of(&record);
            if expected.is_some_and(|e| e != generation) {
                return Err(GenerationError::Superseded);
            }
            let mut next = record.clone();
            next.metadata.managed_fields = None;
            next.annotations_mut()
                .insert(GENERATION_KEY.to_string(), (generation + 1).to_string());
            match self
                .services
                .replace(name, &PostParams::default(), &next)
                .await
            {
                Ok(s) => return Ok(s),
                Err(e) if is_conflict(&e) => {
                    tracing::info!(
                        service = name,
                        "record changed under us (409): reading again"
                    );
                    record = self.live_record(name).await?;
                }
                Err(e) => return Err(api_error("write service", e).into()),
            }
        }
        Err(too_many_conflicts(&format!("service {name}")).into())
    }

    /// Kill all, then start all: the record's generation goes up by one
    /// (compare-and-swap, fenced by the epoch), every pod of the service is
    /// deleted as read (preconditions) and waited for until gone, then every
    /// pod is created from the record's template in the new generation.
    /// `record` is the live record as last read; `expected`: see
    /// [`Inner::bump_generation`]; `keep_restarts`: the new pods count one
    /// restart more than the old ones (`false`: a new spec, from 0).
    /// Returns the record and the pods created.
    async fn new_generation(
        &self,
        name: &str,
        record: Service,
        expected: Option<u64>,
        keep_restarts: bool,
    ) -> Result<(Service, Vec<(String, String)>), GenerationError> {
        let template = template_of(&record)?;
        let record = self.bump_generation(name, record, expected).await?;
        let generation = generation_of(&record);
        let mut restarts: BTreeMap<usize, u32> = BTreeMap::new();
        let mut gone = false;
        for _ in 0..CONFLICT_ATTEMPTS {
            let pods = self.service_pods(name).await?;
            for p in &pods {
                let r = restarts.entry(pod_index(p)).or_default();
                *r = (*r).max(pod_annotation_u32(p, RESTARTS_ANNOTATION));
            }
            // Every delete first, then every wait: the pods shut down together.
            let mut deleted = Vec::new();
            let mut conflicts = 0;
            for p in &pods {
                match self
                    .pods
                    .delete(&p.name_any(), &self.delete_params(p))
                    .await
                {
                    Ok(_) => deleted.push((p.name_any(), p.uid())),
                    Err(e) if is_conflict(&e) => conflicts += 1,
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(api_error("delete pod", e).into()),
                }
            }
            for (pod, uid) in deleted {
                self.wait_gone(&pod, uid).await?;
            }
            if conflicts == 0 {
                gone = true;
                break;
            }
            // A pod changed since we read it: read again, if the service is
            // still ours to act on.
            tracing::info!(
                service = name,
                "a pod changed under us (409): reading again"
            );
            if generation_of(&self.live_record(name).await?) != generation {
                return Err(GenerationError::Superseded);
            }
        }
        if !gone {
            return Err(too_many_conflicts(&format!("pods of {name}")).into());
        }
        // Still ours, and still our generation, before anything starts.
        let record = self.live_record(name).await?;
        if generation_of(&record) != generation {
            return Err(GenerationError::Superseded);
        }
        let base = restarts.values().copied().max().unwrap_or(0);
        let created = self
            .create_pods(&record, &template, generation, |i| {
                if keep_restarts {
                    restarts.get(&i).copied().unwrap_or(base) + 1
                } else {
                    0
                }
            })
            .await?;
        tracing::info!(
            service = name,
            generation,
            "started every pod of the service as a new generation"
        );
        Ok((record, created))
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
        let _lock = self.lock(&config.name).await;
        let ours = self.config.epoch;
        let name = config.name.clone();
        let template = objects::template(&self.context(), &config);
        let mut record = self.write_record(&config, &template).await?;
        self.write_secret(&config).await?;
        let mut created = Vec::new();
        let mut decided = false;
        for _ in 0..CONFLICT_ATTEMPTS {
            let generation = generation_of(&record);
            let pods = self.service_pods(&name).await?;
            if pods.is_empty() {
                // Nothing runs: every pod starts in the record's generation.
                created = self
                    .create_pods(&record, &template, generation, |_| 0)
                    .await
                    .map_err(|e| e.into_ensure(&name, ours))?;
                decided = true;
                break;
            }
            let ctx = self.context();
            let desired: Vec<Pod> = (0..config.scale)
                .map(|i| objects::pod(&ctx, &name, config.id, &template, i, generation, 0))
                .collect();
            if adoptable(&pods, &desired) {
                // Adopt: relabel with our epoch, CAS on what we read.
                let mut conflict = false;
                for (p, d) in pods.iter().zip(&desired) {
                    if p.labels() == d.labels() {
                        continue;
                    }
                    let mut relabelled = p.clone();
                    relabelled.metadata.labels = d.metadata.labels.clone();
                    match self
                        .pods
                        .replace(&p.name_any(), &PostParams::default(), &relabelled)
                        .await
                    {
                        Ok(_) => {}
                        Err(e) if is_conflict(&e) => {
                            tracing::info!(pod = %p.name_any(), "pod changed under us (409): reading again");
                            conflict = true;
                            break;
                        }
                        Err(e) => return Err(api_error("write pod", e).into()),
                    }
                }
                if conflict {
                    continue;
                }
                decided = true;
                break;
            }
            // A changed spec, a pod missing or dead, a pod of another
            // generation: shared fate, every pod goes and a new generation
            // starts.
            let (r, c) = self
                .new_generation(&name, record, None, false)
                .await
                .map_err(|e| e.into_ensure(&name, ours))?;
            record = r;
            created = c;
            decided = true;
            break;
        }
        if !decided {
            return Err(too_many_conflicts(&format!("pods of {name}")).into());
        }
        // Did a newer controller take the record over while we wrote pods?
        // Then its deletes may have missed the pods we created: remove them.
        match self.read_record(&name).await? {
            Record::Live { epoch, .. } if self.config.conditional_writes && epoch > ours => {
                self.remove_created(&created).await;
                return Err(EnsureError::StaleEpoch {
                    service: name,
                    stored: epoch,
                    ours,
                });
            }
            Record::Dropped { by, .. } if self.config.conditional_writes && by > ours => {
                self.remove_created(&created).await;
                return Err(EnsureError::DroppedByNewer {
                    service: name,
                    dropped_at: by,
                    ours,
                });
            }
            _ => {}
        }
        self.announce(&name, &created);
        Ok(self.status_when_ready(&record).await?)
    }

    /// `Started` for each pod created.
    fn announce(&self, service: &str, created: &[(String, String)]) {
        for (pod, _) in created {
            let index = pod.rsplit('-').next().and_then(|i| i.parse().ok());
            let _ = self.events.send(ServiceEvent {
                service: service.to_string(),
                process: index,
                kind: ServiceEventKind::Started { pid: 0 },
            });
        }
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
        let _lock = self.lock(name).await;
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
                    // The generation goes on: a service created again
                    // under this name starts after it.
                    if let Some(g) = service.annotations().get(GENERATION_KEY) {
                        t.annotations_mut()
                            .insert(GENERATION_KEY.to_string(), g.clone());
                    }
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
        let _lock = self.lock(name).await;
        let ours = self.config.epoch;
        let record = self
            .live_record(name)
            .await
            .map_err(|e| e.into_restart(name, ours))?;
        let (record, created) = self
            .new_generation(name, record, None, true)
            .await
            .map_err(|e| e.into_restart(name, ours))?;
        self.announce(name, &created);
        Ok(self.status_when_ready(&record).await?)
    }

    /// Shared fate: restarts service `name` as a whole (a new generation)
    /// if a pod of its current generation died, went or is missing, or a
    /// pod of another generation or spec runs. Under the service's lock, so
    /// a write of our own in progress is never mistaken for a death. Quiet
    /// when the service is not ours to act on (dropped, a newer epoch, or
    /// restarted by someone else meanwhile).
    async fn check_shared_fate(&self, name: &str) -> Result<(), StateError> {
        let _lock = self.lock(name).await;
        let record = match self.live_record(name).await {
            Ok(r) => r,
            Err(GenerationError::State(e)) => return Err(e),
            Err(_) => return Ok(()),
        };
        let Ok(template) = template_of(&record) else {
            return Ok(());
        };
        let generation = generation_of(&record);
        let pods = self.service_pods(name).await?;
        let Some(reason) = shared_fate_reason(&pods, &template, generation) else {
            return Ok(());
        };
        tracing::warn!(
            service = name,
            generation = generation + 1,
            "{reason}: restarting every pod of the service (shared fate)"
        );
        match self
            .new_generation(name, record, Some(generation), true)
            .await
        {
            Ok((_, created)) => {
                self.announce(name, &created);
                Ok(())
            }
            Err(GenerationError::State(e)) => Err(e),
            Err(GenerationError::Spawn {
                process, source, ..
            }) => Err(StateError::Io {
                path: format!("kubernetes API: pod {}", objects::pod_name(name, process)).into(),
                source,
            }),
            Err(other) => {
                tracing::info!(
                    service = name,
                    "shared-fate restart not ours to finish: {other:?}"
                );
                Ok(())
            }
        }
    }

    async fn list_records(&self) -> Result<Vec<Service>, StateError> {
        let lp = ListParams::default().labels(&objects::live_selector(&self.config.environment));
        Ok(self
            .services
            .list(&lp)
            .await
            .map_err(|e| api_error("list services", e))?
            .items)
    }

    async fn list_inner(&self) -> Result<Vec<ServiceStatus>, StateError> {
        let records = self.list_records().await?;
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

/// Whether `pods` (sorted by index) are exactly `desired`, alive: same
/// names, same spec hash (so the same generation), none dead or going.
fn adoptable(pods: &[Pod], desired: &[Pod]) -> bool {
    pods.len() == desired.len()
        && pods.iter().zip(desired).all(|(p, d)| {
            p.name_any() == d.name_any()
                && p.metadata.deletion_timestamp.is_none()
                && p.annotations().get(SPEC_HASH_ANNOTATION)
                    == d.annotations().get(SPEC_HASH_ANNOTATION)
                && !pod_dead(p)
        })
}

/// Why the pods of a service of generation `generation` and pod template
/// `template` need a whole restart, if they do.
fn shared_fate_reason(pods: &[Pod], template: &PodTemplate, generation: u64) -> Option<String> {
    for (i, hash) in template.hash.iter().enumerate() {
        let Some(p) = pods.iter().find(|p| pod_index(p) == i) else {
            return Some(format!("the pod of process {i} is gone"));
        };
        let name = p.name_any();
        if p.metadata.deletion_timestamp.is_some() {
            return Some(format!("pod {name} is being deleted"));
        }
        let of = label_u64(p.labels(), GENERATION_KEY).unwrap_or(0);
        if of != generation {
            return Some(format!(
                "pod {name} is of generation {of}, the service of {generation}"
            ));
        }
        if p.annotations().get(SPEC_HASH_ANNOTATION) != Some(&objects::spec_hash(hash, generation))
        {
            return Some(format!("pod {name} does not run the service's spec"));
        }
        let restarts = container_restarts(p);
        if restarts > 0 {
            return Some(format!(
                "the container of pod {name} exited (restarted in place {restarts} times)"
            ));
        }
        if pod_failed(p) {
            return Some(format!("pod {name} failed"));
        }
    }
    None
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

/// The pod's phase says its containers ended (evicted, or failed for good).
fn pod_failed(p: &Pod) -> bool {
    matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    )
}

/// A process of the pod died: its container restarted in place, or the pod failed.
fn pod_dead(p: &Pod) -> bool {
    container_restarts(p) > 0 || pod_failed(p)
}

fn pod_annotation_u32(p: &Pod, key: &str) -> u32 {
    p.annotations()
        .get(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Replacements by `restart_service` plus the kubelet's in-place restarts.
fn pod_restarts(p: &Pod) -> u32 {
    pod_annotation_u32(p, RESTARTS_ANNOTATION) + u32::try_from(container_restarts(p)).unwrap_or(0)
}

fn container_restarts(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).sum())
        .unwrap_or(0)
}

/// What the watch remembers of a pod: uid, container restarts, failed.
type Seen = (Option<String>, i32, bool);

fn seen(p: &Pod) -> Seen {
    (p.uid(), container_restarts(p), pod_failed(p))
}

/// Watches the environment's pods and turns what happens to them into
/// [`ServiceEvent`]s, and (with `fate`) into checks for the shared-fate
/// task: every list asks it to check every service, every death of a pod
/// (its container restarted, it failed, it was deleted) its service. A
/// watch that ends or fails (the API server drops it, or answers 410 Gone)
/// is followed by a fresh list and a new watch from the list's
/// resourceVersion, so no change is missed for long.
async fn watch_pods(
    pods: Api<Pod>,
    selector: String,
    events: broadcast::Sender<ServiceEvent>,
    fate: Option<mpsc::UnboundedSender<Check>>,
) {
    let check = |c: Check| {
        if let Some(f) = &fate {
            let _ = f.send(c);
        }
    };
    let service_of = |p: &Pod| p.labels().get(SERVICE_LABEL).cloned();
    let mut known: BTreeMap<String, Seen> = BTreeMap::new();
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
            now.insert(p.name_any(), seen(p));
        }
        // What changed while we were not watching.
        for (name, (uid, _, _)) in &known {
            if now.get(name).map(|(u, _, _)| u) != Some(uid) {
                emit_exit(&events, name, "deleted while the watch was down");
            }
        }
        known = now;
        check(Check::All);
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
                    known.insert(p.name_any(), seen(&p));
                }
                Ok(WatchEvent::Modified(p)) => {
                    let (uid, restarts, failed) = seen(&p);
                    let before = known.insert(p.name_any(), (uid, restarts, failed));
                    let restarted = before.as_ref().is_some_and(|(_, r, _)| restarts > *r);
                    let newly_failed = failed && !before.is_some_and(|(_, _, f)| f);
                    if restarted {
                        emit_exit(
                            &events,
                            &p.name_any(),
                            "the container exited; the kubelet restarted it",
                        );
                    } else if newly_failed {
                        emit_exit(&events, &p.name_any(), "the pod failed");
                    }
                    if restarted || newly_failed {
                        if let Some(s) = service_of(&p) {
                            check(Check::Service(s));
                        }
                    }
                }
                Ok(WatchEvent::Deleted(p)) => {
                    known.remove(&p.name_any());
                    emit_exit(&events, &p.name_any(), "pod deleted");
                    if let Some(s) = service_of(&p) {
                        check(Check::Service(s));
                    }
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

/// The shared-fate task: gathers the watch's checks for
/// [`KubernetesOrchestratorConfig::shared_fate_delay`] (pods dying together
/// cause one restart), then checks each service named (every live one after
/// a list) and restarts it as a whole if a pod of it died. A check that
/// fails is tried again after [`SHARED_FATE_RETRY`].
async fn shared_fate(
    inner: Arc<Inner>,
    tx: mpsc::UnboundedSender<Check>,
    mut rx: mpsc::UnboundedReceiver<Check>,
) {
    let retry = |c: Check| {
        let tx = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(SHARED_FATE_RETRY).await;
            let _ = tx.send(c);
        });
    };
    loop {
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut all = false;
        let mut names = BTreeSet::new();
        let mut add = |c: Check| match c {
            Check::All => all = true,
            Check::Service(s) => {
                names.insert(s);
            }
        };
        add(first);
        let deadline = tokio::time::Instant::now() + inner.config.shared_fate_delay;
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(c)) => add(c),
                Ok(None) => return,
                Err(_) => break,
            }
        }
        if all {
            match inner.list_records().await {
                Ok(records) => names.extend(records.iter().map(|r| r.name_any())),
                Err(e) => {
                    tracing::warn!("shared fate: listing the services failed: {e}; trying again");
                    retry(Check::All);
                }
            }
        }
        for name in names {
            if let Err(e) = inner.check_shared_fate(&name).await {
                tracing::warn!(service = %name, "shared fate: the whole restart failed: {e}; trying again");
                retry(Check::Service(name));
            }
        }
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
        self.inner.config.epoch
    }

    async fn ensure_service(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        self.inner.ensure(config).await
    }

    async fn drop_service(&self, name: &str) -> Result<bool, DropError> {
        self.inner.drop_inner(name).await
    }

    async fn restart_service(&self, name: &str) -> Result<ServiceStatus, RestartError> {
        self.inner.restart_inner(name).await
    }

    async fn list_services(&self) -> Result<Vec<ServiceStatus>, ListError> {
        Ok(self.inner.list_inner().await?)
    }

    fn watch_services(&self) -> broadcast::Receiver<ServiceEvent> {
        let receiver = self.inner.events.subscribe();
        let mut tasks = self.tasks.lock().expect("poisoned");
        if tasks.is_empty() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let fate = self.inner.config.shared_fate.then(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    tasks.push(runtime.spawn(shared_fate(Arc::clone(&self.inner), tx.clone(), rx)));
                    tx
                });
                tasks.push(runtime.spawn(watch_pods(
                    self.inner.pods.clone(),
                    objects::environment_selector(&self.inner.config.environment),
                    self.inner.events.clone(),
                    fate,
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
