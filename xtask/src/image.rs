//! `cargo xtask image [--from-source | --release] [--keep]`: builds the container image
//! `lockstep:dev` from the repository's `Containerfile` and checks it.
//!
//! 1. Finds podman (or docker with a running daemon).
//! 2. Makes sure the runtime base image, `docker.io/library/debian:bookworm-slim`,
//!    is there: present, else pulled, else made with `debootstrap --variant=minbase
//!    bookworm` from the mirror apt already uses and imported under that name
//!    (so the Containerfile builds unchanged where a registry exists).
//! 3. Builds the image: by default the `runtime-prebuilt` target from a context
//!    directory (target/lockstep/image/context) holding stripped copies of the
//!    host's target/debug/lockstep and lockstep-replica and
//!    target/lockstep/policies/*.wasm (with `--release`, of target/release's
//!    binaries, built first); with `--from-source` the whole multi-stage
//!    build (a release build inside the Rust image, which must come from a
//!    registry).
//! 4. Runs `lockstep demo` in it (read-only root, as the image's non-root
//!    user) and requires `demo: ok`.
//! 5. Runs `lockstep serve` in it (process backend, token from the
//!    environment, state on a tmpfs owned by the image's user), checks from
//!    the host that the API answers with the token and refuses without, that
//!    a replica created through it serves (grpc.health.v1, `lockstep
//!    status`), and that /metrics answers with the read-only metrics token
//!    `lockstep serve` made in its state directory (read from the
//!    container), and refuses without it or with the API token; then stops
//!    it.
//! 6. Runs `lockstep serve` in it with the shipped Deployment's exact
//!    command, arguments and environment against the Kubernetes API double
//!    and a throw-away PostgreSQL server ([`deployment`]).
//! 7. Removes the containers always, and the image and the context unless
//!    `--keep` (podman's vfs driver copies every layer).
//!
//! `cargo xtask test` runs it ([`in_test`]) where a container engine
//! answers here, and skips it, saying why, elsewhere (`.ci/run` installs
//! podman, debootstrap and runc). See docs/image.md.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::util::{root, run, step, target_dir};

mod deployment;
pub mod node_images;

/// The image this task builds (and removes unless `--keep`).
pub const IMAGE: &str = "lockstep:dev";
/// The runtime base, exactly as the Containerfile's `FROM` resolves it.
pub const BASE_IMAGE: &str = "docker.io/library/debian:bookworm-slim";
/// The build stage's base (`--from-source` only).
pub const RUST_IMAGE: &str = "docker.io/library/rust:1.95-bookworm";
/// The Debian release the base image is made from.
const SUITE: &str = "bookworm";
/// The image's user (Containerfile: `USER 10001`).
const IMAGE_UID: u32 = 10001;

/// Options of `cargo xtask image`.
pub struct Options {
    /// Build everything inside the container instead of copying host binaries.
    pub from_source: bool,
    /// The host's release binaries (built first) instead of its debug ones.
    pub release: bool,
    /// Keep the image and the build context.
    pub keep: bool,
}

/// The image check of `cargo xtask test`: [`image`] from the host's
/// binaries (just built by the test). podman, debootstrap and runc are
/// installed where they are missing (`crate::prereqs::podman`); an engine
/// that still does not answer fails the run, naming it (`--skip image`
/// skips the step on purpose).
pub fn in_test() -> anyhow::Result<()> {
    step("the container image (cargo xtask image): lockstep demo and lockstep serve inside it");
    if crate::prereqs::skipped("image") {
        return Ok(());
    }
    crate::prereqs::podman()?;
    let engine = Engine::find().context("the image check needs a container engine")?;
    if let Engine::Podman { .. } = engine {
        let mut info = engine.cmd();
        info.arg("info").stdout(Stdio::null()).stderr(Stdio::null());
        if !succeeds(info) {
            anyhow::bail!(
                "podman is installed but `podman info` fails here: the image check cannot run (pass --skip image to leave it out on purpose)"
            );
        }
    }
    image(&Options {
        from_source: false,
        release: false,
        keep: false,
    })
}

/// Runs the task.
pub fn image(opts: &Options) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut times = Times::default();
    let result = run_all(opts, &mut times);
    times.close();
    eprintln!("\nxtask: image: time per step");
    for (what, d) in &times.done {
        eprintln!("xtask:   {:>7.1} s  {what}", d.as_secs_f64());
    }
    eprintln!("xtask:   {:>7.1} s  total", started.elapsed().as_secs_f64());
    result?;
    eprintln!("\nxtask: image: ok");
    Ok(())
}

