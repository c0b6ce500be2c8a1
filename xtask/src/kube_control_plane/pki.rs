//! The control plane's certificates and the admin kubeconfig (the openssl
//! CLI).

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::Context;

/// The admin kubeconfig, naming the certificate files in `pki`.
pub(super) fn kubeconfig_yaml(server: &str, pki: &Path) -> String {
    client_kubeconfig_yaml(server, pki, "admin")
}

/// A kubeconfig with the client certificate `pki/USER.crt` (`admin`, or
/// `kubelet` for the real node).
pub(crate) fn client_kubeconfig_yaml(server: &str, pki: &Path, user: &str) -> String {
    let p = |s: &str| pki.join(s).display().to_string();
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: lockstep
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: admin
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: lockstep
  context:
    cluster: lockstep
    user: admin
current-context: lockstep
",
        ca = p("ca.crt"),
        cert = p(&format!("{user}.crt")),
        key = p(&format!("{user}.key")),
    )
}

/// Makes (with the openssl CLI) a CA, the API server's serving certificate,
/// the admin's client certificate (group system:masters), the real node's
/// kubelet's (group system:nodes) and the service
/// accounts' signing key pair, all P-256.
pub(super) fn make_pki(pki: &Path) -> anyhow::Result<()> {
    let openssl = |args: &[&str]| -> anyhow::Result<()> {
        let mut cmd = Command::new("openssl");
        cmd.args(args).current_dir(pki).stdin(Stdio::null());
        crate::util::stdout(cmd)
            .context("the openssl CLI (is it installed?)")
            .map(drop)
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-noenc",
    ];
    let mut ca = vec![
        "req", "-x509", "-days", "3650", "-keyout", "ca.key", "-out", "ca.crt",
    ];
    ca.extend(ec);
    ca.extend([
        "-subj",
        "/CN=lockstep-kube-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    ]);
    openssl(&ca)?;
    let leaves = [
        (
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,\
             DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n\
             extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n",
        ),
        (
            "admin",
            "/O=system:masters/CN=lockstep-admin",
            "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
        ),
        // The real node's kubelet: the Node authorizer and NodeRestriction
        // let it register its node, hold its lease and write its pods' status.
        (
            "kubelet",
            "/O=system:nodes/CN=system:node:lockstep-node-0",
            "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n",
        ),
    ];
    for (name, subject, ext) in leaves {
        let (key, csr, crt, extfile) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        fs::write(pki.join(&extfile), ext)?;
        let mut req = vec![
            "req", "-new", "-keyout", &key, "-out", &csr, "-subj", subject,
        ];
        req.extend(ec);
        openssl(&req)?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-out",
            &crt,
            "-extfile",
            &extfile,
        ])?;
    }
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "sa.key",
    ])?;
    openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}
