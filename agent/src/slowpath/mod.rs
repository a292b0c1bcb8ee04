//! The slow path (docs/architecture.md): DHCPv4, DHCPv6 and router solicitations
//! from VM ports arrive tagged with the port id on one AF_XDP socket; the
//! answers go back tagged and the data path sends them out of that port.

mod afxdp;
pub mod dhcp4;
pub mod dhcp6;
pub mod fair;
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

use crate::apply::dataplane::{Dataplane, links_dir, maps_dir};
pub use service::{Counters, Outcome, PortService, Services, SharedStats, SlowStats};

/// What one DHCPv4 or DHCPv6 message led to.
#[derive(Debug)]
pub struct Handled {
    /// The message type received (for counters), e.g. "discover".
    pub kind: String,
    /// The reply frame, or why there is none.
    pub reply: Result<Vec<u8>, &'static str>,
}

impl Handled {
    /// A message that could not be read: counted as `malformed`, not
    /// answered, for the reason `why`.
    pub fn malformed(why: &'static str) -> Self {
        Handled {
            kind: "malformed".into(),
            reply: Err(why),
        }
    }
}

/// Decodes a VM-supplied message. dhcproto has asserts on malformed input
/// (debug builds) and slices by declared lengths: a panic there is a
/// malformed message, never a crash.
pub fn decode_guarded<T: dhcproto::Decodable>(payload: &[u8]) -> Option<T> {
    std::panic::catch_unwind(|| T::decode(&mut dhcproto::Decoder::new(payload)).ok())
        .ok()
        .flatten()
}

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
    crate::sys::netlink::run(|handle| async move {
        if crate::sys::netif::ifindex_of(SLOW0).is_none() {
            handle
                .link()
                .add(rtnetlink::LinkVeth::new(SLOW0, SLOW1).build())
                .execute()
                .await
                .with_context(|| format!("creating {SLOW0}/{SLOW1}"))?;
            info!("created slow path interfaces {SLOW0}/{SLOW1}");
        }
        for name in [SLOW0, SLOW1] {
            // The node's own stack must stay off these interfaces: its IPv6
            // DAD/MLD/RS frames would reach the slow path untagged.
            let sysctl = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
            if let Err(e) = std::fs::write(&sysctl, "1") {
                warn!("{sysctl}: {e}");
            }
            handle
                .link()
                .set(rtnetlink::LinkUnspec::new_with_name(name).up().build())
                .execute()
                .await
                .with_context(|| format!("setting {name} up"))?;
        }
        Ok::<_, anyhow::Error>(())
    })
    .context("netlink")?
}

/// Deletes `vmp-slow0`/`vmp-slow1` (`vmpath agent --cleanup`).
pub fn remove_interfaces() -> Result<()> {
    let Some(index) = crate::sys::netif::ifindex_of(SLOW0) else {
        return Ok(());
    };
    crate::sys::netlink::run(|handle| async move {
        // Deleting one end of a veth pair deletes both.
        handle
            .link()
            .del(index)
            .execute()
            .await
            .with_context(|| format!("deleting {SLOW0}"))?;
        info!("removed slow path interfaces {SLOW0}/{SLOW1}");
        Ok::<_, anyhow::Error>(())
    })
    .context("netlink")?
}

/// Sets up the slow path and serves it on a thread of its own. Failure
/// leaves the rest of the data path running; slow-path frames are then
/// dropped and counted (`slowpath_down`).
pub fn start(
    dp: &mut Dataplane,
    root: &std::path::Path,
    services: Services,
    stats: SharedStats,
    serve_rate: u64,
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
    let slow0 = crate::sys::netif::ifindex_of(SLOW0).ok_or_else(|| anyhow!("{SLOW0} vanished"))?;
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
        .spawn(move || serve(xsk, xsks, services, stats, serve_rate))?;
    Ok(())
}

