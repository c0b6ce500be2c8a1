//! The orphan scenarios on a real Kubernetes API server (variant
//! `RULE@kube-apiserver`): `cargo xtask kube` starts one on loopback
//! (kube-apiserver with RBAC on, etcd, kwok giving pods their phases; no
//! kubelet), applies `deploy/kubernetes/base`, and passes here
//!
//! - [`KUBECONFIG_ENV`]: a kubeconfig holding a token of the shipped
//!   service account (`lockstep/lockstep-environment`): every environment of
//!   a scenario, library or `lockstep serve`, acts with it alone, so the
//!   shipped Role is what the real authorizer checks;
//! - [`ADMIN_KUBECONFIG_ENV`] and [`KUBECTL_ENV`]: what the harness itself
//!   uses to make each sandbox's namespace and to read pods.
//!
//! Every sandbox gets a namespace of its own (`lockstep-chaos-PID-N`,
//! labelled for the `restricted` pod security standard, which the real
//! admission enforces on every pod the backend makes) holding the shipped
//! `rbac.yaml`, its RoleBinding's subject in `lockstep` (as kustomize fills
//! it in): the one service account above bound to the shipped Role there.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;

/// The service account's kubeconfig.
pub const KUBECONFIG_ENV: &str = "LOCKSTEP_KUBE_KUBECONFIG";
/// The administrator's kubeconfig (the harness's own reads and set-up).
pub const ADMIN_KUBECONFIG_ENV: &str = "LOCKSTEP_KUBE_ADMIN_KUBECONFIG";
/// The namespace of the shipped service account the harness holds a token
/// of (the base kustomization's).
pub const SERVICE_ACCOUNT_NAMESPACE: &str = "lockstep";
/// The kubectl the harness runs.
pub const KUBECTL_ENV: &str = "LOCKSTEP_KUBECTL";

/// A real API server, as [`KUBECONFIG_ENV`] and the others name it.
#[derive(Clone)]
pub struct RealCluster {
    /// The service account's kubeconfig (given to `lockstep serve`).
    pub kubeconfig: PathBuf,
    /// The same, read (every library environment's client is made from it).
    config: std::sync::Arc<kube::Config>,
    admin: PathBuf,
    kubectl: PathBuf,
    rbac: PathBuf,
}

impl std::fmt::Debug for RealCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RealCluster({})", self.config.cluster_url)
    }
}

static NEXT_NAMESPACE: AtomicU64 = AtomicU64::new(1);

impl RealCluster {
    /// The cluster the environment names, read; an error says which
    /// variable is missing or what is wrong with it.
    pub async fn from_env() -> anyhow::Result<RealCluster> {
        let var = |name: &str| {
            std::env::var_os(name)
                .map(PathBuf::from)
                .with_context(|| format!("{name} is not set (cargo xtask kube sets it)"))
        };
        let kubeconfig = var(KUBECONFIG_ENV)?;
        let parsed = kube::config::Kubeconfig::read_from(&kubeconfig)
            .with_context(|| format!("reading {}", kubeconfig.display()))?;
        let config = kube::Config::from_custom_kubeconfig(parsed, &Default::default())
            .await
            .with_context(|| format!("loading {}", kubeconfig.display()))?;
        Ok(RealCluster {
            kubeconfig,
            config: std::sync::Arc::new(config),
            admin: var(ADMIN_KUBECONFIG_ENV)?,
            kubectl: var(KUBECTL_ENV)?,
            rbac: Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../deploy/kubernetes/base/rbac.yaml"),
        })
    }

    /// kubectl as the administrator.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg("--kubeconfig").arg(&self.admin);
        cmd
    }

    /// Runs `args` with [`kubectl`](Self::kubectl); its stdout, or an error
    /// with its stderr.
    pub fn kubectl_out(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self
            .kubectl()
            .args(args)
            .output()
            .with_context(|| format!("running {}", self.kubectl.display()))?;
        anyhow::ensure!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A fresh namespace for one sandbox, restricted, with the shipped
    /// `rbac.yaml` applied in it (server-side, strict field validation).
    pub fn fresh_namespace(&self) -> anyhow::Result<String> {
        let n = NEXT_NAMESPACE.fetch_add(1, Ordering::Relaxed);
        let ns = format!("lockstep-chaos-{}-{n}", std::process::id());
        self.kubectl_out(&["create", "namespace", &ns])?;
        self.kubectl_out(&[
            "label",
            "namespace",
            &ns,
            "pod-security.kubernetes.io/enforce=restricted",
        ])?;
        let rbac = self.shipped_rbac()?;
        let mut apply = self.kubectl();
        apply
            .args([
                "apply",
                "--server-side",
                "--field-manager=lockstep-chaos",
                "--validate=strict",
                "-n",
                &ns,
                "-f",
                "-",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = apply.spawn().context("running kubectl apply")?;
        {
            use std::io::Write;
            let mut stdin = child.stdin.take().expect("piped");
            stdin.write_all(rbac.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        anyhow::ensure!(
            out.status.success(),
            "kubectl apply (rbac.yaml in {ns}): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(ns)
    }

    /// The shipped `rbac.yaml` as a JSON list, its RoleBinding's subject in
    /// [`SERVICE_ACCOUNT_NAMESPACE`] (where kustomize puts it: the service
    /// account whose token this harness holds). Nothing else is changed.
    fn shipped_rbac(&self) -> anyhow::Result<String> {
        let text = std::fs::read_to_string(&self.rbac)
            .with_context(|| format!("reading {}", self.rbac.display()))?;
        let mut items = Vec::new();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let mut v: serde_json::Value = serde::Deserialize::deserialize(doc)?;
            if v["kind"] == "RoleBinding" {
                for s in v["subjects"].as_array_mut().into_iter().flatten() {
                    s["namespace"] = SERVICE_ACCOUNT_NAMESPACE.into();
                }
            }
            items.push(v);
        }
        Ok(serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string())
    }

    /// A client acting as the service account, in `namespace`.
    pub fn client(&self, namespace: &str) -> anyhow::Result<kube::Client> {
        let mut config = (*self.config).clone();
        config.default_namespace = namespace.to_string();
        Ok(kube::Client::try_from(config)?)
    }

    /// The uids of `service`'s pods in `namespace`, by pod name; an error
    /// if they cannot be read (never an empty list standing in for one).
    pub fn pod_uids(&self, namespace: &str, service: &str) -> anyhow::Result<Vec<String>> {
        let out = self.kubectl_out(&[
            "get",
            "pods",
            "-n",
            namespace,
            "-l",
            &format!("lockstep/service={service}"),
            "-o",
            "json",
        ])?;
        let list: serde_json::Value =
            serde_json::from_str(&out).context("kubectl get pods printed no JSON")?;
        let mut pods: Vec<(String, String)> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                (
                    p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    p["metadata"]["uid"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
        pods.sort();
        Ok(pods.into_iter().map(|(_, uid)| uid).collect())
    }
}
