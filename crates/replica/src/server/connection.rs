//! One controller connection: the handshake (Hello checked, the
//! connection made current, the HelloResponse at version 3 or more), then
//! commands in sequence to every local worker and responses back.

use super::*;

/// What a process sends instead of a response of `len` bytes, over the frame
/// limit `max`: the peek's error answer, or an error.
pub(super) fn too_large(
    process_index: u32,
    peek_id: Option<u64>,
    len: usize,
    max: usize,
) -> Response {
    tracing::warn!(
        len,
        max,
        ?peek_id,
        "a response exceeds the frame limit; answering with an error"
    );
    match peek_id {
        Some(peek_id) => Response {
            process_index,
            kind: ResponseKind::PeekResponse(lockstep_protocol::PeekResponse {
                peek_id,
                result: lockstep_protocol::PeekResult::Error(format!(
                    "the answer of process {process_index} is {len} bytes, over the frame limit of {max} bytes; peek a narrower collection"
                )),
            }),
        },
        None => error_response(
            process_index,
            ErrorKind::InvalidCommand,
            format!("a response of {len} bytes exceeds the frame limit of {max} bytes and was dropped"),
            0,
        ),
    }
}

pub(super) fn error_response(
    process_index: u32,
    kind: ErrorKind,
    message: String,
    seqno: u64,
) -> Response {
    Response {
        process_index,
        kind: ResponseKind::Error(ErrorResponse {
            kind,
            message,
            seqno,
        }),
    }
}

/// Reads and checks a connection's first frame; a refusal is answered (an
/// Error response) and returned with its reason.
pub(super) async fn handshake(
    framed: &mut Framed<Counted<TcpStream>, SecureCodec<ReplicaCodec>>,
    config: &ReplicaConfig,
    shared: &Mutex<Shared>,
) -> Result<(Command, lockstep_protocol::Hello, u32), (Refusal, String)> {
    let me = config.identity.process_index;
    let first = match framed.next().await {
        None => return Err((Refusal::Closed, "closed before a Hello".into())),
        Some(Err(e)) => {
            let _ = framed
                .send(error_response(me, ErrorKind::Malformed, e.to_string(), 0))
                .await;
            return Err((Refusal::Malformed, format!("malformed first frame: {e}")));
        }
        Some(Ok(cmd)) => cmd,
    };
    let newest = shared.lock().expect("not poisoned").newest_epoch;
    let (hello, protocol_version) = match check_hello(
        &first,
        &config.identity,
        newest,
        config.session_key.as_ref(),
    ) {
        Ok(accepted) => (accepted.hello, accepted.protocol_version),
        Err(e) => {
            let _ = framed
                .send(Response {
                    process_index: me,
                    kind: ResponseKind::Error(e.to_response()),
                })
                .await;
            return Err((Refusal::RefusedHello, format!("refused Hello: {e}")));
        }
    };
    // A Hello of a session that is not newer than the current one is a
    // replay (or a duplicate): taking it would cut the current controller
    // off. Every real connection attempt carries a new nonce.
    let current = shared.lock().expect("not poisoned").outbox.writer_session();
    let session = session_of(hello.epoch, hello.nonce);
    if current != 0 && session <= current {
        let _ = framed
            .send(error_response(
                me,
                ErrorKind::StaleEpoch,
                format!(
                    "Hello of epoch {} nonce {} is not newer than the current session; replayed or duplicated, refused",
                    hello.epoch, hello.nonce
                ),
                0,
            ))
            .await;
        return Err((
            Refusal::Replayed,
            format!(
                "refused a replayed Hello (epoch {}, nonce {})",
                hello.epoch, hello.nonce
            ),
        ));
    }
    Ok((first, hello, protocol_version))
}

/// A connection whose Hello was accepted: its frames, and the Hello (as
/// a command, checked, and the agreed version).
type Accepted = (
    Framed<Counted<TcpStream>, SecureCodec<ReplicaCodec>>,
    (Command, lockstep_protocol::Hello, u32),
);

/// What a connection turned out to be once its first bytes arrived.
enum Opened {
    /// A controller whose Hello was accepted.
    Session(Box<Accepted>),
    /// An HTTP request (`GET /metrics`).
    Scrape(TcpStream),
}

/// Serves one metrics request on `sock` within [`HELLO_DEADLINE`] of its
/// admission, holding its unproven slot throughout (closed at once if the
/// pool evicts it). Off loopback, a process with a session key answers only
/// a request bearing the key's metrics token.
async fn scrape(sock: TcpStream, config: &ReplicaConfig, slot: &lockstep_admission::Slot) {
    let loopback = sock.local_addr().is_ok_and(|a| a.ip().is_loopback());
    let token = config
        .session_key
        .as_ref()
        .filter(|_| !loopback)
        .map(|k| Arc::from(k.metrics_token()));
    let handler = lockstep_metrics_http::metrics_only(|| crate::metrics::METRICS.encode());
    tokio::select! {
        () = slot.closed() => {}
        _ = tokio::time::timeout(
            HELLO_DEADLINE.saturating_sub(slot.admitted().elapsed()),
            lockstep_metrics_http::serve_connection(sock, handler, token),
        ) => {}
    }
}

