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
//!   (`k=v`, `k==v`, `k!=v`, `k`, `!k`) and by the one field selector
//!   `metadata.name=NAME` (any other is refused, 400), carrying the store's
//!   resourceVersion.
//! - **replace** (`PUT`): 409 `Conflict` if the body's resourceVersion (or
//!   uid) is not the stored one — the compare-and-swap. A pod's spec may not
//!   change (422), as on a real server.
//! - **delete** (`DELETE`) with `DeleteOptions.preconditions`: 409 `Conflict`
//!   if the uid or resourceVersion does not match. Deletion is immediate
//!   (a kubelet that stops containers at once).
//! - **watch** (`GET ?watch=true`): streams `ADDED` / `MODIFIED` / `DELETED`
//!   after the given resourceVersion, filtered as a list is; a version
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
//! other field selectors, pagination (`limit` is ignored: one page), graceful deletion, finalizers and garbage
//! collection of owner references.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::Method;
use http_body_util::combinators::UnsyncBoxBody;
use serde_json::{json, Value};

mod routing;
mod store;
mod watch;

pub use store::selector_matches;
use store::Store;

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

    pub(crate) fn matches(&self, method: &Method, resource: &str, name: Option<&str>) -> bool {
        self.method == *method
            && self.resource == resource
            && (self.name.is_none() || self.name.as_deref() == name)
    }
}

/// An action run on the store before a matching request is handled.
pub type Action = Box<dyn FnOnce(&ApiServerDouble) + Send>;

pub(crate) enum Fault {
    Fail(Matcher, u16, String),
    Before(Matcher, Action),
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
            .object(resource, namespace, name)
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

    /// Changes pod `name`'s status with `change`, as its kubelet would (a
    /// new resourceVersion, a MODIFIED event; a client's replace keeps the
    /// stored status).
    pub fn update_pod_status(
        &self,
        namespace: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> Result<(), String> {
        let mut s = self.store.lock().expect("poisoned");
        let key = ("pods".to_string(), namespace.to_string(), name.to_string());
        let Some(mut pod) = s.objects.get(&key).cloned() else {
            return Err(format!("no pod {name}"));
        };
        change(&mut pod["status"]);
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