fn run_all(opts: &Options, times: &mut Times) -> anyhow::Result<()> {
    times.start("finding podman or docker");
    let engine = Engine::find()?;
    eprintln!("xtask: using {}", engine.describe());

    times.start("the base image");
    ensure_base(&engine, times)?;

    let work = target_dir().join("lockstep/image");
    let context = work.join("context");
    times.start(if opts.from_source {
        "building the image from source (--from-source)"
    } else {
        "preparing the build context (stripped host binaries, policies)"
    });
    if opts.from_source {
        ensure_pullable(&engine, RUST_IMAGE).with_context(|| {
            format!(
                "--from-source needs {RUST_IMAGE} (a registry, or the image loaded beforehand); without one, drop --from-source to build from the host's binaries"
            )
        })?;
        let mut cmd = engine.build_cmd();
        cmd.args(["-f", "Containerfile", "--target", "runtime", "-t", IMAGE]);
        cmd.args(oci_build_args()?).arg(".");
        cmd.current_dir(root());
        run(cmd)?;
    } else {
        let profile = if opts.release {
            times.start("building the release binaries on the host (cargo build --release)");
            let mut cmd = crate::util::cargo();
            cmd.args([
                "build",
                "--release",
                "--locked",
                "-p",
                "lockstep-cli",
                "-p",
                "lockstep-replica",
                "--bins",
            ]);
            run(cmd)?;
            times.start("preparing the build context (stripped release binaries, policies)");
            "release"
        } else {
            "debug"
        };
        prepare_context(&context, profile)?;
        times.start("building the image (--target runtime-prebuilt)");
        let mut cmd = engine.build_cmd();
        cmd.arg("-f")
            .arg(context.join("Containerfile"))
            .args(["--target", "runtime-prebuilt", "-t", IMAGE])
            .args(oci_build_args()?)
            .arg(&context);
        run(cmd)?;
    }
    // From here on, the image exists: remove it (and the context) whatever happens.
    let _image = Cleanup {
        engine: &engine,
        what: Removal::Image(opts.keep, context.clone()),
    };
    let size = engine.image_size(IMAGE)?;
    eprintln!(
        "xtask: {IMAGE}: {:.1} MB ({} bytes)",
        size as f64 / 1e6,
        size
    );
    times.note(format!("image size {:.1} MB", size as f64 / 1e6));
    times.start("the image's OCI labels and its LICENSE");
    oci_labels(&engine)?;

    times.start("lockstep demo inside the image");
    demo_in_image(&engine)?;

    times.start("lockstep serve inside the image, checked from the host");
    serve_in_image(&engine)?;
    times.start("lockstep serve inside the image as the shipped Deployment runs it");
    deployment::run_check(&engine)?;

    if !opts.release {
        // The node suite's pods run the binaries the test built (with the
        // test features), never a release image of another build.
        times.start("saving the image for the real Kubernetes node (target/lockstep/node-images)");
        node_images::save(&engine)?;
    }

    times.start(if opts.keep {
        "keeping the image and the build context (--keep)"
    } else {
        "removing the image and the build context"
    });
    if opts.keep {
        let own = build_tag(&engine)?;
        eprintln!(
            "xtask: kept {IMAGE}, also tagged {own} (this build's own tag: name that one in a cluster, where one tag for every build lets two nodes run two builds), and {} (--keep)",
            context.display()
        );
    }
    Ok(())
}

/// The first 12 hex digits of [`IMAGE`]'s image ID (a digest of its
/// content): what names this build and no other.
fn short_id(engine: &Engine) -> anyhow::Result<String> {
    let mut inspect = engine.cmd();
    inspect.args(["image", "inspect", "--format", "{{.Id}}", IMAGE]);
    let id = crate::util::stdout(inspect)?;
    let id = id.trim().trim_start_matches("sha256:");
    anyhow::ensure!(id.len() >= 12, "{IMAGE} has no image ID ({id:?})");
    Ok(id[..12].to_string())
}

/// Tags [`IMAGE`] as `lockstep:VERSION-ID` (ID: the first 12 hex digits
/// of its image ID, a digest of its content), a tag no other build has;
/// returns it.
fn build_tag(engine: &Engine) -> anyhow::Result<String> {
    let own = format!(
        "lockstep:{}-{}",
        env!("CARGO_PKG_VERSION"),
        short_id(engine)?
    );
    let mut tag = engine.cmd();
    tag.args(["tag", IMAGE, &own]);
    run(tag)?;
    Ok(own)
}

/// Wall time per step.
#[derive(Default)]
struct Times {
    current: Option<(String, Instant)>,
    done: Vec<(String, Duration)>,
}

impl Times {
    /// Ends the current step and starts (and announces) `what`.
    fn start(&mut self, what: &str) {
        self.close();
        step(what);
        self.current = Some((what.to_string(), Instant::now()));
    }

    fn close(&mut self) {
        if let Some((what, t)) = self.current.take() {
            self.done.push((what, t.elapsed()));
        }
    }

    /// A line in the summary that is not a step.
    fn note(&mut self, what: String) {
        self.close();
        self.done.push((what, Duration::ZERO));
    }
}

