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
use lockstep_orchestrator::{ServiceConfig, EPOCH_LABEL, ID_LABEL};
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

pub use crate::template::{
    legacy_pod_name, pod_args, pod_name, process_args, process_host, template, template_pod_name,
    PodTemplate, GENERATION_PLACEHOLDER,
};
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
