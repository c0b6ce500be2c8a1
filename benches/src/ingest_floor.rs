//! The like-for-like floor of the durable-ingest path (`api/ingest_10k`):
//! differential alone doing the replica's work on the replica's shape.
//!
//! A timely cluster of `processes` x `workers` in this process's threads
//! (each timely process its own thread group, connected over loopback TCP
//! as a replica's processes are) keeps one dataflow for its whole life, as
//! the bench replica keeps its collection: the input as the replica holds
//! it (rows as bytes, `InputSession<u64, Row, i64>`), arranged in the
//! order the replica's exports use ([`row_order`]), and (`filtered`) a
//! second export filtered on its first column (`#0 < 1`), also arranged.
//! State grows for as long as the cluster runs, as the replica's does. Each row goes to the worker that
//! owns it ([`row_owner`], the rule the controller splits writes by) once,
//! moved, not copied; workers park until a batch or a peer wakes them, as
//! the replica's do. Not in the floor: what lockstep adds (the catalog,
//! the wire, the sessions, the exports' change taps).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use differential_dataflow::input::InputSession;
use lockstep_protocol::history::row_order;
use lockstep_protocol::{row_owner, varint_values, Row};
use timely::dataflow::operators::Probe;
use timely::dataflow::ProbeHandle;

/// How long the driver waits for the cluster before it calls it stuck.
const STUCK: Duration = Duration::from_secs(60);

/// A row as an export's arrangement holds it: ordered as the replica's
/// exports order rows (varint values, then bytes).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
struct Arranged(Row);

impl Ord for Arranged {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        row_order(&self.0, &other.0)
    }
}

impl PartialOrd for Arranged {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// What the driver sends a worker: its rows of the batch at a time.
enum ToWorker {
    Batch { rows: Vec<Row>, time: u64 },
    Stop,
}

/// A running cluster; dropped, its workers stop and are joined.
pub struct IngestCluster {
    to_workers: Vec<(Sender<ToWorker>, Thread)>,
    /// (worker, the first time some probe of that worker has not passed).
    passed: Receiver<(usize, u64)>,
    frontier: Vec<u64>,
    processes: Vec<JoinHandle<()>>,
}

impl IngestCluster {
    /// Starts `processes` timely processes of `workers` threads each and
    /// builds the dataflow on every worker: the input arranged, and with
    /// `filtered` the filtered export too.
    pub fn start(processes: usize, workers: usize, filtered: bool) -> IngestCluster {
        let peers = processes * workers;
        let addresses: Vec<String> = (0..processes)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
                format!("127.0.0.1:{}", l.local_addr().expect("addr").port())
            })
            .collect();
        let mut inboxes = Vec::new();
        let mut senders = Vec::new();
        for _ in 0..peers {
            let (tx, rx) = channel();
            senders.push(tx);
            inboxes.push(Some(rx));
        }
        let inboxes = Arc::new(Mutex::new(inboxes));
        let (ready_tx, ready) = channel::<(usize, Thread)>();
        let (passed_tx, passed) = channel::<(usize, u64)>();
        let processes = (0..processes)
            .map(|process| {
                let addresses = addresses.clone();
                let inboxes = Arc::clone(&inboxes);
                let ready_tx = Mutex::new(ready_tx.clone());
                let passed_tx = Mutex::new(passed_tx.clone());
                std::thread::spawn(move || {
                    let config = timely::Config {
                        communication: timely::CommunicationConfig::Cluster {
                            threads: workers,
                            process,
                            addresses,
                            report: false,
                            zerocopy: false,
                        },
                        worker: timely::WorkerConfig::default(),
                    };
                    timely::execute(config, move |worker| {
                        let index = worker.index();
                        let inbox = inboxes.lock().expect("inboxes")[index]
                            .take()
                            .expect("one inbox per worker");
                        let passed = passed_tx.lock().expect("passed").clone();
                        ready_tx
                            .lock()
                            .expect("ready")
                            .send((index, std::thread::current()))
                            .expect("the driver waits");
                        run_worker(worker, inbox, passed, filtered);
                    })
                    .expect("a timely cluster")
                    .join()
                    .into_iter()
                    .for_each(|r| r.expect("a timely worker"));
                })
            })
            .collect();
        drop((ready_tx, passed_tx));
        let mut threads: Vec<Option<Thread>> = vec![None; peers];
        for _ in 0..peers {
            let (index, thread) = ready.recv_timeout(STUCK).expect("every worker starts");
            threads[index] = Some(thread);
        }
        let to_workers = senders
            .into_iter()
            .zip(threads)
            .map(|(tx, t)| (tx, t.expect("every worker reported")))
            .collect();
        IngestCluster {
            to_workers,
            passed,
            frontier: vec![0; peers],
            processes,
        }
    }

    /// Gives every worker its rows of `rows` at `time` (each row moved to
    /// its owner once) and advances the input past `time`; does not wait.
    pub fn ingest(&self, rows: Vec<Row>, time: u64) {
        let peers = self.to_workers.len();
        let mut shares: Vec<Vec<Row>> = (0..peers)
            .map(|_| Vec::with_capacity(rows.len() / peers + 1))
            .collect();
        for row in rows {
            shares[row_owner(&row, peers)].push(row);
        }
        for ((tx, thread), rows) in self.to_workers.iter().zip(shares) {
            tx.send(ToWorker::Batch { rows, time })
                .expect("a worker of the floor stopped");
            thread.unpark();
        }
    }

    /// Waits until every worker's probes passed `time`.
    pub fn wait_past(&mut self, time: u64) {
        // A frontier above `time` passed it.
        while self.frontier.iter().any(|f| *f <= time) {
            match self.passed.recv_timeout(STUCK) {
                Ok((worker, at)) => self.frontier[worker] = self.frontier[worker].max(at),
                Err(RecvTimeoutError::Timeout) => {
                    panic!("the floor's cluster did not pass {time} in {STUCK:?}")
                }
                Err(RecvTimeoutError::Disconnected) => panic!("the floor's cluster stopped"),
            }
        }
    }
}

