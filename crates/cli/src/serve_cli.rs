//! `lockstep serve`: its arguments, the API token, the shutdown signal, and
//! the wiring of the environment library (store, orchestrator, policies,
//! metrics, TLS) into a serving process.

use super::*;

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// Directory holding the catalog, the orchestrator state and the tokens
    /// (also read from LOCKSTEP_STATE_DIR, as the client commands do).
    /// Created 0700 if missing; refused if other users can enter it; every
    /// file in it is made 0600.
    #[arg(long, env = "LOCKSTEP_STATE_DIR")]
    state_dir: PathBuf,
    /// Address to serve the gRPC API on (port 0 picks one; the chosen address
    /// is printed as `lockstep: serving on ADDR`).
    #[arg(long, default_value = "127.0.0.1:6875")]
    listen: SocketAddr,
    /// The orphan rule.
    #[arg(long, value_enum, default_value_t = OrphanRule::IdWatermark)]
    orphan_rule: OrphanRule,
    /// The replica program (default: lockstep-replica beside this binary, or in PATH).
    #[arg(long)]
    service_binary: Option<PathBuf>,
    /// The dataflow format the replica program builds, for a replica built
    /// with a family of your own (docs/embedding.md), e.g.
    /// lockstep.example.reachability.v2. Default: the built-in plan
    /// language (lockstep.plan.v1), whose plans and rows are checked here;
    /// another family's are checked by its replicas.
    #[arg(long)]
    format: Option<String>,
    /// An argument template for replica processes (repeat for several; see
    /// `ServiceTemplate` for placeholders such as {process} and {peers:timely}).
    /// Default: the lockstep-replica arguments.
    #[arg(long = "service-arg", allow_hyphen_values = true)]
    service_args: Vec<String>,
    /// A WASM orphan policy (a component of the `orphans` world) instead of
    /// `--orphan-rule`, e.g. target/lockstep/policies/id-watermark.wasm. On a
    /// failing call it deletes nothing.
    #[arg(long)]
    orphan_policy: Option<PathBuf>,
    /// A WASM distribution policy (the `distribution` world) choosing the
    /// strategy of every command, e.g. target/lockstep/policies/barrier.wasm.
    /// Default: the native rule, `barrier` for every command. On a failing
    /// call the command is sent with `barrier`.
    #[arg(long)]
    distribution_policy: Option<PathBuf>,
    /// Seconds between background orphan removals while serving (0: only at start).
    #[arg(long, default_value_t = 30)]
    orphan_interval_secs: u64,
    /// The largest frame on a replica connection, in bytes (at least 64 KiB);
    /// replica processes get the same. Writes and peek answers larger than
    /// half of it travel in parts.
    #[arg(long, env = "LOCKSTEP_MAX_FRAME_LEN", default_value_t = lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(65536..=(1u64 << 30)))]
    max_frame_len: usize,
    /// How far, in timestamps, an input collection's since stays behind its
    /// upper: updates below it are compacted (a row inserted and retracted
    /// there leaves nothing) and reads below it are refused with
    /// OUT_OF_RANGE. Omitted: every time is kept, and storage grows with
    /// every distinct (row, time) written.
    #[arg(long)]
    compaction_lag: Option<u64>,
    /// How far, in timestamps, a read (an open subscription, a peek in
    /// flight) may hold an input collection's since behind its upper. The
    /// since follows --compaction-lag only as far as the oldest read needs;
    /// a read held back further than this ends with OUT_OF_RANGE, so that
    /// a stuck reader cannot make storage grow without bound.
    #[arg(long, default_value_t = lockstep_environment::DEFAULT_READ_HOLD_LIMIT)]
    read_hold_limit: u64,
    /// A file holding the token every API call must carry
    /// (`authorization: Bearer TOKEN`; at least 16 characters; the file's
    /// first line). Also read from LOCKSTEP_API_TOKEN. Without either, the
    /// token is STATE_DIR/api.token (made on first start, 0600), which the
    /// client commands read with --state-dir or LOCKSTEP_STATE_DIR.
    #[arg(long)]
    api_token_file: Option<PathBuf>,
    /// Serve the API without a token, on a loopback address only: then any
    /// local user can drive every replica and read every row (the behaviour
    /// before tokens were the default). The metrics endpoint, if on
    /// loopback, asks no token either.
    #[arg(long)]
    insecure_loopback: bool,
    /// A file holding the read-only token of the metrics endpoint (its
    /// first line; what Prometheus holds: it reads metrics and can do
    /// nothing else). Default: STATE_DIR/metrics.token, made on first
    /// start. The API token is not accepted there. (A Kubernetes Secret
    /// mounted as a file: LOCKSTEP_METRICS_TOKEN_FILE.)
    #[arg(long, env = "LOCKSTEP_METRICS_TOKEN_FILE")]
    metrics_token_file: Option<PathBuf>,
    /// Serve the API over TLS with this certificate chain (PEM); needs
    /// --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics (OpenMetrics text) on this address at
    /// /metrics (port 0 picks one; printed on the serving line).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Let a WASM distribution policy choose `naive`, the negative control
    /// (each worker reconciles alone; it breaks I1 under faults). Refused
    /// otherwise, with the fallback `barrier` used instead. Only in a build
    /// with the test hooks (feature `failpoints`).
    #[cfg(feature = "failpoints")]
    #[arg(long)]
    experiments_allow_naive: bool,
    /// Never restart a replica on a controller event (a silent process,
    /// lost lockstep, a history mismatch): the negative control of the
    /// seeded campaign, which shows what those restarts repair. Only in a
    /// build with the test hooks (feature `failpoints`).
    #[cfg(feature = "failpoints")]
    #[arg(long, hide = true)]
    experiments_no_replica_restarts: bool,
    /// Where the catalog and the replicas' command logs live: omitted, SQLite
    /// files in the state directory (the embedded default); or a PostgreSQL
    /// database, `postgres://USER@HOST:PORT/DB`, shared by environments on
    /// several machines; TLS with `?sslmode=verify-full&sslrootcert=CA.pem`
    /// (or `sslmode=require`, unverified). Keep the password out of the
    /// command line: set PGPASSWORD (or the whole string in LOCKSTEP_STORE).
    #[arg(long, env = "LOCKSTEP_STORE")]
    store: Option<String>,
    /// The largest answer the API sends (default 256 MiB, what this CLI
    /// accepts); a larger peek answer is refused with RESOURCE_EXHAUSTED
    /// (tests lower it).
    #[arg(long, hide = true, default_value_t = lockstep_environment::server::MAX_ANSWER_BYTES)]
    max_answer_bytes: usize,
    /// Let a stale ensure overwrite a newer controller's service (negative
    /// tests only: built with feature `failpoints` only).
    #[cfg(feature = "failpoints")]
    #[arg(long, hide = true)]
    unconditional_writes: bool,
    /// Where replicas run: supervised processes on this machine, or pods
    /// in a Kubernetes cluster (in-cluster service account, or KUBECONFIG).
    #[arg(long, value_enum, default_value_t = OrchestratorKind::Process)]
    orchestrator: OrchestratorKind,
    /// Place every replica's process i on simulated host i mod N: a network
    /// namespace of its own joined to this one by veth pairs (process
    /// backend only; needs root and iproute2; see docs/hosts.md). 0: every
    /// process on this host's loopback.
    #[arg(long, default_value_t = 0)]
    hosts: usize,
    /// The Kubernetes namespace of the replicas' objects (in a pod: its
    /// own, from the downward API).
    #[arg(long, env = "LOCKSTEP_NAMESPACE", default_value = "lockstep")]
    namespace: String,
    /// The container image of replica pods (it holds --service-binary): a
    /// version tag or a digest (`latest` or no tag is refused). Default: the
    /// image of --kubernetes-owner's container `environment` (the
    /// environment's own build), else `lockstep:VERSION`.
    #[arg(long, env = "LOCKSTEP_KUBERNETES_IMAGE")]
    kubernetes_image: Option<String>,
    /// On SIGTERM or SIGINT: how long calls in flight may take to finish
    /// after health turned NOT_SERVING and new calls are refused; then the
    /// process exits 0, leaving the replicas running for the next
    /// environment to adopt.
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    shutdown_grace_secs: u64,
    /// The label value (`lockstep/environment`) that tells this
    /// environment's objects from others' in the same namespace.
    #[arg(long, default_value = "lockstep")]
    kubernetes_environment: String,
    /// The resource requests of every replica pod's container, as
    /// `NAME=QUANTITY,...` (Kubernetes backend). Default: cpu=500m,memory=512Mi.
    #[arg(long, value_parser = lockstep_orchestrator_kubernetes::objects::PodResources::parse_list)]
    kubernetes_replica_requests: Option<std::collections::BTreeMap<String, String>>,
    /// The resource limits of every replica pod's container, as
    /// `NAME=QUANTITY,...` (Kubernetes backend). Default: memory=2Gi (no CPU
    /// limit: a throttled worker holds up its whole replica).
    #[arg(long, value_parser = lockstep_orchestrator_kubernetes::objects::PodResources::parse_list)]
    kubernetes_replica_limits: Option<std::collections::BTreeMap<String, String>>,
    /// The environment's own object in --namespace, `Deployment/NAME`, or
    /// `Pod/NAME` for the Deployment that controls that pod (the shipped
    /// Deployment passes its own pod's name, so no object name is written
    /// in it): every object made for a replica (pods, Services, Secrets,
    /// PodDisruptionBudgets) gets an owner reference to it, so deleting the
    /// Deployment garbage-collects the replicas. Read once at start (its
    /// uid); a missing one is an error. Unset: the objects have no owner.
    #[arg(
        long,
        env = "LOCKSTEP_KUBERNETES_OWNER",
        value_name = "Deployment/NAME|Pod/NAME"
    )]
    kubernetes_owner: Option<String>,
}

