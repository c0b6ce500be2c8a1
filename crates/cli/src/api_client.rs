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
    let token = AddToken::bearer(client_token(server)?.as_deref())?;
    let channel = connect_channel(server).await?;
    Ok(EnvironmentClient::with_interceptor(channel, token)
        .max_decoding_message_size(lockstep_api::MAX_ANSWER_BYTES)
        .max_encoding_message_size(lockstep_api::MAX_REQUEST_BYTES))
}

pub(crate) async fn connect_channel(arg: &ServerArg) -> anyhow::Result<tonic::transport::Channel> {
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

/// A token file `lockstep serve` is given: read only if it is a regular
/// file this user or root owns that others cannot write (someone else's
/// file could hold a token they know), else from [`API_TOKEN_ENV`] as
/// [`api_token`] does.
pub(crate) fn served_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    match file {
        Some(path) => {
            let bytes = lockstep_environment::private::read_secret_file(path)
                .with_context(|| format!("reading the token file {}", path.display()))?;
            checked_token(Some(first_line(&String::from_utf8_lossy(&bytes))))
        }
        None => api_token(None),
    }
}

/// The first line of a token file, trimmed.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim().to_string()
}

/// Refuses a token too short or not printable ASCII.
fn checked_token(token: Option<String>) -> anyhow::Result<Option<String>> {
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
