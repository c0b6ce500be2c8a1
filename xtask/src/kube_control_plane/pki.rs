//! The control plane's certificates and the admin kubeconfig (rcgen).

use std::fs;
use std::path::Path;

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

/// Makes (with rcgen) a CA, the API server's serving certificate, the
/// admin's client certificate (group system:masters), the real node's
/// kubelet's (group system:nodes) and the service accounts' signing key
/// pair, all P-256, as PEM files in `pki` (keys mode 0600).
pub(super) fn make_pki(pki: &Path) -> anyhow::Result<()> {
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose, SanType,
    };
    let write = |name: &str, text: &str, secret: bool| -> anyhow::Result<()> {
        let path = pki.join(name);
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        if secret {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
        }
        Ok(())
    };
    let name = |o: Option<&str>, cn: &str| {
        let mut dn = DistinguishedName::new();
        if let Some(o) = o {
            dn.push(DnType::OrganizationName, o);
        }
        dn.push(DnType::CommonName, cn);
        dn
    };
    let ca_key = KeyPair::generate().context("a CA key")?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name = name(None, "lockstep-kube-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key)?;
    write("ca.crt", &ca_cert.pem(), false)?;
    write("ca.key", &ca_key.serialize_pem(), true)?;
    let dns = |d: &str| -> anyhow::Result<SanType> { Ok(SanType::DnsName(d.try_into()?)) };
    let apiserver_names = vec![
        SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
        SanType::IpAddress(std::net::Ipv4Addr::new(10, 96, 0, 1).into()),
        dns("localhost")?,
        dns("kubernetes")?,
        dns("kubernetes.default")?,
        dns("kubernetes.default.svc")?,
        dns("kubernetes.default.svc.cluster.local")?,
    ];
    let leaves = [
        (
            "apiserver",
            name(None, "kube-apiserver"),
            apiserver_names,
            ExtendedKeyUsagePurpose::ServerAuth,
        ),
        (
            "admin",
            name(Some("system:masters"), "lockstep-admin"),
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        ),
        // The real node's kubelet: the Node authorizer and NodeRestriction
        // let it register its node, hold its lease and write its pods' status.
        (
            "kubelet",
            name(Some("system:nodes"), "system:node:lockstep-node-0"),
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        ),
    ];
    for (file, subject, sans, usage) in leaves {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = subject;
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![usage];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
        write(&format!("{file}.crt"), &cert.pem(), false)?;
        write(&format!("{file}.key"), &key.serialize_pem(), true)?;
    }
    let sa = KeyPair::generate()?;
    write("sa.key", &sa.serialize_pem(), true)?;
    write("sa.pub", &sa.public_key_pem(), false)?;
    Ok(())
}