/// The orchestrator backend of `lockstep serve`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OrchestratorKind {
    /// Supervised OS processes on this machine (state in STATE_DIR/orchestrator).
    Process,
    /// Pods and headless Services in a Kubernetes namespace.
    Kubernetes,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum OrphanRule {
    /// Delete services absent from the catalog with an older epoch.
    Epoch,
    /// Halt on a service ID at or above our next ID, else delete every service absent from the catalog.
    IdWatermark,
    /// Negative control: delete every service absent from the catalog.
    CatalogOnly,
}

impl OrphanRule {
    fn name(self) -> &'static str {
        match self {
            OrphanRule::Epoch => "epoch",
            OrphanRule::IdWatermark => "id-watermark",
            OrphanRule::CatalogOnly => "catalog-only",
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT (the handlers are installed when
/// it is called, so a signal that arrives during start-up is kept and acted
/// on once the environment serves).
pub(crate) fn shutdown_signal(
) -> anyhow::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!("{name}: shutting down gracefully");
    })
}

pub(crate) async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let shutdown = shutdown_signal()?;
    // Private by default (R1): the state directory 0700 (made if missing,
    // refused if open to others), the umask 077, the tokens in it.
    lockstep_environment::private::prepare_state_dir(&args.state_dir)?;
    let (token, metrics_token) = tokens(&args)?;
    let tls = tls_config(&args)?;
    refuse_open_listeners(&args, token.is_some(), metrics_token.is_some())?;
    // Bind first: failing to listen must not fence the running controller.
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    let metrics_listener = match args.metrics_listen {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("cannot listen on {a} for metrics"))?,
        ),
        None => None,
    };
    let local = local_socket(&args.state_dir, addr.port());
    let serving = Serving {
        listener,
        local,
        addr,
        metrics_listener,
        metrics_token,
        tls,
        max_answer_bytes: args.max_answer_bytes,
        #[cfg(feature = "failpoints")]
        no_restarts: args.experiments_no_replica_restarts,
        #[cfg(not(feature = "failpoints"))]
        no_restarts: false,
        orphan_interval: args.orphan_interval_secs,
        grace: args.shutdown_grace_secs,
    };
    let env = start_environment(args, token).await?;
    run_environment(env, serving, shutdown).await
}

