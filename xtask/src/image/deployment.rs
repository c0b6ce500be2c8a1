//! `lockstep serve` in the image exactly as `deploy/kubernetes/base/environment.yaml`
//! runs it: the Deployment's command, every argument and every environment
//! variable, against the Kubernetes API double (`lockstep-kube-double`,
//! holding the Deployment the environment owns its objects by) and a
//! throw-away PostgreSQL server (the Deployment's `LOCKSTEP_STORE`), the
//! state volume as the kubelet leaves it (fsGroup). It must start, answer
//! grpc.health.v1 SERVING and the API with the token (refusing a call
//! without), serve /metrics to the read-only metrics token of its mounted
//! Secret only (not the API token),
//! and exit 0 on SIGTERM.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;

use super::{
    check_then_stop, client, container_name, output, poll, random_token, running, Cleanup, Engine,
    Removal, IMAGE, IMAGE_UID,
};
use crate::util::{build_plain_bins, root, run, target_dir};

/// The environment pod's name here (the double holds it, controlled by a
/// ReplicaSet of the Deployment, as in a cluster).
const POD: &str = "lockstep-environment-5d8f7c9b4-x7k2q";

/// What the check needs of the Deployment.
struct Shipped {
    /// `metadata.name`.
    name: String,
    /// The container's `command` then `args`.
    command: Vec<String>,
    /// The container's `env`: each variable and where its value comes from.
    env: Vec<(String, Value)>,
    /// The container's image (which replica pods run).
    image: String,
    /// The container's Secret volumes: where each is mounted, and the
    /// Secret's name.
    secret_mounts: Vec<(String, String)>,
}

impl Shipped {
    fn read(file: &Path) -> anyhow::Result<Shipped> {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let mut deployment = None;
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let v = <Value as serde::Deserialize>::deserialize(doc)
                .with_context(|| format!("parsing {}", file.display()))?;
            if v["kind"] == "Deployment" {
                deployment = Some(v);
            }
        }
        let d = deployment.with_context(|| format!("no Deployment in {}", file.display()))?;
        let c = &d["spec"]["template"]["spec"]["containers"][0];
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        };
        let mut command = strings(&c["command"]);
        command.extend(strings(&c["args"]));
        anyhow::ensure!(
            !command.is_empty(),
            "the Deployment's container has no command"
        );
        let env = c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| (e["name"].as_str().unwrap_or("").to_string(), e.clone()))
            .collect();
        let volumes = &d["spec"]["template"]["spec"]["volumes"];
        let secret_mounts = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| {
                let volume = volumes
                    .as_array()?
                    .iter()
                    .find(|v| v["name"] == m["name"])?;
                Some((
                    m["mountPath"].as_str()?.to_string(),
                    volume["secret"]["secretName"].as_str()?.to_string(),
                ))
            })
            .collect();
        Ok(Shipped {
            name: d["metadata"]["name"].as_str().unwrap_or("").to_string(),
            command,
            env,
            secret_mounts,
            image: c["image"].as_str().unwrap_or("").to_string(),
        })
    }

    /// The value of `--NAME=VALUE` among the arguments.
    fn flag(&self, name: &str) -> anyhow::Result<&str> {
        let prefix = format!("--{name}=");
        self.command
            .iter()
            .find_map(|a| a.strip_prefix(&prefix))
            .with_context(|| format!("the Deployment passes no --{name}"))
    }

    fn port(&self, name: &str) -> anyhow::Result<u16> {
        let at = self.flag(name)?;
        at.rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .with_context(|| format!("--{name}={at} has no port"))
    }
}

/// Kills the double when the check ends.
struct Double(Child);

impl Drop for Double {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The check (see the module docs).
pub(super) fn run_check(engine: &Engine) -> anyhow::Result<()> {
    let shipped = Shipped::read(&root().join("deploy/kubernetes/base/environment.yaml"))?;
    // The namespace is the base kustomization's (set once there; the
    // Deployment reads its own from the downward API).
    let kustomization: serde_json::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(
        root().join("deploy/kubernetes/base/kustomization.yaml"),
    )?)?;
    let namespace = kustomization["namespace"]
        .as_str()
        .context("deploy/kubernetes/base/kustomization.yaml sets no namespace")?
        .to_string();
    let api_port = shipped.port("listen")?;
    let metrics_port = shipped.port("metrics-listen")?;
    for port in [api_port, metrics_port] {
        std::net::TcpListener::bind(("0.0.0.0", port)).with_context(|| {
            format!("port {port} (the Deployment's) is in use here; the check needs it free")
        })?;
    }