/// Whether `program` is found in PATH.
fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Runs `cmd` quietly; whether it succeeded.
fn succeeds(mut cmd: Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The container engine.
enum Engine {
    /// podman, with the flags that work on machines without systemd or
    /// CAP_SYS_RESOURCE (see docs/image.md).
    Podman {
        /// `--storage-driver` (default vfs; LOCKSTEP_IMAGE_STORAGE_DRIVER
        /// overrides it, empty for podman's own choice).
        storage_driver: Option<String>,
        /// `--runtime runc` if runc is installed (crun refuses hybrid cgroup
        /// layouts).
        runc: bool,
    },
    /// docker with a running daemon.
    Docker,
}

impl Engine {
    fn find() -> anyhow::Result<Engine> {
        if on_path("podman") {
            let storage_driver = match std::env::var("LOCKSTEP_IMAGE_STORAGE_DRIVER") {
                Ok(s) if s.is_empty() => None,
                Ok(s) => Some(s),
                Err(_) => Some("vfs".to_string()),
            };
            return Ok(Engine::Podman {
                storage_driver,
                runc: on_path("runc"),
            });
        }
        if on_path("docker") {
            let mut info = Command::new("docker");
            info.arg("info");
            if succeeds(info) {
                return Ok(Engine::Docker);
            }
            bail!(
                "docker is installed but its daemon does not answer (`docker info` failed), and podman is not installed.\n\
                 Install podman (no daemon needed): apt-get install podman debootstrap runc"
            );
        }
        bail!(
            "neither podman nor docker is installed.\n\
             Install podman, and debootstrap and runc to make the base image where no registry is reachable:\n\
             \x20   apt-get install podman debootstrap runc"
        )
    }

    fn describe(&self) -> String {
        match self {
            Engine::Podman {
                storage_driver,
                runc,
            } => format!(
                "podman (storage driver {}, runtime {})",
                storage_driver.as_deref().unwrap_or("default"),
                if *runc { "runc" } else { "default" }
            ),
            Engine::Docker => "docker".into(),
        }
    }

    /// The engine with its global flags.
    fn cmd(&self) -> Command {
        match self {
            Engine::Podman {
                storage_driver,
                runc,
            } => {
                let mut cmd = Command::new("podman");
                if let Some(driver) = storage_driver {
                    cmd.args(["--storage-driver", driver]);
                }
                if *runc {
                    cmd.args(["--runtime", "runc"]);
                }
                cmd.args(["--cgroup-manager", "cgroupfs"]);
                cmd
            }
            Engine::Docker => Command::new("docker"),
        }
    }

    /// `build` with the engine's build flags.
    fn build_cmd(&self) -> Command {
        let mut cmd = self.cmd();
        cmd.arg("build");
        if let Engine::Podman { .. } = self {
            cmd.args(["--isolation", "chroot"]);
        }
        cmd
    }

    /// `run` with the flags every container of this task gets: host network,
    /// explicit rlimits, an init process (PID 1 that forwards signals and reaps
    /// the replica processes lockstep leaves behind), a read-only root.
    fn run_cmd(&self) -> Command {
        let mut cmd = self.cmd();
        cmd.args([
            "run",
            "--network",
            "host",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            "--init",
            "--read-only",
        ]);
        if let Engine::Docker = self {
            // podman mounts a tmpfs on /tmp of a read-only container by itself.
            cmd.args(["--tmpfs", "/tmp"]);
        }
        cmd
    }

    fn image_exists(&self, image: &str) -> bool {
        let mut cmd = self.cmd();
        cmd.args(["image", "inspect", image]);
        succeeds(cmd)
    }

    fn image_size(&self, image: &str) -> anyhow::Result<u64> {
        let mut cmd = self.cmd();
        cmd.args(["image", "inspect", "--format", "{{.Size}}", image]);
        let out = cmd.output().context("image inspect")?;
        if !out.status.success() {
            bail!(
                "image inspect {image}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let s = String::from_utf8_lossy(&out.stdout);
        s.trim()
            .parse()
            .with_context(|| format!("image size of {image}: {s:?}"))
    }

    /// Removes a container, quietly (it may not exist).
    fn remove_container(&self, name: &str) {
        let mut cmd = self.cmd();
        cmd.args(["rm", "-f", name]);
        let _ = succeeds(cmd);
    }
}

/// Removes a container or the image when dropped.
struct Cleanup<'a> {
    engine: &'a Engine,
    what: Removal,
}

enum Removal {
    Container(String),
    /// The image and the context directory, unless kept (`true`).
    Image(bool, PathBuf),
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        match &self.what {
            Removal::Container(name) => self.engine.remove_container(name),
            Removal::Image(true, _) => {}
            Removal::Image(false, context) => {
                let mut cmd = self.engine.cmd();
                cmd.args(["rmi", "-f", IMAGE]);
                if let Err(e) = run(cmd) {
                    eprintln!("xtask: could not remove {IMAGE}: {e:#}");
                }
                let _ = std::fs::remove_dir_all(context);
            }
        }
    }
}

/// Whether `image` is there or can be pulled (the pull is tried).
fn ensure_pullable(engine: &Engine, image: &str) -> anyhow::Result<()> {
    if engine.image_exists(image) {
        return Ok(());
    }
    let mut cmd = engine.cmd();
    cmd.args(["pull", image]);
    run(cmd)
}

/// Makes sure [`BASE_IMAGE`] is present: there, pulled, or made with
/// debootstrap.
fn ensure_base(engine: &Engine, times: &mut Times) -> anyhow::Result<()> {
    if engine.image_exists(BASE_IMAGE) {
        eprintln!("xtask: {BASE_IMAGE} is present");
        return Ok(());
    }
    eprintln!("xtask: {BASE_IMAGE} is not present: pulling it");
    let mut pull = engine.cmd();
    pull.args(["pull", BASE_IMAGE]);
    if run(pull).is_ok() {
        return Ok(());
    }
    times.start(&format!(
        "no registry: making {BASE_IMAGE} with debootstrap (tens of seconds)"
    ));
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    if uid != "0" {
        bail!(
            "{BASE_IMAGE} can be neither pulled nor made here: debootstrap needs root (uid {uid})"
        );
    }
    if !on_path("debootstrap") {
        bail!("{BASE_IMAGE} cannot be pulled and debootstrap is not installed: apt-get install debootstrap");
    }
    let mirror = apt_mirror();
    let rootfs = target_dir().join("lockstep/image/rootfs");
    remove_rootfs(&rootfs)?;
    std::fs::create_dir_all(rootfs.parent().expect("rootfs has a parent"))?;
    eprintln!(
        "xtask: debootstrap {SUITE} from {mirror} into {}",
        rootfs.display()
    );
    let mut cmd = Command::new("debootstrap");
    cmd.args(["--variant=minbase", SUITE])
        .arg(&rootfs)
        .arg(&mirror);
    // debootstrap prints a line per package: keep only its step lines.
    let mut extracting = false;
    run_filtered(cmd, |l| {
        if l.starts_with("I: Extracting") {
            // One line for all the packages.
            return !std::mem::replace(&mut extracting, true);
        }
        l.starts_with("I: Retrieving Release")
            || l.starts_with("I: Validating Packages")
            || l.starts_with("I: Resolving")
            || l.starts_with("I: Checking component")
            || l.starts_with("I: Installing core")
            || l.starts_with("I: Unpacking the base")
            || l.starts_with("I: Configuring the base")
            || l.starts_with("I: Base system installed")
            || l.starts_with("E:")
            || l.starts_with("W:")
    })?;
    slim(&rootfs)?;
    times.start(&format!("importing the root filesystem as {BASE_IMAGE}"));
    let mut tar = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .args(["--numeric-owner", "-c", "."])
        .stdout(Stdio::piped())
        .spawn()
        .context("tar")?;
    let mut import = engine.cmd();
    import
        .args(["import", "--change", "CMD [\"bash\"]", "-", BASE_IMAGE])
        .stdin(tar.stdout.take().expect("piped"));
    let imported = run(import);
    let tarred = tar.wait()?;
    imported?;
    if !tarred.success() {
        bail!("tar of {} failed with {tarred}", rootfs.display());
    }
    remove_rootfs(&rootfs)?;
    Ok(())
}

/// Runs a command, echoing only the lines of its output that `keep`
/// selects (and every line if it fails).
fn run_filtered(mut cmd: Command, mut keep: impl FnMut(&str) -> bool) -> anyhow::Result<()> {
    let shown = format!("{cmd:?}");
    eprintln!("xtask: $ {shown}");
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start {shown}"))?;
    let mut all = Vec::new();
    let mut out = out;
    for line in BufReader::new(out.stdout.take().expect("piped")).lines() {
        let line = line?;
        if keep(&line) {
            eprintln!("xtask:   {line}");
        }
        all.push(line);
    }
    let status = out.wait()?;
    if !status.success() {
        for l in all.iter().rev().take(40).rev() {
            eprintln!("  {l}");
        }
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

/// The Debian mirror apt uses for `bookworm` (from /etc/apt/sources.list
/// and /etc/apt/sources.list.d/, one-line and deb822 formats), or
/// deb.debian.org.
fn apt_mirror() -> String {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        if let Some(m) = mirror_in(&text) {
            return m;
        }
    }
    "http://deb.debian.org/debian".to_string()
}

/// The first `deb` source for [`SUITE`] in a sources file.
fn mirror_in(text: &str) -> Option<String> {
    // One-line format: `deb [options] URI SUITE COMPONENTS...`.
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("deb") {
            continue;
        }
        let rest: Vec<&str> = words.collect();
        let rest: Vec<&str> = if rest.first().is_some_and(|w| w.starts_with('[')) {
            let close = rest.iter().position(|w| w.ends_with(']'))?;
            rest[close + 1..].to_vec()
        } else {
            rest
        };
        if rest.len() >= 2 && rest[1] == SUITE {
            return Some(rest[0].to_string());
        }
    }
    // deb822: paragraphs of `Field: value` lines.
    for para in text.split("\n\n") {
        let field = |name: &str| {
            para.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim().eq_ignore_ascii_case(name)).then(|| v.trim().to_string())
            })
        };
        let is_deb = field("Types").is_some_and(|t| t.split_whitespace().any(|t| t == "deb"));
        let has_suite = field("Suites").is_some_and(|s| s.split_whitespace().any(|s| s == SUITE));
        let enabled = field("Enabled").is_none_or(|e| e != "no");
        if is_deb && has_suite && enabled {
            if let Some(uri) =
                field("URIs").and_then(|u| u.split_whitespace().next().map(String::from))
            {
                return Some(uri);
            }
        }
    }
    None
}

