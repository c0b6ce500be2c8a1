//! The Kubernetes objects of one lockstep service, built from a
//! [`ServiceConfig`]: a headless Service (the service's record and its DNS
//! domain), one pod per process, and a Secret with the processes'
//! environment. Pure functions: no API calls here.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvFromSource, EnvVar,
    Pod, PodAffinityTerm, PodAntiAffinity, PodSecurityContext, PodSpec, ResourceRequirements,
    SeccompProfile, Secret, SecretEnvSource, SecurityContext, Service, ServicePort, ServiceSpec,
    Volume, VolumeMount, WeightedPodAffinityTerm,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use lockstep_orchestrator::{ServiceAssignment, ServiceConfig, EPOCH_LABEL, ID_LABEL};
use serde::{Deserialize, Serialize};

/// A replica pod's `terminationGracePeriodSeconds`: `lockstep-replica`
/// exits within a second of SIGTERM, so a deleted pod is gone in about
/// that, not the default 30 s.
pub const POD_TERMINATION_GRACE_SECS: i64 = 5;

/// `app.kubernetes.io/managed-by`: every object this backend writes says `lockstep`.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// The value of [`MANAGED_BY_LABEL`].
pub const MANAGED_BY: &str = "lockstep";
/// The environment (one `lockstep serve` deployment) an object belongs to, so
/// that several environments can share a namespace.
pub const ENVIRONMENT_LABEL: &str = "lockstep/environment";
/// The lockstep service an object belongs to.
pub const SERVICE_LABEL: &str = "lockstep/service";
/// The index of the process a pod runs.
pub const PROCESS_LABEL: &str = "lockstep/process";
/// `live` on the record of a running service, `dropped` on a tombstone.
pub const STATE_LABEL: &str = "lockstep/state";
/// The epoch that dropped a service (on a tombstone).
pub const DROPPED_BY_LABEL: &str = "lockstep/dropped-by";
/// Annotation: the hash of a pod's spec (program, arguments, environment,
/// ports), so an unchanged spec is adopted instead of replaced.
pub const SPEC_HASH_ANNOTATION: &str = "lockstep/spec-hash";
/// Annotation on the record: every label of the [`ServiceConfig`] as JSON
/// (Kubernetes label values are restricted; this keeps them exactly).
pub const LABELS_ANNOTATION: &str = "lockstep/labels";
/// Annotation on a pod: how often `restart_service` replaced it.
pub const RESTARTS_ANNOTATION: &str = "lockstep/restarts";
/// Annotation on the record: the service's current generation (1 for a new
/// service, one more on every whole restart). Label on a pod: the
/// generation it was started in; its container gets it as
/// [`GENERATION_ENV`], and a replica's mesh refuses a peer of another one.
pub const GENERATION_KEY: &str = "lockstep/generation";
/// Annotation on the record: the [`PodTemplate`] as JSON, so a whole restart
/// can create every pod again (a deleted one too) without the
/// [`ServiceConfig`].
pub const TEMPLATE_ANNOTATION: &str = "lockstep/template";
/// The variable that tells a process its generation (the process backend's too).
pub use lockstep_orchestrator::process::GENERATION_ENV;
/// The name of the one container of a process's pod.
pub const CONTAINER: &str = "process";
/// The user and group a process's container runs as: the image's `lockstep`
/// user (uid and gid 10001, see the Containerfile).
pub const PROCESS_UID: i64 = 10001;
/// The writable scratch directory of a process's pod (an `emptyDir`): the
/// container's root filesystem is read-only.
pub const SCRATCH_DIR: &str = "/tmp";
/// The node label a replica's pods prefer to spread over (pod
/// anti-affinity): one process per node where the cluster allows it.
pub const SPREAD_TOPOLOGY_KEY: &str = "kubernetes.io/hostname";

/// The compute resources of every process's container: Kubernetes
/// resource names (`cpu`, `memory`, ...) to quantities (`500m`, `512Mi`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodResources {
    /// What the scheduler reserves for the container.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, String>,
    /// What the container may use at most (memory past it is an OOM kill).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
}

