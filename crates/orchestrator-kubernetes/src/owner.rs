//! The environment's own object, which every object made for a replica is
//! owned by (so deleting the environment's Deployment garbage-collects its
//! replicas): named as `Deployment/NAME`, or found from the environment's
//! own pod (`Pod/NAME`: its ReplicaSet's Deployment).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

/// The owner reference to the environment's own object (for
/// [`KubernetesOrchestratorConfig::owner`]), `object` as
/// `Deployment/NAME`, or `Pod/NAME` for the Deployment that controls that
/// pod through its ReplicaSet (the environment's own pod, from the downward
/// API: no object's name is written in the manifests, so a kustomize
/// `namePrefix` changes nothing), read from the API server in `namespace`
/// for its UID. An error names the object and says what is wrong.
pub async fn owner_of(
    client: kube::Client,
    namespace: &str,
    object: &str,
) -> Result<OwnerReference, String> {
    owner_object(client, namespace, object)
        .await
        .map(|(r, _)| r)
}

/// [`owner_of`] and the Deployment read (whose container image replica pods
/// run unless one is named: [`crate::image::owner_image`]).
pub async fn owner_object(
    client: kube::Client,
    namespace: &str,
    object: &str,
) -> Result<(OwnerReference, k8s_openapi::api::apps::v1::Deployment), String> {
    let name = match object.split_once('/') {
        Some(("Deployment", name)) if !name.is_empty() && !name.contains('/') => name.to_string(),
        Some(("Pod", pod)) if !pod.is_empty() && !pod.contains('/') => {
            deployment_of_pod(client.clone(), namespace, pod).await?
        }
        _ => {
            return Err(format!(
                "the environment's owner object {object:?} is not Deployment/NAME or Pod/NAME"
            ))
        }
    };
    let api: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(client, namespace);
    let deployment = api
        .get(&name)
        .await
        .map_err(|e| format!("reading Deployment {name} in namespace {namespace}: {e}"))?;
    let uid = deployment
        .metadata
        .uid
        .clone()
        .ok_or_else(|| format!("Deployment {name} in namespace {namespace} has no uid"))?;
    Ok((
        owner_reference("apps/v1", "Deployment", &name, &uid),
        deployment,
    ))
}

/// The name of the Deployment that controls `pod` (its controller is a
/// ReplicaSet, whose controller is the Deployment).
async fn deployment_of_pod(
    client: kube::Client,
    namespace: &str,
    pod: &str,
) -> Result<String, String> {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    fn controller<'m>(meta: &'m ObjectMeta, kind: &str, what: &str) -> Result<&'m str, String> {
        meta.owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true))
            .filter(|r| r.kind == kind)
            .map(|r| r.name.as_str())
            .ok_or_else(|| format!("{what} is not controlled by a {kind}: run the environment as a Deployment, or name it with Deployment/NAME"))
    }
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(client.clone(), namespace);
    let p = pods
        .get(pod)
        .await
        .map_err(|e| format!("reading Pod {pod} in namespace {namespace}: {e}"))?;
    let replica_set = controller(&p.metadata, "ReplicaSet", &format!("Pod {pod}"))?.to_string();
    let sets: kube::Api<k8s_openapi::api::apps::v1::ReplicaSet> =
        kube::Api::namespaced(client, namespace);
    let rs = sets
        .get(&replica_set)
        .await
        .map_err(|e| format!("reading ReplicaSet {replica_set} in namespace {namespace}: {e}"))?;
    controller(
        &rs.metadata,
        "Deployment",
        &format!("ReplicaSet {replica_set}"),
    )
    .map(str::to_string)
}

/// The owner reference of the environment's own object, for
/// [`KubernetesOrchestratorConfig::owner`]: `kind/name` (of `api_version`)
/// with `uid`, neither the controller nor blocking its owner's deletion.
pub fn owner_reference(api_version: &str, kind: &str, name: &str, uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: api_version.to_string(),
        kind: kind.to_string(),
        name: name.to_string(),
        uid: uid.to_string(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    }
}
