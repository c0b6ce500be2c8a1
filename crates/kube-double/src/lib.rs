//! A stateful in-memory Kubernetes API server for tests (`lockstep-kube-double`): a `tower::Service`
//! that answers the HTTP requests a real [`kube::Client`] sends, so the
//! backend's own code (requests, preconditions, 409 handling, watch
//! re-listing) runs unchanged against it.
//!
//! What it implements, for the core/v1 resources `pods`, `services`,
//! `secrets` and `configmaps` and the policy/v1 `poddisruptionbudgets` in
//! any namespace, as the API server does (no disruption controller: a
//! budget's status stays empty and nothing is evicted):
//!
//! - **create** (`POST`): 409 `AlreadyExists` if the name is taken; assigns a
//!   `uid` and a `resourceVersion` from one counter for the whole store.
//! - **get** and **list** (`GET`), lists filtered by `labelSelector`
//!   (`k=v`, `k==v`, `k!=v`, `k`, `!k`), carrying the store's
//!   resourceVersion.
//! - **replace** (`PUT`): 409 `Conflict` if the body's resourceVersion (or
//!   uid) is not the stored one — the compare-and-swap. A pod's spec may not
//!   change (422), as on a real server.
//! - **delete** (`DELETE`) with `DeleteOptions.preconditions`: 409 `Conflict`
//!   if the uid or resourceVersion does not match. Deletion is immediate
//!   (a kubelet that stops containers at once).
//! - **watch** (`GET ?watch=true`): streams `ADDED` / `MODIFIED` / `DELETED`
//!   after the given resourceVersion, filtered by `labelSelector`; a version
//!   older than the last [`compact`](ApiServerDouble::compact) gets an
//!   `ERROR` event with 410 Gone, as etcd compaction does.
//! - A simulated kubelet: a created pod is at once `Running` with a pod IP
//!   from 127.0.100.0/24 (loopback, so nothing leaves this machine if a test
//!   connects to it) and a container status; see
//!   [`restart_container`](ApiServerDouble::restart_container).
//!
//! Fault injection: [`fail_next`](ApiServerDouble::fail_next) answers the
//! next matching request with an error instead of applying it;
//! [`before_next`](ApiServerDouble::before_next) runs an action on the store
//! just before the next matching request is handled (a concurrent writer:
//! e.g. delete and re-create an object between the backend's read and its
//! delete); [`drop_watches`](ApiServerDouble::drop_watches) ends every open
//! watch. Every request is recorded ([`requests`](ApiServerDouble::requests)).
//!
//! [`serve`](ApiServerDouble::serve) serves it over HTTP on a loopback
//! listener, and [`kubeconfig`] writes the kubeconfig that points a separate
//! process (`lockstep serve --orchestrator kubernetes`) at it.
//!
//! Not implemented: other API groups and resources, patch, generateName,
//! field selectors, pagination, graceful deletion, finalizers and garbage
//! collection of owner references.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// The response body of the double.
pub type DoubleBody = UnsyncBoxBody<Bytes, Infallible>;

/// One request as the double received it.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedRequest {
    /// `GET`, `POST`, `PUT`, `DELETE`.
    pub method: Method,
    /// The path, without the query.
    pub path: String,
    /// The decoded query parameters.
    pub query: BTreeMap<String, String>,
    /// The JSON body, `Value::Null` if there was none.
    pub body: Value,
}

/// Which requests a fault applies to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matcher {
    /// The method.
    pub method: Method,
    /// The resource (`pods`, `services`, ...).
    pub resource: String,
    /// The object's name, or any object (and collection requests) if `None`.
    pub name: Option<String>,
}

impl Matcher {
    /// Requests with `method` on `resource`, object `name` if given.
    pub fn new(method: Method, resource: &str, name: Option<&str>) -> Matcher {
        Matcher {
            method,
            resource: resource.to_string(),
            name: name.map(str::to_string),
        }
    }

