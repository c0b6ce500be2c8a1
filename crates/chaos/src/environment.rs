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
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use lockstep_catalog::ReplicaConfig;
use lockstep_orchestrator::process::{
    kill_all_services, ProcessOrchestrator, ProcessOrchestratorConfig,
};
use lockstep_orchestrator::{Orchestrator, ServiceStatus};
use tokio::io::AsyncBufReadExt;

use lockstep_kube_double::{ApiServerDouble, Matcher};
use lockstep_orchestrator_kubernetes::{KubernetesOrchestrator, KubernetesOrchestratorConfig};

use lockstep_environment::proto::environment_client::EnvironmentClient;
use lockstep_environment::{
    proto, EnvError, Environment, EnvironmentConfig, ServiceTemplate, ORCHESTRATOR_DIR,
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
        Ok(Sandbox {
            dir: tempfile::Builder::new()
                .prefix("lockstep-chaos-")
                .tempdir()?,
            backend,
            store,
            api_server: std::sync::Mutex::new(None),
        })
    }

    /// What a `lockstep serve` process needs to run on this sandbox's
    /// backend: extra arguments and environment. For Kubernetes, serves the
    /// API double over HTTP on 127.0.0.1 (once) and writes a kubeconfig
    /// pointing at it.
    pub async fn serve_args(&self) -> anyhow::Result<(Vec<String>, Vec<(String, PathBuf)>)> {
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
    /// a new one).
    pub fn identities(&self, services: &[ServiceStatus], id: u64) -> Vec<String> {
        match &self.backend {
            Backend::Process | Backend::ProcessOnPostgres(_) => pids(services, id)
                .into_iter()
                .map(|p| format!("{p:?}"))
                .collect(),
            Backend::Kubernetes(api) => {
                let name = ServiceTemplate::service_name(id);
                let mut pods: Vec<String> = api
                    .names("pods", K8S_NAMESPACE)
                    .into_iter()
                    .filter(|p| p.rsplit_once('-').is_some_and(|(s, _)| s == name))
                    .collect();
                pods.sort();
                pods.iter()
                    .filter_map(|p| api.get("pods", K8S_NAMESPACE, p))
                    .map(|p| p["metadata"]["uid"].as_str().unwrap_or("").to_string())
                    .collect()
            }
        }
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
        distribution_policy: None,
        max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
        compaction_lag: None,
        api_token: None,
        allow_naive: false,
        store: None,
        state_dir: dir.to_path_buf(),
        orphan_policy,
        service: sleep_template(),
        conditional_writes,
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

/// Records every service's epoch label after each step and reports the first
/// label that went backwards (O4).
#[derive(Default)]
struct LabelWatch {
    max: BTreeMap<String, u64>,
    violation: Option<String>,
}

impl LabelWatch {
    async fn observe(&mut self, sandbox: &Sandbox, after: &str) -> anyhow::Result<()> {
        for s in sandbox.services().await? {
            let max = self.max.entry(s.name.clone()).or_insert(s.epoch);
            if s.epoch < *max && self.violation.is_none() {
                self.violation = Some(format!(
                    "O4: service {}'s epoch label went back from {} to {} after step '{after}'",
                    s.name, max, s.epoch
                ));
            }
            *max = (*max).max(s.epoch);
        }
        Ok(())
    }
}

/// What a step of a stale or current controller did.
enum StepResult {
    Done,
    Halted,
}

fn step<T>(result: Result<T, EnvError>) -> anyhow::Result<StepResult> {
    match result {
        Ok(_) => Ok(StepResult::Done),
        Err(EnvError::Halted(_)) => Ok(StepResult::Halted),
        Err(e) => Err(anyhow!(e)),
    }
}

fn outcome(result: anyhow::Result<Result<(), String>>) -> Outcome {
    match result {
        Ok(Ok(())) => Outcome::Pass,
        Ok(Err(v)) => Outcome::Violation(v),
        Err(e) => Outcome::Harness(format!("{e:#}")),
    }
}

/// Sets up an environment with replicas `r1` (two processes) and `r2`, then
/// makes `r2` an orphan the way a crash after the catalog transaction of drop
/// replica does: a controller drops it from the catalog and dies before the
/// orchestrator call. Returns the IDs of r1 and r2.
async fn setup_with_orphan(sandbox: &Sandbox, rule: &str) -> anyhow::Result<(u64, u64)> {
    let env0 = sandbox.load(rule, true)?;
    env0.ensure_replicas().await?;
    env0.remove_orphans().await?;
    let r1 = env0.create_replica("r1", replica_config(2)).await?;
    let r2 = env0.create_replica("r2", replica_config(1)).await?;
    drop(env0);
    let mut crashed = sandbox.open_catalog()?;
    crashed.drop_replica("r2")?;
    Ok((r1.replica.id, r2.replica.id))
}

/// The seed's three-controller timeline (PR 16114): three environments load
/// the same catalog; their ensure, remove_orphans and serve steps interleave
/// as in the PR's diagram; serving is a catalog write (create a replica).
/// Checks O1–O4 after it.
pub async fn timeline(rule: &str, conditional_writes: bool) -> Outcome {
    timeline_on(Backend::Process, rule, conditional_writes).await
}

/// [`timeline`] on `backend`.
pub async fn timeline_on(backend: Backend, rule: &str, conditional_writes: bool) -> Outcome {
    outcome(timeline_inner(backend, rule, conditional_writes).await)
}

async fn timeline_inner(
    backend: Backend,
    rule: &str,
    conditional: bool,
) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let (_r1, orphan) = setup_with_orphan(&sandbox, rule).await?;
    let mut watch = LabelWatch::default();
    watch.observe(&sandbox, "setup").await?;
    // envd@1 loads first, so it has the lowest epoch of the three.
    let e1 = sandbox.load(rule, conditional)?;
    let e2 = sandbox.load(rule, conditional)?;
    let e3 = sandbox.load(rule, conditional)?;
    let envs = [&e1, &e2, &e3];
    let mut halted = [false; 3];
    let mut stale_writes = Vec::new();
    let mut first_violation = None;
    let steps: [(usize, &str); 9] = [
        (1, "ensure"),
        (2, "ensure"),
        (0, "ensure"),
        (2, "remove_orphans"),
        (0, "remove_orphans"),
        (2, "serve"),
        (1, "remove_orphans"),
        (0, "serve"),
        (1, "serve"),
    ];
    for (i, what) in steps {
        if halted[i] {
            continue;
        }
        let env = envs[i];
        let r = match what {
            "ensure" => step(env.ensure_replicas().await)?,
            "remove_orphans" => step(env.remove_orphans().await)?,
            _ => {
                let name = format!("created-by-epoch-{}", env.epoch());
                match env.create_replica(&name, replica_config(1)).await {
                    Ok(_) if i != 2 => {
                        stale_writes.push(format!("envd@{} created {name}", i + 1));
                        StepResult::Done
                    }
                    other => step(other)?,
                }
            }
        };
        if let StepResult::Halted = r {
            halted[i] = true;
        }
        let label = format!("envd@{} {what}", i + 1);
        watch.observe(&sandbox, &label).await?;
        // O4 and O1 after every step, so a violation names the step that
        // broke it; the first one is reported.
        if first_violation.is_none() {
            first_violation = watch.violation.clone();
        }
        if first_violation.is_none() {
            let newest: BTreeSet<u64> = e3.view().replicas.keys().copied().collect();
            let listed: BTreeSet<u64> = sandbox.services().await?.iter().map(|s| s.id).collect();
            if let Some(id) = newest.difference(&listed).next() {
                first_violation = Some(format!(
                    "O1: after step '{label}' (rule {rule}), replica {id} of the newest catalog (epoch {}) has no service",
                    e3.epoch()
                ));
            }
        }
    }
    if let Some(v) = first_violation {
        return Ok(Err(v));
    }
    let services = sandbox.services().await?;
    let newest: BTreeSet<u64> = e3.view().replicas.keys().copied().collect();
    if let Some(v) = watch.violation {
        return Ok(Err(v));
    }
    if halted[2] {
        return Ok(Err(format!(
            "O3: the newest controller (epoch {}) halted: {:?}",
            e3.epoch(),
            e3.halted()
        )));
    }
    if let Err(v) = check_o1_o2(&newest, &services) {
        return Ok(Err(v));
    }
    if services.iter().any(|s| s.id == orphan) {
        return Ok(Err(format!("O2: the orphan {orphan} survived")));
    }
    if !stale_writes.is_empty() {
        return Ok(Err(format!(
            "O3: stale controllers wrote: {}",
            stale_writes.join("; ")
        )));
    }
    if !halted[0] || !halted[1] {
        return Ok(Err(format!(
            "O3: stale controllers still running at the end (envd@1 halted: {}, envd@2 halted: {})",
            halted[0], halted[1]
        )));
    }
    Ok(Ok(()))
}

/// The negative control of conditional writes: with the condition off, the
/// timeline must show an epoch label going backwards (O4), or the harness
/// cannot see O4 violations. Passes when it does.
pub async fn o4_control(rule: &str) -> Outcome {
    o4_control_on(Backend::Process, rule).await
}

/// [`o4_control`] on `backend`.
pub async fn o4_control_on(backend: Backend, rule: &str) -> Outcome {
    match timeline_on(backend, rule, false).await {
        Outcome::Violation(v) if v.starts_with("O4") => Outcome::Pass,
        Outcome::Violation(v) => Outcome::Harness(format!(
            "with conditional writes off the timeline broke something else first: {v}"
        )),
        Outcome::Pass => Outcome::Harness(
            "with conditional writes off, no epoch label went backwards: the harness cannot see O4"
                .into(),
        ),
        h => h,
    }
}

/// The case that catches `catalog-only`: a stale controller loads its
/// catalog, a newer one opens the catalog and creates a replica, then the
/// stale one removes orphans. The newer replica must survive (O1) and the
/// stale controller must halt (O3).
pub async fn stale_loads_before_newer_creates(rule: &str) -> Outcome {
    stale_loads_before_newer_creates_on(Backend::Process, rule).await
}

/// [`stale_loads_before_newer_creates`] on `backend`.
pub async fn stale_loads_before_newer_creates_on(backend: Backend, rule: &str) -> Outcome {
    outcome(stale_loads_inner(backend, rule).await)
}

async fn stale_loads_inner(backend: Backend, rule: &str) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let env0 = sandbox.load(rule, true)?;
    env0.create_replica("r1", replica_config(1)).await?;
    drop(env0);
    let stale = sandbox.load(rule, true)?;
    stale.ensure_replicas().await?;
    let newer = sandbox.load(rule, true)?;
    newer.ensure_replicas().await?;
    newer.remove_orphans().await?;
    let fresh = newer.create_replica("fresh", replica_config(2)).await?;
    let stale_halted = match stale.remove_orphans().await {
        Ok(_) => matches!(
            stale.create_replica("by-stale", replica_config(1)).await,
            Err(EnvError::Halted(_))
        ),
        Err(EnvError::Halted(_)) => true,
        Err(e) => return Err(e.into()),
    };
    let newest: BTreeSet<u64> = newer.view().replicas.keys().copied().collect();
    let services = sandbox.services().await?;
    if !services.iter().any(|s| s.id == fresh.replica.id) {
        return Ok(Err(format!(
            "O1: stale controller (epoch {}, rule {rule}) deleted replica 'fresh' (id {}) that the newer controller (epoch {}) created after the stale one loaded its catalog",
            stale.epoch(),
            fresh.replica.id,
            newer.epoch()
        )));
    }
    if let Err(v) = check_o1_o2(&newest, &services) {
        return Ok(Err(v));
    }
    if !stale_halted {
        return Ok(Err(format!(
            "O3: the stale controller (epoch {}) did not halt",
            stale.epoch()
        )));
    }
    Ok(Ok(()))
}

