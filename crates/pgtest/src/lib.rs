//! Test support: a real, throw-away PostgreSQL server.
//!
//! [`PgServer::start`] runs `initdb --no-sync` into a fresh temporary
//! directory, starts the server with `pg_ctl -w` on a free TCP port of
//! 127.0.0.1 (its Unix socket inside the temporary directory, so servers of
//! parallel tests never meet), and creates the database `lockstep`.
//! Authentication is `trust`: the server accepts any local user without a
//! password, which is what a test wants and nothing else should.
//!
//! PostgreSQL refuses to run as root. When the test runs as root (as CI does),
//! the directory is handed to the `postgres` user and every PostgreSQL
//! command runs through `runuser -u postgres --`; the user must exist
//! (`.ci/run` creates it). Otherwise the commands run as the current user.
//!
//! The binaries are looked up on `PATH` (`initdb`, resolved through
//! symlinks to the directory holding `pg_ctl`, `createdb` and `psql`), then
//! in `/usr/lib/postgresql/<newest>/bin`; `LOCKSTEP_PG_BIN` overrides both.
//! [`PgServer::available`] tells whether they were found.
//!
//! Dropping a [`PgServer`] stops it (`pg_ctl stop -m immediate`) and removes
//! the directory.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// What went wrong starting or driving a test server.
#[derive(Debug)]
pub struct Error(String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// The result of this crate's operations.
pub type Result<T> = std::result::Result<T, Error>;

/// The database [`PgServer::start`] creates and [`PgServer::url`] names.
pub const DATABASE: &str = "lockstep";

/// A running throw-away PostgreSQL server.
#[derive(Debug)]
pub struct PgServer {
    bin: PathBuf,
    dir: Option<tempfile::TempDir>,
    port: u16,
    as_postgres: bool,
    running: bool,
    /// Another address it listens on, beside 127.0.0.1 ([`PgServer::start_reachable`]).
    also_on: Option<String>,
}

impl PgServer {
    /// Whether the PostgreSQL binaries were found (see the crate docs).
    pub fn available() -> bool {
        bin_dir().is_some()
    }

    /// The directory holding the binaries, if found.
    pub fn bin_dir() -> Option<PathBuf> {
        bin_dir()
    }

    /// Creates a cluster in a fresh temporary directory, starts it on a free
    /// port and creates the database [`DATABASE`].
    pub fn start() -> Result<PgServer> {
        Self::start_on(None, None)
    }

    /// [`PgServer::start`] with TLS: `cert_pem` and `key_pem` are the
    /// server's certificate and key, and a TCP connection without TLS is
    /// refused (`hostnossl ... reject`), so a client that forgets to ask for
    /// TLS fails rather than passes in the clear.
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Result<PgServer> {
        Self::start_on(None, Some((cert_pem.to_string(), key_pem.to_string())))
    }

    /// [`PgServer::start`], also listening on `address` and trusting clients
    /// from `clients` (a CIDR): for pods of a test cluster that reach this
    /// host at `address`. Test clusters only: no password is asked.
    pub fn start_reachable(address: &str, clients: &str) -> Result<PgServer> {
        Self::start_on(Some((address.to_string(), clients.to_string())), None)
    }

    fn start_on(
        reachable: Option<(String, String)>,
        tls: Option<(String, String)>,
    ) -> Result<PgServer> {
        let bin = bin_dir().ok_or_else(|| {
            Error(
                "no PostgreSQL binaries (initdb, pg_ctl) on PATH or in /usr/lib/postgresql/*/bin"
                    .into(),
            )
        })?;
        let as_postgres = running_as_root();
        let dir = tempfile::Builder::new()
            .prefix("lockstep-pg-")
            .tempdir()
            .map_err(|e| Error(format!("cannot create a temporary directory: {e}")))?;
        if as_postgres {
            let status = Command::new("chown")
                .arg("postgres:")
                .arg(dir.path())
                .status()
                .map_err(|e| Error(format!("chown: {e}")))?;
            if !status.success() {
                return Err(Error(format!(
                    "cannot hand {} to the postgres user (does it exist? `useradd --system postgres`)",
                    dir.path().display()
                )));
            }
        }
        let mut server = PgServer {
            bin,
            dir: Some(dir),
            port: 0,
            as_postgres,
            running: false,
            also_on: reachable.as_ref().map(|(a, _)| a.clone()),
        };
        let data = server.data_dir();
        server.run(
            "initdb",
            &[
                "--no-sync",
                "--no-instructions",
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--locale=C",
                "-D",
                path_str(&data)?,
            ],
        )?;
        if let Some((_, clients)) = &reachable {
            use std::io::Write;
            let hba = data.join("pg_hba.conf");
            std::fs::OpenOptions::new()
                .append(true)
                .open(&hba)
                .and_then(|mut f| writeln!(f, "host all all {clients} trust"))
                .map_err(|e| Error(format!("{}: {e}", hba.display())))?;
        }
        if let Some((cert, key)) = &tls {
            server.enable_tls(cert, key)?;
        }
        // A free port can be taken between probing and binding: retry.
        let mut last = None;
        for _ in 0..5 {
            server.port = free_port()?;
            match server.pg_ctl_start() {
                Ok(()) => {
                    last = None;
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = last {
            return Err(e);
        }
        server.create_database(DATABASE)?;
        Ok(server)
    }

    /// The TCP port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The connection string of the database [`DATABASE`].
    pub fn url(&self) -> String {
        self.url_of(DATABASE)
    }

    /// The connection string of database `name` on this server.
    pub fn url_of(&self, name: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }

    /// Creates the database `name` and returns its connection string: an
    /// isolated database on a shared server, cheaper than another server.
    pub fn new_database(&self, name: &str) -> Result<String> {
        self.create_database(name)?;
        Ok(self.url_of(name))
    }

    /// Runs `sql` in database `db` with `psql` (stopping at the first
    /// error) and returns what it printed, unaligned and without headers.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String> {
        let port = self.port.to_string();
        let out = self.run(
            "psql",
            &[
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                db,
                "-c",
                sql,
            ],
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// Stops the server (immediate mode: no checkpoint, like a crash of the
    /// server process, but nothing acknowledged is lost).
    pub fn stop(&mut self) -> Result<()> {
        if self.running {
            self.running = false;
            let data = self.data_dir();
            self.run(
                "pg_ctl",
                &["stop", "-w", "-m", "immediate", "-D", path_str(&data)?],
            )?;
        }
        Ok(())
    }

    /// Starts a stopped server again on the same data directory and port.
    pub fn start_again(&mut self) -> Result<()> {
        if !self.running {
            self.pg_ctl_start()?;
        }
        Ok(())
    }

    /// Stops the server in immediate mode and starts it again on the same
    /// data directory and port: every connection is cut, crash recovery
    /// runs, and acknowledged commits survive.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.start_again()
    }

    /// The server's log so far (for test failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.root().join("server.log")).unwrap_or_default()
    }

    /// Writes the server's certificate and key into the data directory,
    /// turns `ssl` on and refuses TCP connections without it.
    fn enable_tls(&self, cert: &str, key: &str) -> Result<()> {
        use std::io::Write;
        use std::os::unix::fs::PermissionsExt;
        let data = self.data_dir();
        let io = |what: &Path, e: std::io::Error| Error(format!("{}: {e}", what.display()));
        for (name, text) in [("server.crt", cert), ("server.key", key)] {
            let path = data.join(name);
            std::fs::write(&path, text).map_err(|e| io(&path, e))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| io(&path, e))?;
            if self.as_postgres {
                let status = Command::new("chown")
                    .arg("postgres:")
                    .arg(&path)
                    .status()
                    .map_err(|e| Error(format!("chown: {e}")))?;
                if !status.success() {
                    return Err(Error(format!("cannot hand {} to postgres", path.display())));
                }
            }
        }
        let conf = data.join("postgresql.conf");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&conf)
            .and_then(|mut f| {
                writeln!(
                    f,
                    "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'"
                )
            })
            .map_err(|e| io(&conf, e))?;
        // First match wins: these come before initdb's `host` lines.
        let hba = data.join("pg_hba.conf");
        let old = std::fs::read_to_string(&hba).map_err(|e| io(&hba, e))?;
        std::fs::write(
            &hba,
            format!("hostnossl all all 0.0.0.0/0 reject\nhostnossl all all ::/0 reject\n{old}"),
        )
        .map_err(|e| io(&hba, e))
    }

    fn root(&self) -> &Path {
        self.dir.as_ref().expect("present until drop").path()
    }

    fn data_dir(&self) -> PathBuf {
        self.root().join("data")
    }

    fn pg_ctl_start(&mut self) -> Result<()> {
        let data = self.data_dir();
        let log = self.root().join("server.log");
        let listen = match &self.also_on {
            Some(a) => format!("127.0.0.1,{a}"),
            None => "127.0.0.1".to_string(),
        };
        let options = format!(
            "-p {} -k {} -c listen_addresses={listen} -c shared_buffers=16MB -c max_connections=60",
            self.port,
            path_str(self.root())?
        );
        self.run(
            "pg_ctl",
            &[
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                path_str(&data)?,
                "-l",
                path_str(&log)?,
                "-o",
                &options,
            ],
        )
        .map_err(|e| Error(format!("{e}\nserver log:\n{}", self.log())))?;
        self.running = true;
        Ok(())
    }

    fn create_database(&self, name: &str) -> Result<()> {
        let port = self.port.to_string();
        let started = Instant::now();
        // Right after start the server may still refuse connections briefly.
        loop {
            match self.run(
                "createdb",
                &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", name],
            ) {
                Ok(_) => return Ok(()),
                Err(e) if started.elapsed() > Duration::from_secs(10) => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Runs a PostgreSQL binary, as the postgres user when we are root.
    fn run(&self, program: &str, args: &[&str]) -> Result<Output> {
        let exe = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        cmd.args(args);
        if let Some(dir) = &self.dir {
            cmd.current_dir(dir.path());
        }
        let out = cmd
            .output()
            .map_err(|e| Error(format!("cannot run {}: {e}", exe.display())))?;
        if !out.status.success() {
            return Err(Error(format!(
                "{program} {args:?} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(out)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = self.stop();
        // The directory belongs to postgres; root removes it all the same.
        if let Some(dir) = self.dir.take() {
            let _ = dir.close();
        }
    }
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .ok_or_else(|| Error(format!("{} is not UTF-8", p.display())))
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| Error(format!("no free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| Error(format!("no free port: {e}")))
}

/// Whether this process runs as root (Linux: `/proc/self` belongs to the
/// effective user).
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

fn bin_dir() -> Option<PathBuf> {
    let complete = |d: &Path| d.join("initdb").is_file() && d.join("pg_ctl").is_file();
    if let Some(d) = std::env::var_os("LOCKSTEP_PG_BIN") {
        let d = PathBuf::from(d);
        return complete(&d).then_some(d);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let initdb = d.join("initdb");
            if initdb.is_file() {
                // /usr/local/bin/initdb may be a link into the directory that
                // also holds createdb and psql.
                let real = std::fs::canonicalize(&initdb).ok()?;
                let real_dir = real.parent()?.to_path_buf();
                if complete(&real_dir) && real_dir.join("createdb").is_file() {
                    return Some(real_dir);
                }
                if complete(&d) && d.join("createdb").is_file() {
                    return Some(d);
                }
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            complete(&bin).then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, d)| d)
}

/// Waits until `done()` holds, checking every 10 ms, for at most `bound`;
/// returns whether it held. For a test that must wait for something another
/// thread does (writes acknowledged, a write cut by a restart) rather than
/// sleep for a while and hope.
pub fn wait_until(bound: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + bound;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Declares one test per backend for each named test function: for
/// `on_both_backends!(Fixture; name, ...)`, a module `both::name` with the
/// tests `sqlite` and `postgres`, which call `name(&Fixture::sqlite())` and
/// `name(&Fixture::postgres())`. `Fixture` is the calling test module's own
/// type (a SQLite file or a [`PgServer`] database behind one interface).
#[macro_export]
macro_rules! on_both_backends {
    ($fixture:ident; $($name:ident),* $(,)?) => {
        mod both {
            $(
                mod $name {
                    #[test]
                    fn sqlite() {
                        super::super::$name(&super::super::$fixture::sqlite());
                    }
                    #[test]
                    fn postgres() {
                        super::super::$name(&super::super::$fixture::postgres());
                    }
                }
            )*
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_starts_restarts_and_goes_away() {
        assert!(
            PgServer::available(),
            "no PostgreSQL binaries: install the postgresql package"
        );
        let t = Instant::now();
        let mut pg = PgServer::start().unwrap();
        eprintln!("started in {:?}", t.elapsed());
        assert!(pg.url().starts_with("postgres://postgres@127.0.0.1:"));
        pg.psql(
            DATABASE,
            "CREATE TABLE t (x int); INSERT INTO t VALUES (7);",
        )
        .unwrap();
        let t = Instant::now();
        pg.restart().unwrap();
        eprintln!("restarted in {:?}", t.elapsed());
        assert_eq!(pg.psql(DATABASE, "SELECT x FROM t").unwrap(), "7");
        let url = pg.new_database("other").unwrap();
        assert!(url.ends_with("/other"));
        assert_eq!(pg.psql("other", "SELECT 1").unwrap(), "1");
        let root = pg.root().to_path_buf();
        drop(pg);
        assert!(!root.exists(), "the directory is removed");
    }
}

/// A throw-away certificate authority and a server certificate it signed,
/// for `localhost` and 127.0.0.1 (rcgen, PEM): what [`PgServer::start_tls`]
/// and any other test server speaking TLS are given.
#[derive(Debug, Clone)]
pub struct Certificates {
    /// The CA's certificate (what a client trusts).
    pub ca_pem: String,
    /// The server's certificate.
    pub cert_pem: String,
    /// The server's private key.
    pub key_pem: String,
}

impl Certificates {
    /// A fresh CA and a server certificate for `localhost` and 127.0.0.1.
    pub fn for_localhost() -> Certificates {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
        let ca_key = KeyPair::generate().expect("a CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "lockstep test CA");
        let ca_cert = ca.self_signed(&ca_key).expect("a self-signed CA");
        let key = KeyPair::generate().expect("a server key");
        let mut server = CertificateParams::new(Vec::<String>::new()).expect("server parameters");
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.subject_alt_names = vec![
            SanType::DnsName("localhost".try_into().expect("a DNS name")),
            SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
        ];
        let cert = server
            .signed_by(&key, &ca_cert, &ca_key)
            .expect("a certificate the CA signed");
        Certificates {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}
