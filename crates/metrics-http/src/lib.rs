//! The `/metrics` endpoint of both lockstep binaries: the environment
//! (`lockstep serve --metrics-listen`) and every replica process (on its
//! controller port, see `lockstep_replica`).
//!
//! One connection is answered by hyper (HTTP/1.1, keep-alive off, the
//! request head within [`HEAD_TIMEOUT`]): a `GET` gets what the caller's
//! [`Handler`] answers for its path (OpenMetrics text, 404 or 502), anything
//! else 404; `GET /healthz` ([`HEALTH_PATH`]) is answered to anyone: `ok`, or
//! 503 where the handler says the process does not serve.
//! [`fetch`] is the other side, for the environment's relay of a
//! replica process's metrics. With a token, a request must carry
//! `Authorization: Bearer TOKEN` (compared in constant time), else 401 and
//! nothing else. The caller bounds how many connections it serves at once.
//!
//! [`process`] gives both binaries the standard `process_*` series.

pub mod process;

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;

/// The path answered to anyone, token or not: 200 `ok` while the process
/// serves (a liveness and startup probe's target), 503 where the handler
/// answers it [`Answer::Unavailable`].
pub const HEALTH_PATH: &str = "/healthz";

/// The content type of what `GET /metrics` answers.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The time a connection has to deliver its request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `a` and `b` are equal, in time that depends on their lengths
/// only (tokens are compared with it).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What a path of the endpoint answers.
#[derive(Debug)]
pub enum Answer {
    /// 200 with this OpenMetrics text.
    Metrics(String),
    /// 404, saying why.
    NotFound(String),
    /// 502: what would answer could not be reached, saying why.
    Unavailable(String),
    /// 200 with this JSON document (e.g. Prometheus HTTP service discovery).
    Json(String),
}

/// What the endpoint serves: the answer to `GET PATH`.
pub type Handler =
    Arc<dyn Fn(String) -> Pin<Box<dyn Future<Output = Answer> + Send>> + Send + Sync>;

/// A handler of `GET /metrics` alone, answered with `encode`.
pub fn metrics_only(encode: impl Fn() -> String + Send + Sync + 'static) -> Handler {
    Arc::new(move |path: String| {
        let answer = if path == "/metrics" {
            Answer::Metrics(encode())
        } else {
            Answer::NotFound("only GET /metrics".into())
        };
        Box::pin(std::future::ready(answer))
    })
}

/// Serves one connection `io` until it ends: `handler` answers each `GET`;
/// with `token`, only a request bearing it is answered.
pub async fn serve_connection<I>(io: I, handler: Handler, token: Option<Arc<str>>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let handler = handler.clone();
        let token = token.clone();
        async move { Ok::<_, std::convert::Infallible>(respond(&req, &handler, token.as_deref()).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .keep_alive(false)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service)
        .await;
}

/// The answer to one request.
pub async fn respond<B>(
    req: &hyper::Request<B>,
    handler: &Handler,
    token: Option<&str>,
) -> hyper::Response<Full<Bytes>> {
    let authorized = token.is_none_or(|want| {
        req.headers()
            .get_all(hyper::header::AUTHORIZATION)
            .iter()
            .any(|v| {
                let v = v.as_bytes();
                v.len() > 7
                    && v[..7].eq_ignore_ascii_case(b"bearer ")
                    && constant_time_eq(&v[7..], want.as_bytes())
            })
    });
    // `GET /healthz` says only whether the process serves: no token,
    // nothing read (the kubelet's probes carry no credential). 200 unless
    // the handler answers the path Unavailable (then 503, saying why).
    let health = req.method() == hyper::Method::GET && req.uri().path() == HEALTH_PATH;
    let (status, body, kind) = if health {
        match handler(HEALTH_PATH.to_string()).await {
            Answer::Unavailable(why) => (
                hyper::StatusCode::SERVICE_UNAVAILABLE,
                format!("{why}\n"),
                "text/plain",
            ),
            _ => (hyper::StatusCode::OK, "ok\n".to_string(), "text/plain"),
        }
    } else if !authorized {
        (
            hyper::StatusCode::UNAUTHORIZED,
            "a bearer token is required\n".to_string(),
            "text/plain",
        )
    } else if req.method() != hyper::Method::GET {
        (
            hyper::StatusCode::NOT_FOUND,
            "only GET\n".to_string(),
            "text/plain",
        )
    } else {
        match handler(req.uri().path().to_string()).await {
            Answer::Metrics(text) => (hyper::StatusCode::OK, text, OPENMETRICS_CONTENT_TYPE),
            Answer::NotFound(why) => (
                hyper::StatusCode::NOT_FOUND,
                format!("{why}\n"),
                "text/plain",
            ),
            Answer::Unavailable(why) => (
                hyper::StatusCode::BAD_GATEWAY,
                format!("{why}\n"),
                "text/plain",
            ),
            Answer::Json(text) => (hyper::StatusCode::OK, text, "application/json"),
        }
    };
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(kind),
    );
    response
}