/// Unmounts anything a broken debootstrap left mounted under `rootfs`
/// (proc, sys), then removes it.
fn remove_rootfs(rootfs: &Path) -> anyhow::Result<()> {
    if !rootfs.exists() {
        return Ok(());
    }
    let prefix = format!("{}/", rootfs.display());
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let mut under: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| m.starts_with(&prefix))
        .collect();
    under.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in under {
        let mut cmd = Command::new("umount");
        cmd.args(["-l", m]);
        run(cmd)?;
    }
    std::fs::remove_dir_all(rootfs).with_context(|| format!("removing {}", rootfs.display()))
}

/// What debian:bookworm-slim leaves out of a minbase system: apt's lists and
/// caches, documentation but the copyright files, man pages, locales.
fn slim(rootfs: &Path) -> anyhow::Result<()> {
    for dir in [
        "var/lib/apt/lists",
        "var/cache/apt",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
        "var/log",
    ] {
        let d = rootfs.join(dir);
        if let Ok(entries) = std::fs::read_dir(&d) {
            for e in entries.flatten() {
                let p = e.path();
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    // Keep apt's directory skeleton (partial/, archives/).
                    if dir.starts_with("var/") {
                        continue;
                    }
                    std::fs::remove_dir_all(&p)?;
                } else {
                    std::fs::remove_file(&p)?;
                }
            }
        }
    }
    let mut cmd = Command::new("find");
    cmd.arg(rootfs.join("usr/share/doc")).args([
        "-type",
        "f",
        "!",
        "-name",
        "copyright",
        "-delete",
    ]);
    run(cmd)
}

