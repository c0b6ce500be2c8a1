//! A connection over TLS to a real PostgreSQL server that refuses TCP
//! without it: `verify-full` against the server's CA and `require` connect
//! (and the server says the session is encrypted); no `sslmode`, or
//! `verify-full` against another CA, is refused.

use lockstep_pg::{Conn, Options, PgError, Session};
use lockstep_pgtest::PgServer;

/// A CA's certificate (PEM), and a server certificate and key it signed for
/// `localhost` and 127.0.0.1.
fn certificates() -> (String, String, String) {
    let c = lockstep_pgtest::Certificates::for_localhost();
    (c.ca_pem, c.cert_pem, c.key_pem)
}

/// Whether this connection's session is encrypted, as the server sees it.
fn encrypted(conn: &Conn) -> Result<bool, PgError> {
    conn.run(|s: &mut Session| {
        Box::pin(async move {
            let row = s
                .client
                .query_one(
                    "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                    &[],
                )
                .await?;
            Ok(row.get::<_, bool>(0))
        })
    })
}

#[test]
fn a_tls_server_is_reached_verified_or_required_and_refuses_the_rest() {
    if !PgServer::available() {
        panic!("PostgreSQL is needed (cargo xtask test installs it)");
    }
    let (ca, cert, key) = certificates();
    let pg = PgServer::start_tls(&cert, &key).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca).unwrap();
    let url = pg.url();

    let verified = format!(
        "{url}?sslmode=verify-full&sslrootcert={}",
        ca_file.display()
    );
    let conn = Conn::connect(&verified, Options::default()).unwrap();
    assert!(encrypted(&conn).unwrap(), "verify-full: not encrypted");

    let required = format!("{url}?sslmode=require");
    let conn = Conn::connect(&required, Options::default()).unwrap();
    assert!(encrypted(&conn).unwrap(), "require: not encrypted");

    // Without sslmode: plain TCP, which this server refuses.
    let e = Conn::connect(&url, Options::default()).unwrap_err();
    assert!(
        e.to_string().contains("no pg_hba.conf entry") || e.to_string().contains("rejects"),
        "{e}"
    );

    // Another CA: the certificate is not trusted, nothing is sent.
    let (other_ca, _, _) = certificates();
    let other = dir.path().join("other-ca.pem");
    std::fs::write(&other, other_ca).unwrap();
    let e = Conn::connect(
        &format!("{url}?sslmode=verify-full&sslrootcert={}", other.display()),
        Options::default(),
    )
    .unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");

    // The password-free location (messages, a replica's command line)
    // keeps the TLS mode, and connects as the original does.
    let redacted = lockstep_pg::redact(&verified);
    assert_eq!(
        redacted,
        format!(
            "postgres://postgres@127.0.0.1:{}/lockstep?sslmode=verify-full&sslrootcert={}",
            pg.port(),
            ca_file.display()
        )
    );
    let conn = Conn::connect(&redacted, Options::default()).unwrap();
    assert!(encrypted(&conn).unwrap());
}
