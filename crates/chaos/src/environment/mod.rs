//! Real environments for the suites and tests: sandboxes, `lockstep serve`
//! processes, the CLI, and the orphan fault scenarios, shared by the orphan
//! suite (`cargo xtask chaos orphans`, the `lockstep-chaos` binary), which
//! runs them and reports their outcomes, and by the environment's
//! integration tests (a dev-dependency: none of this is in the production
//! library).
//!
//! Every scenario runs real processes: services are real OS processes
//! (`sleep`, bounded to five minutes so nothing can leak for long), and the
//! crash scenarios run the real `lockstep` binary, crash it at a failpoint and
//! restart it. A scenario ends in one of three [`Outcome`]s: it passed, it saw
//! an invariant broken ([`Outcome::Violation`], naming the invariant and what
//! was seen), or the harness itself failed ([`Outcome::Harness`]). Only a
//! violation counts as "caught" for the negative control.
//!
//! Two kinds of scenario:
//!
//! - **Library scenarios** drive [`Environment`]s step by step
//!   (load / ensure / remove_orphans / serve), several on one state directory,
//!   to produce exactly the interleavings of the seed's three-controller
//!   timeline. They need no failpoints.
//! - **Crash scenarios** start `lockstep serve`, crash it with
//!   `FAILPOINTS=<point>=panic` during create or drop replica, restart it and
//!   check O1/O2 and that the surviving replica was adopted, not restarted.
//!   They need a `lockstep` binary built with the `failpoints` feature.
//!
//! The library scenarios also run on the Kubernetes backend
//! ([`Backend::Kubernetes`]): every controller of the scenario gets a
//! `KubernetesOrchestrator` on one shared in-memory API server double (no
//! cluster, no processes; a pod is "running" when the double's kubelet says
//! so). The crash scenarios run there too: the harness serves the double
//! over HTTP on 127.0.0.1 and starts `lockstep serve --orchestrator
//! kubernetes` with a kubeconfig pointing at it; adoption is then checked by
//! pod uids instead of PIDs. Every scenario except the Kubernetes-only ones
//! also runs with the catalog in PostgreSQL ([`Backend::ProcessOnPostgres`]:
//! each sandbox on a fresh database, `--store` for `lockstep serve`), so the
//! fence checked is PostgreSQL's. Three scenarios
//! exist only there ([`k8s_delete_races_recreate`], [`k8s_conflict_on_ensure`],
//! [`k8s_watch_drops`]): they drive the backend through the trait, as the
//! environment does, and check O1/O4 at the objects.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context};
use lockstep_catalog::ReplicaConfig;
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceStatus};

use lockstep_kube_double::ApiServerDouble;
use lockstep_orchestrator_kubernetes::{KubernetesOrchestrator, KubernetesOrchestratorConfig};

use lockstep_environment::{Environment, EnvironmentConfig, ServiceTemplate, ORCHESTRATOR_DIR};

mod crash;
mod k8s_scenarios;
mod process;
pub mod real_kube;
mod scenarios;

pub use crash::{crash_scenario, crash_scenario_on, stale_binary_halts, stale_binary_halts_on};
pub use k8s_scenarios::{k8s_conflict_on_ensure, k8s_delete_races_recreate, k8s_watch_drops};
use process::pids;
pub use process::{cli, Bearer, Client, EnvProcess};
pub use scenarios::{
    o4_control, o4_control_on, stale_cannot_resurrect, stale_cannot_resurrect_on,
    stale_halts_on_write, stale_halts_on_write_on, stale_loads_before_newer_creates,
    stale_loads_before_newer_creates_on, timeline, timeline_on,
};

/// The rules the suite runs, and whether each must pass (`catalog-only` is
/// the negative control that must be caught).
pub const VARIANTS: [(&str, bool); 3] = [
    ("epoch", true),
    ("id-watermark", true),
    ("catalog-only", false),
];

/// Failpoints of create replica, in path order.
pub const CREATE_FAILPOINTS: [&str; 3] = [
    "before_catalog_create_replica",
    "after_catalog_create_replica",
    "after_orchestrator_create_replica",
];

/// Failpoints of drop replica, in path order.
pub const DROP_FAILPOINTS: [&str; 3] = [
    "before_catalog_drop_replica",
    "after_catalog_drop_replica",
    "after_orchestrator_drop_replica",
];

/// Every bounded wait of the harness.
const WAIT: Duration = Duration::from_secs(30);

/// How a scenario ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every checked invariant held.
    Pass,
    /// An invariant broke: which one, and what was seen.
    Violation(String),
    /// The harness failed (a timeout, a process that would not start).
    Harness(String),
}

