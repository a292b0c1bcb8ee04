//! Figure group 16: the pod network (issue 36's bench). Two measurements,
//! each against a baseline of the same run:
//!
//! - **Through a ClusterIP to the cluster's own network.** The stand-in of
//!   `vmpath_tests::cluster_net` (bridge + host-local pods, the nodes
//!   routing each other's pod CIDRs, kube-proxy's iptables rules): node 0
//!   runs the agent (release build) with a `role: Primary` network and a
//!   namespace VM on it (as pod_network.rs's `vault`); node 1 runs a
//!   cluster-network server pod behind a ClusterIP. In the same run,
//!   interleaved, the VM and a cluster-network pod on node 0 reach the
//!   server through that ClusterIP: TCP throughput (iperf3) and request
//!   latency (a new TCP connection, one request and its answer), the pod
//!   network's figure ÷ the cluster network's.
//! - **The migration loss window.** Section 5's scenario
//!   (`vmpath_tests::migration`) with the migrating VM's network `role:
//!   Primary` (the agents given the cluster's CIDRs), beside the same
//!   scenario on the secondary network, runs alternated.

use anyhow::{Result, anyhow, bail};
use vmpath_tests::{
    Netns, Node, UnderlayFamily, Vm,
    cluster_net::{self, ClusterNet, Echo, POD_CIDR, Proto, SERVICE_CIDR, ask},
    migration::{INTERVAL_MS, LossWindow, Role, STREAM_COUNT, three_nodes_with},
    unique_tag, wait_for, yaml,
};

use crate::{
    report::{Bar, Section},
    util::{self, fmt_summary, summary},
};

pub struct Options {
    /// Rounds: one iperf3 run and one batch of requests of each setup per
    /// round.
    pub rounds: usize,
    pub tcp_seconds: u32,
    /// Requests per setup per round.
    pub requests: usize,
    /// Migration cut-overs of each role.
    pub migration_runs: usize,
}

const NET: &str = "blue";
const NET_ID: u32 = 310;
const GW: &str = "10.31.0.1";
const VM_MAC: &str = "52:54:00:00:31:0b";
const VM_CIDR: &str = "10.31.0.11/24";
/// The ClusterIP of the server's iperf3 (port 80 -> 5201) and of its
/// echo server (8080 -> 8080).
const VIP_IPERF: &str = "10.96.0.20";
const VIP_ECHO: &str = "10.96.0.21";
const IPERF_PORT: u16 = 5201;
/// The two clients: the measured one and the baseline.
const NAMES: [&str; 2] = [
    "VM on the pod network (vmpath)",
    "pod on the cluster network",
];
const ECHO_PORT: u16 = 8080;

struct Bed {
    _echo: Echo,
    /// The VM on the pod network (node 0).
    vm: Vm,
    /// A cluster-network pod on node 0, the baseline client.
    client: Netns,
    /// The cluster-network server pod on node 1.
    server: Netns,
    node_ip: String,
    client_ip: String,
    node: Node,
    _cluster: ClusterNet,
    _other: Netns,
}

fn bed() -> Result<Bed> {
    let mut node = Node::new("pn");
    let other = Netns::new(format!("vt{}-pn1", unique_tag()));
    let cluster = ClusterNet::new(&[&node.ns, &other]);
    let node_ip = cluster.nodes[0].address.clone();
    let (server, server_ip) = cluster.nodes[1].pod("srv");
    let (client, client_ip) = cluster.nodes[0].pod("cli");
    let echo = Echo::start(&server, Proto::Tcp, ECHO_PORT);

    let vm = node.add_vm("vm", VM_MAC, &[VM_CIDR], Some(GW));
    let network = yaml::network(NET, NET_ID, &["10.31.0.0/24"], &[GW], true) + "  role: Primary\n";
    // This node's v1 Node: its pod CIDR is the one the hand-off does not
    // masquerade towards (the server is on the other node: it is).
    let this_node = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {}}}\nspec: {{podCIDRs: [{}]}}\n",
        node.name, cluster.nodes[0].pod_cidr
    );
    let attachment = yaml::attachment("vm", NET, &node.name, &vm.port, VM_MAC, &[VM_CIDR]);
    node.write_config(
        "config.yaml",
        &yaml::docs(&[network, this_node, attachment]),
    );
    node.set_agent_args(&[
        "--cluster-pod-cidrs",
        POD_CIDR,
        "--cluster-service-cidrs",
        SERVICE_CIDR,
    ]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);

    let svc = cluster_net::one_endpoint_service;
    cluster.kube_proxy(&[
        svc(
            "prod/srv:iperf",
            VIP_IPERF,
            80,
            Proto::Tcp,
            None,
            (&server_ip, IPERF_PORT),
        ),
        svc(
            "prod/srv:echo",
            VIP_ECHO,
            ECHO_PORT,
            Proto::Tcp,
            None,
            (&server_ip, ECHO_PORT),
        ),
    ]);
    Ok(Bed {
        _echo: echo,
        vm,
        client,
        server,
        node_ip,
        client_ip,
        node,
        _cluster: cluster,
        _other: other,
    })
}

