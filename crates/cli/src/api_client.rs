//! A client of the environment's API: the channel (TLS when asked), and the
//! API token added to every call. It links `lockstep-api` only (no
//! environment, wasmtime or kube).

use super::*;

/// Adds the API token, if there is one, to every request.
#[derive(Clone)]
pub(crate) struct AddToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for AddToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

impl AddToken {
    /// Sends `token` as `authorization: Bearer TOKEN` (none: nothing).
    pub(crate) fn bearer(token: Option<&str>) -> anyhow::Result<AddToken> {
        Ok(AddToken(
            token
                .map(|t| format!("Bearer {t}").parse())
                .transpose()
                .context("the API token is not a valid header value")?,
        ))
    }
}

/// An API client that sends the token.
pub(crate) type Client = EnvironmentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
>;

pub(crate) async fn connect(server: &ServerArg) -> anyhow::Result<Client> {
    let (channel, token) = channel_with_token(server).await?;
    Ok(EnvironmentClient::with_interceptor(channel, token)
        .max_decoding_message_size(lockstep_api::MAX_ANSWER_BYTES)
        .max_encoding_message_size(lockstep_api::MAX_REQUEST_BYTES))
}

/// A grpc.health.v1 client that sends the token too: a replica's status
/// (`replica/NAME`) is a token holder's.
pub(crate) type Health = tonic_health::pb::health_client::HealthClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
>;

/// A health client of `server`, by the route [`connect`] takes.
pub(crate) async fn connect_health(server: &ServerArg) -> anyhow::Result<Health> {
    let (channel, token) = channel_with_token(server).await?;
    Ok(tonic_health::pb::health_client::HealthClient::with_interceptor(channel, token))
}

/// A channel to `server` by its [`route`], and the token to send on it;
/// refuses a token over plain HTTP unless `--insecure-plaintext`.
async fn channel_with_token(
    server: &ServerArg,
) -> anyhow::Result<(tonic::transport::Channel, AddToken)> {
    let token = client_token(server)?;
    let channel = match route(server) {
        Route::Local { socket, owner } => connect_local(&socket, owner).await?,
        Route::Plain if token.is_some() && !server.insecure_plaintext && !unproven_allowed() => {
            anyhow::bail!(
                "refusing to send the API token over plain HTTP to {}: nothing proves who listens there (on a restart another local user can bind the port and read it). Give the environment's state directory (--state-dir or LOCKSTEP_STATE_DIR: its socket api-PORT.sock proves the server), an https:// address with --tls-ca, or --insecure-plaintext to send it anyway",
                server.url
            )
        }
        Route::Plain | Route::Tls => connect_tcp(server).await?,
    };
    Ok((channel, AddToken::bearer(token.as_deref())?))
}

/// Set, in a build with the `failpoints` feature only (the test command's),
/// the client sends its token over plain HTTP as if `--insecure-plaintext`
/// were given: the hostile campaign's negative control `unproven-server`.
/// A release build ignores it.
const UNPROVEN_SERVER_ENV: &str = "LOCKSTEP_EXPERIMENT_UNPROVEN_SERVER";

/// Whether [`UNPROVEN_SERVER_ENV`] is in force.
fn unproven_allowed() -> bool {
    cfg!(feature = "failpoints") && std::env::var_os(UNPROVEN_SERVER_ENV).is_some()
}

/// How a client reaches the environment, and what proves the far end
/// before the token is sent.
enum Route {
    /// The state directory's Unix socket: only the directory's owner could
    /// have made it, and the peer's uid is checked against `owner`.
    Local {
        socket: std::path::PathBuf,
        owner: u32,
    },
    /// `https://`: the server's certificate.
    Tls,
    /// Plain HTTP/2 over TCP: nothing.
    Plain,
}

/// The route to `server`: its state directory's socket for the address's
/// port when the address is on loopback and the directory (`--state-dir`,
/// or the directory of the token file) has one, else TLS for `https://`,
/// else plain.
fn route(server: &ServerArg) -> Route {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let https = server.url.starts_with("https://");
    if let Some(port) = (!https).then(|| loopback_port(&server.url)).flatten() {
        let token_file = server
            .token_file
            .clone()
            .or_else(|| std::env::var_os(TOKEN_FILE_ENV).map(std::path::PathBuf::from));
        let dir = server
            .state_dir
            .clone()
            .or_else(|| token_file.and_then(|f| f.parent().map(std::path::Path::to_path_buf)));
        if let Some(dir) = dir {
            let socket = dir.join(lockstep_api::local_socket_file(port));
            if let (Ok(dir_meta), Ok(meta)) =
                (std::fs::metadata(&dir), std::fs::symlink_metadata(&socket))
            {
                if meta.file_type().is_socket() {
                    return Route::Local {
                        socket,
                        owner: dir_meta.uid(),
                    };
                }
            }
        }
    }
    if https {
        Route::Tls
    } else {
        Route::Plain
    }
}

