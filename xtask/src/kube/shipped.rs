//! The example overlay as a platform team applies it, on the real node
//! (`cargo xtask kube`, step 6): `deploy/kubernetes` copied unchanged, the
//! files the example overlay makes its Secrets from written into its
//! `secrets/` as its comments say, and `kubectl apply -k` of the copy. What
//! the cluster must provide is provided as a cluster would:
//!
//! - the image the overlay names (`registry.example.com/lockstep:0.3.0-dev`)
//!   in containerd (no registry: the tested image tagged with that name);
//! - a PersistentVolume for the state PVC (a hostPath one, owned by the
//!   image's user, reserved for the overlay's claim: the node has no
//!   storage class);
//! - a PostgreSQL server the pods reach (on the node's IP, trusting the pod
//!   subnet), named by the `lockstep-postgres` Secret; in a second run the
//!   Secret names `sqlite:` on the PVC instead;
//! - the API server at the `kubernetes` Service's ClusterIP (the node puts
//!   it on `lo`), for the environment's in-cluster config.
//!
//! Then `lockstep-chaos-node shipped` drives the environment from this host
//! (outside the cluster) at its pod's IP over the API's TLS (which the
//! overlay turns on; the probes stay on the plain metrics port), with the
//! token of the Secret:
//! a replica created and its answers checked, scraped as
//! `deploy/prometheus/scrape.yaml` says with the metrics token read back
//! from its Secret, the environment's pod deleted (the Deployment makes
//! another) and the replica adopted.

use std::path::Path;

use anyhow::Context;

use crate::kube_control_plane::ControlPlane;
use crate::kube_node::{RealNode, NODE_IP, POD_SUBNET};
use crate::util::{root, step};

/// The overlay's namespace.
pub const NAMESPACE: &str = "lockstep-example";
/// The image the overlay names.
const IMAGE: &str = "registry.example.com/lockstep:0.3.0-dev";

/// Applies the overlay twice, its catalog on PostgreSQL and then on SQLite
/// on its PVC (`sqlite:` in the same Secret), and runs the checks on each.
pub fn run(cp: &ControlPlane, node: &RealNode, dir: &Path) -> anyhow::Result<()> {
    node.tag_image(&node.image, IMAGE)?;
    let pg = lockstep_pgtest::PgServer::start_reachable(NODE_IP, POD_SUBNET)
        .map_err(|e| anyhow::anyhow!("a PostgreSQL server for the pods: {e}"))?;
    let postgres = format!(
        "postgres://postgres@{NODE_IP}:{}/{}",
        pg.port(),
        lockstep_pgtest::DATABASE
    );
    run_one(cp, dir, "postgres", &postgres)?;
    drop(pg);
    run_one(
        cp,
        dir,
        "sqlite",
        "sqlite:/var/lib/lockstep/state/catalog.db",
    )
}

