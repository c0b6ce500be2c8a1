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
//!   place; the backend then restarts the whole service, see *Shared fate*),
//!   the configured resources
//!   ([`KubernetesOrchestratorConfig::resources`]), a restricted security
//!   context and a preferred anti-affinity against the service's other pods
//!   (see [`objects::pod`]);
//! - a PodDisruptionBudget `NAME` over its pods (`minAvailable: scale - 1`,
//!   [`objects::disruption_budget`]), written and fenced like the Secret,
//!   deleted with the service;
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
//!   The write keeps the record's generation. Then the Secret, the
//!   PodDisruptionBudget and the pods:
//!   if none exists, every pod is created in the record's generation; if
//!   every pod has the spec hash of its process in that generation (the
//!   hash covers program, image, arguments, environment, ports, resources
//!   and the generation) and none died, they are kept and relabelled (adopted);
//!   anything else (a changed spec, a pod missing, dead or of another
//!   generation) is a whole restart as `restart_service` does it, with the
//!   new spec. Finally it reads the record once more: if a newer
//!   controller took it over meanwhile, it deletes the pods it created (with
//!   preconditions) and refuses.
//! - `drop_service` turns the record into a tombstone (a write with the
//!   record's resourceVersion, or a create), then deletes the service's
//!   pods, Secret and PodDisruptionBudget, each with the uid and
//!   resourceVersion it read. A 409 on a
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
//! (at most [`KubernetesOrchestratorConfig::stuck_after`]: a pod still
//! there after that, on a lost node, is left terminating beside the new
//! generation, whose pods are named by their generation). Between the
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

pub mod image;
pub mod objects;

mod dropping;
pub mod events;
mod generation;
pub mod health;
mod owner;
mod pods;
mod records;
mod secrets;
mod services;
mod template;
mod watch;

pub use owner::{owner_object, owner_of, owner_reference};

use pods::*;
use watch::*;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use lockstep_orchestrator::{
    DropError, EnsureError, ListError, Orchestrator, ProcessStatus, RestartError, ServiceConfig,
    ServiceEvent, ServiceEventKind, ServiceStatus, StateError, EPOCH_LABEL, ID_LABEL,
};
use tokio::sync::{broadcast, mpsc};

use crate::objects::{
    ObjectContext, PodTemplate, CONTAINER, DROPPED_BY_LABEL, GENERATION_KEY, LABELS_ANNOTATION,
    PROCESS_LABEL, RESTARTS_ANNOTATION, SERVICE_LABEL, SPEC_HASH_ANNOTATION, STATE_LABEL,
    TEMPLATE_ANNOTATION,
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
    /// The compute resources of every process's container
    /// ([`objects::PodResources::replica_default`] unless set). Part of the
    /// spec hash: a change replaces the pods on the next ensure.
    pub resources: objects::PodResources,
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
    /// How long a new generation waits for the pods it deleted to go. A pod
    /// still there after that is stuck terminating (its node lost, a
    /// finalizer held): the new generation starts beside it under names of
    /// its own ([`objects::pod_name`]) and a drop goes on without it.
    pub stuck_after: Duration,
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
    /// Defaults: environment `lockstep`, image [`image::default_image`]
    /// (`lockstep:VERSION`), domain
    /// `cluster.local`, ports from 2100, the default replica resources,
    /// conditional writes on, 60 s waits, shared fate on with a 1 s delay.
    pub fn new(namespace: impl Into<String>, epoch: u64) -> Self {
        KubernetesOrchestratorConfig {
            namespace: namespace.into(),
            environment: "lockstep".to_string(),
            epoch,
            image: image::default_image(),
            cluster_domain: "cluster.local".to_string(),
            base_port: 2100,
            owner: None,
            resources: objects::PodResources::replica_default(),
            conditional_writes: true,
            delete_preconditions: true,
            ready_timeout: Duration::from_secs(60),
            delete_timeout: Duration::from_secs(60),
            stuck_after: Duration::from_secs(20),
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
    budgets: Api<PodDisruptionBudget>,
    /// Kubernetes Events on the services' records ([`events`]).
    events_api: Api<k8s_openapi::api::core::v1::Event>,
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
                secrets: Api::namespaced(client.clone(), ns),
                budgets: Api::namespaced(client.clone(), ns),
                events_api: Api::namespaced(client, ns),
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

    /// A pod's delete: [`delete_params`](Self::delete_params) with the
    /// stated grace period ([`objects::POD_TERMINATION_GRACE_SECS`]), so a
    /// restart, upgrade or drop waits at most that for a pod, whatever an
    /// older pod's spec said.
    fn pod_delete_params(&self, pod: &Pod) -> DeleteParams {
        DeleteParams {
            grace_period_seconds: Some(objects::POD_TERMINATION_GRACE_SECS as u32),
            ..self.delete_params(pod)
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
            resources: self.config.resources.clone(),
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

    /// The objects' context for pods of `record`: labelled with the record's
    /// epoch (a whole restart does not take a service over).
    fn context_of(&self, record: &Service) -> ObjectContext {
        let mut ctx = self.context();
        ctx.epoch = label_u64(record.labels(), EPOCH_LABEL).unwrap_or(ctx.epoch);
        ctx
    }
}

/// What the watch remembers of a pod.
#[derive(Clone, Debug)]
struct Seen {
    uid: Option<String>,
    /// Its containers' restarts.
    restarts: i32,
    failed: bool,
    /// Being deleted (terminating).
    deleting: bool,
    /// The image ID its kubelet reports, once known.
    image: Option<String>,
    /// Its service and process index (from its labels; a pod's name holds
    /// its generation too).
    service: String,
    process: Option<usize>,
}

#[async_trait::async_trait]
impl Orchestrator for KubernetesOrchestrator {
    fn epoch(&self) -> u64 {
        self.inner.config.epoch
    }

    async fn ensure_service(&self, config: ServiceConfig) -> Result<ServiceStatus, EnsureError> {
        let name = config.name.clone();
        let result = self.inner.ensure(config).await;
        if let Err(e @ (EnsureError::StaleEpoch { .. } | EnsureError::DroppedByNewer { .. })) =
            &result
        {
            self.inner
                .event(&name, events::reasons::REFUSED, e.to_string(), true)
                .await;
        }
        result
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
