//! What every scenario of one variant shares ([`Setting`]): its cluster,
//! namespace and service, how `lockstep serve` is started there, and what
//! the scenarios read of its pods; and the variant's end ([`finish`]).

use std::path::PathBuf;

use lockstep_chaos::environment::real_kube::RealCluster;
use lockstep_chaos::environment::EnvProcess;
use lockstep_chaos::outcome::{violation, Failure};

use super::{pods, Api, Scenario, PROCESSES, RECOVERY};

/// What every scenario of one variant shares.
pub(crate) struct Setting {
    pub(crate) cluster: RealCluster,
    pub(crate) ns: String,
    pub(crate) service: String,
    pub(crate) bin: PathBuf,
    pub(crate) state: tempfile::TempDir,
    pub(crate) args: Vec<String>,
    pub(crate) env: Vec<(String, std::ffi::OsString)>,
    /// The names' control: pods keep their names across generations.
    pub(crate) names_reused: bool,
}

impl Setting {
    /// The setting of variant `policy` (a shipped policy, or a control:
    /// `POLICY+no-shared-fate`, `POLICY+reused-names`), in a fresh namespace.
    pub(crate) fn new(cluster: &RealCluster, policy: &str) -> anyhow::Result<Setting> {
        use anyhow::Context;
        let var = |name: &str| {
            std::env::var_os(name)
                .map(PathBuf::from)
                .with_context(|| format!("{name} is not set (cargo xtask kube sets it)"))
        };
        let image = var("LOCKSTEP_NODE_IMAGE")?;
        let (policy, control) = match policy.split_once('+') {
            Some((p, c @ ("no-shared-fate" | "reused-names"))) => (p, Some(c)),
            Some((_, other)) => anyhow::bail!("unknown variant suffix +{other}"),
            None => (policy, None),
        };
        let policy_file = var("LOCKSTEP_POLICY_DIR")?.join(format!("{policy}.wasm"));
        anyhow::ensure!(
            policy_file.is_file(),
            "{} is missing (cargo xtask build-policies)",
            policy_file.display()
        );
        let bin = var("LOCKSTEP_BIN")?;
        let ns = cluster.fresh_namespace()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--orchestrator".into(),
            "kubernetes".into(),
            "--namespace".into(),
            ns.clone(),
            "--kubernetes-environment".into(),
            "node".into(),
            "--kubernetes-image".into(),
            image.to_string_lossy().into_owned(),
            "--service-binary".into(),
            "/usr/local/bin/lockstep-replica".into(),
            // Two cores hold every pod of the suite.
            "--kubernetes-replica-requests".into(),
            "cpu=10m,memory=32Mi".into(),
            "--distribution-policy".into(),
            policy_file.to_string_lossy().into_owned(),
        ];
        let mut env = vec![(
            "KUBECONFIG".to_string(),
            cluster.kubeconfig.clone().into_os_string(),
        )];
        match control {
            Some("no-shared-fate") => {
                env.push(("FAILPOINTS".into(), "kube_shared_fate_off=return".into()))
            }
            Some(_) => env.push(("FAILPOINTS".into(), "kube_pod_names_reused=return".into())),
            None => {}
        }
        Ok(Setting {
            cluster: cluster.clone(),
            ns,
            // The first replica of a fresh environment.
            service: "replica-1".into(),
            bin,
            state: tempfile::Builder::new()
                .prefix("lockstep-node-")
                .tempdir()?,
            args,
            env,
            names_reused: control == Some("reused-names"),
        })
    }

    pub(crate) async fn serve(&self) -> anyhow::Result<EnvProcess> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        EnvProcess::serve(&self.bin, self.state.path(), &args, &self.env).await
    }

    /// [`Setting::serve`] with the replica image `image` (an environment
    /// of another build).
    pub(crate) async fn serve_on(&self, image: &str) -> anyhow::Result<EnvProcess> {
        let mut args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let at = args
            .iter()
            .position(|a| *a == "--kubernetes-image")
            .ok_or_else(|| anyhow::anyhow!("the setting names no --kubernetes-image"))?;
        args[at + 1] = image;
        EnvProcess::serve(&self.bin, self.state.path(), &args, &self.env).await
    }

    pub(crate) fn api(env: &EnvProcess) -> Api {
        Api {
            url: env.url.clone(),
            token: env.token.clone(),
            tls: None,
        }
    }

    /// The generation now, as a harness error if it cannot be read.
    pub(crate) fn generation(&self) -> Result<u64, Failure> {
        pods::generation(&self.cluster, &self.ns, &self.service)
            .map_err(|e| Failure::Harness(format!("{e:#}")))
    }

    /// The pods run as one generation, every one ready (I2), within
    /// [`RECOVERY`] (a readiness probe trails the first answer).
    pub(crate) async fn one_generation(&self) -> Result<u64, Failure> {
        self.one_generation_beside(&[]).await
    }

    /// [`Setting::one_generation`], the pods named in `beside` (held
    /// terminating) left out.
    pub(crate) async fn one_generation_beside(&self, beside: &[&str]) -> Result<u64, Failure> {
        self.one_generation_of(PROCESSES as usize, beside).await
    }

    /// [`Setting::one_generation_beside`] for a replica of `processes`
    /// processes (resized).
    pub(crate) async fn one_generation_of(
        &self,
        processes: usize,
        beside: &[&str],
    ) -> Result<u64, Failure> {
        pods::await_one_generation(
            &self.cluster,
            &self.ns,
            &self.service,
            processes,
            beside,
            RECOVERY,
        )
        .await
    }

    /// The pod of process `i` in the record's generation.
    pub(crate) fn pod_of(&self, i: u32) -> Result<String, Failure> {
        pods::pod_of(&self.cluster, &self.ns, &self.service, i)
            .map_err(|e| Failure::Harness(format!("{e:#}")))
    }

    /// Waits until a new generation replaced `before` (I2: a process's death
    /// is the whole generation's), within [`RECOVERY`].
    pub(crate) async fn replaced(&self, before: u64, what: &str) -> Result<(), Failure> {
        match pods::generation_above(&self.cluster, &self.ns, &self.service, before, RECOVERY).await
        {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(violation(
                "I2",
                format!(
                    "{what}: generation {before} was not replaced within {} s",
                    RECOVERY.as_secs()
                ),
            )),
            Err(e) => Err(Failure::Harness(format!("{e:#}"))),
        }
    }

    /// The host PID of process `i`'s `lockstep-replica`.
    pub(crate) fn pid_of(&self, i: u32) -> Result<u32, Failure> {
        let harness = |e: anyhow::Error| Failure::Harness(format!("{e:#}"));
        let pods = pods::pods(&self.cluster, &self.ns, &self.service).map_err(harness)?;
        let name = self.pod_of(i)?;
        let pod = pods
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| Failure::Harness(format!("no pod {name}")))?;
        pods::replica_pid(&pod.uid).map_err(harness)
    }
}

/// Stops the environment and deletes the variant's namespace (its pods go
/// with it), then returns the scenarios.
pub(crate) fn finish(out: Vec<Scenario>, env: EnvProcess, setting: &Setting) -> Vec<Scenario> {
    drop(env);
    if out.iter().any(|s| s.result.is_err()) {
        // What the environment said last, to see why.
        let newest = std::fs::read_dir(setting.state.path())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "stderr"))
            .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
        if let Some(log) = newest {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "node: the last lines of {}:\n{}",
                log.display(),
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
    }
    if let Err(e) = setting.cluster.kubectl_out(&[
        "delete",
        "namespace",
        &setting.ns,
        "--wait=true",
        "--timeout=90s",
    ]) {
        eprintln!("node: deleting {}: {e:#}", setting.ns);
    }
    out
}
