//! The images the real Kubernetes node runs ([`crate::kube_node`]), as
//! archives containerd imports: no registry is reachable, so every image a
//! pod names must already be in containerd's `k8s.io` namespace.
//!
//! - `lockstep`: the image [`super::image`] builds (`lockstep:dev`), saved
//!   under a tag of its own, `docker.io/library/lockstep:dev-ID` (ID: the
//!   first 12 hex digits of the image's ID), the full name a pod asks for;
//! - the pause image (`localhost/lockstep-pause:1`): catatonit as `/pause`,
//!   the sandbox every pod's containers share.
//!
//! Written to `target/lockstep/node-images/` with `images.json`. The image
//! check of `cargo xtask test` saves them before it removes its image;
//! `cargo xtask kube` alone builds them when they are missing or older than
//! the debug binaries.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;

use super::{ensure_base, prepare_context, run, Engine, Times, IMAGE};
use crate::util::target_dir;

/// The pause (sandbox) image every pod of the real node starts with.
pub const PAUSE_IMAGE: &str = "localhost/lockstep-pause:1";

/// The saved images.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct NodeImages {
    /// The full name pods ask for (`docker.io/library/lockstep:dev-ID`).
    pub lockstep: String,
    /// Its docker archive.
    pub lockstep_archive: PathBuf,
    /// [`PAUSE_IMAGE`].
    pub pause: String,
    /// Its docker archive.
    pub pause_archive: PathBuf,
}

fn dir() -> PathBuf {
    target_dir().join("lockstep/node-images")
}

/// Saves `lockstep:dev` (built just before) and the pause image (built
/// here) as archives.
pub(super) fn save(engine: &Engine) -> anyhow::Result<NodeImages> {
    let dir = dir();
    // Prometheus' archive stays (it holds no lockstep binary).
    for stale in ["lockstep.tar", "pause.tar", "images.json"] {
        let _ = std::fs::remove_file(dir.join(stale));
    }
    std::fs::create_dir_all(&dir)?;
    let lockstep = format!(
        "docker.io/library/lockstep:dev-{}",
        super::short_id(engine)?
    );
    let lockstep_archive = dir.join("lockstep.tar");
    save_as(engine, IMAGE, &lockstep, &lockstep_archive)?;

    let catatonit = ["/usr/bin/catatonit", "/usr/libexec/podman/catatonit"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.is_file())
        .context("catatonit (podman's package brings it) is needed for the pause image")?;
    let pause_archive = dir.join("pause.tar");
    save_scratch_image(
        engine,
        PAUSE_IMAGE,
        catatonit,
        "/pause",
        "[\"/pause\", \"-P\"]",
        &pause_archive,
    )?;
    let images = NodeImages {
        lockstep,
        lockstep_archive,
        pause: PAUSE_IMAGE.to_string(),
        pause_archive,
    };
    std::fs::write(dir.join("images.json"), serde_json::to_vec_pretty(&images)?)?;
    eprintln!(
        "xtask: saved {} and {} for the real node in {}",
        images.lockstep,
        images.pause,
        dir.display()
    );
    Ok(images)
}

/// Builds image `name` from scratch holding `program` at `at` with
/// `entrypoint` (a JSON array), saves it into `archive` and removes it.
fn save_scratch_image(
    engine: &Engine,
    name: &str,
    program: &Path,
    at: &str,
    entrypoint: &str,
    archive: &Path,
) -> anyhow::Result<()> {
    let context = archive.with_extension("context");
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&context)?;
    std::fs::copy(program, context.join("program"))
        .with_context(|| format!("copying {}", program.display()))?;
    std::fs::write(
        context.join("Containerfile"),
        format!("FROM scratch\nCOPY program {at}\nENTRYPOINT {entrypoint}\n"),
    )?;
    let mut build = engine.build_cmd();
    build.args(["-t", name]).arg(&context);
    let built = run(build).and_then(|()| save_as(engine, name, name, archive));
    let mut rmi = engine.cmd();
    rmi.args(["rmi", "-f", name]);
    let _ = run(rmi);
    let _ = std::fs::remove_dir_all(&context);
    built
}

/// Prometheus' image for the real node's suite (the shipped scrape
/// configuration run by Prometheus itself).
pub const PROMETHEUS_IMAGE: &str = "localhost/lockstep-prometheus:1";

/// [`PROMETHEUS_IMAGE`] holding `binary` (tools/kube/prometheus), saved as
/// an archive, made again only when the binary is newer; the archive.
pub fn prometheus(binary: &Path) -> anyhow::Result<PathBuf> {
    let archive = dir().join("prometheus.tar");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if let (Some(saved), Some(built)) = (modified(&archive), modified(binary)) {
        if saved >= built {
            return Ok(archive);
        }
    }
    crate::prereqs::podman()?;
    let engine = Engine::find()?;
    std::fs::create_dir_all(dir())?;
    save_scratch_image(
        &engine,
        PROMETHEUS_IMAGE,
        binary,
        "/bin/prometheus",
        "[\"/bin/prometheus\"]",
        &archive,
    )?;
    Ok(archive)
}

/// `engine save` of `image` named `name` into `archive`.
fn save_as(engine: &Engine, image: &str, name: &str, archive: &Path) -> anyhow::Result<()> {
    if image != name {
        let mut tag = engine.cmd();
        tag.args(["tag", image, name]);
        run(tag)?;
    }
    let mut save = engine.cmd();
    save.args(["save", "--format", "docker-archive", "-o"])
        .arg(archive)
        .arg(name);
    let saved = run(save);
    if image != name {
        let mut untag = engine.cmd();
        untag.args(["untag", image, name]);
        let _ = run(untag);
    }
    saved
}

/// The saved images if they are there and newer than the binaries they
/// hold; else builds `lockstep:dev` from the host's binaries and saves
/// them (then removes the image).
pub fn ensure() -> anyhow::Result<NodeImages> {
    let newest_binary = ["lockstep", "lockstep-replica"]
        .iter()
        .filter_map(|b| {
            std::fs::metadata(target_dir().join("debug").join(b))
                .and_then(|m| m.modified())
                .ok()
        })
        .max();
    if let Ok(text) = std::fs::read(dir().join("images.json")) {
        if let Ok(images) = serde_json::from_slice::<NodeImages>(&text) {
            let saved = std::fs::metadata(&images.lockstep_archive).and_then(|m| m.modified());
            if let (Ok(saved), Some(newest)) = (saved, newest_binary) {
                if saved >= newest && images.pause_archive.is_file() {
                    eprintln!(
                        "xtask: {} (saved after the binaries were built) is up to date",
                        images.lockstep_archive.display()
                    );
                    return Ok(images);
                }
            }
        }
    }
    crate::prereqs::podman()?;
    let engine = Engine::find()?;
    let mut times = Times::default();
    ensure_base(&engine, &mut times)?;
    let context = target_dir().join("lockstep/image/context");
    prepare_context(&context, "debug")?;
    let mut build = engine.build_cmd();
    build
        .arg("-f")
        .arg(context.join("Containerfile"))
        .args(["--target", "runtime-prebuilt", "-t", IMAGE])
        .args(super::oci_build_args()?)
        .arg(&context);
    run(build)?;
    let saved = save(&engine);
    let mut rmi: Command = engine.cmd();
    rmi.args(["rmi", "-f", IMAGE]);
    let _ = run(rmi);
    let _ = std::fs::remove_dir_all(&context);
    times.close();
    saved
}
