//! The legitimate client: writes (each one's fate recorded) and peeks
//! checked against them, every call on a new connection with the token
//! (as a new client would come), each within its bound.
//!
//! Each write at time `t` inserts the one row `[t, t % 4]` and advances the
//! upper to `t + 1`, so a peek of the identity export tells exactly which
//! writes happened. A write is retried (the same request) until answered:
//! `OUT_OF_RANGE` after an attempt of unknown fate means that attempt was
//! applied (this client is the input's only writer). A peek at the newest
//! applied time must show every applied write exactly once and nothing
//! else (I3); the reduce export must equal the reference evaluation over
//! the same writes (I3). A call not answered within its bound
//! ([`OP_BOUND`], counted from the end of a process restart while one is
//! under way) is a violation of R1: a token holder was kept out.

use super::*;

use lockstep_plan::{Aggregate, Plan};
use lockstep_protocol::proto as wire;
use std::collections::BTreeMap;

/// The input collection.
pub(crate) const INPUT: u64 = 1;
/// The identity export, `get(1)`.
pub(crate) const IDENTITY: u64 = 101;
/// The reduce export: per `t % 4`, the count and the sum of `t`.
pub(crate) const REDUCE: u64 = 102;

/// The reduce export's plan.
pub(crate) fn reduce_plan() -> Plan {
    Plan::Reduce {
        input: Box::new(Plan::Get {
            collection_id: INPUT,
        }),
        key: vec![1],
        aggregates: vec![Aggregate::Count, Aggregate::Sum(0)],
    }
}

/// The dataflow the seed creates: both exports over the input.
pub(crate) fn create_request() -> proto::CreateDataflowRequest {
    let identity = Plan::Get {
        collection_id: INPUT,
    };
    proto::CreateDataflowRequest {
        replica: REPLICA.into(),
        name: "hostile".into(),
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
    }
}

/// The row write `t` inserts.
fn values(t: u64) -> Vec<i64> {
    vec![t as i64, (t % 4) as i64]
}

/// What one attempt of a call came to.
enum Attempt<T> {
    /// Answered.
    Answered(T),
    /// Answered with an error status.
    Status(tonic::Status),
    /// Not connected: nothing was sent.
    NotSent(String),
    /// Sent, no answer (within the attempt's bound, or the connection
    /// broke): its fate is unknown.
    Lost(String),
}

/// One attempt of `call` on a new token holder's connection, within `bound`.
async fn attempt<T, Fut>(api: &Api, bound: Duration, call: impl FnOnce(Client) -> Fut) -> Attempt<T>
where
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let started = Instant::now();
    let client = match api.client(bound).await {
        Ok(c) => c,
        Err(e) => return Attempt::NotSent(e),
    };
    let left = bound.saturating_sub(started.elapsed());
    match tokio::time::timeout(left, call(client)).await {
        Ok(Ok(r)) => Attempt::Answered(r.into_inner()),
        // Refused before it reached the service: nothing done.
        Ok(Err(s)) if s.code() == tonic::Code::Unavailable && s.message().contains("connect") => {
            Attempt::NotSent(code(&s))
        }
        Ok(Err(s)) => Attempt::Status(s),
        Err(_) => Attempt::Lost(format!("no answer within {left:?}")),
    }
}

/// The writes and what the peeks showed of them.
#[derive(Default)]
pub(crate) struct Model {
    /// Writes known applied (answered, or found so), by time: their rows.
    applied: BTreeMap<u64, Vec<i64>>,
    /// Writes of unknown fate, by time.
    unknown: BTreeMap<u64, Vec<i64>>,
    /// Writes of unknown fate a peek at or after their time did not show:
    /// they did not happen, and never may.
    absent: BTreeMap<u64, Vec<i64>>,
    /// The next write's time.
    next: u64,
    /// Writes answered.
    pub(crate) writes: usize,
    /// Peeks answered and checked.
    pub(crate) peeks: usize,
}

