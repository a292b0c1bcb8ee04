//! The north-south part of the data path: the uplink program's link and
//! the routed / SNAT maps.

use std::{collections::BTreeSet, fs, path::PathBuf};

use anyhow::{Context as _, Result};
use aya::maps::{
    MapData,
    lpm_trie::{Key as LpmKey, LpmTrie},
};
use tracing::info;
use vmpath_common::prog_names;

use super::{Dataplane, links_dir, sync};
use crate::plan::Plan;

fn uplink_pin(root: &std::path::Path, ifindex: u32) -> PathBuf {
    links_dir(root).join(format!("{}-{ifindex}", prog_names::UPLINK))
}

impl Dataplane {
    pub(super) fn apply_north_south(&mut self, plan: &Plan) -> Result<()> {
        sync(&mut self.maps.routed, &plan.routed)?;
        sync_lpm(&mut self.maps.subnets4, &plan.subnets4)?;
        sync_lpm(&mut self.maps.subnets6, &plan.subnets6)?;
        let mut snat = plan.snat;
        if let Ok(old) = self.maps.snat_config.get(&0, 0) {
            // The uplink's ifindex is filled in by `attach_uplink`.
            snat.uplink = old.uplink;
            if old == snat {
                return Ok(());
            }
        }
        self.maps.snat_config.set(0, snat, 0)?;
        Ok(())
    }

    /// Attaches the uplink program at tcx ingress of `ifname` (or adopts
    /// the link a previous agent pinned there); pins of an uplink with
    /// another ifindex are removed.
    pub fn attach_uplink(&mut self, ifname: &str, ifindex: u32) -> Result<()> {
        let prefix = format!("{}-", prog_names::UPLINK);
        for entry in fs::read_dir(links_dir(&self.root))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with(&prefix) && name != format!("{prefix}{ifindex}") {
                let _ = fs::remove_file(entry.path());
            }
        }
        let pin = uplink_pin(&self.root, ifindex);
        self.attach_tcx(prog_names::UPLINK, ifname, &pin)
            .with_context(|| format!("attaching the uplink program to {ifname}"))?;
        let mut cfg = self.maps.snat_config.get(&0, 0).unwrap_or_default();
        cfg.uplink = ifindex;
        self.maps.snat_config.set(0, cfg, 0)?;
        info!(uplink = ifname, ifindex, "uplink program attached");
        Ok(())
    }
}

fn sync_lpm<K>(map: &mut LpmTrie<MapData, K, u32>, want: &BTreeSet<(u32, K)>) -> Result<()>
where
    K: aya::Pod + Ord,
{
    let have: BTreeSet<(u32, K)> = map
        .keys()
        .filter_map(|k| k.ok())
        .map(|k| (k.prefix_len(), k.data()))
        .collect();
    for (len, data) in have.difference(want) {
        map.remove(&LpmKey::new(*len, *data))?;
    }
    for (len, data) in want.difference(&have) {
        map.insert(&LpmKey::new(*len, *data), 1, 0)?;
    }
    Ok(())
}

impl Dataplane {
    /// A loaded tc program by name (`uplink`, `vm_egress`), for fixture
    /// tests that run it with BPF_PROG_TEST_RUN.
    pub fn classifier(&self, name: &str) -> Result<&aya::programs::SchedClassifier> {
        Ok(self
            .ebpf
            .program(name)
            .ok_or_else(|| anyhow::anyhow!("program {name} missing"))?
            .try_into()?)
    }
}
