//! Which image replica pods run: always a pinned one (a version tag or a
//! digest), so that a pod restarted by the kubelet, or a service restarted
//! by the backend, runs the build its siblings run.
//!
//! `lockstep serve` takes, in order: `--kubernetes-image` (checked by
//! [`check_pinned`]), else the image of the environment's own Deployment
//! (`--kubernetes-owner`, [`owner_image`]: the replicas run the
//! environment's build), else [`default_image`] (`localhost/lockstep:VERSION`).

use k8s_openapi::api::apps::v1::Deployment;

/// The container of the environment's Deployment whose image replica pods
/// run when no image is named (else its first container's).
pub const ENVIRONMENT_CONTAINER: &str = "environment";

/// `localhost/lockstep:VERSION`, this build's own tag: a full name (a short
/// name such as `lockstep:VERSION` resolves to Docker Hub's
/// `docker.io/library/lockstep`, which is not this project's), naming a
/// locally built image (podman tags `cargo xtask image`'s as
/// `localhost/lockstep:dev`); an overlay names its registry's.
pub fn default_image() -> String {
    format!("localhost/lockstep:{}", env!("CARGO_PKG_VERSION"))
}

/// Whether `image` names its registry (the part before the first `/` holds
/// a `.` or a `:`, or is `localhost`): a short name is resolved by each
/// runtime's own rules, Docker Hub for most.
pub fn fully_qualified(image: &str) -> bool {
    image
        .split_once('/')
        .is_some_and(|(host, _)| host == "localhost" || host.contains('.') || host.contains(':'))
}

/// Accepts an image reference that names one build: a digest
/// (`NAME@sha256:...`) or a tag other than `latest`. Refuses a reference
/// with no tag (which means `latest`) or the tag `latest`, saying why: a
/// moving tag lets one replica's processes run different builds.
pub fn check_pinned(image: &str) -> Result<(), String> {
    if image.trim().is_empty() {
        return Err("the replica image is empty".to_string());
    }
    if let Some((_, digest)) = image.split_once('@') {
        return if digest.contains(':') && digest.len() > 8 {
            Ok(())
        } else {
            Err(format!(
                "the replica image {image:?} has a malformed digest"
            ))
        };
    }
    // A tag follows the last ':' after the last '/' (a registry's port
    // comes before a '/').
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, "latest")) => Err(format!(
            "the replica image {image:?} names the moving tag `latest`: a pod restarted later \
             could run another build than its siblings; name a version tag or a digest"
        )),
        Some((_, tag)) if !tag.is_empty() => Ok(()),
        _ => Err(format!(
            "the replica image {image:?} has no tag (it means `latest`, which moves): name a \
             version tag or a digest"
        )),
    }
}

/// The image of `deployment`'s container [`ENVIRONMENT_CONTAINER`] (else
/// its first container), checked by [`check_pinned`].
pub fn owner_image(deployment: &Deployment) -> Result<String, String> {
    let name = deployment.metadata.name.as_deref().unwrap_or("?");
    let containers = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    let container = containers
        .iter()
        .find(|c| c.name == ENVIRONMENT_CONTAINER)
        .or_else(|| containers.first())
        .ok_or_else(|| format!("Deployment {name} has no container"))?;
    let image = container.image.clone().ok_or_else(|| {
        format!(
            "Deployment {name}'s container {} has no image",
            container.name
        )
    })?;
    check_pinned(&image).map_err(|e| format!("Deployment {name}: {e}"))?;
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_version_tag_or_a_digest_is_pinned() {
        for ok in [
            "lockstep:0.3.0",
            "registry.example:5000/lockstep:v1",
            "lockstep@sha256:0123456789abcdef",
            "r:5000/team/lockstep@sha256:00ff00ff00",
        ] {
            assert_eq!(check_pinned(ok), Ok(()), "{ok}");
        }
        for bad in [
            "lockstep",
            "lockstep:latest",
            "registry.example:5000/lockstep",
            "registry.example:5000/lockstep:latest",
            "lockstep@sha256",
            "",
            "lockstep:",
        ] {
            assert!(check_pinned(bad).is_err(), "{bad} was accepted");
        }
        assert_eq!(check_pinned(&default_image()), Ok(()));
    }

    #[test]
    fn a_full_name_names_its_registry() {
        assert!(fully_qualified(&default_image()));
        for full in [
            "registry.example.com/lockstep:1",
            "r:5000/lockstep:1",
            "localhost/lockstep:1",
        ] {
            assert!(fully_qualified(full), "{full}");
        }
        for short in ["lockstep:1", "team/lockstep:1"] {
            assert!(!fully_qualified(short), "{short}");
        }
    }

    #[test]
    fn the_owner_image_is_the_environment_container_s() {
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "env"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "sidecar", "image": "proxy:1"},
                {"name": "environment", "image": "lockstep:0.3.0"}
            ]}}}
        }))
        .unwrap();
        assert_eq!(owner_image(&deployment), Ok("lockstep:0.3.0".to_string()));
        let unpinned: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "env"},
            "spec": {"selector": {}, "template": {"spec": {"containers": [
                {"name": "environment", "image": "lockstep:latest"}
            ]}}}
        }))
        .unwrap();
        let err = owner_image(&unpinned).unwrap_err();
        assert!(
            err.contains("Deployment env") && err.contains("latest"),
            "{err}"
        );
    }
}