/// Where a scenario's services run, and where its state lives.
#[derive(Clone, Debug, Default)]
pub enum Backend {
    /// Real OS processes: the process backend on the sandbox's state
    /// directory, the catalog in SQLite there.
    #[default]
    Process,
    /// The Kubernetes backend on an in-memory API server double that every
    /// controller of the scenario shares (namespace [`K8S_NAMESPACE`]).
    Kubernetes(ApiServerDouble),
    /// The process backend with the catalog and the command logs in
    /// PostgreSQL (`--store`): every sandbox gets a fresh, empty database.
    ProcessOnPostgres(FreshDatabase),
    /// The Kubernetes backend on a real API server ([`real_kube`]): every
    /// sandbox in a fresh namespace, every controller acting as the shipped
    /// service account.
    RealKubernetes(real_kube::RealCluster),
}

/// Makes a fresh, empty PostgreSQL database and returns its connection
/// string (the orphan suite makes them on a throw-away server).
#[derive(Clone)]
pub struct FreshDatabase(pub std::sync::Arc<dyn Fn() -> anyhow::Result<String> + Send + Sync>);

impl std::fmt::Debug for FreshDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FreshDatabase")
    }
}

impl Backend {
    /// The backend named `process` or `kubernetes` (a fresh API server).
    /// `postgres` needs a database maker: build [`Backend::ProcessOnPostgres`].
    pub fn named(name: &str) -> Option<Backend> {
        match name {
            "process" => Some(Backend::Process),
            "kubernetes" => Some(Backend::Kubernetes(ApiServerDouble::new())),
            _ => None,
        }
    }

    /// `process`, `kubernetes` or `postgres`.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Process => "process",
            Backend::Kubernetes(_) => "kubernetes",
            Backend::ProcessOnPostgres(_) => "postgres",
            Backend::RealKubernetes(_) => "kube-apiserver",
        }
    }
}

/// The namespace of the Kubernetes scenarios.
pub const K8S_NAMESPACE: &str = "lockstep";

/// The Kubernetes backend's configuration in the scenarios.
pub fn k8s_config(epoch: u64, conditional_writes: bool) -> KubernetesOrchestratorConfig {
    let mut config = KubernetesOrchestratorConfig::new(K8S_NAMESPACE, epoch);
    config.conditional_writes = conditional_writes;
    config.ready_timeout = Duration::from_secs(5);
    config.delete_timeout = Duration::from_secs(5);
    config.poll_interval = Duration::from_millis(5);
    config
}

/// The Kubernetes backend's configuration on a real API server: as on the
/// double, with waits long enough for a real server and kwok (pods get
/// their IPs within about a second; a delete completes within the pods'
/// grace period).
pub fn real_config(
    namespace: &str,
    epoch: u64,
    conditional_writes: bool,
) -> KubernetesOrchestratorConfig {
    let mut config = k8s_config(epoch, conditional_writes);
    config.namespace = namespace.to_string();
    config.ready_timeout = Duration::from_secs(30);
    config.delete_timeout = Duration::from_secs(30);
    config.poll_interval = Duration::from_millis(50);
    config
}

/// A temporary state directory whose services are killed on drop.
#[derive(Debug)]
pub struct Sandbox {
    dir: tempfile::TempDir,
    backend: Backend,
    /// The `--store` of every environment on this sandbox: a fresh
    /// database on [`Backend::ProcessOnPostgres`], else none (SQLite).
    store: Option<String>,
    /// The Kubernetes backend's API double served over loopback HTTP, for
    /// `lockstep serve` processes, once [`serve_args`](Sandbox::serve_args)
    /// started it: the task and the kubeconfig.
    api_server: std::sync::Mutex<Option<(tokio::task::JoinHandle<()>, PathBuf)>>,
    /// The Kubernetes namespace of its services ([`K8S_NAMESPACE`] on the
    /// double, a fresh one on a real API server).
    namespace: String,
}

impl Sandbox {
    /// A fresh, empty state directory (process backend).
    pub fn new() -> anyhow::Result<Sandbox> {
        Self::on(Backend::Process)
    }

    /// A fresh, empty state directory whose services run on `backend`.
    pub fn on(backend: Backend) -> anyhow::Result<Sandbox> {
        let store = match &backend {
            Backend::ProcessOnPostgres(fresh) => {
                Some((fresh.0)().context("making a fresh PostgreSQL database")?)
            }
            _ => None,
        };
        let namespace = match &backend {
            Backend::RealKubernetes(cluster) => cluster
                .fresh_namespace()
                .context("making the sandbox's namespace")?,
            _ => K8S_NAMESPACE.to_string(),
        };
        Ok(Sandbox {
            dir: tempfile::Builder::new()
                .prefix("lockstep-chaos-")
                .tempdir()?,
            backend,
            store,
            api_server: std::sync::Mutex::new(None),
            namespace,
        })
    }