/// `requests` new TCP connections from `ns` to the echo ClusterIP, one
/// request and its answer each: the round trips in µs.
fn request_latencies(ns: &Netns, requests: usize) -> Result<Vec<f64>> {
    let script = format!(
        "import socket, time, json\nout = []\nfor _ in range({requests}):\n    \
         t = time.perf_counter()\n    s = socket.create_connection(('{VIP_ECHO}', {ECHO_PORT}), timeout=2)\n    \
         s.sendall(b'probe')\n    d = s.recv(100)\n    out.append((time.perf_counter() - t) * 1e6)\n    \
         s.close()\n    assert d.startswith(b'probe'), d\nprint(json.dumps(out))\n"
    );
    let out = ns.run_status(&["python3", "-c", &script]);
    if !out.status.success() {
        bail!(
            "requests from {}: {}",
            ns.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).map_err(|e| anyhow!("request latencies: {e}"))
}

fn tcp_gbps(bed: &Bed, from: &Netns, seconds: u32) -> f64 {
    let report =
        vmpath_tests::iperf3_via(&bed.server, IPERF_PORT, from, VIP_IPERF, 80, false, seconds);
    report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(f64::NAN)
        / 1e9
}

pub fn run(opts: &Options) -> Result<Section> {
    let bed = bed()?;
    // Both clients reach the server through the ClusterIP: the pod
    // network's from the node's address (the hand-off's masquerade: the
    // other node cannot route back to it), the cluster pod from its own.
    let from_node = format!("probe from {}", bed.node_ip);
    wait_for(
        "the VM reaches the ClusterIP",
        std::time::Duration::from_secs(30),
        || ask(&bed.vm.ns, Proto::Tcp, VIP_ECHO, ECHO_PORT).as_deref() == Some(&from_node),
    );
    let seen = ask(&bed.client, Proto::Tcp, VIP_ECHO, ECHO_PORT);
    if seen != Some(format!("probe from {}", bed.client_ip)) {
        bail!("the cluster pod through the ClusterIP: {seen:?}");
    }
    let setups: [(&str, &Netns); 2] = [(NAMES[0], &bed.vm.ns), (NAMES[1], &bed.client)];
    // [setup][round]
    let mut tcp: Vec<Vec<f64>> = vec![Vec::new(); 2];
    let mut lat_median: Vec<Vec<f64>> = vec![Vec::new(); 2];
    let mut lat_all: Vec<Vec<f64>> = vec![Vec::new(); 2];
    for r in 0..opts.rounds {
        let mut row = [f64::NAN; 2];
        for i in util::rotated(2, r) {
            row[i] = tcp_gbps(&bed, setups[i].1, opts.tcp_seconds);
            eprintln!(
                "bench:   round {r} {}: TCP {:.2} Gbit/s",
                setups[i].0, row[i]
            );
        }
        for (i, g) in row.into_iter().enumerate() {
            tcp[i].push(g);
        }
        for i in util::rotated(2, r) {
            let l = request_latencies(setups[i].1, opts.requests)?;
            let m = summary(&l).median;
            eprintln!(
                "bench:   round {r} {}: request median {m:.0} µs",
                setups[i].0
            );
            lat_median[i].push(m);
            lat_all[i].extend(l);
        }
    }
    let drops = util::drops_text(&bed.node.maps().drop_counts()?);
    drop(bed);

    // The migration loss window, each role in turn.
    let mut secondary: Vec<LossWindow> = Vec::new();
    let mut primary: Vec<LossWindow> = Vec::new();
    for r in 0..opts.migration_runs {
        for i in util::rotated(2, r) {
            if i == 0 {
                primary.push(crate::migration::measure(
                    &format!("pod network run {r}"),
                    three_nodes_with(UnderlayFamily::V4, Role::Primary),
                )?);
            } else {
                secondary.push(crate::migration::measure(
                    &format!("secondary network run {r}"),
                    three_nodes_with(UnderlayFamily::V4, Role::Secondary),
                )?);
            }
        }
    }

    let tcp_ratio = util::paired_ratio(&tcp[0], &tcp[1]);
    let lat_ratio = util::paired_ratio(&lat_median[0], &lat_median[1]);
    let mut md = format!(
        "The stand-in for the cluster's own network (`vmpath_tests::cluster_net`): two node \
         namespaces on an underlay, each with `bridge` + `host-local` pods on `cni0` and a \
         route to the other's pod CIDR, and kube-proxy's iptables rules (iptables mode, \
         `KUBE-SERVICES` → `KUBE-SVC-*` → `KUBE-SEP-*` DNAT). Node 0 also runs the agent \
         (release build) given `--cluster-pod-cidrs {POD_CIDR} --cluster-service-cidrs \
         {SERVICE_CIDR}`, with network blue `role: Primary` and a namespace VM on it \
         (an Attachment, as `tests/tests/pod_network.rs`'s VM vault; its default route is \
         vmpath's gateway). A server pod on node 1 (the cluster's CNI) is behind two \
         ClusterIPs: `{VIP_IPERF}:80` → iperf3 on {IPERF_PORT}, `{VIP_ECHO}:{ECHO_PORT}` → \
         a TCP echo server. Two clients on node 0 reach it through the ClusterIPs, \
         measured interleaved:\n\n\
         - **VM on the pod network**: the VM sends to vmpath's gateway; the data path \
         hands the packet to the node's stack, kube-proxy's rules DNAT it, the hand-off's \
         nftables table masquerades it to the node's address (the other node cannot route \
         back to a Primary network; the server saw `probe from <node address>`, checked), \
         and the stack routes it over the underlay; replies come back the same way.\n\
         - **pod on the cluster network** (baseline): a `bridge` pod on `cni0`, the same \
         kube-proxy rules, no masquerade (the server saw the pod's own address, \
         checked).\n\n\
         TCP: `iperf3 -t {}` client → ClusterIP, one stream, received bit rate. Request \
         latency: {} new TCP connections per batch from one Python process, each \
         connect + a 5-byte request + its echoed answer + close, timed with \
         `perf_counter` (so Python's own cost is in both; the ratio is of per-batch \
         medians). {} rounds, each one iperf3 run and one batch of each client, order \
         rotated. Ratios are the median (min–max) of the per-round paired ratios, pod \
         network ÷ cluster network.\n\n\
         | client | TCP Gbit/s | ÷ cluster network | request latency µs, median of batch \
         medians | ÷ cluster network | p99 over all requests µs |\n|---|---|---|---|---|---|\n",
        opts.tcp_seconds, opts.requests, opts.rounds
    );
    for (i, name) in NAMES.iter().enumerate() {
        let (tr, lr) = if i == 0 {
            (fmt_summary(&tcp_ratio), fmt_summary(&lat_ratio))
        } else {
            ("1.000".to_string(), "1.000".to_string())
        };
        md.push_str(&format!(
            "| {name} | {} | {tr} | {} | {lr} | {:.0} |\n",
            fmt_summary(&summary(&tcp[i])),
            fmt_summary(&summary(&lat_median[i])),
            util::percentile(&lat_all[i], 99.0),
        ));
    }
    md.push_str(&format!(
        "\nDrops counted by the data path on node 0 during these rounds: {drops}.\n"
    ));

    // The migration table: both roles, one row per cut-over.
    let interval = INTERVAL_MS as f64;
    let win = |ws: &[LossWindow], f: fn(&LossWindow) -> f64| -> util::Summary {
        summary(&ws.iter().map(f).collect::<Vec<_>>())
    };
    md.push_str(&format!(
        "\n**Migration loss window, pod network beside secondary network.** Section 5's \
         scenario and figures (`vmpath_tests::migration`: three nodes on a veth underlay, \
         the VXLAN overlay, a client VM on node c streaming UDP {INTERVAL_MS} ms apart, \
         {STREAM_COUNT} datagrams per family, to vm1's IPv4 and IPv6 addresses while it \
         moves from node a to node b; loss window = last datagram on the source to first \
         on the target), {} cut-over(s) of each network, alternated, a fresh bed each. The \
         networks differ only by `role: Primary` (`egress: Routed`, `advertise: {{perVM: \
         true}}` in both); for the pod network every agent is also given the cluster's \
         pod and Service CIDRs, so it writes the hand-off table and routes the network's \
         subnets into `vmp-vxlan` for the node's own reach, as a pod network's agents do. \
         The client and vm1 are both on the migrating network, so the stream stays on \
         vmpath's overlay in both.\n\n\
         | network | run | loss window ms | IPv6 loss window ms | datagrams lost | IPv6 \
         datagrams lost | longest loss run around the cut-over ms | first datagram on the \
         target after its link came up ms |\n|---|---|---|---|---|---|---|---|\n",
        opts.migration_runs
    ));
    for (name, ws) in [
        ("pod network (Primary)", &primary),
        ("secondary", &secondary),
    ] {
        for (i, w) in ws.iter().enumerate() {
            md.push_str(&format!(
                "| {name} | {} | {:.1} | {:.1} | {} | {} | {:.1} | {:.1} |\n",
                i + 1,
                w.ipv4.switch_ms,
                w.ipv6.switch_ms,
                w.ipv4.lost,
                w.ipv6.lost,
                w.ipv4.gap_ms.max(w.ipv6.gap_ms),
                w.ipv4.first_on_target_ms
            ));
        }
        md.push_str(&format!(
            "| {name} | median (min–max) | {} | {} | {:.0} | {:.0} | {:.1} | {:.1} |\n",
            fmt_summary(&win(ws, |w| w.ipv4.switch_ms)),
            fmt_summary(&win(ws, |w| w.ipv6.switch_ms)),
            win(ws, |w| w.ipv4.lost as f64).median,
            win(ws, |w| w.ipv6.lost as f64).median,
            win(ws, |w| w.ipv4.gap_ms.max(w.ipv6.gap_ms)).median,
            win(ws, |w| w.ipv4.first_on_target_ms).median,
        ));
    }
    let p4 = win(&primary, |w| w.ipv4.switch_ms).median;
    let s4 = win(&secondary, |w| w.ipv4.switch_ms).median;
    let p6 = win(&primary, |w| w.ipv6.switch_ms).median;
    let s6 = win(&secondary, |w| w.ipv6.switch_ms).median;
    md.push_str(&format!(
        "\nPod network ÷ secondary network, median loss windows: IPv4 {:.2}, IPv6 {:.2}; \
         pod network ÷ send interval: IPv4 {:.1}, IPv6 {:.1}.\n",
        p4 / s4,
        p6 / s6,
        p4 / interval,
        p6 / interval
    ));
    Ok(Section {
        title: "16. The pod network".into(),
        markdown: md,
        bars: vec![
            Bar {
                label: "TCP through a ClusterIP: VM on the pod network".into(),
                ratio: tcp_ratio.median,
                baseline: "cluster-network pod".into(),
            },
            Bar {
                label: "request latency through a ClusterIP (lower is better)".into(),
                ratio: lat_ratio.median,
                baseline: "cluster-network pod".into(),
            },
            Bar {
                label: "migration loss window, pod network (lower is better)".into(),
                ratio: p4 / s4,
                baseline: "secondary network".into(),
            },
        ],
    })
}
