//! Private by default (R1): the state directory is 0700 and everything in
//! it 0600, and the API and metrics tokens live in it.
//!
//! - [`prepare_state_dir`] creates a missing state directory 0700, refuses
//!   one another user owns or could redirect (a directory above it or a
//!   symbolic link on its path that is neither this user's nor root's, or
//!   a directory above it others can write without the sticky bit), makes
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
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::StartError;

/// The admin token's file in the state directory: every API call.
pub const API_TOKEN_FILE: &str = "api.token";

/// The read-only metrics token's file in the state directory: the metrics
/// endpoint only, never the API.
pub const METRICS_TOKEN_FILE: &str = "metrics.token";

/// Set, in a build with the `failpoints` feature only (the test command's),
/// no owner is checked: a state directory, token or secret file of any
/// user is trusted as before owners were checked. The hostile campaign's
/// negative control `unowned-state`; a release build ignores it.
pub const ANY_OWNER_ENV: &str = "LOCKSTEP_EXPERIMENT_ANY_OWNER";

/// Whether [`ANY_OWNER_ENV`] is in force.
fn owners_unchecked() -> bool {
    cfg!(feature = "failpoints") && std::env::var_os(ANY_OWNER_ENV).is_some()
}

/// The most entries [`prepare_state_dir`] narrows (a bound on the walk of a
/// state directory someone filled).
const MAX_NARROWED: usize = 100_000;

/// Makes `dir` the private state directory: created 0700 if missing,
/// refused unless [`crate::check_state_dir`] trusts it; the process's umask
/// set to 077; group and other bits taken off everything in it, through
/// descriptors (no symbolic link followed).
pub fn prepare_state_dir(dir: &Path) -> Result<(), StartError> {
    nix::sys::stat::umask(Mode::from_bits_truncate(0o077));
    if std::fs::symlink_metadata(dir).is_err() {
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
    narrow(checked_state_dir(dir)?, &mut 0);
    Ok(())
}

/// [`crate::check_state_dir`]: the path checked, the directory opened once
/// and checked (and narrowed to 0700) through its descriptor, a probe file
/// written and removed; the open directory, for work through it.
pub(crate) fn checked_state_dir(dir: &Path) -> Result<OwnedFd, StartError> {
    // The directory holds the master secret, every replica's key, the
    // tokens and every row (R1: private by default): one another user made
    // or can swap is refused, not used.
    check_path(dir)?;
    let fd = open_state_dir(dir)?;
    let probe = dir.join(format!(".lockstep-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe")
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|source| StartError::StateDirUnwritable {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(fd)
}

/// This process's effective uid.
fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Whether a file `uid` owns may decide what this process trusts: this
/// user's, or root's (who can do anything anyway).
fn trusted_owner(uid: u32) -> bool {
    uid == euid() || uid == 0 || owners_unchecked()
}

/// Whether `gid` is this process's group or one of its supplementary
/// groups (Kubernetes' `fsGroup` makes a volume's root writable by one).
fn our_group(gid: u32) -> bool {
    nix::unistd::getegid().as_raw() == gid
        || nix::unistd::getgroups()
            .map(|groups| groups.iter().any(|g| g.as_raw() == gid))
            .unwrap_or(false)
}

/// Refuses a state directory whose path another user could redirect: a
/// symbolic link on the given path that another user owns, or a directory
/// above the resolved one that another user owns or that users outside
/// this process's groups can write without the sticky bit (which keeps them
/// from renaming what they do not own).
pub(crate) fn check_path(dir: &Path) -> Result<(), StartError> {
    use std::os::unix::fs::MetadataExt;
    let untrusted = |component: &Path, why: String| StartError::StateDirUntrusted {
        path: dir.to_path_buf(),
        reason: format!("{} {why}", component.display()),
    };
    let unreadable = |source| StartError::StateDirUnwritable {
        path: dir.to_path_buf(),
        source,
    };
    let abs = std::path::absolute(dir).map_err(unreadable)?;
    let mut prefix = std::path::PathBuf::new();
    for component in abs.components() {
        prefix.push(component);
        if let Ok(meta) = std::fs::symlink_metadata(&prefix) {
            if meta.file_type().is_symlink() && !trusted_owner(meta.uid()) {
                return Err(untrusted(
                    &prefix,
                    format!("is a symbolic link owned by uid {}", meta.uid()),
                ));
            }
        }
    }
    let real = std::fs::canonicalize(&abs).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => StartError::StateDirMissing(dir.to_path_buf()),
        _ => unreadable(e),
    })?;
    for ancestor in real.ancestors().skip(1) {
        let meta = std::fs::metadata(ancestor).map_err(unreadable)?;
        let mode = meta.mode();
        if !trusted_owner(meta.uid()) {
            return Err(untrusted(
                ancestor,
                format!("is owned by uid {}", meta.uid()),
            ));
        }
        let sticky = mode & 0o1000 != 0;
        let others_write = mode & 0o002 != 0 || (mode & 0o020 != 0 && !our_group(meta.gid()));
        if others_write && !sticky {
            return Err(untrusted(
                ancestor,
                format!(
                    "is writable by other users without the sticky bit (mode {:o})",
                    mode & 0o7777
                ),
            ));
        }
    }
    Ok(())
}

/// Opens the state directory once (a symbolic link at its last component
/// resolved first, by [`check_path`]'s rules) and checks the open
/// directory: owned by this user, not writable by others; one that others
/// can only read or enter is made 0700 through the descriptor, so what is
/// changed is what was checked.
pub(crate) fn open_state_dir(dir: &Path) -> Result<OwnedFd, StartError> {
    let unreadable = |source| StartError::StateDirUnwritable {
        path: dir.to_path_buf(),
        source,
    };
    let real = std::fs::canonicalize(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => StartError::StateDirMissing(dir.to_path_buf()),
        _ => unreadable(e),
    })?;
    let fd = nix::fcntl::open(
        &real,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|errno| match errno {
        nix::errno::Errno::ENOTDIR => StartError::StateDirNotADirectory(dir.to_path_buf()),
        nix::errno::Errno::ENOENT => StartError::StateDirMissing(dir.to_path_buf()),
        other => unreadable(std::io::Error::from(other)),
    })?;
    let stat = nix::sys::stat::fstat(&fd).map_err(|e| unreadable(e.into()))?;
    if owners_unchecked() {
        tracing::warn!("{ANY_OWNER_ENV} is set: no owner is checked (a negative control)");
    } else if stat.st_uid != euid() {
        return Err(StartError::StateDirUntrusted {
            path: dir.to_path_buf(),
            reason: format!(
                "it is owned by uid {}, not by this user (uid {}); another user may have made it and planted what is in it",
                stat.st_uid,
                euid()
            ),
        });
    }
    let mode = stat.st_mode & 0o777;
    if mode & 0o022 != 0 {
        // What others may have put in it cannot be trusted.
        return Err(StartError::StateDirUnsafe {
            path: dir.to_path_buf(),
            mode,
        });
    }
    if mode & 0o077 != 0 {
        nix::sys::stat::fchmod(&fd, Mode::from_bits_truncate(0o700))
            .map_err(|e| unreadable(e.into()))?;
        tracing::info!(path = %dir.display(), mode = format!("{mode:o}"), "the state directory was open to other users; made it 0700");
    }
    Ok(fd)
}