fn serve(
    mut xsk: afxdp::Xsk,
    _xsks: XskMap<MapData>,
    services: Services,
    stats: SharedStats,
    serve_rate: u64,
) {
    let mut last_ra = Instant::now() - RA_INTERVAL;
    let mut budget = fair::Budget::new(serve_rate);
    loop {
        // Over the node-wide budget: frames wait in the ring (and the
        // kernel drops what does not fit) rather than the agent spinning.
        let wait = budget.wait();
        if !wait.is_zero() {
            std::thread::sleep(wait);
            continue;
        }
        let handle = |frames: &[&[u8]]| serve_batch(frames, &mut budget, &services, &stats);
        if let Err(e) = xsk.poll(Duration::from_millis(200), fair::BATCH, handle) {
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

/// Serves one batch fairly (`fair`): the tagged replies to send.
pub fn serve_batch(
    frames: &[&[u8]],
    budget: &mut fair::Budget,
    services: &Services,
    stats: &SharedStats,
) -> Vec<Vec<u8>> {
    let ports: Vec<Option<u16>> = frames.iter().copied().map(port_of).collect();
    let plan = fair::schedule(&ports, budget.available());
    budget.spend(plan.serve.len());
    for (indices, why) in [
        (&plan.over_quota, "over_quota"),
        (&plan.over_budget, "over_budget"),
    ] {
        for &i in indices {
            count_unserved(ports[i], why, services, stats);
        }
    }
    let mut replies = Vec::new();
    for i in plan.serve {
        // A parser bug must cost one frame, never the slow path.
        let answered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            dispatch(frames[i], services, stats)
        }))
        .unwrap_or_else(|_| {
            error!("slow path: a frame crashed its parser; dropped");
            let mut st = stats.lock().unwrap_or_else(|p| p.into_inner());
            *st.unattributed_drops
                .entry("parser_panic".into())
                .or_default() += 1;
            Vec::new()
        });
        replies.extend(answered);
    }
    replies
}

/// The port id a tagged frame carries, without copying it.
fn port_of(frame: &[u8]) -> Option<u16> {
    if frame.len() < 18 || u16::from_be_bytes([frame[12], frame[13]]) != ETH_P_8021Q {
        return None;
    }
    Some(u16::from_be_bytes([frame[14], frame[15]]) & VID_MASK)
}

