//! HTTP routing: a request's path to a resource, namespace and name, its
//! query, faults, and the store operation it asks for; Status bodies for
//! errors; and the `tower::Service` a [`kube::Client`] calls.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::store::{api_version_of, kind_of, labels_of, selector_matches};
use crate::{ApiServerDouble, DoubleBody, Fault, RecordedRequest};

pub(crate) fn status(code: u16, reason: &str, message: String) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// The object a `fieldSelector` names: only `metadata.name=NAME` is known
/// (kube's `await_condition` asks for it); any other is refused (answer
/// 400 with the message).
pub(crate) fn field_selector(
    query: &std::collections::BTreeMap<String, String>,
) -> Result<Option<String>, String> {
    match query.get("fieldSelector").map(String::as_str) {
        None | Some("") => Ok(None),
        Some(f) => match f.strip_prefix("metadata.name=") {
            Some(name) if !name.contains(',') => Ok(Some(name.to_string())),
            _ => Err(format!(
                "fieldSelector {f:?}: the double knows only metadata.name=NAME"
            )),
        },
    }
}

/// Whether `object` is the one a field selector names (`None`: any).
pub(crate) fn name_matches(name: Option<&str>, object: &Value) -> bool {
    name.is_none_or(|n| object["metadata"]["name"].as_str() == Some(n))
}

fn reason_of(code: u16) -> &'static str {
    match code {
        404 => "NotFound",
        409 => "Conflict",
        410 => "Expired",
        422 => "Invalid",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        _ => "BadRequest",
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

fn full(code: StatusCode, body: &Value) -> Response<DoubleBody> {
    Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(
            Full::new(Bytes::from(body.to_string()))
                .map_err(|never| match never {})
                .boxed_unsync(),
        )
        .expect("a valid response")
}

/// An answer of status `code` (a Kubernetes `Status` saying `message`).
pub(crate) fn error(code: u16, message: String) -> Response<DoubleBody> {
    full(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &status(code, reason_of(code), message),
    )
}

impl ApiServerDouble {
    fn handle(
        &self,
        method: Method,
        path: &str,
        query: BTreeMap<String, String>,
        body: Value,
    ) -> Response<DoubleBody> {
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (namespace, resource, name) = match segments.as_slice() {
            ["api", "v1", "namespaces", ns, resource] => (*ns, *resource, None),
            ["api", "v1", "namespaces", ns, resource, name] => (*ns, *resource, Some(*name)),
            ["apis", "policy" | "apps", "v1", "namespaces", ns, resource] => (*ns, *resource, None),
            ["apis", "policy" | "apps", "v1", "namespaces", ns, resource, name] => {
                (*ns, *resource, Some(*name))
            }
            _ => {
                return error(
                    404,
                    format!("the server could not find the requested resource ({path})"),
                )
            }
        };
        // Faults first: an action runs with the store unlocked.
        let fault = {
            let mut s = self.store.lock().expect("poisoned");
            s.requests.push(RecordedRequest {
                method: method.clone(),
                path: path.to_string(),
                query: query.clone(),
                body: body.clone(),
            });
            let pos = s.faults.iter().position(|f| match f {
                Fault::Fail(m, _, _) | Fault::Before(m, _) => m.matches(&method, resource, name),
            });
            pos.map(|p| s.faults.remove(p))
        };
        match fault {
            Some(Fault::Fail(_, code, message)) => return error(code, message),
            Some(Fault::Before(_, action)) => action(self),
            None => {}
        }
        if kind_of(resource).is_none() {
            return error(
                404,
                format!("the server could not find the requested resource ({resource})"),
            );
        }
        let mut s = self.store.lock().expect("poisoned");
        let result = match (&method, name) {
            (&Method::POST, None) => s
                .insert(resource, namespace, body)
                .map(|o| (StatusCode::CREATED, o)),
            (&Method::GET, Some(name)) => s
                .object(resource, namespace, name)
                .cloned()
                .map(|o| (StatusCode::OK, o))
                .ok_or((404, format!("{resource} \"{name}\" not found"))),
            (&Method::GET, None) if query.get("watch").map(String::as_str) == Some("true") => {
                return self.watch(&mut s, resource, namespace, &query);
            }
            (&Method::GET, None) => {
                let selector = query.get("labelSelector").cloned().unwrap_or_default();
                let name = match field_selector(&query) {
                    Ok(name) => name,
                    Err(refused) => return error(400, refused),
                };
                let items: Vec<Value> = s
                    .objects
                    .iter()
                    .filter(|((r, n, _), o)| {
                        r == resource
                            && n == namespace
                            && selector_matches(&selector, &labels_of(o))
                            && name_matches(name.as_deref(), o)
                    })
                    .map(|(_, o)| o.clone())
                    .collect();
                Ok((
                    StatusCode::OK,
                    json!({
                        "kind": format!("{}List", kind_of(resource).unwrap_or_default()),
                        "apiVersion": api_version_of(resource),
                        "metadata": {"resourceVersion": s.rv.to_string()},
                        "items": items,
                    }),
                ))
            }
            (&Method::PUT, Some(name)) => s
                .replace(resource, namespace, name, body)
                .map(|o| (StatusCode::OK, o)),
            (&Method::DELETE, Some(name)) => s
                .delete(resource, namespace, name, &body)
                .map(|o| (StatusCode::OK, o)),
            _ => Err((405, format!("method {method} not allowed on {path}"))),
        };
        match result {
            Ok((code, object)) => full(code, &object),
            Err((code, message)) => error(code, message),
        }
    }
}

impl<B> tower::Service<Request<B>> for ApiServerDouble
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::fmt::Display,
{
    type Response = Response<DoubleBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = match body.collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return Ok(error(400, format!("unreadable body: {e}"))),
            };
            let body: Value = if bytes.is_empty() {
                Value::Null
            } else {
                match serde_json::from_slice(&bytes) {
                    Ok(v) => v,
                    Err(e) => return Ok(error(400, format!("the body is not JSON: {e}"))),
                }
            };
            let query = parse_query(parts.uri.query());
            Ok(me.handle(parts.method, parts.uri.path(), query, body))
        })
    }
}