/// The legitimate client.
pub(crate) struct Workload {
    api: Api,
    shared: Arc<Shared>,
    /// Its record.
    pub(crate) model: Model,
}

impl Workload {
    /// A client of `api`, reporting to `shared`.
    pub(crate) fn new(api: Api, shared: Arc<Shared>) -> Workload {
        Workload {
            api,
            shared,
            model: Model::default(),
        }
    }

    /// The deadline of a call started at `started`: `bound` after it, or
    /// after the end of a process restart under way.
    fn deadline(&self, started: Instant, bound: Option<Duration>) -> Instant {
        match bound {
            // Setup: a fixed bound.
            Some(b) => started + b,
            None => self.shared.deadline(started),
        }
    }

    /// One write (`bound`: a fixed one, for the setup; else [`OP_BOUND`]
    /// with the restart allowance).
    pub(crate) async fn write(&mut self, bound: Option<Duration>) -> Result<(), Failure> {
        let started = Instant::now();
        let t = self.model.next;
        self.model.next += 1;
        let row = values(t);
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
        let mut sent = false;
        let mut last = String::from("no attempt");
        loop {
            let deadline = self.deadline(started, bound);
            let now = Instant::now();
            if now >= deadline || self.shared.stopped() {
                if sent {
                    self.model.unknown.insert(t, row);
                }
                if self.shared.stopped() && now < deadline {
                    return Ok(());
                }
                return Err(violation(
                    "R1",
                    format!(
                        "a write with the token (time {t}) was not answered within {:.1} s: {last}",
                        (now - started).as_secs_f64()
                    ),
                ));
            }
            let per = ATTEMPT.min(deadline - now);
            let r = req.clone();
            match attempt(
                &self.api,
                per,
                |mut c| async move { c.write_input(r).await },
            )
            .await
            {
                Attempt::Answered(_) => {
                    self.model.applied.insert(t, row);
                    self.model.writes += 1;
                    return Ok(());
                }
                Attempt::Status(s) if refused_token(&s) => {
                    return Err(violation(
                        "R1",
                        format!("a write with the token was refused: {}", code(&s)),
                    ));
                }
                Attempt::Status(s) if s.code() == tonic::Code::OutOfRange && sent => {
                    // An earlier attempt was applied.
                    self.model.applied.insert(t, row);
                    self.model.writes += 1;
                    return Ok(());
                }
                Attempt::Status(s) if not_transient(&s) => {
                    return Err(Failure::Harness(format!(
                        "a write at {t} was refused: {}",
                        code(&s)
                    )));
                }
                Attempt::Status(s) => {
                    sent = true;
                    last = code(&s);
                }
                Attempt::Lost(e) => {
                    sent = true;
                    last = e;
                }
                Attempt::NotSent(e) => last = e,
            }
            self.shared.pause(RETRY_PAUSE).await;
        }
    }

    /// One peek of `collection` at `t`: its rows (values, diff), or
    /// `None` if the seed stopped first.
    async fn peek_rows(
        &mut self,
        collection: u64,
        t: u64,
        bound: Option<Duration>,
    ) -> Result<Option<BTreeMap<Vec<u8>, i64>>, Failure> {
        let started = Instant::now();
        let mut last = String::from("no attempt");
        loop {
            let deadline = self.deadline(started, bound);
            let now = Instant::now();
            if self.shared.stopped() {
                return Ok(None);
            }
            if now >= deadline {
                return Err(violation(
                    "R1",
                    format!(
                        "a peek with the token (collection {collection} at {t}) was not answered within {:.1} s: {last}",
                        (now - started).as_secs_f64()
                    ),
                ));
            }
            let per = ATTEMPT.min(deadline - now);
            let req = proto::PeekRequest {
                replica: REPLICA.into(),
                collection_id: collection,
                timestamp: t,
            };
            match attempt(&self.api, per, |mut c| async move { c.peek(req).await }).await {
                Attempt::Answered(rows) => {
                    let mut m = BTreeMap::new();
                    for r in rows.rows {
                        *m.entry(r.values).or_insert(0) += r.diff;
                    }
                    m.retain(|_, d| *d != 0);
                    return Ok(Some(m));
                }
                Attempt::Status(s) if refused_token(&s) => {
                    return Err(violation(
                        "R1",
                        format!("a peek with the token was refused: {}", code(&s)),
                    ));
                }
                Attempt::Status(s) if s.code() == tonic::Code::NotFound => {
                    return Err(violation(
                        "I3",
                        format!(
                            "a peek of the live collection {collection} answered NOT_FOUND: {}",
                            s.message()
                        ),
                    ));
                }
                Attempt::Status(s) if not_transient(&s) => {
                    return Err(Failure::Harness(format!(
                        "a peek of {collection} at {t} was refused: {}",
                        code(&s)
                    )));
                }
                Attempt::Status(s) => last = code(&s),
                Attempt::Lost(e) | Attempt::NotSent(e) => last = e,
            }
            self.shared.pause(RETRY_PAUSE).await;
        }
    }