/// The API's Unix socket in the state directory
/// ([`lockstep_api::local_socket_file`] of the API's `port`; 0600 by the
/// umask, in the private directory). Sockets of earlier environments that
/// nothing listens on any more are removed first. None (logged) if it
/// cannot be made, e.g. a path past the 107 bytes a socket's address
/// holds: clients then need TLS, or say they accept plain HTTP.
fn local_socket(
    state_dir: &std::path::Path,
    port: u16,
) -> Option<(tokio::net::UnixListener, PathBuf, (u64, u64))> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    for entry in std::fs::read_dir(state_dir).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let stale = name.starts_with("api-")
            && name.ends_with(".sock")
            && entry.file_type().is_ok_and(|t| t.is_socket())
            && std::os::unix::net::UnixStream::connect(entry.path())
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused);
        if stale {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    let path = state_dir.join(lockstep_api::local_socket_file(port));
    if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(&path);
    }
    match tokio::net::UnixListener::bind(&path) {
        Ok(listener) => {
            let id = std::fs::symlink_metadata(&path)
                .map(|m| (m.dev(), m.ino()))
                .unwrap_or_default();
            tracing::info!(socket = %path.display(), "the API also on the state directory's socket");
            Some((listener, path, id))
        }
        Err(e) => {
            tracing::warn!(socket = %path.display(), "cannot serve the API on the state directory's socket ({e}); clients must use TLS or --insecure-plaintext");
            None
        }
    }
}