/// The port of an `http://HOST[:PORT]` address that names this machine's
/// loopback (80 without one); `None` for any other address.
fn loopback_port(url: &str) -> Option<u16> {
    let uri = url.parse::<tonic::codegen::http::Uri>().ok()?;
    let loopback = match uri.host()? {
        "localhost" => true,
        host => host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback()),
    };
    loopback.then(|| uri.port_u16().unwrap_or(80))
}

/// A channel over the Unix socket at `socket`, refused unless the process
/// that accepted runs as `owner` (the state directory's) or root.
async fn connect_local(
    socket: &std::path::Path,
    owner: u32,
) -> anyhow::Result<tonic::transport::Channel> {
    let path = socket.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let path = path.clone();
        async move {
            let stream = tokio::net::UnixStream::connect(&path).await?;
            let peer = stream.peer_cred()?.uid();
            if peer != owner && peer != 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "the process at {} runs as uid {peer}, not as the state directory's owner (uid {owner}): not sending it the token",
                        path.display()
                    ),
                ));
            }
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(60))
        .connect_with_connector(connector)
        .await
        .with_context(|| {
            format!(
                "cannot connect to the environment at its socket {}",
                socket.display()
            )
        })
}

/// A TCP channel to `arg`'s address, TLS with `--tls-ca`.
async fn connect_tcp(arg: &ServerArg) -> anyhow::Result<tonic::transport::Channel> {
    let server = &arg.url;
    let mut endpoint = tonic::transport::Endpoint::from_shared(server.to_string())
        .with_context(|| format!("bad server address {server:?}"))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(60));
    if let Some(ca) = &arg.tls_ca {
        let pem = std::fs::read(ca)
            .with_context(|| format!("reading the TLS CA certificate {}", ca.display()))?;
        endpoint = endpoint
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
            )
            .context("TLS configuration")?;
    }
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("cannot connect to the environment at {server}"))?;
    Ok(channel)
}

/// The API token from `file`, or from LOCKSTEP_API_TOKEN.
pub(crate) fn api_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let token = match file {
        Some(path) => Some(first_line(&std::fs::read_to_string(path).with_context(
            || format!("reading the API token file {}", path.display()),
        )?)),
        None => std::env::var(API_TOKEN_ENV)
            .ok()
            .map(|t| t.trim().to_string()),
    };
    checked_token(token)
}

/// The first line of a token file, trimmed.
pub(crate) fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim().to_string()
}

/// Refuses a token too short or not printable ASCII.
pub(crate) fn checked_token(token: Option<String>) -> anyhow::Result<Option<String>> {
    match token {
        Some(t) if t.len() < lockstep_api::MIN_TOKEN_LEN => anyhow::bail!(
            "an API token has at least {} characters",
            lockstep_api::MIN_TOKEN_LEN
        ),
        Some(t) if !t.chars().all(|c| c.is_ascii_graphic()) => {
            anyhow::bail!("an API token holds printable ASCII only")
        }
        t => Ok(t),
    }
}

/// Where clients and `lockstep serve` find the API token.
pub(crate) const API_TOKEN_ENV: &str = "LOCKSTEP_API_TOKEN";

/// Where a client finds the file of the API token, after
/// [`API_TOKEN_ENV`].
pub(crate) const TOKEN_FILE_ENV: &str = "LOCKSTEP_TOKEN_FILE";

/// The API token file `lockstep serve` makes in its state directory
/// (`lockstep_environment::private::API_TOKEN_FILE`; the client does not
/// link the environment).
pub(crate) const STATE_API_TOKEN_FILE: &str = "api.token";

/// A client's API token: `--token-file`, else LOCKSTEP_API_TOKEN, else the
/// file LOCKSTEP_TOKEN_FILE names, else `api.token` in `--state-dir`
/// (LOCKSTEP_STATE_DIR), else none (an environment serving with
/// `--insecure-loopback`).
pub(crate) fn client_token(server: &ServerArg) -> anyhow::Result<Option<String>> {
    if server.token_file.is_some() || std::env::var_os(API_TOKEN_ENV).is_some() {
        return api_token(server.token_file.as_deref());
    }
    if let Some(file) = std::env::var_os(TOKEN_FILE_ENV) {
        return api_token(Some(std::path::Path::new(&file)));
    }
    if let Some(dir) = &server.state_dir {
        let file = dir.join(STATE_API_TOKEN_FILE);
        return api_token(Some(&file)).with_context(|| {
            format!(
                "the environment of state directory {} keeps its API token there; is `lockstep serve --state-dir {}` running as this user?",
                dir.display(),
                dir.display()
            )
        });
    }
    Ok(None)
}
