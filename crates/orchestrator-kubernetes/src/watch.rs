//! The pod watch and the shared-fate task it feeds.

use super::*;

/// Watches the environment's pods and turns what happens to them into
/// [`ServiceEvent`]s, and (with `fate`) into checks for the shared-fate
/// task: every list asks it to check every service, every death of a pod
/// (its container restarted, it failed, it was deleted) its service. A
/// watch that ends or fails (the API server drops it, or answers 410 Gone)
/// is followed by a fresh list and a new watch from the list's
/// resourceVersion, so no change is missed for long.
pub(super) async fn watch_pods(
    pods: Api<Pod>,
    selector: String,
    events: broadcast::Sender<ServiceEvent>,
    fate: Option<mpsc::UnboundedSender<Check>>,
) {
    let check = |c: Check| {
        if let Some(f) = &fate {
            let _ = f.send(c);
        }
    };
    let service_of = |p: &Pod| p.labels().get(SERVICE_LABEL).cloned();
    let mut known: BTreeMap<String, Seen> = BTreeMap::new();
    loop {
        let list = match pods.list(&ListParams::default().labels(&selector)).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("listing pods for the watch failed: {e}; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let version = list.metadata.resource_version.clone().unwrap_or_default();
        let mut now = BTreeMap::new();
        for p in &list.items {
            now.insert(p.name_any(), seen(p));
        }
        // What changed while we were not watching.
        for (name, (uid, _, _)) in &known {
            if now.get(name).map(|(u, _, _)| u) != Some(uid) {
                emit_exit(&events, name, "deleted while the watch was down");
            }
        }
        known = now;
        check(Check::All);
        let wp = WatchParams::default().labels(&selector).timeout(290);
        let stream = match pods.watch(&wp, &version).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("watching pods failed: {e}; listing again");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut stream = std::pin::pin!(stream.into_stream());
        while let Some(event) = stream.next().await {
            match event {
                Ok(WatchEvent::Added(p)) => {
                    known.insert(p.name_any(), seen(&p));
                }
                Ok(WatchEvent::Modified(p)) => {
                    let (uid, restarts, failed) = seen(&p);
                    let before = known.insert(p.name_any(), (uid, restarts, failed));
                    let restarted = before.as_ref().is_some_and(|(_, r, _)| restarts > *r);
                    let newly_failed = failed && !before.is_some_and(|(_, _, f)| f);
                    if restarted {
                        emit_exit(
                            &events,
                            &p.name_any(),
                            "the container exited; the kubelet restarted it",
                        );
                    } else if newly_failed {
                        emit_exit(&events, &p.name_any(), "the pod failed");
                    }
                    if restarted || newly_failed {
                        if let Some(s) = service_of(&p) {
                            check(Check::Service(s));
                        }
                    }
                }
                Ok(WatchEvent::Deleted(p)) => {
                    known.remove(&p.name_any());
                    emit_exit(&events, &p.name_any(), "pod deleted");
                    if let Some(s) = service_of(&p) {
                        check(Check::Service(s));
                    }
                }
                Ok(WatchEvent::Bookmark(_)) => {}
                Ok(WatchEvent::Error(status)) => {
                    tracing::info!("watch error {}: listing again", status.code);
                    break;
                }
                Err(e) => {
                    tracing::info!("watch failed: {e}; listing again");
                    break;
                }
            }
        }
        tracing::debug!("pod watch ended; listing and watching again");
    }
}

/// The shared-fate task: gathers the watch's checks for
/// [`KubernetesOrchestratorConfig::shared_fate_delay`] (pods dying together
/// cause one restart), then checks each service named (every live one after
/// a list) and restarts it as a whole if a pod of it died. A check that
/// fails is tried again after [`SHARED_FATE_RETRY`].
pub(super) async fn shared_fate(
    inner: Arc<Inner>,
    tx: mpsc::UnboundedSender<Check>,
    mut rx: mpsc::UnboundedReceiver<Check>,
) {
    let retry = |c: Check| {
        let tx = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(SHARED_FATE_RETRY).await;
            let _ = tx.send(c);
        });
    };
    loop {
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut all = false;
        let mut names = BTreeSet::new();
        let mut add = |c: Check| match c {
            Check::All => all = true,
            Check::Service(s) => {
                names.insert(s);
            }
        };
        add(first);
        let deadline = tokio::time::Instant::now() + inner.config.shared_fate_delay;
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(c)) => add(c),
                Ok(None) => return,
                Err(_) => break,
            }
        }
        if all {
            match inner.list_records().await {
                Ok(records) => names.extend(records.iter().map(|r| r.name_any())),
                Err(e) => {
                    tracing::warn!("shared fate: listing the services failed: {e}; trying again");
                    retry(Check::All);
                }
            }
        }
        for name in names {
            if let Err(e) = inner.check_shared_fate(&name).await {
                tracing::warn!(service = %name, "shared fate: the whole restart failed: {e}; trying again");
                retry(Check::Service(name));
            }
        }
    }
}

pub(super) fn emit_exit(events: &broadcast::Sender<ServiceEvent>, pod: &str, status: &str) {
    let (service, index) = match pod.rsplit_once('-') {
        Some((s, i)) => (s.to_string(), i.parse().ok()),
        None => (pod.to_string(), None),
    };
    let _ = events.send(ServiceEvent {
        service,
        process: index,
        kind: ServiceEventKind::Exited {
            pid: 0,
            status: status.to_string(),
        },
    });
}
