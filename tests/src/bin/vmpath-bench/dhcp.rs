//! Figure group 4: DHCPv4 through the slow path (VM port -> tagged punt ->
//! AF_XDP -> agent -> tagged reply -> VM port) against the real agent.
//! A client written here (raw AF_PACKET socket in the VM namespace,
//! dhcproto) runs DISCOVER/OFFER/REQUEST/ACK exchanges back to back for a
//! fixed time. Baseline: the same client loop sending an ARP request for
//! the gateway, which the VM-port program answers in the kernel.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use anyhow::{Result, anyhow, bail};
use dhcproto::{
    Decodable, Decoder, Encodable, Encoder,
    v4::{DhcpOption, Flags, Message, MessageType, OptionCode},
};
use vmpath_tests::{Node, Vm, yaml};

use crate::{
    report::{Bar, Section},
    util::{self, Mac, RawSock, fmt, fmt_summary, percentile, summary},
};

pub struct Options {
    pub runs: usize,
    pub seconds: u64,
}

const VM_MAC: Mac = [0x52, 0x54, 0x00, 0x00, 0xd1, 0x01];
const VM_IP: [u8; 4] = [10, 20, 0, 50];
const GW_IP: [u8; 4] = [10, 20, 0, 1];

/// What one timed loop gave: completed exchanges per second and each
/// exchange's latency (µs); timeouts count as failures.
struct Loop {
    rate: f64,
    lat_us: Vec<f64>,
    failures: u64,
}

fn dhcp_frame(
    mac: Mac,
    xid: u32,
    mtype: MessageType,
    req: Option<(Ipv4Addr, Ipv4Addr)>,
) -> Result<Vec<u8>> {
    let mut msg = Message::default();
    msg.set_xid(xid)
        .set_flags(Flags::default().set_broadcast())
        .set_chaddr(&mac);
    msg.opts_mut().insert(DhcpOption::MessageType(mtype));
    if let Some((ip, server)) = req {
        msg.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
        msg.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    }
    let mut payload = Vec::new();
    msg.encode(&mut Encoder::new(&mut payload))
        .map_err(|e| anyhow!("encoding DHCP: {e}"))?;
    Ok(util::udp4(
        [0xff; 6], mac, [0; 4], [255; 4], 68, 67, &payload,
    ))
}

/// A DHCP reply in `frame` for `xid`: (type, yiaddr, server id).
fn parse_reply(frame: &[u8], xid: u32) -> Option<(MessageType, Ipv4Addr, Ipv4Addr)> {
    if frame.len() < 42 || frame[12..14] != [0x08, 0x00] || frame[23] != 17 {
        return None;
    }
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    let udp = 14 + ihl;
    if frame.len() < udp + 8 || frame[udp + 2..udp + 4] != 68u16.to_be_bytes() {
        return None;
    }
    let msg = Message::decode(&mut Decoder::new(&frame[udp + 8..])).ok()?;
    if msg.xid() != xid {
        return None;
    }
    let server = match msg.opts().get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(s)) => *s,
        _ => Ipv4Addr::UNSPECIFIED,
    };
    Some((msg.opts().msg_type()?, msg.yiaddr(), server))
}

/// Waits for a frame `accept` likes, up to `timeout`.
fn wait_for<T>(
    sock: &RawSock,
    timeout: Duration,
    mut accept: impl FnMut(&[u8]) -> Option<T>,
) -> Option<T> {
    let start = Instant::now();
    let mut buf = [0u8; 2048];
    while start.elapsed() < timeout {
        if let Some(n) = sock.recv(&mut buf)
            && let Some(t) = accept(&buf[..n])
        {
            return Some(t);
        }
    }
    None
}

/// One DISCOVER -> OFFER -> REQUEST -> ACK exchange of the VM with `mac`
/// (500 ms for each answer): whether it completed.
pub fn dhcp_exchange(sock: &RawSock, mac: Mac, xid: u32) -> Result<bool> {
    let timeout = Duration::from_millis(500);
    sock.send(&dhcp_frame(mac, xid, MessageType::Discover, None)?)?;
    let Some((ip, server)) = wait_for(sock, timeout, |f| match parse_reply(f, xid) {
        Some((MessageType::Offer, ip, server)) => Some((ip, server)),
        _ => None,
    }) else {
        return Ok(false);
    };
    sock.send(&dhcp_frame(
        mac,
        xid,
        MessageType::Request,
        Some((ip, server)),
    )?)?;
    Ok(wait_for(sock, timeout, |f| match parse_reply(f, xid) {
        Some((MessageType::Ack, _, _)) => Some(()),
        _ => None,
    })
    .is_some())
}

fn arp_exchange(sock: &RawSock, frame: &[u8]) -> Result<bool> {
    sock.send(frame)?;
    Ok(wait_for(sock, Duration::from_millis(500), |f| {
        (f.len() >= 42 && f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2] && f[28..32] == GW_IP)
            .then_some(())
    })
    .is_some())
}

