//! Where a seed's environment runs besides its strategy, and the faults
//! only that place has: `STRATEGY@postgres` keeps the catalog and the
//! replica's command log in a throw-away PostgreSQL server (`lockstep serve
//! --store`), which [`Op::RestartStore`] restarts under it;
//! `STRATEGY@hosts` runs the replica's processes on two simulated hosts
//! (`lockstep serve --hosts 2`: network namespaces, root), whose links
//! [`Op::CutLink`] cuts. `STRATEGY+no-holds` is a negative control:
//! the environment compacts its inputs ignoring read holds (failpoint
//! `read_holds_off`), under a compaction lag drawn from the small ones.
//! `STRATEGY+reconfigure` draws resizes and upgrades that keep answering,
//! with faults part-way ([`Op::Reconfigure`], `reconfigure.rs`);
//! `STRATEGY+early-switch` is their negative control: reads go to the
//! standby before its lag closes (failpoint `reads_switch_early`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use lockstep_orchestrator::hosts::{Link, SimulatedHosts};
use lockstep_pgtest::PgServer;

use super::*;
use env::*;
use model::{Fate, Op, Rng, INPUTS};

/// A campaign variant: `STRATEGY`, `STRATEGY@postgres` or `STRATEGY@hosts`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Variant {
    /// The distribution policy's strategy (broadcast, barrier, log, naive).
    pub(super) strategy: String,
    /// Where the environment runs.
    pub(super) place: Place,
    /// The negative control of read holds (I5): compaction ignores them.
    pub(super) holds_off: bool,
    /// Resizes and upgrades that keep answering drawn among the operations
    /// ([`Op::Reconfigure`]).
    pub(super) reconfigure: bool,
    /// The negative control of reconfigurations (I6): reads switch to a
    /// standby before it has caught up. Implies `reconfigure`.
    pub(super) early_switch: bool,
}

/// A reconfiguring variant's failpoint: each standby's processes start
/// [`reconfigure::STANDBY_DELAY`] late.
macro_rules! standby_late {
    () => {
        "standby_failpoints=return(replica_start=sleep(3000))"
    };
}

/// Where a variant's environment runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// SQLite in the state directory, processes on this machine.
    Embedded,
    /// `--store`: a PostgreSQL database.
    Postgres,
    /// `--hosts 2`: simulated hosts.
    Hosts,
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.strategy)?;
        match self.place {
            Place::Embedded => Ok(()),
            Place::Postgres => f.write_str("@postgres"),
            Place::Hosts => f.write_str("@hosts"),
        }?;
        if self.holds_off {
            f.write_str("+no-holds")?;
        }
        if self.early_switch {
            f.write_str("+early-switch")?;
        } else if self.reconfigure {
            f.write_str("+reconfigure")?;
        }
        Ok(())
    }
}

impl Variant {
    /// Parses `STRATEGY[@postgres|@hosts][+no-holds][+reconfigure|+early-switch]`.
    pub(super) fn parse(s: &str) -> Result<Variant, String> {
        let (s, early_switch) = match s.strip_suffix("+early-switch") {
            Some(s) => (s, true),
            None => (s, false),
        };
        let (s, reconfigure) = match s.strip_suffix("+reconfigure") {
            Some(s) => (s, true),
            None => (s, early_switch),
        };
        let (s, holds_off) = match s.strip_suffix("+no-holds") {
            Some(s) => (s, true),
            None => (s, false),
        };
        let (strategy, place) = match s.split_once('@') {
            None => (s, Place::Embedded),
            Some((st, "postgres")) => (st, Place::Postgres),
            Some((st, "hosts")) => (st, Place::Hosts),
            Some((_, other)) => {
                return Err(format!(
                    "unknown variant suffix @{other} in {s:?} (known: @postgres, @hosts)"
                ))
            }
        };
        if !STRATEGIES.contains(&strategy) && strategy != "naive" {
            return Err(format!(
                "unknown strategy {strategy:?} (broadcast, barrier, log, naive)"
            ));
        }
        Ok(Variant {
            strategy: strategy.to_string(),
            place,
            holds_off,
            reconfigure,
            early_switch,
        })
    }

    /// Whether this is a negative control (naive delivery, compaction
    /// that ignores read holds, or reads switched to a standby early).
    pub(super) fn negative(&self) -> bool {
        self.strategy == "naive" || self.holds_off || self.early_switch
    }

    /// The failpoints of every environment this variant starts: a
    /// reconfiguring variant's standbys start
    /// [`reconfigure::STANDBY_DELAY`] late (`standby_failpoints`, the
    /// `FAILPOINTS` of a standby's processes).
    pub(super) fn failpoints(&self) -> Option<&'static str> {
        match (self.holds_off, self.reconfigure, self.early_switch) {
            (false, false, _) => None,
            (true, false, _) => Some("read_holds_off=return"),
            (true, true, _) => Some(concat!("read_holds_off=return;", standby_late!())),
            (false, true, false) => Some(standby_late!()),
            (false, true, true) => Some(concat!(standby_late!(), ";reads_switch_early=return")),
        }
    }

    /// The fault only this variant's place has, if any.
    pub(super) fn place_fault(&self) -> Option<Op> {
        match self.place {
            Place::Embedded => None,
            Place::Postgres => Some(Op::RestartStore),
            Place::Hosts => Some(Op::CutLink),
        }
    }
}

/// The throw-away PostgreSQL server the `@postgres` variants share: one
/// fresh database per seed run.
pub(super) struct Store {
    pg: Arc<Mutex<PgServer>>,
    databases: AtomicUsize,
}

impl Store {
    /// Starts the server.
    pub(super) fn start() -> Result<Store, String> {
        let pg = PgServer::start().map_err(|e| format!("starting PostgreSQL: {e}"))?;
        Ok(Store {
            pg: Arc::new(Mutex::new(pg)),
            databases: AtomicUsize::new(0),
        })
    }

