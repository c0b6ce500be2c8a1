//! lockstep's synchronous PostgreSQL connection.
//!
//! The catalog and the command log have synchronous APIs, called both from
//! plain threads (timely workers) and from inside a tokio runtime (the
//! environment calls its catalog under a `std::sync::Mutex` from async
//! tasks). Blocking on a future there would panic or stall the runtime, so a
//! [`Conn`] owns a dedicated thread with its own current-thread tokio runtime
//! and one `tokio-postgres` client; the synchronous [`Conn::run`] sends it a
//! job and waits for the answer. That is safe inside and outside a runtime
//! (it blocks the calling thread, as a SQLite call does).
//!
//! - **Reconnection.** A job that finds the connection closed (the server
//!   restarted, the backend was terminated) reconnects first; the job that
//!   was in flight when the connection broke fails with an error, never
//!   hangs. Every job runs under a time bound ([`Options::op_timeout`]);
//!   one that exceeds it fails and its connection is dropped (the server
//!   rolls back whatever it had open). [`Session::generation`] counts
//!   connections, so a transaction spanning several jobs can tell that its
//!   connection was replaced in between.
//! - **LISTEN/NOTIFY.** With [`Options::listen`], the connection `LISTEN`s
//!   on those channels (again after every reconnect) and
//!   [`Conn::wait_notification`] returns as soon as a notification arrives.
//!   A lost connection also wakes the waiter, since notifications sent while
//!   it was down are gone: NOTIFY has no replay, so it is only a wake-up and
//!   the tables stay the source of truth.
//! - **Secrets.** A connection string without a password takes the one in
//!   the environment variable `PGPASSWORD`, so a password need never be on a
//!   command line. [`redact`] gives the connection string without it, for
//!   messages.
//!
//! - **TLS.** `sslmode=require` or `sslmode=verify-full` (with
//!   `sslrootcert=CA.pem`, else the system's roots) in the connection
//!   string encrypt the connection with rustls ([`tls`]); without them it is
//!   plain TCP or a Unix socket.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::types::Type;
use tokio_postgres::{AsyncMessage, Client, Config, Statement};

pub use tokio_postgres;

pub mod tls;
pub use tls::TlsMode;

/// A boxed future borrowing the session for `'c`.
pub type BoxFuture<'c, T> = Pin<Box<dyn Future<Output = T> + Send + 'c>>;

/// Why talking to the server failed.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// The connection string does not parse.
    #[error("invalid PostgreSQL connection string: {0}")]
    Url(String),
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to {location}: {}", describe(source))]
    Connect {
        /// The server, without the password.
        location: String,
        /// What tokio-postgres said.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A statement failed, or the connection broke while it ran.
    #[error("{0}")]
    Db(#[from] tokio_postgres::Error),
    /// The operation did not finish within its bound; its connection was
    /// dropped, so whatever it had open was rolled back.
    #[error("no answer from {location} within {timeout:?}; the connection was dropped")]
    Timeout {
        /// The server, without the password.
        location: String,
        /// The bound.
        timeout: Duration,
    },
    /// A transaction spanning several operations lost its connection
    /// between them; nothing of it was committed.
    #[error(
        "the connection to {0} was replaced in the middle of a transaction; nothing was committed"
    )]
    Reconnected(String),
    /// The connection thread could not be started.
    #[error("cannot start the PostgreSQL connection thread: {0}")]
    Thread(String),
    /// The connection thread is gone (it panicked).
    #[error("the PostgreSQL connection thread of {0} is gone")]
    Gone(String),
}

/// What tokio-postgres said, whole: a server's error with its message (its
/// `Display` says only "db error"), any other with its causes (a TLS
/// handshake's says why the certificate was refused).
fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return format!("{}: {}", db.severity(), db.message());
    }
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

impl PgError {
    /// The SQLSTATE of a server error, if this is one.
    pub fn code(&self) -> Option<&tokio_postgres::error::SqlState> {
        match self {
            PgError::Db(e) | PgError::Connect { source: e, .. } => e.code(),
            _ => None,
        }
    }
}

