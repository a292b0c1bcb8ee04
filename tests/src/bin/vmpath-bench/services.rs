//! Figure group 12: a ClusterIP Service against talking to its backend
//! directly. One node, the real agent (release build), one network with
//! IPAM (port security on); a client VM and three backend VMs. In the same
//! run, interleaved, the client reaches backend VM2
//!   direct       at its own address (the L2 forward of section 2)
//!   1 backend    through the ClusterIP of a Service whose only backend is
//!                VM2 (DNAT at the client's port, reverse NAT of replies)
//!   3 backends   through the ClusterIP of a Service of VM2, VM3 and VM4
//!                (sessionAffinity ClientIP, so iperf3's control and data
//!                connections meet the same server)
//! TCP: iperf3, one stream. Packet rate: the same 60-byte UDP frame from a
//! raw socket in the client (one flow: after its first packet every frame
//! takes the tracked-flow path), counted as IPv4 packets the backends'
//! stacks took in, in short slices rotated per round as in section 2.

use std::{process::Child, time::Duration};

use anyhow::{Result, anyhow, bail};
use vmpath::config::parse_mac;
use vmpath_common::{ServiceKey, default_gateway_mac};
use vmpath_tests::{Netns, Node, Vm, wait_for, yaml};

use crate::{
    e2e::{Rate, pps, rate_rounds},
    report::{Bar, Section},
    util::{self, fmt_summary, summary},
};

pub struct Options {
    /// TCP rounds (one iperf3 run of each setup per round).
    pub runs: usize,
    pub tcp_seconds: u32,
    /// Packet-rate rounds (one slice of each setup per round).
    pub pps_rounds: usize,
    pub pps_slice: Duration,
}

const NET_ID: u32 = 120;
const GW: &str = "10.20.0.1";
const CLIENT_MAC: &str = "52:54:00:0c:00:01";
const CLIENT_IP: [u8; 4] = [10, 20, 0, 11];
/// (name, MAC, address); the first is the backend of both Services.
const BACKENDS: [(&str, &str, [u8; 4]); 3] = [
    ("b1", "52:54:00:0c:00:02", [10, 20, 0, 12]),
    ("b2", "52:54:00:0c:00:03", [10, 20, 0, 13]),
    ("b3", "52:54:00:0c:00:04", [10, 20, 0, 14]),
];
const VIP_ONE: [u8; 4] = [10, 96, 0, 20];
const VIP_THREE: [u8; 4] = [10, 96, 0, 21];
const IPERF_PORT: u16 = 5201;
/// The UDP port of the packet-rate frames (nothing listens: the backend's
/// stack takes the packet in and discards it, as in section 2).
const UDP_PORT: u16 = 9;

fn ip_str(ip: [u8; 4]) -> String {
    format!("{}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3])
}

/// A Service `name` at `vip` (TCP 5201, UDP 9, same target ports) and its
/// EndpointSlice of `backends`.
fn service_docs(name: &str, vip: [u8; 4], backends: &[[u8; 4]], affinity: bool) -> Vec<String> {
    let vip = ip_str(vip);
    let affinity = if affinity {
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 3600}}\n"
    } else {
        ""
    };
    let eps: String = backends
        .iter()
        .map(|b| {
            format!(
                "- addresses: [\"{}\"]\n  conditions: {{ready: true}}\n",
                ip_str(*b)
            )
        })
        .collect();
    vec![
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: prod}}\nspec:\n  type: ClusterIP\n  clusterIP: {vip}\n  clusterIPs: [{vip}]\n  ports:\n  - {{name: iperf, port: {IPERF_PORT}, targetPort: {IPERF_PORT}, protocol: TCP}}\n  - {{name: discard, port: {UDP_PORT}, targetPort: {UDP_PORT}, protocol: UDP}}\n{affinity}"
        ),
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-x1\n  namespace: prod\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: IPv4\nports:\n- {{name: iperf, port: {IPERF_PORT}, protocol: TCP}}\n- {{name: discard, port: {UDP_PORT}, protocol: UDP}}\nendpoints:\n{eps}"
        ),
    ]
}

