//! What a replica sends cannot make the controller keep more than a
//! bound, nor pass one worker's answer off as another's: each check
//! below ends the session with an error (a `Disconnected` event).

use lockstep_protocol::{PeekResponse, Response, Update};

use super::*;

struct Harness {
    actor: Actor,
    events: broadcast::Receiver<Event>,
    _peers: Vec<tokio::net::TcpStream>,
    _from_conns: mpsc::UnboundedReceiver<FromConn>,
    _connected: mpsc::UnboundedReceiver<(u64, Result<Vec<connection::Connected>, String>)>,
}

/// A controller of `processes` x `workers` whose session is past
/// Hello, over sockets that stand in for the processes.
async fn connected(processes: usize, workers: u32) -> Harness {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let replica = ReplicaAddrs {
        replica_id: 1,
        processes: vec![addr.into(); processes],
        workers_per_process: workers,
        command_log: None,
        session_key: None,
        one_way_proof: false,
        max_frame_len: lockstep_protocol::DEFAULT_MAX_FRAME_LEN,
    };
    let timeouts = Timeouts {
        connect: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(2),
        request: Duration::from_secs(20),
    };
    let (events_tx, events) = broadcast::channel(1024);
    let (mut actor, from_conns, connected_rx) = Actor::new(
        replica,
        1,
        CommandHistory::new(),
        crate::Distribution {
            policy: Box::new(lockstep_policy::FixedStrategy(
                crate::DeliveryRules::FALLBACK,
            )),
            rules: crate::DeliveryRules::AS_CHOSEN,
        },
        timeouts,
        events_tx,
    );
    actor.session.connect();
    let mut socks = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..processes {
        socks.push(connection::Connected::plain(
            tokio::net::TcpStream::connect(addr).await.unwrap(),
        ));
        peers.push(listener.accept().await.unwrap().0);
    }
    let generation = actor.generation;
    actor.on_connected(generation, Ok(socks));
    assert!(actor.phase().is_connected(), "{:?}", actor.phase());
    Harness {
        actor,
        events,
        _peers: peers,
        _from_conns: from_conns,
        _connected: connected_rx,
    }
}

impl Harness {
    /// Process `p` answers `kind`.
    fn answer(&mut self, p: usize, kind: ResponseKind) {
        let generation = self.actor.generation;
        self.actor.on_conn(FromConn {
            process: p,
            generation,
            event: ConnEvent::Response(Response {
                process_index: p as u32,
                kind,
            }),
        });
    }

    /// The reason the session ended, if it did.
    fn ended(&mut self) -> Option<String> {
        while let Ok(e) = self.events.try_recv() {
            if let Event::Disconnected { reason, .. } = e {
                assert!(
                    matches!(self.actor.phase(), Phase::Connecting { .. }),
                    "{:?}",
                    self.actor.phase()
                );
                return Some(reason);
            }
        }
        None
    }
}

fn status(worker_index: u32) -> Status {
    Status {
        worker_index,
        epoch: 1,
        nonce: 1,
        applied_seqno: 0,
        history_hash: None,
        creation_log: Vec::new(),
        installed: Vec::new(),
    }
}

#[tokio::test]
async fn a_status_of_a_worker_the_process_does_not_own_ends_the_session() {
    let mut h = connected(2, 2).await;
    // Process 1 owns workers 2 and 3.
    h.answer(1, ResponseKind::Status(status(2)));
    h.answer(1, ResponseKind::Status(status(3)));
    assert_eq!(h.ended(), None);
    h.answer(1, ResponseKind::Status(status(0)));
    let reason = h.ended().expect("the session ended");
    assert!(
        reason.contains("worker 0") && reason.contains("does not own"),
        "{reason}"
    );
    assert!(!h.actor.statuses.contains_key(&0));

    // A worker index past the replica's workers.
    let mut h = connected(2, 2).await;
    h.answer(0, ResponseKind::Status(status(u32::MAX)));
    assert!(h.ended().is_some());
    assert!(h.actor.statuses.is_empty());
}

#[tokio::test]
async fn a_response_naming_another_process_ends_the_session() {
    let mut h = connected(2, 1).await;
    let generation = h.actor.generation;
    h.actor.on_conn(FromConn {
        process: 0,
        generation,
        event: ConnEvent::Response(Response {
            process_index: 1,
            kind: ResponseKind::Frontiers(Vec::new()),
        }),
    });
    let reason = h.ended().expect("the session ended");
    assert!(reason.contains("names process 1"), "{reason}");
}

#[tokio::test]
async fn frontiers_of_too_many_unknown_collections_end_the_session() {
    let mut h = connected(1, 1).await;
    h.actor.limits.unknown_frontiers = 10;
    // Known collections do not count.
    h.actor.send(dataflow_1());
    h.answer(
        0,
        ResponseKind::Frontiers(vec![(1, Some(1)), (1001, Some(1))]),
    );
    h.answer(
        0,
        ResponseKind::Frontiers((5000..5010).map(|c| (c, Some(1))).collect()),
    );
    // Again: the same collections are not counted twice.
    h.answer(
        0,
        ResponseKind::Frontiers((5000..5010).map(|c| (c, Some(2))).collect()),
    );
    assert_eq!(h.ended(), None);
    h.answer(0, ResponseKind::Frontiers(vec![(6000, Some(1))]));
    let reason = h.ended().expect("the session ended");
    assert!(reason.contains("does not know"), "{reason}");
    assert!(h.actor.frontiers.len() <= 12);
}