    fn matches(&self, method: &Method, resource: &str, name: Option<&str>) -> bool {
        self.method == *method
            && self.resource == resource
            && (self.name.is_none() || self.name.as_deref() == name)
    }
}

/// An action run on the store before a matching request is handled.
pub type Action = Box<dyn FnOnce(&ApiServerDouble) + Send>;

enum Fault {
    Fail(Matcher, u16, String),
    Before(Matcher, Action),
}

struct Watcher {
    resource: String,
    namespace: String,
    selector: String,
    tx: mpsc::UnboundedSender<Bytes>,
}

struct Event {
    rv: u64,
    resource: String,
    namespace: String,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    uids: u64,
    ips: u32,
    objects: BTreeMap<(String, String, String), Value>,
    history: Vec<Event>,
    compacted_below: u64,
    watchers: Vec<Watcher>,
    faults: Vec<Fault>,
    requests: Vec<RecordedRequest>,
    no_kubelet: bool,
}

/// The in-memory API server. Clones share the store; see the module docs.
#[derive(Clone, Default)]
pub struct ApiServerDouble {
    store: Arc<Mutex<Store>>,
}

impl std::fmt::Debug for ApiServerDouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.store.lock().expect("poisoned");
        f.debug_struct("ApiServerDouble")
            .field("resource_version", &s.rv)
            .field("objects", &s.objects.len())
            .finish_non_exhaustive()
    }
}

fn kind_of(resource: &str) -> Option<&'static str> {
    match resource {
        "pods" => Some("Pod"),
        "services" => Some("Service"),
        "secrets" => Some("Secret"),
        "configmaps" => Some("ConfigMap"),
        "poddisruptionbudgets" => Some("PodDisruptionBudget"),
        _ => None,
    }
}

/// The API group and version of a resource's objects.
fn api_version_of(resource: &str) -> &'static str {
    match resource {
        "poddisruptionbudgets" => "policy/v1",
        _ => "v1",
    }
}

