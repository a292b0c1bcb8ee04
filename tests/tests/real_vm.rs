//! Real guests (QEMU, Debian cloud kernel, busybox) in KubeVirt's bridge
//! binding layout, where the guest's own kernel and DHCP client matter:
//! the lease a guest's udhcpc takes from vmpath, reachability of another
//! guest, a namespace VM and the gateway by ping and TCP, an imported guest
//! with a static address, spoofing from inside a guest. Live migration of a
//! real guest is in `real_migration.rs`.

use std::time::{Duration, Instant};

use vmpath_tests::{
    Node, Vm,
    qemu::{Guest, GuestNet, QemuVm, again_if_a_guest_kernel_crashes, pod_port},
    vmpath::common::drop_reason,
    wait_for, yaml,
};

const BLUE: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: blue}
spec:
  id: 100
  role: Primary
  subnets: [10.20.0.0/24]
  defaultGatewayIPs: [10.20.0.1]
  excludeSubnets: [10.20.0.0/28]
  mtu: 1400
  dhcp:
    leaseSeconds: 600
    dnsServers: [10.0.0.10]
    searchDomains: [corp.example]
    routes: [{destination: 172.16.0.0/12, nextHop: 10.20.0.254}]
";

/// An imported network: no IPAM, the guests bring their own addresses.
const RED: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: red}
spec:
  id: 200
  subnets: [10.30.0.0/24]
  defaultGatewayIPs: [10.30.0.1]
  ipam: {mode: Disabled}
";

fn attachment(vm: &str, net: &str, port: &str, mac: &str, ips: &[&str]) -> String {
    let ips = if ips.is_empty() {
        String::new()
    } else {
        format!("  ips: [{}]\n", ips.join(", "))
    };
    yaml::attachment_with(vm, net, "a", port, &format!("  mac: \"{mac}\"\n{ips}"))
}

/// The address the agent allocated to `vm` (IPAM), with its prefix.
fn allocated(node: &Node, vm: &str) -> String {
    node.vm_addresses(vm)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no address for {vm} in {:?}", node.status()))
}

