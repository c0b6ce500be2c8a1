//! The Kubernetes objects of one lockstep service, built from a
//! [`ServiceConfig`]: a headless Service (the service's record and its DNS
//! domain), one pod per process, and a Secret with the processes'
//! environment. Pure functions: no API calls here.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvFromSource, EnvVar, Pod, PodSpec, Secret, SecretEnvSource,
    Service, ServicePort, ServiceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::ByteString;
use lockstep_orchestrator::{ServiceAssignment, ServiceConfig, EPOCH_LABEL, ID_LABEL};
use serde::{Deserialize, Serialize};

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

/// The pod of process `index`.
pub fn pod_name(service: &str, index: usize) -> String {
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
/// letters, digits, `-`) short enough that `NAME-INDEX` and `NAME-env` are
/// DNS labels too.
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

/// Process `index`'s stable DNS name: `NAME-INDEX.NAME.NAMESPACE.svc.DOMAIN`.
pub fn process_host(ctx: &ObjectContext, service: &str, index: usize) -> String {
    format!(
        "{}.{service}.{}.svc.{}",
        pod_name(service, index),
        ctx.namespace,
        ctx.cluster_domain
    )
}

/// Every process's arguments, from the config's args function with each
/// process's stable DNS name as its host.
pub fn process_args(ctx: &ObjectContext, config: &ServiceConfig) -> Vec<Vec<String>> {
    let ports = port_numbers(config, ctx.base_port);
    let all_ports = vec![ports; config.scale];
    let hosts: Vec<String> = (0..config.scale)
        .map(|i| process_host(ctx, &config.name, i))
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
    /// Each process's [`template_hash`].
    pub hash: Vec<String>,
}

/// The template of `config`'s pods: each process's command line from
/// [`process_args`] and its [`template_hash`].
pub fn template(ctx: &ObjectContext, config: &ServiceConfig) -> PodTemplate {
    let argv = process_args(ctx, config);
    PodTemplate {
        image: ctx.image.clone(),
        program: config.program.display().to_string(),
        ports: port_numbers(config, ctx.base_port),
        hash: argv.iter().map(|a| template_hash(ctx, config, a)).collect(),
        argv,
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

/// The hash of what a process runs: program, image, arguments, environment
/// and ports. Labels are not in it: a relabel keeps the pod.
pub fn template_hash(ctx: &ObjectContext, config: &ServiceConfig, argv: &[String]) -> String {
    let mut h = blake3::Hasher::new();
    let doc = serde_json::json!({
        "image": ctx.image,
        "program": config.program,
        "argv": argv,
        "env": config.env,
        "ports": port_numbers(config, ctx.base_port),
        "scale": config.scale,
    });
    h.update(doc.to_string().as_bytes());
    h.finalize().to_hex()[..16].to_string()
}

/// A pod's [`SPEC_HASH_ANNOTATION`]: its [`template_hash`] and its
/// generation, so a pod of an older generation is never adopted as one of
/// the current one.
pub fn spec_hash(template_hash: &str, generation: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(format!("{template_hash}/{generation}").as_bytes());
    h.finalize().to_hex()[..16].to_string()
}

/// The pod of process `index` of service `service` (ID `id`) in generation
/// `generation`, from its template: hostname `NAME-INDEX` in the subdomain
/// `NAME` (the headless Service), restarted in place by the kubelet when it
/// exits (`restartPolicy: Always`; the backend then restarts the whole
/// service as a new generation), its environment from the Secret, its
/// generation in [`GENERATION_ENV`] and the [`GENERATION_KEY`] label.
/// `ctx.epoch` labels it.
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
    let name = pod_name(service, index);
    Pod {
        metadata: meta(ctx, name.clone(), labels, annotations),
        spec: Some(PodSpec {
            hostname: Some(name),
            subdomain: Some(service.to_string()),
            restart_policy: Some("Always".to_string()),
            containers: vec![Container {
                name: CONTAINER.to_string(),
                image: Some(template.image.clone()),
                command: Some(vec![template.program.clone()]),
                args: Some(template.argv.get(index).cloned().unwrap_or_default()),
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
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    }
}