/// Fills the `runtime-prebuilt` context: bin/ (stripped copies of the host's
/// debug binaries), policies/, the Containerfile.
fn prepare_context(context: &Path, profile: &str) -> anyhow::Result<()> {
    if context.exists() {
        std::fs::remove_dir_all(context)?;
    }
    std::fs::create_dir_all(context.join("bin"))?;
    std::fs::create_dir_all(context.join("policies"))?;
    let built = target_dir().join(profile);
    for bin in ["lockstep", "lockstep-replica"] {
        let src = built.join(bin);
        if !src.is_file() {
            bail!(
                "{} is missing: build it first (cargo build -p lockstep-cli -p lockstep-replica --bins), or use --from-source",
                src.display()
            );
        }
        let dst = context.join("bin").join(bin);
        // Debug info is most of a debug binary; symbols stay (backtraces).
        let mut cmd = if on_path("strip") {
            let mut c = Command::new("strip");
            c.arg("--strip-debug");
            c
        } else {
            let mut c = Command::new("objcopy");
            c.arg("--strip-debug");
            c
        };
        cmd.arg("-o").arg(&dst).arg(&src);
        if !(on_path("strip") || on_path("objcopy")) {
            eprintln!("xtask: neither strip nor objcopy found: copying {bin} unstripped");
            std::fs::copy(&src, &dst)?;
        } else {
            run(cmd)?;
        }
        eprintln!(
            "xtask: bin/{bin}: {:.1} MB (from {:.1} MB)",
            std::fs::metadata(&dst)?.len() as f64 / 1e6,
            std::fs::metadata(&src)?.len() as f64 / 1e6
        );
    }
    let policies = target_dir().join("lockstep/policies");
    let mut n = 0;
    for e in std::fs::read_dir(&policies)
        .with_context(|| format!("{}: run cargo xtask build-policies", policies.display()))?
    {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "wasm") {
            std::fs::copy(
                &p,
                context
                    .join("policies")
                    .join(p.file_name().expect("a file")),
            )?;
            n += 1;
        }
    }
    if n == 0 {
        bail!(
            "no policies in {}: run cargo xtask build-policies",
            policies.display()
        );
    }
    eprintln!("xtask: policies/: {n} policies");
    std::fs::copy(root().join("Containerfile"), context.join("Containerfile"))?;
    std::fs::copy(root().join("LICENSE"), context.join("LICENSE"))?;
    Ok(())
}

