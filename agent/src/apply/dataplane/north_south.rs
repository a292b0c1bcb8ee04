//! The north-south part of the data path: the uplink program's link and
//! the routed / SNAT maps.

use std::{collections::BTreeMap, fs, path::PathBuf};

use anyhow::{Context as _, Result};
use aya::maps::{
    MapData,
    lpm_trie::{Key as LpmKey, LpmTrie},
};
use tracing::{debug, info, warn};
use vmpath_common::prog_names;

use super::{Dataplane, links_dir, sync_layered_since};
use crate::plan::{Plan, layered::Layered};
use vmpath_common::AddrKey;

fn uplink_pin(root: &std::path::Path, ifindex: u32) -> PathBuf {
    links_dir(root).join(format!("{}-{ifindex}", prog_names::UPLINK))
}

fn uplink_xdp_pin(root: &std::path::Path, ifindex: u32) -> PathBuf {
    links_dir(root).join(format!("{}-{ifindex}", prog_names::UPLINK_XDP))
}

/// How often the agent loop asks the kernel again which ports take XDP
/// frames (nothing notifies a veth peer's GRO change in this namespace).
pub const XDP_PORTS_RECHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// `--uplink-xdp`: whether the uplink also gets the native XDP program
/// (the common cases of routed ingress and SNAT return before an skb
/// exists); the tc program is attached either way and handles the rest.
/// Off by default: on a veth uplink (the test bed) XDP measured slower
/// than tc (docs/north-south.md); a NIC with native XDP has not been
/// measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum UplinkXdp {
    /// Native XDP where the uplink's driver has it; tc alone where not.
    Auto,
    /// tc alone.
    #[default]
    Off,
}

impl Dataplane {
    /// `last_routed`: `vmp_routed` as this agent last wrote it (only what
    /// changed since is written); `None`: read back and made to match.
    pub(super) fn apply_north_south(
        &mut self,
        plan: &Plan,
        last_routed: Option<&Layered<AddrKey, vmpath_common::RoutedAddr>>,
    ) -> Result<()> {
        sync_layered_since(&mut self.maps.routed, last_routed, &plan.routed)?;
        sync_lpm_values(&mut self.maps.subnets4, &plan.subnets4)?;
        sync_lpm_values(&mut self.maps.subnets6, &plan.subnets6)?;
        sync_lpm_values(&mut self.maps.resolve_prefixes, &plan.resolve_prefixes)?;
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
        for prog in [prog_names::UPLINK, prog_names::UPLINK_XDP] {
            let prefix = format!("{prog}-");
            for entry in fs::read_dir(links_dir(&self.root))? {
                let entry = entry?;
                let name = entry.file_name().to_string_lossy().to_string();
                if name.starts_with(&prefix) && name != format!("{prefix}{ifindex}") {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        let pin = uplink_pin(&self.root, ifindex);
        self.attach_tcx(prog_names::UPLINK, ifname, &pin)
            .with_context(|| format!("attaching the uplink program to {ifname}"))?;
        let mut cfg = self.maps.snat_config.get(&0, 0).unwrap_or_default();
        cfg.uplink = ifindex;
        self.maps.snat_config.set(0, cfg, 0)?;
        info!(uplink = ifname, ifindex, "uplink program attached");
        self.attach_uplink_xdp(ifname, ifindex);
        Ok(())
    }

    /// The XDP program on the uplink as `--uplink-xdp` says: attached (or
    /// adopted) in native mode, or its link removed. A driver without
    /// native XDP is not an error: the tc program, attached already,
    /// handles everything.
    fn attach_uplink_xdp(&mut self, ifname: &str, ifindex: u32) {
        let pin = uplink_xdp_pin(&self.root, ifindex);
        if self.uplink_xdp == UplinkXdp::Off {
            // The pin holds the link: removing it detaches the program.
            if fs::remove_file(&pin).is_ok() {
                info!(
                    uplink = ifname,
                    "uplink XDP program detached (--uplink-xdp off)"
                );
            }
            return;
        }
        match self.attach_xdp(prog_names::UPLINK_XDP, ifname, &pin) {
            Ok(()) => info!(
                uplink = ifname,
                ifindex, "uplink XDP program attached (native)"
            ),
            Err(e) => warn!(
                uplink = ifname,
                "no native XDP on the uplink ({e:#}); the tc program handles all its traffic"
            ),
        }
    }

    /// Sets `--uplink-xdp` (before the uplink is attached).
    pub fn set_uplink_xdp(&mut self, mode: UplinkXdp) {
        self.uplink_xdp = mode;
    }

    /// `vmp_xdp_ports`: the plan's ports whose device takes XDP frames
    /// (`ndo_xdp_xmit`): a tap, or a veth whose peer runs NAPI. Asked of
    /// the kernel on every apply and every `XDP_PORTS_RECHECK` (the
    /// agent loop), as a peer's GRO or XDP may change.
    pub fn refresh_xdp_ports(&mut self, plan: &Plan) -> Result<()> {
        let mut want = BTreeMap::new();
        if self.uplink_xdp == UplinkXdp::Auto && !plan.ports.is_empty() {
            match crate::sys::xdp_features::Netdev::open() {
                Ok(mut netdev) => {
                    for (ifindex, port) in &plan.ports {
                        match netdev.takes_redirects(*ifindex) {
                            Ok(true) => {
                                want.insert(*ifindex, port.info.port_id);
                            }
                            Ok(false) => {}
                            Err(e) => debug!(ifindex, "XDP features: {e}"),
                        }
                    }
                }
                Err(e) => debug!("XDP features not readable ({e}); uplink XDP delivers to no port"),
            }
        }
        super::sync(&mut self.maps.xdp_ports, &want)
    }
}

/// Makes an LPM trie hold exactly `want` (prefix length, key -> value).
fn sync_lpm_values<K>(
    map: &mut LpmTrie<MapData, K, u32>,
    want: &BTreeMap<(u32, K), u32>,
) -> Result<()>
where
    K: aya::Pod + Ord,
{
    let have: BTreeMap<(u32, K), u32> = map
        .iter()
        .filter_map(|r| r.ok())
        .map(|(k, v)| ((k.prefix_len(), k.data()), v))
        .collect();
    for key in have.keys().filter(|k| !want.contains_key(k)) {
        map.remove(&LpmKey::new(key.0, key.1))?;
    }
    for (key, value) in want.iter().filter(|(k, v)| have.get(k) != Some(v)) {
        map.insert(&LpmKey::new(key.0, key.1), value, 0)?;
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

    /// A loaded XDP program by name (`uplink_xdp`), for fixture tests.
    pub fn xdp_program(&self, name: &str) -> Result<&aya::programs::Xdp> {
        Ok(self
            .ebpf
            .program(name)
            .ok_or_else(|| anyhow::anyhow!("program {name} missing"))?
            .try_into()?)
    }
}
