//! The compute model's properties: quietness, invariants I1 and I4, and
//! liveness (I2) by a fault-free search with a shared cache.

use std::collections::{BTreeSet, HashSet};

use lockstep_reconcile::{
    lockstep_check, lockstep_prefix_check, CreationEntry, DataflowKey, Phase,
};
use stateright::Model;

use super::state::{fingerprint, ComputeState};
use super::ComputeModel;

impl ComputeModel {
    /// The replica is quiet (see the module docs).
    pub fn quiet(&self, s: &ComputeState) -> bool {
        s.ctl.up
            && s.ctl.machine.phase() == Phase::Serving
            && s.channels.iter().all(|c| c.is_empty())
            && s.workers.iter().all(|w| {
                w.settled_in(s.ctl.session)
                    && w.cursor == s.sequenced.len()
                    && (!self.tails_log() || w.log_position() == s.stream.len())
            })
    }

    fn logs(s: &ComputeState) -> Vec<Vec<CreationEntry>> {
        s.workers.iter().map(|w| w.log.clone()).collect()
    }

    /// I1 at this state: `Err` says what diverged.
    pub fn check_i1(&self, s: &ComputeState) -> Result<(), String> {
        let logs = Self::logs(s);
        lockstep_prefix_check(&logs).map_err(|d| d.to_string())?;
        if self.quiet(s) {
            lockstep_check(&logs).map_err(|d| format!("{d} (replica quiet)"))?;
        }
        Ok(())
    }

    /// I4 at this state: `Err` names a dataflow installed on some workers only.
    pub fn check_i4(&self, s: &ComputeState) -> Result<(), String> {
        if !self.quiet(s) {
            return Ok(());
        }
        let sets: Vec<BTreeSet<(u64, DataflowKey)>> = s
            .workers
            .iter()
            .map(|w| w.installed.iter().copied().collect())
            .collect();
        for (w, set) in sets.iter().enumerate().skip(1) {
            if let Some((idx, k)) = set.symmetric_difference(&sets[0]).next() {
                let (on, off) = if sets[0].contains(&(*idx, *k)) {
                    (0, w)
                } else {
                    (w, 0)
                };
                return Err(format!(
                    "I4 broken: dataflow {} built at timely index {idx} runs on worker {on} but not on worker {off} (replica quiet)",
                    self.label(k)
                ));
            }
        }
        Ok(())
    }

    /// Under alternating strategies (`log-then-barrier`): no session
    /// machine halted for lost lockstep. `Err` names the first that did.
    pub fn check_no_halt(&self, s: &ComputeState) -> Result<(), String> {
        match s.workers.iter().position(|w| w.machine.halted()) {
            Some(w) => Err(format!(
                "worker {w} lost lockstep and halted (LOCKSTEP_LOST): its session machine could not prove lockstep"
            )),
            None => Ok(()),
        }
    }

    /// The target: quiet, lockstep, every worker runs exactly the catalog.
    pub fn done(&self, s: &ComputeState) -> bool {
        if !self.quiet(s) || self.check_i1(s).is_err() || self.check_i4(s).is_err() {
            return false;
        }
        let want: BTreeSet<DataflowKey> = s.ctl.catalog.iter().copied().collect();
        s.workers.iter().all(|w| {
            w.installed.len() == want.len() && w.keys().into_iter().collect::<BTreeSet<_>>() == want
        })
    }

    /// Whether the target is reachable from `s` with no fault and no new
    /// user command (an exhaustive search over those successors).
    pub fn target_reachable(&self, s: &ComputeState) -> bool {
        if let Some(known) = self.known(s) {
            return known;
        }
        let mut stack = vec![s.clone()];
        let mut seen: HashSet<ComputeState> = HashSet::new();
        let mut actions = Vec::new();
        while let Some(st) = stack.pop() {
            match self.known(&st) {
                Some(true) => {
                    self.remember(s, true);
                    return true;
                }
                Some(false) => continue,
                None => {}
            }
            if self.done(&st) {
                self.remember(s, true);
                return true;
            }
            if !seen.insert(st.clone()) {
                continue;
            }
            actions.clear();
            self.actions(&st, &mut actions);
            for a in actions.drain(..).rev() {
                if a.is_fault_or_user() {
                    continue;
                }
                if let Some(next) = self.next_state(&st, a) {
                    stack.push(next);
                }
            }
        }
        // The search was exhaustive: no state it saw reaches the target.
        let mut memo = self.reachable.lock().expect("liveness cache poisoned");
        for st in seen {
            memo.insert(fingerprint(&st), false);
        }
        false
    }

    fn known(&self, s: &ComputeState) -> Option<bool> {
        self.reachable
            .lock()
            .expect("liveness cache poisoned")
            .get(&fingerprint(s))
            .copied()
    }

    fn remember(&self, s: &ComputeState, reachable: bool) {
        self.reachable
            .lock()
            .expect("liveness cache poisoned")
            .insert(fingerprint(s), reachable);
    }
}