/// Takes group and other bits off everything under the open directory
/// `dir`, relative to its descriptor and never through a symbolic link, at
/// most [`MAX_NARROWED`] entries.
fn narrow(dir: OwnedFd, seen: &mut usize) {
    use nix::sys::stat::{fchmodat, fstatat, FchmodatFlags, SFlag};
    let Ok(listing) = dir.try_clone() else {
        return;
    };
    let Ok(mut listing) = nix::dir::Dir::from_fd(listing) else {
        return;
    };
    let mut names = Vec::new();
    for entry in listing.iter().flatten() {
        let name = entry.file_name().to_owned();
        if name.as_bytes() == b"." || name.as_bytes() == b".." {
            continue;
        }
        *seen += 1;
        if *seen > MAX_NARROWED {
            break;
        }
        names.push(name);
    }
    drop(listing);
    for name in names {
        let shown = name.to_string_lossy();
        let Ok(stat) = fstatat(
            &dir,
            name.as_c_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) else {
            continue;
        };
        let kind = SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits());
        if kind == SFlag::S_IFLNK {
            continue;
        }
        let mode = stat.st_mode & 0o7777;
        if mode & 0o077 != 0 {
            let narrowed = Mode::from_bits_truncate(mode & 0o7700);
            match fchmodat(
                &dir,
                name.as_c_str(),
                narrowed,
                FchmodatFlags::NoFollowSymlink,
            ) {
                Err(e) => tracing::warn!(entry = %shown, "cannot make it private: {e}"),
                Ok(()) => {
                    tracing::info!(entry = %shown, mode = format!("{:o}", mode & 0o777), "made private (0600/0700)")
                }
            }
        }
        if kind == SFlag::S_IFDIR {
            if let Ok(sub) = nix::fcntl::openat(
                &dir,
                name.as_c_str(),
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                narrow(sub, seen);
            }
            if *seen > MAX_NARROWED {
                return;
            }
        }
    }
}

/// Reads a file of the state directory without following a symbolic link
/// at its name, refusing one another user (not root) owns or others can
/// write: it may have been planted.
pub(crate) fn read_owned(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(nix::errno::Errno::ELOOP as i32) {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "{} is a symbolic link: a state directory's secrets are plain files; remove it",
                        path.display()
                    ),
                )
            } else {
                e
            }
        })?;
    read_checked(path, file)
}

