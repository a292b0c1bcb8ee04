//! The node's end of the overlay: vmpath's collect-metadata vxlan device
//! (`vmp-vxlan`, UDP 4789, no learning: the data path sets each frame's
//! tunnel key itself), its `vxlan_rx` program, and the overlay slot the
//! VM-port programs read. Made when this node has a Node document (its
//! `spec.address` is the VTEP address); left alone otherwise.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use rtnetlink::{LinkMessageBuilder, LinkUnspec, LinkVxlan};
use tracing::{error, info, warn};
use vmpath_common::{VXLAN_IFNAME, VXLAN_OVERHEAD, VXLAN_PORT};

use crate::{
    dataplane::Dataplane,
    netif::{self, ifindex_of},
    plan::Plan,
    resolved::Resolved,
};

/// MTU of the vxlan device when the underlay interface is not found.
const DEFAULT_UNDERLAY_MTU: u32 = 1500;

#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    #[error("netlink: {0}")]
    Netlink(#[from] rtnetlink::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The interface holding `addr` in this namespace, and its MTU.
fn underlay_of(addr: Ipv4Addr) -> Option<(String, u32)> {
    let name = netif::holding(addr)?;
    let mtu = netif::mtu_of(&name).unwrap_or(DEFAULT_UNDERLAY_MTU);
    Some((name, mtu))
}

fn block_on<F: std::future::Future<Output = Result<(), OverlayError>>>(
    f: impl FnOnce(rtnetlink::Handle) -> F,
) -> Result<(), OverlayError> {
    crate::netlink::run(f)?
}

/// Makes `vmp-vxlan` if it is missing, sets its MTU and brings it up.
/// Returns its ifindex.
pub fn ensure_device(local: Option<Ipv4Addr>, mtu: u32) -> Result<u32> {
    if ifindex_of(VXLAN_IFNAME).is_none() {
        block_on(|handle| async move {
            let mut msg = LinkMessageBuilder::<LinkVxlan>::new(VXLAN_IFNAME)
                .collect_metadata(true)
                .port(VXLAN_PORT)
                .learning(false)
                .ttl(64);
            if let Some(local) = local {
                msg = msg.local(local);
            }
            handle
                .link()
                .add(msg.mtu(mtu).up().build())
                .execute()
                .await?;
            Ok(())
        })
        .with_context(|| format!("creating {VXLAN_IFNAME} (external, UDP {VXLAN_PORT})"))?;
        info!(
            ifname = VXLAN_IFNAME,
            ?local,
            mtu,
            "created the overlay's vxlan device"
        );
    }
    let index = ifindex_of(VXLAN_IFNAME)
        .with_context(|| format!("{VXLAN_IFNAME} vanished after creation"))?;
    // The device outlives agents; an adopted one gets this agent's MTU.
    if netif::mtu_of(VXLAN_IFNAME) != Some(mtu) || !netif::is_up(VXLAN_IFNAME) {
        block_on(|handle| async move {
            handle
                .link()
                .set(LinkUnspec::new_with_index(index).mtu(mtu).up().build())
                .execute()
                .await?;
            Ok(())
        })
        .with_context(|| format!("setting {VXLAN_IFNAME} up with MTU {mtu}"))?;
    }
    Ok(index)
}

/// Deletes `vmp-vxlan` (`vmpath agent --cleanup`).
pub fn remove_device() -> Result<()> {
    let Some(index) = ifindex_of(VXLAN_IFNAME) else {
        return Ok(());
    };
    block_on(|handle| async move {
        handle.link().del(index).execute().await?;
        Ok(())
    })
    .with_context(|| format!("deleting {VXLAN_IFNAME}"))?;
    info!("removed the overlay's vxlan device {VXLAN_IFNAME}");
    Ok(())
}

/// Keeps the vxlan device, its program and the overlay slot in step with
/// the config, once per reconcile.
#[derive(Default)]
pub struct Overlay {
    /// (ifindex, local VTEP address written to the data path).
    attached: Option<(u32, [u8; 4])>,
    /// The last error, logged once until it changes.
    last_error: Option<String>,
    /// When learned remote MACs were last aged.
    last_prune: Option<Instant>,
}

/// How often learned remote MACs are aged (a plan change prunes at once).
const PRUNE_EVERY: Duration = Duration::from_secs(5);

impl Overlay {
    /// `applied` is the plan the data path holds, if any.
    pub fn tick(&mut self, dp: &mut Dataplane, cfg: &Resolved, applied: Option<&Plan>) {
        if let Some(plan) = applied
            && self.last_prune.is_none_or(|t| t.elapsed() >= PRUNE_EVERY)
        {
            dp.prune_remote_learned(plan);
            self.last_prune = Some(Instant::now());
        }
        let Some(node) = &cfg.config.node else {
            return;
        };
        let IpAddr::V4(address) = node.address else {
            if self.last_error.is_none() {
                warn!(address = %node.address, "IPv6 VTEP addresses are not supported yet: no overlay");
                self.last_error = Some("ipv6".into());
            }
            return;
        };
        // Source encapsulated frames from the node address only when it is
        // configured here (else the kernel's route lookup would refuse it).
        let underlay = underlay_of(address);
        let local = underlay.as_ref().map(|_| address);
        let mtu = underlay
            .as_ref()
            .map_or(DEFAULT_UNDERLAY_MTU, |(_, m)| *m)
            .saturating_sub(VXLAN_OVERHEAD)
            .max(576);
        let result = ensure_device(local, mtu).and_then(|ifindex| {
            let local4 = local.map_or([0; 4], |a| a.octets());
            if self.attached != Some((ifindex, local4)) {
                dp.attach_vxlan(VXLAN_IFNAME, ifindex, local4)?;
                self.attached = Some((ifindex, local4));
                info!(
                    ifindex,
                    local = ?local,
                    underlay = ?underlay.as_ref().map(|(n, _)| n),
                    mtu,
                    "overlay ready"
                );
            }
            Ok(())
        });
        match result {
            Ok(()) => self.last_error = None,
            Err(e) => {
                let msg = format!("{e:#}");
                if self.last_error.as_ref() != Some(&msg) {
                    error!("overlay not available: {msg}");
                    self.last_error = Some(msg);
                }
                self.attached = None;
            }
        }
    }
}
