//! Two doors each seed tries as another local user ([`OTHER_UID`]), after
//! its attack phase (docs/threat-model.md names both):
//!
//! - **a state directory another user made and filled**: in a sticky
//!   world-writable directory (as `/tmp` is) the other user makes `state`
//!   (0700, its own) and plants an API token and a metrics token in it;
//!   `lockstep serve --state-dir` on it must refuse it, naming that owner.
//!   If it serves, the planted token is tried: R1 is broken either way
//!   (the negative control `unowned-state` serves with
//!   `lockstep_environment::private::ANY_OWNER_ENV`: no owner checked);
//! - **the CLI's token offered to a listener the other user holds**: the
//!   other user listens on a loopback port and speaks HTTP/2; `lockstep
//!   replica list --server http://127.0.0.1:THAT_PORT --state-dir STATE`
//!   (the environment's own state directory, so the token is at hand) must
//!   refuse to send the token, and the listener must read no
//!   `authorization` header (the negative control `unproven-server` runs
//!   the CLI with [`UNPROVEN_SERVER_ENV`]).
//!
//! Both need root (a uid must be switched).

use super::*;

use other_user::{as_other_user, OTHER_UID};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

/// The first argument of the planter run as the other user: `PLANT_ARG
/// DIR` makes `DIR` and plants the tokens in it.
pub(crate) const PLANT_ARG: &str = "--plant-as-other-user";

/// The first argument of the squatter run as the other user: it listens on
/// a loopback port, prints it, and reads the first request's
/// `authorization` header until its input closes.
pub(crate) const SQUAT_ARG: &str = "--squat-as-other-user";

/// The CLI's switch (`UNPROVEN_SERVER_ENV` in `crates/cli/src/api_client.rs`,
/// a test build only): set, it sends its token over plain HTTP to any
/// listener (the negative control `unproven-server`).
pub(crate) const UNPROVEN_SERVER_ENV: &str = "LOCKSTEP_EXPERIMENT_UNPROVEN_SERVER";

/// The API token the other user plants (long enough, no placeholder: a
/// token `lockstep serve` would take).
const PLANTED_TOKEN: &str = "planted-by-another-user-0f1e2d3c4b5a69788796a5b4";

/// The bound on each step of a door.
const DOOR_STEP: Duration = Duration::from_secs(20);

/// The planter, run as the other user: makes `DIR` (0700) and plants an API
/// token and a metrics token in it (0600); prints `planted`.
pub(crate) fn plant_main(args: &[String]) -> ! {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let [dir] = args else {
        eprintln!("usage: {PLANT_ARG} DIR");
        std::process::exit(2);
    };
    let dir = Path::new(dir);
    let planted = (|| -> std::io::Result<()> {
        std::fs::DirBuilder::new().mode(0o700).create(dir)?;
        for (file, token) in [
            (lockstep_environment::private::API_TOKEN_FILE, PLANTED_TOKEN),
            (
                lockstep_environment::private::METRICS_TOKEN_FILE,
                "planted-metrics-token-0f1e2d3c4b5a6978",
            ),
        ] {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dir.join(file))?;
            std::io::Write::write_all(&mut f, token.as_bytes())?;
        }
        Ok(())
    })();
    match planted {
        Ok(()) => {
            println!("planted");
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("planting in {}: {e}", dir.display());
            std::process::exit(1)
        }
    }
}

/// What the squatter read.
#[derive(serde::Serialize, serde::Deserialize, Debug, Default)]
struct Squatted {
    /// Whether anything connected before its input closed.
    connected: bool,
    /// The `authorization` header of the first request, if one came.
    authorization: Option<String>,
}

/// The squatter, run as the other user: listens on a loopback port,
/// prints `port N`, then serves HTTP/2 to whatever connects until its
/// input closes, and prints what it read ([`Squatted`]) as a JSON line.
pub(crate) fn squat_main() -> ! {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let squatted = runtime.block_on(async {
        let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("binding a loopback port: {e}");
                std::process::exit(1);
            }
        };
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let mut out = tokio::io::stdout();
        let _ = out.write_all(format!("port {port}\n").as_bytes()).await;
        let _ = out.flush().await;
        let mut input = tokio::io::stdin();
        let mut sink = [0u8; 64];
        let mut s = Squatted::default();
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((tcp, _)) = accepted else { return s };
                s.connected = true;
                let read = lockstep_chaos::unproven::first_authorization(tcp);
                s.authorization = tokio::time::timeout(Duration::from_secs(10), read)
                    .await
                    .ok()
                    .flatten();
            }
            _ = input.read(&mut sink) => {}
        }
        s
    });
    println!("{}", serde_json::to_string(&squatted).expect("serializes"));
    std::process::exit(0)
}

/// Runs both doors as the other user. Each finding is recorded in
/// `shared`; a door that could not be tried is a harness error.
pub(crate) async fn run(state: &Path, api: &Api, variant: Variant, seed: u64, shared: &Shared) {
    for door in [
        planted_state_dir(variant, seed, shared).await,
        token_to_a_squatter(state, api, variant, shared).await,
    ] {
        if let Err(f) = door {
            shared.fail(f);
        }
    }
}

