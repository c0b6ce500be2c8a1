//! `buf` for the API (`cargo xtask buf`, and a step of `cargo xtask test`):
//! `buf lint` and `buf breaking` over `proto/` with the repository's
//! `buf.yaml`, against the newest release in `RELEASES`
//! (docs/compatibility.md).
//!
//! - buf itself: the pinned version from PyPI's `buf-bin` wheel (which ships
//!   the buf binary), installed by pip with the wheel's hash checked into
//!   `target/buf/VERSION/` and reused from there.
//! - The release's side: its `proto/` read from git (`git show
//!   COMMIT:PATH`, no tag needed) into `target/buf/against/COMMIT/`. A clone
//!   without that commit (shallow) fetches it from `origin`, else the step
//!   fails naming the release and the commit.
//! - The breaks a release already made on purpose are listed here
//!   ([`ACCEPTED`], [`MOVED`]), each for the release it is against: every
//!   other break fails the step, and so does a listed one that buf no longer
//!   reports (the list says exactly what changed). Types that moved to
//!   another package are compared where they went.
//! - A self-test plants breaks in a copy of `proto/` and checks each fails
//!   the step: the filtering here cannot hide a break unseen.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context};

use crate::util::{root, target_dir};

/// buf's version: `buf-bin` on PyPI of this version ships buf of the same.
const VERSION: &str = "1.75.0";

/// The sha256 of the `buf-bin` wheels pip may choose (Linux x86_64 and
/// aarch64): pip refuses any other file.
const WHEEL_SHA256: [&str; 2] = [
    "6fd3ecb1694b6f5bcdfb9bef5297b330ffb9731b95445a42944c1b6158428101",
    "159e994efa072a7f3c84e5b90cf57f7b9a5e9f6387121bfc70e82ec7167d5694",
];

/// A break that shipped, or will ship, on purpose: buf reports `rule` on
/// `path` with a message starting with `message` when comparing today's
/// `proto/` with `release`.
struct Accepted {
    release: &'static str,
    path: &'static str,
    rules: &'static [&'static str],
    message: &'static str,
}

const COMPUTE: &str = "proto/lockstep/compute/v1/compute.proto";

/// The breaks of v0.3 against v0.2.0, besides the plan language's move
/// ([`MOVED`]). The wire is unchanged for each (the golden v0.2.0
/// encodings, `crates/protocol/tests/golden.rs`, decode and re-encode byte
/// for byte); the JSON mapping and the generated code are not.
const ACCEPTED: &[Accepted] = &[
    // `Export.plan` (an embedded lockstep.compute.v1.Plan) became
    // `Export.description`, the dataflow family's bytes: length-delimited
    // both, the same bytes on the wire; in JSON the key `plan` and its
    // object became `description` and a base64 string.
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &["FIELD_SAME_NAME"],
        message: r#"Field "2" on message "Export" changed name from "plan" to "description"."#,
    },
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &["FIELD_SAME_JSON_NAME"],
        message: r#"Field "2" with name "description" on message "Export" changed option "json_name" from "plan" to "description"."#,
    },
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &["FIELD_WIRE_JSON_COMPATIBLE_TYPE", "FIELD_SAME_TYPE"],
        message: r#"Field "2" with name "description" on message "Export" changed type from "message" to "bytes"."#,
    },
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &["FIELD_SAME_CARDINALITY"],
        message: r#"Field "2" with name "description" on message "Export" changed cardinality from "optional with explicit presence" to "optional with implicit presence"."#,
    },
    // `Update.row` and `Row.values`, packed `repeated int64`, became
    // singular `bytes` (a row is its family's bytes; the built-in family's
    // are the packed varints, the same bytes on the wire from any packing
    // encoder); in JSON a list of numbers became a base64 string.
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &[
            "FIELD_WIRE_JSON_COMPATIBLE_CARDINALITY",
            "FIELD_SAME_CARDINALITY",
        ],
        message: r#"Field "1" with name "row" on message "Update" changed cardinality from "repeated" to "optional with implicit presence"."#,
    },
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &["FIELD_WIRE_JSON_COMPATIBLE_TYPE", "FIELD_SAME_TYPE"],
        message: r#"Field "1" with name "row" on message "Update" changed type from "int64" to "bytes"."#,
    },
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &[
            "FIELD_WIRE_JSON_COMPATIBLE_CARDINALITY",
            "FIELD_SAME_CARDINALITY",
        ],
        message: r#"Field "1" with name "values" on message "Row" changed cardinality from "repeated" to "optional with implicit presence"."#,
    },
    Accepted {
        release: "v0.2.0",
        path: COMPUTE,
        rules: &["FIELD_WIRE_JSON_COMPATIBLE_TYPE", "FIELD_SAME_TYPE"],
        message: r#"Field "1" with name "values" on message "Row" changed type from "int64" to "bytes"."#,
    },
];