/// The workspace's version, the commit and the repository's remote (where
/// it has one), as the Containerfile's build arguments.
fn oci_build_args() -> anyhow::Result<Vec<String>> {
    let revision = crate::util::stdout({
        let mut c = Command::new("git");
        c.args(["rev-parse", "HEAD"]).current_dir(root());
        c
    })?;
    let mut args = vec![
        "--build-arg".to_string(),
        format!("VERSION={}", env!("CARGO_PKG_VERSION")),
        "--build-arg".to_string(),
        format!("REVISION={}", revision.trim()),
    ];
    let mut remote = Command::new("git");
    remote
        .args(["remote", "get-url", "origin"])
        .current_dir(root());
    if let Ok(out) = remote.output() {
        let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !url.is_empty() {
            args.extend(["--build-arg".to_string(), format!("SOURCE={url}")]);
        }
    }
    Ok(args)
}

/// The image says what it is: its OCI labels name this version, this
/// commit and the workspace's license, whose text it holds.
fn oci_labels(engine: &Engine) -> anyhow::Result<()> {
    let mut cmd = engine.cmd();
    cmd.args(["image", "inspect", "--format", "{{json .Labels}}", IMAGE]);
    let labels: serde_json::Value = serde_json::from_str(&crate::util::stdout(cmd)?)
        .context("image inspect printed no JSON labels")?;
    let workspace = std::fs::read_to_string(root().join("Cargo.toml"))?;
    let license = workspace
        .lines()
        .find_map(|l| l.strip_prefix("license = "))
        .map(|l| l.trim_matches('"').to_string())
        .context("the workspace's Cargo.toml names no license")?;
    let revision = oci_build_args()?[3]
        .trim_start_matches("REVISION=")
        .to_string();
    for (key, want) in [
        (
            "org.opencontainers.image.version",
            env!("CARGO_PKG_VERSION"),
        ),
        ("org.opencontainers.image.revision", revision.as_str()),
        ("org.opencontainers.image.licenses", license.as_str()),
        ("org.opencontainers.image.title", "lockstep"),
    ] {
        anyhow::ensure!(
            labels[key] == want,
            "the image's label {key} is {}, not {want}",
            labels[key]
        );
    }
    // The image has no shell or coreutils to read a file with: the file is
    // copied out of a container made (not started) from it.
    let name = container_name("files");
    let mut create = engine.cmd();
    create.args(["create", "--name", &name, IMAGE]);
    crate::util::stdout(create)?;
    let _rm = Cleanup {
        engine,
        what: Removal::Container(name.clone()),
    };
    let out = tempfile::tempdir()?;
    let copy_out = |from: &str| {
        let mut cp = engine.cmd();
        cp.arg("cp")
            .arg(format!("{name}:{from}"))
            .arg(out.path().join("copied"));
        let _ = std::fs::remove_file(out.path().join("copied"));
        crate::util::stdout(cp).map(|_| out.path().join("copied"))
    };
    let text = std::fs::read_to_string(copy_out("/usr/share/doc/lockstep/LICENSE")?)?;
    anyhow::ensure!(
        text.contains("Apache License"),
        "the image's /usr/share/doc/lockstep/LICENSE begins {:?}",
        text.lines().take(3).collect::<Vec<_>>()
    );
    // The runtime is the programs and what they link, no more: the copy
    // (which just worked for the LICENSE) must fail saying the file is not
    // there, not for any other reason.
    for absent in ["/bin/sh", "/usr/bin/apt-get", "/usr/bin/mkdir"] {
        match copy_out(absent) {
            Ok(_) => bail!(
                "the image holds {absent}: the runtime base should hold the programs' libraries only"
            ),
            Err(e) if e.to_string().contains("no such file or directory") => {}
            Err(e) => bail!("copying {absent} out of the image failed otherwise: {e:#}"),
        }
    }
    eprintln!("xtask: labels {labels}; LICENSE in /usr/share/doc/lockstep");
    Ok(())
}

/// A container name unique to this run.
fn container_name(what: &str) -> String {
    format!("lockstep-image-{what}-{}", std::process::id())
}