#[tokio::test]
async fn peek_parts_past_the_bound_end_the_session_and_fail_the_peek() {
    let mut h = connected(2, 1).await;
    h.actor.limits.peek_part_bytes = 100 * update_bytes(8);
    let (reply, mut answer) = oneshot::channel();
    h.actor.on_request(Request::Peek {
        collection: 1001,
        timestamp: 0,
        reply,
    });
    let peek_id = h.actor.next_peek_id - 1;
    let part = |n: i64| {
        ResponseKind::PeekResponse(PeekResponse {
            peek_id,
            result: PeekResult::Part((0..n).map(|i| (i.to_le_bytes().to_vec(), 1)).collect()),
        })
    };
    // Within the bound, over both processes.
    h.answer(0, part(50));
    h.answer(1, part(40));
    assert_eq!(h.ended(), None);
    assert!(answer.try_recv().is_err(), "not answered yet");
    h.answer(0, part(20));
    let reason = h.ended().expect("the session ended");
    assert!(reason.contains(&format!("peek {peek_id}")), "{reason}");
    let err = answer.try_recv().expect("answered").unwrap_err();
    assert!(err.to_string().contains("exceeds"), "{err}");
    assert!(h.actor.peeks.is_empty());
}

/// The campaign's defect (seed 6, barrier): after an environment
/// restart, a restarted replica replayed an earlier controller's peek
/// from the command log, and its answer, carrying the same peek ID as
/// the new controller's first peek, was taken as that peek's answer.
/// IDs now carry the epoch: the old answer matches nothing.
#[tokio::test]
async fn an_answer_to_an_earlier_controllers_peek_is_not_taken_for_ours() {
    let mut h = connected(1, 1).await;
    let (reply, mut answer) = oneshot::channel();
    h.actor.on_request(Request::Peek {
        collection: 1001,
        timestamp: 0,
        reply,
    });
    let ours = h.actor.next_peek_id - 1;
    // The same counter value under the previous epoch (0): what the
    // earlier controller's first peek was numbered.
    let earlier = first_request_id(0);
    assert_ne!(earlier, ours);
    h.answer(
        0,
        ResponseKind::PeekResponse(PeekResponse {
            peek_id: earlier,
            result: PeekResult::Rows(vec![(vec![66], 1)]),
        }),
    );
    assert!(
        answer.try_recv().is_err(),
        "an earlier peek's rows were taken"
    );
    h.answer(
        0,
        ResponseKind::PeekResponse(PeekResponse {
            peek_id: ours,
            result: PeekResult::Rows(vec![(vec![1], 1)]),
        }),
    );
    assert_eq!(
        answer.try_recv().expect("answered").unwrap(),
        vec![(vec![1], 1)]
    );
}

#[tokio::test]
async fn completed_peek_parts_are_not_counted_against_the_next() {
    let mut h = connected(1, 1).await;
    h.actor.limits.peek_part_bytes = 100 * update_bytes(8);
    let (reply, mut answer) = oneshot::channel();
    h.actor.on_request(Request::Peek {
        collection: 1001,
        timestamp: 0,
        reply,
    });
    let peek_id = h.actor.next_peek_id - 1;
    let rows = |n: i64| {
        (0..n)
            .map(|i| (i.to_le_bytes().to_vec(), 1))
            .collect::<Vec<_>>()
    };
    h.answer(
        0,
        ResponseKind::PeekResponse(PeekResponse {
            peek_id,
            result: PeekResult::Part(rows(90)),
        }),
    );
    h.answer(
        0,
        ResponseKind::PeekResponse(PeekResponse {
            peek_id,
            result: PeekResult::Rows(rows(5)),
        }),
    );
    assert_eq!(h.ended(), None);
    assert_eq!(answer.try_recv().unwrap().unwrap().len(), 90);
}

fn batch(id: u64, lower: u64, upper: Frontier, times: std::ops::Range<u64>) -> ResponseKind {
    ResponseKind::SubscribeResponse(SubscribeBatch {
        subscribe_id: id,
        lower,
        upper,
        updates: times
            .map(|t| Update {
                row: t.to_le_bytes().to_vec(),
                time: t,
                diff: 1,
            })
            .collect(),
    })
}