/// How a [`Conn`] behaves.
#[derive(Clone, Debug)]
pub struct Options {
    /// The bound on one job (connecting included).
    pub op_timeout: Duration,
    /// The bound on establishing a connection.
    pub connect_timeout: Duration,
    /// Channels to `LISTEN` on (identifiers; quoted when sent).
    pub listen: Vec<String>,
    /// Reported to the server as `application_name`.
    pub application_name: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            op_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            listen: Vec::new(),
            application_name: "lockstep".into(),
        }
    }
}

/// What a job gets: the client of the current connection.
pub struct Session {
    /// The client.
    pub client: Client,
    /// Which connection this is: 1 for the first, one more for every
    /// reconnect.
    pub generation: u64,
    /// Statements prepared on this connection, by their text (a reconnect
    /// starts a new session, so they are prepared again).
    statements: std::collections::HashMap<&'static str, Statement>,
}

impl Session {
    /// `sql` prepared with parameter `types` on this connection: a round
    /// trip the first time, none after. A statement run on every operation
    /// is parsed and planned once this way (PostgreSQL keeps the plan once
    /// it sees that a generic one serves) instead of on every call.
    pub async fn prepare_cached(
        &mut self,
        sql: &'static str,
        types: &[Type],
    ) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare_typed(sql, types).await?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }
}

/// Runs `lock` and then `statement` in one transaction and one round trip:
/// BEGIN, the two, and COMMIT are pipelined (sent together, run in order
/// by the server). Pass the futures of tokio-postgres queries on `client`,
/// not yet polled: they send on their first poll, which is in this order.
/// `statement` runs as a statement of its own after `lock`, so under read
/// committed its snapshot sees everything committed before the lock was
/// granted. If either fails, the transaction is aborted and the COMMIT
/// rolls it back; the first error is returned.
pub async fn pipelined_transaction<A, B>(
    client: &Client,
    lock: impl Future<Output = Result<A, tokio_postgres::Error>>,
    statement: impl Future<Output = Result<B, tokio_postgres::Error>>,
) -> Result<(A, B), tokio_postgres::Error> {
    let (begin, lock, statement, commit) = futures::join!(
        client.batch_execute("BEGIN"),
        lock,
        statement,
        client.batch_execute("COMMIT")
    );
    begin?;
    let lock = lock?;
    let statement = statement?;
    commit?;
    Ok((lock, statement))
}

type Job = Box<dyn for<'c> FnOnce(&'c mut Session) -> BoxFuture<'c, ()> + Send>;
type Failed = Box<dyn FnOnce(PgError) + Send>;

/// A synchronous handle on one PostgreSQL connection, served by a dedicated
/// thread (see the crate docs). `Send`, not `Sync`.
pub struct Conn {
    jobs: Option<mpsc::UnboundedSender<(Job, Failed)>>,
    notifications: std_mpsc::Receiver<Wake>,
    thread: Option<std::thread::JoinHandle<()>>,
    location: String,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("location", &self.location)
            .finish()
    }
}

/// Why a waiter was woken.
#[derive(Debug)]
enum Wake {
    /// A notification, with its payload.
    Notified,
    /// The connection was lost: notifications may have been missed.
    Lost,
}