/// A stale controller loads a catalog holding `r2`; a newer one drops `r2`;
/// then the stale one ensures its replicas. It must not re-create `r2` (O4:
/// a drop is a write, and never goes back to an older controller's
/// version), and it must halt (O3); the newest state keeps O1 and O2.
pub async fn stale_cannot_resurrect(rule: &str) -> Outcome {
    stale_cannot_resurrect_on(Backend::Process, rule).await
}

/// [`stale_cannot_resurrect`] on `backend`.
pub async fn stale_cannot_resurrect_on(backend: Backend, rule: &str) -> Outcome {
    outcome(stale_resurrect_inner(backend, rule).await)
}

async fn stale_resurrect_inner(backend: Backend, rule: &str) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let env0 = sandbox.load(rule, true)?;
    env0.create_replica("r1", replica_config(2)).await?;
    let r2 = env0.create_replica("r2", replica_config(1)).await?;
    drop(env0);
    let stale = sandbox.load(rule, true)?;
    let newer = sandbox.load(rule, true)?;
    newer.ensure_replicas().await?;
    newer.remove_orphans().await?;
    newer.drop_replica("r2").await?;
    let halted = match stale.ensure_replicas().await {
        Ok(()) => false,
        Err(EnvError::Halted(_)) => true,
        Err(e) => return Err(e.into()),
    };
    let services = sandbox.services().await?;
    if services.iter().any(|s| s.id == r2.replica.id) {
        return Ok(Err(format!(
            "O4: the stale controller (epoch {}) re-created replica r2 (id {}) that the newer controller (epoch {}) dropped",
            stale.epoch(),
            r2.replica.id,
            newer.epoch()
        )));
    }
    if !halted {
        return Ok(Err(format!(
            "O3: the stale controller (epoch {}) did not halt when its ensure was refused",
            stale.epoch()
        )));
    }
    let newest: BTreeSet<u64> = newer.view().replicas.keys().copied().collect();
    Ok(check_o1_o2(&newest, &services))
}

