//! TLS to the server, as a connection string asks for it with libpq's
//! parameters, read here (tokio-postgres knows neither `verify-full` nor
//! `sslrootcert`) and removed before the rest is parsed:
//!
//! | `sslmode` | what lockstep does |
//! | --- | --- |
//! | absent, `disable`, `allow`, `prefer` | plain TCP (no opportunistic TLS: ask for it) |
//! | `require` | TLS, the server's certificate not checked (as libpq: private from a passive listener only) |
//! | `verify-full` | TLS, the certificate checked against `sslrootcert` (a PEM file), else the system's roots, and the host name |
//! | `verify-ca` | refused: say `verify-full` (the host name is checked too) |
//!
//! The TLS itself is rustls (`tokio-postgres-rustls`), never our own.

use std::path::PathBuf;
use std::sync::Arc;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::PgError;

/// How a connection is encrypted (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain TCP, or a Unix socket.
    Plain,
    /// TLS without checking the server's certificate (`require`).
    Unverified,
    /// TLS, the certificate and the host name checked (`verify-full`)
    /// against this CA file, else the system's roots.
    Verified {
        /// `sslrootcert`.
        root_cert: Option<PathBuf>,
    },
}

impl TlsMode {
    /// The query string that asks for this mode (empty for
    /// [`TlsMode::Plain`]): nothing secret, so [`crate::redact`] keeps it,
    /// and a location passed on (a replica's command log) keeps its TLS.
    pub fn query(&self) -> String {
        match self {
            TlsMode::Plain => String::new(),
            TlsMode::Unverified => "?sslmode=require".into(),
            TlsMode::Verified { root_cert: None } => "?sslmode=verify-full".into(),
            TlsMode::Verified {
                root_cert: Some(path),
            } => format!(
                "?sslmode=verify-full&sslrootcert={}",
                percent_encoded(&path.to_string_lossy())
            ),
        }
    }
}

/// What a query value escapes: controls, whitespace and the characters
/// that end or split a value (`%`, `&`, `#`, `?`, `+`, `=`).
const QUERY_VALUE: &AsciiSet = &CONTROLS
    .add(b' ')
    .add(b'%')
    .add(b'&')
    .add(b'#')
    .add(b'?')
    .add(b'+')
    .add(b'=');

/// `value` escaped for a URL's query.
fn percent_encoded(value: &str) -> String {
    utf8_percent_encode(value, QUERY_VALUE).to_string()
}

