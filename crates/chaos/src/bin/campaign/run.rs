//! A seed's run: its setup, the I1 check on the environment's log after every
//! operation, environment restarts and the resolution of creates and drops
//! of unknown fate.

use super::*;
use env::*;
use model::{identity_collection, Fate, Rng, INPUTS};

impl Run {
    pub(super) async fn setup(
        seed: u64,
        variant: &Variant,
        store: Option<&Store>,
        processes: u32,
        workers: u32,
    ) -> Result<Run, Failure> {
        let strategy = variant.strategy.as_str();
        let sandbox = Sandbox::new().map_err(|e| format!("sandbox: {e:#}"))?;
        let (store, mut serve_args) = match variant.place {
            Place::Embedded => (None, Vec::new()),
            Place::Postgres => {
                let store = store
                    .ok_or_else(|| Failure::Harness("no PostgreSQL server".into()))?
                    .new_database()?;
                let args = vec!["--store".to_string(), store.url.clone()];
                (Some(store), args)
            }
            Place::Hosts => (None, vec!["--hosts".into(), variant::HOSTS.to_string()]),
        };
        let lag = model::compaction_lag(seed, variant.holds_off);
        if let Some(lag) = lag {
            serve_args.extend(["--compaction-lag".to_string(), lag.to_string()]);
        }
        let env = Env::start(
            sandbox.path(),
            strategy == "naive",
            &serve_args,
            variant.failpoints(),
        )
        .await?;
        let client = env.client().await?;
        let mut run = Run {
            seed,
            strategy: strategy.to_string(),
            place: variant.place,
            serve_args,
            store,
            hosts: None,
            processes,
            sandbox,
            env,
            client,
            world: World::new(),
            faults: 0,
            crashed_for: None,
            log_read: 0,
            partial_drops: 0,
            failpoints: variant.failpoints(),
            reads_switch_early: variant.early_switch,
            follows: Vec::new(),
        };
        run.set_policy(strategy)
            .await
            .map_err(|e| Failure::Harness(format!("setting the policy {strategy}: {e}")))?;
        run.client
            .create_replica(proto::CreateReplicaRequest {
                name: REPLICA.into(),
                processes,
                workers_per_process: workers,
                config: String::new(),
            })
            .await
            .map_err(|e| format!("creating the replica: {}", code(&e)))?;
        run.world.log(format!(
            "setup: replica {processes}x{workers}, policy {strategy}, {variant}, compaction lag {}",
            lag.map_or("none".to_string(), |l| l.to_string())
        ));
        // The identity dataflows, and a first write to every input.
        for k in INPUTS {
            let text = format!("get({k})");
            let plan = model::parse(&text)?;
            let mut d = model::DataflowRec {
                collection: identity_collection(k),
                text,
                plan,
                inputs: vec![k],
                id: None,
                live: true,
                unknown: false,
                identity: true,
            };
            let created = run
                .client
                .create_dataflow(create_request(&d))
                .await
                .map_err(|e| format!("creating the identity dataflow of {k}: {}", code(&e)))?;
            d.id = created.into_inner().dataflow.map(|d| d.id);
            run.world.dataflows.push(d);
            let mut r = Rng::new(seed ^ k);
            let w = run.world.new_write(usize::MAX, k, &mut r);
            run.client
                .write_input(write_request(&w))
                .await
                .map_err(|e| format!("the first write to {k}: {}", code(&e)))?;
            run.world.record_write(w, Fate::Acked);
        }
        run.open_follows().await?;
        Ok(run)
    }