/// A stale controller that was overtaken halts on its next catalog write
/// and changes nothing (O3).
pub async fn stale_halts_on_write(rule: &str) -> Outcome {
    stale_halts_on_write_on(Backend::Process, rule).await
}

/// [`stale_halts_on_write`] on `backend`.
pub async fn stale_halts_on_write_on(backend: Backend, rule: &str) -> Outcome {
    outcome(stale_halts_inner(backend, rule).await)
}

async fn stale_halts_inner(backend: Backend, rule: &str) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let a = sandbox.load(rule, true)?;
    a.ensure_replicas().await?;
    a.remove_orphans().await?;
    let r1 = a.create_replica("r1", replica_config(1)).await?;
    let b = sandbox.load(rule, true)?;
    b.ensure_replicas().await?;
    b.remove_orphans().await?;
    let before = sandbox.services().await?;
    match a.drop_replica("r1").await {
        Err(EnvError::Halted(reason)) if reason.contains("another controller took over") => {}
        Err(EnvError::Halted(reason)) => {
            return Ok(Err(format!(
                "O3: halted without saying why clearly: {reason}"
            )))
        }
        other => {
            return Ok(Err(format!(
                "O3: the stale controller's drop was not refused: {other:?}"
            )))
        }
    }
    if a.halted().is_none() {
        return Ok(Err("O3: the stale controller is not marked halted".into()));
    }
    if !matches!(a.list_replicas().await, Err(EnvError::Halted(_))) {
        return Ok(Err("O3: the halted controller still answers".into()));
    }
    let after = sandbox.services().await?;
    if before != after || !after.iter().any(|s| s.id == r1.replica.id) {
        return Ok(Err(format!(
            "O1: the stale controller's refused drop changed the services: {before:?} -> {after:?}"
        )));
    }
    let newest: BTreeSet<u64> = b.view().replicas.keys().copied().collect();
    Ok(check_o1_o2(&newest, &after))
}

