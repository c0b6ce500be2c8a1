//! Watch streams: the open watches, the event history a watch from an
//! older resourceVersion replays (until [`compact`](crate::ApiServerDouble::compact)),
//! sending each change to the watches it matches, and a watch request's
//! streaming response.

use std::collections::BTreeMap;
use std::convert::Infallible;

use bytes::Bytes;
use futures::StreamExt;
use http::{Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::routing::{error, field_selector, name_matches, status};
use crate::store::{labels_of, selector_matches, Store};
use crate::{ApiServerDouble, DoubleBody};

pub(crate) struct Watcher {
    pub(crate) resource: String,
    pub(crate) namespace: String,
    pub(crate) selector: String,
    /// `fieldSelector=metadata.name=NAME`: only that object.
    pub(crate) name: Option<String>,
    pub(crate) tx: mpsc::UnboundedSender<Bytes>,
}

pub(crate) struct Event {
    pub(crate) rv: u64,
    pub(crate) resource: String,
    pub(crate) namespace: String,
    pub(crate) kind: &'static str,
    pub(crate) object: Value,
}

impl Store {
    pub(crate) fn emit(
        &mut self,
        resource: &str,
        namespace: &str,
        kind: &'static str,
        object: Value,
    ) {
        let rv = self.rv;
        let line = Bytes::from(format!("{}\n", json!({"type": kind, "object": object})));
        let labels = labels_of(&object);
        self.watchers.retain(|w| {
            if w.resource != resource || w.namespace != namespace {
                return !w.tx.is_closed();
            }
            if !selector_matches(&w.selector, &labels) || !name_matches(w.name.as_deref(), &object)
            {
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
}

impl ApiServerDouble {
    pub(crate) fn watch(
        &self,
        s: &mut Store,
        resource: &str,
        namespace: &str,
        query: &BTreeMap<String, String>,
    ) -> Response<DoubleBody> {
        let selector = query.get("labelSelector").cloned().unwrap_or_default();
        let name = match field_selector(query) {
            Ok(name) => name,
            Err(e) => return error(400, e),
        };
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
                    && name_matches(name.as_deref(), &e.object)
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
                name,
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
