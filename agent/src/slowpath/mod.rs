//! The slow path (DESIGN.md §2): DHCPv4, DHCPv6 and router solicitations
//! from VM ports arrive tagged with the port id on one AF_XDP socket; the
//! answers go back tagged and the data path sends them out of that port.

mod afxdp;
pub mod dhcp4;
pub mod dhcp6;
pub mod ra;
pub mod service;

use std::{
    net::Ipv6Addr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow};
use aya::maps::{Map, MapData, XskMap};
use etherparse::{LinkSlice, NetSlice, SlicedPacket, TransportSlice};
use tracing::{error, info, warn};
use vmpath_common::{SLOW0, SLOW1, SlowPath, map_names, prog_names};

use crate::dataplane::{Dataplane, links_dir, maps_dir};
pub use service::{Counters, Outcome, PortService, Services, SharedStats, SlowStats};

const ETH_P_8021Q: u16 = 0x8100;
const VID_MASK: u16 = 0x0fff;
/// Unsolicited RAs, so VMs keep their router and prefix without asking.
const RA_INTERVAL: Duration = Duration::from_secs(30);

/// Splits `[dst][src][8100][tci][type]...` into the port id and the
/// untagged frame.
pub fn untag(frame: &[u8]) -> Option<(u16, Vec<u8>)> {
    if frame.len() < 18 || u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_8021Q {
        return None;
    }
    let vid = u16::from_be_bytes([frame[14], frame[15]]) & VID_MASK;
    let mut inner = Vec::with_capacity(frame.len() - 4);
    inner.extend_from_slice(&frame[..12]);
    inner.extend_from_slice(&frame[16..]);
    Some((vid, inner))
}

/// Inserts the port id tag after the MAC addresses.
pub fn tag(port_id: u16, frame: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(frame.len() + 4);
    out.extend_from_slice(&frame[..12]);
    out.extend_from_slice(&ETH_P_8021Q.to_be_bytes());
    out.extend_from_slice(&(port_id & VID_MASK).to_be_bytes());
    out.extend_from_slice(&frame[12..]);
    out
}

/// Answers one tagged frame: the tagged replies to send.
pub fn dispatch(frame: &[u8], services: &Services, stats: &SharedStats) -> Vec<Vec<u8>> {
    let Some((port_id, inner)) = untag(frame) else {
        *stats
            .lock()
            .unwrap()
            .unattributed_drops
            .entry("untagged".into())
            .or_default() += 1;
        return Vec::new();
    };
    let services = services.read().unwrap();
    let Some(svc) = services.get(&port_id) else {
        *stats
            .lock()
            .unwrap()
            .unattributed_drops
            .entry("unknown_port".into())
            .or_default() += 1;
        return Vec::new();
    };
    let (kind, reply) = answer(svc, &inner);
    let mut st = stats.lock().unwrap();
    st.count(svc, &kind, Outcome::Received);
    match reply {
        Ok(reply) => {
            st.count(svc, &kind, Outcome::Replied);
            vec![tag(port_id, &reply)]
        }
        Err(why) => {
            st.count(svc, &kind, Outcome::Dropped);
            tracing::debug!(vm = %svc.key, kind, why, "slow path: no reply");
            Vec::new()
        }
    }
}

fn answer(svc: &PortService, frame: &[u8]) -> (String, Result<Vec<u8>, &'static str>) {
    let Ok(packet) = SlicedPacket::from_ethernet(frame) else {
        return ("malformed".into(), Err("unparseable frame"));
    };
    let Some(LinkSlice::Ethernet2(eth)) = packet.link.as_ref() else {
        return ("malformed".into(), Err("no Ethernet header"));
    };
    let src_mac = eth.source();
    match (&packet.net, &packet.transport) {
        (Some(NetSlice::Ipv4(_)), Some(TransportSlice::Udp(udp)))
            if udp.destination_port() == 67 =>
        {
            let h = dhcp4::handle(svc, src_mac, udp.payload());
            (format!("dhcp4_{}", h.kind), h.reply)
        }
        (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Udp(udp)))
            if udp.destination_port() == 547 =>
        {
            let src = ip.header().source_addr();
            let h = dhcp6::handle(svc, src_mac, src, udp.payload());
            (format!("dhcp6_{}", h.kind), h.reply)
        }
        (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Icmpv6(icmp))) if icmp.type_u8() == 133 => {
            let src: Ipv6Addr = ip.header().source_addr();
            if svc.mac.is_some_and(|m| m != src_mac) {
                return ("router_solicit".into(), Err("frame not from the VM's MAC"));
            }
            let dst = if src.is_unspecified() {
                None
            } else {
                Some((src_mac, src))
            };
            (
                "router_solicit".into(),
                ra::advert(svc, dst).ok_or("the network has no IPv6 prefix"),
            )
        }
        _ => (
            "other".into(),
            Err("not DHCPv4, DHCPv6 or a router solicitation"),
        ),
    }
}

