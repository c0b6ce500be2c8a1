//! Bad input on real processes: each gets a clear error and disturbs nothing.

mod common;

use bytes::BytesMut;
use common::*;
use futures::{SinkExt, StreamExt};
use lockstep_controller::Event;
use lockstep_protocol::{
    CodecError, Command, CommandHistory, CommandKind, ErrorKind, Response, ResponseKind, Strategy,
    PROTOCOL_VERSION,
};
use lockstep_transport::secure::{self, SecureCodec};
use lockstep_transport::ControllerCodec;
use tokio::io::AsyncWriteExt;
use tokio_util::codec::{Decoder, Encoder, Framed};

/// What a test peer sends: a frame, or bytes as they are (inside the
/// session's encryption when it has one).
enum Out {
    Frame(Command),
    Bytes(Vec<u8>),
}

/// The controller's codec, plus raw bytes.
struct Raw(ControllerCodec);

impl Encoder<Out> for Raw {
    type Error = CodecError;
    fn encode(&mut self, item: Out, dst: &mut BytesMut) -> Result<(), CodecError> {
        match item {
            Out::Frame(cmd) => self.0.encode(cmd, dst),
            Out::Bytes(b) => {
                dst.extend_from_slice(&b);
                Ok(())
            }
        }
    }
}

impl Decoder for Raw {
    type Item = Response;
    type Error = CodecError;
    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Response>, CodecError> {
        self.0.decode(src)
    }
}