pub(super) async fn connection(
    sock: TcpStream,
    config: ReplicaConfig,
    shared: Arc<Mutex<Shared>>,
    workers: Arc<Workers>,
    slot: lockstep_admission::Slot,
) -> Result<(), Ended> {
    let me = config.identity.process_index;
    // Until a Hello is accepted, frames are capped at HELLO_MAX_FRAME_LEN:
    // nothing sent before the handshake makes the process buffer or decode
    // more than that.
    //
    // Handshake: with a session key, first the session (the controller
    // proves the key, this process proves it back, and every frame after
    // is encrypted and authenticated: `lockstep_transport::secure`), then the
    // whole first frame, its checks and any refusal sent, all within one
    // deadline; closed at once if a newer connection evicts it.
    //
    // A connection whose first byte is `G` is a metrics scrape (`GET
    // /metrics`): no controller's first frame starts with it (a session
    // handshake message and a plain frame both start with the high byte of
    // a small length, 0). It is served under the same deadline, holding its
    // place among the unproven connections.
    let setup = async {
        let mut first = [0u8; 1];
        if sock.peek(&mut first).await.unwrap_or(0) == 1 && first[0] == b'G' {
            return Ok(Opened::Scrape(sock));
        }
        let mut sock = Counted(sock);
        let session = match (&config.session_key, config.one_way_proof) {
            (Some(key), false) => Some(
                lockstep_transport::secure::respond(&mut sock, key, config.identity.replica_id, me)
                    .await
                    .map_err(|e| (Refusal::NotProven, format!("no session: {e}")))?,
            ),
            _ => None,
        };
        let mut framed = Framed::new(
            sock,
            SecureCodec::new(
                ReplicaCodec::new(config.max_frame_len.min(HELLO_MAX_FRAME_LEN)),
                session,
            ),
        );
        let accepted = handshake(&mut framed, &config, &shared).await?;
        Ok::<_, (Refusal, String)>(Opened::Session(Box::new((framed, accepted))))
    };
    let opened = tokio::select! {
        () = slot.closed() => {
            if slot.admitted().elapsed() >= HELLO_DEADLINE {
                return Err(Ended::Unproven((
                    Refusal::TimedOut,
                    format!("no Hello within {HELLO_DEADLINE:?}"),
                )));
            }
            return Err(Ended::Unproven((Refusal::Evicted, format!(
                "{} connections were waiting for their Hello; closed the oldest",
                slot.caps().unproven
            ))));
        }
        r = tokio::time::timeout(HELLO_DEADLINE, setup) => match r {
            Err(_) => {
                return Err(Ended::Unproven((
                    Refusal::TimedOut,
                    format!("no Hello within {HELLO_DEADLINE:?}"),
                )))
            }
            Ok(Err(refusal)) => return Err(Ended::Unproven(refusal)),
            Ok(Ok(opened)) => opened,
        },
    };
    let (mut framed, (first, hello, protocol_version)) = match opened {
        Opened::Session(accepted) => *accepted,
        Opened::Scrape(sock) => {
            scrape(sock, &config, &slot).await;
            return Ok(());
        }
    };
    if !slot.prove() {
        return Err(Ended::Unproven((
            Refusal::Full,
            format!(
                "{} proven controller connections are open; refused another",
                slot.caps().proven
            ),
        )));
    }
    crate::metrics::METRICS.sessions.inc();
    framed
        .codec_mut()
        .inner_mut()
        .set_max_frame_len(config.max_frame_len);
    let (sink, mut stream) = framed.split();

    // This connection becomes the current one.
    let (wtx, wrx) = mpsc::unbounded_channel::<Response>();
    let generation = {
        let mut s = shared.lock().expect("not poisoned");
        if hello.epoch < s.newest_epoch {
            return Err(
                anyhow::anyhow!("stale epoch {} (newest {})", hello.epoch, s.newest_epoch).into(),
            );
        }
        s.newest_epoch = hello.epoch;
        s.generation += 1;
        // From version 3 on, the agreed version and this build come first,
        // before any Status of the session (a version-2 controller would
        // not know the message, so it gets none).
        if protocol_version >= 3 {
            let _ = wtx.send(Response {
                process_index: me,
                kind: ResponseKind::HelloResponse(lockstep_protocol::HelloResponse {
                    protocol_version,
                    build_version: config.build_version.clone(),
                }),
            });
        }
        s.outbox
            .connected(session_of(hello.epoch, hello.nonce), wtx);
        workers.send(first);
        s.generation
    };
    tracing::info!(
        epoch = hello.epoch,
        nonce = hello.nonce,
        protocol_version,
        "controller session started"
    );

    let writer = tokio::spawn(write_responses(sink, wrx, config.max_frame_len));

    let result = read_commands(&mut stream, &shared, generation, &workers, me).await;
    {
        let mut s = shared.lock().expect("not poisoned");
        if s.generation == generation {
            s.outbox.disconnected();
        }
    }
    // Give queued responses (an error, say) a moment to leave.
    let _ = tokio::time::timeout(Duration::from_millis(200), writer).await;
    result.map_err(Ended::Proven)
}

