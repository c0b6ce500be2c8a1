//! The resumed subscription: a snapshot, a SIGKILL of the environment, a
//! write, then the subscription resumed after the snapshot's time
//! (`SubscribeRequest.resume`). What it read, consolidated, is recorded as
//! an answer at the newer time, which the reference checks like any peek:
//! a change missed or delivered twice shows as a wrong answer.

use super::*;
use env::write_request;
use model::{multiset, Rng};
use ops::read_through;

impl Run {
    /// Operation `i` on dataflow `k`.
    pub(super) async fn resume_subscribe(
        &mut self,
        i: usize,
        k: usize,
        r: &mut Rng,
    ) -> Result<(), Failure> {
        let d = self.world.dataflows[k].clone();
        let Some(t1) = self.world.read_time(&d.inputs) else {
            return Ok(());
        };
        let snapshot = match self.open_subscription(d.collection, t1, false).await {
            Ok(mut stream) => read_through(&mut stream, t1).await,
            Err(code) => {
                self.world.log(format!(
                    "{i} resumed subscribe {} at {t1}: {code}",
                    d.collection
                ));
                return Ok(());
            }
        };
        let Some(snapshot) = snapshot else {
            self.world.log(format!(
                "{i} resumed subscribe {} at {t1}: no complete snapshot within 10 s",
                d.collection
            ));
            return Ok(());
        };
        self.world.log(format!(
            "{i} resumed subscribe {} at {t1}: snapshot read; kill -9 environment",
            d.collection
        ));
        self.restart_env(None).await?;
        // A change after the snapshot, for the resumed part to carry.
        let input = d.inputs[r.below(d.inputs.len() as u64) as usize];
        let w = self.world.new_write(i, input, r);
        let res = self.client.write_input(write_request(&w)).await;
        self.finish_write(i, w, res);
        let Some(t2) = self.world.read_time(&d.inputs) else {
            return Ok(());
        };
        let resumed = match self.open_subscription(d.collection, t1, true).await {
            Ok(mut stream) => read_through(&mut stream, t2).await,
            Err(code) => {
                self.world.log(format!(
                    "{i} resumed subscribe {} after {t1}: {code}",
                    d.collection
                ));
                return Ok(());
            }
        };
        let Some(resumed) = resumed else {
            self.world.log(format!(
                "{i} resumed subscribe {} after {t1}: not through {t2} within 10 s",
                d.collection
            ));
            return Ok(());
        };
        let rows = multiset(snapshot.into_iter().chain(resumed));
        self.world.log(format!(
            "{i} resumed subscribe {} after {t1} through {t2}: {} rows",
            d.collection,
            rows.len()
        ));
        self.world.answers.push(model::Answer {
            op: i,
            how: "resumed subscribe",
            collection: d.collection,
            plan: d.plan,
            time: t2,
            rows,
        });
        Ok(())
    }

    /// Opens a subscription to `collection` as of `as_of` (resuming after
    /// it if `resume`); the status code's name if refused.
    async fn open_subscription(
        &mut self,
        collection: u64,
        as_of: u64,
        resume: bool,
    ) -> Result<tonic::Streaming<wire::SubscribeResponse>, String> {
        self.client
            .subscribe(proto::SubscribeRequest {
                replica: REPLICA.into(),
                collection_id: collection,
                as_of,
                resume,
            })
            .await
            .map(|s| s.into_inner())
            .map_err(|s| format!("{:?}", s.code()))
    }
}