/// Reads a secret file given on the command line (a token file), following
/// symbolic links (a Kubernetes Secret's mounted files are links), and
/// refuses what it opened unless it is a regular file this user or root
/// owns that others cannot write.
pub fn read_secret_file(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(OFlag::O_CLOEXEC.bits())
        .open(path)?;
    read_checked(path, file)
}

/// Checks the open `file` (owner, kind, mode) and reads it, at most 64 KiB.
fn read_checked(path: &Path, file: std::fs::File) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata()?;
    let refuse = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} {why}: it may have been planted; refusing to use it",
                path.display()
            ),
        )
    };
    if !meta.is_file() {
        return Err(refuse("is not a regular file".into()));
    }
    if !trusted_owner(meta.uid()) {
        return Err(refuse(format!(
            "is owned by uid {}, not by this user (uid {}) or root",
            meta.uid(),
            euid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(refuse(format!(
            "is writable by other users (mode {:o})",
            meta.mode() & 0o777
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_BYTES).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The most bytes read from a token or secret file.
const MAX_SECRET_BYTES: u64 = 64 * 1024;

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
    match read_owned(&path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
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
    use std::os::unix::fs::PermissionsExt;

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

    /// A uid that is not this process's (`nobody`), when this process may
    /// give files away (root); `None` otherwise.
    fn other_uid() -> Option<u32> {
        (euid() == 0).then_some(65534)
    }

    #[test]
    fn a_state_dir_another_user_made_or_links_to_is_refused_and_nothing_in_it_is_used() {
        let Some(other) = other_uid() else {
            assert!(
                !std::env::var("LOCKSTEP_TEST_HAS")
                    .is_ok_and(|v| v.split(',').any(|h| h == "root")),
                "giving a directory to another user needs root"
            );
            eprintln!("skipped: giving a directory to another user needs root");
            return;
        };
        let base = tempfile::tempdir().unwrap();
        // A sticky world-writable directory, like /tmp.
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let planted = base.path().join("state");
        std::fs::create_dir(&planted).unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(planted.join(API_TOKEN_FILE), "a".repeat(64)).unwrap();
        nix::unistd::chown(&planted, Some(other.into()), None).unwrap();
        let e = prepare_state_dir(&planted).unwrap_err().to_string();
        assert!(e.contains(&format!("owned by uid {other}")), "{e}");
        assert!(e.contains("cannot be trusted"), "{e}");

        // A link another user planted at the path, to a directory of ours.
        let ours = base.path().join("ours");
        std::fs::create_dir(&ours).unwrap();
        let link = base.path().join("linked");
        std::os::unix::fs::symlink(&ours, &link).unwrap();
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            &link,
            Some(other.into()),
            None,
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .unwrap();
        let e = prepare_state_dir(&link).unwrap_err().to_string();
        assert!(e.contains("symbolic link owned by uid"), "{e}");
        // Through a directory above it that another user owns.
        let theirs = base.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        nix::unistd::chown(&theirs, Some(other.into()), None).unwrap();
        let e = prepare_state_dir(&theirs.join("state"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("theirs is owned by uid"), "{e}");
        // Through one others can write without the sticky bit.
        let open = base.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = prepare_state_dir(&open.join("state"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("without the sticky bit (mode 777)"), "{e}");
        // Our own, in the sticky directory, is used.
        prepare_state_dir(&ours).unwrap();
    }

    #[test]
    fn a_planted_token_or_secret_is_refused_not_read() {
        let dir = tempfile::tempdir().unwrap();
        prepare_state_dir(dir.path()).unwrap();
        // A link at a token's name, to a file of the linker's choosing.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, "b".repeat(64)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(API_TOKEN_FILE)).unwrap();
        let e = state_token(dir.path(), API_TOKEN_FILE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(crate::SESSION_SECRET_FILE))
            .unwrap();
        let e = crate::session_secret(dir.path()).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        // A token file others can write (given on the command line).
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = read_secret_file(&elsewhere).unwrap_err().to_string();
        assert!(e.contains("writable by other users (mode 666)"), "{e}");
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            read_secret_file(&elsewhere).unwrap(),
            "b".repeat(64).as_bytes()
        );
        if let Some(other) = other_uid() {
            let planted = dir.path().join(METRICS_TOKEN_FILE);
            std::fs::write(&planted, "c".repeat(64)).unwrap();
            nix::unistd::chown(&planted, Some(other.into()), None).unwrap();
            let e = state_token(dir.path(), METRICS_TOKEN_FILE)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("owned by uid {other}")), "{e}");
            nix::unistd::chown(&elsewhere, Some(other.into()), None).unwrap();
            let e = read_secret_file(&elsewhere).unwrap_err().to_string();
            assert!(e.contains("refusing to use it"), "{e}");
        }
    }
}
