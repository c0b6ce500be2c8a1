//! Subscriptions that follow an input for the whole seed: one per input's
//! identity dataflow, opened at setup and read in the background through
//! every fault (process kills, SIGSTOPs, replica restarts, environment
//! kills: then resumed after the last time fully received, as `lockstep
//! subscribe --resume` does). At the end, the stream is checked against the
//! reference at every upper it reported: the accumulation of its updates at
//! or before `upper - 1` must be the collection at that time. A change
//! missed or delivered twice (a replica rebuilt from inputs compacted past
//! the stream, I5) shows as a wrong accumulation. A stream may end with
//! OUT_OF_RANGE (a read hold that could not be kept): only what it carried
//! before is checked.

use std::sync::{Arc, Mutex};

use super::*;
use env::code;
use lockstep_plan::reference::Multiset;

/// What a following subscription received, shared with its reader task.
#[derive(Default)]
struct Received {
    /// Every update, with its time.
    updates: Vec<(lockstep_protocol::Row, u64, i64)>,
    /// The uppers of the batches, in order (`None`: the empty frontier).
    uppers: Vec<Option<u64>>,
    /// How the stream ended, if it did.
    ended: Option<tonic::Status>,
}

impl Received {
    /// The last time every update of which was received.
    fn through(&self) -> Option<u64> {
        self.uppers.iter().rev().find_map(|u| *u)?.checked_sub(1)
    }
}

/// One following subscription.
pub(super) struct Follow {
    /// The dataflow (an index into the world's dataflows).
    dataflow: usize,
    as_of: u64,
    received: Arc<Mutex<Received>>,
    reader: Option<tokio::task::JoinHandle<()>>,
    /// Ended for good (refused when resumed, or OUT_OF_RANGE): not resumed.
    done: bool,
}

impl Drop for Follow {
    fn drop(&mut self) {
        if let Some(r) = self.reader.take() {
            r.abort();
        }
    }
}

impl Run {
    /// Opens a following subscription on every identity dataflow, as of the
    /// newest readable time.
    pub(super) async fn open_follows(&mut self) -> Result<(), Failure> {
        for k in 0..self.world.dataflows.len() {
            let d = self.world.dataflows[k].clone();
            if !d.identity {
                continue;
            }
            let as_of = self.world.read_time(&d.inputs).unwrap_or(0);
            let mut follow = Follow {
                dataflow: k,
                as_of,
                received: Arc::default(),
                reader: None,
                done: false,
            };
            self.start_reader(&mut follow, as_of, false)
                .await
                .map_err(|s| {
                    Failure::Harness(format!(
                        "following subscription to {} as of {as_of}: {}",
                        d.collection,
                        code(&s)
                    ))
                })?;
            self.world.log(format!(
                "setup: following subscription to {} as of {as_of}",
                d.collection
            ));
            self.follows.push(follow);
        }
        Ok(())
    }

    /// Subscribes and starts the task reading the stream into `follow`.
    async fn start_reader(
        &mut self,
        follow: &mut Follow,
        as_of: u64,
        resume: bool,
    ) -> Result<(), tonic::Status> {
        let collection = self.world.dataflows[follow.dataflow].collection;
        let mut stream = self
            .client
            .subscribe(proto::SubscribeRequest {
                replica: REPLICA.into(),
                collection_id: collection,
                as_of,
                resume,
            })
            .await?
            .into_inner();
        let received = follow.received.clone();
        follow.reader = Some(tokio::spawn(async move {
            loop {
                let next = stream.next().await;
                let mut r = received.lock().expect("poisoned");
                match next {
                    Some(Ok(batch)) => {
                        r.updates
                            .extend(batch.updates.into_iter().map(|u| (u.row, u.time, u.diff)));
                        r.uppers.push(batch.upper.first().copied());
                        if batch.upper.is_empty() {
                            return;
                        }
                    }
                    Some(Err(status)) => {
                        r.ended = Some(status);
                        return;
                    }
                    None => {
                        r.ended = Some(tonic::Status::unavailable("the stream ended early"));
                        return;
                    }
                }
            }
        }));
        Ok(())
    }

