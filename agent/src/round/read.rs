//! Stage 1, **read**: what the round works from, as it is. The documents
//! (the config dir's files or the API server's objects, and the CNI
//! plugin's ports) as one [`Snapshot`]; and, after a restart, what the data
//! path already serves on this node's ports ([`running_ports`]).

use std::{collections::BTreeMap, path::Path};

use crate::{
    apply::dataplane::Dataplane,
    config::{
        Held,
        source::{Reader, Snapshot},
    },
    read::kube_source::KubeSource,
};

/// Reads every document: from the API server when `cluster` is given,
/// else from `config_dir`; then the CNI plugin's ports (kept under
/// `state_dir`) as Attachment documents of their own.
pub fn read(
    cluster: Option<&KubeSource>,
    reader: &mut Reader,
    config_dir: &Path,
    state_dir: &Path,
    node: &str,
) -> Snapshot {
    let mut snap = match cluster {
        Some(cluster) => cluster.read(),
        None => reader.read(config_dir),
    };
    crate::api::endpoints::add_documents(state_dir, node, &mut snap);
    snap
}

/// What the data path serves on this node's ports now: each port's MAC
/// and its given or claimed addresses (learned ones are the learned
/// stage's), by network id and port name.
pub fn running_ports(dp: &Dataplane) -> Held {
    let mut held = Held::default();
    let mut names: BTreeMap<u32, Option<String>> = BTreeMap::new();
    let mut name_of = |ifindex: u32| {
        names
            .entry(ifindex)
            .or_insert_with(|| crate::sys::netif::name_of(ifindex))
            .clone()
    };
    for (ifindex, info) in dp.maps().ports.iter().filter_map(|r| r.ok()) {
        if let Some(name) = name_of(ifindex) {
            held.port_macs.insert((info.network, info.mac), name);
        }
    }
    for (key, info) in dp.maps().addresses.iter().filter_map(|r| r.ok()) {
        if info.ifindex == 0 || info.origin == vmpath_common::ADDR_LEARNED {
            continue;
        }
        if let Some(name) = name_of(info.ifindex) {
            held.port_ips.insert((key.network, key.ip()), name);
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_config_dir_without_a_cluster_or_a_data_path() {
        let dir = std::env::temp_dir().join(format!("vmpath-round-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("n.yaml"),
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec: {id: 7}\n",
        )
        .unwrap();
        let snap = read(None, &mut Reader::default(), &dir, &dir.join("state"), "a");
        assert!(!snap.empty);
        assert_eq!(snap.documents.len(), 1);
        assert!(snap.errors.is_empty(), "{:?}", snap.errors);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
