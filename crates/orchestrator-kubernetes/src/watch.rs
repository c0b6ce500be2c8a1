//! The pod watch and the shared-fate task it feeds.

use super::*;

/// Watches the environment's pods (kube's `watcher`: a list, then a watch
/// from its resourceVersion; a watch that ends is opened again from the
/// last version seen, one that fails or answers 410 Gone is followed by a
/// fresh list, retried with [`watch_backoff`]) and turns
/// what happens to them into [`ServiceEvent`]s, and (with `fate`) into
/// checks for the shared-fate task: every list asks it to check every
/// service, every death of a pod (its container restarted, it failed, it
/// began terminating, it was deleted) and every image a pod's kubelet
/// reports anew (one build per generation) its service.
pub(super) async fn watch_pods(
    pods: Api<Pod>,
    selector: String,
    events: broadcast::Sender<ServiceEvent>,
    fate: Option<mpsc::UnboundedSender<Check>>,
) {
    use kube::runtime::watcher::{watcher, Config, Event};
    use kube::runtime::WatchStreamExt;

    let check = |c: Check| {
        if let Some(f) = &fate {
            let _ = f.send(c);
        }
    };
    let service_of = |p: &Pod| p.labels().get(SERVICE_LABEL).cloned();
    let mut known: BTreeMap<String, Seen> = BTreeMap::new();
    // The pods of a list in progress.
    let mut listed: Option<BTreeMap<String, Seen>> = None;
    let config = Config::default().labels(&selector).timeout(290);
    let stream = watcher(pods, config).backoff(watch_backoff());
    let mut stream = std::pin::pin!(stream);
    while let Some(event) = stream.next().await {
        match event {
            Ok(Event::Init) => listed = Some(BTreeMap::new()),
            Ok(Event::InitApply(p)) => {
                listed
                    .get_or_insert_with(BTreeMap::new)
                    .insert(p.name_any(), seen(&p));
            }
            Ok(Event::InitDone) => {
                let now = listed.take().unwrap_or_default();
                // What changed while we were not watching.
                for (name, was) in &known {
                    if now.get(name).map(|s| &s.uid) != Some(&was.uid) {
                        emit_exit(&events, was, "deleted while the watch was down");
                    }
                }
                known = now;
                check(Check::All);
            }
            Ok(Event::Apply(p)) => {
                let now = seen(&p);
                let before = known.insert(p.name_any(), now.clone());
                let restarted = before.as_ref().is_some_and(|b| now.restarts > b.restarts);
                let newly_failed = now.failed && !before.as_ref().is_some_and(|b| b.failed);
                // Terminating: on a lost node no delete event follows.
                let newly_deleting = now.deleting && !before.as_ref().is_some_and(|b| b.deleting);
                // Its build now known: is it its siblings'?
                let newly_imaged =
                    now.image.is_some() && before.is_none_or(|b| b.image != now.image);
                if restarted {
                    emit_exit(
                        &events,
                        &now,
                        "the container exited; the kubelet restarted it",
                    );
                } else if newly_failed {
                    emit_exit(&events, &now, "the pod failed");
                }
                if restarted || newly_failed || newly_deleting || newly_imaged {
                    if let Some(s) = service_of(&p) {
                        check(Check::Service(s));
                    }
                }
            }
            Ok(Event::Delete(p)) => {
                known.remove(&p.name_any());
                emit_exit(&events, &seen(&p), "pod deleted");
                if let Some(s) = service_of(&p) {
                    check(Check::Service(s));
                }
            }
            Err(e) => tracing::info!("pod watch: {e}; the watcher starts again after a backoff"),
        }
    }
}

/// How the pod watch retries after an error: from 200 ms, doubling, at most
/// 2 s apart (a restarted API server is seen again within seconds; the
/// watcher's default waits up to 30 s).
fn watch_backoff() -> kube::runtime::watcher::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(2))
        .without_max_times()
        .with_jitter()
        .into()
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

pub(super) fn emit_exit(events: &broadcast::Sender<ServiceEvent>, pod: &Seen, status: &str) {
    let _ = events.send(ServiceEvent {
        service: pod.service.clone(),
        process: pod.process,
        kind: ServiceEventKind::Exited {
            pid: 0,
            status: status.to_string(),
        },
    });
}
