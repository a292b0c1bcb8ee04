//! Figure group 2b: VM to an external host behind the node's uplink, two
//! ways, measured interleaved:
//!   vmpath SNAT   the real agent, a network with `egress: SNAT`: the
//!                 VM-port program translates to the node address and sends
//!                 the frame out of the uplink (fib lookup, redirect_neigh);
//!                 replies come back through the uplink program
//!   Linux         the host-side veth is the gateway (10.30.0.1), the node
//!                 forwards and nftables masquerades out of the uplink
//! The "external host" is a namespace at the other end of the uplink veth.
//! Rounds and paired ratios as in section 2 (`e2e`).

use anyhow::{Result, anyhow};
use vmpath::config::parse_mac;
use vmpath_common::default_gateway_mac;
use vmpath_tests::{Netns, Node, Vm, enable_forwarding, link};

use crate::{
    e2e,
    report::{Bar, Section},
    util::{self, Mac, fmt_summary, summary},
};

const VM_MAC: &str = "52:54:00:00:0e:01";
const VM_IP: [u8; 4] = [10, 30, 0, 21];
const EXT_IP: &str = "192.0.2.2";
const NET_ID: u32 = 501;

struct Bed {
    name: &'static str,
    vm: Vm,
    ext: Netns,
    gw_mac: Mac,
    node: Node,
}

fn base(tag: &str) -> (Node, Netns, Vm) {
    let node = Node::new(tag);
    let ext = Netns::new(format!("vt{}-ext", node.tag));
    link(
        &node.ns,
        "up0",
        "192.0.2.1/30",
        &ext,
        "ext0",
        "192.0.2.2/30",
    );
    enable_forwarding(&node.ns);
    node.ns
        .run(&["ip", "route", "add", "default", "via", EXT_IP]);
    let vm = node.add_vm("o1", VM_MAC, &["10.30.0.21/16"], Some("10.30.0.1"));
    (node, ext, vm)
}

fn vmpath_bed() -> Result<Bed> {
    let (mut node, ext, vm) = base("x");
    node.write_config(
        "config.yaml",
        &format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: x}}\nspec:\n  address: 192.0.2.1\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: orange}}\nspec:\n  id: {NET_ID}\n  subnets: [\"10.30.0.0/16\"]\n  defaultGatewayIPs: [\"10.30.0.1\"]\n  ipam: {{mode: Enabled}}\n  egress: SNAT\n---\n\
             apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: o1-eth0, namespace: prod}}\nspec:\n  vm: o1\n  interface: eth0\n  network: orange\n  node: x\n  port: {}\n  mac: \"{VM_MAC}\"\n  ips: [\"10.30.0.21/16\"]\n",
            vm.port
        ),
    );
    node.set_agent_args(&["--uplink", "up0", "--metrics-addr", "off"]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    Ok(Bed {
        name: "vmpath SNAT",
        vm,
        ext,
        gw_mac: default_gateway_mac(NET_ID),
        node,
    })
}

