//! The client of the real-node suite: writes to one input and peeks of two
//! exports, every answer checked against the plain-Rust reference (I3),
//! every call retried within a bound (a call not answered within it is a
//! violation of R2's promise that the replica is back within the bound).
//!
//! Write `t` inserts the row `[t, t % 4]` at time `t` and moves the upper
//! to `t + 1`. A write is retried (the same request) until answered;
//! `OUT_OF_RANGE` after an attempt that was sent means that attempt was
//! applied (this client is the input's only writer).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lockstep_chaos::environment::Client;
use lockstep_chaos::outcome::{violation, Failure};
use lockstep_environment::proto;
use lockstep_plan::{Aggregate, Plan};
use lockstep_protocol::proto as wire;

/// The replica's name.
pub const REPLICA: &str = "r";
/// The input collection.
const INPUT: u64 = 1;
/// The identity export.
const IDENTITY: u64 = 101;
/// The reduce export: per `t % 4`, the count and the sum of `t`.
const REDUCE: u64 = 102;
/// One attempt's bound.
const ATTEMPT: Duration = Duration::from_secs(10);
/// The pause between attempts.
const RETRY: Duration = Duration::from_millis(250);

fn reduce_plan() -> Plan {
    Plan::Reduce {
        input: Box::new(Plan::Get {
            collection_id: INPUT,
        }),
        key: vec![1],
        aggregates: vec![Aggregate::Count, Aggregate::Sum(0)],
    }
}

/// How to reach the API: its URL and token (a new connection per attempt,
/// so an environment restarted on the same port is found again).
#[derive(Clone, Debug)]
pub struct Api {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The API token.
    pub token: Option<String>,
    /// For an `https://` URL: the CA certificate (PEM) to check the
    /// server's against, and the name to check it for (the Service's DNS
    /// name, where the URL has the pod's IP).
    pub tls: Option<(String, String)>,
}

impl Api {
    async fn client(&self) -> Result<Client, String> {
        let mut endpoint = tonic::transport::Endpoint::from_shared(self.url.clone())
            .map_err(|e| e.to_string())?
            .connect_timeout(ATTEMPT);
        if let Some((ca, domain)) = &self.tls {
            endpoint = endpoint
                .tls_config(
                    tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                        .domain_name(domain),
                )
                .map_err(|e| format!("TLS: {e}"))?;
        }
        let channel = tokio::time::timeout(ATTEMPT, endpoint.connect())
            .await
            .map_err(|_| "connect timed out".to_string())?
            .map_err(|e| format!("connect: {e}"))?;
        let bearer = lockstep_chaos::environment::Bearer::new(self.token.as_deref())
            .map_err(|e| e.to_string())?;
        Ok(proto::environment_client::EnvironmentClient::with_interceptor(channel, bearer))
    }
}