    // The Deployment's secrets, supplied here.
    let pg = lockstep_pgtest::PgServer::start()
        .map_err(|e| anyhow::anyhow!("cannot start PostgreSQL (install postgresql): {e}"))?;
    let token = random_token()?;
    let mut env = Vec::new();
    for (name, e) in &shipped.env {
        let value = match (name.as_str(), e.get("value")) {
            (_, Some(v)) => v.as_str().unwrap_or("").to_string(),
            ("LOCKSTEP_API_TOKEN", None) => token.clone(),
            ("LOCKSTEP_NAMESPACE", None) => namespace.clone(),
            ("LOCKSTEP_POD_NAME", None) => POD.to_string(),
            ("LOCKSTEP_STORE", None) => pg.url(),
            (other, None) => {
                bail!("the Deployment's variable {other} comes from somewhere this check cannot supply: {e}")
            }
        };
        env.push((name.clone(), value));
    }

    // The API double, holding the Deployment (the owner of every object).
    run(build_plain_bins(&["lockstep-kube-double"]))?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    let mut double = Command::new(target_dir().join("debug/lockstep-kube-double"));
    double
        .args(["--namespace", &namespace, "--kubeconfig"])
        .arg(&kubeconfig)
        .args(["--deployment", &shipped.name, "--image", &shipped.image])
        .args(["--pod", POD])
        .stdout(Stdio::piped());
    let mut child = double.spawn().context("starting lockstep-kube-double")?;
    let mut first = String::new();
    {
        let out = child.stdout.as_mut().expect("piped");
        let mut byte = [0u8; 1];
        while out.read(&mut byte)? == 1 && byte[0] != b'\n' {
            first.push(byte[0] as char);
        }
    }
    let _double = Double(child);
    anyhow::ensure!(
        first.starts_with("kube-double: serving on "),
        "lockstep-kube-double said {first:?}"
    );
    eprintln!("xtask: {first}");

    // The state volume as the kubelet leaves it with fsGroup: the volume's
    // root owned by root, group the image's, group-writable with setgid;
    // `lockstep serve` makes `state` in it (mode 0700) itself.
    let volume = dir.path().join("volume");
    std::fs::create_dir_all(&volume)?;
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(&volume, Some(0), Some(IMAGE_UID))
        .with_context(|| format!("chown {} (needs root)", volume.display()))?;
    std::fs::set_permissions(&volume, std::fs::Permissions::from_mode(0o2775))?;
    std::fs::set_permissions(&kubeconfig, std::fs::Permissions::from_mode(0o644))?;

    let name = container_name("deployment");
    let _rm = Cleanup {
        engine,
        what: Removal::Container(name.clone()),
    };
    // The Deployment's Secret volumes, as the kubelet mounts them: owned
    // by root, group the image's (fsGroup), mode 0440.
    let metrics_token = random_token()?;
    let mut secret_volumes = Vec::new();
    for (at, secret) in &shipped.secret_mounts {
        let content = match secret.as_str() {
            "lockstep-metrics-token" => [("token", &metrics_token)],
            other => {
                bail!("the Deployment mounts the Secret {other}, which this check cannot supply")
            }
        };
        let host = dir.path().join(format!("secret-{secret}"));
        std::fs::create_dir_all(&host)?;
        for (key, value) in content {
            let file = host.join(key);
            std::fs::write(&file, format!("{value}\n"))?;
            std::os::unix::fs::chown(&file, Some(0), Some(IMAGE_UID))?;
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o440))?;
        }
        std::fs::set_permissions(&host, std::fs::Permissions::from_mode(0o755))?;
        secret_volumes.push(format!("{}:{at}:ro", host.display()));
    }

    let mut cmd = engine.run_cmd();
    cmd.args(["--detach", "--name", &name])
        .arg("--volume")
        .arg(format!("{}:/var/lib/lockstep", volume.display()))
        .arg("--volume")
        .arg(format!(
            "{}:/etc/lockstep-kube/config:ro",
            kubeconfig.display()
        ))
        .args(["--env", "KUBECONFIG=/etc/lockstep-kube/config"]);
    for v in &secret_volumes {
        cmd.arg("--volume").arg(v);
    }
    // Values by name only: the token is on no command line.
    for (k, v) in &env {
        cmd.args(["--env", k]).env(k, v);
    }
    // `$(VAR)` in the arguments, as the kubelet expands it from the
    // container's variables.
    let expanded: Vec<String> = shipped.command[1..]
        .iter()
        .map(|a| {
            env.iter()
                .fold(a.clone(), |a, (k, v)| a.replace(&format!("$({k})"), v))
        })
        .collect();
    anyhow::ensure!(
        !expanded.iter().any(|a| a.contains("$(")),
        "an argument names a variable the Deployment does not set: {expanded:?}"
    );
    cmd.args(["--entrypoint", &shipped.command[0], IMAGE])
        .args(&expanded);
    run(cmd)?;
    // The Deployment's own shutdown grace is 20 s, under a 30 s termination
    // grace period.
    check_then_stop(engine, &name, 25, || {
        check(
            engine,
            &name,
            api_port,
            metrics_port,
            &token,
            &metrics_token,
        )
    })
}

