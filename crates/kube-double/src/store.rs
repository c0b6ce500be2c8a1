//! The object store: the stored objects by resource, namespace and name,
//! the one resourceVersion counter, what a resource's objects look like
//! (kind, apiVersion, labels and selectors), and create, replace and delete
//! with their preconditions and the simulated kubelet.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::watch::{Event, Watcher};
use crate::{Fault, RecordedRequest};

#[derive(Default)]
pub(crate) struct Store {
    pub(crate) rv: u64,
    pub(crate) uids: u64,
    pub(crate) ips: u32,
    pub(crate) objects: BTreeMap<(String, String, String), Value>,
    pub(crate) history: Vec<Event>,
    pub(crate) compacted_below: u64,
    pub(crate) watchers: Vec<Watcher>,
    pub(crate) faults: Vec<Fault>,
    pub(crate) requests: Vec<RecordedRequest>,
    pub(crate) no_kubelet: bool,
}

pub(crate) fn kind_of(resource: &str) -> Option<&'static str> {
    match resource {
        "pods" => Some("Pod"),
        "services" => Some("Service"),
        "secrets" => Some("Secret"),
        "configmaps" => Some("ConfigMap"),
        "poddisruptionbudgets" => Some("PodDisruptionBudget"),
        "deployments" => Some("Deployment"),
        "replicasets" => Some("ReplicaSet"),
        "events" => Some("Event"),
        _ => None,
    }
}

/// The API group and version of a resource's objects.
pub(crate) fn api_version_of(resource: &str) -> &'static str {
    match resource {
        "poddisruptionbudgets" => "policy/v1",
        "deployments" | "replicasets" => "apps/v1",
        _ => "v1",
    }
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

pub(crate) fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object["metadata"]["labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

impl Store {
    pub(crate) fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    pub(crate) fn insert(
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

    /// The stored object `resource` `namespace`/`name`, if any.
    pub(crate) fn object(&self, resource: &str, namespace: &str, name: &str) -> Option<&Value> {
        self.objects.get(&(
            resource.to_string(),
            namespace.to_string(),
            name.to_string(),
        ))
    }

    pub(crate) fn replace(
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

    pub(crate) fn delete(
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