/// The service of the Kubernetes-only scenarios.
fn k8s_service(id: u64) -> lockstep_orchestrator::ServiceConfig {
    lockstep_orchestrator::ServiceConfig::new(ServiceTemplate::service_name(id), id, "sleep")
        .port("timely")
        .fixed_args(["300"])
}

/// The record and pod labels of the service of `id` on the double.
fn k8s_epochs(api: &ApiServerDouble, id: u64) -> (Option<String>, Option<String>) {
    let name = ServiceTemplate::service_name(id);
    let epoch = |o: Option<serde_json::Value>| {
        o.and_then(|o| {
            o["metadata"]["labels"]["lockstep/epoch"]
                .as_str()
                .map(str::to_string)
        })
    };
    (
        epoch(api.get("services", K8S_NAMESPACE, &name)),
        epoch(api.get("pods", K8S_NAMESPACE, &format!("{name}-0"))),
    )
}

/// Kubernetes only: a delete racing a re-create with the same name. A stale
/// controller (epoch 1) drops a service; between its read of the pod and
/// its delete, a newer controller (epoch 2) re-creates the service (a new
/// record, a new pod of the same name). The delete's preconditions (uid and
/// resourceVersion) must stop it: the newer pod survives (O1) and the
/// record keeps epoch 2 (O4).
pub async fn k8s_delete_races_recreate() -> Outcome {
    outcome(k8s_delete_races_inner().await)
}