struct Bed {
    servers: Vec<Child>,
    client: Vm,
    backends: Vec<Vm>,
    node: Node,
}

impl Drop for Bed {
    fn drop(&mut self) {
        for s in &mut self.servers {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
}

/// One way of reaching backend VM2 from the client.
struct Setup {
    name: &'static str,
    /// Where iperf3 and the UDP frames go.
    dst: [u8; 4],
    /// The Ethernet destination of the UDP frames: VM2's MAC, or the
    /// gateway's for a ClusterIP (off the network's subnets).
    dst_mac: [u8; 6],
    /// The backends that may receive.
    receivers: usize,
}

fn bed() -> Result<Bed> {
    let mut node = Node::new("a");
    let client = node.add_vm("cl", CLIENT_MAC, &["10.20.0.11/16"], Some(GW));
    let backends: Vec<Vm> = BACKENDS
        .iter()
        .map(|(name, mac, ip)| node.add_vm(name, mac, &[&format!("{}/16", ip_str(*ip))], Some(GW)))
        .collect();
    let mut docs = vec![yaml::network(
        "blue",
        NET_ID,
        &["10.20.0.0/16"],
        &[GW],
        true,
    )];
    docs.push(yaml::attachment(
        "cl",
        "blue",
        "a",
        &client.port,
        CLIENT_MAC,
        &["10.20.0.11/16"],
    ));
    for ((name, mac, ip), vm) in BACKENDS.iter().zip(&backends) {
        docs.push(yaml::attachment(
            name,
            "blue",
            "a",
            &vm.port,
            mac,
            &[&format!("{}/16", ip_str(*ip))],
        ));
    }
    docs.extend(service_docs("one", VIP_ONE, &[BACKENDS[0].2], false));
    docs.extend(service_docs(
        "three",
        VIP_THREE,
        &BACKENDS.map(|b| b.2),
        true,
    ));
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.start_agent();
    let mut ports: Vec<&str> = backends.iter().map(|v| v.port.as_str()).collect();
    ports.push(&client.port);
    node.wait_ports(&ports);
    let want = [
        (VIP_ONE, IPERF_PORT, 6u8, 1u32),
        (VIP_ONE, UDP_PORT, 17, 1),
        (VIP_THREE, IPERF_PORT, 6, 3),
        (VIP_THREE, UDP_PORT, 17, 3),
    ];
    wait_for(
        "the Services to be programmed",
        Duration::from_secs(20),
        || {
            let maps = node.maps();
            want.iter().all(|(vip, port, proto, n)| {
                let key = ServiceKey::new(NET_ID, *vip, *port, *proto);
                maps.services.get(&key, 0).map(|s| s.count).ok() == Some(*n)
            })
        },
    );
    let mut servers = Vec::new();
    for vm in &backends {
        servers.push(
            vm.ns
                .spawn(&["iperf3", "-s", "-p", &IPERF_PORT.to_string()]),
        );
    }
    for vm in &backends {
        wait_for("iperf3 server to listen", Duration::from_secs(10), || {
            let ss = vm
                .ns
                .run_status(&["ss", "-Hltn", &format!("sport = :{IPERF_PORT}")]);
            !String::from_utf8_lossy(&ss.stdout).trim().is_empty()
        });
    }
    Ok(Bed {
        servers,
        client,
        backends,
        node,
    })
}

fn tcp_gbps(bed: &Bed, dst: [u8; 4], seconds: u32) -> Result<f64> {
    let out = bed.client.ns.run_status(&[
        "iperf3",
        "-c",
        &ip_str(dst),
        "-p",
        &IPERF_PORT.to_string(),
        "-t",
        &seconds.to_string(),
        "-J",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| anyhow!("iperf3 to {} printed no JSON: {e}", ip_str(dst)))?;
    if let Some(e) = report.get("error") {
        bail!("iperf3 to {} failed: {e}", ip_str(dst));
    }
    Ok(report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(f64::NAN)
        / 1e9)
}

pub fn run(opts: &Options) -> Result<Section> {
    let bed = bed()?;
    let client_mac = parse_mac(CLIENT_MAC).map_err(|e| anyhow!(e))?;
    let setups = [
        Setup {
            name: "direct",
            dst: BACKENDS[0].2,
            dst_mac: parse_mac(BACKENDS[0].1).map_err(|e| anyhow!(e))?,
            receivers: 1,
        },
        Setup {
            name: "ClusterIP, 1 backend",
            dst: VIP_ONE,
            dst_mac: default_gateway_mac(NET_ID),
            receivers: 1,
        },
        Setup {
            name: "ClusterIP, 3 backends",
            dst: VIP_THREE,
            dst_mac: default_gateway_mac(NET_ID),
            receivers: 3,
        },
    ];
    if !bed.client.ns.ping(&ip_str(BACKENDS[0].2), 2) {
        bail!("the client cannot ping VM2");
    }
    let client_if = bed.client.port.clone();
    let client_ifindex = bed.node.ns.ifindex(&client_if);
    let flows_before = bed
        .node
        .maps()
        .service_stats(client_ifindex)?
        .map(|s| s.flows)
        .unwrap_or(0);

    // [setup][round]
    let mut tcp: Vec<Vec<f64>> = vec![Vec::new(); setups.len()];
    for r in 0..opts.runs {
        let mut row = vec![f64::NAN; setups.len()];
        for i in util::rotated(setups.len(), r) {
            row[i] = tcp_gbps(&bed, setups[i].dst, opts.tcp_seconds)?;
            eprintln!(
                "bench:   round {r} {}: TCP {:.2} Gbit/s",
                setups[i].name, row[i]
            );
        }
        for (i, g) in row.into_iter().enumerate() {
            tcp[i].push(g);
        }
    }
    let frames: Vec<Vec<u8>> = setups
        .iter()
        .map(|s| {
            util::udp4(
                s.dst_mac, client_mac, CLIENT_IP, s.dst, 4000, UDP_PORT, &[0u8; 18],
            )
        })
        .collect();
    let names: Vec<&str> = setups.iter().map(|s| s.name).collect();
    let rates = rate_rounds(&names, opts.pps_rounds, |i| {
        let receivers: Vec<&Netns> = bed.backends[..setups[i].receivers]
            .iter()
            .map(|v| &v.ns)
            .collect();
        pps(&bed.client.ns, &frames[i], opts.pps_slice, &receivers)
    })?;
    let pick = |f: fn(&Rate) -> f64| -> Vec<Vec<f64>> {
        rates
            .iter()
            .map(|setup| setup.iter().map(|x| f(x) / 1e6).collect())
            .collect()
    };
    let (pps, sent, per_cpu) = (
        pick(|x| x.received_pps),
        pick(|x| x.sent_pps),
        pick(|x| x.received_per_cpu_s),
    );

    // The check the figures rest on: the ClusterIP setups really went
    // through the Service path (new flows counted at the client's port).
    let flows = bed
        .node
        .maps()
        .service_stats(client_ifindex)?
        .map(|s| s.flows)
        .unwrap_or(0)
        - flows_before;
    if flows == 0 {
        bail!("no Service flow was counted at the client's port");
    }
    let drops = bed.node.maps().drop_counts()?;
    let drop_names = util::drops_text(&drops);

    let mut md = format!(
        "One node namespace running the agent (release build), one network with IPAM \
         Enabled (port security on), a client VM and three backend VMs. The client reaches \
         backend VM2 three ways, built together and measured interleaved:\n\n\
         - **direct**: VM2's own address (the L2 forward of section 2).\n\
         - **ClusterIP, 1 backend**: a Service whose one endpoint is VM2: the client sends \
         to the gateway MAC, `vm_port` tail-calls `vm_service`, which rewrites the \
         destination to the backend and delivers it; replies get the ClusterIP back before \
         delivery to the client (`vm_service_in`).\n\
         - **ClusterIP, 3 backends**: a Service of VM2, VM3 and VM4 with \
         `sessionAffinity: ClientIP` (iperf3's control and data connections must meet the \
         same server; an iperf3 server runs in every backend).\n\n\
         TCP: `iperf3 -t {}` client → target, one stream, received bit rate; {} rounds, one \
         run of each setup per round, order rotated. Packet rate: the same 60-byte UDP \
         frame (64 bytes on the wire, one flow: after its first frame every one takes the \
         tracked-flow path) from a raw AF_PACKET socket in the client with `sendmmsg`, \
         received = IPv4 packets the backends' stacks took in (`Ip: InReceives`, summed \
         over the Service's backends); {} rounds of {} ms slices, one slice of each setup \
         per round, order rotated. Ratios are the median (min–max) of the per-round paired \
         ratios against **direct** (section 2 explains why).\n\n\
         With any Service programmed, every delivery to a local port, **direct** ones \
         included, goes through `vm_service_in` (a tail call and a flow lookup), so the \
         baseline carries that cost too. What a ClusterIP packet adds on top: the tail call \
         into `vm_service`, its flow lookup (the tracked flow) and the rewrite with \
         incremental checksums, and the client's egress policy on the backend's tuple; \
         `vm_service` then delivers the frame itself (no second pass through `vm_port`).\n\n",
        opts.tcp_seconds,
        opts.runs,
        opts.pps_rounds,
        opts.pps_slice.as_millis()
    );
    md.push_str(
        "| setup | TCP Gbit/s | ÷ direct | UDP 64 B received Mpps | ÷ direct | sent Mpps |\n\
         |---|---|---|---|---|---|\n",
    );
    let ratio = |v: &[Vec<f64>], i: usize| -> String {
        if i == 0 {
            "1.000".into()
        } else {
            fmt_summary(&util::paired_ratio(&v[i], &v[0]))
        }
    };
    for (i, s) in setups.iter().enumerate() {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            s.name,
            fmt_summary(&summary(&tcp[i])),
            ratio(&tcp, i),
            fmt_summary(&summary(&pps[i])),
            ratio(&pps, i),
            fmt_summary(&summary(&sent[i])),
        ));
    }
    let paired = |v: &[Vec<f64>], i: usize| util::paired_ratio(&v[i], &v[0]).median;
    let worst = [1, 2]
        .iter()
        .flat_map(|&i| [paired(&tcp, i), paired(&pps, i)])
        .fold(f64::INFINITY, f64::min);
    md.push_str(&format!(
        "\nPer CPU-second (packets received ÷ CPU time the machine ran, from /proc/stat), \
         1 backend ÷ direct is {} and 3 backends ÷ direct {}.\n\n\
         Goal: ClusterIP at least 0.9x direct for both. **{}** (lowest median ratio {:.3}). \
         New Service flows counted at the client's port during the run: {flows}. Drops \
         counted by the data path: {}.\n",
        fmt_summary(&util::paired_ratio(&per_cpu[1], &per_cpu[0])),
        fmt_summary(&util::paired_ratio(&per_cpu[2], &per_cpu[0])),
        if worst >= 0.9 { "Met" } else { "Not met" },
        worst,
        drop_names
    ));
    let mut bars = Vec::new();
    for i in [1, 2] {
        bars.push(Bar {
            label: format!("TCP: {}", setups[i].name),
            ratio: paired(&tcp, i),
            baseline: "direct".into(),
        });
        bars.push(Bar {
            label: format!("UDP 64 B pps: {}", setups[i].name),
            ratio: paired(&pps, i),
            baseline: "direct".into(),
        });
    }
    drop(bed);
    Ok(Section {
        title: "12. ClusterIP Services against direct VM to VM".into(),
        markdown: md,
        bars,
    })
}