fn status(code: u16, reason: &str, message: String) -> Value {
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

/// Whether `labels` satisfy the equality-based `selector`.
pub fn selector_matches(selector: &str, labels: &BTreeMap<String, String>) -> bool {
    selector
        .split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .all(|r| {
            if let Some((k, v)) = r.split_once("!=") {
                labels.get(k.trim()).map(String::as_str) != Some(v.trim())
            } else if let Some((k, v)) = r.split_once("==").or_else(|| r.split_once('=')) {
                labels.get(k.trim()).map(String::as_str) == Some(v.trim())
            } else if let Some(k) = r.strip_prefix('!') {
                !labels.contains_key(k.trim())
            } else {
                labels.contains_key(r)
            }
        })
}

fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object["metadata"]["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
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

fn error(code: u16, message: String) -> Response<DoubleBody> {
    full(
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &status(code, reason_of(code), message),
    )
}

impl Store {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn emit(&mut self, resource: &str, namespace: &str, kind: &'static str, object: Value) {
        let rv = self.rv;
        let line = Bytes::from(format!("{}\n", json!({"type": kind, "object": object})));
        let labels = labels_of(&object);
        self.watchers.retain(|w| {
            if w.resource != resource || w.namespace != namespace {
                return !w.tx.is_closed();
            }
            if !selector_matches(&w.selector, &labels) {
                return !w.tx.is_closed();
            }
            w.tx.send(line.clone()).is_ok()
        });
        self.history.push(Event {
            rv,
            resource: resource.to_string(),
            namespace: namespace.to_string(),
            kind,
            object,
        });
    }

    fn insert(
        &mut self,
        resource: &str,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, (u16, String)> {
        let Some(kind) = kind_of(resource) else {
            return Err((
                404,
                format!("the server could not find the requested resource {resource}"),
            ));
        };
        let Some(name) = object["metadata"]["name"].as_str().map(str::to_string) else {
            return Err((422, "metadata.name: Required value".to_string()));
        };
        let key = (resource.to_string(), namespace.to_string(), name.clone());
        if self.objects.contains_key(&key) {
            return Err((409, format!("{resource} \"{name}\" already exists")));
        }
        self.uids += 1;
        let rv = self.next_rv();
        object["kind"] = json!(kind);
        object["apiVersion"] = json!(api_version_of(resource));
        let meta = &mut object["metadata"];
        meta["namespace"] = json!(namespace);
        meta["uid"] = json!(format!("00000000-0000-4000-8000-{:012}", self.uids));
        meta["resourceVersion"] = json!(rv.to_string());
        meta["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        if resource == "pods" && !self.no_kubelet {
            self.ips += 1;
            let containers: Vec<Value> = object["spec"]["containers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|c| {
                    json!({
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": "",
                        "ready": true,
                        "restartCount": 0,
                        "started": true,
                    })
                })
                .collect();
            object["status"] = json!({
                "phase": "Running",
                "podIP": format!("127.0.100.{}", self.ips % 250 + 1),
                "containerStatuses": containers,
            });
        }
        self.objects.insert(key, object.clone());
        self.emit(resource, namespace, "ADDED", object.clone());
        Ok(object)
    }

    fn replace(
        &mut self,
        resource: &str,
        namespace: &str,
        name: &str,
        mut object: Value,
    ) -> Result<Value, (u16, String)> {
        let key = (
            resource.to_string(),
            namespace.to_string(),
            name.to_string(),
        );
        let Some(stored) = self.objects.get(&key).cloned() else {
            return Err((404, format!("{resource} \"{name}\" not found")));
        };
        let stored_rv = stored["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let stored_uid = stored["metadata"]["uid"].as_str().unwrap_or("").to_string();
        if let Some(uid) = object["metadata"]["uid"].as_str() {
            if uid != stored_uid {
                return Err((409, format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {stored_uid}")));
            }
        }
        if let Some(rv) = object["metadata"]["resourceVersion"].as_str() {
            if rv != stored_rv {
                return Err((409, format!("Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; please apply your changes to the latest version and try again")));
            }
        }
        if resource == "pods" && object["spec"] != stored["spec"] {
            return Err((422, format!("Pod \"{name}\" is invalid: spec: Forbidden: pod updates may not change fields other than image and a few others")));
        }
        let rv = self.next_rv();
        object["kind"] = stored["kind"].clone();
        object["apiVersion"] = stored["apiVersion"].clone();
        object["status"] = stored["status"].clone();
        let meta = &mut object["metadata"];
        meta["namespace"] = json!(namespace);
        meta["uid"] = json!(stored_uid);
        meta["resourceVersion"] = json!(rv.to_string());
        meta["creationTimestamp"] = stored["metadata"]["creationTimestamp"].clone();
        self.objects.insert(key, object.clone());
        self.emit(resource, namespace, "MODIFIED", object.clone());
        Ok(object)
    }

    fn delete(
        &mut self,
        resource: &str,
        namespace: &str,
        name: &str,
        options: &Value,
    ) -> Result<Value, (u16, String)> {
        let key = (
            resource.to_string(),
            namespace.to_string(),
            name.to_string(),
        );
        let Some(stored) = self.objects.get(&key).cloned() else {
            return Err((404, format!("{resource} \"{name}\" not found")));
        };
        let pre = &options["preconditions"];
        if let Some(uid) = pre["uid"].as_str() {
            let have = stored["metadata"]["uid"].as_str().unwrap_or("");
            if uid != have {
                return Err((409, format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {have}")));
            }
        }
        if let Some(rv) = pre["resourceVersion"].as_str() {
            let have = stored["metadata"]["resourceVersion"].as_str().unwrap_or("");
            if rv != have {
                return Err((409, format!("Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {have}")));
            }
        }
        self.objects.remove(&key);
        let rv = self.next_rv();
        let mut gone = stored;
        gone["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.emit(resource, namespace, "DELETED", gone.clone());
        Ok(gone)
    }
}

impl ApiServerDouble {
    /// An empty API server with a kubelet that runs every pod at once.
    pub fn new() -> ApiServerDouble {
        ApiServerDouble::default()
    }

    /// A client of this API server whose default namespace is `namespace`.
    pub fn client(&self, namespace: &str) -> kube::Client {
        kube::Client::new(self.clone(), namespace.to_string())
    }

    /// Turns the simulated kubelet off: new pods stay `Pending`, without IP.
    pub fn set_kubelet(&self, running: bool) {
        self.store.lock().expect("poisoned").no_kubelet = !running;
    }

    /// Every request received so far.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.store.lock().expect("poisoned").requests.clone()
    }

    /// The store's current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.store.lock().expect("poisoned").rv
    }

    /// The stored object, if any.
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        self.store
            .lock()
            .expect("poisoned")
            .objects
            .get(&(
                resource.to_string(),
                namespace.to_string(),
                name.to_string(),
            ))
            .cloned()
    }

    /// The names of every stored object of `resource` in `namespace`.
    pub fn names(&self, resource: &str, namespace: &str) -> Vec<String> {
        self.store
            .lock()
            .expect("poisoned")
            .objects
            .keys()
            .filter(|(r, n, _)| r == resource && n == namespace)
            .map(|(_, _, name)| name.clone())
            .collect()
    }

    /// Creates an object as another client would (a new uid and version).
    pub fn create(&self, resource: &str, namespace: &str, object: Value) -> Result<Value, String> {
        self.store
            .lock()
            .expect("poisoned")
            .insert(resource, namespace, object)
            .map_err(|(c, m)| format!("{c}: {m}"))
    }

    /// Replaces an object unconditionally, as another client would.
    pub fn replace(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
        mut object: Value,
    ) -> Result<Value, String> {
        if let Some(meta) = object["metadata"].as_object_mut() {
            meta.remove("resourceVersion");
            meta.remove("uid");
        }
        self.store
            .lock()
            .expect("poisoned")
            .replace(resource, namespace, name, object)
            .map_err(|(c, m)| format!("{c}: {m}"))
    }

    /// Deletes an object unconditionally, as another client would.
    pub fn delete(&self, resource: &str, namespace: &str, name: &str) -> Result<Value, String> {
        self.store
            .lock()
            .expect("poisoned")
            .delete(resource, namespace, name, &Value::Null)
            .map_err(|(c, m)| format!("{c}: {m}"))
    }

    /// The kubelet restarts pod `name`'s container in place (it exited):
    /// its restart count goes up and a `MODIFIED` event is sent.
    pub fn restart_container(&self, namespace: &str, name: &str) -> Result<(), String> {
        let mut s = self.store.lock().expect("poisoned");
        let key = ("pods".to_string(), namespace.to_string(), name.to_string());
        let Some(mut pod) = s.objects.get(&key).cloned() else {
            return Err(format!("no pod {name}"));
        };
        if let Some(cs) = pod["status"]["containerStatuses"].as_array_mut() {
            for c in cs {
                c["restartCount"] = json!(c["restartCount"].as_i64().unwrap_or(0) + 1);
            }
        }
        let rv = s.next_rv();
        pod["metadata"]["resourceVersion"] = json!(rv.to_string());
        s.objects.insert(key, pod.clone());
        s.emit("pods", namespace, "MODIFIED", pod);
        Ok(())
    }

    /// Answers the next request matching `matcher` with `code` (a Status
    /// body) instead of handling it.
    pub fn fail_next(&self, matcher: Matcher, code: u16, message: &str) {
        self.store
            .lock()
            .expect("poisoned")
            .faults
            .push(Fault::Fail(matcher, code, message.to_string()));
    }

    /// Runs `action` just before the next request matching `matcher` is
    /// handled (a concurrent writer acting between a read and a write).
    pub fn before_next(
        &self,
        matcher: Matcher,
        action: impl FnOnce(&ApiServerDouble) + Send + 'static,
    ) {
        self.store
            .lock()
            .expect("poisoned")
            .faults
            .push(Fault::Before(matcher, Box::new(action)));
    }

    /// Ends every open watch (a dropped connection, an API server restart).
    /// Returns how many were open.
    pub fn drop_watches(&self) -> usize {
        let mut s = self.store.lock().expect("poisoned");
        let n = s.watchers.iter().filter(|w| !w.tx.is_closed()).count();
        s.watchers.clear();
        n
    }

    /// How many watches are open.
    pub fn open_watches(&self) -> usize {
        let s = self.store.lock().expect("poisoned");
        s.watchers.iter().filter(|w| !w.tx.is_closed()).count()
    }

    /// Forgets the event history (etcd compaction): a watch from an older
    /// resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        let mut s = self.store.lock().expect("poisoned");
        s.history.clear();
        s.compacted_below = s.rv;
    }

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
            ["apis", "policy", "v1", "namespaces", ns, resource] => (*ns, *resource, None),
            ["apis", "policy", "v1", "namespaces", ns, resource, name] => {
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
                .objects
                .get(&(
                    resource.to_string(),
                    namespace.to_string(),
                    name.to_string(),
                ))
                .cloned()
                .map(|o| (StatusCode::OK, o))
                .ok_or((404, format!("{resource} \"{name}\" not found"))),
            (&Method::GET, None) if query.get("watch").map(String::as_str) == Some("true") => {
                return self.watch(&mut s, resource, namespace, &query);
            }
            (&Method::GET, None) => {
                let selector = query.get("labelSelector").cloned().unwrap_or_default();
                let items: Vec<Value> = s
                    .objects
                    .iter()
                    .filter(|((r, n, _), o)| {
                        r == resource
                            && n == namespace
                            && selector_matches(&selector, &labels_of(o))
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

    fn watch(
        &self,
        s: &mut Store,
        resource: &str,
        namespace: &str,
        query: &BTreeMap<String, String>,
    ) -> Response<DoubleBody> {
        let selector = query.get("labelSelector").cloned().unwrap_or_default();
        let from: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(s.rv);
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        if from < s.compacted_below {
            let gone = status(
                410,
                "Expired",
                format!("too old resource version: {from} ({})", s.compacted_below),
            );
            let _ = tx.send(Bytes::from(format!(
                "{}\n",
                json!({"type": "ERROR", "object": gone})
            )));
            drop(tx);
        } else {
            for e in &s.history {
                if e.rv > from
                    && e.resource == resource
                    && e.namespace == namespace
                    && selector_matches(&selector, &labels_of(&e.object))
                {
                    let _ = tx.send(Bytes::from(format!(
                        "{}\n",
                        json!({"type": e.kind, "object": e.object})
                    )));
                }
            }
            s.watchers.push(Watcher {
                resource: resource.to_string(),
                namespace: namespace.to_string(),
                selector,
                tx,
            });
        }
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, Infallible>(http_body::Frame::data(b)), rx))
        })
        .boxed();
        Response::builder()
            .status(StatusCode::OK)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(StreamBody::new(stream).boxed_unsync())
            .expect("a valid response")
    }
}

/// A kubeconfig whose current context is the API server at `url` (plain
/// HTTP, no credentials) with default namespace `namespace`.
pub fn kubeconfig(url: &str, namespace: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: api-double
  cluster:
    server: {url}
contexts:
- name: api-double
  context:
    cluster: api-double
    user: api-double
    namespace: {namespace}
users:
- name: api-double
  user: {{}}
current-context: api-double
"
    )
}

impl ApiServerDouble {
    /// Serves this API server over HTTP/1 on `listener` (bind it to a
    /// loopback address) until the returned task is aborted.
    pub fn serve(&self, listener: tokio::net::TcpListener) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let service = hyper_util::service::TowerToHyperService::new(me.clone());
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        })
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
