//! grpc.health.v1 as the API serves it: open to any caller for the server
//! (`""`) and the API's service, so that probes and load balancers need no
//! credential; a replica's status (`replica/NAME`) only to a caller that
//! sends the API token. To any other caller every `replica/...` is "not
//! registered", whether that replica exists or not: a token-less caller
//! cannot learn a replica's name by guessing (R1).

use tonic::{Request, Response, Status};
use tonic_health::pb::health_server::Health;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::HealthService;

use crate::server::TokenCheck;

/// The health service name of replica `name`.
pub(crate) fn replica_service(name: &str) -> String {
    format!("{REPLICA_PREFIX}{name}")
}

/// What every replica's health service name starts with.
const REPLICA_PREFIX: &str = "replica/";

/// The health service with replicas' statuses behind the token.
pub(crate) struct HealthGate {
    /// The statuses.
    inner: HealthService,
    /// The API token's check; `None` when the API has no token (then
    /// every status is open, as every call is).
    token: Option<TokenCheck>,
}

impl HealthGate {
    /// `inner`'s statuses, replicas' behind `token` if there is one.
    pub(crate) fn new(inner: HealthService, token: Option<TokenCheck>) -> HealthGate {
        HealthGate { inner, token }
    }

    /// Refuses a replica's status to a caller without the token, as the
    /// health service refuses a name it does not know.
    fn admit(&self, request: &Request<HealthCheckRequest>) -> Result<(), Status> {
        let hidden = request.get_ref().service.starts_with(REPLICA_PREFIX)
            && self
                .token
                .as_ref()
                .is_some_and(|t| !t.holds(request.metadata()));
        if hidden {
            return Err(Status::not_found("service not registered"));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl Health for HealthGate {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.admit(&request)?;
        self.inner.check(request).await
    }

    type WatchStream = <HealthService as Health>::WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        self.admit(&request)?;
        self.inner.watch(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica's status goes to a token holder only; to anyone else an
    /// existing replica and a made-up one look the same. The server's own
    /// status is open.
    #[tokio::test]
    async fn a_replicas_status_goes_only_to_a_token_holder() {
        let (reporter, _) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(replica_service("r1"), tonic_health::ServingStatus::Serving)
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let gate = HealthGate::new(
            HealthService::from_health_reporter(reporter),
            Some(TokenCheck::new("a-token-of-enough-length")),
        );
        let ask = |service: &str, token: Option<&str>| {
            let mut r = Request::new(HealthCheckRequest {
                service: service.to_string(),
            });
            if let Some(t) = token {
                r.metadata_mut()
                    .insert("authorization", format!("Bearer {t}").parse().unwrap());
            }
            r
        };
        let code = |r: Result<Response<HealthCheckResponse>, Status>| match r {
            Ok(_) => tonic::Code::Ok,
            Err(s) => s.code(),
        };
        let token = Some("a-token-of-enough-length");
        assert_eq!(
            code(gate.check(ask("replica/r1", token)).await),
            tonic::Code::Ok
        );
        assert_eq!(
            code(gate.check(ask("replica/nope", token)).await),
            tonic::Code::NotFound
        );
        for caller in [None, Some("another-token-of-enough-length")] {
            for service in ["replica/r1", "replica/nope"] {
                assert_eq!(
                    code(gate.check(ask(service, caller)).await),
                    tonic::Code::NotFound,
                    "{service} to {caller:?}"
                );
                assert!(gate.watch(ask(service, caller)).await.is_err());
            }
            assert_eq!(code(gate.check(ask("", caller)).await), tonic::Code::Ok);
        }
    }
}