/// Output of a child run as the other user, within [`DOOR_STEP`].
async fn output_of(cmd: &mut tokio::process::Command, what: &str) -> Result<String, Failure> {
    let out = tokio::time::timeout(DOOR_STEP, cmd.output())
        .await
        .map_err(|_| Failure::Harness(format!("{what} did not end within {DOOR_STEP:?}")))?
        .map_err(|e| Failure::Harness(format!("{what}: {e}")))?;
    if !out.status.success() {
        return Err(Failure::Harness(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The planted state directory: refused, naming its owner (a pass); served
/// (a violation of R1, with what the planted token got).
async fn planted_state_dir(variant: Variant, seed: u64, shared: &Shared) -> Result<(), Failure> {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::Builder::new()
        .prefix("lockstep-hostile-sticky-")
        .tempdir()
        .map_err(|e| Failure::Harness(format!("a sticky directory: {e}")))?;
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o1777))
        .map_err(|e| Failure::Harness(format!("making {} 1777: {e}", base.path().display())))?;
    let planted = base.path().join("state");
    let said = output_of(
        as_other_user(PLANT_ARG).arg(&planted),
        &format!("uid {OTHER_UID}'s planting"),
    )
    .await?;
    if said.trim() != "planted" {
        return Err(Failure::Harness(format!(
            "uid {OTHER_UID}'s planting said {said:?}"
        )));
    }
    let _teardown = seed::Teardown(planted.join(lockstep_environment::ORCHESTRATOR_DIR));
    let log = env::out_dir().join(format!("{}-seed-{seed}.planted.log", variant.name()));
    let refusal = format!("owned by uid {OTHER_UID}");
    match Env::start(&planted, &log, variant).await {
        Err(e) if e.contains(&refusal) => {
            shared.note(format!(
                "a state directory uid {OTHER_UID} made and filled: refused"
            ));
            Ok(())
        }
        Err(e) => Err(Failure::Harness(format!(
            "lockstep serve on the planted state directory failed, but not naming its owner ({refusal}): {e}"
        ))),
        Ok(mut served) => {
            let answered = async {
                let mut c = served.api.client_with(Some(PLANTED_TOKEN), DOOR_STEP).await?;
                c.list_replicas(proto::ListReplicasRequest::default())
                    .await
                    .map_err(|s| code(&s))
            };
            let got = match tokio::time::timeout(DOOR_STEP, answered).await {
                Ok(Ok(_)) => "its planted API token was served ListReplicas".to_string(),
                Ok(Err(e)) => format!("its planted API token got {e}"),
                Err(_) => "its planted API token got no answer".to_string(),
            };
            served.kill().await;
            Err(violation(
                "R1",
                format!(
                    "lockstep serve ran on a state directory uid {OTHER_UID} made and filled: {got}"
                ),
            ))
        }
    }
}

/// The CLI given the environment's state directory and a squatter's port:
/// refuses to send the token (a pass); a squatter that reads it is a
/// violation of R1.
async fn token_to_a_squatter(
    state: &Path,
    api: &Api,
    variant: Variant,
    shared: &Shared,
) -> Result<(), Failure> {
    let mut squatter = as_other_user(SQUAT_ARG)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Failure::Harness(format!("running the squatter as uid {OTHER_UID}: {e}")))?;
    let stdout = squatter
        .stdout
        .take()
        .ok_or_else(|| Failure::Harness("the squatter's output was not piped".into()))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let first = tokio::time::timeout(DOOR_STEP, lines.next_line()).await;
    let port: u16 = match first {
        Ok(Ok(Some(l))) => l
            .strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| Failure::Harness(format!("the squatter said {l:?}")))?,
        other => {
            return Err(Failure::Harness(format!(
                "the squatter named no port: {other:?}"
            )))
        }
    };
    let mut cli = tokio::process::Command::new(env::lockstep_binary());
    cli.args(["replica", "list", "--server"])
        .arg(format!("http://127.0.0.1:{port}"))
        .arg("--state-dir")
        .arg(state)
        .env_remove("LOCKSTEP_API_TOKEN")
        .env_remove("LOCKSTEP_TOKEN_FILE")
        .env_remove("LOCKSTEP_STATE_DIR")
        .env_remove(UNPROVEN_SERVER_ENV)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if variant == Variant::UnprovenServer {
        cli.env(UNPROVEN_SERVER_ENV, "1");
    }
    let out = tokio::time::timeout(DOOR_STEP, cli.output())
        .await
        .map_err(|_| {
            Failure::Harness(format!(
                "lockstep replica list did not end within {DOOR_STEP:?}"
            ))
        })?
        .map_err(|e| Failure::Harness(format!("lockstep replica list: {e}")))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Its input closed: the squatter says what it read and ends.
    drop(squatter.stdin.take());
    let said = tokio::time::timeout(DOOR_STEP, lines.next_line()).await;
    let _ = tokio::time::timeout(DOOR_STEP, squatter.wait()).await;
    let squatted: Squatted = match said {
        Ok(Ok(Some(l))) => serde_json::from_str(&l)
            .map_err(|e| Failure::Harness(format!("the squatter said {l:?}: {e}")))?,
        other => {
            return Err(Failure::Harness(format!(
                "the squatter said nothing at the end: {other:?}"
            )))
        }
    };
    if squatted.authorization.as_deref() == Some(&format!("Bearer {}", api.token)) {
        return Err(violation(
            "R1",
            format!(
                "lockstep replica list sent the API token to a loopback port uid {OTHER_UID} listened on"
            ),
        ));
    }
    if out.status.success() || !stderr.contains("refusing to send") || squatted.connected {
        return Err(Failure::Harness(format!(
            "lockstep replica list to uid {OTHER_UID}'s port neither refused nor leaked the token ({}, squatter {squatted:?}): {}",
            out.status,
            stderr.trim()
        )));
    }
    shared.note(format!(
        "the CLI sent no token to uid {OTHER_UID}'s listener"
    ));
    Ok(())
}
