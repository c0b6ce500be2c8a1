//! The protocol's frames through `tokio_util`'s `Framed` on a real socket.

use lockstep_protocol::*;
use lockstep_transport::{ControllerCodec, ReplicaCodec};

#[tokio::test]
async fn framed_over_a_real_socket() {
    use futures::{SinkExt, StreamExt};
    use tokio_util::codec::Framed;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (sock, _) = listener.accept().await.unwrap();
        let mut framed = Framed::new(sock, ReplicaCodec::default());
        let cmd = framed.next().await.unwrap().unwrap();
        framed
            .send(Response {
                process_index: 0,
                kind: ResponseKind::Error(ErrorResponse {
                    kind: ErrorKind::InvalidCommand,
                    message: format!("got {}", cmd.kind.name()),
                    seqno: cmd.seqno,
                }),
            })
            .await
            .unwrap();
    });
    let sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut framed = Framed::new(sock, ControllerCodec::default());
    framed
        .send(Command {
            seqno: 3,
            strategy: lockstep_protocol::Strategy::Barrier,
            kind: CommandKind::InitializationComplete,
        })
        .await
        .unwrap();
    let resp = framed.next().await.unwrap().unwrap();
    assert_eq!(
        resp.kind,
        ResponseKind::Error(ErrorResponse {
            kind: ErrorKind::InvalidCommand,
            message: "got initialization-complete".into(),
            seqno: 3
        })
    );
    server.await.unwrap();
}