/// A client that stops reading is cut off with an error as its last
/// item, not buffered without end; the session goes on.
#[tokio::test]
async fn a_stalled_subscriber_is_cut_off_not_buffered() {
    let mut h = connected(1, 1).await;
    let (sink, mut out) = mpsc::channel(crate::SUBSCRIBE_CHANNEL_BATCHES);
    h.actor.on_request(Request::Subscribe {
        collection: 1001,
        as_of: 0,
        sink,
    });
    let id = h.actor.next_subscribe_id - 1;
    for t in 0..crate::SUBSCRIBE_CHANNEL_BATCHES as u64 + 10 {
        h.answer(0, batch(id, t, Some(t + 1), t..t + 1));
    }
    assert_eq!(h.ended(), None, "the session goes on");
    assert!(h.actor.subs.is_empty(), "the subscription ended");
    let mut items = 0;
    let mut last = None;
    while let Ok(item) = out.try_recv() {
        items += 1;
        last = Some(item);
    }
    assert_eq!(items, crate::SUBSCRIBE_CHANNEL_BATCHES);
    let err = last
        .expect("items")
        .expect_err("the last item is the error");
    assert!(err.to_string().contains("unread"), "{err}");
}

#[tokio::test]
async fn a_subscription_held_back_past_the_bound_ends_the_session() {
    let mut h = connected(2, 1).await;
    h.actor.limits.subscribe_buffer_bytes = 100 * update_bytes(8);
    let (sink, mut out) = mpsc::channel(crate::SUBSCRIBE_CHANNEL_BATCHES);
    h.actor.on_request(Request::Subscribe {
        collection: 1001,
        as_of: 0,
        sink,
    });
    let id = h.actor.next_subscribe_id - 1;
    // Both processes advance together: what is emitted is not held.
    for round in 0..5u64 {
        let (lo, hi) = (round * 80, (round + 1) * 80);
        h.answer(0, batch(id, lo, Some(hi), lo..hi));
        h.answer(1, batch(id, lo, Some(hi), lo..hi));
        assert_eq!(h.ended(), None, "round {round}");
        // (Both sent the same rows: consolidated, one row each, diff 2.)
        assert_eq!(out.try_recv().unwrap().unwrap().updates.len(), 80);
    }
    // Process 1 runs ahead while process 0 stays: its updates are held
    // back until the bound.
    h.answer(1, batch(id, 400, Some(460), 400..460));
    assert_eq!(h.ended(), None);
    h.answer(1, batch(id, 460, Some(520), 460..520));
    let reason = h.ended().expect("the session ended");
    assert!(reason.contains(&format!("subscription {id}")), "{reason}");
    assert!(
        out.try_recv().unwrap().is_err(),
        "the subscription ends with an error"
    );
    assert!(h.actor.subs.is_empty());
}

/// A dataflow reading input 1 and exporting collection 1001.
fn dataflow_1() -> CommandKind {
    CommandKind::CreateDataflow(lockstep_protocol::DataflowDescription {
        id: 1,
        as_of: 0,
        inputs: vec![1],
        exports: vec![lockstep_protocol::Export {
            collection_id: 1001,
            // The built-in family's `get(1)`; the controller never reads it.
            description: vec![0x0a, 0x02, 0x08, 0x01],
        }],
        debug_name: "d".into(),
        format: lockstep_protocol::DEFAULT_FORMAT.into(),
    })
}

#[tokio::test]
async fn a_dataflow_is_caught_up_once_every_process_reported_its_exports_there() {
    let mut h = connected(2, 1).await;
    assert_eq!(h.actor.caught_up(), crate::CaughtUp::default());
    h.actor.send(dataflow_1());
    let none = crate::CaughtUp {
        dataflows: 1,
        caught_up: 0,
    };
    assert_eq!(h.actor.caught_up(), none, "nothing reported");
    h.answer(0, ResponseKind::Frontiers(vec![(1001, Some(1))]));
    assert_eq!(h.actor.caught_up(), none, "one process of two");
    h.answer(1, ResponseKind::Frontiers(vec![(1001, None)]));
    assert_eq!(
        h.actor.caught_up(),
        crate::CaughtUp {
            dataflows: 1,
            caught_up: 1
        },
        "both, one of them complete"
    );
}

#[tokio::test]
async fn a_reshaped_controller_sizes_its_books_for_the_new_processes_and_reconnects() {
    let mut h = connected(2, 1).await;
    h.actor.send(dataflow_1());
    let (sink, _rx) = mpsc::channel(4);
    h.actor.on_request(Request::Subscribe {
        collection: 1001,
        as_of: 0,
        sink,
    });
    let mut replica = h.actor.replica.clone();
    replica.processes.push(replica.processes[0].clone());
    replica.workers_per_process = 2;
    h.actor.on_request(Request::Reshape(replica));
    assert_eq!(h.actor.conns.len(), 3);
    assert_eq!(h.actor.replica.total_workers(), 6);
    assert!(
        matches!(h.actor.phase(), Phase::Connecting { .. }),
        "a new session: {:?}",
        h.actor.phase()
    );
    assert_eq!(h.actor.subs.len(), 1, "the subscription goes on");
    // Another replica's reshape is refused.
    let mut other = h.actor.replica.clone();
    other.replica_id = 2;
    other.processes.truncate(1);
    h.actor.on_request(Request::Reshape(other));
    assert_eq!(h.actor.conns.len(), 3);
}