/// A token file `lockstep serve` is given: read only if it is a regular
/// file this user or root owns that others cannot write (someone else's
/// file could hold a token they know), else from [`API_TOKEN_ENV`] as
/// [`api_token`] does.
fn served_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let token = match file {
        Some(path) => {
            let bytes = lockstep_environment::private::read_secret_file(path)
                .with_context(|| format!("reading the token file {}", path.display()))?;
            checked_token(Some(first_line(&String::from_utf8_lossy(&bytes))))?
        }
        None => api_token(None)?,
    };
    if let Some(t) = &token {
        refuse_placeholder(t)?;
    }
    Ok(token)
}

/// Refuses a token that is a placeholder someone forgot to replace (the
/// shipped manifests' `CHANGE-ME...`): everyone who read them knows it.
fn refuse_placeholder(token: &str) -> anyhow::Result<()> {
    let folded: String = token
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .collect();
    if folded.contains("changeme") {
        anyhow::bail!(
            "the token is a placeholder (it says CHANGE-ME): anyone who read the manifests knows it; make one, e.g. `head -c 32 /dev/urandom | base64`"
        );
    }
    Ok(())
}

/// The API token and the metrics token: from their files, else none under
/// `--insecure-loopback`, else the state directory's (made on first use).
fn tokens(args: &ServeArgs) -> anyhow::Result<(Option<String>, Option<String>)> {
    let explicit = served_token(args.api_token_file.as_deref())?;
    let token = match explicit {
        Some(t) => Some(t),
        None if args.insecure_loopback => {
            tracing::warn!(
                "--insecure-loopback: the API asks no token; any local user can drive every replica and read every row"
            );
            None
        }
        None => Some(
            lockstep_environment::private::state_token(
                &args.state_dir,
                lockstep_environment::private::API_TOKEN_FILE,
            )
            .context("reading or making the API token in the state directory")?,
        ),
    };
    let metrics_token = match (&args.metrics_token_file, args.insecure_loopback) {
        (Some(file), _) => served_token(Some(file))?,
        (None, true) => None,
        (None, false) => Some(
            lockstep_environment::private::state_token(
                &args.state_dir,
                lockstep_environment::private::METRICS_TOKEN_FILE,
            )
            .context("reading or making the metrics token in the state directory")?,
        ),
    };
    Ok((token, metrics_token))
}

