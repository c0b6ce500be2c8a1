//! The `broadcast` strategy (the Materialize baseline): global worker 0 is
//! the sequencer.
//!
//! Worker 0 forwards each broadcast command it receives from its own
//! process's controller connection onto the control mesh (an explicit
//! broadcast exchange rather than timely's `Sequencer`), and every worker,
//! worker 0 included, applies broadcast commands only in the order the mesh
//! delivers them from worker 0; the copies other workers receive from their
//! own connections only wake them. A Hello sent with `broadcast` is
//! sequenced too, so a session starts at the same point of the stream on
//! every worker. Broadcast sessions reconcile collectively (see
//! `lockstep_reconcile::strategy::barrier`).

use lockstep_protocol::{Command, ErrorKind, WireMessage};
use serde_bytes::ByteBuf;

use crate::worker::{MeshMessage, WorkerState};

impl WorkerState {
    /// The socket copy of a broadcast command: the sequencer (worker 0)
    /// forwards it on the control mesh; every other worker leaves it.
    pub(crate) fn forward_broadcast(&mut self, cmd: Command) {
        if self.index == 0 {
            let seqno = cmd.seqno;
            let bytes = cmd.encode_to_vec();
            if let Some(mesh) = &mut self.mesh {
                mesh.send(
                    0,
                    MeshMessage::Command {
                        seqno,
                        bytes: ByteBuf::from(bytes),
                    },
                );
            } else {
                self.error(
                    seqno,
                    ErrorKind::InvalidCommand,
                    "broadcast needs the control mesh".into(),
                );
            }
        }
    }

    /// A broadcast command the mesh delivered from the sequencer: it joins
    /// the queue, in mesh order.
    pub(crate) fn sequenced(&mut self, seqno: u64, bytes: ByteBuf) {
        match Command::decode_from(&bytes) {
            Ok(cmd) => self.push_ordered(cmd),
            // Worker 0 encoded it: only a broken build gets here,
            // and every worker sees the same bytes.
            Err(e) => self.halt(format!(
                "undecodable broadcast command {seqno} from the sequencer: {e}"
            )),
        }
    }
}