async fn k8s_delete_races_inner() -> anyhow::Result<Result<(), String>> {
    let api = ApiServerDouble::new();
    let stale = KubernetesOrchestrator::new(api.client(K8S_NAMESPACE), k8s_config(1, true));
    stale.ensure_service(k8s_service(1)).await?;
    let name = ServiceTemplate::service_name(1);
    let b = api.clone();
    let (record_name, pod_name) = (name.clone(), format!("{name}-0"));
    api.before_next(
        Matcher::new(http::Method::DELETE, "pods", Some(&pod_name)),
        move |_| {
            // The newer controller's ensure, as its requests would leave it.
            let Some(mut record) = b.get("services", K8S_NAMESPACE, &record_name) else {
                return;
            };
            let labels = &mut record["metadata"]["labels"];
            labels["lockstep/state"] = serde_json::json!("live");
            labels["lockstep/epoch"] = serde_json::json!("2");
            if let Some(l) = labels.as_object_mut() {
                l.remove("lockstep/dropped-by");
            }
            let _ = b.replace("services", K8S_NAMESPACE, &record_name, record);
            if let Some(mut pod) = b.get("pods", K8S_NAMESPACE, &pod_name) {
                let _ = b.delete("pods", K8S_NAMESPACE, &pod_name);
                pod["metadata"]["labels"]["lockstep/epoch"] = serde_json::json!("2");
                if let Some(m) = pod["metadata"].as_object_mut() {
                    m.remove("uid");
                    m.remove("resourceVersion");
                }
                let _ = b.create("pods", K8S_NAMESPACE, pod);
            }
        },
    );
    stale.drop_service(&name).await?;
    match k8s_epochs(&api, 1) {
        (Some(r), Some(p)) if r == "2" && p == "2" => Ok(Ok(())),
        (r, None) => Ok(Err(format!(
            "O1: the stale controller's delete removed the pod the newer controller (epoch 2) re-created (record epoch {r:?})"
        ))),
        (r, p) => Ok(Err(format!(
            "O4: after the race the record says epoch {r:?} and the pod {p:?}, not 2"
        ))),
    }
}

/// Kubernetes only: 409 Conflict on ensure. A newer environment's ensure
/// meets a plain 409 on its record write (it must read again and succeed,
/// not fail or halt); then a stale environment's ensure loses the
/// compare-and-swap to a write of the newer epoch between its read and its
/// write (it must read again, refuse and halt: O3), and the record's epoch
/// never goes back (O4). O1 and O2 hold for the newest catalog.
pub async fn k8s_conflict_on_ensure(rule: &str) -> Outcome {
    outcome(k8s_conflict_inner(rule).await)
}

async fn k8s_conflict_inner(rule: &str) -> anyhow::Result<Result<(), String>> {
    let api = ApiServerDouble::new();
    let sandbox = Sandbox::on(Backend::Kubernetes(api.clone()))?;
    let env0 = sandbox.load(rule, true)?;
    let r1 = env0
        .create_replica("r1", replica_config(2))
        .await?
        .replica
        .id;
    drop(env0);
    let name = ServiceTemplate::service_name(r1);
    let stale = sandbox.load(rule, true)?;
    let newer = sandbox.load(rule, true)?;
    // The stale ensure reads the record (epoch of env0), then the newer
    // controller's write lands before the stale one's compare-and-swap.
    let b = api.clone();
    let record_name = name.clone();
    let newer_epoch = newer.epoch().to_string();
    let epoch = newer_epoch.clone();
    api.before_next(
        Matcher::new(http::Method::PUT, "services", Some(&name)),
        move |_| {
            if let Some(mut record) = b.get("services", K8S_NAMESPACE, &record_name) {
                record["metadata"]["labels"]["lockstep/epoch"] = serde_json::json!(epoch);
                let _ = b.replace("services", K8S_NAMESPACE, &record_name, record);
            }
        },
    );
    let stale_halted = matches!(stale.ensure_replicas().await, Err(EnvError::Halted(_)));
    let (record_epoch, _) = k8s_epochs(&api, r1);
    if record_epoch.as_deref() != Some(newer_epoch.as_str()) {
        return Ok(Err(format!(
            "O4: the record's epoch is {record_epoch:?} after the stale ensure (epoch {}) lost the race, not {newer_epoch}",
            stale.epoch()
        )));
    }
    if !stale_halted {
        return Ok(Err(format!(
            "O3: the stale controller (epoch {}) did not halt after losing the compare-and-swap",
            stale.epoch()
        )));
    }
    // A plain 409 on the newest controller's write: read again, write again.
    api.fail_next(
        Matcher::new(http::Method::PUT, "services", Some(&name)),
        409,
        "the object has been modified; please apply your changes to the latest version and try again",
    );
    match newer.ensure_replicas().await {
        Ok(()) => {}
        Err(EnvError::Halted(h)) => {
            return Ok(Err(format!(
                "O3: the newest controller halted on a plain 409 instead of reading again: {h}"
            )))
        }
        Err(e) => return Err(e.into()),
    }
    newer.remove_orphans().await?;
    let newest: BTreeSet<u64> = newer.view().replicas.keys().copied().collect();
    Ok(check_o1_o2(&newest, &sandbox.services().await?))
}

