//! Per-RPC metrics of the API as one tower layer around the whole gRPC
//! server, instead of a call in every handler: for each call to a method
//! of `lockstep.environment.v1.Environment`, its latency to the response
//! headers (`lockstep_environment_api_request_seconds`) and, once the call ends, its
//! gRPC status code (`lockstep_environment_api_requests`). Being outside the token
//! check and the decoder, it also counts calls refused for a missing token
//! (`UNAUTHENTICATED`) or a request that does not decode.
//!
//! Each call also runs in a tracing span `request` with its `method` and an
//! `id`: the client's `x-request-id` header if it sent a short one of
//! letters, digits and `-_.:`, else one made here (`PID-N`); the answer
//! carries it back in `x-request-id`, so a client's error and the server's
//! log lines of that call can be matched.
//!
//! The code is read where gRPC puts it: the `grpc-status` header of a
//! trailers-only answer (an error before any message), or the trailers at
//! the end of the body; a body dropped before either (the client went
//! away) counts as `CANCELLED`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http_body::{Body, Frame};

use crate::metrics::Metrics;

/// The API's gRPC service; only its methods are counted.
const SERVICE_PREFIX: &str = "/lockstep.environment.v1.Environment/";

/// The layer: wraps a service in [`RpcMetrics`].
#[derive(Clone)]
pub struct RpcMetricsLayer {
    metrics: Arc<Metrics>,
}

impl RpcMetricsLayer {
    /// Counts into `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        RpcMetricsLayer { metrics }
    }
}

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;

    fn layer(&self, inner: S) -> RpcMetrics<S> {
        RpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// A service whose API calls are counted (see the module docs).
#[derive(Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

/// The API's methods (checked against `environment.proto` by a test): a
/// label takes only these values, or [`OTHER`], so no client can grow the
/// metrics by calling made-up methods.
const METHODS: [&str; 14] = [
    "CreateReplica",
    "DropReplica",
    "RestartReplica",
    "ResizeReplica",
    "ListReplicas",
    "GetStatus",
    "CreateDataflow",
    "DropDataflow",
    "ListDataflows",
    "WriteInput",
    "Peek",
    "Subscribe",
    "SetPolicy",
    "ListPolicies",
];

/// The label of a call to a method the API does not have.
const OTHER: &str = "other";

/// The method label of an API call's path (`CreateReplica`), if the path
/// is under the API's service.
fn method_of(path: &str) -> Option<&'static str> {
    let m = path.strip_prefix(SERVICE_PREFIX)?;
    Some(METHODS.iter().copied().find(|k| *k == m).unwrap_or(OTHER))
}

/// A gRPC status code from its header value.
fn code_of(value: &http::HeaderValue) -> tonic::Code {
    value
        .to_str()
        .ok()
        .and_then(|s| s.parse::<i32>().ok())
        .map(tonic::Code::from_i32)
        .unwrap_or(tonic::Code::Unknown)
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: Body + Unpin,
{
    type Response = http::Response<Counted<ResBody>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let method = method_of(request.uri().path());
        let started = Instant::now();
        let metrics = self.metrics.clone();
        let id = request_id(request.headers().get(REQUEST_ID));
        let span = tracing::info_span!("request", id = %id, method = method.unwrap_or(OTHER));
        let call = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        Box::pin(tracing::Instrument::instrument(
            async move {
                let mut response = call.await?;
                if let Ok(v) = http::HeaderValue::from_str(&id) {
                    response.headers_mut().insert(REQUEST_ID, v);
                }
                let Some(method) = method else {
                    return Ok(response.map(|body| Counted { body, call: None }));
                };
                metrics.api_latency(method, started.elapsed());
                let mut open = OpenCall { method, metrics };
                let ended = response.headers().get("grpc-status").map(code_of);
                let call = match ended {
                    Some(code) => {
                        open.end(code);
                        None
                    }
                    None => Some(open),
                };
                Ok(response.map(|body| Counted { body, call }))
            },
            span,
        ))
    }
}

/// The header that carries a call's request ID both ways.
const REQUEST_ID: &str = "x-request-id";

/// A call's request ID: the client's, if it is 1 to 64 of letters, digits
/// and `-_.:`; else a new one, `PID-N`.
fn request_id(given: Option<&http::HeaderValue>) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let ok = |s: &str| {
        (1..=64).contains(&s.len())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    };
    match given.and_then(|v| v.to_str().ok()) {
        Some(s) if ok(s) => s.to_string(),
        _ => format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ),
    }
}

/// A call whose status code is not known yet.
struct OpenCall {
    method: &'static str,
    metrics: Arc<Metrics>,
}

impl OpenCall {
    fn end(&mut self, code: tonic::Code) {
        self.metrics.api_code(self.method, code);
    }
}

/// A response body that counts its call's status code when the trailers
/// pass (or `CANCELLED` if it is dropped first).
pub struct Counted<B> {
    body: B,
    call: Option<OpenCall>,
}

impl<B> Drop for Counted<B> {
    fn drop(&mut self) {
        if let Some(mut call) = self.call.take() {
            call.end(tonic::Code::Cancelled);
        }
    }
}