impl PodResources {
    /// The default of a replica process: requests `cpu: 500m`,
    /// `memory: 512Mi`, limit `memory: 2Gi` (a Burstable pod, never
    /// BestEffort, which is evicted first and stalls its whole replica). No
    /// CPU limit: a throttled worker holds up every barrier of its replica.
    pub fn replica_default() -> Self {
        PodResources {
            requests: BTreeMap::from([
                ("cpu".to_string(), "500m".to_string()),
                ("memory".to_string(), "512Mi".to_string()),
            ]),
            limits: BTreeMap::from([("memory".to_string(), "2Gi".to_string())]),
        }
    }

    /// Parses `NAME=QUANTITY[,NAME=QUANTITY...]` (e.g. `cpu=500m,memory=1Gi`;
    /// empty: none) into resource names and quantities.
    pub fn parse_list(text: &str) -> Result<BTreeMap<String, String>, String> {
        text.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| match p.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() && !v.trim().is_empty() => {
                    Ok((k.trim().to_string(), v.trim().to_string()))
                }
                _ => Err(format!(
                    "{p:?} is not NAME=QUANTITY (e.g. cpu=500m or memory=1Gi)"
                )),
            })
            .collect()
    }

    fn requirements(&self) -> Option<ResourceRequirements> {
        let map = |m: &BTreeMap<String, String>| {
            (!m.is_empty()).then(|| {
                m.iter()
                    .map(|(k, v)| (k.clone(), Quantity(v.clone())))
                    .collect()
            })
        };
        (!self.requests.is_empty() || !self.limits.is_empty()).then(|| ResourceRequirements {
            requests: map(&self.requests),
            limits: map(&self.limits),
            ..ResourceRequirements::default()
        })
    }
}

/// What every object of a service needs beyond its [`ServiceConfig`].
#[derive(Clone, Debug)]
pub struct ObjectContext {
    /// The namespace.
    pub namespace: String,
    /// The environment's name ([`ENVIRONMENT_LABEL`]).
    pub environment: String,
    /// The epoch that labels the objects.
    pub epoch: u64,
    /// The container image the processes run (it holds the program).
    pub image: String,
    /// The cluster's DNS domain (`cluster.local`).
    pub cluster_domain: String,
    /// The first port number; named port *k* of a service gets `base_port + k`.
    pub base_port: u16,
    /// The owner of every object (the environment's own object), if any.
    pub owner: Option<OwnerReference>,
    /// The compute resources of every process's container.
    pub resources: PodResources,
}

/// The Secret holding a service's environment.
pub fn secret_name(service: &str) -> String {
    format!("{service}-env")
}

/// The Secret holding the environment's master secret, from which every
/// replica's session key is derived.
pub fn master_secret_name(environment: &str) -> String {
    format!("{environment}-master")
}

/// The key of the master secret's bytes in its Secret.
pub const MASTER_SECRET_KEY: &str = "master";

/// What a host name in a template's arguments holds where the pod's
/// generation goes ([`pod_name`]): a pod's arguments are its template's
/// with this replaced, so the template (and its hash) is the same in every
/// generation.
pub const GENERATION_PLACEHOLDER: &str = "{generation}";

/// The pod of process `index` of a service of `scale` processes in
/// `generation`, also its host name: `NAME-gGENERATION-INDEX`. A new
/// generation's pods never take the name (nor the DNS name) of a pod of an
/// older one that is still there, stuck terminating on a lost node: the
/// new generation starts beside it. The generation is kept to the digits
/// that fit a DNS label (at least 8 for a 50-character name and 64
/// processes; modulo that, a name comes back only after 10^8 generations).
pub fn pod_name(service: &str, scale: usize, generation: u64, index: usize) -> String {
    format!(
        "{service}-{}-{index}",
        generation_tag(service, scale, generation)
    )
}

/// `gGENERATION`, with the generation's digits kept to what fits
/// ([`pod_name`]).
fn generation_tag(service: &str, scale: usize, generation: u64) -> String {
    let index_digits = scale.saturating_sub(1).max(1).ilog10() as usize + 1;
    // 63 = a DNS label; 3 = "-g" and "-".
    let room = 63usize
        .saturating_sub(service.len() + 3 + index_digits)
        .clamp(1, 19);
    format!("g{}", generation % 10u64.pow(room as u32))
}