impl Drop for IngestCluster {
    fn drop(&mut self) {
        for (tx, thread) in &self.to_workers {
            let _ = tx.send(ToWorker::Stop);
            thread.unpark();
        }
        for p in self.processes.drain(..) {
            let _ = p.join();
        }
    }
}

/// One worker: the dataflow, then batches in as they come, stepping (and
/// parking when idle) until told to stop; each time its probe advances it
/// says so.
fn run_worker(
    worker: &mut timely::worker::Worker,
    inbox: Receiver<ToWorker>,
    passed: Sender<(usize, u64)>,
    filtered: bool,
) {
    let index = worker.index();
    let mut input: InputSession<u64, Row, i64> = InputSession::new();
    let probe = ProbeHandle::new();
    worker.dataflow::<u64, _, _>(|scope| {
        let rows = input.to_collection(scope);
        rows.clone()
            .map(Arranged)
            .arrange_by_self()
            .stream
            .probe_with(&probe);
        if filtered {
            rows.filter(|row: &Row| varint_values(row).next().is_some_and(|v| v < 1))
                .map(Arranged)
                .arrange_by_self()
                .stream
                .probe_with(&probe);
        }
    });
    let mut reported = 0u64;
    loop {
        loop {
            match inbox.try_recv() {
                Ok(ToWorker::Batch { rows, time }) => {
                    for row in rows {
                        input.update_at(row, time, 1);
                    }
                    input.advance_to(time + 1);
                    input.flush();
                }
                Ok(ToWorker::Stop) => return,
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            }
        }
        worker.step_or_park(Some(Duration::from_millis(10)));
        let at = probe.with_frontier(|f| f.first().copied().unwrap_or(u64::MAX));
        if at > reported {
            reported = at;
            let _ = passed.send((index, at));
        }
    }
}
