//! A service's pod template, kept in its record
//! ([`TEMPLATE_ANNOTATION`](crate::objects::TEMPLATE_ANNOTATION)):
//! what every pod of a generation runs, and the names (and host names) its
//! pods take in each generation. Pure functions: no API calls here.

use std::collections::BTreeMap;

use lockstep_orchestrator::{ServiceAssignment, ServiceConfig};
use serde::{Deserialize, Serialize};

use crate::objects::{port_numbers, ObjectContext, PodResources};

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