/// Makes `vmp-slow0`/`vmp-slow1` if they are missing, and brings them up.
fn ensure_interfaces() -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().context("netlink")?;
        tokio::spawn(conn);
        if crate::agent::ifindex_of(SLOW0).is_none() {
            handle
                .link()
                .add(rtnetlink::LinkVeth::new(SLOW0, SLOW1).build())
                .execute()
                .await
                .with_context(|| format!("creating {SLOW0}/{SLOW1}"))?;
            info!("created slow path interfaces {SLOW0}/{SLOW1}");
        }
        for name in [SLOW0, SLOW1] {
            handle
                .link()
                .set(rtnetlink::LinkUnspec::new_with_name(name).up().build())
                .execute()
                .await
                .with_context(|| format!("setting {name} up"))?;
        }
        Ok::<_, anyhow::Error>(())
    })
}

/// Sets up the slow path and serves it on a thread of its own. Failure
/// leaves the rest of the data path running; slow-path frames are then
/// dropped and counted (`slowpath_down`).
pub fn start(
    dp: &mut Dataplane,
    root: &std::path::Path,
    services: Services,
    stats: SharedStats,
) -> Result<()> {
    ensure_interfaces()?;
    let links = links_dir(root);
    dp.attach_xdp(prog_names::SLOW_RX, SLOW1, &links.join(prog_names::SLOW_RX))?;
    dp.attach_tcx(
        prog_names::SLOW_RETURN,
        SLOW0,
        &links.join(prog_names::SLOW_RETURN),
    )?;
    let xsk = afxdp::Xsk::open(SLOW1)?;
    let mut xsks: XskMap<MapData> =
        Map::from_map_data(MapData::from_pin(maps_dir(root).join(map_names::XSKS))?)?.try_into()?;
    xsks.set(0, xsk.fd(), 0)
        .context("registering the AF_XDP socket")?;
    let slow0 = crate::agent::ifindex_of(SLOW0).ok_or_else(|| anyhow!("{SLOW0} vanished"))?;
    dp.maps_mut().slow.set(
        0,
        SlowPath {
            ifindex: slow0,
            _pad: 0,
        },
        0,
    )?;
    info!(ifindex = slow0, "slow path serving DHCPv4, DHCPv6 and RA");
    std::thread::Builder::new()
        .name("slowpath".into())
        .spawn(move || serve(xsk, xsks, services, stats))?;
    Ok(())
}

fn serve(mut xsk: afxdp::Xsk, _xsks: XskMap<MapData>, services: Services, stats: SharedStats) {
    let mut last_ra = Instant::now() - RA_INTERVAL;
    loop {
        if let Err(e) = xsk.poll(Duration::from_millis(200), |frame| {
            dispatch(frame, &services, &stats)
        }) {
            error!("slow path: {e:#}");
            std::thread::sleep(Duration::from_millis(200));
        }
        if last_ra.elapsed() >= RA_INTERVAL {
            last_ra = Instant::now();
            let adverts: Vec<Vec<u8>> = services
                .read()
                .unwrap()
                .iter()
                .filter_map(|(id, svc)| ra::advert(svc, None).map(|f| tag(*id, &f)))
                .collect();
            for frame in adverts {
                if let Err(e) = xsk.send(&frame) {
                    warn!("slow path: periodic RA: {e:#}");
                }
            }
        }
    }
}
