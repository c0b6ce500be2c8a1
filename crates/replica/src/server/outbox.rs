//! Where the process's responses go: the current controller connection, or
//! a bounded wait for the connection of the session the workers are in.
//!
//! A response belongs to the session the workers were in when they produced
//! it, and goes out only on that session's connection. Two windows make the
//! two differ:
//!
//! - Under broadcast and log, workers can start a session (a Hello read from
//!   the mesh or the command log) before this process accepted that
//!   session's connection: what they answer waits here for it.
//! - The other way round, a newer session's connection is accepted while
//!   the workers are still in the older one (a log session starts only when
//!   its marker is read from the log). What they answer then belongs to the
//!   session the controller left: sent on the new connection, it would be
//!   taken for the new session's (a subscription's snapshot sent twice, its
//!   rows counted twice; an error naming an old sequence number). It waits
//!   too, and is forgotten when the workers start the newer session.
//!
//! A worker that halts says why on whatever connection is current: the
//! process exits, and no session of it goes on.

use std::collections::VecDeque;

use lockstep_protocol::{ErrorKind, Response, ResponseKind};
use lockstep_reconcile::Session;
use tokio::sync::mpsc;

/// The most responses kept while no connection of the workers' session is
/// current.
pub const MAX_PENDING_RESPONSES: usize = 100_000;

/// The current connection's sender and what waits for a connection.
#[derive(Default)]
pub(super) struct Outbox {
    writer: Option<mpsc::UnboundedSender<Response>>,
    /// The session (see `session_of`) of the current connection.
    writer_session: Session,
    /// The newest session the local workers started.
    workers_session: Session,
    /// Responses produced while no connection of the workers' session was
    /// current; bounded by [`MAX_PENDING_RESPONSES`].
    pending: VecDeque<Response>,
}

impl Outbox {
    /// The session of the current (or last) connection; 0 before any.
    pub(super) fn writer_session(&self) -> Session {
        self.writer_session
    }

    /// The local workers started `session`: what waits from an older one
    /// is forgotten.
    pub(super) fn workers_started(&mut self, session: Session) {
        if session > self.workers_session {
            self.pending.clear();
            self.workers_session = session;
        }
    }

    /// Whether the current connection is the workers' session's.
    fn current_is_workers(&self) -> bool {
        self.writer.is_some() && self.writer_session == self.workers_session
    }

    /// A response of the workers: out now, or kept for its connection.
    pub(super) fn deliver(&mut self, response: Response) {
        let halting = matches!(
            &response.kind,
            ResponseKind::Error(e) if e.kind == ErrorKind::LockstepLost
        );
        match &self.writer {
            Some(w) if halting || self.current_is_workers() => {
                let _ = w.send(response);
            }
            _ => {
                if self.pending.len() == MAX_PENDING_RESPONSES {
                    self.pending.pop_front();
                    tracing::warn!(
                        "no connection of the workers' session; dropping the oldest kept response"
                    );
                }
                self.pending.push_back(response);
            }
        }
    }

    /// A connection of `session` became the current one: what waits for it
    /// goes out on it first.
    pub(super) fn connected(&mut self, session: Session, writer: mpsc::UnboundedSender<Response>) {
        self.writer_session = session;
        self.writer = Some(writer);
        if self.current_is_workers() {
            let w = self.writer.as_ref().expect("just set");
            for r in self.pending.drain(..) {
                let _ = w.send(r);
            }
        }
    }

    /// The current connection ended.
    pub(super) fn disconnected(&mut self) {
        self.writer = None;
    }

    /// A response of the connection itself (a refused frame): on the
    /// current connection, if any.
    pub(super) fn send_on_connection(&self, response: Response) {
        if let Some(w) = &self.writer {
            let _ = w.send(response);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_protocol::{ErrorResponse, SubscribeBatch};

    fn batch(id: u64) -> Response {
        Response {
            process_index: 0,
            kind: ResponseKind::SubscribeResponse(SubscribeBatch {
                subscribe_id: id,
                lower: 0,
                upper: Some(1),
                updates: vec![],
            }),
        }
    }

    fn received(rx: &mut mpsc::UnboundedReceiver<Response>) -> Vec<Response> {
        let mut out = Vec::new();
        while let Ok(r) = rx.try_recv() {
            out.push(r);
        }
        out
    }

    /// The workers are still in session 1 when session 2's connection is
    /// accepted: what they answer for session 1 is not sent on it, and is
    /// forgotten once they start session 2. (Sent, a subscription's snapshot
    /// of session 1 and its replay in session 2 both reached the
    /// controller's merge of session 2: the campaign's `log` seed 2 saw a
    /// snapshot with one process's rows twice, I3.)
    #[test]
    fn an_older_sessions_answer_is_not_sent_on_a_newer_connection() {
        let mut o = Outbox::default();
        let (w1, mut rx1) = mpsc::unbounded_channel();
        o.workers_started(1);
        o.connected(1, w1);
        o.deliver(batch(7));
        assert_eq!(received(&mut rx1), vec![batch(7)]);

        let (w2, mut rx2) = mpsc::unbounded_channel();
        o.connected(2, w2);
        o.deliver(batch(7));
        assert_eq!(
            received(&mut rx2),
            vec![],
            "session 1's answer on session 2's connection"
        );
        o.workers_started(2);
        o.deliver(batch(8));
        assert_eq!(received(&mut rx2), vec![batch(8)]);
    }

    /// What the workers answered in session 1 while no connection was up
    /// does not go out on session 2's connection either.
    #[test]
    fn kept_answers_of_an_older_session_are_not_flushed_to_a_newer_connection() {
        let mut o = Outbox::default();
        o.workers_started(1);
        o.deliver(batch(7));
        let (w2, mut rx2) = mpsc::unbounded_channel();
        o.connected(2, w2);
        assert_eq!(received(&mut rx2), vec![]);
        o.workers_started(2);
        o.deliver(batch(8));
        assert_eq!(received(&mut rx2), vec![batch(8)]);
    }

    /// Workers that started a session before its connection was accepted
    /// (broadcast, log): their answers wait for it, and go out first.
    #[test]
    fn answers_of_a_session_wait_for_its_connection() {
        let mut o = Outbox::default();
        let (w1, mut rx1) = mpsc::unbounded_channel();
        o.connected(1, w1);
        o.workers_started(2);
        o.deliver(batch(7));
        assert_eq!(received(&mut rx1), vec![]);
        let (w2, mut rx2) = mpsc::unbounded_channel();
        o.connected(2, w2);
        assert_eq!(received(&mut rx2), vec![batch(7)]);
    }

    /// A halting worker's reason goes out on whatever connection is current.
    #[test]
    fn a_halt_is_said_on_any_connection() {
        let mut o = Outbox::default();
        o.workers_started(1);
        let (w2, mut rx2) = mpsc::unbounded_channel();
        o.connected(2, w2);
        let halt = Response {
            process_index: 0,
            kind: ResponseKind::Error(ErrorResponse {
                kind: ErrorKind::LockstepLost,
                message: "halting".into(),
                seqno: 0,
            }),
        };
        o.deliver(halt.clone());
        assert_eq!(received(&mut rx2), vec![halt]);
    }
}
