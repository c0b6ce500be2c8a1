//! Policies swapped at run time (`SetPolicy`, `lockstep policy set FILE`).
//!
//! A WASM policy sent to a running environment must first pass the
//! conformance scenarios of its kind (`lockstep_policy_host::conformance`);
//! it is then stored in the catalog (fenced, so a restarted environment uses
//! it), written to `STATE_DIR/policies/KIND.wasm`, and put in force: a
//! distribution policy for every replica's controller from its next session
//! on (the environment starts one at once; a session's strategy is chosen at
//! its Hello, so dataflows are reconciled, not rebuilt), an orphan policy
//! from the next orphan pass. A policy set at run time stays in force across
//! restarts, over `--distribution-policy` and `--orphan-rule/--orphan-policy`,
//! until another is set.
//!
//! A distribution policy can also be set on one replica
//! (`lockstep policy set --replica NAME`): stored with the replica in the
//! catalog (`replica_policies`, schema version 3), written to
//! `STATE_DIR/policies/distribution-replica-ID.wasm`, in force on that
//! replica alone over the environment-wide one (which no longer reaches it),
//! kept across restarts, and gone with the replica.

use std::path::{Path, PathBuf};

use lockstep_catalog::StoredPolicy;
use lockstep_policy_host::PolicyKind;

use crate::compute::ComputeError;
use crate::{EnvError, Environment};

/// A policy in force, as `ListPolicies` and `lockstep policy show` report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyInForce {
    /// `distribution` or `orphans`.
    pub kind: String,
    /// Its name (`native barrier` for a native rule).
    pub name: String,
    /// The first 16 hex digits of the BLAKE3 hash of the component (empty
    /// for a native rule).
    pub hash: String,
    /// When it was put in force, in seconds since the Unix epoch.
    pub since: u64,
    /// The replica it is in force on alone (over the environment-wide one
    /// of its kind), or `None` for the whole environment.
    pub replica: Option<String>,
}

/// The kind's name.
pub fn kind_name(kind: PolicyKind) -> &'static str {
    match kind {
        PolicyKind::Distribution => "distribution",
        PolicyKind::Orphans => "orphans",
    }
}

