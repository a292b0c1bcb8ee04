//! The overlay part of the data path: `vm_remote` in the VM-port
//! program's tail-call slot, `vxlan_rx` on the vxlan device through a
//! pinned tcx link, and the overlay maps.

use std::fs;

use anyhow::{Context as _, Result, anyhow};
use aya::maps::PerCpuValues;
use tracing::{debug, info};
use vmpath_common::{
    EndpointKey, OverlayConfig, PortStats, REMOTE_LEARNED_MAX_AGE_NS, RemoteLearned, prog_names,
};

use super::{Dataplane, links_dir, sync};
use crate::plan::Plan;

/// Loads `vxlan_rx` (attached to the VXLAN device when there is one).
pub(super) fn load(ebpf: &mut aya::Ebpf) -> Result<()> {
    let rx: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(prog_names::VXLAN_RX)
        .ok_or_else(|| anyhow!("program {} missing", prog_names::VXLAN_RX))?
        .try_into()?;
    super::retry_eagain(|| rx.load()).context("loading (verifying) the vxlan_rx program")?;
    Ok(())
}

impl Dataplane {
    pub(super) fn apply_overlay(&mut self, plan: &Plan) -> Result<()> {
        // IPv6 underlay: each other node's handle and address (a handle
        // stays with its address: `plan::overlay::vtep_handles`).
        let addrs: std::collections::BTreeMap<[u8; 4], [u8; 16]> =
            plan.vteps6.iter().map(|(a, h)| (*h, a.octets())).collect();
        let ids: std::collections::BTreeMap<[u8; 16], [u8; 4]> =
            plan.vteps6.iter().map(|(a, h)| (a.octets(), *h)).collect();
        sync(&mut self.maps.vtep6, &addrs)?;
        sync(&mut self.maps.vtep6_ids, &ids)?;
        sync(&mut self.maps.reach_nodes, &plan.reach_nodes)?;
        sync(&mut self.maps.flood_remote, &plan.flood_remote)
    }

    /// IPv6 underlay: the VTEP handles the data path holds (the IPv6
    /// address of each other node -> its handle), kept across restarts.
    pub fn pinned_vteps6(&self) -> std::collections::BTreeMap<std::net::Ipv6Addr, [u8; 4]> {
        self.maps
            .vtep6_ids
            .iter()
            .filter_map(|r| r.ok())
            .map(|(a, h)| (std::net::Ipv6Addr::from(a), h))
            .collect()
    }

    /// Attaches `vxlan_rx` at tcx ingress of the vxlan device (or adopts
    /// the pinned link) and points the data path at it; pins left for a
    /// vxlan device with another ifindex are removed.
    pub fn attach_vxlan(&mut self, ifname: &str, slot: OverlayConfig) -> Result<()> {
        let ifindex = slot.vxlan_ifindex;
        let prefix = format!("{}-", prog_names::VXLAN_RX);
        let links = links_dir(&self.root);
        for entry in fs::read_dir(&links)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with(&prefix) && name != format!("{prefix}{ifindex}") {
                let _ = fs::remove_file(entry.path());
            }
        }
        let pin = links.join(format!("{prefix}{ifindex}"));
        self.attach_tcx(prog_names::VXLAN_RX, ifname, &pin)
            .with_context(|| format!("attaching vxlan_rx to {ifname}"))?;
        // Reach: what the node's stack routes into the device goes to the
        // node hosting the address (`ebpf/src/reach.rs`).
        let egress = format!("{}-", prog_names::VXLAN_FROM_STACK);
        for entry in fs::read_dir(&links)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with(&egress) && name != format!("{egress}{ifindex}") {
                let _ = fs::remove_file(entry.path());
            }
        }
        self.attach_tcx_at(
            prog_names::VXLAN_FROM_STACK,
            ifname,
            &links.join(format!("{egress}{ifindex}")),
            aya::programs::TcAttachType::Egress,
        )
        .with_context(|| format!("attaching vxlan_from_stack to {ifname}"))?;
        self.set_overlay(slot)?;
        info!(ifname, ifindex, "overlay receive program attached");
        Ok(())
    }

    /// Writes the overlay slot (ifindex 0: remote frames are dropped and
    /// counted as `overlay_down`).
    pub fn set_overlay(&mut self, cfg: OverlayConfig) -> Result<()> {
        if self.maps.overlay.get(&0, 0).ok() != Some(cfg) {
            self.maps.overlay.set(0, cfg, 0)?;
        }
        Ok(())
    }
}

