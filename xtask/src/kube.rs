//! `cargo xtask kube`: the Kubernetes backend and the shipped manifests
//! against a real API server on loopback
//! ([`crate::kube_control_plane`]: etcd, kube-apiserver with RBAC,
//! controller manager, scheduler and kwok's fake node, built from
//! `tools/kube`).
//!
//! 1. `deploy/kubernetes/base` applied with `kubectl apply -k --server-side
//!    --validate=strict` (every field known to the real server, the
//!    namespace admitted as `restricted`); the example overlay rendered and
//!    checked to move every object, and the RoleBinding's subject, to its
//!    namespace.
//! 2. A token of the shipped service account, and the shipped Role checked
//!    by the real authorizer: every verb the backend uses allowed, a list of
//!    others refused.
//! 3. The orphan suite's scenarios on the real server, every controller
//!    acting as that service account (`RULE@kube-apiserver`; the rules must
//!    pass, `catalog-only` must be caught).
//! 4. A replica's life (`lockstep-chaos-kube`): create, shared-fate
//!    restart, whole restart, upgrade, drop, each timed.
//! 5. The oldest Kubernetes stated (v1.33.13, from tools/kube/k8s-oldest):
//!    its control plane, the base applied with strict validation, the Role
//!    through its authorizer, a replica's life.
//! 6. A second control plane with a real node ([`crate::kube_node`]:
//!    kubelet, containerd, CoreDNS, the image of `cargo xtask image`
//!    imported): the base applied again, and `lockstep-chaos-node` runs
//!    replicas of real pods under each shipped policy, faulted (a process
//!    killed and stopped, a pod deleted, the environment killed) and
//!    checked; then the example overlay applied as shipped ([`shipped`]:
//!    the environment in the cluster, on PostgreSQL, driven from outside
//!    over TLS, scraped by Prometheus in a pod).
//!    The host is restored afterwards, also after a failure.
//!    Needs root; where it is not, the step fails naming it (`--skip
//!    kube-node` leaves it out on purpose).
//!
//! Ends with `kube: ok`.

use std::path::Path;
use std::process::Command;

use anyhow::bail;

use crate::kube_control_plane::ControlPlane;

mod shipped;
use crate::util::{root, step, target_dir};

/// The shipped service account, as the authorizer names it.
const SERVICE_ACCOUNT: &str = "system:serviceaccount:lockstep:lockstep-environment";

/// What the shipped Role must allow (verb, resource), in namespace
/// `lockstep`.
const ALLOWED: [(&str, &str); 18] = [
    ("create", "pods"),
    ("delete", "pods"),
    ("get", "pods"),
    ("list", "pods"),
    ("update", "pods"),
    ("watch", "pods"),
    ("create", "services"),
    ("get", "services"),
    ("list", "services"),
    ("update", "services"),
    ("create", "secrets"),
    ("delete", "secrets"),
    ("get", "secrets"),
    ("update", "secrets"),
    ("create", "poddisruptionbudgets.policy"),
    ("delete", "poddisruptionbudgets.policy"),
    ("update", "poddisruptionbudgets.policy"),
    ("get", "deployments.apps"),
];

/// What it must not allow: (verb, resource, namespace).
const REFUSED: [(&str, &str, &str); 10] = [
    ("list", "secrets", "lockstep"),
    ("watch", "secrets", "lockstep"),
    ("delete", "services", "lockstep"),
    ("patch", "pods", "lockstep"),
    ("create", "pods/exec", "lockstep"),
    ("update", "deployments.apps", "lockstep"),
    ("create", "roles.rbac.authorization.k8s.io", "lockstep"),
    ("get", "pods", "kube-system"),
    ("get", "secrets", "default"),
    ("list", "nodes", ""),
];

/// The task; `node_only`: step 6 alone.
pub fn kube(node_only: bool) -> anyhow::Result<()> {
    step("the control plane's programs (tools/kube, built once into target/kube/bin)");
    let binaries = crate::kube_control_plane::ensure_built()?;
    crate::chaos::build_with_environment(
        "lockstep-chaos, lockstep-chaos-kube and lockstep-chaos-node",
    )?;
    if node_only {
        real_node(&binaries)?;
        println!("kube: ok");
        return Ok(());
    }
    step("starting a real control plane on loopback");
    let dir = target_dir().join("kube/run");
    let cp = ControlPlane::start_with(&binaries, &dir)?;
    let result = against(&cp, &dir);
    if result.is_err() {
        eprintln!(
            "xtask: kube-apiserver's log, last lines:\n{}",
            cp.log_tail("kube-apiserver", 20)
        );
    }
    result?;
    drop(cp);
    oldest(&binaries)?;
    if !crate::prereqs::skipped("kube-node") {
        real_node(&binaries)?;
    }
    println!("kube: ok");
    Ok(())
}