/// The pod of process `index` as records written before pods were named by
/// their generation name it (`NAME-INDEX`): a service whose template says
/// so ([`PodTemplate::generation_names`] false) keeps these names, as its
/// processes' arguments name its peers so.
pub fn legacy_pod_name(service: &str, index: usize) -> String {
    format!("{service}-{index}")
}

/// The label selector of every object this environment manages.
pub fn environment_selector(environment: &str) -> String {
    format!("{MANAGED_BY_LABEL}={MANAGED_BY},{ENVIRONMENT_LABEL}={environment}")
}

/// The label selector of a service's pods.
pub fn pods_selector(environment: &str, service: &str) -> String {
    format!(
        "{},{SERVICE_LABEL}={service}",
        environment_selector(environment)
    )
}

/// The label selector of the records of live services.
pub fn live_selector(environment: &str) -> String {
    format!("{},{STATE_LABEL}=live", environment_selector(environment))
}

/// Whether `name` is a valid service name here: a DNS label (lower-case
/// letters, digits, `-`) short enough that its pods' names
/// (`NAME-gGENERATION-INDEX`, [`pod_name`]) and `NAME-env` are DNS labels
/// too.
pub fn validate_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 50
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "service name {name:?} must be a DNS label of at most 50 characters (lower-case letters, digits, '-')"
        ))
    }
}

/// Each named port's number: `base_port + k` for the `k`-th name.
pub fn port_numbers(config: &ServiceConfig, base_port: u16) -> BTreeMap<String, u16> {
    config
        .ports
        .iter()
        .enumerate()
        .map(|(k, n)| (n.clone(), base_port + k as u16))
        .collect()
}

/// Process `index`'s DNS name in a template:
/// `NAME-g{generation}-INDEX.NAME.NAMESPACE.svc.DOMAIN`, the
/// [`GENERATION_PLACEHOLDER`] replaced in each pod ([`pod_args`])
/// (`NAME-INDEX.NAME...` without `generation_names`).
pub fn process_host(
    ctx: &ObjectContext,
    service: &str,
    index: usize,
    generation_names: bool,
) -> String {
    let host = if generation_names {
        format!("{service}-g{GENERATION_PLACEHOLDER}-{index}")
    } else {
        legacy_pod_name(service, index)
    };
    format!(
        "{host}.{service}.{}.svc.{}",
        ctx.namespace, ctx.cluster_domain
    )
}

/// Process `index`'s arguments in `generation`: its template's, with the
/// [`GENERATION_PLACEHOLDER`] of every host name replaced by the digits
/// [`pod_name`] keeps.
pub fn pod_args(
    template: &PodTemplate,
    service: &str,
    generation: u64,
    index: usize,
) -> Vec<String> {
    let argv = template.argv.get(index).cloned().unwrap_or_default();
    if !template.generation_names {
        return argv;
    }
    let tag = generation_tag(service, template.argv.len(), generation);
    let digits = tag.trim_start_matches('g');
    argv.into_iter()
        .map(|a| a.replace(GENERATION_PLACEHOLDER, digits))
        .collect()
}

/// Every process's arguments, from the config's args function with each
/// process's DNS name ([`process_host`]) as its host.
pub fn process_args(
    ctx: &ObjectContext,
    config: &ServiceConfig,
    generation_names: bool,
) -> Vec<Vec<String>> {
    let ports = port_numbers(config, ctx.base_port);
    let all_ports = vec![ports; config.scale];
    let hosts: Vec<String> = (0..config.scale)
        .map(|i| process_host(ctx, &config.name, i, generation_names))
        .collect();
    (0..config.scale)
        .map(|i| {
            (config.args)(&ServiceAssignment {
                process: i,
                scale: config.scale,
                host: &hosts[i],
                hosts: &hosts,
                // A pod is reached at its pod IP, from outside the pod.
                listen_host: "0.0.0.0",
                ports: &all_ports,
            })
        })
        .collect()
}

fn labels(ctx: &ObjectContext, config: &ServiceConfig) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (ENVIRONMENT_LABEL.to_string(), ctx.environment.clone()),
        (SERVICE_LABEL.to_string(), config.name.clone()),
        (EPOCH_LABEL.to_string(), ctx.epoch.to_string()),
        (ID_LABEL.to_string(), config.id.to_string()),
    ])
}

