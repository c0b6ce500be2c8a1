//! The resumed subscription: a snapshot, a SIGKILL of the environment, a
//! write, then the subscription resumed after the snapshot's time
//! (`SubscribeRequest.resume`). What it read, consolidated, is recorded as
//! an answer at the newer time, which the reference checks like any peek:
//! a change missed or delivered twice shows as a wrong answer.

use super::*;
use env::write_request;
use model::{multiset, Rng};

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
        let how = "resumed subscribe";
        let Some(snapshot) = self.read_subscription(i, how, &d, t1, false, t1).await else {
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
        let Some(resumed) = self.read_subscription(i, how, &d, t1, true, t2).await else {
            return Ok(());
        };
        let rows = multiset(snapshot.into_iter().chain(resumed));
        self.world.answer(i, how, &d, t2, rows);
        Ok(())
    }
}