/// The connection string without `sslmode` and `sslrootcert`, and the TLS
/// mode they ask for. A URL's query or key=value pairs are both read.
pub fn split_tls(url: &str) -> Result<(String, TlsMode), PgError> {
    let mut mode = None;
    let mut root_cert = None;
    let mut take = |key: &str, value: &str| -> bool {
        match key {
            "sslmode" => {
                mode = Some(value.to_string());
                true
            }
            "sslrootcert" => {
                root_cert = Some(PathBuf::from(value));
                true
            }
            _ => false,
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            Some((base, query)) => {
                let kept: Vec<&str> = query
                    .split('&')
                    .filter(|pair| {
                        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                        !take(k, &percent_decoded(v))
                    })
                    .collect();
                if kept.is_empty() {
                    base.to_string()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
            None => url.to_string(),
        }
    } else {
        url.split_whitespace()
            .filter(|pair| {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                !take(k.trim(), v.trim().trim_matches('\''))
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mode = match mode.as_deref() {
        None | Some("disable" | "allow" | "prefer") => TlsMode::Plain,
        Some("require") => TlsMode::Unverified,
        Some("verify-full") => TlsMode::Verified { root_cert },
        Some("verify-ca") => {
            return Err(PgError::Url(
                "sslmode=verify-ca is not supported: use sslmode=verify-full, which checks the host name too".into(),
            ))
        }
        Some(other) => {
            return Err(PgError::Url(format!(
                "sslmode={other}: expected disable, prefer, require or verify-full"
            )))
        }
    };
    Ok((rest, mode))
}

/// `%XX` escapes decoded (a path in a URL's query may carry them).
fn percent_decoded(value: &str) -> String {
    percent_decode_str(value).decode_utf8_lossy().into_owned()
}

/// The connector for `mode` (for [`TlsMode::Plain`] one that is never
/// used: the connection is told to disable TLS).
pub fn connector(mode: &TlsMode) -> Result<tokio_postgres_rustls::MakeRustlsConnect, PgError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgError::Url(format!("TLS: {e}")))?;
    let config = match mode {
        TlsMode::Plain => builder
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth(),
        TlsMode::Unverified => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
            .with_no_client_auth(),
        TlsMode::Verified { root_cert } => builder
            .with_root_certificates(roots(root_cert.as_ref())?)
            .with_no_client_auth(),
    };
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

/// The CA certificates of `file` (PEM), else the system's.
fn roots(file: Option<&PathBuf>) -> Result<RootCertStore, PgError> {
    let mut store = RootCertStore::empty();
    match file {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .map_err(|e| PgError::Url(format!("sslrootcert {}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(PgError::Url(format!(
                    "sslrootcert {}: no certificate in it",
                    path.display()
                )));
            }
            for c in certs {
                store
                    .add(c)
                    .map_err(|e| PgError::Url(format!("sslrootcert {}: {e}", path.display())))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(PgError::Url(
                    "sslmode=verify-full without sslrootcert needs the system's CA certificates, and none were found".into(),
                ));
            }
        }
    }
    Ok(store)
}

/// `require`: the handshake's signatures are checked (so the session is
/// one with the holder of the presented key), the certificate is not.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_parameters_are_read_and_removed_from_a_url() {
        let (rest, mode) =
            split_tls("postgres://u@h:5432/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x")
                .unwrap();
        assert_eq!(rest, "postgres://u@h:5432/db?application_name=x");
        assert_eq!(
            mode,
            TlsMode::Verified {
                root_cert: Some("/etc/ca.pem".into())
            }
        );
        let (rest, mode) = split_tls("postgresql://u@h/db?sslmode=require").unwrap();
        assert_eq!(
            (rest.as_str(), mode),
            ("postgresql://u@h/db", TlsMode::Unverified)
        );
        let (rest, mode) = split_tls("postgres://u@h/db").unwrap();
        assert_eq!((rest.as_str(), mode), ("postgres://u@h/db", TlsMode::Plain));
        let (_, mode) = split_tls("postgres://u@h/db?sslmode=prefer").unwrap();
        assert_eq!(mode, TlsMode::Plain);
    }

    #[test]
    fn a_mode_written_as_a_query_reads_back_as_itself() {
        for mode in [
            TlsMode::Plain,
            TlsMode::Unverified,
            TlsMode::Verified { root_cert: None },
            TlsMode::Verified {
                root_cert: Some("/odd dir/a&b#c%d.pem".into()),
            },
        ] {
            let url = format!("postgres://u@h:1/db{}", mode.query());
            assert_eq!(
                split_tls(&url).unwrap(),
                ("postgres://u@h:1/db".to_string(), mode)
            );
        }
    }

    #[test]
    fn the_tls_parameters_are_read_from_key_value_pairs() {
        let (rest, mode) =
            split_tls("host=h user=u sslmode=verify-full sslrootcert=/ca.pem dbname=d").unwrap();
        assert_eq!(rest, "host=h user=u dbname=d");
        assert_eq!(
            mode,
            TlsMode::Verified {
                root_cert: Some("/ca.pem".into())
            }
        );
    }

    #[test]
    fn an_unknown_or_unsupported_mode_is_refused_naming_it() {
        let e = split_tls("postgres://h/db?sslmode=verify-ca").unwrap_err();
        assert!(e.to_string().contains("verify-full"), "{e}");
        let e = split_tls("postgres://h/db?sslmode=sometimes").unwrap_err();
        assert!(e.to_string().contains("sslmode=sometimes"), "{e}");
    }

    #[test]
    fn a_root_cert_file_that_holds_no_certificate_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let e = connector(&TlsMode::Verified {
            root_cert: Some(path),
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("no certificate"), "{e}");
        let e = connector(&TlsMode::Verified {
            root_cert: Some(dir.path().join("absent.pem")),
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("absent.pem"), "{e}");
    }
}