impl Conn {
    /// Connects to `url` (a `postgres://` or `postgresql://` connection
    /// string, or key=value pairs). Fails if the first connection fails.
    pub fn connect(url: &str, options: Options) -> Result<Conn, PgError> {
        let (url, tls_mode) = tls::split_tls(url)?;
        let mut config = Config::from_str(&url).map_err(|e| PgError::Url(e.to_string()))?;
        config.ssl_mode(match tls_mode {
            TlsMode::Plain => tokio_postgres::config::SslMode::Disable,
            TlsMode::Unverified | TlsMode::Verified { .. } => {
                tokio_postgres::config::SslMode::Require
            }
        });
        let tls = tls::connector(&tls_mode)?;
        if config.get_password().is_none() {
            if let Some(p) = std::env::var_os("PGPASSWORD") {
                config.password(p.into_encoded_bytes());
            }
        }
        config.connect_timeout(options.connect_timeout);
        config.application_name(options.application_name.clone());
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(30));
        let location = location_of(&config);
        let (jobs, mut rx) = mpsc::unbounded_channel::<(Job, Failed)>();
        let (wake_tx, notifications) = std_mpsc::channel();
        let (ready_tx, ready_rx) = std_mpsc::sync_channel::<Result<(), PgError>>(1);
        let loc = location.clone();
        let thread = std::thread::Builder::new()
            .name("lockstep-pg".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(PgError::Thread(format!("no runtime: {e}"))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let mut worker = Worker {
                        config,
                        tls,
                        options,
                        location: loc,
                        wake: wake_tx,
                        session: None,
                        generation: 0,
                    };
                    let first = worker.ensure().await;
                    let ok = first.is_ok();
                    let _ = ready_tx.send(first);
                    if !ok {
                        return;
                    }
                    while let Some((job, failed)) = rx.recv().await {
                        worker.serve(job, failed).await;
                    }
                });
            })
            .map_err(|e| PgError::Thread(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(PgError::Gone(location));
            }
        }
        Ok(Conn {
            jobs: Some(jobs),
            notifications,
            thread: Some(thread),
            location,
        })
    }

    /// The server and database, without the password.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Runs `job` on the connection thread (reconnecting first if the
    /// connection was lost) and waits for its result.
    pub fn run<T, E, F>(&self, job: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<PgError> + Send + 'static,
        F: for<'c> FnOnce(&'c mut Session) -> BoxFuture<'c, Result<T, E>> + Send + 'static,
    {
        let (tx, rx) = std_mpsc::sync_channel::<Result<T, E>>(1);
        let tx2 = tx.clone();
        let wrapped: Job = Box::new(move |session: &mut Session| {
            Box::pin(async move {
                let out = job(session).await;
                let _ = tx.send(out);
            })
        });
        let failed: Failed = Box::new(move |e: PgError| {
            let _ = tx2.send(Err(E::from(e)));
        });
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send((wrapped, failed)).is_ok());
        if !sent {
            return Err(E::from(PgError::Gone(self.location.clone())));
        }
        rx.recv()
            .unwrap_or_else(|_| Err(E::from(PgError::Gone(self.location.clone()))))
    }

    /// Waits up to `timeout` for a notification on a channel of
    /// [`Options::listen`] (or for the connection to be lost, which may have
    /// lost notifications). Returns whether it was woken before the timeout;
    /// every notification that arrived since the last call counts, so none
    /// is missed between a read and the next wait.
    pub fn wait_notification(&self, timeout: Duration) -> bool {
        let woken = match self.notifications.recv_timeout(timeout) {
            Ok(_) => true,
            Err(std_mpsc::RecvTimeoutError::Timeout) => false,
            // The thread is gone: the caller's next operation reports it.
            Err(std_mpsc::RecvTimeoutError::Disconnected) => true,
        };
        // One wake-up covers every notification that is waiting.
        while self.notifications.try_recv().is_ok() {}
        woken
    }

    /// Whether a notification (or a lost connection) arrived since the last
    /// call, without waiting. Drains them.
    pub fn notified(&self) -> bool {
        let mut any = false;
        while self.notifications.try_recv().is_ok() {
            any = true;
        }
        any
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The connection thread's state.
struct Worker {
    config: Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    options: Options,
    location: String,
    wake: std_mpsc::Sender<Wake>,
    session: Option<Session>,
    generation: u64,
}

impl Worker {
    /// Makes sure there is an open connection, reconnecting if needed.
    async fn ensure(&mut self) -> Result<(), PgError> {
        if self.session.as_ref().is_some_and(|s| !s.client.is_closed()) {
            return Ok(());
        }
        self.session = None;
        let connect = self.config.connect(self.tls.clone());
        let (client, mut connection) =
            match tokio::time::timeout(self.options.op_timeout, connect).await {
                Ok(Ok(c)) => c,
                Ok(Err(source)) => {
                    return Err(PgError::Connect {
                        location: self.location.clone(),
                        source,
                    })
                }
                Err(_) => {
                    return Err(PgError::Timeout {
                        location: self.location.clone(),
                        timeout: self.options.op_timeout,
                    })
                }
            };
        let wake = self.wake.clone();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(_)) => {
                        let _ = wake.send(Wake::Notified);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            // Notifications sent from now on are lost: wake the waiter so it
            // reads the table (and so reconnects).
            let _ = wake.send(Wake::Lost);
        });
        for channel in &self.options.listen {
            let listen = format!("LISTEN {}", quote_ident(channel));
            client.batch_execute(&listen).await?;
        }
        self.generation += 1;
        self.session = Some(Session {
            client,
            generation: self.generation,
            statements: Default::default(),
        });
        Ok(())
    }

    async fn serve(&mut self, job: Job, failed: Failed) {
        let bound = self.options.op_timeout;
        if let Err(e) = self.ensure().await {
            failed(e);
            return;
        }
        let session = self.session.as_mut().expect("ensured");
        let timed_out = tokio::time::timeout(bound, job(session)).await.is_err();
        if timed_out {
            // The job's future was dropped mid-statement: the connection is
            // in an unknown state. Drop it; the server rolls back.
            self.session = None;
            failed(PgError::Timeout {
                location: self.location.clone(),
                timeout: bound,
            });
        }
    }
}