impl Dataplane {
    /// Forgets the remote MACs the data path learned (`vmp_remote_learned`)
    /// that `plan` places itself (a local port or a configured remote VM:
    /// `vmp_endpoints` wins in every lookup anyway), whose node no longer
    /// hosts the network, or that were not heard from for
    /// `REMOTE_LEARNED_MAX_AGE_NS`. Returns how many remain. One at a
    /// time: the LRU map may evict an entry meanwhile, which would stop a
    /// batch delete.
    pub fn prune_remote_learned(&mut self, plan: &Plan) -> usize {
        let now = crate::sys::clock::monotonic_ns();
        let (stale, kept): (Vec<_>, Vec<_>) = self
            .maps
            .remote_learned()
            .into_iter()
            .partition(|(k, v)| remote_learned_stale(plan, k, v, now));
        for (k, _) in &stale {
            let _ = self.maps.remote_learned.remove(k);
        }
        if !stale.is_empty() {
            debug!(
                forgotten = stale.len(),
                kept = kept.len(),
                "learned remote MACs pruned"
            );
        }
        kept.len()
    }
}

/// Should a learned remote MAC be forgotten (see `prune_remote_learned`)?
fn remote_learned_stale(plan: &Plan, key: &EndpointKey, v: &RemoteLearned, now: u64) -> bool {
    let hosts = plan.flood_remote.get(&key.network).is_some_and(|l| {
        l.node_ip4[..(l.count as usize).min(l.node_ip4.len())].contains(&v.node_ip4)
    });
    plan.endpoints.contains_key(key)
        || !hosts
        || now.saturating_sub(v.last_seen_ns) > REMOTE_LEARNED_MAX_AGE_NS
}

impl super::Maps {
    /// The remote MACs the data path learned from the overlay.
    pub fn remote_learned(&self) -> Vec<(EndpointKey, RemoteLearned)> {
        self.remote_learned.iter().filter_map(|r| r.ok()).collect()
    }

    /// The overlay's counters summed over CPUs: `tx` sent to remote nodes,
    /// `rx` received from them, `drops` of either.
    pub fn overlay_stats(&self) -> Result<PortStats> {
        let values: PerCpuValues<PortStats> = self.overlay_stats.get(&0, 0)?;
        Ok(super::sum_per_cpu(&values))
    }
}

#[cfg(test)]
mod tests {
    use vmpath_common::{ENDPOINT_LOCAL, Endpoint};

    use super::*;

    const KEY: EndpointKey = EndpointKey {
        network: 100,
        mac: [0x52, 0x54, 0, 0, 0, 1],
        _pad: [0; 2],
    };
    const NODE_B: [u8; 4] = [192, 0, 2, 2];
    const NOW: u64 = 1_000 * 1_000_000_000;

    fn plan_with_b() -> Plan {
        let mut plan = Plan::default();
        let list = plan.flood_remote.entry(100).or_default();
        list.node_ip4[0] = NODE_B;
        list.count = 1;
        plan
    }

    fn seen(node_ip4: [u8; 4], ago_s: u64) -> RemoteLearned {
        RemoteLearned {
            node_ip4,
            _pad: 0,
            last_seen_ns: NOW - ago_s * 1_000_000_000,
        }
    }

    #[test]
    fn learned_remote_macs_are_kept_while_fresh_and_unplaced() {
        let plan = plan_with_b();
        assert!(!remote_learned_stale(&plan, &KEY, &seen(NODE_B, 10), NOW));
        // Not heard from for longer than a bridge keeps an FDB entry.
        assert!(remote_learned_stale(&plan, &KEY, &seen(NODE_B, 301), NOW));
        // Behind a node that does not (or no longer) host the network.
        assert!(remote_learned_stale(
            &plan,
            &KEY,
            &seen([192, 0, 2, 9], 10),
            NOW
        ));
        let other_net = EndpointKey {
            network: 200,
            ..KEY
        };
        assert!(remote_learned_stale(
            &plan,
            &other_net,
            &seen(NODE_B, 10),
            NOW
        ));
    }

    #[test]
    fn the_plan_placing_a_mac_replaces_what_was_learned() {
        let mut plan = plan_with_b();
        plan.endpoints.insert(
            KEY,
            Endpoint {
                kind: ENDPOINT_LOCAL,
                ifindex: 7,
                ..Default::default()
            },
        );
        assert!(remote_learned_stale(&plan, &KEY, &seen(NODE_B, 0), NOW));
    }
}