/// Step 5: the oldest Kubernetes stated ([`crate::kube_control_plane::OLDEST`]):
/// a control plane of that release (kwok's node), the base applied with
/// strict validation against its schemas, the Role through its authorizer,
/// and a replica's life (`lockstep-chaos-kube`) on it.
fn oldest(binaries: &crate::kube_control_plane::Binaries) -> anyhow::Result<()> {
    let version = crate::kube_control_plane::OLDEST;
    step(&format!(
        "the oldest Kubernetes stated ({version}): a control plane of that release on loopback"
    ));
    let dir = target_dir().join("kube/run-oldest");
    let cp = ControlPlane::start_with(&binaries.with_oldest_control_plane(), &dir)?;
    let served = kubectl(&cp, &["version", "-o", "json"])?;
    let served: serde_json::Value = serde_json::from_str(&served)?;
    anyhow::ensure!(
        served["serverVersion"]["gitVersion"] == version,
        "the oldest control plane serves {}, not {version}",
        served["serverVersion"]["gitVersion"]
    );
    let result = (|| {
        apply_base(&cp)?;
        step(&format!(
            "the Role through {version}'s authorizer; a replica's life on {version}"
        ));
        let kubeconfig = service_account_kubeconfig(&cp, &dir)?;
        authorizer(&cp)?;
        let env = [
            ("LOCKSTEP_KUBE_KUBECONFIG", kubeconfig),
            ("LOCKSTEP_KUBE_ADMIN_KUBECONFIG", cp.admin_kubeconfig()),
            ("LOCKSTEP_KUBECTL", cp.binaries().kubectl.clone()),
        ];
        for (k, v) in &env {
            std::env::set_var(k, v);
        }
        crate::chaos::run_suite_binary(
            target_dir().join("debug/lockstep-chaos-kube"),
            &[],
            "kube",
            1,
        )
    })();
    if result.is_err() {
        eprintln!(
            "xtask: kube-apiserver {version}'s log, last lines:\n{}",
            cp.log_tail("kube-apiserver", 20)
        );
    }
    result
}

/// Step 6: the real node and the suite on it.
fn real_node(binaries: &crate::kube_control_plane::Binaries) -> anyhow::Result<()> {
    step("the real node: the image saved for it");
    let images = crate::image::node_images::ensure()?;
    step("a control plane for the real node (no kwok), and the node: kubelet, containerd, CoreDNS");
    let dir = target_dir().join("kube/run-node");
    let cp = ControlPlane::start_without_node(binaries, &dir)?;
    let node = crate::kube_node::RealNode::start(&cp, &target_dir().join("kube/node"), &images)?;
    let result = (|| {
        step("Prometheus' image for the shipped scrape configuration (tools/kube/prometheus)");
        let prometheus = crate::image::node_images::prometheus(&binaries.prometheus)?;
        let prometheus_image = crate::image::node_images::PROMETHEUS_IMAGE;
        node.import_image(&prometheus, prometheus_image)?;
        std::env::set_var("LOCKSTEP_PROMETHEUS_IMAGE", prometheus_image);
        apply_base(&cp)?;
        let kubeconfig = service_account_kubeconfig(&cp, &dir)?;
        // The `upgraded` scenario's image: the same build, another tag.
        let next_image = format!("{}-next", node.image);
        node.tag_image(&node.image, &next_image)?;
        let debug = target_dir().join("debug");
        let env = [
            ("LOCKSTEP_KUBE_KUBECONFIG", kubeconfig),
            ("LOCKSTEP_KUBE_ADMIN_KUBECONFIG", cp.admin_kubeconfig()),
            (
                "LOCKSTEP_KUBECTL",
                crate::kube_control_plane::bin_dir().join("kubectl"),
            ),
            ("LOCKSTEP_NODE_IMAGE", node.image.clone().into()),
            ("LOCKSTEP_NODE_IMAGE_NEXT", next_image.into()),
            (
                "LOCKSTEP_POLICY_DIR",
                target_dir().join("lockstep/policies"),
            ),
            ("LOCKSTEP_BIN", debug.join("lockstep")),
            ("LOCKSTEP_NODE_NAME", crate::kube_node::NODE_NAME.into()),
            // The `node-lost` scenario stops and resumes it.
            (
                "LOCKSTEP_NODE_KUBELET_PID",
                node.pid("kubelet")
                    .ok_or_else(|| anyhow::anyhow!("the node's kubelet is not running"))?
                    .to_string()
                    .into(),
            ),
        ];
        for (k, v) in &env {
            std::env::set_var(k, v);
        }
        // LOCKSTEP_NODE_VARIANTS="barrier log" runs only those (default:
        // every policy and the two negative controls).
        let chosen = std::env::var("LOCKSTEP_NODE_VARIANTS").unwrap_or_default();
        let variants: Vec<&str> = chosen.split_whitespace().collect();
        let expected = if variants.is_empty() {
            5
        } else {
            variants.len()
        };
        crate::chaos::run_suite_binary(
            debug.join("lockstep-chaos-node"),
            &variants,
            "kube-node",
            expected,
        )?;
        shipped::run(&cp, &node, &dir)
    })();
    if result.is_err() {
        for name in ["kubelet", "containerd"] {
            eprintln!(
                "xtask: {name}'s log, last lines:\n{}",
                crate::kube_control_plane::tail(&node.log(name), 20)
            );
        }
    }
    drop(node);
    drop(cp);
    result
}