/// One application of the overlay with `store` in the `lockstep-postgres`
/// Secret; removes the namespace and the volume after.
fn run_one(cp: &ControlPlane, dir: &Path, variant: &str, store: &str) -> anyhow::Result<()> {
    step(&format!(
        "the example overlay, applied as shipped, on the real node (in-cluster environment, catalog on {variant}, a bound PVC)"
    ));
    let pv_dir = dir.join("pv-state");
    let _ = std::fs::remove_dir_all(&pv_dir);
    std::fs::create_dir_all(&pv_dir)?;
    // The image's user owns the volume (hostPath ignores fsGroup).
    nix::unistd::chown(
        &pv_dir,
        Some(nix::unistd::Uid::from_raw(10001)),
        Some(nix::unistd::Gid::from_raw(10001)),
    )
    .context("chown of the volume's directory")?;
    apply_stdin(
        cp,
        &format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata:\n  name: lockstep-example-state\nspec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadWriteOnce]\n  persistentVolumeReclaimPolicy: Retain\n  storageClassName: \"\"\n  claimRef: {{namespace: {NAMESPACE}, name: lockstep-state}}\n  hostPath: {{path: {}, type: Directory}}\n",
            pv_dir.display()
        ),
    )?;
    let token = crate::image::random_token()?;
    let copy = dir.join("shipped");
    let overlay = example_with_secrets(&copy, &token, store)?;
    let result = (|| {
        super::kubectl(
            cp,
            &[
                "apply",
                "-k",
                &overlay.display().to_string(),
                "--server-side",
                "--field-manager=lockstep-xtask",
                "--validate=strict",
            ],
        )?;
        super::kubectl(
            cp,
            &[
                "wait",
                "--for=condition=Available",
                "deployment/lockstep-environment",
                "-n",
                NAMESPACE,
                "--timeout=180s",
            ],
        )?;
        std::env::set_var("LOCKSTEP_SHIPPED_NAMESPACE", NAMESPACE);
        std::env::set_var("LOCKSTEP_SHIPPED_TOKEN", &token);
        std::env::set_var("LOCKSTEP_SHIPPED_VARIANT", variant);
        std::env::set_var("LOCKSTEP_SHIPPED_DEPLOY", copy.join("deploy"));
        std::env::set_var("LOCKSTEP_SHIPPED_API_CA", api_ca(&overlay));
        crate::chaos::run_suite_binary(
            crate::util::target_dir().join("debug/lockstep-chaos-node"),
            &["shipped"],
            "kube-shipped",
            1,
        )
    })();
    if result.is_err() {
        let mut logs = cp.kubectl();
        logs.args([
            "logs",
            "-n",
            NAMESPACE,
            "deployment/lockstep-environment",
            "--tail=30",
        ]);
        if let Ok(text) = crate::util::stdout(logs) {
            eprintln!("xtask: the environment pod's log, last lines:\n{text}");
        }
    }
    // Its pods go before the node does; the volume after its claim.
    let _ = super::kubectl(
        cp,
        &[
            "delete",
            "namespace",
            NAMESPACE,
            "--wait=true",
            "--timeout=120s",
        ],
    );
    let _ = super::kubectl(cp, &["delete", "pv", "lockstep-example-state"]);
    let _ = std::fs::remove_dir_all(&pv_dir);
    let _ = std::fs::remove_dir_all(&copy);
    result
}

/// `deploy/` copied unchanged into `copy`, with the files the example
/// overlay makes its Secrets from written into its `secrets/` as its
/// comments say (a newline at the end included): the API token `token`, a
/// fresh metrics token, the store `store`, and the API's certificate and
/// key ([`api_ca`]). The overlay's directory.
pub fn example_with_secrets(
    copy: &Path,
    token: &str,
    store: &str,
) -> anyhow::Result<std::path::PathBuf> {
    let _ = std::fs::remove_dir_all(copy);
    crate::util::copy_tree(&root().join("deploy"), &copy.join("deploy"))?;
    let overlay = copy.join("deploy/kubernetes/overlays/example");
    let secrets = overlay.join("secrets");
    std::fs::create_dir_all(&secrets)?;
    std::fs::write(secrets.join("api.token"), format!("{token}\n"))?;
    std::fs::write(
        secrets.join("metrics.token"),
        format!("{}\n", crate::image::random_token()?),
    )?;
    std::fs::write(secrets.join("postgres.url"), store)?;
    // The API's certificate for the Service's name, self-signed (its own
    // CA), as the comments' openssl command makes it.
    let name = format!("lockstep-environment.{NAMESPACE}.svc");
    let key = rcgen::KeyPair::generate()?;
    let cert = rcgen::CertificateParams::new(vec![name])?.self_signed(&key)?;
    std::fs::write(secrets.join("tls.crt"), cert.pem())?;
    std::fs::write(secrets.join("tls.key"), key.serialize_pem())?;
    Ok(overlay)
}

/// The API's certificate [`example_with_secrets`] wrote for the overlay in
/// `overlay` (the CA to check the API against).
pub fn api_ca(overlay: &Path) -> std::path::PathBuf {
    overlay.join("secrets/tls.crt")
}

/// `kubectl apply -f -` of `yaml`.
fn apply_stdin(cp: &ControlPlane, yaml: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut cmd = cp.kubectl();
    cmd.args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null());
    let mut child = cmd.spawn().context("running kubectl apply")?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(yaml.as_bytes())?;
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "kubectl apply -f - failed ({status})");
    Ok(())
}