fn meta(
    ctx: &ObjectContext,
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(ctx.namespace.clone()),
        labels: Some(labels),
        annotations: (!annotations.is_empty()).then_some(annotations),
        owner_references: ctx.owner.clone().map(|o| vec![o]),
        ..ObjectMeta::default()
    }
}

/// The headless Service of a live service: its record (epoch and ID labels,
/// [`STATE_LABEL`] `live`, the config's labels in [`LABELS_ANNOTATION`], the
/// current `generation` in [`GENERATION_KEY`], the pods' `template` in
/// [`TEMPLATE_ANNOTATION`]) and the DNS domain of its pods
/// (`publishNotReadyAddresses`, so peers resolve each other before they are
/// ready, as a timely mesh forms first).
pub fn service(
    ctx: &ObjectContext,
    config: &ServiceConfig,
    generation: u64,
    template: &PodTemplate,
) -> Service {
    let mut labels = labels(ctx, config);
    labels.insert(STATE_LABEL.to_string(), "live".to_string());
    let mut all = config.labels.clone();
    all.insert(EPOCH_LABEL.to_string(), ctx.epoch.to_string());
    all.insert(ID_LABEL.to_string(), config.id.to_string());
    let annotations = BTreeMap::from([
        (
            LABELS_ANNOTATION.to_string(),
            serde_json::to_string(&all).expect("labels serialize"),
        ),
        (GENERATION_KEY.to_string(), generation.to_string()),
        (
            TEMPLATE_ANNOTATION.to_string(),
            serde_json::to_string(template).expect("a template serializes"),
        ),
    ]);
    Service {
        metadata: meta(ctx, config.name.clone(), labels, annotations),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_string()),
            publish_not_ready_addresses: Some(true),
            selector: Some(BTreeMap::from([
                (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
                (ENVIRONMENT_LABEL.to_string(), ctx.environment.clone()),
                (SERVICE_LABEL.to_string(), config.name.clone()),
            ])),
            ports: Some(
                port_numbers(config, ctx.base_port)
                    .into_iter()
                    .map(|(name, port)| ServicePort {
                        name: Some(name),
                        port: i32::from(port),
                        ..ServicePort::default()
                    })
                    .collect(),
            ),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The tombstone of a dropped service: a headless Service that selects no
/// pod, labelled `dropped` with the highest epoch that dropped it, so an
/// older controller may not re-create the service (O4: a drop is a write).
pub fn tombstone(ctx: &ObjectContext, name: &str, dropped_by: u64) -> Service {
    let labels = BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (ENVIRONMENT_LABEL.to_string(), ctx.environment.clone()),
        (SERVICE_LABEL.to_string(), name.to_string()),
        (STATE_LABEL.to_string(), "dropped".to_string()),
        (DROPPED_BY_LABEL.to_string(), dropped_by.to_string()),
    ]);
    Service {
        metadata: meta(ctx, name.to_string(), labels, BTreeMap::new()),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_string()),
            selector: Some(BTreeMap::from([(
                STATE_LABEL.to_string(),
                "dropped".to_string(),
            )])),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The labels that select every pod of `service` (and no other): what the
/// pod anti-affinity and the [`disruption_budget`] select.
pub fn pod_selector_labels(ctx: &ObjectContext, service: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (ENVIRONMENT_LABEL.to_string(), ctx.environment.clone()),
        (SERVICE_LABEL.to_string(), service.to_string()),
    ])
}

/// The PodDisruptionBudget of a service, named like it: at most one of its
/// pods evicted at a time (`minAvailable: scale - 1`), so a node drain takes
/// one process of a replica, and the backend's shared-fate restart brings
/// the whole replica back before the next eviction may proceed. An integer
/// `minAvailable`, not `maxUnavailable`: the disruption controller counts
/// the pods the selector matches for it, while `maxUnavailable` needs the
/// pods' controller to have a scale (a Deployment's), which the service
/// record is not, and then refuses every eviction. A pod that is
/// not ready may always be evicted (`unhealthyPodEvictionPolicy:
/// AlwaysAllow`), so a broken replica never blocks a drain. Labelled with
/// the epoch like the Secret.
pub fn disruption_budget(ctx: &ObjectContext, config: &ServiceConfig) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: meta(
            ctx,
            config.name.clone(),
            labels(ctx, config),
            BTreeMap::new(),
        ),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(
                i32::try_from(config.scale.saturating_sub(1)).unwrap_or(i32::MAX),
            )),
            selector: Some(LabelSelector {
                match_labels: Some(pod_selector_labels(ctx, &config.name)),
                ..LabelSelector::default()
            }),
            unhealthy_pod_eviction_policy: Some("AlwaysAllow".to_string()),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    }
}