fn check(
    engine: &Engine,
    name: &str,
    api_port: u16,
    metrics_port: u16,
    token: &str,
    metrics_token: &str,
) -> anyhow::Result<()> {
    let url = format!("http://127.0.0.1:{api_port}");
    let status = poll(engine, name, 60, "the API answering with the token", || {
        output(client(engine, name, &url, Some(token), &["status"]))
    })?;
    eprintln!("xtask: `lockstep status` with the token:\n{status}");
    if output(client(engine, name, &url, None, &["status"])).is_ok() {
        bail!("the API answered a call without the token");
    }
    health_serving(api_port)?;
    // The Deployment's probes: GET /healthz on the metrics port, no token.
    let probe = http_get_path(metrics_port, "/healthz", None)?;
    anyhow::ensure!(
        probe.starts_with("HTTP/1.1 200") || probe.starts_with("HTTP/1.0 200"),
        "the probes' GET /healthz: {}",
        probe.lines().next().unwrap_or("")
    );
    let bare = http_get(metrics_port, None)?;
    anyhow::ensure!(
        bare.starts_with("HTTP/1.1 401") || bare.starts_with("HTTP/1.0 401"),
        "/metrics off loopback answered without the token: {}",
        bare.lines().next().unwrap_or("")
    );
    // /metrics asks the read-only metrics token of its Secret (mounted as
    // the Deployment mounts it), not the API's.
    let with_api_token = http_get(metrics_port, Some(token))?;
    anyhow::ensure!(
        with_api_token.starts_with("HTTP/1.1 401") || with_api_token.starts_with("HTTP/1.0 401"),
        "/metrics answered the API token: {}",
        with_api_token.lines().next().unwrap_or("")
    );
    let metrics = http_get(metrics_port, Some(metrics_token))?;
    anyhow::ensure!(
        metrics.starts_with("HTTP/1.1 200") || metrics.starts_with("HTTP/1.0 200"),
        "/metrics with the metrics token: {}",
        metrics.lines().next().unwrap_or("")
    );
    anyhow::ensure!(
        metrics.contains("\nlockstep_environment_build_info{"),
        "/metrics names no build: {metrics}"
    );
    anyhow::ensure!(running(engine, name), "{name} stopped");
    Ok(())
}

/// grpc.health.v1 of the server (the Deployment's probes), through Python's
/// grpcio (which `cargo xtask test` needs for its API client test); where
/// it cannot be imported, the API answering stands for it, said so.
fn health_serving(port: u16) -> anyhow::Result<()> {
    let script = format!(
        "import grpc\nfrom grpc_health.v1 import health_pb2, health_pb2_grpc\n\
         ch = grpc.insecure_channel('127.0.0.1:{port}')\n\
         r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=''), timeout=10)\n\
         print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))\n"
    );
    // A python3 with grpcio (installed into a venv under target/ if the
    // system's lacks it): the health check is never left out.
    let python = crate::prereqs::python()?;
    let out = Command::new(python).args(["-c", &script]).output()?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    anyhow::ensure!(
        out.status.success() && said == "SERVING",
        "grpc.health.v1 Check: {said} {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    eprintln!("xtask: grpc.health.v1: SERVING");
    Ok(())
}

/// A plain HTTP/1.0 GET of /metrics on 127.0.0.1, with `token` as its
/// bearer; the whole answer.
fn http_get(port: u16, token: Option<&str>) -> anyhow::Result<String> {
    http_get_path(port, "/metrics", token)
}

/// `GET path` on the metrics port, HTTP/1.0: the whole answer.
fn http_get_path(port: u16, path: &str, token: Option<&str>) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to the metrics port {port}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n")?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    Ok(answer)
}
