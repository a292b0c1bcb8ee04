//! The node's end of the overlay: vmpath's collect-metadata vxlan device
//! (`vmp-vxlan`, UDP 4789, no learning: the data path sets each frame's
//! tunnel key itself), its `vxlan_rx` program, and the overlay slot the
//! VM-port programs read. Made when this node has a Node document (its
//! `spec.address` is the VTEP address, IPv4 or IPv6: the underlay's
//! family); left alone otherwise. One device serves both families (a
//! collect-metadata vxlan device opens an IPv4 and an IPv6 socket); the
//! data path sends and accepts only the underlay's.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use rtnetlink::{LinkMessageBuilder, LinkUnspec, LinkVxlan};
use tracing::{error, info};
use vmpath_common::{
    OverlayConfig, VXLAN_IFNAME, VXLAN_OVERHEAD, VXLAN_PORT, VXLAN6_OVERHEAD, addr_family,
};

use crate::{
    apply::dataplane::Dataplane,
    plan::Plan,
    resolve::resolved::Resolved,
    sys::netif::{self, ifindex_of},
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
fn underlay_of(addr: IpAddr) -> Option<(String, u32)> {
    let name = netif::holding(addr)?;
    let mtu = netif::mtu_of(&name).unwrap_or(DEFAULT_UNDERLAY_MTU);
    Some((name, mtu))
}

fn block_on<F: std::future::Future<Output = Result<(), OverlayError>>>(
    f: impl FnOnce(rtnetlink::Handle) -> F,
) -> Result<(), OverlayError> {
    crate::sys::netlink::run(f)?
}

/// Makes `vmp-vxlan` if it is missing, sets its MTU and brings it up.
/// Returns its ifindex.
pub fn ensure_device(local: Option<IpAddr>, mtu: u32) -> Result<u32> {
    if ifindex_of(VXLAN_IFNAME).is_none() {
        block_on(|handle| async move {
            let mut msg = LinkMessageBuilder::<LinkVxlan>::new(VXLAN_IFNAME)
                .collect_metadata(true)
                .port(VXLAN_PORT)
                .learning(false)
                .ttl(64);
            match local {
                Some(IpAddr::V4(local)) => msg = msg.local(local),
                Some(IpAddr::V6(local)) => msg = msg.local6(local),
                None => {}
            }
            handle
                .link()
                .add(msg.mtu(mtu).arp(false).up().build())
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
    // NOARP: the stack's frames routed into it (reach, the Primary
    // networks' subnets) need no neighbour; `vxlan_from_stack` picks the
    // node by address.
    if netif::mtu_of(VXLAN_IFNAME) != Some(mtu)
        || !netif::is_up(VXLAN_IFNAME)
        || !netif::is_noarp(VXLAN_IFNAME)
    {
        block_on(|handle| async move {
            handle
                .link()
                .set(
                    LinkUnspec::new_with_index(index)
                        .mtu(mtu)
                        .arp(false)
                        .up()
                        .build(),
                )
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
    /// The overlay slot written to the data path.
    attached: Option<OverlayConfig>,
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
        let address = node.address;
        // Source encapsulated frames from the node address only when it is
        // configured here (else the kernel's route lookup would refuse it).
        let underlay = underlay_of(address);
        let local = underlay.as_ref().map(|_| address);
        let overhead = if address.is_ipv6() {
            VXLAN6_OVERHEAD
        } else {
            VXLAN_OVERHEAD
        };
        let mtu = underlay
            .as_ref()
            .map_or(DEFAULT_UNDERLAY_MTU, |(_, m)| *m)
            .saturating_sub(overhead)
            .max(576);
        let result = ensure_device(local, mtu).and_then(|ifindex| {
            let slot = overlay_slot(ifindex, address, local.is_some());
            if self.attached != Some(slot) {
                dp.attach_vxlan(VXLAN_IFNAME, slot)?;
                self.attached = Some(slot);
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

/// The overlay slot for the vxlan device `ifindex` on the underlay of
/// this node's `address`; the local VTEP is written only when this
/// namespace holds the address (`held`), else routing picks the source.
fn overlay_slot(ifindex: u32, address: IpAddr, held: bool) -> OverlayConfig {
    let mut slot = OverlayConfig {
        vxlan_ifindex: ifindex,
        ..OverlayConfig::default()
    };
    match address {
        IpAddr::V4(a) => {
            if held {
                slot.local_ip4 = a.octets();
            }
        }
        IpAddr::V6(a) => {
            slot.underlay = addr_family::IPV6;
            if held {
                slot.local_ip6 = a.octets();
            }
        }
    }
    slot
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_overlay_slot_names_the_underlays_family_and_local_vtep() {
        let v4 = overlay_slot(7, "192.0.2.1".parse().unwrap(), true);
        assert_eq!((v4.vxlan_ifindex, v4.local_ip4), (7, [192, 0, 2, 1]));
        assert!(!v4.is_ipv6());
        let v6 = overlay_slot(7, "fd00:1::1".parse().unwrap(), true);
        assert!(v6.is_ipv6());
        assert_eq!(
            v6.local_ip6,
            "fd00:1::1".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(v6.local_ip4, [0; 4]);
        // Not held here: routing picks the source, the family stays.
        let unheld = overlay_slot(7, "fd00:1::1".parse().unwrap(), false);
        assert!(unheld.is_ipv6() && unheld.local_ip6 == [0; 16]);
    }
}
