//! The controller's view of every pod, kept by one watch. Listing every
//! pod in the cluster each round (every 2 s in deploy/) would make the
//! API server serialise them all again and again; a watch sends each
//! change once. Each pod is kept in vmpath's pruned form (what a plain
//! pod's claim and a selection's `ips` need), plus its uid and whether it
//! is over, read from the object itself so that a pod whose fields do not
//! read as vmpath's form still keeps its claims.
//!
//! A watch can lag. Nothing is deleted on its word alone: the round reads
//! the pod again before deleting its claim ([`super::pod_claims`]).

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
};

use futures_util::StreamExt as _;
use kube::{
    Api, Client,
    api::DynamicObject,
    runtime::{WatchStreamExt as _, watcher},
};
use tracing::warn;

use crate::{config::kube_objects as objects, read::kube_source::Store};

/// A pod as the rounds see it.
#[derive(Debug, Clone)]
struct Entry {
    uid: String,
    /// `Succeeded` or `Failed`.
    over: bool,
    /// vmpath's form; None when the object does not read as it.
    pod: Option<objects::Pod>,
}

#[derive(Default)]
struct State {
    /// False until the first list is complete: a round must not decide
    /// anything about pods it has not seen yet.
    synced: bool,
    pods: Store<Entry>,
}

/// Every pod in the cluster, as the watch last said.
#[derive(Clone, Default)]
pub struct PodView {
    state: Arc<Mutex<State>>,
}

fn entry(o: &DynamicObject) -> Entry {
    let phase = o.data["status"]["phase"].as_str();
    Entry {
        uid: o.metadata.uid.clone().unwrap_or_default(),
        over: matches!(phase, Some("Succeeded" | "Failed")),
        pod: serde_json::to_value(o)
            .ok()
            .and_then(|v| serde_json::from_value(v).ok()),
    }
}

impl PodView {
    /// Starts the watch on the current runtime.
    pub fn start(client: Client) -> Self {
        let view = Self::default();
        let resource = super::resource("", "v1", "Pod", "pods");
        let api: Api<DynamicObject> = Api::all_with(client, &resource);
        let state = view.state.clone();
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(e) => apply(&mut state.lock().unwrap(), e),
                    // The watcher retries (backoff), resuming from the
                    // last resourceVersion or relisting on 410.
                    Err(e) => warn!("pod watch: {e}"),
                }
            }
        });
        view
    }

    /// The uids of pods not over, and every pod in vmpath's form; None
    /// until the first list is complete.
    pub fn snapshot(&self) -> Option<(BTreeSet<String>, Vec<objects::Pod>)> {
        let st = self.state.lock().unwrap();
        if !st.synced {
            return None;
        }
        let all = st.pods.state();
        let running = all
            .iter()
            .filter(|e| !e.over)
            .map(|e| e.uid.clone())
            .collect();
        let pods = all.into_iter().filter_map(|e| e.pod).collect();
        Some((running, pods))
    }
}

fn apply(st: &mut State, event: watcher::Event<DynamicObject>) {
    st.synced |= matches!(event, watcher::Event::InitDone);
    st.pods.apply(&event, entry);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, uid: &str, phase: &str) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "prod", "uid": uid},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn nothing_is_known_until_the_first_list_is_done_and_a_relist_replaces_all() {
        let mut st = State::default();
        apply(&mut st, watcher::Event::Init);
        apply(
            &mut st,
            watcher::Event::InitApply(pod("a", "u-a", "Running")),
        );
        let view = PodView {
            state: Arc::new(Mutex::new(st)),
        };
        assert!(view.snapshot().is_none(), "not synced yet");
        {
            let mut st = view.state.lock().unwrap();
            apply(
                &mut st,
                watcher::Event::InitApply(pod("b", "u-b", "Succeeded")),
            );
            apply(&mut st, watcher::Event::InitDone);
        }
        let (running, pods) = view.snapshot().unwrap();
        assert_eq!(running, BTreeSet::from(["u-a".to_string()]));
        assert_eq!(pods.len(), 2);
        {
            let mut st = view.state.lock().unwrap();
            apply(&mut st, watcher::Event::Delete(pod("a", "u-a", "Running")));
            // A relist (after 410 Gone) under way keeps what was known.
            apply(&mut st, watcher::Event::Init);
            apply(
                &mut st,
                watcher::Event::InitApply(pod("c", "u-c", "Running")),
            );
        }
        assert_eq!(
            view.snapshot().unwrap().1.len(),
            1,
            "b only, until InitDone"
        );
        apply(&mut view.state.lock().unwrap(), watcher::Event::InitDone);
        let (running, _) = view.snapshot().unwrap();
        assert_eq!(running, BTreeSet::from(["u-c".to_string()]));
    }
}