/// The largest exposition [`fetch`] reads.
pub const MAX_FETCHED_BYTES: usize = 16 << 20;

/// GETs `/metrics` from `addr` (with `token` as its bearer), within
/// `within`; the text of a 200 answer of at most [`MAX_FETCHED_BYTES`],
/// else what went wrong.
pub async fn fetch(
    addr: SocketAddr,
    token: Option<&str>,
    within: Duration,
) -> Result<String, String> {
    fetch_path(addr, "/metrics", token, within).await
}

/// As [`fetch`], of any `path` (a scraper's other requests: service
/// discovery, a relayed process).
pub async fn fetch_path(
    addr: SocketAddr,
    path: &str,
    token: Option<&str>,
    within: Duration,
) -> Result<String, String> {
    let work = async {
        let sock = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(sock))
                .await
                .map_err(|e| format!("{addr}: {e}"))?;
        tokio::spawn(conn);
        let mut req = hyper::Request::get(path).header(hyper::header::HOST, addr.to_string());
        if let Some(token) = token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req
            .body(http_body_util::Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let answer = sender
            .send_request(req)
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        let status = answer.status();
        let body = http_body_util::Limited::new(answer.into_body(), MAX_FETCHED_BYTES)
            .collect()
            .await
            .map_err(|e| format!("{addr}: {e}"))?
            .to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if status != hyper::StatusCode::OK {
            return Err(format!("{addr} answered {status}: {}", text.trim()));
        }
        Ok(text)
    };
    tokio::time::timeout(within, work)
        .await
        .map_err(|_| format!("{addr} did not answer within {within:?}"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Serves `answer` (with `token`) on a loopback port.
    async fn endpoint(token: Option<&str>) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let token: Option<Arc<str>> = token.map(Arc::from);
        tokio::spawn(async move {
            loop {
                let (sock, _) = listener.accept().await.unwrap();
                let handler = metrics_only(|| "lockstep_epoch 7\n# EOF\n".to_string());
                tokio::spawn(serve_connection(sock, handler, token.clone()));
            }
        });
        addr
    }

    /// Sends `request` and reads the whole answer (the server closes).
    async fn exchange(addr: std::net::SocketAddr, request: &str) -> String {
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out))
            .await
            .expect("the endpoint answers and closes within 10 s")
            .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn get_metrics_is_answered_and_anything_else_is_not_found() {
        let addr = endpoint(None).await;
        let ok = exchange(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(ok.contains("lockstep_epoch 7"), "{ok}");
        assert!(ok.contains("application/openmetrics-text"), "{ok}");
        let other = exchange(addr, "GET /other HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(other.starts_with("HTTP/1.1 404"), "{other}");
        let post = exchange(
            addr,
            "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        assert!(post.starts_with("HTTP/1.1 404"), "{post}");
    }

    #[tokio::test]
    async fn with_a_token_only_its_bearer_is_answered() {
        let addr = endpoint(Some("s3cret")).await;
        let none = exchange(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(none.starts_with("HTTP/1.1 401"), "{none}");
        assert!(!none.contains("lockstep_epoch"), "{none}");
        let wrong = exchange(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n",
        )
        .await;
        assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
        let right = exchange(
            addr,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nauthorization: bearer s3cret\r\n\r\n",
        )
        .await;
        assert!(right.starts_with("HTTP/1.1 200"), "{right}");
        assert!(right.contains("lockstep_epoch 7"), "{right}");
    }

    #[tokio::test]
    async fn healthz_is_answered_without_the_token_and_reads_nothing() {
        let addr = endpoint(Some("s3cret")).await;
        let health = exchange(addr, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        assert!(health.ends_with("ok\n"), "{health}");
        assert!(!health.contains("lockstep_epoch"), "{health}");
        let metrics = exchange(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(metrics.starts_with("HTTP/1.1 401"), "{metrics}");
    }

    #[tokio::test]
    async fn a_request_head_that_never_ends_is_cut_off() {
        let addr = endpoint(None).await;
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        // The head's deadline is 5 s; the connection must end well within 15.
        let read = tokio::time::timeout(Duration::from_secs(15), sock.read_to_end(&mut out)).await;
        assert!(
            read.is_ok(),
            "a slow head kept the connection open past 15 s"
        );
        assert!(
            !String::from_utf8_lossy(&out).contains("lockstep_epoch"),
            "an unfinished request got the metrics"
        );
    }
}