impl<B: Body + Unpin> Body for Counted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame
                    .trailers_ref()
                    .and_then(|t| t.get("grpc-status"))
                    .map(code_of)
                {
                    if let Some(mut call) = self.call.take() {
                        call.end(code);
                    }
                }
            }
            // An error in the body, or its end with no status: the call
            // failed in transport.
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => {
                if let Some(mut call) = self.call.take() {
                    call.end(tonic::Code::Unknown);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_apis_methods_are_labels() {
        assert_eq!(
            method_of("/lockstep.environment.v1.Environment/CreateReplica"),
            Some("CreateReplica")
        );
        assert_eq!(method_of("/grpc.health.v1.Health/Check"), None);
        assert_eq!(
            method_of("/lockstep.environment.v1.Environment/MadeUp12345"),
            Some(OTHER),
            "a made-up method adds no label value"
        );
    }

    #[test]
    fn the_method_list_is_the_services() {
        use prost::Message;
        let set = prost_types::FileDescriptorSet::decode(crate::proto::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set decodes");
        let mut declared: Vec<String> = set
            .file
            .iter()
            .filter(|f| f.package() == "lockstep.environment.v1")
            .flat_map(|f| f.service.iter())
            .filter(|s| s.name() == "Environment")
            .flat_map(|s| s.method.iter().map(|m| m.name().to_string()))
            .collect();
        declared.sort();
        let mut listed: Vec<String> = METHODS.iter().map(|m| m.to_string()).collect();
        listed.sort();
        assert_eq!(listed, declared);
    }

    type TestBody = http_body_util::StreamBody<
        futures::stream::Iter<
            std::vec::IntoIter<Result<Frame<hyper::body::Bytes>, std::convert::Infallible>>,
        >,
    >;

    /// A server answering every call as tonic would for `outcome`: an error
    /// before any message (trailers-only: the code in the headers), or a
    /// message and then the code in the trailers.
    fn answering(
        trailers_only: Option<u16>,
        trailer_code: u16,
    ) -> impl tower::Service<
        http::Request<()>,
        Response = http::Response<TestBody>,
        Error = std::convert::Infallible,
        Future = std::future::Ready<Result<http::Response<TestBody>, std::convert::Infallible>>,
    > + Clone {
        tower::service_fn(move |_req: http::Request<()>| {
            let mut frames = Vec::new();
            let mut response = http::Response::builder();
            match trailers_only {
                Some(code) => response = response.header("grpc-status", code.to_string()),
                None => {
                    frames.push(Ok(Frame::data(hyper::body::Bytes::from_static(b"message"))));
                    let mut t = http::HeaderMap::new();
                    t.insert("grpc-status", trailer_code.to_string().parse().unwrap());
                    frames.push(Ok(Frame::trailers(t)));
                }
            }
            std::future::ready(Ok(response
                .body(http_body_util::StreamBody::new(futures::stream::iter(
                    frames,
                )))
                .unwrap()))
        })
    }

    fn call(path: &str) -> http::Request<()> {
        http::Request::builder().uri(path).body(()).unwrap()
    }

    #[tokio::test]
    async fn a_call_is_counted_with_the_code_grpc_gives_it() {
        use http_body_util::BodyExt;
        use tower::{Layer, Service};
        let metrics = Arc::new(Metrics::new());
        let layer = RpcMetricsLayer::new(metrics.clone());
        let path = "/lockstep.environment.v1.Environment/ListReplicas";
        // Refused before any message (a missing token): UNAUTHENTICATED.
        let mut refused = layer.layer(answering(Some(16), 0));
        drop(refused.call(call(path)).await.unwrap());
        // Answered: OK once the trailers pass, not before.
        let mut answered = layer.layer(answering(None, 0));
        let response = answered.call(call(path)).await.unwrap();
        let text = metrics.encode();
        assert!(
            !text.contains(r#"method="ListReplicas",code="OK""#),
            "{text}"
        );
        response.into_body().collect().await.unwrap();
        // A client that goes away mid-answer: CANCELLED.
        let mut dropped = layer.layer(answering(None, 0));
        drop(dropped.call(call(path)).await.unwrap());
        // Not the API: not counted.
        let mut health = layer.layer(answering(None, 0));
        health
            .call(call("/grpc.health.v1.Health/Check"))
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap();
        let text = metrics.encode();
        for code in ["UNAUTHENTICATED", "OK", "CANCELLED"] {
            assert!(
                text.contains(&format!(
                    r#"lockstep_environment_api_requests_total{{method="ListReplicas",code="{code}"}} 1"#
                )),
                "{code} missing from:\n{text}"
            );
        }
        assert!(!text.contains("Health"), "{text}");
        assert!(
            text.contains(
                r#"lockstep_environment_api_request_seconds_count{method="ListReplicas"} 3"#
            ),
            "{text}"
        );
    }

    #[test]
    fn codes_are_read_from_the_header_value() {
        assert_eq!(
            code_of(&http::HeaderValue::from_static("0")),
            tonic::Code::Ok
        );
        assert_eq!(
            code_of(&http::HeaderValue::from_static("16")),
            tonic::Code::Unauthenticated
        );
        assert_eq!(
            code_of(&http::HeaderValue::from_static("x")),
            tonic::Code::Unknown
        );
    }

    #[test]
    fn a_request_id_is_the_clients_when_it_is_tame_else_a_new_one() {
        let given = http::HeaderValue::from_static("abc-123_x.y:z");
        assert_eq!(request_id(Some(&given)), "abc-123_x.y:z");
        let hostile = http::HeaderValue::from_static("a b\"c");
        let made = request_id(Some(&hostile));
        assert!(
            made.starts_with(&format!("{}-", std::process::id())),
            "{made}"
        );
        let long = http::HeaderValue::from_str(&"x".repeat(65)).unwrap();
        assert_ne!(request_id(Some(&long)), "x".repeat(65));
        assert_ne!(request_id(None), request_id(None), "each made ID is new");
    }
}