/// `lockstep demo` in the image: must end with `demo: ok`.
fn demo_in_image(engine: &Engine) -> anyhow::Result<()> {
    let name = container_name("demo");
    let _rm = Cleanup {
        engine,
        what: Removal::Container(name.clone()),
    };
    let mut cmd = engine.run_cmd();
    cmd.args(["--rm", "--name", &name, IMAGE, "demo"]);
    eprintln!("xtask: $ {cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the demo container")?;
    let stdout = child.stdout.take().expect("piped");
    // The demo prints its steps; a watchdog kills the container if it hangs.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watchdog = {
        let kill = {
            let mut k = engine.cmd();
            k.args(["kill", &name]);
            k
        };
        std::thread::spawn(move || {
            if rx.recv_timeout(Duration::from_secs(600)).is_err() {
                eprintln!("xtask: the demo ran 600 s: killing its container");
                let _ = succeeds(kill);
            }
        })
    };
    let mut last = String::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        println!("  | {line}");
        if !line.trim().is_empty() {
            last = line;
        }
    }
    let status = child.wait()?;
    let _ = tx.send(());
    let _ = watchdog.join();
    if !status.success() {
        bail!("lockstep demo in {IMAGE} failed with {status}");
    }
    if !last.starts_with("demo: ok") {
        bail!("lockstep demo in {IMAGE} did not end with `demo: ok` (last line: {last:?})");
    }
    Ok(())
}

/// A free port on 127.0.0.1 (free when asked; the host network is shared).
fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A random API token (hex of 24 bytes of /dev/urandom).
pub(crate) fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 24];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// `lockstep serve` in the image as deploy/kubernetes/base/environment.yaml runs it,
/// but on the process backend, checked from the host.
fn serve_in_image(engine: &Engine) -> anyhow::Result<()> {
    let name = container_name("serve");
    let _rm = Cleanup {
        engine,
        what: Removal::Container(name.clone()),
    };
    let port = free_port()?;
    let metrics_port = free_port()?;
    let token = random_token()?;
    let url = format!("http://127.0.0.1:{port}");
    // The state directory as the image makes it: owned by the image's user,
    // mode 0700; a host directory (the root is read-only), so that the
    // metrics token serve makes in it is read from here.
    let volume = tempfile::tempdir()?;
    let state = volume.path().join("state");
    std::fs::create_dir(&state)?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::os::unix::fs::chown(&state, Some(IMAGE_UID), Some(IMAGE_UID))
            .with_context(|| format!("chown {} (needs root)", state.display()))?;
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700))?;
    }
    let mut cmd = engine.run_cmd();
    cmd.args(["--detach", "--name", &name])
        .arg("--volume")
        .arg(format!("{}:/var/lib/lockstep", state.display()))
        // The token reaches the container by name, not on a command line.
        .args(["--env", "LOCKSTEP_API_TOKEN"])
        .env("LOCKSTEP_API_TOKEN", &token)
        .arg(IMAGE)
        .args([
            "serve",
            "--orchestrator=process",
            "--state-dir=/var/lib/lockstep",
            "--service-binary=/usr/local/bin/lockstep-replica",
        ])
        .arg(format!("--listen=127.0.0.1:{port}"))
        .arg(format!("--metrics-listen=127.0.0.1:{metrics_port}"))
        .arg("--distribution-policy=/usr/local/share/lockstep/policies/barrier.wasm");
    run(cmd)?;
    check_then_stop(engine, &name, 20, || {
        check_serving(engine, &name, &url, metrics_port, &token, &state)
    })
}

/// Runs `check` on the running container `name` (printing its logs if the
/// check fails), then stops it with SIGTERM, allowing `grace_secs`; the
/// container's exit code must be 0.
fn check_then_stop(
    engine: &Engine,
    name: &str,
    grace_secs: u32,
    check: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let result = check();
    if result.is_err() {
        eprintln!("xtask: logs of {name}:");
        let mut logs = engine.cmd();
        logs.args(["logs", name]);
        let _ = logs.status();
    }
    result?;
    eprintln!("xtask: stopping {name} (SIGTERM, {grace_secs} s to exit)");
    let mut stop = engine.cmd();
    stop.args(["stop", "--time", &grace_secs.to_string(), name]);
    run(stop)?;
    let mut inspect = engine.cmd();
    inspect.args(["inspect", "--format", "{{.State.ExitCode}}", name]);
    let code = output(inspect).map_err(|e| anyhow::anyhow!("inspecting {name}: {e}"))?;
    anyhow::ensure!(
        code.trim() == "0",
        "{name} exited {} on SIGTERM, not 0",
        code.trim()
    );
    eprintln!("xtask: {name} exited 0 on SIGTERM");
    Ok(())
}

/// The `lockstep` CLI: the host's target/debug/lockstep if built, else the
/// image's own, in the container (`exec`).
fn client(
    engine: &Engine,
    container: &str,
    url: &str,
    token: Option<&str>,
    args: &[&str],
) -> Command {
    let host = target_dir().join("debug/lockstep");
    let mut cmd = if host.is_file() {
        Command::new(host)
    } else {
        let mut c = engine.cmd();
        c.args(["exec", "--env", "LOCKSTEP_API_TOKEN", container, "lockstep"]);
        c
    };
    cmd.env_remove("LOCKSTEP_API_TOKEN");
    if let Some(t) = token {
        cmd.env("LOCKSTEP_API_TOKEN", t);
    }
    // The container's published port: nothing proves who listens there, so
    // the client is told to send the token in clear (loopback only).
    cmd.env("LOCKSTEP_INSECURE_PLAINTEXT", "true");
    // `--server` is global, but clap takes it after the subcommand only.
    cmd.args(args).args(["--server", url]);
    cmd
}