    /// What a `lockstep serve` process needs to run on this sandbox's
    /// backend: extra arguments and environment. For Kubernetes, serves the
    /// API double over HTTP on 127.0.0.1 (once) and writes a kubeconfig
    /// pointing at it.
    pub async fn serve_args(&self) -> anyhow::Result<(Vec<String>, Vec<(String, PathBuf)>)> {
        if let Backend::RealKubernetes(cluster) = &self.backend {
            let args = [
                "--orchestrator",
                "kubernetes",
                "--namespace",
                &self.namespace,
            ];
            return Ok((
                args.iter().map(|a| a.to_string()).collect(),
                vec![("KUBECONFIG".to_string(), cluster.kubeconfig.clone())],
            ));
        }
        let Backend::Kubernetes(api) = &self.backend else {
            let args = match &self.store {
                Some(url) => vec!["--store".to_string(), url.clone()],
                None => Vec::new(),
            };
            return Ok((args, Vec::new()));
        };
        let existing = self
            .api_server
            .lock()
            .expect("poisoned")
            .as_ref()
            .map(|(_, k)| k.clone());
        let kubeconfig = match existing {
            Some(k) => k,
            None => {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
                let url = format!("http://{}", listener.local_addr()?);
                let path = self.path().join("kubeconfig");
                std::fs::write(&path, lockstep_kube_double::kubeconfig(&url, K8S_NAMESPACE))?;
                let task = api.serve(listener);
                *self.api_server.lock().expect("poisoned") = Some((task, path.clone()));
                path
            }
        };
        let args = ["--orchestrator", "kubernetes", "--namespace", K8S_NAMESPACE];
        Ok((
            args.iter().map(|a| a.to_string()).collect(),
            vec![("KUBECONFIG".to_string(), kubeconfig)],
        ))
    }

    /// Starts `lockstep serve` on this sandbox (see [`EnvProcess::start`]).
    pub async fn start_env(
        &self,
        bin: &Path,
        rule: &str,
        failpoints: Option<&str>,
    ) -> anyhow::Result<EnvProcess> {
        let (args, env) = self.serve_args().await?;
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        EnvProcess::start_with_env(bin, self.path(), rule, failpoints, &args, &env).await
    }