/// Counts a frame the slow path did not serve, under its port if known.
fn count_unserved(port: Option<u16>, why: &str, services: &Services, stats: &SharedStats) {
    let services = services.read().unwrap();
    let mut st = stats.lock().unwrap_or_else(|p| p.into_inner());
    match port.and_then(|p| services.get(&p)) {
        Some(svc) => st.count(svc, why, Outcome::Dropped),
        None => *st.unattributed_drops.entry(why.into()).or_default() += 1,
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeMap,
        net::{Ipv4Addr, Ipv6Addr},
    };

    use dhcproto::{
        Decodable, Decoder, Encodable, Encoder,
        v4::{self, DhcpOption, HType, Opcode},
    };
    use etherparse::PacketBuilder;
    use proptest::prelude::*;

    use super::*;
    use crate::{config::AttachmentKey, slowpath::service::NetService};

    const VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 1];
    const GW_MAC: [u8; 6] = [0x0a, 0x76, 0x70, 0, 0, 0x64];

    fn services() -> Services {
        let svc = PortService {
            ifindex: 7,
            key: AttachmentKey::new("prod".into(), "vm1".into(), "eth0".into()),
            hostname: "vm1".into(),
            mac: Some(VM_MAC),
            v4: Some("10.20.0.50/24".parse().unwrap()),
            v6: Some("fd20::50/64".parse().unwrap()),
            net: NetService {
                name: "blue".into(),
                gw_mac: GW_MAC,
                gw4: Some(Ipv4Addr::new(10, 20, 0, 1)),
                gw6: Some("fd20::1".parse().unwrap()),
                gw_ll6: Ipv6Addr::from(vmpath_common::link_local_from_mac(GW_MAC)),
                mtu: 1400,
                lease_seconds: 600,
                default_route: true,
                dns4: vec![Ipv4Addr::new(10, 0, 0, 10)],
                dns6: vec![],
                search: vec!["corp.example".into()],
                routes4: vec![],
                prefix6: Some("fd20::/64".parse().unwrap()),
            },
        };
        Services::new(std::sync::RwLock::new(BTreeMap::from([(5u16, svc)])))
    }

    fn discover_frame() -> Vec<u8> {
        let mut msg = v4::Message::default();
        msg.set_opcode(Opcode::BootRequest)
            .set_htype(HType::Eth)
            .set_xid(42)
            .set_chaddr(&VM_MAC);
        msg.opts_mut()
            .insert(DhcpOption::MessageType(v4::MessageType::Discover));
        let mut payload = Vec::new();
        msg.encode(&mut Encoder::new(&mut payload)).unwrap();
        let b = PacketBuilder::ethernet2(VM_MAC, [0xff; 6])
            .ipv4([0; 4], [255; 4], 64)
            .udp(68, 67);
        let mut f = Vec::new();
        b.write(&mut f, &payload).unwrap();
        tag(5, &f)
    }

    #[test]
    fn a_discover_gets_an_offer_of_the_vms_address() {
        let stats = SharedStats::default();
        let replies = dispatch(&discover_frame(), &services(), &stats);
        assert_eq!(replies.len(), 1);
        let (port, frame) = untag(&replies[0]).unwrap();
        assert_eq!(port, 5);
        let p = SlicedPacket::from_ethernet(&frame).unwrap();
        let Some(TransportSlice::Udp(udp)) = p.transport else {
            panic!("not UDP")
        };
        let offer = v4::Message::decode(&mut Decoder::new(udp.payload())).unwrap();
        assert_eq!(offer.yiaddr(), Ipv4Addr::new(10, 20, 0, 50));
        assert_eq!(offer.opts().msg_type(), Some(v4::MessageType::Offer));
        assert_eq!(
            stats.lock().unwrap().ports["prod/vm1/eth0"].replied["dhcp4_discover"],
            1
        );
    }

    #[test]
    fn a_batch_serves_a_port_its_quota_and_counts_the_rest() {
        let stats = SharedStats::default();
        let frame = discover_frame();
        let frames: Vec<&[u8]> = vec![&frame[..]; 100];
        let mut budget = fair::Budget::new(fair::DEFAULT_SERVE_RATE);
        let replies = serve_batch(&frames, &mut budget, &services(), &stats);
        assert_eq!(replies.len(), fair::PORT_QUOTA);
        let st = stats.lock().unwrap();
        let port = &st.ports["prod/vm1/eth0"];
        assert_eq!(port.replied["dhcp4_discover"], fair::PORT_QUOTA as u64);
        assert_eq!(port.dropped["over_quota"], 100 - fair::PORT_QUOTA as u64);
    }

    /// A DHCPv6 CONFIRM from the VM's link-local address, with an IA_NA
    /// holding `addrs`.
    fn confirm_frame(addrs: &[Ipv6Addr]) -> Vec<u8> {
        use dhcproto::v6;
        let mut msg = v6::Message::new(v6::MessageType::Confirm);
        let opts = msg.opts_mut();
        opts.insert(v6::DhcpOption::ClientId(vec![
            0, 3, 0, 1, 0x52, 0x54, 0, 0, 0, 1,
        ]));
        let mut ia_opts = v6::DhcpOptions::new();
        for a in addrs {
            ia_opts.insert(v6::DhcpOption::IAAddr(v6::IAAddr {
                addr: *a,
                preferred_life: 0,
                valid_life: 0,
                opts: v6::DhcpOptions::new(),
            }));
        }
        opts.insert(v6::DhcpOption::IANA(v6::IANA {
            id: 1,
            t1: 0,
            t2: 0,
            opts: ia_opts,
        }));
        let mut payload = Vec::new();
        msg.encode(&mut Encoder::new(&mut payload)).unwrap();
        let src = Ipv6Addr::from(vmpath_common::link_local_from_mac(VM_MAC));
        let all_servers: Ipv6Addr = "ff02::1:2".parse().unwrap();
        let b = PacketBuilder::ethernet2(VM_MAC, [0x33, 0x33, 0, 1, 0, 2])
            .ipv6(src.octets(), all_servers.octets(), 1)
            .udp(546, 547);
        let mut f = Vec::new();
        b.write(&mut f, &payload).unwrap();
        tag(5, &f)
    }

    /// The status code of the Reply to `frame`, None: no reply.
    fn confirm_status(frame: &[u8]) -> Option<dhcproto::v6::Status> {
        use dhcproto::v6;
        let replies = dispatch(frame, &services(), &SharedStats::default());
        let (_, frame) = untag(replies.first()?).unwrap();
        let p = SlicedPacket::from_ethernet(&frame).unwrap();
        let Some(TransportSlice::Udp(udp)) = p.transport else {
            panic!("not UDP")
        };
        let reply = v6::Message::decode(&mut Decoder::new(udp.payload())).unwrap();
        assert_eq!(reply.msg_type(), v6::MessageType::Reply);
        match reply.opts().get(v6::OptionCode::StatusCode) {
            Some(v6::DhcpOption::StatusCode(s)) => Some(s.status),
            other => panic!("no status code: {other:?}"),
        }
    }

    /// After a migration the guest's client confirms its lease with the
    /// target node's server: its own address fits the link; another VM's
    /// (a tenant trying it on) or any mix with one does not, and a CONFIRM
    /// naming no address gets no reply (RFC 8415 18.3.3).
    #[test]
    fn a_confirm_succeeds_only_for_the_vms_own_address() {
        use dhcproto::v6::Status;
        let own: Ipv6Addr = "fd20::50".parse().unwrap();
        let other: Ipv6Addr = "fd20::51".parse().unwrap();
        assert_eq!(
            confirm_status(&confirm_frame(&[own])),
            Some(Status::Success)
        );
        assert_eq!(
            confirm_status(&confirm_frame(&[other])),
            Some(Status::NotOnLink)
        );
        assert_eq!(
            confirm_status(&confirm_frame(&[own, other])),
            Some(Status::NotOnLink)
        );
        assert_eq!(confirm_status(&confirm_frame(&[])), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Any byte string: no panic, and nothing that is not DHCP/RS is answered.
        #[test]
        fn random_frames_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let replies = dispatch(&bytes, &services(), &SharedStats::default());
            prop_assert!(replies.len() <= 1);
        }

        /// A truncated DISCOVER is never answered.
        #[test]
        fn truncated_discovers_get_no_reply(cut in 0usize..282) {
            let frame = discover_frame();
            let cut = cut.min(frame.len() - 1);
            let replies = dispatch(&frame[..cut], &services(), &SharedStats::default());
            prop_assert!(replies.is_empty(), "answered a discover cut at {cut}");
        }

        /// Flipped bytes in a DISCOVER: no panic; any reply is a well-formed
        /// frame from the gateway MAC on the same port.
        #[test]
        fn mutated_discovers_are_handled(flips in proptest::collection::vec((0usize..400, any::<u8>()), 1..8)) {
            let mut frame = discover_frame();
            for (at, v) in flips {
                let n = frame.len();
                frame[at % n] = v;
            }
            for reply in dispatch(&frame, &services(), &SharedStats::default()) {
                let (port, inner) = untag(&reply).expect("replies are tagged");
                prop_assert_eq!(port, 5);
                prop_assert_eq!(&inner[6..12], &GW_MAC[..]);
                prop_assert!(SlicedPacket::from_ethernet(&inner).is_ok());
            }
        }
    }
}