/// `"ident"`, with embedded quotes doubled.
pub fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// The password in a connection string, if it has one (to hand a child
/// process in `PGPASSWORD` rather than on its command line).
pub fn password(url: &str) -> Option<String> {
    let (url, _) = tls::split_tls(url).ok()?;
    let config = Config::from_str(&url).ok()?;
    let pw = config.get_password()?;
    Some(String::from_utf8_lossy(pw).into_owned())
}

/// The connection string without its password (for messages, logs and a
/// replica's command line), with its TLS mode ([`TlsMode::query`]), or a
/// placeholder if it does not parse.
pub fn redact(url: &str) -> String {
    let unparsable = || "<unparsable PostgreSQL connection string>".to_string();
    let Ok((rest, tls)) = tls::split_tls(url) else {
        return unparsable();
    };
    match Config::from_str(&rest) {
        Ok(c) => location_of(&c) + &tls.query(),
        Err(_) => unparsable(),
    }
}

fn location_of(config: &Config) -> String {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "postgres://{}@{host}:{port}/{}",
        config.get_user().unwrap_or(""),
        config.get_dbname().unwrap_or("")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_pgtest::PgServer;
    use std::time::Instant;

    fn select_one(conn: &Conn) -> Result<i32, PgError> {
        conn.run(|s: &mut Session| {
            Box::pin(async move {
                let row = s.client.query_one("SELECT 1", &[]).await?;
                Ok(row.get::<_, i32>(0))
            })
        })
    }

    #[test]
    fn runs_inside_a_runtime_reconnects_and_wakes_on_notify() {
        let mut pg = PgServer::start().unwrap();
        let options = Options {
            listen: vec!["wake me".into()],
            ..Options::default()
        };
        let conn = Conn::connect(&pg.url(), options).unwrap();
        assert!(!conn.location().contains("password"));
        // Called from inside a tokio runtime: no nested block_on.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(async { select_one(&conn) }).unwrap(), 1);

        let other = Conn::connect(&pg.url(), Options::default()).unwrap();
        let started = Instant::now();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            other
                .run(|s: &mut Session| {
                    Box::pin(async move {
                        s.client
                            .batch_execute("NOTIFY \"wake me\", 'x'")
                            .await
                            .map_err(PgError::from)
                    })
                })
                .unwrap();
        });
        assert!(conn.wait_notification(Duration::from_secs(30)));
        assert!(started.elapsed() < Duration::from_secs(10));
        t.join().unwrap();

        pg.restart().unwrap();
        // The broken connection wakes the waiter; the next job reconnects.
        assert!(conn.wait_notification(Duration::from_secs(10)));
        let mut answer = select_one(&conn);
        if answer.is_err() {
            answer = select_one(&conn);
        }
        assert_eq!(answer.unwrap(), 1);
        pg.stop().unwrap();
        let err = select_one(&conn).unwrap_err();
        assert!(err.to_string().contains("127.0.0.1"), "{err}");
    }

    #[test]
    fn redaction_drops_the_password() {
        let r = redact("postgres://u:secret@db.example:6543/cat");
        assert_eq!(r, "postgres://u@db.example:6543/cat");
        assert!(Conn::connect("postgres://[", Options::default()).is_err());
    }
}
