//! The overlay part of the data path: `vm_remote` in the VM-port
//! program's tail-call slot, `vxlan_rx` on the vxlan device through a
//! pinned tcx link, and the overlay maps.

use std::fs;

use anyhow::{Context as _, Result, anyhow};
use aya::maps::{MapData, MapType, PerCpuValues};
use tracing::info;
use vmpath_common::{
    MAX_NETWORKS, OverlayConfig, PortStats, RemoteFloodList, map_names, prog_names,
};

use super::{Dataplane, MapSpec, links_dir, spec, sync};
use crate::plan::Plan;

/// Slot of `vm_remote` in `vmp_progs` (the eBPF side's `PROG_VM_REMOTE`).
const PROG_VM_REMOTE: u32 = 1;

/// The overlay maps, checked like `MAP_SPECS`.
pub(super) const OVERLAY_MAP_SPECS: [MapSpec; 3] = [
    spec::<u32, RemoteFloodList>(map_names::FLOOD_REMOTE, MapType::Hash, MAX_NETWORKS),
    spec::<u32, OverlayConfig>(map_names::OVERLAY, MapType::Array, 1),
    spec::<u32, PortStats>(map_names::OVERLAY_STATS, MapType::PerCpuArray, 1),
];

/// Loads `vm_remote` into its tail-call slot and loads `vxlan_rx`.
pub(super) fn load(ebpf: &mut aya::Ebpf) -> Result<()> {
    let prog: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(prog_names::VM_REMOTE)
        .ok_or_else(|| anyhow!("program {} missing", prog_names::VM_REMOTE))?
        .try_into()?;
    super::retry_eagain(|| prog.load()).context("loading (verifying) the vm_remote program")?;
    let fd = prog.fd()?.try_clone()?;
    let map = ebpf
        .map_mut(map_names::PROGS)
        .ok_or_else(|| anyhow!("map {} missing", map_names::PROGS))?;
    let mut progs: aya::maps::ProgramArray<&mut MapData> = map.try_into()?;
    progs.set(PROG_VM_REMOTE, &fd, 0)?;
    let rx: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(prog_names::VXLAN_RX)
        .ok_or_else(|| anyhow!("program {} missing", prog_names::VXLAN_RX))?
        .try_into()?;
    super::retry_eagain(|| rx.load()).context("loading (verifying) the vxlan_rx program")?;
    Ok(())
}

impl Dataplane {
    pub(super) fn apply_overlay(&mut self, plan: &Plan) -> Result<()> {
        sync(&mut self.maps.flood_remote, &plan.flood_remote)
    }

    /// Attaches `vxlan_rx` at tcx ingress of the vxlan device (or adopts
    /// the pinned link) and points the data path at it; pins left for a
    /// vxlan device with another ifindex are removed.
    pub fn attach_vxlan(&mut self, ifname: &str, ifindex: u32, local_ip4: [u8; 4]) -> Result<()> {
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
        self.set_overlay(OverlayConfig {
            vxlan_ifindex: ifindex,
            local_ip4,
        })?;
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

impl super::Maps {
    /// The overlay's counters summed over CPUs: `tx` sent to remote nodes,
    /// `rx` received from them, `drops` of either.
    pub fn overlay_stats(&self) -> Result<PortStats> {
        let values: PerCpuValues<PortStats> = self.overlay_stats.get(&0, 0)?;
        Ok(super::sum_per_cpu(&values))
    }
}