/// The API's TLS identity, when both `--tls-cert` and `--tls-key` are given.
fn tls_config(args: &ServeArgs) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let cert = std::fs::read(cert)
                .with_context(|| format!("reading the TLS certificate {}", cert.display()))?;
            // The key is a secret: refused if another user owns it or
            // others can write it (it may have been planted).
            let key = lockstep_environment::private::read_secret_file(key)
                .with_context(|| format!("reading the TLS key {}", key.display()))?;
            Some(
                tonic::transport::ServerTlsConfig::new()
                    .identity(tonic::transport::Identity::from_pem(cert, key)),
            )
        }
        _ => None,
    };
    Ok(tls)
}

/// Refuses to serve the API or the metrics off loopback without a token.
fn refuse_open_listeners(args: &ServeArgs, token: bool, metrics_token: bool) -> anyhow::Result<()> {
    if !token && !args.listen.ip().is_loopback() {
        anyhow::bail!(
            "refusing to serve the API on {} without a token: anyone who reaches it could drive every replica; --insecure-loopback is for a loopback address only",
            args.listen
        );
    }
    if !metrics_token {
        if let Some(at) = args.metrics_listen.filter(|a| !a.ip().is_loopback()) {
            anyhow::bail!(
                "refusing to serve metrics on {at} without a token; --insecure-loopback is for a loopback address only"
            );
        }
    }
    Ok(())
}

/// The environment's configuration from the arguments, then the environment
/// started on the orchestrator they name.
async fn start_environment(
    args: ServeArgs,
    token: Option<String>,
) -> anyhow::Result<std::sync::Arc<Environment>> {
    let mut service = ServiceTemplate::lockstep_replica();
    if let Some(program) = args.service_binary.clone() {
        service.program = program;
    }
    if !args.service_args.is_empty() {
        service.args = args.service_args.clone();
    }
    let orphan_policy: Box<dyn lockstep_policy::OrphanPolicy + Send> = match &args.orphan_policy {
        Some(path) => {
            let p = lockstep_policy_host::WasmOrphanPolicy::load(path, Default::default())
                .with_context(|| format!("loading the orphan policy {}", path.display()))?;
            Box::new(lockstep_policy_host::SafeOrphans::new(p))
        }
        None => lockstep_policy::native_orphan_rule(args.orphan_rule.name())
            .expect("every OrphanRule value names a native rule"),
    };
    if let Some(path) = &args.distribution_policy {
        // Load once now, so that a bad file fails the start with a clear error.
        lockstep_policy_host::WasmDistributionPolicy::load(path, Default::default())
            .with_context(|| format!("loading the distribution policy {}", path.display()))?;
    }
    let orphan_in_force = match &args.orphan_policy {
        Some(p) => p.display().to_string(),
        None => format!("native {}", args.orphan_rule.name()),
    };
    let distribution_in_force = match &args.distribution_policy {
        Some(p) => p.display().to_string(),
        None => "native barrier".to_string(),
    };
    tracing::info!(
        orphan_policy = %orphan_in_force,
        distribution_policy = %distribution_in_force,
        "policies in force"
    );
    if let Some(store) = &args.store {
        // Only a URL on the command line is in the process list (clap took
        // it from LOCKSTEP_STORE when that holds the same string).
        let from_env = std::env::var("LOCKSTEP_STORE").ok().as_deref() == Some(store.as_str());
        if store_has_password(store) && !from_env {
            tracing::warn!(
                "the --store URL carries a password, which other users can read in the process list if it was given on the command line: set PGPASSWORD (or the whole URL in LOCKSTEP_STORE) instead"
            );
        }
    }
    // Only a build with the test hooks can turn the conditional writes off.
    #[cfg(feature = "failpoints")]
    let conditional_writes = !args.unconditional_writes;
    #[cfg(not(feature = "failpoints"))]
    let conditional_writes = true;
    let config = EnvironmentConfig {
        conditional_writes,
        distribution_policy: args.distribution_policy.clone(),
        max_frame_len: args.max_frame_len,
        compaction_lag: args.compaction_lag,
        read_hold_limit: args.read_hold_limit,
        api_token: token,
        #[cfg(feature = "failpoints")]
        allow_naive: args.experiments_allow_naive,
        #[cfg(not(feature = "failpoints"))]
        allow_naive: false,
        // A Secret made from a file may end in a newline.
        store: args.store.as_deref().map(|s| s.trim().to_string()),
        format: args.format.clone(),
        replicas_here: args.orchestrator == OrchestratorKind::Process,
        ..EnvironmentConfig::new(args.state_dir.clone(), orphan_policy, service)
    };
    Ok(match args.orchestrator {
        OrchestratorKind::Process if args.hosts > 0 => {
            Environment::start_with(
                config,
                lockstep_environment::process_orchestrator_on_hosts(args.hosts),
            )
            .await?
        }
        OrchestratorKind::Process => Environment::start(config).await?,
        OrchestratorKind::Kubernetes if args.hosts > 0 => {
            anyhow::bail!("--hosts places processes on simulated hosts of the process backend; pods already run on their own network stacks")
        }
        OrchestratorKind::Kubernetes => start_on_kubernetes(args, config).await?,
    })
}