/// The short hash of a component.
pub fn short_hash(wasm: &[u8]) -> String {
    blake3::hash(wasm).to_hex()[..16].to_string()
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Where a kind's policy file lives.
fn file_of(dir: &Path, kind: &str) -> PathBuf {
    dir.join(format!("{kind}.wasm"))
}

/// Where a replica's own policy of a kind lives.
fn replica_file_of(dir: &Path, kind: &str, replica_id: u64) -> PathBuf {
    dir.join(format!("{kind}-replica-{replica_id}.wasm"))
}

impl Environment {
    /// Checks, stores and puts in force the WASM policy `wasm` named `name`
    /// for the whole environment.
    pub async fn set_policy(
        &self,
        name: &str,
        wasm: Vec<u8>,
    ) -> Result<PolicyInForce, ComputeError> {
        self.set_policy_on(None, name, wasm).await
    }

    /// [`set_policy`](Self::set_policy), on replica `replica` alone when it
    /// is given (a distribution policy only: orphan removal is
    /// environment-wide). A replica's own policy is stored with it in the
    /// catalog, is in force over the environment-wide one, and goes when
    /// the replica is dropped.
    pub async fn set_policy_on(
        &self,
        replica: Option<&str>,
        name: &str,
        wasm: Vec<u8>,
    ) -> Result<PolicyInForce, ComputeError> {
        let _ops = self.ops.lock().await;
        self.check_not_halted()?;
        let replica = match replica {
            None => None,
            Some(r) => Some(self.replica_named(r)?),
        };
        let dir = self.policies_dir.clone().ok_or_else(|| {
            ComputeError::Unavailable("this environment has no state directory for policies".into())
        })?;
        if name.is_empty()
            || name.len() > 63
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(ComputeError::Invalid(
                "a policy name has 1 to 63 of a-z, A-Z, 0-9, '-' and '_'".into(),
            ));
        }
        if wasm.len() > MAX_POLICY_BYTES {
            return Err(ComputeError::Invalid(format!(
                "a policy has at most {MAX_POLICY_BYTES} bytes; this one has {}",
                wasm.len()
            )));
        }
        std::fs::create_dir_all(&dir)
            .map_err(|e| ComputeError::Unavailable(format!("{}: {e}", dir.display())))?;
        // Checked from a file named after it (the conformance line names it).
        let staging = tempfile::Builder::new()
            .prefix(".staging-")
            .tempdir_in(&dir)
            .map_err(|e| ComputeError::Unavailable(e.to_string()))?;
        let candidate = staging.path().join(format!("{name}.wasm"));
        std::fs::write(&candidate, &wasm).map_err(|e| ComputeError::Unavailable(e.to_string()))?;
        let kind = lockstep_policy_host::detect_kind(&candidate)
            .map_err(|e| ComputeError::Invalid(format!("not a lockstep policy: {e}")))?;
        let lines = lockstep_policy_host::conformance::check(&candidate)
            .map_err(|e| ComputeError::Invalid(format!("the policy does not load: {e}")))?;
        if let Some(bad) = lines.iter().find(|l| !l.ok()) {
            return Err(ComputeError::Invalid(format!(
                "the policy fails its conformance scenarios: {}",
                lockstep_policy_host::conformance::report(std::slice::from_ref(bad)).trim()
            )));
        }
        if replica.is_some() && kind != PolicyKind::Distribution {
            return Err(ComputeError::Invalid(format!(
                "a {} policy is environment-wide; only a distribution policy can be set per replica",
                kind_name(kind)
            )));
        }
        let stored = StoredPolicy {
            kind: kind_name(kind).to_string(),
            name: name.to_string(),
            wasm,
            set_at: now(),
        };
        {
            let mut catalog = self.catalog.lock().expect("poisoned");
            match &replica {
                None => catalog.set_policy(&stored),
                Some(r) => catalog.set_replica_policy(r.id, &stored),
            }
            .map_err(|e| ComputeError::Env(self.catalog_error(e)))?;
        }
        let in_force = match &replica {
            None => self.put_in_force(&dir, &stored),
            Some(r) => self.put_in_force_on(&dir, r.id, &r.name, &stored),
        }
        .map_err(ComputeError::Env)?;
        tracing::info!(kind = %in_force.kind, name = %in_force.name, hash = %in_force.hash, "policy set");
        Ok(in_force)
    }

    /// Writes `stored` to its file and puts it in force.
    fn put_in_force(&self, dir: &Path, stored: &StoredPolicy) -> Result<PolicyInForce, EnvError> {
        let path = file_of(dir, &stored.kind);
        let io = |e: std::io::Error| EnvError::Orchestrator(format!("{}: {e}", path.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        let tmp = path.with_extension("wasm.tmp");
        std::fs::write(&tmp, &stored.wasm).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        if stored.kind == "distribution" {
            self.compute.set_distribution_policy(Some(path.clone()));
            let ids: Vec<u64> = self
                .view
                .lock()
                .expect("poisoned")
                .replicas
                .keys()
                .copied()
                .collect();
            for id in ids {
                // A replica with its own policy keeps it.
                if self.compute.has_replica_policy(id) {
                    continue;
                }
                for c in self.compute.mutated(id) {
                    // From the next session on, which starts now.
                    let _ = c.set_policy(self.compute.policy_for(id));
                    let _ = c.reconnect();
                }
            }
        } else {
            let policy = lockstep_policy_host::WasmOrphanPolicy::load(&path, Default::default())
                .map_err(|e| EnvError::Orchestrator(format!("loading {}: {e}", path.display())))?;
            *self.policy.lock().expect("poisoned") =
                Box::new(lockstep_policy_host::SafeOrphans::new(policy));
        }
        let in_force = PolicyInForce {
            kind: stored.kind.clone(),
            name: stored.name.clone(),
            hash: short_hash(&stored.wasm),
            since: stored.set_at,
            replica: None,
        };
        self.policies_in_force
            .lock()
            .expect("poisoned")
            .insert(in_force.kind.clone(), in_force.clone());
        Ok(in_force)
    }

    /// Writes replica `replica_id`'s own distribution policy `stored` to
    /// its file and puts it in force on that replica: from its controller's
    /// next session, which starts now.
    fn put_in_force_on(
        &self,
        dir: &Path,
        replica_id: u64,
        replica: &str,
        stored: &StoredPolicy,
    ) -> Result<PolicyInForce, EnvError> {
        let path = replica_file_of(dir, &stored.kind, replica_id);
        let io = |e: std::io::Error| EnvError::Orchestrator(format!("{}: {e}", path.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        let tmp = path.with_extension("wasm.tmp");
        std::fs::write(&tmp, &stored.wasm).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        self.compute
            .set_replica_distribution_policy(replica_id, Some(path.clone()));
        for c in self.compute.mutated(replica_id) {
            let _ = c.set_policy(self.compute.policy_for(replica_id));
            let _ = c.reconnect();
        }
        let in_force = PolicyInForce {
            kind: stored.kind.clone(),
            name: stored.name.clone(),
            hash: short_hash(&stored.wasm),
            since: stored.set_at,
            replica: Some(replica.to_string()),
        };
        self.replica_policies_in_force
            .lock()
            .expect("poisoned")
            .insert(replica_id, in_force.clone());
        Ok(in_force)
    }

    /// Puts in force the policies the catalog holds (set at run time before
    /// a restart). Called on load, before any controller starts.
    pub(crate) fn restore_policies(&self) -> Result<(), EnvError> {
        let Some(dir) = self.policies_dir.clone() else {
            return Ok(());
        };
        let stored = self
            .catalog
            .lock()
            .expect("poisoned")
            .policies()
            .map_err(|e| EnvError::Orchestrator(format!("reading the catalog's policies: {e}")))?;
        for p in stored {
            self.put_in_force(&dir, &p)?;
        }
        let per_replica = self
            .catalog
            .lock()
            .expect("poisoned")
            .replica_policies()
            .map_err(|e| {
                EnvError::Orchestrator(format!("reading the catalog's replica policies: {e}"))
            })?;
        for (id, p) in per_replica {
            let name = self
                .view
                .lock()
                .expect("poisoned")
                .replicas
                .get(&id)
                .map(|r| r.name.clone());
            if let Some(name) = name {
                self.put_in_force_on(&dir, id, &name, &p)?;
            }
        }
        Ok(())
    }

    /// The policies in force: the environment-wide ones by kind, then each
    /// replica's own, by replica ID.
    pub fn policies_in_force(&self) -> Vec<PolicyInForce> {
        let mut all: Vec<PolicyInForce> = self
            .policies_in_force
            .lock()
            .expect("poisoned")
            .values()
            .cloned()
            .collect();
        all.extend(
            self.replica_policies_in_force
                .lock()
                .expect("poisoned")
                .values()
                .cloned(),
        );
        all
    }
}

/// The largest policy component accepted (the API's limit).
pub use lockstep_api::MAX_POLICY_BYTES;