    /// After the environment was killed and started again: resumes every
    /// following subscription after the last time it fully received (or
    /// from its start if it received nothing).
    pub(super) async fn resume_follows(&mut self) -> Result<(), Failure> {
        let mut follows = std::mem::take(&mut self.follows);
        for f in follows.iter_mut().filter(|f| !f.done) {
            if let Some(r) = f.reader.take() {
                r.abort();
            }
            let (ended, through) = {
                let r = f.received.lock().expect("poisoned");
                (r.ended.clone(), r.through())
            };
            let collection = self.world.dataflows[f.dataflow].collection;
            if let Some(s) = ended.filter(|s| !resumable(s)) {
                self.world.log(format!(
                    "  following subscription to {collection} ended: {}",
                    code(&s)
                ));
                f.done = true;
                continue;
            }
            let (as_of, resume) = match through {
                Some(t) => (t, true),
                None => (f.as_of, false),
            };
            f.received.lock().expect("poisoned").ended = None;
            match self.start_reader(f, as_of, resume).await {
                Ok(()) => self.world.log(format!(
                    "  following subscription to {collection} resumed after {as_of}"
                )),
                Err(s) => {
                    self.world.log(format!(
                        "  following subscription to {collection} not resumed after {as_of}: {}",
                        code(&s)
                    ));
                    f.received.lock().expect("poisoned").ended = Some(s);
                    f.done = true;
                }
            }
        }
        self.follows = follows;
        Ok(())
    }

    /// After the final reads (every write's fate resolved): each following
    /// subscription reaches the final time of its input (unless it ended
    /// with OUT_OF_RANGE or was refused on resume) within [`RECOVERY`] (I2),
    /// and at every upper it reported, its accumulation equals the
    /// reference (I3, I5).
    pub(super) async fn check_follows(&mut self) -> Result<(), Failure> {
        for f in &self.follows {
            let d = self.world.dataflows[f.dataflow].clone();
            let Some(last) = self.world.read_time(&d.inputs) else {
                continue;
            };
            let deadline = Instant::now() + RECOVERY;
            loop {
                let (through, ended) = {
                    let r = f.received.lock().expect("poisoned");
                    (r.through(), r.ended.clone())
                };
                if through.is_some_and(|t| t >= last) {
                    break;
                }
                if let Some(s) = ended {
                    if s.code() != tonic::Code::OutOfRange && !f.done {
                        return Err(violation(
                            "I2",
                            format!(
                                "the following subscription to {} ended before time {last}: {}",
                                d.collection,
                                code(&s)
                            ),
                        ));
                    }
                    self.world.log(format!(
                        "  following subscription to {} ended at {through:?}: {}",
                        d.collection,
                        code(&s)
                    ));
                    break;
                }
                if Instant::now() > deadline {
                    return Err(violation(
                        "I2",
                        format!(
                            "the following subscription to {} did not pass time {last} within {RECOVERY:?} of the final reads (through {through:?})",
                            d.collection
                        ),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let r = f.received.lock().expect("poisoned");
            let mut updates = r.updates.clone();
            updates.sort_by_key(|u| u.1);
            let mut acc = Multiset::new();
            let mut next = 0;
            let mut checked = 0;
            for upper in r.uppers.iter().flatten() {
                let Some(t) = upper.checked_sub(1).filter(|t| *t >= f.as_of && *t <= last) else {
                    continue;
                };
                while next < updates.len() && updates[next].1 <= t {
                    let (row, _, diff) = &updates[next];
                    *acc.entry(row.clone()).or_insert(0) += diff;
                    next += 1;
                }
                acc.retain(|_, d| *d != 0);
                let want = self.world.reference(&d.plan, t);
                if acc != want {
                    return Err(violation(
                        "I3",
                        format!(
                            "the following subscription to {} ({}) as of {}, accumulated at {t}: {}",
                            d.collection,
                            d.text,
                            f.as_of,
                            model::diff(&acc, &want)
                        ),
                    ));
                }
                checked += 1;
            }
            self.world.log(format!(
                "  following subscription to {}: exact at {checked} uppers through {:?}",
                d.collection,
                r.through()
            ));
        }
        Ok(())
    }
}

/// Whether a subscription that failed may be resumed: the server or the
/// connection went away, not a refusal.
fn resumable(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}
