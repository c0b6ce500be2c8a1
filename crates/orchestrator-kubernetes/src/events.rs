//! Kubernetes Events on a replica's headless Service (its record), so that
//! `kubectl describe service NAME` and `kubectl get events` show what the
//! backend did to it and why: a restart the environment asked for, a
//! shared-fate restart (a pod died), a new generation for a changed spec
//! (an upgrade) and a refused write (a newer environment owns the service).
//! Best effort: an Event that cannot be written within [`EVENT_BOUND`] is
//! logged and dropped; it never fails or holds up the operation.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::PostParams;

use super::Inner;
use crate::objects::{ENVIRONMENT_LABEL, MANAGED_BY, MANAGED_BY_LABEL};

/// How long writing one Event may take.
pub(crate) const EVENT_BOUND: Duration = Duration::from_secs(2);

/// The Event's `reason`s this backend writes.
pub mod reasons {
    /// Every pod replaced because the environment asked (a replica restart).
    pub const RESTARTED: &str = "Restarted";
    /// Every pod replaced because one of the current generation died, went
    /// or runs another spec (shared fate).
    pub const SHARED_FATE: &str = "SharedFateRestart";
    /// A new generation for a changed spec or a missing pod at an ensure
    /// (an upgrade: another image or arguments).
    pub const NEW_GENERATION: &str = "NewGeneration";
    /// A write refused: a newer environment ensured or dropped the service.
    pub const REFUSED: &str = "Refused";
}

/// Why every pod of a service was replaced by a new generation.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Replaced<'a> {
    /// The environment restarted the replica.
    Restarted,
    /// A pod of the current generation died, went or runs another spec
    /// (the reason said).
    SharedFate(&'a str),
    /// An ensure found a changed spec (an upgrade) or a pod missing.
    NewGeneration,
}

impl Inner {
    /// Writes the Event saying service `service`'s pods were replaced by
    /// `generation`, and why. Called after the service's lock is released:
    /// a slow Event never holds up the service's next write.
    pub(crate) async fn replaced_event(&self, service: &str, why: Replaced<'_>, generation: u64) {
        let (reason, message, warning) = match why {
            Replaced::Restarted => (
                reasons::RESTARTED,
                format!("every pod replaced by generation {generation} (the environment restarted the replica)"),
                false,
            ),
            Replaced::SharedFate(cause) => (
                reasons::SHARED_FATE,
                format!("{cause}: every pod replaced by generation {generation} (shared fate)"),
                true,
            ),
            Replaced::NewGeneration => (
                reasons::NEW_GENERATION,
                format!("every pod replaced by generation {generation}: a changed spec (an upgrade) or a pod missing at an ensure"),
                false,
            ),
        };
        self.event(service, reason, message, warning).await;
    }

    /// Writes an Event about service `service` (`warning`: type Warning,
    /// else Normal); see the module docs.
    pub(crate) async fn event(&self, service: &str, reason: &str, message: String, warning: bool) {
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(format!("{service}.{nanos:x}")),
                labels: Some(std::collections::BTreeMap::from([
                    (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
                    (
                        ENVIRONMENT_LABEL.to_string(),
                        self.config.environment.clone(),
                    ),
                ])),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Service".into()),
                name: Some(service.to_string()),
                namespace: Some(self.config.namespace.clone()),
                ..Default::default()
            },
            reason: Some(reason.to_string()),
            message: Some(message),
            type_: Some(if warning { "Warning" } else { "Normal" }.into()),
            source: Some(EventSource {
                component: Some("lockstep".into()),
                ..Default::default()
            }),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            reporting_component: Some("lockstep".into()),
            reporting_instance: Some(format!("epoch-{}", self.config.epoch)),
            ..Default::default()
        };
        match tokio::time::timeout(
            EVENT_BOUND,
            self.events_api.create(&PostParams::default(), &event),
        )
        .await
        {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(service, reason, error = %e, "a Kubernetes Event was not written")
            }
            Err(_) => tracing::warn!(
                service,
                reason,
                "a Kubernetes Event was not written within {EVENT_BOUND:?}"
            ),
        }
    }
}
