//! The state directory: the lock around every read-modify-write, service
//! records and tombstones (private files in private directories), and the
//! teardown of every recorded service.

use super::*;

impl Inner {
    pub(super) fn state_err(path: &Path, source: std::io::Error) -> StateError {
        StateError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(super) fn lock(&self) -> Result<DirLock, StateError> {
        let path = self.config.state_dir.join("orchestrator.lock");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Self::state_err(&path, e))?;
        file.lock().map_err(|e| Self::state_err(&path, e))?;
        Ok(DirLock(file))
    }

    pub(super) fn record_path(&self, name: &str) -> PathBuf {
        self.config
            .state_dir
            .join("services")
            .join(format!("{name}.json"))
    }

    pub(super) fn read(&self, name: &str) -> Result<Option<ServiceRecord>, StateError> {
        read_record(&self.record_path(name))
    }

    pub(super) fn tombstone_path(&self, name: &str) -> PathBuf {
        self.config
            .state_dir
            .join("services")
            .join(format!("{name}.dropped"))
    }

    /// The epoch of the newest controller that dropped the service, if any.
    pub(super) fn read_tombstone(&self, name: &str) -> Result<Option<u64>, StateError> {
        let path = self.tombstone_path(name);
        match std::fs::read_to_string(&path) {
            Ok(s) => s.trim().parse().map(Some).map_err(|e| StateError::Corrupt {
                path,
                reason: format!("tombstone: {e}"),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Self::state_err(&path, e)),
        }
    }

    pub(super) fn write_tombstone(&self, name: &str, epoch: u64) -> Result<(), StateError> {
        let path = self.tombstone_path(name);
        let tmp = path.with_extension("dropped.tmp");
        let result = (|| {
            let mut f = private_file(&tmp)?;
            writeln!(f, "{epoch}")?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        result.map_err(|e| Self::state_err(&path, e))
    }

    pub(super) fn read_all(&self) -> Result<Vec<ServiceRecord>, StateError> {
        read_all_records(&self.config.state_dir)
    }

    /// Writes the record, and its environment to its own private file
    /// first (so a record is never newer than its environment).
    pub(super) fn write(&self, record: &ServiceRecord) -> Result<(), StateError> {
        let path = self.record_path(&record.name);
        let env = env_path(&path);
        let env_bytes = serde_json::to_vec(&record.env).expect("an environment serializes");
        let bytes = serde_json::to_vec_pretty(record).expect("records serialize");
        let write = |path: &Path, bytes: &[u8]| -> std::io::Result<()> {
            let mut tmp = path.as_os_str().to_owned();
            tmp.push(".tmp");
            let tmp = PathBuf::from(tmp);
            let mut f = private_file(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        let result = (|| {
            write(&env, &env_bytes)?;
            write(&path, &bytes)?;
            File::open(path.parent().expect("has a parent"))?.sync_all()
        })();
        result.map_err(|e| Self::state_err(&path, e))
    }
}

/// The held directory lock; released on drop.
pub(super) struct DirLock(File);

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

/// Creates `dir` (and its parents) if missing, mode 0700 from the start, and
/// narrows an existing one to 0700.
pub(super) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Creates (or truncates) `path` for writing, mode 0600 from the start (an
/// existing file is narrowed to 0600 before anything is written).
pub(super) fn private_file(path: &Path) -> std::io::Result<File> {
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

pub(super) fn read_record(path: &Path) -> Result<Option<ServiceRecord>, StateError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Inner::state_err(path, e)),
    };
    let record: ServiceRecord =
        serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    if record.version != RECORD_VERSION {
        return Err(StateError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("unknown record version {}", record.version),
        });
    }
    let mut record = record;
    let env = env_path(path);
    match std::fs::read(&env) {
        Ok(bytes) => {
            record.env = serde_json::from_slice(&bytes).map_err(|e| StateError::Corrupt {
                path: env.clone(),
                reason: e.to_string(),
            })?;
        }
        // A record written before environments had their own file.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Inner::state_err(&env, e)),
    }
    Ok(Some(record))
}

/// The private file beside a record that holds its processes' environment
/// (`NAME.env` beside `NAME.json`, 0600): secrets stay out of the record.
pub(super) fn env_path(record: &Path) -> PathBuf {
    record.with_extension("env")
}

/// Removes a record and its environment file.
pub(super) fn remove_record(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(env_path(path)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::remove_file(path)
}

pub(super) fn read_all_records(state_dir: &Path) -> Result<Vec<ServiceRecord>, StateError> {
    let dir = state_dir.join("services");
    let entries = std::fs::read_dir(&dir).map_err(|e| Inner::state_err(&dir, e))?;
    let mut records = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Inner::state_err(&dir, e))?;
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "json") {
            if let Some(r) = read_record(&path)? {
                records.push(r);
            }
        }
    }
    records.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(records)
}

/// Kills every process recorded under `state_dir` and removes the records:
/// the teardown for tests and for decommissioning a machine. Only processes
/// whose PID and start time both match are signalled. Also removes the
/// directory's simulated hosts ([`crate::hosts::remove_for_state_dir`]).
/// Returns how many processes were killed.
pub fn kill_all_services(state_dir: &Path) -> Result<usize, StateError> {
    let dir = state_dir.join("services");
    if !dir.exists() {
        return Ok(0);
    }
    // Under the lock, so that no supervisor restarts a process in between:
    // one that restarts later finds the record gone and stops.
    let lock_path = state_dir.join("orchestrator.lock");
    let lock = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&lock_path)
        .map_err(|e| Inner::state_err(&lock_path, e))?;
    lock.lock().map_err(|e| Inner::state_err(&lock_path, e))?;
    let _lock = DirLock(lock);
    let mut killed = 0;
    let entries = std::fs::read_dir(&dir).map_err(|e| Inner::state_err(&dir, e))?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        if let Ok(Some(record)) = read_record(&path) {
            for p in &record.processes {
                if let Some((pid, start)) = p.handle() {
                    if proc_alive(pid, start) {
                        let _ = nix::sys::signal::killpg(
                            nix::unistd::Pid::from_raw(pid as i32),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                        killed += 1;
                    }
                }
            }
        }
        let _ = remove_record(&path);
    }
    killed += kill_strays(state_dir);
    crate::hosts::remove_for_state_dir(state_dir);
    Ok(killed)
}