/// The environment on Kubernetes: the replica image (named and pinned, or
/// the owner Deployment's), the master secret in the cluster, and the
/// orchestrator each controller generation gets.
async fn start_on_kubernetes(
    args: ServeArgs,
    config: EnvironmentConfig,
) -> anyhow::Result<std::sync::Arc<Environment>> {
    use lockstep_orchestrator_kubernetes::image as replica_image;
    // A named image is checked before anything is read or written.
    if let Some(image) = &args.kubernetes_image {
        replica_image::check_pinned(image)
            .map_err(|e| anyhow::anyhow!("--kubernetes-image: {e}"))?;
    }
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API server")?;
    let namespace = args.namespace;
    let environment = args.kubernetes_environment;
    let mut resources = lockstep_orchestrator_kubernetes::objects::PodResources::replica_default();
    if let Some(requests) = args.kubernetes_replica_requests {
        resources.requests = requests;
    }
    if let Some(limits) = args.kubernetes_replica_limits {
        resources.limits = limits;
    }
    let owner = match &args.kubernetes_owner {
        Some(object) => Some(
            lockstep_orchestrator_kubernetes::owner_object(client.clone(), &namespace, object)
                .await
                .map_err(|e| anyhow::anyhow!("--kubernetes-owner: {e}"))?,
        ),
        None => None,
    };
    let image = match (args.kubernetes_image, &owner) {
        (Some(image), _) => image,
        (None, Some((_, deployment))) => replica_image::owner_image(deployment)
            .map_err(|e| anyhow::anyhow!("the replica image (from --kubernetes-owner): {e}"))?,
        (None, None) => replica_image::default_image(),
    };
    tracing::info!(%image, "replica pods run this image");
    let owner = owner.map(|(reference, _)| reference);
    // The master secret of the replicas' session keys lives in the
    // cluster (Secret ENVIRONMENT-master), not in the state
    // directory: a pod's emptyDir would lose it on every restart,
    // and with it every replica's key, Secret and pod.
    let master = {
        let mut c = lockstep_orchestrator_kubernetes::KubernetesOrchestratorConfig::new(
            namespace.clone(),
            0,
        );
        c.environment = environment.clone();
        lockstep_orchestrator_kubernetes::KubernetesOrchestrator::new(client.clone(), c)
            .master_secret()
            .await
            .context("reading (or creating) the master secret in the cluster")?
    };
    let factory: lockstep_environment::OrchestratorFactory = Box::new(move |p| {
        let mut c =
            lockstep_orchestrator_kubernetes::KubernetesOrchestratorConfig::new(namespace, p.epoch);
        c.image = image;
        c.environment = environment;
        c.resources = resources;
        c.owner = owner;
        c.conditional_writes = p.conditional_writes;
        Ok(std::sync::Arc::new(
            lockstep_orchestrator_kubernetes::KubernetesOrchestrator::new(client, c),
        ))
    });
    Environment::start_with_secret(config, factory, Some(master)).await
}

