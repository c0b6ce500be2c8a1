//! One controller connection to one replica process: a writer task fed by a
//! channel and a reader task that forwards every response, or the reason the
//! connection ended, to the controller task, tagged with the process index
//! and the connection generation so that stale connections are ignored.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use lockstep_protocol::{Command, Endpoint, Response, SessionKey};
use lockstep_transport::secure::{SecureCodec, Session};
use lockstep_transport::ControllerCodec;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

/// What a connection reports to the controller task.
pub(crate) enum ConnEvent {
    Response(Response),
    Closed(String),
}

/// A message from connection `process` of generation `generation`.
pub(crate) struct FromConn {
    pub process: usize,
    pub generation: u64,
    pub event: ConnEvent,
}

/// The write side of a live connection.
pub(crate) struct Conn {
    pub writer: mpsc::UnboundedSender<Command>,
}

/// Connects to `addr`, retrying every 5 ms until `deadline`. A name is
/// looked up at every attempt (a restarted pod may have a new address); a
/// lookup that fails is retried like a refused connection.
pub(crate) async fn connect(
    addr: &Endpoint,
    deadline: tokio::time::Instant,
) -> Result<TcpStream, String> {
    loop {
        let attempt = TcpStream::connect((addr.host(), addr.port()));
        match tokio::time::timeout(Duration::from_millis(500), attempt).await {
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Ok(Err(e)) if tokio::time::Instant::now() >= deadline => {
                return Err(format!("cannot connect to {addr}: {e}"))
            }
            Err(_) if tokio::time::Instant::now() >= deadline => {
                return Err(format!("cannot connect to {addr}: connect timed out"))
            }
            // Refused (not listening yet, say): a replica starts in ~10 ms.
            _ => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// A connected socket, with its session keys if the replica has a key.
pub(crate) struct Connected {
    sock: TcpStream,
    session: Option<Session>,
}

impl Connected {
    /// A socket without session keys (plain frames).
    #[cfg(test)]
    pub(crate) fn plain(sock: TcpStream) -> Self {
        Connected {
            sock,
            session: None,
        }
    }
}

/// The longest a session handshake may take once connected.
const SESSION_HANDSHAKE_BOUND: Duration = Duration::from_secs(5);

/// Connects to process `process_index` at `addr` (see [`connect`]) and,
/// with a session key, sets up the session (`lockstep_transport::secure`):
/// a process that does not prove the key is an error, and it is sent
/// nothing more. `one_way` (the negative control `no-mutual` only) skips
/// that and speaks plain frames, as before mutual proof existed.
pub(crate) async fn connect_session(
    addr: &Endpoint,
    deadline: tokio::time::Instant,
    key: Option<&SessionKey>,
    one_way: bool,
    replica_id: u64,
    process_index: u32,
) -> Result<Connected, String> {
    let mut sock = connect(addr, deadline).await?;
    let session = match key {
        Some(key) if !one_way => {
            let bound = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .max(SESSION_HANDSHAKE_BOUND);
            let setup =
                lockstep_transport::secure::initiate(&mut sock, key, replica_id, process_index);
            match tokio::time::timeout(bound, setup).await {
                Ok(Ok(session)) => Some(session),
                Ok(Err(e)) => return Err(format!("process {process_index} at {addr}: {e}")),
                Err(_) => {
                    return Err(format!(
                        "process {process_index} at {addr}: no session set up within {bound:?}"
                    ))
                }
            }
        }
        _ => None,
    };
    Ok(Connected { sock, session })
}

/// Starts the reader and writer tasks of a connected socket.
pub(crate) fn spawn(
    connected: Connected,
    process: usize,
    generation: u64,
    max_frame_len: usize,
    to_actor: mpsc::UnboundedSender<FromConn>,
) -> Conn {
    let codec = SecureCodec::new(ControllerCodec::new(max_frame_len), connected.session);
    let (mut sink, mut stream) = Framed::new(connected.sock, codec).split();
    let (writer, mut commands) = mpsc::unbounded_channel::<Command>();
    let to_actor2 = to_actor.clone();
    tokio::spawn(async move {
        while let Some(cmd) = commands.recv().await {
            // Every command already queued goes out in the same flush: a
            // session's start is thousands of commands, and a flush each
            // was a write to the socket each. The codec's buffer flushes by
            // itself past its boundary, so a burst is not held whole.
            let mut sent = sink.feed(cmd).await;
            while sent.is_ok() {
                match commands.try_recv() {
                    Ok(next) => sent = sink.feed(next).await,
                    Err(_) => break,
                }
            }
            if let Err(e) = match sent {
                Ok(()) => sink.flush().await,
                Err(e) => Err(e),
            } {
                let _ = to_actor2.send(FromConn {
                    process,
                    generation,
                    event: ConnEvent::Closed(format!("write failed: {e}")),
                });
                return;
            }
        }
        let _ = sink.close().await;
    });
    tokio::spawn(async move {
        let reason = loop {
            match stream.next().await {
                None => break "connection closed by the process".to_string(),
                Some(Err(e)) => break format!("read failed: {e}"),
                Some(Ok(r)) => {
                    if to_actor
                        .send(FromConn {
                            process,
                            generation,
                            event: ConnEvent::Response(r),
                        })
                        .is_err()
                    {
                        return;
                    }
                }
            }
        };
        let _ = to_actor.send(FromConn {
            process,
            generation,
            event: ConnEvent::Closed(reason),
        });
    });
    Conn { writer }
}