    /// I1 at every connection: the environment's controller compares every
    /// worker's creation log and installed dataflows each time it connects
    /// (after every environment restart and every replica reconnect) and
    /// logs [`DISAGREEMENT`] on a difference, saying whether the creation
    /// logs differ. It then repairs it, but workers whose creation logs
    /// differ did build different dataflows: a violation of I1, whatever
    /// came after. Installed sets that differ alone (a drop that reached some
    /// processes before the controller crashed, which `barrier` leaves to the
    /// collective reconciliation) are counted, and must be gone by the end
    /// (the final checks). Reads what the environment logged since the last
    /// call.
    pub(super) fn workers_agreed(&mut self, i: usize) -> Result<(), Failure> {
        // Only what was logged since the last call: the log grows with the
        // run, and this runs after every operation.
        let mut new = Vec::new();
        (|| -> std::io::Result<()> {
            use std::io::{Read, Seek, SeekFrom};
            let mut f = std::fs::File::open(self.sandbox.path().join("campaign-env.stderr"))?;
            f.seek(SeekFrom::Start(self.log_read as u64))?;
            f.read_to_end(&mut new)?;
            Ok(())
        })()
        .map_err(|e| Failure::Harness(format!("reading the environment's log: {e}")))?;
        // Whole lines only: the environment may be writing the next one.
        let whole = new.iter().rposition(|b| *b == b'\n').map_or(0, |k| k + 1);
        self.log_read += whole;
        let new = String::from_utf8_lossy(&new[..whole]);
        for line in new.lines().filter(|l| l.contains(DISAGREEMENT)) {
            // The environment logs JSON (LOCKSTEP_LOG_FORMAT=json): the
            // history check's finding is a field, not text to match.
            let parsed: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                Failure::Harness(format!(
                    "a log line of the environment is not JSON ({e}): {line}"
                ))
            })?;
            if parsed["message"] != DISAGREEMENT_MESSAGE {
                continue;
            }
            let creation_logs = parsed["creation_logs"].as_str().unwrap_or("");
            if !matches!(creation_logs, "same" | "differ") {
                return Err(Failure::Harness(format!(
                    "the history check's line says neither creation_logs=same nor differ: {line}"
                )));
            }
            if creation_logs == "same" {
                self.partial_drops += 1;
                // Each fault leaves at most one command applied by some
                // processes only, which the next connection repairs. More
                // mismatches than faults: a repair did not take (I4).
                if self.partial_drops > self.faults {
                    return Err(violation(
                        "I4",
                        format!(
                            "by operation {i}, {} history checks found installed sets that differ after {} faults: a collective reconciliation did not repair what a fault left: {line}",
                            self.partial_drops, self.faults
                        ),
                    ));
                }
                continue;
            }
            return Err(violation(
                "I1",
                format!(
                    "by operation {i}, the history check on a connection found workers that built different dataflows: {line}"
                ),
            ));
        }
        Ok(())
    }

    pub(super) async fn set_policy(&mut self, strategy: &str) -> Result<(), String> {
        let file = policy_file(strategy);
        let wasm = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        self.client
            .set_policy(proto::SetPolicyRequest {
                name: strategy.into(),
                wasm,
                replica: String::new(),
            })
            .await
            .map_err(|e| code(&e))?;
        Ok(())
    }

    pub(super) async fn pids(&mut self) -> Result<Vec<u32>, String> {
        let r = self
            .client
            .list_replicas(proto::ListReplicasRequest::default())
            .await
            .map_err(|e| code(&e))?
            .into_inner();
        Ok(r.replicas
            .iter()
            .find(|r| r.name == REPLICA)
            .map(|r| r.process_status.iter().map(|p| p.pid).collect())
            .unwrap_or_default())
    }

    /// kill -9 the environment (it must be gone), then start it again on
    /// the same state directory, and resolve what the catalog holds.
    pub(super) async fn restart_env(&mut self, failpoints: Option<&str>) -> Result<(), Failure> {
        self.crashed_for = None;
        self.env.kill().await;
        let failpoints = match (self.failpoints, failpoints) {
            (Some(a), Some(b)) => Some(format!("{a};{b}")),
            (a, b) => a.or(b).map(str::to_string),
        };
        self.env = Env::start(
            self.sandbox.path(),
            self.strategy == "naive",
            &self.serve_args,
            failpoints.as_deref(),
        )
        .await?;
        self.client = self.env.client().await?;
        self.resume_follows().await?;
        if failpoints.is_none_or(|f| Some(f.as_str()) == self.failpoints) {
            self.resolve_dataflows().await?;
        }
        Ok(())
    }

    /// Resolves creates and drops of unknown fate from the catalog.
    pub(super) async fn resolve_dataflows(&mut self) -> Result<(), Failure> {
        if !self.world.dataflows.iter().any(|d| d.unknown) {
            return Ok(());
        }
        let mut listed = std::collections::BTreeMap::new();
        let mut token = String::new();
        loop {
            let page = self
                .client
                .list_dataflows(proto::ListDataflowsRequest {
                    page_size: 1000,
                    page_token: token.clone(),
                })
                .await
                .map_err(|e| format!("listing dataflows: {}", code(&e)))?
                .into_inner();
            for e in page.dataflows {
                if let Some(d) = e.dataflow {
                    for x in &d.exports {
                        listed.insert(x.collection_id, d.id);
                    }
                }
            }
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        let mut lines = Vec::new();
        for d in self.world.dataflows.iter_mut().filter(|d| d.unknown) {
            d.unknown = false;
            match listed.get(&d.collection) {
                Some(id) => {
                    d.live = true;
                    d.id = Some(*id);
                }
                None => d.live = false,
            }
            lines.push(format!(
                "  resolved: dataflow {} ({}) is {}",
                d.collection,
                d.text,
                if d.live { "live" } else { "absent" }
            ));
        }
        self.world.history.extend(lines);
        Ok(())
    }
}