/// Sets up a session with process `index` of `r` (it holds the key, as the
/// real controller does) and sends `out`; returns the first answer, which
/// must be an error.
async fn first_error(
    r: &TestReplica,
    index: usize,
    out: Vec<Out>,
) -> lockstep_protocol::ErrorResponse {
    let addr = r.addrs.processes[index]
        .socket_addr()
        .expect("an IP address");
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let key = r.addrs.session_key.clone().expect("a keyed replica");
    let session = secure::initiate(&mut sock, &key, r.addrs.replica_id, index as u32)
        .await
        .expect("the process proves the key");
    let mut framed = Framed::new(
        sock,
        SecureCodec::new(Raw(ControllerCodec::default()), Some(session)),
    );
    for item in out {
        framed.send(item).await.unwrap();
    }
    let resp = tokio::time::timeout(std::time::Duration::from_secs(10), framed.next())
        .await
        .expect("an answer within 10 s")
        .expect("a frame")
        .expect("a valid frame");
    match resp.kind {
        ResponseKind::Error(e) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}

/// The error process `index` answers `hello` with, as a session's first frame.
async fn hello_error(
    r: &TestReplica,
    index: usize,
    hello: lockstep_protocol::Hello,
) -> lockstep_protocol::ErrorResponse {
    let cmd = Command {
        seqno: 0,
        strategy: Strategy::Barrier,
        kind: CommandKind::Hello(hello),
    };
    first_error(r, index, vec![Out::Frame(cmd)]).await
}

/// A peer without the key that sends `bytes` gets no answer at all: the
/// connection is closed, nothing is read back.
async fn no_answer(addr: std::net::SocketAddr, bytes: &[u8]) {
    use tokio::io::AsyncReadExt;
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = sock.write_all(bytes).await;
    let mut back = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        sock.read_to_end(&mut back),
    )
    .await
    .expect("closed within 10 s");
    assert!(back.is_empty(), "answered {} bytes: {read:?}", back.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_disturbs_nothing() {
    let r = start_replica(5, 2, 2).await;
    let c = controller(&r, 5, CommandHistory::new());
    let mut events = c.events();
    let d = operator_dataflows().remove(3); // the join
    c.create_dataflow(d.clone()).unwrap();
    let writes = operator_writes();
    for (coll, ups, upper) in &writes {
        c.write_input(*coll, ups.clone(), *upper).unwrap();
    }
    assert_eq!(
        as_multiset(c.peek(1013, 3).await.unwrap()),
        reference(&d, &writes, 3)
    );
    let addr = r.addrs.processes[1].socket_addr().expect("an IP address");

    // A peer speaking another protocol version.
    let mut hello = r.addrs.identity(1).hello(9, 42);
    hello.protocol_version = PROTOCOL_VERSION + 1;
    let hello = test_session_key(5).sign(hello);
    let e = hello_error(&r, 1, hello).await;
    assert_eq!(e.kind, ErrorKind::VersionMismatch);
    assert!(
        e.message.contains(&format!("version {PROTOCOL_VERSION}"))
            && e.message
                .contains(&format!("version {}", PROTOCOL_VERSION + 1)),
        "{}",
        e.message
    );

    // A stale controller.
    let stale = r.addrs.hello(1, 4, 43);
    let e = hello_error(&r, 1, stale).await;
    assert_eq!(e.kind, ErrorKind::StaleEpoch, "{}", e.message);

    // A peer without the key gets no session, and so no answer at all, to
    // a Hello (forged or copied) or anything else.
    let plain_hello = {
        let mut b = BytesMut::new();
        ControllerCodec::default()
            .encode(
                Command {
                    seqno: 0,
                    strategy: Strategy::Barrier,
                    kind: CommandKind::Hello(r.addrs.hello(1, u64::MAX, u64::MAX)),
                },
                &mut b,
            )
            .unwrap();
        b.to_vec()
    };
    no_answer(addr, &plain_hello).await;
    no_answer(addr, &[0, 48, 1, 2, 3]).await;

    // A forged Hello inside a session (no proof of the session key, or a proof of another
    // key) with the highest epoch: refused before any other check, and it
    // changes nothing, so the real controller is not locked out (it used to
    // make every real Hello STALE_EPOCH).
    for proof in [
        Vec::new(),
        test_session_key(6).sign(r.addrs.hello(1, 0, 0)).proof,
    ] {
        let mut forged = r.addrs.identity(1).hello(u64::MAX, u64::MAX);
        forged.proof = proof;
        let e = hello_error(&r, 1, forged).await;
        assert_eq!(e.kind, ErrorKind::Unauthenticated, "{}", e.message);
    }
    c.reconnect().unwrap();
    assert_eq!(
        as_multiset(c.peek(1013, 3).await.unwrap()),
        reference(&d, &writes, 3),
        "the real controller still drives the replica after forged Hellos"
    );

    // Before any Hello, a frame longer than HELLO_MAX_FRAME_LEN is refused
    // from its length alone: the process neither waits for nor buffers it.
    let len = (lockstep_protocol::HELLO_MAX_FRAME_LEN as u32 + 1).to_be_bytes();
    let e = first_error(&r, 1, vec![Out::Bytes(len.to_vec())]).await;
    assert_eq!(e.kind, ErrorKind::Malformed, "{}", e.message);
    assert!(
        e.message.contains(&format!(
            "exceeds the maximum of {} bytes",
            lockstep_protocol::HELLO_MAX_FRAME_LEN
        )),
        "{}",
        e.message
    );

    // A malformed frame: a length prefix followed by garbage.
    let e = first_error(&r, 1, vec![Out::Bytes(vec![0, 0, 0, 3, 0xff, 0xff, 0xff])]).await;
    assert_eq!(e.kind, ErrorKind::Malformed, "{}", e.message);

    // A plan naming an unknown collection.
    let mut bad = dataflow(30, &[1], lockstep_plan::Plan::Get { collection_id: 77 });
    bad.debug_name = "bad".into();
    c.create_dataflow(bad).unwrap();
    let err = loop {
        let e = tokio::time::timeout(std::time::Duration::from_secs(10), events.recv())
            .await
            .expect("an error event")
            .unwrap();
        if let Event::ReplicaError { error, .. } = e {
            break error;
        }
    };
    assert_eq!(err.kind, ErrorKind::InvalidCommand);
    assert!(err.message.contains("collection 77"), "{}", err.message);

    // A peek at a compacted time.
    c.allow_compaction(1013, Some(2)).unwrap();
    let e = c.peek(1013, 1).await.unwrap_err();
    assert!(e.to_string().contains("compaction frontier"), "{e}");

    // Nothing else was disturbed: same answers, workers in lockstep, the bad
    // dataflow built nowhere.
    assert_eq!(
        as_multiset(c.peek(1013, 3).await.unwrap()),
        reference(&d, &writes, 3)
    );
    let statuses = c.statuses().await.unwrap();
    for s in &statuses {
        assert_eq!(s.creation_log, statuses[0].creation_log);
        assert_eq!(s.installed, vec![13]);
    }
    c.shutdown();
}

/// A replayed Hello (a copy of the real controller's, proof included) is
/// refused: it used to become the current session and cut the real
/// controller off. A flood of connections that never send a Hello is capped
/// (past the cap, the oldest are closed to admit the new ones) and the
/// controller keeps driving the replica in the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_hellos_and_connection_floods_do_not_cut_the_controller_off() {
    use tokio::io::AsyncReadExt;
    let r = start_replica(9, 2, 1).await;
    let c = controller(&r, 1, CommandHistory::new());
    let d = dataflow(1, &[1], lockstep_plan::Plan::Get { collection_id: 1 });
    c.create_dataflow(d).unwrap();
    c.write_input(1, vec![u(&[1], 0, 1)], 1).unwrap();
    assert_eq!(c.peek(1001, 0).await.unwrap(), vec![(vec![1], 1)]);
    let nonce = c.statuses().await.unwrap()[0].nonce;
    let addr = r.addrs.processes[1].socket_addr().expect("an IP address");

    let replay = r.addrs.hello(1, 1, nonce);
    let e = hello_error(&r, 1, replay).await;
    assert_eq!(e.kind, ErrorKind::StaleEpoch, "{}", e.message);
    assert!(e.message.contains("replayed"), "{}", e.message);

    let mut flood = Vec::new();
    for _ in 0..lockstep_replica::server::MAX_UNPROVEN_CONNECTIONS + 20 {
        flood.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    // Well under HELLO_DEADLINE: the 20 oldest were evicted, the newest is
    // kept.
    let mut byte = [0u8; 1];
    for oldest in &mut flood[..20] {
        let read = tokio::time::timeout(std::time::Duration::from_secs(2), oldest.read(&mut byte))
            .await
            .expect("the oldest connections past the cap are closed at once, not kept");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    let newest = flood.last_mut().unwrap();
    assert!(
        tokio::time::timeout(
            std::time::Duration::from_millis(300),
            newest.read(&mut byte)
        )
        .await
        .is_err(),
        "the newest connection is admitted"
    );

    c.write_input(1, vec![u(&[2], 1, 1)], 2).unwrap();
    assert_eq!(
        as_multiset(c.peek(1001, 1).await.unwrap()),
        as_multiset(vec![(vec![1], 1), (vec![2], 1)])
    );
    for s in c.statuses().await.unwrap() {
        assert_eq!(
            s.nonce, nonce,
            "the controller had to reconnect (worker {})",
            s.worker_index
        );
    }
    drop(flood);
    c.shutdown();
}
