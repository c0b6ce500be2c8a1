//! Every command and response survives the wire types and the framing.

mod arb;

use bytes::BytesMut;
use lockstep_protocol::*;
use proptest::prelude::*;

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
        let mut buf = BytesMut::new();
        for c in &cmds {
            encode_frame(c.clone(), DEFAULT_MAX_FRAME_LEN, &mut buf).unwrap();
        }
        let mut got = Vec::new();
        while let Some(c) = decode_frame::<Command>(&mut buf, DEFAULT_MAX_FRAME_LEN).unwrap() {
            got.push(c);
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, cmds);
    }

    #[test]
    fn responses_roundtrip_through_the_codec(resps in proptest::collection::vec(arb::response(), 1..6)) {
        let mut buf = BytesMut::new();
        for r in &resps {
            encode_frame(r.clone(), DEFAULT_MAX_FRAME_LEN, &mut buf).unwrap();
        }
        let mut got = Vec::new();
        while let Some(r) = decode_frame::<Response>(&mut buf, DEFAULT_MAX_FRAME_LEN).unwrap() {
            got.push(r);
        }
        prop_assert_eq!(got, resps);
    }

    /// Byte-at-a-time delivery yields the same frames: partial frames wait.
    #[test]
    fn partial_delivery_decodes_the_same(cmd in arb::command()) {
        let mut whole = BytesMut::new();
        encode_frame(cmd.clone(), DEFAULT_MAX_FRAME_LEN, &mut whole).unwrap();
        let mut buf = BytesMut::new();
        let mut got = None;
        for b in whole.iter() {
            prop_assert!(got.is_none());
            buf.extend_from_slice(&[*b]);
            got = decode_frame::<Command>(&mut buf, DEFAULT_MAX_FRAME_LEN).unwrap();
        }
        prop_assert_eq!(got, Some(cmd));
    }

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut buf = BytesMut::from(&bytes[..]);
        for _ in 0..8 {
            match decode_frame::<Command>(&mut buf, 1024) {
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => break,
            }
        }
        let mut buf = BytesMut::from(&bytes[..]);
        let _ = decode_frame_eof::<Response>(&mut buf, 1024);
    }
}
