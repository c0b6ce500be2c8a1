//! Private by default (R1): the state directory is 0700 and everything in
//! it 0600, and the API and metrics tokens live in it.
//!
//! - [`prepare_state_dir`] creates a missing state directory 0700, makes
//!   one of this user's that others can only read or enter 0700, refuses
//!   one that others can write (naming its mode), sets
//!   the process's umask to 077 (so the catalog, SQLite's `-wal` and
//!   `-shm`, command logs, records and process logs are created 0600, and
//!   directories 0700), and narrows anything already in it that is not.
//! - [`state_token`] reads a token file of the state directory, creating
//!   it (32 random bytes as 64 hex digits, 0600) on first use: `lockstep
//!   serve` keeps [`API_TOKEN_FILE`] (every API call) and
//!   [`METRICS_TOKEN_FILE`] (read-only: the metrics endpoint alone) there.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::StartError;

/// The admin token's file in the state directory: every API call.
pub const API_TOKEN_FILE: &str = "api.token";

/// The read-only metrics token's file in the state directory: the metrics
/// endpoint only, never the API.
pub const METRICS_TOKEN_FILE: &str = "metrics.token";

/// The most entries [`prepare_state_dir`] narrows (a bound on the walk of a
/// state directory someone filled).
const MAX_NARROWED: usize = 100_000;

/// Makes `dir` the private state directory: created 0700 if missing,
/// refused if another user can read, write or enter it; the process's
/// umask set to 077; group and other bits taken off everything in it.
pub fn prepare_state_dir(dir: &Path) -> Result<(), StartError> {
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    if !dir.exists() {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|source| StartError::StateDirUnwritable {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Ok(()),
                _ => Err(e),
            })
            .map_err(|source| StartError::StateDirUnwritable {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    crate::check_state_dir(dir)?;
    narrow(dir, &mut 0);
    Ok(())
}

/// Makes a state directory this user owns, that others can read or enter
/// but not write (`mkdir`'s 0755), 0700. One others can write is left for
/// [`crate::check_state_dir`] to refuse: what they may have put in it
/// cannot be trusted.
pub(crate) fn force_private(dir: &Path) -> Result<(), StartError> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(dir) else {
        return Ok(());
    };
    let mode = meta.permissions().mode() & 0o777;
    let ours = meta.uid() == nix::unistd::geteuid().as_raw();
    if meta.is_dir() && ours && mode & 0o077 != 0 && mode & 0o022 == 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| StartError::StateDirUnwritable {
                path: dir.to_path_buf(),
                source,
            },
        )?;
        tracing::info!(path = %dir.display(), mode = format!("{mode:o}"), "the state directory was open to other users; made it 0700");
    }
    Ok(())
}

/// Takes group and other bits off everything under `dir` (not following
/// symbolic links), at most [`MAX_NARROWED`] entries.
fn narrow(dir: &Path, seen: &mut usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        *seen += 1;
        if *seen > MAX_NARROWED {
            return;
        }
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if meta.file_type().is_symlink() {
            continue;
        }
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            let narrowed = std::fs::Permissions::from_mode(mode & 0o7700);
            if let Err(e) = std::fs::set_permissions(entry.path(), narrowed) {
                tracing::warn!(path = %entry.path().display(), "cannot make it private: {e}");
            } else {
                tracing::info!(path = %entry.path().display(), mode = format!("{:o}", mode & 0o777), "made private (0600/0700)");
            }
        }
        if meta.is_dir() {
            narrow(&entry.path(), seen);
        }
    }
}

/// Writes `bytes` to `path` (0600) unless it exists, atomically: two
/// processes at once both end up reading what the first one wrote.
pub(crate) fn create_once(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    // The first link wins; a loser reads the winner's.
    if std::fs::hard_link(&tmp, path).is_err() && !path.exists() {
        std::fs::remove_file(&tmp)?;
        return Err(std::io::Error::other(format!(
            "cannot create {}",
            path.display()
        )));
    }
    std::fs::remove_file(&tmp)
}

/// Fills `buf` from the OS's random source.
pub(crate) fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// The token in `dir/file` (its first line), created on first use: 32
/// random bytes as 64 hex digits, mode 0600.
pub fn state_token(dir: &Path, file: &str) -> std::io::Result<String> {
    let path = dir.join(file);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let token = text.lines().next().unwrap_or("").trim().to_string();
            if token.len() < lockstep_api::MIN_TOKEN_LEN {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{} holds a token of {} characters, fewer than {}: remove it to have a new one made",
                        path.display(),
                        token.len(),
                        lockstep_api::MIN_TOKEN_LEN
                    ),
                ));
            }
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut raw = [0u8; 32];
            random_bytes(&mut raw)?;
            let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
            create_once(&path, format!("{hex}\n").as_bytes())?;
            state_token(dir, file)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_is_created_private_and_a_shared_one_is_refused_naming_its_mode() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/state");
        prepare_state_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        // Files made after it are 0600 (the umask).
        std::fs::write(dir.join("catalog.db"), b"x").unwrap();
        let mode = std::fs::metadata(dir.join("catalog.db"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        // One others can read is made private; one others can write is
        // refused, naming its mode.
        let readable = root.path().join("readable");
        std::fs::create_dir(&readable).unwrap();
        std::fs::set_permissions(&readable, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_state_dir(&readable).unwrap();
        let mode = std::fs::metadata(&readable).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let shared = root.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_state_dir(&shared).unwrap_err().to_string();
        assert!(e.contains("777"), "{e}");
        assert!(e.contains("chmod 700"), "{e}");
    }

    #[test]
    fn what_an_older_build_left_readable_is_made_private() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("command-logs");
        std::fs::create_dir(&logs).unwrap();
        std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(logs.join("r1.db"), b"rows").unwrap();
        std::fs::set_permissions(logs.join("r1.db"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        prepare_state_dir(dir.path()).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&logs), 0o700);
        assert_eq!(mode(&logs.join("r1.db")), 0o600);
    }

    #[test]
    fn a_token_is_made_once_private_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let a = state_token(dir.path(), API_TOKEN_FILE).unwrap();
        let b = state_token(dir.path(), API_TOKEN_FILE).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        let m = state_token(dir.path(), METRICS_TOKEN_FILE).unwrap();
        assert_ne!(a, m, "the metrics token is another token");
        let mode = std::fs::metadata(dir.path().join(API_TOKEN_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.path().join("short.token"), "abc\n").unwrap();
        let e = state_token(dir.path(), "short.token")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fewer than"), "{e}");
    }
}