    /// Each process's identity of the service of `id`: its PID on the
    /// process backend, its pod's uid on Kubernetes (a replaced process has
    /// a new one). An error when none can be read: an empty list before and
    /// after would pass an adoption check it never made.
    pub fn identities(&self, services: &[ServiceStatus], id: u64) -> anyhow::Result<Vec<String>> {
        let ids: Vec<String> = match &self.backend {
            Backend::Process | Backend::ProcessOnPostgres(_) => pids(services, id)
                .into_iter()
                .map(|p| format!("{p:?}"))
                .collect(),
            Backend::Kubernetes(api) => {
                // The service's pods by their labels (a pod's name holds
                // its generation too), in process order.
                let name = ServiceTemplate::service_name(id);
                let mut pods: Vec<(u64, String)> = api
                    .names("pods", K8S_NAMESPACE)
                    .into_iter()
                    .filter_map(|p| api.get("pods", K8S_NAMESPACE, &p))
                    .filter(|p| p["metadata"]["labels"]["lockstep/service"] == name.as_str())
                    .map(|p| {
                        let labels = &p["metadata"]["labels"];
                        let process = labels["lockstep/process"].as_str().unwrap_or("");
                        (
                            process.parse().unwrap_or(u64::MAX),
                            p["metadata"]["uid"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect();
                pods.sort();
                pods.into_iter().map(|(_, uid)| uid).collect()
            }
            Backend::RealKubernetes(cluster) => {
                cluster.pod_uids(&self.namespace, &ServiceTemplate::service_name(id))?
            }
        };
        anyhow::ensure!(!ids.is_empty(), "no process of service {id} could be read");
        Ok(ids)
    }

    /// The state directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Opens this sandbox's catalog (in its state directory, or its
    /// database) as a controller would: a new epoch.
    pub fn open_catalog(&self) -> anyhow::Result<lockstep_catalog::Catalog> {
        let store = lockstep_catalog::Store::from_arg(
            self.store.as_deref(),
            self.path().join(lockstep_environment::CATALOG_FILE),
        )
        .map_err(|e| anyhow!("bad store: {e}"))?;
        Ok(lockstep_catalog::Catalog::open_store(&store)?)
    }

    /// Lists the services recorded in the state directory, or on the API
    /// server (any epoch).
    pub async fn services(&self) -> anyhow::Result<Vec<ServiceStatus>> {
        match &self.backend {
            Backend::Process | Backend::ProcessOnPostgres(_) => {
                let orchestrator = ProcessOrchestrator::new(ProcessOrchestratorConfig::new(
                    self.path().join(ORCHESTRATOR_DIR),
                    0,
                ))?;
                Ok(orchestrator.list_services().await?)
            }
            Backend::Kubernetes(api) => {
                let orchestrator =
                    KubernetesOrchestrator::new(api.client(K8S_NAMESPACE), k8s_config(0, true));
                Ok(orchestrator.list_services().await?)
            }
            Backend::RealKubernetes(cluster) => {
                let orchestrator = KubernetesOrchestrator::new(
                    cluster.client(&self.namespace)?,
                    real_config(&self.namespace, 0, true),
                );
                Ok(orchestrator.list_services().await?)
            }
        }
    }

    /// Loads an environment on this sandbox with the native rule `rule`.
    pub fn load(&self, rule: &str, conditional_writes: bool) -> anyhow::Result<Environment> {
        match &self.backend {
            Backend::Process => load(self.path(), rule, conditional_writes),
            Backend::ProcessOnPostgres(_) => {
                let mut config = env_config(self.path(), rule, conditional_writes)?;
                config.store = self.store.clone();
                Ok(Environment::load(config)?)
            }
            Backend::Kubernetes(api) => {
                let api = api.clone();
                let factory: lockstep_environment::OrchestratorFactory = Box::new(move |p| {
                    Ok(std::sync::Arc::new(KubernetesOrchestrator::new(
                        api.client(K8S_NAMESPACE),
                        k8s_config(p.epoch, p.conditional_writes),
                    )))
                });
                Ok(Environment::load_with(
                    env_config(self.path(), rule, conditional_writes)?,
                    factory,
                )?)
            }
            Backend::RealKubernetes(cluster) => {
                let client = cluster.client(&self.namespace)?;
                let namespace = self.namespace.clone();
                let factory: lockstep_environment::OrchestratorFactory = Box::new(move |p| {
                    Ok(std::sync::Arc::new(KubernetesOrchestrator::new(
                        client,
                        real_config(&namespace, p.epoch, p.conditional_writes),
                    )))
                });
                Ok(Environment::load_with(
                    env_config(self.path(), rule, conditional_writes)?,
                    factory,
                )?)
            }
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some((task, _)) = self.api_server.lock().expect("poisoned").take() {
            task.abort();
        }
        let _ = kill_all_services(&self.path().join(ORCHESTRATOR_DIR));
    }
}

/// The service template of the scenarios: `sleep 300`, the same command line
/// for every controller (so an ensure of an unchanged replica adopts it).
pub fn sleep_template() -> ServiceTemplate {
    ServiceTemplate {
        program: PathBuf::from("sleep"),
        args: vec!["300".to_string()],
    }
}

fn replica_config(processes: u32) -> ReplicaConfig {
    ReplicaConfig {
        processes,
        workers_per_process: 1,
        config: String::new(),
    }
}

/// Loads an environment on `dir` with the native rule `rule`.
pub fn load(dir: &Path, rule: &str, conditional_writes: bool) -> anyhow::Result<Environment> {
    Ok(Environment::load(env_config(
        dir,
        rule,
        conditional_writes,
    )?)?)
}

fn env_config(
    dir: &Path,
    rule: &str,
    conditional_writes: bool,
) -> anyhow::Result<EnvironmentConfig> {
    let orphan_policy =
        lockstep_policy::native_orphan_rule(rule).ok_or_else(|| anyhow!("no rule {rule}"))?;
    Ok(EnvironmentConfig {
        conditional_writes,
        ..EnvironmentConfig::new(dir, orphan_policy, sleep_template())
    })
}

/// Checks O1 and O2 of the services against the newest catalog's replica IDs.
fn check_o1_o2(newest: &BTreeSet<u64>, services: &[ServiceStatus]) -> Result<(), String> {
    let listed: BTreeMap<u64, &ServiceStatus> = services.iter().map(|s| (s.id, s)).collect();
    for id in newest {
        match listed.get(id) {
            None => {
                return Err(format!(
                    "O1: replica {id} of the newest catalog has no service (listed: {:?})",
                    listed.keys().collect::<Vec<_>>()
                ))
            }
            Some(s) if !s.processes.iter().all(|p| p.running) => {
                return Err(format!(
                    "O1: replica {id}'s service {} has processes down: {:?}",
                    s.name, s.processes
                ))
            }
            Some(_) => {}
        }
    }
    for s in services {
        if !newest.contains(&s.id) {
            return Err(format!(
                "O2: orphan service {} (id {}, epoch {}) survived; the newest catalog holds {:?}",
                s.name, s.id, s.epoch, newest
            ));
        }
    }
    Ok(())
}

fn outcome(result: anyhow::Result<Result<(), String>>) -> Outcome {
    match result {
        Ok(Ok(())) => Outcome::Pass,
        Ok(Err(v)) => Outcome::Violation(v),
        Err(e) => Outcome::Harness(format!("{e:#}")),
    }
}