/// `kubectl apply -k deploy/kubernetes/base`, server-side with strict
/// validation.
fn apply_base(cp: &ControlPlane) -> anyhow::Result<()> {
    step("kubectl apply -k deploy/kubernetes/base (server-side, strict validation)");
    let base = root().join("deploy/kubernetes/base");
    kubectl(
        cp,
        &[
            "apply",
            "-k",
            &base.display().to_string(),
            "--server-side",
            "--field-manager=lockstep-xtask",
            "--validate=strict",
        ],
    )
    .map(drop)
}

/// A kubeconfig in `dir` holding a token of the shipped service account.
fn service_account_kubeconfig(cp: &ControlPlane, dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let token = kubectl(
        cp,
        &[
            "create",
            "token",
            "lockstep-environment",
            "-n",
            "lockstep",
            "--duration=4h",
        ],
    )?;
    let kubeconfig = dir.join("environment.kubeconfig");
    write_kubeconfig(cp, token.trim(), &kubeconfig)?;
    Ok(kubeconfig)
}

fn against(cp: &ControlPlane, dir: &Path) -> anyhow::Result<()> {
    apply_base(cp)?;
    overlay(cp)?;

    step("a token of the shipped service account; the Role through the real authorizer");
    let kubeconfig = service_account_kubeconfig(cp, dir)?;
    authorizer(cp)?;

    let debug = target_dir().join("debug");
    let env = [
        ("LOCKSTEP_KUBE_KUBECONFIG", kubeconfig.clone()),
        ("LOCKSTEP_KUBE_ADMIN_KUBECONFIG", cp.admin_kubeconfig()),
        (
            "LOCKSTEP_KUBECTL",
            crate::kube_control_plane::bin_dir().join("kubectl"),
        ),
    ];
    for (k, v) in &env {
        std::env::set_var(k, v);
    }
    crate::chaos::run_suite_binary(
        debug.join("lockstep-chaos"),
        &[
            "orphans",
            "epoch@kube-apiserver",
            "id-watermark@kube-apiserver",
            "catalog-only@kube-apiserver",
        ],
        "orphans",
        3,
    )?;
    crate::chaos::run_suite_binary(debug.join("lockstep-chaos-kube"), &[], "kube", 1)?;
    Ok(())
}

/// Runs kubectl as the administrator; its stdout.
fn kubectl(cp: &ControlPlane, args: &[&str]) -> anyhow::Result<String> {
    let mut cmd: Command = cp.kubectl();
    cmd.args(args);
    eprintln!("xtask: $ kubectl {}", args.join(" "));
    crate::util::stdout(cmd)
}