/// Boots guests in parallel (each TCG guest keeps one core busy while it
/// boots): (name, MAC, how it configures eth0).
fn boot_all(node: &Node, guests: &[(&str, &str, GuestNet)]) -> Vec<QemuVm> {
    std::thread::scope(|s| {
        let handles: Vec<_> = guests
            .iter()
            .map(|(name, mac, net)| s.spawn(move || QemuVm::boot(node, name, mac, net.clone())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A TCP exchange: `server` answers one connection with busybox `nc`, the
/// `client` sends a line through it and must read the answer. (`busybox`
/// explicitly: a namespace VM runs the node's tools.)
fn tcp_echo(server: &dyn Guest, server_ip: &str, client: &dyn Guest) {
    server.run(
        r#"busybox nc -l -p 7000 -e sh -c 'read l; echo "echo:$l"' </dev/null >/dev/null 2>&1 &"#,
    );
    // The listener is up once a socket is bound to the port.
    wait_for("nc to listen", Duration::from_secs(20), || {
        server
            .run_status("busybox netstat -ltn | grep -q ':7000 '")
            .0
            == 0
    });
    let out = client.run(&format!(
        "echo hello-through-vmpath | timeout 10 busybox nc -w 5 {server_ip} 7000"
    ));
    assert!(
        out.contains("echo:hello-through-vmpath"),
        "echo over TCP: {out}"
    );
}

#[test]
fn guests_take_their_lease_from_vmpath_and_reach_each_other() {
    again_if_a_guest_kernel_crashes(guests_take_their_lease_from_vmpath_and_reach_each_other_once);
}

fn guests_take_their_lease_from_vmpath_and_reach_each_other_once() {
    let mut node = Node::new("a");
    let vm = node.add_vm("ns1", "52:54:00:e0:00:03", &[], None);
    let (g1_mac, g2_mac) = ("52:54:00:e0:00:01", "52:54:00:e0:00:02");
    let (g1_port, g2_port) = (pod_port(&node, "g1"), pod_port(&node, "g2"));
    node.write_config(
        "c.yaml",
        &[
            BLUE.to_string(),
            attachment("g1", "blue", &g1_port, g1_mac, &[]),
            attachment("g2", "blue", &g2_port, g2_mac, &[]),
            attachment("ns1", "blue", &vm.port, &vm.mac, &[]),
        ]
        .join("---\n"),
    );
    node.start_agent();
    let started = Instant::now();
    let guests = boot_all(
        &node,
        &[
            ("g1", g1_mac, GuestNet::Dhcp),
            ("g2", g2_mac, GuestNet::Dhcp),
        ],
    );
    let (g1, g2) = (&guests[0], &guests[1]);
    node.wait_ports(&[&g1_port, &g2_port, &vm.port]);
    let leases: Vec<_> = guests.iter().map(|g| g.wait_lease()).collect();
    let boot_to_lease = started.elapsed();
    for (g, lease) in guests.iter().zip(&leases) {
        println!(
            "guest {} ({:?}): lease after {:.1} s (guest uptime {} s), QEMU RSS {} MiB",
            g.pod.ns.name,
            g.accel,
            boot_to_lease.as_secs_f64(),
            lease.get("uptime").map_or("?", String::as_str),
            g.rss_kib() / 1024
        );
        // KubeVirt's second seed: the pod never holds the VM's IP.
        assert!(g.pod.holds_no_ip(), "pod {} holds an IP", g.pod.ns.name);
    }

    // The lease is exactly what the network says, as udhcpc saw it.
    let lease = &leases[0];
    let (ip, prefix) = allocated(&node, "g1")
        .split_once('/')
        .map(|(a, p)| (a.to_string(), p.to_string()))
        .unwrap();
    assert_eq!(lease["ip"], ip, "{lease:?}");
    assert_eq!(prefix, "24");
    assert_eq!(lease["mask"], "24", "{lease:?}");
    assert_eq!(lease["router"], "10.20.0.1", "{lease:?}");
    assert_eq!(lease["serverid"], "10.20.0.1", "{lease:?}");
    assert_eq!(lease["dns"], "10.0.0.10", "{lease:?}");
    assert_eq!(lease["search"], "corp.example", "{lease:?}");
    assert_eq!(lease["mtu"], "1400", "{lease:?}");
    assert_eq!(lease["lease"], "600", "{lease:?}");
    assert_eq!(
        lease["staticroutes"], "172.16.0.0/12 10.20.0.254 0.0.0.0/0 10.20.0.1",
        "{lease:?}"
    );
    // ... and the guest's kernel is configured from it.
    assert_eq!(g1.addresses(), vec![format!("{ip}/24")]);
    let link = g1.run("ip link show eth0");
    assert!(link.contains("mtu 1400") && link.contains(g1_mac), "{link}");
    let routes = g1.run("ip route");
    assert!(routes.contains("default via 10.20.0.1"), "{routes}");
    assert!(routes.contains("172.16.0.0/12 via 10.20.0.254"), "{routes}");
    assert!(
        g1.run("cat /etc/resolv.conf")
            .contains("nameserver 10.0.0.10")
    );

    // The namespace VM is configured from its own allocation.
    let vm_addr = allocated(&node, "ns1");
    vm.ns.run(&["ip", "addr", "add", &vm_addr, "dev", "eth0"]);
    vm.ns
        .run(&["ip", "route", "add", "default", "via", "10.20.0.1"]);
    let vm_ip = vm_addr.split('/').next().unwrap();
    let g2_ip = leases[1]["ip"].clone();

    assert!(g1.ping("10.20.0.1"), "guest -> gateway");
    assert!(g1.ping(&g2_ip), "guest -> guest");
    assert!(g1.ping(vm_ip), "guest -> namespace VM");
    assert!(Guest::ping(&vm, &ip), "namespace VM -> guest");
    tcp_echo(g2, &g2_ip, g1);
    tcp_echo(&vm, vm_ip, g1);
    tcp_echo(g1, &ip, &vm);

    // Spoofing from inside the guest: another source address, then
    // another source MAC. Neither reaches the namespace VM.
    let ip_spoof = node.drops(drop_reason::IP_SPOOF);
    g1.run("ip addr add 10.20.0.99/32 dev eth0");
    let (rc, out) = g1.run_status(&format!("ping -c 3 -W 1 -I 10.20.0.99 {vm_ip}"));
    assert_ne!(rc, 0, "a spoofed source address got through: {out}");
    g1.run("ip addr del 10.20.0.99/32 dev eth0");
    assert!(
        node.drops(drop_reason::IP_SPOOF) >= ip_spoof + 3,
        "IP spoof drops {} -> {}",
        ip_spoof,
        node.drops(drop_reason::IP_SPOOF)
    );
    let mac_spoof = node.drops(drop_reason::MAC_SPOOF);
    g1.run("ip link set eth0 address 52:54:00:e0:00:66");
    let (rc, out) = g1.run_status(&format!("ping -c 3 -W 1 {vm_ip}"));
    assert_ne!(rc, 0, "a spoofed source MAC got through: {out}");
    assert!(
        node.drops(drop_reason::MAC_SPOOF) > mac_spoof,
        "no MAC spoof drops"
    );
    g1.run(&format!("ip link set eth0 address {g1_mac}"));
    assert!(
        g1.ping(vm_ip),
        "guest -> namespace VM with its own MAC again"
    );
}

#[test]
fn an_imported_guest_keeps_its_mac_ip_and_gateway() {
    again_if_a_guest_kernel_crashes(an_imported_guest_keeps_its_mac_ip_and_gateway_once);
}

fn an_imported_guest_keeps_its_mac_ip_and_gateway_once() {
    let mut node = Node::new("a");
    let mac = "52:54:00:e1:00:01";
    let port = pod_port(&node, "imp");
    let vm: Vm = node.add_vm(
        "ns2",
        "52:54:00:e1:00:02",
        &["10.30.0.6/24"],
        Some("10.30.0.1"),
    );
    node.write_config(
        "c.yaml",
        &[
            RED.to_string(),
            attachment("imp", "red", &port, mac, &["\"10.30.0.5/24\""]),
            attachment("ns2", "red", &vm.port, &vm.mac, &["\"10.30.0.6/24\""]),
        ]
        .join("---\n"),
    );
    node.start_agent();
    let g = QemuVm::boot(
        &node,
        "imp",
        mac,
        GuestNet::Static {
            addr: "10.30.0.5/24".into(),
            gateway: Some("10.30.0.1".into()),
        },
    );
    node.wait_ports(&[&port, &vm.port]);
    assert!(g.pod.holds_no_ip());
    assert!(g.ping("10.30.0.1"), "imported guest -> its gateway");
    assert!(g.ping("10.30.0.6"), "imported guest -> namespace VM");
    tcp_echo(&vm, "10.30.0.6", &g);
    // The command channel itself: a background job that ends while the
    // next command line is half-way in must not cost that line (busybox's
    // `read` in the guest's PID 1 started again on the orphan's SIGCHLD and
    // dropped what it had read: commands after tcp_echo's listener went
    // unanswered now and then).
    g.run("sleep 1 >/dev/null 2>&1 &");
    let (rc, out) = g.run_paused("echo the-whole-line-arrived", Duration::from_secs(2));
    assert_eq!((rc, out.trim()), (0, "the-whole-line-arrived"));
    // What it came with is what it has: MAC, address, default route, and
    // the gateway answers its ARP.
    assert_eq!(g.addresses(), vec!["10.30.0.5/24".to_string()]);
    assert!(g.run("ip link show eth0").contains(mac));
    assert!(g.run("ip route").contains("default via 10.30.0.1"));
    let gw_mac = g
        .neighbour("10.30.0.1")
        .expect("an ARP entry for the gateway");
    assert!(g.ping("10.30.0.1"));
    assert_eq!(g.neighbour("10.30.0.1").as_deref(), Some(gw_mac.as_str()));
}