/// Kubernetes only: the watch drops. The API server ends the backend's pod
/// watch, a pod goes while nobody watches, then the same with an etcd
/// compaction between the re-list and the re-watch (410 Gone). Each exit
/// must still be reported (the liveness of what the environment learns
/// from the orchestrator, I2), and the service must still be listed (O1).
pub async fn k8s_watch_drops() -> Outcome {
    outcome(k8s_watch_inner().await)
}

async fn k8s_watch_inner() -> anyhow::Result<Result<(), String>> {
    let api = ApiServerDouble::new();
    let o = KubernetesOrchestrator::new(api.client(K8S_NAMESPACE), k8s_config(1, true));
    o.ensure_service(k8s_service(1).scale(2)).await?;
    let mut events = o.watch_services();
    let watching = |api: &ApiServerDouble| {
        let api = api.clone();
        async move {
            for _ in 0..1000 {
                if api.open_watches() > 0 {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(anyhow!("the backend never watched"))
        }
    };
    watching(&api).await?;
    let name = ServiceTemplate::service_name(1);
    api.drop_watches();
    api.delete("pods", K8S_NAMESPACE, &format!("{name}-0"))
        .map_err(|e| anyhow!(e))?;
    if !exit_reported(&mut events, &name, 0).await {
        return Ok(Err(
            "I2: a pod deleted while the watch was down was never reported".into(),
        ));
    }
    watching(&api).await?;
    let pod1 = format!("{name}-1");
    api.before_next(Matcher::new(http::Method::GET, "pods", None), |_| {});
    api.before_next(Matcher::new(http::Method::GET, "pods", None), move |api| {
        let _ = api.delete("pods", K8S_NAMESPACE, &pod1);
        api.compact();
    });
    api.drop_watches();
    if !exit_reported(&mut events, &name, 1).await {
        return Ok(Err(
            "I2: a pod deleted before a 410 Gone watch was never reported".into(),
        ));
    }
    if !o.list_services().await?.iter().any(|s| s.name == name) {
        return Ok(Err(format!(
            "O1: {name} is no longer listed after the watch dropped"
        )));
    }
    Ok(Ok(()))
}

/// Whether an `Exited` event of `service`'s process `process` arrives
/// within 5 s.
async fn exit_reported(
    events: &mut tokio::sync::broadcast::Receiver<lockstep_orchestrator::ServiceEvent>,
    service: &str,
    process: usize,
) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, events.recv()).await {
            Err(_) | Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return false,
            Ok(Err(_)) => continue,
            Ok(Ok(e)) => {
                if e.service == service
                    && e.process == Some(process)
                    && matches!(
                        e.kind,
                        lockstep_orchestrator::ServiceEventKind::Exited { .. }
                    )
                {
                    return true;
                }
            }
        }
    }
}

/// A running `lockstep serve` process.
#[derive(Debug)]
pub struct EnvProcess {
    child: tokio::process::Child,
    /// The gRPC address, `http://host:port`.
    pub url: String,
    /// Where its stderr goes.
    pub stderr_path: PathBuf,
    /// The line it printed when it started serving (addresses, epoch).
    pub serving_line: String,
}

impl EnvProcess {
    /// Starts `lockstep serve` on `state_dir` with `rule`, the `sleep`
    /// service, and `failpoints` (the `FAILPOINTS` value) if given, and waits
    /// (bounded) until it serves.
    pub async fn start(
        bin: &Path,
        state_dir: &Path,
        rule: &str,
        failpoints: Option<&str>,
        extra_args: &[&str],
    ) -> anyhow::Result<EnvProcess> {
        Self::start_with_env(bin, state_dir, rule, failpoints, extra_args, &[]).await
    }