fn timed(vm: &Vm, seconds: u64, dhcp: bool) -> Result<Loop> {
    let ns = vm.ns.path();
    util::in_netns(&ns, || -> Result<Loop> {
        let sock = RawSock::open("eth0")?;
        sock.set_rcv_timeout(100);
        let arp = util::arp_request(VM_MAC, VM_IP, GW_IP);
        let mut lat = Vec::new();
        let mut failures = 0;
        let start = Instant::now();
        let mut xid = 0x5eed_0000u32;
        while start.elapsed() < Duration::from_secs(seconds) {
            xid = xid.wrapping_add(1);
            let t = Instant::now();
            let ok = if dhcp {
                dhcp_exchange(&sock, VM_MAC, xid)?
            } else {
                arp_exchange(&sock, &arp)?
            };
            if ok {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            } else {
                failures += 1;
            }
        }
        Ok(Loop {
            rate: lat.len() as f64 / start.elapsed().as_secs_f64(),
            lat_us: lat,
            failures,
        })
    })?
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut node = Node::new("d");
    let vm = node.add_vm("vm", &util::mac_str(&VM_MAC), &[], None);
    node.write_config(
        "config.yaml",
        &yaml::docs(&[
            // The slow path's own cost: limits far above the loop's rate
            // (section 6 measures them at their defaults).
            yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true)
                + "  slowPathLimits: {dhcp4: {rate: 100000, burst: 100000}}\n",
            yaml::attachment(
                "vm",
                "blue",
                "d",
                &vm.port,
                &util::mac_str(&VM_MAC),
                &["10.20.0.50/16"],
            ),
        ]),
    );
    node.set_agent_args(&["--slowpath-serve-rate", "1000000"]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    // The slow path comes up with the agent; wait for the first answer.
    let ready = Instant::now();
    loop {
        let l = timed(&vm, 1, true)?;
        if !l.lat_us.is_empty() {
            break;
        }
        if ready.elapsed() > Duration::from_secs(15) {
            bail!("no DHCP answer from the agent; log:\n{}", node.agent_log());
        }
    }
    let mut dhcp_rate = Vec::new();
    let mut arp_rate = Vec::new();
    let mut dhcp_lat = Vec::new();
    let mut arp_lat = Vec::new();
    let mut dhcp_med = Vec::new();
    let mut arp_med = Vec::new();
    let mut failures = (0, 0);
    for r in 0..opts.runs {
        let d = timed(&vm, opts.seconds, true)?;
        let a = timed(&vm, opts.seconds, false)?;
        eprintln!(
            "bench:   run {r}: DHCP {:.0}/s, ARP {:.0}/s",
            d.rate, a.rate
        );
        dhcp_rate.push(d.rate);
        arp_rate.push(a.rate);
        dhcp_med.push(percentile(&d.lat_us, 50.0));
        arp_med.push(percentile(&a.lat_us, 50.0));
        dhcp_lat.extend(d.lat_us);
        arp_lat.extend(a.lat_us);
        failures.0 += d.failures;
        failures.1 += a.failures;
    }
    let (dr, ar) = (summary(&dhcp_rate), summary(&arp_rate));
    let (dm, am) = (summary(&dhcp_med), summary(&arp_med));
    let mut md = format!(
        "The real agent (release build) serves one VM port; IPAM Enabled, so DHCP \
         goes to the slow path: the VM-port program tags the frame and redirects it \
         to `vmp-slow0`, XDP on `vmp-slow1` hands it to the agent's AF_XDP socket, \
         the agent answers (dhcproto) and the reply goes back tagged through \
         `vmp-slow0` to the VM. The client (written in the bench) sits in the VM \
         namespace on a raw AF_PACKET socket and runs complete exchanges back to back, \
         one at a time: DISCOVER → OFFER → REQUEST → ACK, matched by xid; latency is \
         DISCOVER sent to ACK received. Baseline: the same loop sending an ARP request \
         for the gateway, answered in the kernel by the VM-port program. The port's \
         slow-path limits and the agent's serving budget are raised far above the \
         loop's rate here (section 6 runs at the defaults). {} runs of {} s each, \
         interleaved.\n\n\
         | loop | per second | DISCOVER→ACK (or ARP round trip) median µs | p99 µs (all runs) | timeouts |\n|---|---|---|---|---|\n",
        opts.runs, opts.seconds
    );
    md.push_str(&format!(
        "| DHCP exchange (4 messages, 2 round trips) | {} | {} | {} | {} |\n",
        fmt_summary(&dr),
        fmt_summary(&dm),
        fmt(percentile(&dhcp_lat, 99.0)),
        failures.0
    ));
    md.push_str(&format!(
        "| baseline: ARP request for the gateway (1 round trip) | {} | {} | {} | {} |\n",
        fmt_summary(&ar),
        fmt_summary(&am),
        fmt(percentile(&arp_lat, 99.0)),
        failures.1
    ));
    md.push_str(&format!(
        "\nDHCP exchanges per second ÷ ARP round trips per second: {}; DHCP latency ÷ \
         ARP round trip: {} (a DHCP exchange is two round trips through userspace).\n",
        fmt(dr.median / ar.median),
        fmt(dm.median / am.median)
    ));
    drop(vm);
    drop(node);
    Ok(Section {
        title: "4. DHCP through the slow path".into(),
        markdown: md,
        bars: vec![Bar {
            label: "DHCP DISCOVER->ACK latency, median".into(),
            ratio: dm.median / am.median,
            baseline: "in-kernel ARP round trip".into(),
        }],
    })
}