/// What serving needs beside the environment: the bound listeners, the
/// tokens and limits, the background intervals.
struct Serving {
    listener: tokio::net::TcpListener,
    /// The API on the state directory's Unix socket, and the socket file's
    /// identity (device, inode) to remove it at the end if still ours.
    local: Option<(tokio::net::UnixListener, PathBuf, (u64, u64))>,
    addr: std::net::SocketAddr,
    metrics_listener: Option<tokio::net::TcpListener>,
    metrics_token: Option<String>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    max_answer_bytes: usize,
    no_restarts: bool,
    orphan_interval: u64,
    grace: u64,
}

/// Serves the API (and the metrics) until the shutdown signal, with the
/// background orphan removal and replica retry.
async fn run_environment(
    env: std::sync::Arc<Environment>,
    serving: Serving,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let Serving {
        listener,
        local,
        addr,
        metrics_listener,
        metrics_token,
        tls,
        max_answer_bytes,
        no_restarts,
        orphan_interval,
        grace,
    } = serving;
    env.set_max_answer_bytes(max_answer_bytes);
    if no_restarts {
        tracing::warn!("replica restarts on controller events are off (experiment)");
        env.set_replica_restarts(false);
    }
    let metrics_note = match metrics_listener {
        Some(l) => {
            let at = l.local_addr()?;
            // The read-only metrics token, on loopback too (unless
            // --insecure-loopback).
            tokio::spawn(lockstep_environment::metrics::serve(
                l,
                env.metrics(),
                Some(env.clone()),
                metrics_token,
            ));
            format!(", metrics on http://{at}/metrics")
        }
        None => String::new(),
    };
    println!(
        "lockstep: serving on {addr} (epoch {}){metrics_note}",
        env.epoch()
    );
    use std::io::Write;
    std::io::stdout().flush()?;
    tracing::info!(%addr, epoch = env.epoch(), "serving");
    let background = (orphan_interval > 0)
        .then(|| env.spawn_orphan_removal(std::time::Duration::from_secs(orphan_interval)));
    // A replica whose ensure failed (after its catalog write) is retried.
    let retry = env.spawn_replica_retry(std::time::Duration::from_secs(5));
    let grace = std::time::Duration::from_secs(grace);
    let (local, socket) = match local {
        Some((listener, path, id)) => (Some(listener), Some((path, id))),
        None => (None, None),
    };
    let result = env.serve_until(listener, local, tls, shutdown, grace).await;
    // The socket file, unless a newer environment replaced it meanwhile.
    if let Some((path, id)) = socket {
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(&path).is_ok_and(|m| (m.dev(), m.ino()) == id) {
            let _ = std::fs::remove_file(&path);
        }
    }
    retry.abort();
    if let Some(task) = background {
        task.abort();
    }
    result?;
    Ok(())
}

/// Whether a `postgres://USER:PASSWORD@HOST/...` URL carries a password.
pub(crate) fn store_has_password(url: &str) -> bool {
    let Some(rest) = url.split_once("://").map(|(_, r)| r) else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

#[cfg(test)]
mod store_url_tests {
    use super::store_has_password;

    #[test]
    fn a_password_in_the_store_url_is_noticed() {
        assert!(store_has_password("postgres://u:secret@db:5432/x"));
        assert!(!store_has_password("postgres://u@db:5432/x"));
        assert!(!store_has_password("postgres://db:5432/x"));
        assert!(!store_has_password("postgres://u@db:5432/x?opt=a:b"));
    }
}