/// Messages and enums that moved from one package (and file) to another
/// after `release`, under the same names: their deletion from the old
/// package is accepted, and they are compared with the release's where
/// they went (the release's file read as if it declared the new package).
struct Moved {
    release: &'static str,
    from_path: &'static str,
    from_package: &'static str,
    to_path: &'static str,
    to_package: &'static str,
    messages: &'static [&'static str],
    enums: &'static [&'static str],
}

/// The plan language left the compute protocol for its own package after
/// v0.2.0 (the compute protocol carries its bytes, `Export.description`).
/// The wire carries no type names, so nothing a process sees changed; the
/// generated code of lockstep.compute.v1 lost these types.
const MOVED: &[Moved] = &[Moved {
    release: "v0.2.0",
    from_path: "proto/lockstep/compute/v1/compute.proto",
    from_package: "lockstep.compute.v1",
    to_path: "proto/lockstep/plan/v1/plan.proto",
    to_package: "lockstep.plan.v1",
    messages: &[
        "Aggregate",
        "Arrange",
        "BinaryExpr",
        "Expr",
        "Filter",
        "Get",
        "Join",
        "Map",
        "Plan",
        "Predicate",
        "Reduce",
    ],
    enums: &["AggregateKind", "CompareOp"],
}];

/// A break as buf reports it (`--error-format json`).
#[derive(Debug)]
struct Report {
    path: String,
    rule: String,
    message: String,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.path, self.rule, self.message)
    }
}

/// The newest release in `RELEASES`.
struct Release {
    version: String,
    commit: String,
}

