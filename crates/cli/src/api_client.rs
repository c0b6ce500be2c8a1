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

/// An API client that sends the token.
pub(crate) type Client = EnvironmentClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>,
>;

pub(crate) async fn connect(server: &ServerArg) -> anyhow::Result<Client> {
    let token = api_token(server.token_file.as_deref())?
        .map(|t| format!("Bearer {t}").parse())
        .transpose()
        .context("the API token is not a valid header value")?;
    let channel = connect_channel(server).await?;
    Ok(
        EnvironmentClient::with_interceptor(channel, AddToken(token))
            .max_decoding_message_size(lockstep_api::MAX_ANSWER_BYTES)
            .max_encoding_message_size(lockstep_api::MAX_REQUEST_BYTES),
    )
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
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the API token file {}", path.display()))?
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string(),
        ),
        None => std::env::var(API_TOKEN_ENV)
            .ok()
            .map(|t| t.trim().to_string()),
    };
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