/// The owner reference that makes a service's record the controller of
/// its pods: `kubectl drain` and the cluster autoscaler evict a pod with a
/// controller (a bare pod they refuse to touch), and the garbage collector
/// deletes the pods if the record goes. No `blockOwnerDeletion` (it would
/// need `update` on `services/finalizers`).
pub fn record_controls(service: &str, record_uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: "v1".to_string(),
        kind: "Service".to_string(),
        name: service.to_string(),
        uid: record_uid.to_string(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// The Secret with the service's environment ([`ServiceConfig::env`], which
/// carries the replica's session key): it reaches the processes through
/// `envFrom`, never their command line or the pod spec.
pub fn secret(ctx: &ObjectContext, config: &ServiceConfig) -> Secret {
    Secret {
        metadata: meta(
            ctx,
            secret_name(&config.name),
            labels(ctx, config),
            BTreeMap::new(),
        ),
        type_: Some("Opaque".to_string()),
        data: Some(
            config
                .env
                .iter()
                .map(|(k, v)| (k.clone(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Secret::default()
    }
}

/// What every pod of a service runs, kept in the record
/// ([`TEMPLATE_ANNOTATION`]) so that a whole restart rebuilds exactly the
/// pods [`ensure_service`](lockstep_orchestrator::Orchestrator::ensure_service)
/// built, a deleted one included.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodTemplate {
    /// The container image.
    pub image: String,
    /// The program (the container's command).
    pub program: String,
    /// The named ports and their numbers (the same in every pod).
    pub ports: BTreeMap<String, u16>,
    /// Each process's arguments; its length is the scale.
    pub argv: Vec<Vec<String>>,
    /// Each process's hash (what it runs: see [`PodTemplate::with_image`]).
    pub hash: Vec<String>,
    /// The container's compute resources (absent in records written before
    /// they were set: none).
    #[serde(default)]
    pub resources: PodResources,
    /// Pods are named by their generation ([`pod_name`]) and `argv` names
    /// them with a [`GENERATION_PLACEHOLDER`] (absent in records written
    /// before: `NAME-INDEX`, [`legacy_pod_name`]).
    #[serde(default)]
    pub generation_names: bool,
    /// The digest of the processes' environment (absent in records written
    /// before: their hashes held the environment itself).
    #[serde(default)]
    pub env_digest: Option<String>,
}

/// The template of `config`'s pods: each process's command line from
/// [`process_args`] and its hashes.
pub fn template(ctx: &ObjectContext, config: &ServiceConfig) -> PodTemplate {
    // The real-node suite's negative control (feature `failpoints` only):
    // pods keep their names across generations, as records written before
    // had them.
    fail::fail_point!("kube_pod_names_reused", |_| template_named(
        ctx, config, false
    ));
    template_named(ctx, config, true)
}

fn template_named(
    ctx: &ObjectContext,
    config: &ServiceConfig,
    generation_names: bool,
) -> PodTemplate {
    let mut template = PodTemplate {
        image: ctx.image.clone(),
        program: config.program.display().to_string(),
        ports: port_numbers(config, ctx.base_port),
        argv: process_args(ctx, config, generation_names),
        hash: Vec::new(),
        resources: ctx.resources.clone(),
        generation_names,
        env_digest: Some(env_digest(&config.env)),
    };
    template.hash = template.hashes();
    template
}

impl PodTemplate {
    /// Each process's hash: what it runs (image, program, arguments, the
    /// environment's digest, ports, scale and compute resources: a pod's
    /// resources cannot change in place). Labels are not in it: a relabel
    /// keeps the pod.
    fn hashes(&self) -> Vec<String> {
        self.argv
            .iter()
            .map(|argv| {
                let doc = serde_json::json!({
                    "image": self.image,
                    "program": self.program,
                    "argv": argv,
                    "env": self.env_digest,
                    "ports": self.ports,
                    "scale": self.argv.len(),
                    "resources": self.resources,
                });
                blake3::hash(doc.to_string().as_bytes()).to_hex()[..16].to_string()
            })
            .collect()
    }

    /// This template on `image`, its hashes made again: what a new
    /// generation runs when the environment runs another build than the
    /// one the service's pods were made with (an upgrade). The same
    /// template when `image` is its own.
    pub fn with_image(&self, image: &str) -> PodTemplate {
        if self.image == image {
            return self.clone();
        }
        let mut t = self.clone();
        t.image = image.to_string();
        t.hash = t.hashes();
        t
    }
}

/// The digest of a service's environment: the record keeps it, not the
/// values (a session key is among them), so that a changed environment is
/// a changed template.
fn env_digest(env: &BTreeMap<String, String>) -> String {
    let doc = serde_json::to_string(env).expect("an environment serializes");
    blake3::hash(doc.as_bytes()).to_hex()[..32].to_string()
}

/// The Secret with the environment's master secret (`bytes`), labelled with
/// the environment (no epoch: it outlives every epoch) and owned by the
/// environment's object if one is configured.
pub fn master_secret(ctx: &ObjectContext, bytes: &[u8]) -> Secret {
    let labels = BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (ENVIRONMENT_LABEL.to_string(), ctx.environment.clone()),
    ]);
    Secret {
        metadata: meta(
            ctx,
            master_secret_name(&ctx.environment),
            labels,
            BTreeMap::new(),
        ),
        type_: Some("Opaque".to_string()),
        data: Some(BTreeMap::from([(
            MASTER_SECRET_KEY.to_string(),
            ByteString(bytes.to_vec()),
        )])),
        ..Secret::default()
    }
}

/// A pod's [`SPEC_HASH_ANNOTATION`]: its template hash and its
/// generation, so a pod of an older generation is never adopted as one of
/// the current one.
pub fn spec_hash(template_hash: &str, generation: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(format!("{template_hash}/{generation}").as_bytes());
    h.finalize().to_hex()[..16].to_string()
}

/// The name (and host name) of process `index`'s pod of `template` in
/// `generation`: [`pod_name`], or [`legacy_pod_name`] for a template
/// written before.
pub fn template_pod_name(
    template: &PodTemplate,
    service: &str,
    generation: u64,
    index: usize,
) -> String {
    if template.generation_names {
        pod_name(service, template.argv.len(), generation, index)
    } else {
        legacy_pod_name(service, index)
    }
}

/// The pod of process `index` of service `service` (ID `id`) in generation
/// `generation`, from its template: named, and with the host name,
/// [`template_pod_name`] in the subdomain `NAME` (the headless Service), restarted in place by the kubelet when it
/// exits (`restartPolicy: Always`; the backend then restarts the whole
/// service as a new generation), its environment from the Secret, its
/// generation in [`GENERATION_ENV`] and the [`GENERATION_KEY`] label.
/// `ctx.epoch` labels it.
///
/// It is made to be operable: the template's compute [`PodResources`], a
/// restricted security context (non-root as [`PROCESS_UID`], no privilege
/// escalation, every capability dropped, a read-only root filesystem with an
/// `emptyDir` at [`SCRATCH_DIR`], the runtime's default seccomp profile), and
/// a preferred pod anti-affinity over [`SPREAD_TOPOLOGY_KEY`] against the
/// service's other pods, so a node lost or drained takes one process of a
/// replica where the cluster has room.
pub fn pod(
    ctx: &ObjectContext,
    service: &str,
    id: u64,
    template: &PodTemplate,
    index: usize,
    generation: u64,
    restarts: u32,
) -> Pod {
    let labels = BTreeMap::from([
        (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
        (ENVIRONMENT_LABEL.to_string(), ctx.environment.clone()),
        (SERVICE_LABEL.to_string(), service.to_string()),
        (EPOCH_LABEL.to_string(), ctx.epoch.to_string()),
        (ID_LABEL.to_string(), id.to_string()),
        (PROCESS_LABEL.to_string(), index.to_string()),
        (GENERATION_KEY.to_string(), generation.to_string()),
    ]);
    let template_hash = template.hash.get(index).map_or("", String::as_str);
    let annotations = BTreeMap::from([
        (
            SPEC_HASH_ANNOTATION.to_string(),
            spec_hash(template_hash, generation),
        ),
        (RESTARTS_ANNOTATION.to_string(), restarts.to_string()),
    ]);
    let name = template_pod_name(template, service, generation, index);
    let siblings = pod_selector_labels(ctx, service);
    let [startup_probe, liveness_probe, readiness_probe] =
        crate::health::probes(template.ports.contains_key(crate::health::PROBED_PORT));
    Pod {
        metadata: meta(ctx, name.clone(), labels, annotations),
        spec: Some(PodSpec {
            hostname: Some(name),
            subdomain: Some(service.to_string()),
            restart_policy: Some("Always".to_string()),
            // A replica process exits within a second of SIGTERM: a delete
            // (restart, upgrade, drop) need not wait the default 30 s.
            termination_grace_period_seconds: Some(POD_TERMINATION_GRACE_SECS),
            // A replica process never calls the Kubernetes API.
            automount_service_account_token: Some(false),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(PROCESS_UID),
                run_as_group: Some(PROCESS_UID),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_string(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            affinity: Some(Affinity {
                pod_anti_affinity: Some(PodAntiAffinity {
                    preferred_during_scheduling_ignored_during_execution: Some(vec![
                        WeightedPodAffinityTerm {
                            weight: 100,
                            pod_affinity_term: PodAffinityTerm {
                                label_selector: Some(LabelSelector {
                                    match_labels: Some(siblings),
                                    ..LabelSelector::default()
                                }),
                                topology_key: SPREAD_TOPOLOGY_KEY.to_string(),
                                ..PodAffinityTerm::default()
                            },
                        },
                    ]),
                    ..PodAntiAffinity::default()
                }),
                ..Affinity::default()
            }),
            volumes: Some(vec![Volume {
                name: "scratch".to_string(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Volume::default()
            }]),
            containers: vec![Container {
                name: CONTAINER.to_string(),
                image: Some(template.image.clone()),
                // The image named is the environment's build: pulled once,
                // never again behind its back (a restart never mixes builds).
                image_pull_policy: Some("IfNotPresent".to_string()),
                command: Some(vec![template.program.clone()]),
                args: Some(pod_args(template, service, generation, index)),
                env: Some(vec![
                    EnvVar {
                        name: "LOCKSTEP_SERVICE".to_string(),
                        value: Some(service.to_string()),
                        ..EnvVar::default()
                    },
                    EnvVar {
                        name: "LOCKSTEP_PROCESS".to_string(),
                        value: Some(index.to_string()),
                        ..EnvVar::default()
                    },
                    EnvVar {
                        name: GENERATION_ENV.to_string(),
                        value: Some(generation.to_string()),
                        ..EnvVar::default()
                    },
                    crate::health::log_format_env(),
                    crate::health::cluster_timeout_env(),
                ]),
                env_from: Some(vec![EnvFromSource {
                    secret_ref: Some(SecretEnvSource {
                        name: secret_name(service),
                        optional: Some(false),
                    }),
                    ..EnvFromSource::default()
                }]),
                ports: Some(
                    template
                        .ports
                        .iter()
                        .map(|(name, port)| ContainerPort {
                            name: Some(name.clone()),
                            container_port: i32::from(*port),
                            ..ContainerPort::default()
                        })
                        .collect(),
                ),
                resources: template.resources.requirements(),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    privileged: Some(false),
                    read_only_root_filesystem: Some(true),
                    capabilities: Some(Capabilities {
                        drop: Some(vec!["ALL".to_string()]),
                        ..Capabilities::default()
                    }),
                    ..SecurityContext::default()
                }),
                volume_mounts: Some(vec![VolumeMount {
                    name: "scratch".to_string(),
                    mount_path: SCRATCH_DIR.to_string(),
                    ..VolumeMount::default()
                }]),
                startup_probe,
                liveness_probe,
                readiness_probe,
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}