    /// [`start`](Self::start) with extra environment variables.
    pub async fn start_with_env(
        bin: &Path,
        state_dir: &Path,
        rule: &str,
        failpoints: Option<&str>,
        extra_args: &[&str],
        env: &[(String, PathBuf)],
    ) -> anyhow::Result<EnvProcess> {
        let n = std::fs::read_dir(state_dir)?.count();
        let stderr_path = state_dir.join(format!("lockstep-{n}.stderr"));
        let stderr = std::fs::File::create(&stderr_path)?;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.args(["serve", "--state-dir"])
            .arg(state_dir)
            .args(["--listen", "127.0.0.1:0", "--orphan-rule", rule])
            .args(["--service-binary", "sleep", "--service-arg", "300"])
            .args(extra_args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true);
        match failpoints {
            Some(fp) => cmd.env("FAILPOINTS", fp),
            None => cmd.env_remove("FAILPOINTS"),
        };
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(WAIT, lines.next_line()).await;
        let stderr_text = || std::fs::read_to_string(&stderr_path).unwrap_or_default();
        let line = match line {
            Ok(Ok(Some(line))) => line,
            Ok(_) => bail!(
                "lockstep serve exited before serving: {:?}; stderr:\n{}",
                child.wait().await,
                stderr_text()
            ),
            Err(_) => bail!(
                "lockstep serve did not serve within {WAIT:?}; stderr:\n{}",
                stderr_text()
            ),
        };
        let addr = line
            .strip_prefix("lockstep: serving on ")
            .and_then(|r| r.split_whitespace().next())
            .ok_or_else(|| anyhow!("unexpected first line {line:?}"))?;
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(EnvProcess {
            child,
            url: format!("http://{addr}"),
            stderr_path,
            serving_line: line.clone(),
        })
    }

    /// A gRPC client of it.
    pub async fn client(&self) -> anyhow::Result<EnvironmentClient<tonic::transport::Channel>> {
        Ok(
            tokio::time::timeout(WAIT, EnvironmentClient::connect(self.url.clone()))
                .await
                .context("connect timed out")??,
        )
    }

    /// Waits (bounded) for it to exit; returns its status and stderr.
    pub async fn wait_exit(&mut self) -> anyhow::Result<(std::process::ExitStatus, String)> {
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .context("lockstep did not exit in time")??;
        Ok((status, std::fs::read_to_string(&self.stderr_path)?))
    }

    /// Its PID, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Kills it (SIGKILL, a crash) and waits for it.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }
}

/// Runs the `lockstep replica ...` CLI against `url` (bounded).
pub async fn cli(bin: &Path, url: &str, args: &[&str]) -> anyhow::Result<std::process::Output> {
    let mut cmd = tokio::process::Command::new(bin);
    cmd.arg("replica")
        .args(args)
        .args(["--server", url])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    Ok(tokio::time::timeout(WAIT, cmd.output())
        .await
        .context("the CLI did not finish in time")??)
}

async fn list(env: &EnvProcess) -> anyhow::Result<Vec<proto::Replica>> {
    Ok(env
        .client()
        .await?
        .list_replicas(proto::ListReplicasRequest::default())
        .await?
        .into_inner()
        .replicas)
}

fn pids(services: &[ServiceStatus], id: u64) -> Vec<Option<u32>> {
    services
        .iter()
        .filter(|s| s.id == id)
        .flat_map(|s| s.processes.iter().map(|p| p.pid))
        .collect()
}

/// Crashes `lockstep serve` at `failpoint` during create replica (for the
/// create failpoints) or drop replica, restarts it, and checks: O1 and O2
/// against the restarted controller's catalog, and that the replica that was
/// never touched kept its processes (adopted, not restarted).
pub async fn crash_scenario(bin: &Path, rule: &str, failpoint: &str) -> Outcome {
    crash_scenario_on(Backend::Process, bin, rule, failpoint).await
}

/// [`crash_scenario`] on `backend` (on Kubernetes, `lockstep serve` reaches
/// the API double over loopback HTTP through a kubeconfig).
pub async fn crash_scenario_on(
    backend: Backend,
    bin: &Path,
    rule: &str,
    failpoint: &str,
) -> Outcome {
    outcome(crash_inner(backend, bin, rule, failpoint).await)
}