    /// A fresh, empty database: the URL for `lockstep serve --store`.
    pub(super) fn new_database(&self) -> Result<SeedStore, String> {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let url = self
            .pg
            .lock()
            .expect("poisoned")
            .new_database(&format!("campaign_{n}"))
            .map_err(|e| format!("creating a database: {e}"))?;
        Ok(SeedStore {
            pg: self.pg.clone(),
            url,
        })
    }
}

/// One seed's database on the shared server.
pub(super) struct SeedStore {
    pg: Arc<Mutex<PgServer>>,
    /// `postgres://...`, for `--store`.
    pub(super) url: String,
}

/// The simulated hosts of a `@hosts` variant.
pub(super) const HOSTS: usize = 2;

impl Run {
    /// [`Op::RestartStore`]: a write in flight, PostgreSQL stopped
    /// (immediate mode: every connection cut, as a crash), down for a while,
    /// started again; the write's answer (or unknown fate) recorded.
    pub(super) async fn restart_store(&mut self, i: usize, r: &mut Rng) -> Result<(), Failure> {
        let Some(store) = &self.store else {
            self.world
                .log(format!("{i} restart the store: no store (embedded)"));
            return Ok(());
        };
        let pg = store.pg.clone();
        let down = Duration::from_millis(r.range(100, 2500));
        let input = INPUTS[r.below(3) as usize];
        let w = self.world.new_write(i, input, r);
        let mut client = self.client.clone();
        let request = write_request(&w);
        let write = tokio::spawn(async move { client.write_input(request).await });
        tokio::time::sleep(Duration::from_millis(r.below(30))).await;
        let stopped = {
            let pg = pg.clone();
            tokio::task::spawn_blocking(move || pg.lock().expect("poisoned").stop())
                .await
                .map_err(|e| Failure::Harness(format!("stopping PostgreSQL: {e}")))?
        };
        stopped.map_err(|e| Failure::Harness(format!("stopping PostgreSQL: {e}")))?;
        self.world.log(format!(
            "{i} restart PostgreSQL (down {} ms) with a write to {input} at {} in flight",
            down.as_millis(),
            w.time
        ));
        tokio::time::sleep(down).await;
        tokio::task::spawn_blocking(move || pg.lock().expect("poisoned").start_again())
            .await
            .map_err(|e| Failure::Harness(format!("starting PostgreSQL again: {e}")))?
            .map_err(|e| Failure::Harness(format!("starting PostgreSQL again: {e}")))?;
        match tokio::time::timeout(CALL, write).await {
            Ok(Ok(res)) => self.finish_write(i, w, res),
            _ => {
                self.world.log(format!(
                    "{i}  write to {input} at {} not answered: unknown",
                    w.time
                ));
                self.world.record_write(w, Fate::Unknown);
            }
        }
        Ok(())
    }

    /// [`Op::CutLink`]: one of a host's links (to the controller, or to the
    /// other hosts: the timely mesh) cut for a while, a write sent while it
    /// is cut, then healed. A cut is silence: nothing is reset.
    pub(super) async fn cut_link(&mut self, i: usize, r: &mut Rng) -> Result<(), Failure> {
        if self.place != Place::Hosts {
            self.world
                .log(format!("{i} cut a link: no simulated hosts"));
            return Ok(());
        }
        if self.hosts.is_none() {
            // The environment made them; this adopts them (by state dir).
            let dir = self
                .sandbox
                .path()
                .join(lockstep_environment::ORCHESTRATOR_DIR);
            let hosts = tokio::task::spawn_blocking(move || SimulatedHosts::create(&dir, HOSTS))
                .await
                .map_err(|e| Failure::Harness(format!("adopting the simulated hosts: {e}")))?
                .map_err(|e| Failure::Harness(format!("adopting the simulated hosts: {e}")))?;
            self.hosts = Some(hosts);
        }
        let hosts = self.hosts.as_ref().expect("set above");
        let k = r.below(HOSTS as u64) as usize;
        let link = if r.below(2) == 0 {
            Link::Control
        } else {
            Link::Mesh
        };
        let ms = r.range(300, 4000);
        hosts
            .set_link(k, link, false)
            .map_err(|e| Failure::Harness(format!("cutting host {k}'s {link:?} link: {e}")))?;
        self.world
            .log(format!("{i} cut host {k}'s {link:?} link for {ms} ms"));
        let input = INPUTS[r.below(3) as usize];
        let w = self.world.new_write(i, input, r);
        let res = tokio::time::timeout(
            Duration::from_millis(ms),
            self.client.write_input(write_request(&w)),
        )
        .await;
        let healed = |hosts: &SimulatedHosts| {
            hosts
                .set_link(k, link, true)
                .map_err(|e| Failure::Harness(format!("healing host {k}'s {link:?} link: {e}")))
        };
        match res {
            Ok(res) => {
                self.finish_write(i, w, res);
                tokio::time::sleep(Duration::from_millis(ms / 2)).await;
                healed(self.hosts.as_ref().expect("set above"))?;
            }
            Err(_) => {
                healed(self.hosts.as_ref().expect("set above"))?;
                self.world.log(format!(
                    "{i}  write to {input} at {} not answered while cut: unknown",
                    w.time
                ));
                self.world.record_write(w, Fate::Unknown);
            }
        }
        self.world
            .log(format!("{i}  healed host {k}'s {link:?} link"));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_reconfiguring_variant_delays_its_standbys_by_standby_delay() {
        let ms = super::reconfigure::STANDBY_DELAY.as_millis();
        assert!(standby_late!().ends_with(&format!("replica_start=sleep({ms}))")));
    }
}