/// The example overlay moves every namespaced object, and the
/// RoleBinding's subject, to its own namespace, and names its image.
fn overlay(cp: &ControlPlane) -> anyhow::Result<()> {
    step(
        "the example overlay, rendered by kustomize (its Secrets' files made as its comments say)",
    );
    let copy = target_dir().join("kube/example-overlay");
    let path = shipped::example_with_secrets(
        &copy,
        &crate::image::random_token()?,
        "postgres://lockstep@postgres.example.invalid:5432/lockstep",
    )?;
    let rendered = kubectl(cp, &["kustomize", &path.display().to_string()]);
    let _ = std::fs::remove_dir_all(&copy);
    let rendered = rendered?;
    let mut secrets = Vec::new();
    let want = "lockstep-example";
    let mut seen = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(&rendered) {
        let v = <serde_json::Value as serde::Deserialize>::deserialize(doc)?;
        let kind = v["kind"].as_str().unwrap_or("?").to_string();
        let name = v["metadata"]["name"].as_str().unwrap_or("?").to_string();
        seen += 1;
        if kind == "Namespace" {
            anyhow::ensure!(
                name == want,
                "the overlay's Namespace is {name}, not {want}"
            );
            continue;
        }
        anyhow::ensure!(
            v["metadata"]["namespace"] == want,
            "the overlay leaves {kind} {name} in {:?}",
            v["metadata"]["namespace"]
        );
        if kind == "RoleBinding" {
            for s in v["subjects"].as_array().into_iter().flatten() {
                anyhow::ensure!(
                    s["namespace"] == want,
                    "the overlay's RoleBinding binds {s} (not in {want})"
                );
            }
        }
        if kind == "Secret" {
            secrets.push(name.clone());
        }
        if kind == "Deployment" {
            let text = v.to_string();
            anyhow::ensure!(
                text.contains("registry.example.com/lockstep:0.3.0-dev")
                    && !text.contains("localhost/lockstep:"),
                "the overlay's Deployment does not run its image only: {text}"
            );
            anyhow::ensure!(
                text.contains("--tls-cert=/etc/lockstep/api-tls/tls.crt")
                    && text.contains("\"secretName\":\"lockstep-api-tls\""),
                "the overlay's Deployment does not serve the API over TLS: {text}"
            );
        }
    }
    anyhow::ensure!(seen >= 10, "the overlay rendered {seen} objects");
    secrets.sort();
    anyhow::ensure!(
        secrets
            == [
                "lockstep-api-tls",
                "lockstep-api-token",
                "lockstep-metrics-token",
                "lockstep-postgres"
            ],
        "the overlay makes the Secrets {secrets:?}"
    );
    // The base alone makes none (nothing anyone who read it knows).
    let base = kubectl(
        cp,
        &[
            "kustomize",
            &root().join("deploy/kubernetes/base").display().to_string(),
        ],
    )?;
    anyhow::ensure!(
        !base.lines().any(|l| l.trim() == "kind: Secret"),
        "the base renders a Secret"
    );
    eprintln!("xtask: the example overlay: {seen} objects, all in {want}");
    Ok(())
}

/// A kubeconfig acting as the service account with `token`.
fn write_kubeconfig(cp: &ControlPlane, token: &str, path: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!token.is_empty(), "kubectl create token printed nothing");
    let ca = cp.ca_cert().display().to_string();
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: real\n  cluster:\n    server: {}\n    certificate-authority: {ca}\nusers:\n- name: lockstep-environment\n  user:\n    token: {token}\ncontexts:\n- name: real\n  context:\n    cluster: real\n    user: lockstep-environment\n    namespace: lockstep\ncurrent-context: real\n",
        cp.server()
    );
    std::fs::write(path, text)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}

/// `kubectl auth can-i` as the service account: every verb the backend
/// uses allowed, every one of [`REFUSED`] refused.
fn authorizer(cp: &ControlPlane) -> anyhow::Result<()> {
    let can = |verb: &str, resource: &str, ns: &str| -> anyhow::Result<bool> {
        let mut cmd = cp.kubectl();
        // `pods/exec` is a subresource (kubectl would read TYPE/NAME).
        let (resource_only, subresource) = match resource.split_once('/') {
            Some((r, sub)) => (r, Some(sub)),
            None => (resource, None),
        };
        cmd.args([
            "auth",
            "can-i",
            verb,
            resource_only,
            "--as",
            SERVICE_ACCOUNT,
        ]);
        if let Some(sub) = subresource {
            cmd.arg(format!("--subresource={sub}"));
        }
        if ns.is_empty() {
            cmd.arg("--all-namespaces");
        } else {
            cmd.args(["-n", ns]);
        }
        let out = cmd.output()?;
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        match said.as_str() {
            "yes" => Ok(true),
            "no" => Ok(false),
            _ => bail!(
                "kubectl auth can-i {verb} {resource}: {said:?} {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        }
    };
    for (verb, resource) in ALLOWED {
        anyhow::ensure!(
            can(verb, resource, "lockstep")?,
            "the shipped Role does not allow {verb} {resource}, which the backend uses"
        );
    }
    for (verb, resource, ns) in REFUSED {
        anyhow::ensure!(
            !can(verb, resource, ns)?,
            "the shipped Role allows {verb} {resource} in {ns:?}, which the backend never uses"
        );
    }
    eprintln!(
        "xtask: the real authorizer allows the service account the backend's {} verbs and refuses {} others",
        ALLOWED.len(),
        REFUSED.len()
    );
    Ok(())
}
