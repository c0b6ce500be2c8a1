//! Every command and response survives the wire types and the codec.

mod arb;

use bytes::BytesMut;
use lockstep_protocol::*;
use proptest::prelude::*;
use tokio_util::codec::{Decoder, Encoder};

proptest! {
    #[test]
    fn command_roundtrips_through_wire_types(cmd in arb::command()) {
        let wire = proto::Command::from(cmd.clone());
        prop_assert_eq!(Command::try_from(wire).unwrap(), cmd);
    }

    /// The length a policy is told is the encoding's.
    #[test]
    fn encoded_len_is_the_encodings_length(cmd in arb::command()) {
        prop_assert_eq!(cmd.clone().encoded_len(), cmd.encode_to_vec().len());
    }

    #[test]
    fn response_roundtrips_through_wire_types(resp in arb::response()) {
        let wire = proto::Response::from(resp.clone());
        prop_assert_eq!(Response::try_from(wire).unwrap(), resp);
    }

    #[test]
    fn commands_roundtrip_through_the_codec(cmds in proptest::collection::vec(arb::command(), 1..6)) {
        let mut enc = ControllerCodec::default();
        let mut dec = ReplicaCodec::default();
        let mut buf = BytesMut::new();
        for c in &cmds {
            enc.encode(c.clone(), &mut buf).unwrap();
        }
        let mut got = Vec::new();
        while let Some(c) = dec.decode(&mut buf).unwrap() {
            got.push(c);
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, cmds);
    }

    #[test]
    fn responses_roundtrip_through_the_codec(resps in proptest::collection::vec(arb::response(), 1..6)) {
        let mut enc = ReplicaCodec::default();
        let mut dec = ControllerCodec::default();
        let mut buf = BytesMut::new();
        for r in &resps {
            enc.encode(r.clone(), &mut buf).unwrap();
        }
        let mut got = Vec::new();
        while let Some(r) = dec.decode(&mut buf).unwrap() {
            got.push(r);
        }
        prop_assert_eq!(got, resps);
    }

    /// Byte-at-a-time delivery yields the same frames: partial frames wait.
    #[test]
    fn partial_delivery_decodes_the_same(cmd in arb::command()) {
        let mut enc = ControllerCodec::default();
        let mut whole = BytesMut::new();
        enc.encode(cmd.clone(), &mut whole).unwrap();
        let mut dec = ReplicaCodec::default();
        let mut buf = BytesMut::new();
        let mut got = None;
        for b in whole.iter() {
            prop_assert!(got.is_none());
            buf.extend_from_slice(&[*b]);
            got = dec.decode(&mut buf).unwrap();
        }
        prop_assert_eq!(got, Some(cmd));
    }

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut dec = ReplicaCodec::new(1024);
        let mut buf = BytesMut::from(&bytes[..]);
        for _ in 0..8 {
            match dec.decode(&mut buf) {
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => break,
            }
        }
        let mut dec = ControllerCodec::new(1024);
        let mut buf = BytesMut::from(&bytes[..]);
        let _ = dec.decode_eof(&mut buf);
    }
}

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