fn linux_bed() -> Result<Bed> {
    let (node, ext, vm) = base("m");
    node.ns
        .run(&["ip", "addr", "add", "10.30.0.1/16", "dev", &vm.port]);
    for cmd in [
        "add table ip bench",
        "add chain ip bench post { type nat hook postrouting priority 100 ; }",
        "add rule ip bench post oifname up0 masquerade",
    ] {
        let mut args = vec!["nft"];
        args.extend(cmd.split(' '));
        let out = node.ns.run_status(&args);
        if !out.status.success() {
            return Err(anyhow!(
                "nft {cmd}: {} (`cargo xtask setup` installs nftables)",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    let link = node.ns.run(&["ip", "-j", "link", "show", "dev", &vm.port]);
    let v: serde_json::Value = serde_json::from_str(&link)?;
    let gw_mac = parse_mac(v[0]["address"].as_str().unwrap_or("")).map_err(|e| anyhow!(e))?;
    Ok(Bed {
        name: "Linux routing + nftables masquerade",
        vm,
        ext,
        gw_mac,
        node,
    })
}

pub struct Options {
    /// TCP rounds (one iperf3 run of each setup per round).
    pub runs: usize,
    pub tcp_seconds: u32,
    /// Packet-rate rounds (one slice of each setup per round).
    pub pps_rounds: usize,
    pub pps_slice: std::time::Duration,
}

pub fn run(opts: &Options) -> Result<Section> {
    let beds = [vmpath_bed()?, linux_bed()?];
    for b in &beds {
        if !b.vm.ns.ping(EXT_IP, 2) {
            return Err(anyhow!("{}: VM cannot ping the external host", b.name));
        }
    }
    let vm_mac = parse_mac(VM_MAC).map_err(|e| anyhow!(e))?;
    // [setup][round]
    let mut tcp: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut pps: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    let mut per_cpu: Vec<Vec<f64>> = vec![Vec::new(); beds.len()];
    for r in 0..opts.runs {
        let mut row = vec![f64::NAN; beds.len()];
        for i in util::rotated(beds.len(), r) {
            let b = &beds[i];
            let rep = vmpath_tests::iperf3(&b.ext, &b.vm.ns, EXT_IP, false, opts.tcp_seconds);
            row[i] = rep["end"]["sum_received"]["bits_per_second"]
                .as_f64()
                .unwrap_or(f64::NAN)
                / 1e9;
            eprintln!("bench:   round {r} {}: TCP {:.2} Gbit/s", b.name, row[i]);
        }
        for (i, g) in row.into_iter().enumerate() {
            tcp[i].push(g);
        }
    }
    for r in 0..opts.pps_rounds {
        let mut row = vec![None; beds.len()];
        for i in util::rotated(beds.len(), r) {
            let b = &beds[i];
            let frame = util::udp4_min(b.gw_mac, vm_mac, VM_IP, [192, 0, 2, 2]);
            row[i] = Some(e2e::pps(&b.vm.ns, &frame, opts.pps_slice, &b.ext)?);
        }
        let row: Vec<e2e::Rate> = row.into_iter().flatten().collect();
        eprintln!(
            "bench:   round {r} UDP received Mpps (per CPU-second): {}",
            beds.iter()
                .zip(&row)
                .map(|(b, x)| format!(
                    "{} {:.3} ({:.3})",
                    b.name,
                    x.received_pps / 1e6,
                    x.received_per_cpu_s / 1e6
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (i, x) in row.into_iter().enumerate() {
            pps[i].push(x.received_pps / 1e6);
            per_cpu[i].push(x.received_per_cpu_s / 1e6);
        }
    }
    let drops = beds[0].node.maps().drop_counts()?;
    let drop_names: Vec<String> = drops
        .iter()
        .enumerate()
        .filter(|(_, n)| **n != 0)
        .map(|(i, n)| format!("{} {n}", vmpath_common::drop_reason::NAMES[i]))
        .collect();
    let ts: Vec<_> = tcp.iter().map(|v| summary(v)).collect();
    let ps: Vec<_> = pps.iter().map(|v| summary(v)).collect();
    let (tcp_ratio, pps_ratio, cpu_ratio) = (
        util::paired_ratio(&tcp[0], &tcp[1]),
        util::paired_ratio(&pps[0], &pps[1]),
        util::paired_ratio(&per_cpu[0], &per_cpu[1]),
    );
    let mut md = format!(
        "One VM namespace behind a node namespace whose uplink veth leads to an \
         \"external\" namespace (192.0.2.2), two ways, measured interleaved: \
         **vmpath SNAT** (the agent, a network with `egress: SNAT`: the VM-port \
         program translates to the node address 192.0.2.1 and sends the frame out of \
         the uplink by `bpf_fib_lookup` + `bpf_redirect_neigh`; replies come back \
         through the uplink program) and **Linux routing + nftables masquerade** (the \
         host-side veth is the VM's gateway, the node forwards, one `masquerade` rule \
         on the uplink). TCP: `iperf3 -t {}` VM → external, one stream, {} rounds. \
         Packet rate: the same raw-socket sender as section 2, 64-byte UDP to the \
         external host, counted by the external namespace's IP layer, in {} rounds of \
         {} ms slices, one slice of each setup per round, the order alternating. As in \
         section 2, rates are each setup's median (min–max) over the rounds and \
         **÷ Linux is the median (min–max) of the per-round paired ratios** (vmpath's \
         slice ÷ Linux's slice of the same round). Per CPU-second: the packets received \
         divided by the CPU time the machine ran in the slice (as in section 2; host \
         steal excluded).\n\n\
         | setup | TCP Gbit/s | ÷ Linux | UDP 64 B received Mpps | ÷ Linux | received per CPU-second, M | ÷ Linux |\n|---|---|---|---|---|---|---|\n",
        opts.tcp_seconds,
        opts.runs,
        opts.pps_rounds,
        opts.pps_slice.as_millis()
    );
    for (i, b) in beds.iter().enumerate() {
        let (tr, pr, cr) = if i == 1 {
            (
                "1.000".to_string(),
                "1.000".to_string(),
                "1.000".to_string(),
            )
        } else {
            (
                fmt_summary(&tcp_ratio),
                fmt_summary(&pps_ratio),
                fmt_summary(&cpu_ratio),
            )
        };
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            b.name,
            fmt_summary(&ts[i]),
            tr,
            fmt_summary(&ps[i]),
            pr,
            fmt_summary(&summary(&per_cpu[i])),
            cr,
        ));
    }
    md.push_str(&format!(
        "\nDrops counted by the vmpath data path during these runs: {}.\n",
        if drop_names.is_empty() {
            "none".to_string()
        } else {
            drop_names.join(", ")
        }
    ));
    let bars = vec![
        Bar {
            label: "TCP VM-to-external: vmpath SNAT".into(),
            ratio: tcp_ratio.median,
            baseline: "Linux + nft masquerade".into(),
        },
        Bar {
            label: "UDP 64 B pps VM-to-external: vmpath SNAT".into(),
            ratio: pps_ratio.median,
            baseline: "Linux + nft masquerade".into(),
        },
    ];
    drop(beds);
    Ok(Section {
        title: "2b. VM to external: SNAT".into(),
        markdown: md,
        bars,
    })
}