async fn crash_inner(
    backend: Backend,
    bin: &Path,
    rule: &str,
    failpoint: &str,
) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let dropping = failpoint.contains("drop");
    // A: creates the replicas, then crashes (SIGKILL) with them running.
    let mut a = sandbox.start_env(bin, rule, None).await?;
    let ok = |o: std::process::Output, what: &str| -> anyhow::Result<()> {
        if !o.status.success() {
            bail!("{what} failed: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(())
    };
    ok(
        cli(bin, &a.url, &["create", "keep", "--processes", "2"]).await?,
        "create keep",
    )?;
    if dropping {
        ok(
            cli(bin, &a.url, &["create", "doomed", "--processes", "2"]).await?,
            "create doomed",
        )?;
    }
    let keep_id = list(&a)
        .await?
        .iter()
        .find(|r| r.name == "keep")
        .map(|r| r.id)
        .ok_or_else(|| anyhow!("keep is not listed"))?;
    a.kill().await?;
    let keep_pids = sandbox.identities(&sandbox.services().await?, keep_id);

    // B: crashes at the failpoint.
    let mut b = sandbox
        .start_env(bin, rule, Some(&format!("{failpoint}=panic")))
        .await?;
    let out = if dropping {
        cli(bin, &b.url, &["drop", "doomed"]).await?
    } else {
        cli(bin, &b.url, &["create", "doomed", "--processes", "2"]).await?
    };
    let (status, stderr) = b.wait_exit().await?;
    if status.success() || out.status.success() || !stderr.contains(failpoint) {
        bail!(
            "the environment did not crash at {failpoint} (is `lockstep` built with the failpoints feature?): exit {status}, CLI {:?}; stderr:\n{stderr}",
            out.status
        );
    }

    // C: restarts; loads, ensures, removes orphans, serves.
    let c = sandbox.start_env(bin, rule, None).await?;
    let catalog = list(&c).await?;
    let services = sandbox.services().await?;
    let newest: BTreeSet<u64> = catalog.iter().map(|r| r.id).collect();
    if let Err(v) = check_o1_o2(&newest, &services) {
        return Ok(Err(format!(
            "after a crash at {failpoint} and a restart: {v}"
        )));
    }
    if !catalog.iter().any(|r| r.name == "keep") {
        return Ok(Err(format!(
            "O1: replica 'keep' vanished from the catalog after a crash at {failpoint}"
        )));
    }
    let now = sandbox.identities(&services, keep_id);
    if now != keep_pids {
        return Ok(Err(format!(
            "adoption: replica 'keep' was restarted instead of adopted across two controller restarts (pids {keep_pids:?} -> {now:?})"
        )));
    }
    Ok(Ok(()))
}

/// A stale `lockstep serve` halts (exits 3, saying another controller took
/// over) on its next catalog write, and the newer one is unaffected (O3).
pub async fn stale_binary_halts(bin: &Path, rule: &str) -> Outcome {
    stale_binary_halts_on(Backend::Process, bin, rule).await
}

/// [`stale_binary_halts`] on `backend`.
pub async fn stale_binary_halts_on(backend: Backend, bin: &Path, rule: &str) -> Outcome {
    outcome(stale_binary_inner(backend, bin, rule).await)
}

async fn stale_binary_inner(
    backend: Backend,
    bin: &Path,
    rule: &str,
) -> anyhow::Result<Result<(), String>> {
    let sandbox = Sandbox::on(backend)?;
    let mut a = sandbox.start_env(bin, rule, None).await?;
    let out = cli(bin, &a.url, &["create", "r1"]).await?;
    if !out.status.success() {
        bail!("create r1 failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let b = sandbox.start_env(bin, rule, None).await?;
    let out = cli(bin, &a.url, &["create", "r2"]).await?;
    if out.status.success() {
        return Ok(Err("O3: the stale controller accepted a create".into()));
    }
    let (status, stderr) = a.wait_exit().await?;
    if status.code() != Some(3) || !stderr.contains("another controller took over") {
        return Ok(Err(format!(
            "O3: the stale controller did not halt with a clear message: exit {status}; stderr:\n{stderr}"
        )));
    }
    let catalog = list(&b).await?;
    if catalog.iter().map(|r| r.name.as_str()).collect::<Vec<_>>() != ["r1"] {
        return Ok(Err(format!(
            "O3: the stale controller changed the catalog: {catalog:?}"
        )));
    }
    let newest: BTreeSet<u64> = catalog.iter().map(|r| r.id).collect();
    Ok(check_o1_o2(&newest, &sandbox.services().await?))
}