/// Installs (or reuses) buf, runs `buf lint` and `buf breaking` against
/// the newest release, and checks that the check catches planted breaks.
pub fn check() -> anyhow::Result<()> {
    crate::util::step("buf lint and buf breaking against the newest release (buf.yaml)");
    let started = Instant::now();
    let buf = install()?;
    let root = root();

    eprintln!("xtask: buf: $ buf lint (buf.yaml: STANDARD, exceptions listed there)");
    let out = Command::new(&buf)
        .arg("lint")
        .current_dir(&root)
        .output()
        .context("running buf lint")?;
    if !out.status.success() {
        bail!(
            "buf lint found problems (fix them, or add an exception with its reason to buf.yaml):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    eprintln!("xtask: buf: lint: ok");

    let release = newest_release(&root)?;
    let against = release_protos(&root, &release)?;
    let short = &release.commit[..release.commit.len().min(9)];
    eprintln!(
        "xtask: buf: $ buf breaking --against {} (release {} = {short}, from RELEASES)",
        against.display(),
        release.version
    );
    let problems = breaking_problems(&buf, &root, &against, &release)?;
    if !problems.is_empty() {
        bail!(
            "buf breaking against release {} ({short}): {} problem(s):\n  {}\n\
             A break of a released API goes in a new package version (lockstep.*.v2) or, \
             for the compute protocol, a new field gated on the negotiated version; not \
             into ACCEPTED (docs/compatibility.md, \"The policy\").",
            release.version,
            problems.len(),
            problems.join("\n  ")
        );
    }
    let mut fields = std::collections::BTreeSet::new();
    let mut accepted = 0;
    for a in ACCEPTED.iter().filter(|a| a.release == release.version) {
        accepted += a.rules.len();
        // `Field "N" ... on message "M" ...`
        let quoted = |after: &str| a.message.split(after).nth(1)?.split('"').next();
        if let (Some(number), Some(message)) = (quoted("Field \""), quoted("on message \"")) {
            fields.insert(format!("{message} field {number}"));
        }
    }
    let moved: Vec<String> = MOVED
        .iter()
        .filter(|m| m.release == release.version)
        .map(|m| {
            format!(
                "{} types moved from {} to {}",
                m.messages.len() + m.enums.len(),
                m.from_package,
                m.to_package
            )
        })
        .collect();
    eprintln!(
        "xtask: buf: breaking against {}: ok; accepted (xtask/src/buf.rs): {accepted} reports \
         on {}{}; nothing else",
        release.version,
        fields.into_iter().collect::<Vec<_>>().join(", "),
        moved.iter().map(|m| format!("; {m}")).collect::<String>()
    );
    let stale = ACCEPTED
        .iter()
        .filter(|a| a.release != release.version)
        .count()
        + MOVED
            .iter()
            .filter(|m| m.release != release.version)
            .count();
    if stale > 0 {
        eprintln!(
            "xtask: buf: {stale} accepted break(s) in xtask/src/buf.rs are against an older \
             release than {}: they no longer apply and can be deleted",
            release.version
        );
    }

    let planted = self_test(&buf, &root, &against, &release)?;
    eprintln!("xtask: buf: self-test: each of {planted} planted breaks fails the check");
    eprintln!("xtask: buf: ok in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// buf `VERSION` at `target/buf/VERSION/bin/buf`, installed by pip from
/// the `buf-bin` wheel unless already there.
fn install() -> anyhow::Result<PathBuf> {
    let dir = target_dir().join("buf").join(VERSION);
    let bin = dir.join("bin/buf");
    if version_of(&bin).as_deref() == Some(VERSION) {
        eprintln!("xtask: buf: buf {VERSION} at {} (cached)", bin.display());
        return Ok(bin);
    }
    let partial = target_dir().join("buf").join(format!("{VERSION}.partial"));
    if partial.exists() {
        std::fs::remove_dir_all(&partial)
            .with_context(|| format!("removing {}", partial.display()))?;
    }
    std::fs::create_dir_all(&partial)?;
    let requirements = target_dir()
        .join("buf")
        .join(format!("requirements-{VERSION}.txt"));
    let hashes: String = WHEEL_SHA256
        .iter()
        .map(|h| format!(" --hash=sha256:{h}"))
        .collect();
    std::fs::write(&requirements, format!("buf-bin=={VERSION}{hashes}\n"))?;
    eprintln!(
        "xtask: buf: installing buf {VERSION} (PyPI buf-bin=={VERSION}, hash-checked) into {}",
        dir.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--only-binary=:all:",
            "--require-hashes",
            "--target",
        ])
        .arg(&partial)
        .arg("-r")
        .arg(&requirements)
        .env("PIP_ROOT_USER_ACTION", "ignore")
        .status();
    match status {
        Ok(s) if s.success() => {}
        other => bail!(
            "could not install buf {VERSION}: `python3 -m pip install buf-bin=={VERSION}` \
             {} (needs python3 with pip, apt-get install python3-pip, and PyPI); \
             or put buf {VERSION} at {}",
            match other {
                Ok(s) => format!("failed with {s}"),
                Err(e) => format!("could not start: {e}"),
            },
            bin.display()
        ),
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::rename(&partial, &dir)
        .with_context(|| format!("moving {} to {}", partial.display(), dir.display()))?;
    let got = version_of(&bin);
    ensure!(
        got.as_deref() == Some(VERSION),
        "{} reports version {got:?} after installing buf-bin=={VERSION}",
        bin.display()
    );
    Ok(bin)
}

/// What `buf --version` prints, if it runs.
fn version_of(bin: &Path) -> Option<String> {
    let out = Command::new(bin).arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The last release line of `RELEASES` (`<version> <commit> <protocol>`).
fn newest_release(root: &Path) -> anyhow::Result<Release> {
    let text = std::fs::read_to_string(root.join("RELEASES")).context("reading RELEASES")?;
    let line = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'))
        .context("RELEASES names no release")?;
    let mut fields = line.split_whitespace();
    let (Some(version), Some(commit)) = (fields.next(), fields.next()) else {
        bail!("RELEASES: {line:?} is not `<version> <commit> <protocol version>`");
    };
    ensure!(
        commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit()),
        "RELEASES: {version}'s commit {commit:?} is not a full commit hash"
    );
    Ok(Release {
        version: version.to_string(),
        commit: commit.to_string(),
    })
}

/// `git ARGS` in `root`: its stdout, or an error with its stderr.
fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("git")
        .current_dir(root)
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .with_context(|| format!("running git {}", args.join(" ")))?;
    ensure!(
        out.status.success(),
        "git {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The release's `proto/`, written from git into
/// `target/buf/against/COMMIT/proto` (reused once complete). A commit this
/// clone lacks is fetched from `origin`; if that fails too, the error names
/// the release, the commit and what was tried.
fn release_protos(root: &Path, release: &Release) -> anyhow::Result<PathBuf> {
    let dir = target_dir()
        .join("buf/against")
        .join(&release.commit)
        .join("proto");
    let done = dir.join(".complete");
    if done.exists() {
        return Ok(dir);
    }
    let object = format!("{}^{{commit}}", release.commit);
    if git(root, &["cat-file", "-e", &object]).is_err() {
        let shallow = git(root, &["rev-parse", "--is-shallow-repository"])
            .map(|s| s.trim() == "true")
            .unwrap_or(false);
        let tried = if git(root, &["remote", "get-url", "origin"]).is_ok() {
            eprintln!(
                "xtask: buf: release {} ({}) is not in this clone{}; fetching it from origin",
                release.version,
                release.commit,
                if shallow { " (shallow)" } else { "" }
            );
            let mut args = vec!["fetch", "--quiet", "--no-tags"];
            if shallow {
                args.push("--depth=1");
            }
            args.extend(["origin", release.commit.as_str()]);
            match git(root, &args) {
                Ok(_) => "fetched from origin".to_string(),
                Err(e) => format!("`git {}` failed: {e}", args.join(" ")),
            }
        } else {
            "no remote `origin` to fetch it from".to_string()
        };
        ensure!(
            git(root, &["cat-file", "-e", &object]).is_ok(),
            "buf breaking needs release {} (commit {}, from RELEASES), which this {}clone does \
             not have ({tried}): fetch it (`git fetch origin {}`, or `git fetch --unshallow`) \
             and run again",
            release.version,
            release.commit,
            if shallow { "shallow " } else { "" },
            release.commit
        );
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let files = git(
        root,
        &[
            "ls-tree",
            "-r",
            "--name-only",
            &release.commit,
            "--",
            "proto",
        ],
    )?;
    let mut count = 0;
    for path in files.lines().filter(|p| p.ends_with(".proto")) {
        let text = git(root, &["show", &format!("{}:{path}", release.commit)])?;
        let rel = path.strip_prefix("proto/").unwrap_or(path);
        let out = dir.join(rel);
        std::fs::create_dir_all(out.parent().expect("a file under proto/"))?;
        std::fs::write(&out, text)?;
        count += 1;
    }
    ensure!(
        count > 0,
        "release {} ({}) has no .proto file under proto/",
        release.version,
        release.commit
    );
    // Its own workspace, so that buf does not take it for a directory of
    // the repository's.
    std::fs::write(dir.join("buf.yaml"), "version: v2\n")?;
    std::fs::write(&done, "")?;
    Ok(dir)
}

/// `buf breaking` of the workspace at `workspace` (its buf.yaml's rules)
/// against the module at `against`: every break buf reports.
fn breaking(buf: &Path, workspace: &Path, against: &Path) -> anyhow::Result<Vec<Report>> {
    let against = std::path::absolute(against)?;
    let out = Command::new(buf)
        .current_dir(workspace)
        .arg("breaking")
        .arg("--against")
        .arg(&against)
        .args(["--error-format", "json"])
        .output()
        .context("running buf breaking")?;
    // 0: nothing to report; 100: breaks, one JSON object per line.
    if !(out.status.success() || out.status.code() == Some(100)) {
        bail!(
            "buf breaking --against {} failed ({}): {}{}",
            against.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut reports = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("buf's output line {line:?}"))?;
        let field = |k: &str| v.get(k).and_then(|s| s.as_str()).unwrap_or("").to_string();
        reports.push(Report {
            path: field("path"),
            rule: field("type"),
            message: field("message"),
        });
    }
    Ok(reports)
}

/// The problems of `workspace`'s `proto/` against `release` (its protos at
/// `against`): every break not accepted for that release, every accepted
/// one buf no longer reports, and every change to a moved type.
fn breaking_problems(
    buf: &Path,
    workspace: &Path,
    against: &Path,
    release: &Release,
) -> anyhow::Result<Vec<String>> {
    let reports = breaking(buf, workspace, against)?;
    let mut expected: Vec<(&str, &str, String)> = Vec::new();
    for a in ACCEPTED.iter().filter(|a| a.release == release.version) {
        for rule in a.rules {
            expected.push((rule, a.path, a.message.to_string()));
        }
    }
    let moved: Vec<&Moved> = MOVED
        .iter()
        .filter(|m| m.release == release.version)
        .collect();
    for m in &moved {
        let kinds = [
            ("PACKAGE_MESSAGE_NO_DELETE", "message", m.messages),
            ("PACKAGE_ENUM_NO_DELETE", "enum", m.enums),
        ];
        for (rule, kind, names) in kinds {
            for name in names {
                expected.push((
                    rule,
                    m.from_path,
                    format!(
                        "Previously present {kind} \"{name}\" was deleted from package \"{}\".",
                        m.from_package
                    ),
                ));
            }
        }
    }
    let mut seen = vec![false; expected.len()];
    let mut problems = Vec::new();
    for r in &reports {
        let hit = expected.iter().position(|(rule, path, message)| {
            r.rule == *rule && r.path == *path && r.message.starts_with(message.as_str())
        });
        match hit {
            Some(i) => seen[i] = true,
            None => problems.push(format!("breaks {}: {r}", release.version)),
        }
    }
    for ((rule, path, message), seen) in expected.iter().zip(seen) {
        if !seen {
            problems.push(format!(
                "accepted in xtask/src/buf.rs but no longer reported (proto/ no longer makes \
                 exactly this change; fix or remove the entry): {path}: {rule}: {message}"
            ));
        }
    }
    for m in moved {
        problems.extend(moved_problems(buf, workspace, against, release, m)?);
    }
    Ok(problems)
}

/// The changes to the types of `m` since `release`: the release's file that
/// held them, read as if it declared the new package and lived where they
/// went, against today's. Of its other types (which did not move), only
/// their absence is reported, and ignored.
fn moved_problems(
    buf: &Path,
    workspace: &Path,
    against: &Path,
    release: &Release,
    m: &Moved,
) -> anyhow::Result<Vec<String>> {
    let dir = target_dir()
        .join("buf/moved")
        .join(&release.commit)
        .join(m.to_package);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    let from = against.join(m.from_path.strip_prefix("proto/").unwrap_or(m.from_path));
    let text = std::fs::read_to_string(&from).with_context(|| format!("{}", from.display()))?;
    let declaration = format!("package {};", m.from_package);
    ensure!(
        text.matches(&declaration).count() == 1,
        "{} of release {} does not declare `{declaration}` once",
        m.from_path,
        release.version
    );
    let text = text.replace(&declaration, &format!("package {};", m.to_package));
    let to = dir.join(m.to_path.strip_prefix("proto/").unwrap_or(m.to_path));
    std::fs::create_dir_all(to.parent().expect("a file under proto/"))?;
    std::fs::write(&to, text)?;
    std::fs::write(dir.join("buf.yaml"), "version: v2\n")?;
    let moved_name = |message: &str| {
        // `Previously present message "Name" was deleted ...`, nested
        // types as "Outer.Inner".
        let name = message.split('"').nth(1).unwrap_or("");
        let outer = name.split('.').next().unwrap_or("");
        m.messages.contains(&outer) || m.enums.contains(&outer)
    };
    Ok(breaking(buf, workspace, &dir)?
        .into_iter()
        .filter(|r| {
            let deletion = matches!(
                r.rule.as_str(),
                "PACKAGE_MESSAGE_NO_DELETE" | "PACKAGE_ENUM_NO_DELETE"
            );
            !deletion || moved_name(&r.message)
        })
        .map(|r| {
            format!(
                "a type moved from {} to {} changed since {} (compared where it went): {r}",
                m.from_package, m.to_package, release.version
            )
        })
        .collect())
}

/// A break planted in a copy of `proto/`: `from` replaced by `to` in
/// `path`; the check must then name a problem containing every one of
/// `expect`.
struct Plant {
    what: &'static str,
    path: &'static str,
    from: &'static str,
    to: &'static str,
    expect: &'static [&'static str],
}

const ENVIRONMENT: &str = "proto/lockstep/environment/v1/environment.proto";
const PLAN: &str = "proto/lockstep/plan/v1/plan.proto";

/// The breaks the hand-written descriptor check planted, and more.
const PLANTS: &[Plant] = &[
    Plant {
        what: "a field renumbered",
        path: COMPUTE,
        from: "  uint64 replica_id = 4;",
        to: "  uint64 replica_id = 40;",
        expect: &[
            "FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED",
            r#""4" with name "replica_id""#,
            r#""Hello""#,
        ],
    },
    Plant {
        what: "a field retyped",
        path: COMPUTE,
        from: "  uint64 timestamp = 3;",
        to: "  string timestamp = 3;",
        expect: &["FIELD_WIRE_JSON_COMPATIBLE_TYPE", r#"message "Peek""#],
    },
    Plant {
        what: "a field retyped between wire- and JSON-compatible scalars",
        path: COMPUTE,
        from: "  uint32 process_index = 5;",
        to: "  int32 process_index = 5;",
        expect: &[
            "FIELD_SAME_TYPE",
            r#"message "Hello""#,
            r#"from "uint32" to "int32""#,
        ],
    },
    Plant {
        what: "a field retyped to another message",
        path: COMPUTE,
        from: "  DataflowDescription dataflow = 1;",
        to: "  Peek dataflow = 1;",
        expect: &["FIELD_SAME_TYPE", r#"message "CreateDataflow""#],
    },
    Plant {
        what: "a field relabeled",
        path: COMPUTE,
        from: "  uint64 applied_seqno = 4;",
        to: "  repeated uint64 applied_seqno = 4;",
        expect: &["FIELD_SAME_CARDINALITY", r#"name "applied_seqno""#],
    },
    Plant {
        what: "a field removed without reserving its number",
        path: COMPUTE,
        from: "  repeated uint64 installed = 7;",
        to: "",
        expect: &[
            "FIELD_NO_DELETE_UNLESS_NUMBER_RESERVED",
            r#""7" with name "installed""#,
            r#""Status""#,
        ],
    },
    Plant {
        what: "an enum value renumbered",
        path: COMPUTE,
        from: "  ERROR_KIND_STALE_EPOCH = 2;",
        to: "  ERROR_KIND_STALE_EPOCH = 42;",
        expect: &[
            "ENUM_VALUE_NO_DELETE_UNLESS_NUMBER_RESERVED",
            r#""ErrorKind""#,
        ],
    },
    Plant {
        what: "a field renamed (its JSON name)",
        path: COMPUTE,
        from: "  string debug_name = 5;",
        to: "  string debug_label = 5;",
        expect: &["FIELD_SAME_NAME", r#"message "DataflowDescription""#],
    },
    Plant {
        what: "a row made `repeated bytes` (not the accepted change)",
        path: COMPUTE,
        from: "  bytes row = 1;",
        to: "  repeated bytes row = 1;",
        expect: &["FIELD_SAME_CARDINALITY", r#"name "row""#],
    },
    Plant {
        what: "an RPC removed",
        path: ENVIRONMENT,
        from: "  rpc GetStatus(GetStatusRequest) returns (GetStatusResponse);\n",
        to: "",
        expect: &["RPC_NO_DELETE", r#""GetStatus""#],
    },
    Plant {
        what: "a moved type changed where it went",
        path: PLAN,
        from: "  COMPARE_OP_LT = 3;",
        to: "  COMPARE_OP_LT = 30;",
        expect: &[
            "ENUM_VALUE_NO_DELETE_UNLESS_NUMBER_RESERVED",
            r#""CompareOp""#,
        ],
    },
];

/// Plants [`PLANTS`] in a copy of buf.yaml and `proto/` (under
/// `target/buf/planted`) and checks that the check names each.
fn self_test(buf: &Path, root: &Path, against: &Path, release: &Release) -> anyhow::Result<usize> {
    let copy = target_dir().join("buf/planted");
    if copy.exists() {
        std::fs::remove_dir_all(&copy)?;
    }
    crate::util::copy_tree(&root.join("proto"), &copy.join("proto"))?;
    std::fs::copy(root.join("buf.yaml"), copy.join("buf.yaml"))?;
    for p in PLANTS {
        let file = copy.join(p.path);
        let text = std::fs::read_to_string(&file)?;
        ensure!(
            text.matches(p.from).count() == 1,
            "buf self-test: {:?} ({}) is not in {} exactly once: update PLANTS in xtask/src/buf.rs",
            p.from,
            p.what,
            p.path
        );
        std::fs::write(&file, text.replace(p.from, p.to))?;
    }
    let problems = breaking_problems(buf, &copy, against, release)?;
    let missed: Vec<&str> = PLANTS
        .iter()
        .filter(|p| {
            !problems
                .iter()
                .any(|line| p.expect.iter().all(|e| line.contains(e)))
        })
        .map(|p| p.what)
        .collect();
    ensure!(
        missed.is_empty(),
        "buf self-test: planted breaks not caught: {missed:?}; the check reported:\n  {}",
        problems.join("\n  ")
    );
    Ok(PLANTS.len())
}