    /// Peeks both exports at the newest applied time and checks them (I3).
    pub(crate) async fn peek(&mut self, bound: Option<Duration>) -> Result<(), Failure> {
        let Some(&t) = self.model.applied.keys().next_back() else {
            return Ok(());
        };
        let Some(rows) = self.peek_rows(IDENTITY, t, bound).await? else {
            return Ok(());
        };
        // Which writes happened, by their rows.
        let mut seen = BTreeMap::new();
        for (bytes, diff) in &rows {
            let v = lockstep_plan::rows::decode(bytes).map_err(|e| {
                violation(
                    "I3",
                    format!("a peek at {t} answered a row that does not decode: {e}"),
                )
            })?;
            let time = v.first().copied().unwrap_or(-1);
            let written = u64::try_from(time).ok().filter(|w| {
                *w <= t
                    && (self.model.applied.get(w) == Some(&v)
                        || self.model.unknown.get(w) == Some(&v))
            });
            match written {
                Some(w) if *diff == 1 => {
                    seen.insert(w, v);
                }
                _ => {
                    return Err(violation(
                        "I3",
                        format!("a peek of get(1) at {t} answered the row {v:?} with multiplicity {diff}, which no write at or before {t} made"),
                    ))
                }
            }
        }
        let missing: Vec<u64> = self
            .model
            .applied
            .range(..=t)
            .map(|(w, _)| *w)
            .filter(|w| !seen.contains_key(w))
            .collect();
        if !missing.is_empty() {
            return Err(violation(
                "I3",
                format!(
                    "a peek of get(1) at {t} misses the acknowledged writes at {missing:?} ({} rows shown)",
                    seen.len()
                ),
            ));
        }
        // Unknown writes at or before `t` are settled now.
        let settled: Vec<u64> = self.model.unknown.range(..=t).map(|(w, _)| *w).collect();
        for w in settled {
            let row = self.model.unknown.remove(&w).expect("listed");
            if seen.contains_key(&w) {
                self.model.applied.insert(w, row);
            } else {
                self.model.absent.insert(w, row);
            }
        }
        // The reduce over exactly those writes.
        let Some(got) = self.peek_rows(REDUCE, t, bound).await? else {
            return Ok(());
        };
        let want =
            lockstep_chaos::reference::rows_at(&reduce_plan(), INPUT, &self.model.applied, t);
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
                    "a peek of the reduce at {t} answered [{}], the reference over the writes is [{}]",
                    show(&got),
                    show(&want)
                ),
            ));
        }
        self.model.peeks += 1;
        Ok(())
    }
}

/// A token holder's call refused for its credential.
fn refused_token(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
    )
}

/// A status no retry changes: the request itself was wrong (a harness
/// error).
fn not_transient(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::InvalidArgument | tonic::Code::AlreadyExists | tonic::Code::OutOfRange
    )
}