/// Runs a client command; its stdout, or why it failed.
fn output(mut cmd: Command) -> Result<String, String> {
    match cmd.output() {
        Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(o) => Err(format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// Whether the container still runs.
fn running(engine: &Engine, name: &str) -> bool {
    let mut cmd = engine.cmd();
    cmd.args(["inspect", "--format", "{{.State.Running}}", name]);
    cmd.output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
}

/// Polls `f` every half second for up to `secs` while the container runs.
fn poll<T>(
    engine: &Engine,
    name: &str,
    secs: u64,
    what: &str,
    mut f: impl FnMut() -> Result<T, String>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let last = match f() {
            Ok(t) => return Ok(t),
            Err(e) => e,
        };
        if !running(engine, name) {
            bail!(
                "{what}: container {name} stopped (last answer: {})",
                last.trim()
            );
        }
        if Instant::now() > deadline {
            bail!("{what}: not within {secs} s (last answer: {})", last.trim());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn check_serving(
    engine: &Engine,
    name: &str,
    url: &str,
    metrics_port: u16,
    token: &str,
    state: &Path,
) -> anyhow::Result<()> {
    let status = poll(engine, name, 60, "the API answering", || {
        output(client(engine, name, url, Some(token), &["status"]))
    })?;
    eprintln!("xtask: `lockstep status` with the token:\n{status}");
    match output(client(engine, name, url, None, &["status"])) {
        Ok(out) => bail!("the API answered a call without the token:\n{out}"),
        Err(e) if e.to_lowercase().contains("authenticat") || e.contains("token") => {
            eprintln!("xtask: without the token: refused ({})", e.trim());
        }
        Err(e) => bail!("a call without the token failed, but not as unauthenticated: {e}"),
    }
    let replica = "image-check";
    let created = output(client(
        engine,
        name,
        url,
        Some(token),
        &[
            "replica",
            "create",
            replica,
            "--processes",
            "1",
            "--workers",
            "1",
        ],
    ))
    .map_err(|e| anyhow::anyhow!("creating replica {replica} in the container: {e}"))?;
    eprintln!("xtask: {}", created.trim());
    let status = poll(
        engine,
        name,
        60,
        "the replica serving (grpc.health.v1)",
        || {
            let out = output(client(engine, name, url, Some(token), &["status"]))?;
            let serving = out
                .lines()
                .any(|l| l.starts_with(replica) && l.trim_end().ends_with("yes"));
            if serving {
                Ok(out)
            } else {
                Err(out)
            }
        },
    )?;
    eprintln!("xtask: `lockstep status`:\n{status}");
    // /metrics asks its own read-only token, on loopback too: the one
    // `lockstep serve` made in its state directory (mounted from `state`).
    let metrics_token = std::fs::read_to_string(state.join("metrics.token"))
        .with_context(|| format!("reading the metrics token {name}'s serve made"))?;
    let metrics_token = metrics_token.lines().next().unwrap_or("").trim();
    let ok =
        |answer: &str| answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200");
    for (what, bearer) in [("no token", None), ("the API token", Some(token))] {
        let answer = http_get(metrics_port, "/metrics", bearer)?;
        if ok(&answer) {
            bail!("/metrics answered with {what}");
        }
        eprintln!(
            "xtask: /metrics with {what}: {}",
            answer.lines().next().unwrap_or("")
        );
    }
    let metrics = http_get(metrics_port, "/metrics", Some(metrics_token))?;
    if !ok(&metrics) {
        bail!(
            "/metrics did not answer 200 with the metrics token: {}",
            metrics.lines().next().unwrap_or("")
        );
    }
    eprintln!(
        "xtask: /metrics with the metrics token: 200, {} lines",
        metrics.lines().count()
    );
    Ok(())
}

/// A plain HTTP/1.0 GET on 127.0.0.1, with `token` as its bearer; the
/// whole answer.
fn http_get(port: u16, path: &str, token: Option<&str>) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to the metrics port {port}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}\r\n")?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::mirror_in;

    #[test]
    fn mirror_from_one_line_sources() {
        let text =
            "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main\n";
        assert_eq!(mirror_in(text).as_deref(), Some("http://m.example/debian"));
        assert_eq!(
            mirror_in("deb http://x/debian bookworm-updates main\n"),
            None
        );
    }

    #[test]
    fn mirror_from_deb822_sources() {
        let text = "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                    Types: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n";
        assert_eq!(
            mirror_in(text).as_deref(),
            Some("http://deb.debian.org/debian")
        );
    }
}