fn code(s: &tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// What a steady reader saw ([`Workload::read_steadily`]).
#[derive(Debug, Default)]
pub struct Reads {
    /// Peeks answered (right or wrong).
    pub answered: u64,
    /// Peeks refused, by status code.
    pub refused: BTreeMap<String, u64>,
    /// Answers that differ from the reference.
    pub wrong: Vec<String>,
    /// The longest peek.
    pub longest: Duration,
}

impl Reads {
    /// Across `what`: a refused read is a violation of I2, a wrong one of
    /// I3; none answered is a harness error (nothing was tested).
    pub fn check(&self, what: &str) -> Result<(), Failure> {
        if !self.refused.is_empty() {
            return Err(violation(
                "I2",
                format!("reads refused across {what}: {self:?}"),
            ));
        }
        if !self.wrong.is_empty() {
            return Err(violation("I3", format!("{:?}", self.wrong)));
        }
        if self.answered == 0 {
            return Err(Failure::Harness(format!(
                "no read was answered across {what}: nothing was tested"
            )));
        }
        Ok(())
    }
}

/// The writes made so far, and the API.
pub struct Workload {
    api: Api,
    applied: BTreeMap<u64, Vec<i64>>,
    next: u64,
}

impl Workload {
    /// A client of `api` with no writes yet.
    pub fn new(api: Api) -> Workload {
        Workload {
            api,
            applied: BTreeMap::new(),
            next: 0,
        }
    }

    /// Points the client at a restarted environment.
    pub fn set_api(&mut self, api: Api) {
        self.api = api;
    }

    /// The time of the newest applied write.
    pub fn newest(&self) -> Option<u64> {
        self.applied.keys().next_back().copied()
    }

    /// Creates the replica (`processes` x `workers`) and its dataflow,
    /// each retried until answered within `bound`. A harness error if not:
    /// nothing was faulted yet.
    pub async fn set_up(
        &mut self,
        processes: u32,
        workers: u32,
        bound: Duration,
    ) -> Result<u64, Failure> {
        let deadline = Instant::now() + bound;
        let id = loop {
            let req = proto::CreateReplicaRequest {
                name: REPLICA.into(),
                processes,
                workers_per_process: workers,
                config: String::new(),
            };
            let answer = match self.api.client().await {
                Ok(mut c) => c.create_replica(req).await.map_err(|s| code(&s)),
                Err(e) => Err(e),
            };
            match answer {
                Ok(r) => break r.into_inner().replica.map(|r| r.id).unwrap_or(0),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("node: create replica: {e}; again");
                    tokio::time::sleep(RETRY).await;
                }
                Err(e) => return Err(Failure::Harness(format!("creating the replica: {e}"))),
            }
        };
        let identity = Plan::Get {
            collection_id: INPUT,
        };
        let create = proto::CreateDataflowRequest {
            replica: REPLICA.into(),
            name: "node".into(),
            inputs: vec![INPUT],
            exports: vec![
                wire::Export {
                    collection_id: IDENTITY,
                    description: lockstep_plan::encode(&identity),
                },
                wire::Export {
                    collection_id: REDUCE,
                    description: lockstep_plan::encode(&reduce_plan()),
                },
            ],
            as_of: 0,
            format: String::new(),
        };
        loop {
            let answer = match self.api.client().await {
                Ok(mut c) => c
                    .create_dataflow(create.clone())
                    .await
                    .map_err(|s| code(&s)),
                Err(e) => Err(e),
            };
            match answer {
                Ok(_) => return Ok(id),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("node: create dataflow: {e}; again");
                    tokio::time::sleep(RETRY).await;
                }
                Err(e) => return Err(Failure::Harness(format!("creating the dataflow: {e}"))),
            }
        }
    }

    /// Write `t = next` (see the module docs), retried until answered
    /// within `bound` (else a violation of `invariant`).
    pub async fn write(&mut self, bound: Duration, invariant: &str) -> Result<(), Failure> {
        let (req, row) = self.next_write();
        self.retry_write(req, 0, Instant::now(), bound, invariant)
            .await?;
        self.applied.insert(self.next, row);
        self.next += 1;
        Ok(())
    }

    /// Write `t = next` with its first attempt in flight while `interrupt`
    /// runs (it kills the environment and starts it again, giving its
    /// API), then retried against that API until answered within `bound`:
    /// applied exactly once whatever the kill cut (the reference check
    /// then catches a write lost or applied twice). Returns whether the
    /// first attempt was answered before the kill.
    pub async fn write_across(
        &mut self,
        interrupt: impl std::future::Future<Output = Result<Api, Failure>>,
        bound: Duration,
        invariant: &str,
    ) -> Result<bool, Failure> {
        let started = Instant::now();
        let (req, row) = self.next_write();
        // Connected before: the interruption must find the attempt sent.
        let mut c = self.api.client().await.map_err(Failure::Harness)?;
        let first = async {
            tokio::time::timeout(ATTEMPT, c.write_input(req.clone()))
                .await
                .map_err(|_| tonic::Status::deadline_exceeded("no answer"))
                .and_then(|r| r)
        };
        let (first, api) = tokio::join!(first, interrupt);
        self.api = api?;
        // A refusal is an answer, not a cut: retried, it would read as
        // applied.
        if let Err(s) = &first {
            if matches!(
                s.code(),
                tonic::Code::InvalidArgument | tonic::Code::OutOfRange
            ) {
                return Err(Failure::Harness(format!(
                    "the write at {} was refused: {}",
                    self.next,
                    code(s)
                )));
            }
        }
        let answered = first.is_ok();
        if !answered {
            self.retry_write(req, 1, started, bound, invariant).await?;
        }
        self.applied.insert(self.next, row);
        self.next += 1;
        Ok(answered)
    }

    /// The request of write `t = next` and its row.
    fn next_write(&self) -> (proto::WriteInputRequest, Vec<i64>) {
        let t = self.next;
        let row = vec![t as i64, (t % 4) as i64];
        let req = proto::WriteInputRequest {
            replica: REPLICA.into(),
            collection_id: INPUT,
            updates: vec![wire::Update {
                row: lockstep_plan::row(&row),
                time: t,
                diff: 1,
            }],
            upper: t + 1,
        };
        (req, row)
    }

    /// Sends `req` until answered, within `bound` of `started`; `attempts`
    /// were sent before (then `OUT_OF_RANGE` means one of them applied).
    async fn retry_write(
        &self,
        req: proto::WriteInputRequest,
        mut attempts: u32,
        started: Instant,
        bound: Duration,
        invariant: &str,
    ) -> Result<(), Failure> {
        let t = req.updates[0].time;
        let mut last = String::from("no attempt");
        loop {
            if started.elapsed() >= bound {
                return Err(violation(
                    invariant,
                    format!(
                        "the write at {t} was not answered within {:.0} s: {last}",
                        bound.as_secs_f64()
                    ),
                ));
            }
            let answer = match self.api.client().await {
                Ok(mut c) => {
                    attempts += 1;
                    tokio::time::timeout(ATTEMPT, c.write_input(req.clone()))
                        .await
                        .map_err(|_| tonic::Status::deadline_exceeded("no answer"))
                        .and_then(|r| r)
                }
                Err(e) => {
                    last = e;
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            match answer {
                Ok(_) => return Ok(()),
                // An earlier attempt was applied (the first attempt's
                // OUT_OF_RANGE is a refusal: a harness error below).
                Err(s) if s.code() == tonic::Code::OutOfRange && attempts > 1 => return Ok(()),
                Err(s)
                    if matches!(
                        s.code(),
                        tonic::Code::InvalidArgument | tonic::Code::OutOfRange
                    ) =>
                {
                    return Err(Failure::Harness(format!(
                        "the write at {t} was refused: {}",
                        code(&s)
                    )))
                }
                Err(s) => last = code(&s),
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// The rows of `collection` at `t`, retried until answered within the
    /// time left before `deadline`.
    async fn peek_rows(
        &self,
        collection: u64,
        t: u64,
        deadline: Instant,
        invariant: &str,
    ) -> Result<BTreeMap<Vec<u8>, i64>, Failure> {
        let mut last = String::from("no attempt");
        loop {
            if Instant::now() >= deadline {
                return Err(violation(
                    invariant,
                    format!("a peek of {collection} at {t} was not answered in time: {last}"),
                ));
            }
            let req = proto::PeekRequest {
                replica: REPLICA.into(),
                collection_id: collection,
                timestamp: t,
            };
            let answer = match self.api.client().await {
                Ok(mut c) => tokio::time::timeout(ATTEMPT, c.peek(req))
                    .await
                    .map_err(|_| tonic::Status::deadline_exceeded("no answer"))
                    .and_then(|r| r),
                Err(e) => {
                    last = e;
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            match answer {
                Ok(rows) => {
                    let mut m = BTreeMap::new();
                    for r in rows.into_inner().rows {
                        *m.entry(r.values).or_insert(0) += r.diff;
                    }
                    m.retain(|_, d| *d != 0);
                    return Ok(m);
                }
                Err(s) if s.code() == tonic::Code::NotFound => {
                    return Err(violation(
                        "I3",
                        format!(
                            "a peek of the live collection {collection} answered NOT_FOUND: {}",
                            s.message()
                        ),
                    ))
                }
                Err(s) => last = code(&s),
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Peeks both exports at the newest write, answered within `bound`
    /// (else a violation of `invariant`), and checks them against the
    /// reference over every applied write (I3).
    pub async fn check(&self, bound: Duration, invariant: &str) -> Result<(), Failure> {
        let Some(t) = self.newest() else {
            return Ok(());
        };
        let deadline = Instant::now() + bound;
        for (collection, plan) in [
            (
                IDENTITY,
                Plan::Get {
                    collection_id: INPUT,
                },
            ),
            (REDUCE, reduce_plan()),
        ] {
            let got = self.peek_rows(collection, t, deadline, invariant).await?;
            let want = self.reference(&plan, t);
            if got != want {
                let show = |m: &BTreeMap<Vec<u8>, i64>| {
                    m.iter()
                        .map(|(r, d)| {
                            format!(
                                "{:?}x{d}",
                                lockstep_plan::rows::decode(r).unwrap_or_default()
                            )
                        })
                        .collect::<Vec<_>>()
                        .join(" ")
                };
                return Err(violation(
                    "I3",
                    format!(
                        "a peek of {collection} at {t} answered [{}]; the reference over the writes is [{}]",
                        show(&got),
                        show(&want)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Peeks the identity export at the newest write, one attempt each (a
    /// refusal is counted, not retried), each answer checked against the
    /// reference (I3), until `stop` says so.
    pub async fn read_steadily(&self, mut stop: tokio::sync::watch::Receiver<bool>) -> Reads {
        let mut reads = Reads::default();
        let Some(t) = self.newest() else {
            return reads;
        };
        let want = self.reference(
            &Plan::Get {
                collection_id: INPUT,
            },
            t,
        );
        while !*stop.borrow() {
            let req = proto::PeekRequest {
                replica: REPLICA.into(),
                collection_id: IDENTITY,
                timestamp: t,
            };
            let started = Instant::now();
            let answer = match self.api.client().await {
                Ok(mut c) => tokio::time::timeout(ATTEMPT, c.peek(req))
                    .await
                    .map_err(|_| tonic::Status::deadline_exceeded("no answer"))
                    .and_then(|r| r),
                Err(e) => Err(tonic::Status::unavailable(e)),
            };
            reads.longest = reads.longest.max(started.elapsed());
            match answer {
                Ok(rows) => {
                    reads.answered += 1;
                    let mut got = BTreeMap::new();
                    for r in rows.into_inner().rows {
                        *got.entry(r.values).or_insert(0) += r.diff;
                    }
                    got.retain(|_, d| *d != 0);
                    if got != want {
                        reads.wrong.push(format!(
                            "a peek of {IDENTITY} at {t}: {} rows, the reference {}",
                            got.len(),
                            want.len()
                        ));
                    }
                }
                Err(s) => *reads.refused.entry(code(&s)).or_default() += 1,
            }
            // A reader, not a flood: the next peek after 50 ms or the stop.
            let _ = tokio::time::timeout(Duration::from_millis(50), stop.changed()).await;
        }
        reads
    }

    /// `lockstep replica upgrade --keep-answering` (`RestartReplica` with
    /// `keep_answering`), one attempt answered within `bound`; a violation
    /// of I2 if it fails or is not answered.
    pub async fn upgrade_keep_answering(&self, bound: Duration) -> Result<(), Failure> {
        let req = proto::RestartReplicaRequest {
            name: REPLICA.into(),
            keep_answering: true,
        };
        self.replace(
            "replica upgrade --keep-answering",
            bound,
            |mut c| async move { c.restart_replica(req).await },
        )
        .await
    }

    /// `lockstep replica resize` to `processes` x `workers`
    /// (`ResizeReplica`), one attempt answered within `bound`; a violation
    /// of I2 if it fails or is not answered.
    pub async fn resize(
        &self,
        processes: u32,
        workers: u32,
        bound: Duration,
    ) -> Result<(), Failure> {
        let req = proto::ResizeReplicaRequest {
            name: REPLICA.into(),
            processes,
            workers_per_process: workers,
        };
        let what = format!("replica resize to {processes}x{workers}");
        self.replace(
            &what,
            bound,
            |mut c| async move { c.resize_replica(req).await },
        )
        .await
    }

    /// One call that replaces the replica's processes (`what`), answered
    /// within `bound`, else a violation of I2.
    async fn replace<F, Fut, R>(&self, what: &str, bound: Duration, call: F) -> Result<(), Failure>
    where
        F: FnOnce(Client) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let answer = match self.api.client().await {
            Ok(c) => tokio::time::timeout(bound, call(c))
                .await
                .map_err(|_| format!("not answered within {} s", bound.as_secs()))
                .and_then(|r| r.map_err(|s| code(&s))),
            Err(e) => Err(e),
        };
        answer
            .map(drop)
            .map_err(|e| violation("I2", format!("{what}: {e}")))
    }

    /// The reference's rows of `plan` at `t` over every applied write.
    fn reference(&self, plan: &Plan, t: u64) -> BTreeMap<Vec<u8>, i64> {
        lockstep_chaos::reference::rows_at(plan, INPUT, &self.applied, t)
    }

    /// A write, then both exports checked, within `bound` in all.
    pub async fn write_and_check(
        &mut self,
        bound: Duration,
        invariant: &str,
    ) -> Result<(), Failure> {
        let started = Instant::now();
        self.write(bound, invariant).await?;
        self.check(bound.saturating_sub(started.elapsed()), invariant)
            .await
    }
}