pub(super) fn send_current(shared: &Arc<Mutex<Shared>>, generation: u64, r: Response) {
    let s = shared.lock().expect("not poisoned");
    if s.generation == generation {
        s.outbox.send_on_connection(r);
    }
}

/// Sends every response of the session to the controller, a peek answer too
/// large for one frame in parts and a response over the frame limit
/// replaced by an error; ends when the session's queue closes or the
/// connection fails, then closes the connection.
async fn write_responses<S>(
    mut sink: S,
    mut wrx: mpsc::UnboundedReceiver<Response>,
    max_frame_len: usize,
) where
    S: futures::Sink<Response, Error = CodecError> + Unpin,
{
    while let Some(r) = wrx.recv().await {
        // Every response already queued goes out in the same flush.
        let mut fed = feed_response(&mut sink, r, max_frame_len).await;
        while fed.is_ok() {
            match wrx.try_recv() {
                Ok(next) => fed = feed_response(&mut sink, next, max_frame_len).await,
                Err(_) => break,
            }
        }
        if fed.is_err() || sink.flush().await.is_err() {
            break;
        }
    }
    let _ = sink.close().await;
}

/// Feeds one response to `sink` (flushed by the caller): a peek answer too
/// large for one frame in parts, and a response too large for one frame
/// replaced by an error (the codec checks the length before writing
/// anything): the process must not go silent, be restarted and be asked the
/// same peek again, forever. `Err` if the connection failed.
async fn feed_response<S>(sink: &mut S, r: Response, max_frame_len: usize) -> Result<(), ()>
where
    S: futures::Sink<Response, Error = CodecError> + Unpin,
{
    let r = match r.kind {
        ResponseKind::PeekResponse(p) => {
            let process_index = r.process_index;
            let mut parts = p.split(max_frame_len / 2).into_iter();
            let last = parts.next_back().expect("at least one part");
            for part in parts {
                let part = Response {
                    process_index,
                    kind: ResponseKind::PeekResponse(part),
                };
                sink.feed(part).await.map_err(|_| ())?;
            }
            Response {
                process_index,
                kind: ResponseKind::PeekResponse(last),
            }
        }
        kind => Response { kind, ..r },
    };
    let process_index = r.process_index;
    let peek_id = match &r.kind {
        ResponseKind::PeekResponse(p) => Some(p.peek_id),
        _ => None,
    };
    match sink.feed(r).await {
        Ok(()) => Ok(()),
        Err(CodecError::FrameTooLarge { len, max }) => sink
            .feed(too_large(process_index, peek_id, len, max))
            .await
            .map_err(|_| ()),
        Err(_) => Err(()),
    }
}

/// Hands the session's commands, in sequence, to every local worker until
/// the connection ends (`Ok`), a newer session takes over (`Ok`), or a
/// malformed frame, a Hello or a sequence gap ends it (`Err`, after the
/// error was sent to the controller).
async fn read_commands<St>(
    stream: &mut St,
    shared: &Arc<Mutex<Shared>>,
    generation: u64,
    workers: &Workers,
    me: u32,
) -> anyhow::Result<()>
where
    St: futures::Stream<Item = Result<Command, CodecError>> + Unpin,
{
    let mut expected = 1u64;
    loop {
        let next = stream.next().await;
        let current = shared.lock().expect("not poisoned").generation == generation;
        if !current {
            break Ok(()); // a newer controller session took over
        }
        let cmd: Command = match next {
            None => break Ok(()),
            Some(Err(CodecError::Io(e))) => break Err(anyhow::anyhow!("connection lost: {e}")),
            Some(Err(e)) => {
                send_current(
                    shared,
                    generation,
                    error_response(me, ErrorKind::Malformed, e.to_string(), expected),
                );
                break Err(anyhow::anyhow!("malformed frame: {e}"));
            }
            Some(Ok(cmd)) => cmd,
        };
        if matches!(cmd.kind, CommandKind::Hello(_)) || cmd.seqno != expected {
            let msg = if matches!(cmd.kind, CommandKind::Hello(_)) {
                "Hello in the middle of a connection".to_string()
            } else {
                format!("expected sequence number {expected}, got {}", cmd.seqno)
            };
            send_current(
                shared,
                generation,
                error_response(me, ErrorKind::Sequence, msg.clone(), cmd.seqno),
            );
            break Err(anyhow::anyhow!(msg));
        }
        expected += 1;
        let s = shared.lock().expect("not poisoned");
        if s.generation != generation {
            break Ok(());
        }
        workers.send(cmd);
    }
}
