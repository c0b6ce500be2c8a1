//! Protocol version negotiation on a real process (docs/compatibility.md):
//! today's controller and process agree on version 3 and the process
//! reports its build; a version-2 controller's Hello (exactly 2, no
//! maximum) is accepted at version 2 and answered as version 2 answers,
//! with statuses and no HelloResponse.

mod common;

use common::*;
use futures::{SinkExt, StreamExt};
use lockstep_controller::ProcessVersion;
use lockstep_protocol::{
    Command, CommandHistory, CommandKind, Hello, Response, ResponseKind, Strategy, PROTOCOL_VERSION,
};
use lockstep_transport::secure::{self, SecureCodec};
use lockstep_transport::ControllerCodec;
use tokio_util::codec::Framed;

/// Sends `hello` to process 0 of `r` on a new session, as a controller
/// does (the session's marker in the replica's command log first: the
/// workers hold a session until they read it), and returns the first `n`
/// responses.
async fn answers(r: &TestReplica, hello: Hello, n: usize) -> Vec<Response> {
    use lockstep_command_log::{AnyLog, CommandLog};
    let epoch = hello.epoch;
    let hello = Command {
        seqno: 0,
        strategy: Strategy::Barrier,
        kind: CommandKind::Hello(hello),
    };
    let location = r.addrs.command_log.as_ref().expect("a command log");
    AnyLog::open(location)
        .expect("open the command log")
        .append(epoch, std::slice::from_ref(&hello))
        .expect("append the session's marker");
    let addr = r.addrs.processes[0].socket_addr().expect("an IP address");
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let key = r.addrs.session_key.clone().expect("a keyed replica");
    let session = secure::initiate(&mut sock, &key, r.addrs.replica_id, 0)
        .await
        .expect("the process proves the key");
    let mut framed = Framed::new(
        sock,
        SecureCodec::new(ControllerCodec::default(), Some(session)),
    );
    framed.send(hello).await.unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let r = tokio::time::timeout(std::time::Duration::from_secs(10), framed.next())
            .await
            .expect("an answer within 10 s")
            .expect("a frame")
            .expect("a valid frame");
        out.push(r);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_negotiated_and_reported() {
    let r = start_replica(23, 1, 2).await;
    let c = controller(&r, 1, CommandHistory::new());
    let d = dataflow(1, &[1], lockstep_plan::Plan::Get { collection_id: 1 });
    c.create_dataflow(d).unwrap();
    c.write_input(1, vec![u(&[1], 0, 1)], 1).unwrap();
    assert_eq!(c.peek(1001, 0).await.unwrap(), vec![(vec![1], 1)]);
    assert_eq!(
        c.process_versions().await.unwrap(),
        vec![Some(ProcessVersion {
            protocol_version: PROTOCOL_VERSION,
            build_version: Some(env!("CARGO_PKG_VERSION").to_string()),
        })]
    );

    // A version-2 controller (release v0.2.0): exactly 2, no maximum. Its
    // proof stays valid: the maximum is not covered. Epoch 2 supersedes
    // the controller above, which is not used again.
    let mut old = r.addrs.hello(0, 2, 1);
    old.protocol_version = 2;
    old.max_protocol_version = 0;
    let got = answers(&r, old, 2).await;
    for a in &got {
        assert!(
            matches!(&a.kind, ResponseKind::Status(s) if s.epoch == 2 && s.nonce == 1),
            "a version-2 Hello is answered with statuses only, got {a:?}"
        );
    }

    // Today's Hello (2 to 3): the HelloResponse comes first, then the
    // statuses.
    let got = answers(&r, r.addrs.hello(0, 2, 2), 3).await;
    match &got[0].kind {
        ResponseKind::HelloResponse(h) => {
            assert_eq!(h.protocol_version, PROTOCOL_VERSION);
            assert_eq!(h.build_version, env!("CARGO_PKG_VERSION"));
        }
        other => panic!("expected a HelloResponse first, got {other:?}"),
    }
    for a in &got[1..] {
        assert!(
            matches!(&a.kind, ResponseKind::Status(s) if s.nonce == 2),
            "{a:?}"
        );
    }
    c.shutdown();
}
