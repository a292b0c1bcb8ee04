//! DHCPv4, DHCPv6 and router advertisements through the AF_XDP slow path,
//! checked with the clients VMs really run: udhcpc, dhclient, dhclient -6
//! and rdisc6. Nothing is configured inside the node namespace.

use std::{
    collections::BTreeMap,
    fs,
    path::Path,
    time::{Duration, Instant},
};

use vmpath_tests::{
    Node, Vm,
    flood::{Flood, FloodKind},
    vmpath::common::drop_reason,
    vmpath_bin, wait_for, yaml,
};

const BLUE: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: blue}
spec:
  id: 100
  role: Primary
  subnets: [10.20.0.0/24, \"fd20::/64\"]
  defaultGatewayIPs: [10.20.0.1, \"fd20::1\"]
  excludeSubnets: [10.20.0.0/28]
  mtu: 1400
  dhcp:
    leaseSeconds: 600
    dnsServers: [10.0.0.10, \"fd00::53\"]
    searchDomains: [corp.example, lab.example]
    routes: [{destination: 172.16.0.0/12, nextHop: 10.20.0.254}]
";

const RED: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {name: red}
spec:
  id: 200
  subnets: [10.30.0.0/24]
  defaultGatewayIPs: [10.30.0.1]
  ipam: {mode: Disabled}
";

fn attachment(vm: &str, net: &str, port: &str, mac: &str, ips: &str) -> String {
    yaml::attachment_with(vm, net, "a", port, &format!("  mac: \"{mac}\"\n{ips}"))
}

/// A hook for udhcpc that records what it was given and configures the VM
/// (address, and routes from option 121 or the router option) in its own
/// namespace, never touching the host's resolv.conf.
fn udhcpc_hook(dir: &Path) -> String {
    let path = dir.join("udhcpc-hook.sh");
    fs::write(
        &path,
        format!(
            r#"#!/bin/sh
env | grep -E '^(ip|subnet|router|dns|domain|search|mtu|hostname|staticroutes|lease|serverid)=' | sort > {dir}/udhcpc-$1.env
if [ "$1" = bound ]; then
  ip addr add "$ip/$mask" dev "$interface"
  [ -n "$mtu" ] && ip link set "$interface" mtu "$mtu"
  if [ -n "$staticroutes" ]; then
    set -- $staticroutes
    while [ $# -ge 2 ]; do ip route add "$1" via "$2" dev "$interface"; shift 2; done
  elif [ -n "$router" ]; then
    ip route add default via "$router" dev "$interface"
  fi
fi
"#,
            dir = dir.display()
        ),
    )
    .unwrap();
    vmpath_tests::run(&["chmod", "+x", path.to_str().unwrap()]);
    path.display().to_string()
}

fn udhcpc(vm: &Vm, hook: &str, tries: u32) -> std::process::Output {
    vmpath_tests::udhcpc(&vm.ns, "eth0", hook, tries)
}

fn env_file(path: &Path) -> BTreeMap<String, String> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_string(), v.trim_matches('\'').to_string()))
        })
        .collect()
}

fn lease_of(node: &Node, vm: &str, family_v6: bool) -> String {
    node.vm_addresses(vm)
        .into_iter()
        .find(|ip| ip.contains(':') == family_v6)
        .unwrap_or_else(|| panic!("no address of that family for {vm}"))
}

fn bed() -> (Node, Vm, Vm) {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:d0:00:01", &[], None);
    let vm2 = node.add_vm("vm2", "52:54:00:d0:00:02", &[], None);
    node.write_config(
        "c.yaml",
        &[
            BLUE.to_string(),
            attachment("vm1", "blue", &vm1.port, &vm1.mac, ""),
            attachment("vm2", "blue", &vm2.port, &vm2.mac, ""),
        ]
        .join("---\n"),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    (node, vm1, vm2)
}

#[test]
fn udhcpc_gets_exactly_the_configured_lease_and_options() {
    let (node, vm1, _vm2) = bed();
    let work = node.state_dir.clone();
    let hook = udhcpc_hook(&work);
    let out = vm1.ns.run(&[
        "udhcpc",
        "-i",
        "eth0",
        "-n",
        "-q",
        "-f",
        "-t",
        "5",
        "-T",
        "1",
        "-s",
        &hook,
        "-O",
        "search",
        "-O",
        "staticroutes",
        "-O",
        "mtu",
        "-O",
        "hostname",
    ]);
    let env = env_file(&work.join("udhcpc-bound.env"));
    let lease = lease_of(&node, "vm1", false);
    let (ip, prefix) = lease.split_once('/').unwrap();
    assert_eq!(
        env.get("ip").map(String::as_str),
        Some(ip),
        "{out}\n{env:?}"
    );
    assert_eq!(prefix, "24");
    assert_eq!(env["subnet"], "255.255.255.0");
    assert_eq!(env["router"], "10.20.0.1");
    assert_eq!(env["serverid"], "10.20.0.1");
    assert_eq!(env["dns"], "10.0.0.10");
    assert_eq!(env["domain"], "corp.example");
    assert_eq!(env["search"], "corp.example lab.example");
    assert_eq!(env["mtu"], "1400");
    assert_eq!(env["hostname"], "vm1");
    assert_eq!(env["lease"], "600");
    assert_eq!(
        env["staticroutes"],
        "172.16.0.0/12 10.20.0.254 0.0.0.0/0 10.20.0.1"
    );
    // The VM is configured from the lease and routes through its gateway.
    let routes = vm1.ns.run(&["ip", "route"]);
    assert!(routes.contains("default via 10.20.0.1"), "{routes}");
    assert!(routes.contains("172.16.0.0/12 via 10.20.0.254"), "{routes}");
    assert!(vm1.ping("10.20.0.1"));

    // The exchange is counted per VM interface (`vmpath vm show`).
    let sock = node.api_socket();
    let show = vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        "prod/vm1",
        "-o",
        "json",
        "--api-socket",
        sock.to_str().unwrap(),
    ]);
    let detail: serde_json::Value = serde_json::from_str(&show).unwrap();
    let dhcp = &detail["interfaces"][0]["dhcp"];
    assert!(
        dhcp["replied"]["dhcp4_discover"].as_u64() >= Some(1),
        "{show}"
    );
    assert!(
        dhcp["replied"]["dhcp4_request"].as_u64() >= Some(1),
        "{show}"
    );
}

#[test]
fn dhclient_gets_the_same_address_and_dhclient6_its_ipv6() {
    let (node, _vm1, vm2) = bed();
    let work = node.state_dir.clone();
    let conf = work.join("dhclient.conf");
    fs::write(
        &conf,
        "option rfc3442-classless-static-routes code 121 = array of unsigned integer 8;\n\
         request subnet-mask, routers, domain-name, domain-name-servers, domain-search, host-name, interface-mtu, rfc3442-classless-static-routes;\n",
    )
    .unwrap();
    dhclient_hook(&work);
    let out = dhclient(&vm2, &work, false);
    assert!(
        out.status.success(),
        "dhclient -4: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env = env_file(&work.join("dhclient-BOUND.env"));
    let lease = lease_of(&node, "vm2", false);
    assert_eq!(
        env["new_ip_address"],
        lease.split('/').next().unwrap(),
        "{env:?}"
    );
    assert_eq!(env["new_subnet_mask"], "255.255.255.0");
    assert_eq!(env["new_routers"], "10.20.0.1");
    assert_eq!(env["new_domain_name_servers"], "10.0.0.10");
    assert_eq!(env["new_domain_search"], "corp.example. lab.example.");
    assert_eq!(env["new_interface_mtu"], "1400");
    assert_eq!(env["new_host_name"], "vm2");
    assert_eq!(
        env["new_rfc3442_classless_static_routes"],
        "12 172 16 10 20 0 254 0 10 20 0 1"
    );
    release_dhclient(&vm2, &work, false);

    // IPv6: DHCPv6 hands out the VM's claimed /128.
    vm2.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.eth0.accept_ra=0"]);
    wait_link_local(&vm2);
    let out = dhclient(&vm2, &work, true);
    assert!(
        out.status.success(),
        "dhclient -6: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env6 = env_file(&work.join("dhclient-BOUND6.env"));
    let lease6 = lease_of(&node, "vm2", true);
    assert_eq!(
        env6["new_ip6_address"],
        lease6.split('/').next().unwrap(),
        "{env6:?}"
    );
    assert_eq!(env6["new_ip6_prefixlen"], "128");
    assert_eq!(env6["new_dhcp6_name_servers"], "fd00::53");
    release_dhclient(&vm2, &work, true);
}

/// Writes `dir/dhclient-hook.sh`, which records what dhclient was given in
/// `dir/dhclient-<reason>.env`.
fn dhclient_hook(dir: &Path) {
    let hook = dir.join("dhclient-hook.sh");
    fs::write(
        &hook,
        format!(
            "#!/bin/sh\nenv | grep -E '^(reason|new_)' | sort > {}/dhclient-$reason.env\n",
            dir.display()
        ),
    )
    .unwrap();
    vmpath_tests::run(&["chmod", "+x", hook.to_str().unwrap()]);
}

/// One dhclient exchange on `vm`'s eth0 (`-4` with `work`'s dhclient.conf,
/// or `-6`), with the hook [`dhclient_hook`] wrote into `work`.
fn dhclient(vm: &Vm, work: &Path, v6: bool) -> std::process::Output {
    let w = |f: &str| work.join(f).display().to_string();
    let (family, lease, pid) = if v6 {
        ("-6", w("l6"), w("p6"))
    } else {
        ("-4", w("l4"), w("p4"))
    };
    let conf = w("dhclient.conf");
    let hook = w("dhclient-hook.sh");
    let mut args = vec!["timeout", "20", "dhclient", family, "-1", "-v"];
    if !v6 {
        args.extend(["-cf", &conf]);
    }
    args.extend(["-sf", &hook, "-lf", &lease, "-pf", &pid, "eth0"]);
    vm.ns.run_status(&args)
}

/// Stops the dhclient `dhclient` left running, releasing its lease.
fn release_dhclient(vm: &Vm, work: &Path, v6: bool) {
    let pid = work
        .join(if v6 { "p6" } else { "p4" })
        .display()
        .to_string();
    let family = if v6 { "-6" } else { "-4" };
    let _ = vm.ns.run_status(&["dhclient", family, "-x", "-pf", &pid]);
}

#[test]
fn rdisc6_sees_managed_flag_mtu_and_prefix() {
    let (_node, vm1, _vm2) = bed();
    wait_for("a link-local address", Duration::from_secs(5), || {
        !vm1.ns
            .run(&[
                "ip",
                "-6",
                "addr",
                "show",
                "dev",
                "eth0",
                "scope",
                "link",
                "-tentative",
            ])
            .trim()
            .is_empty()
    });
    let out = vm1.ns.run(&["rdisc6", "-1", "-w", "2000", "eth0"]);
    let line = |key: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("{key} missing:\n{out}"))
            .to_string()
    };
    assert!(line("Stateful address conf.").contains("Yes"), "{out}");
    assert!(line("MTU").contains("1400"), "{out}");
    assert!(line("Prefix").contains("fd20::/64"), "{out}");
    assert!(line("Autonomous address conf.").contains("No"), "{out}");
    assert!(
        line("Source link-layer address").contains("0A:76:70:00:00:64"),
        "{out}"
    );
    assert!(line("Recursive DNS server").contains("fd00::53"), "{out}");
}

#[test]
fn no_offer_on_an_ipamless_network_and_malformed_requests_get_nothing() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:d1:00:01", &[], None);
    let vm2 = node.add_vm("vm2", "52:54:00:d1:00:02", &[], None);
    let vm3 = node.add_vm("vm3", "52:54:00:d1:00:03", &["10.30.0.33/24"], None);
    node.write_config(
        "c.yaml",
        &[
            BLUE.to_string(),
            RED.to_string(),
            attachment("vm1", "blue", &vm1.port, &vm1.mac, ""),
            attachment("vm2", "blue", &vm2.port, &vm2.mac, ""),
            attachment("vm3", "red", &vm3.port, &vm3.mac, ""),
        ]
        .join("---\n"),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port, &vm3.port]);
    let hook = udhcpc_hook(&node.state_dir);

    // red has no IPAM: the VM keeps what it brought and gets no offer.
    let out = udhcpc(&vm3, &hook, 3);
    assert!(!out.status.success(), "an IPAM-less network answered DHCP");

    // Truncated and malformed DHCP from vm1: no reply, nothing disturbed.
    let replies = vm1.ns.scapy(&format!(
        "mac = '{mac}'\n\
         base = Ether(src=mac, dst='ff:ff:ff:ff:ff:ff')/IP(src='0.0.0.0', dst='255.255.255.255')/UDP(sport=68, dport=67)\n\
         good = BOOTP(chaddr=bytes.fromhex(mac.replace(':', '')) + bytes(10), xid=7)/DHCP(options=[('message-type', 'discover'), 'end'])\n\
         frames = [base/Raw(bytes(good)[:n]) for n in (0, 1, 20, 100, 236, 240, 241)]\n\
         frames.append(base/Raw(bytes(good)[:240] + bytes([53, 200])))\n\
         frames.append(base/Raw(bytes(good)[:240] + bytes([53, 1, 99, 255])))\n\
         frames.append(base/BOOTP(op=2, chaddr=bytes.fromhex(mac.replace(':', '')) + bytes(10))/DHCP(options=[('message-type', 'offer'), 'end']))\n\
         frames.append(base/BOOTP(chaddr=bytes.fromhex('525400ffffff') + bytes(10))/DHCP(options=[('message-type', 'discover'), 'end']))\n\
         frames.append(base/BOOTP(hlen=255, chaddr=bytes.fromhex(mac.replace(':', '')) + bytes(10))/DHCP(options=[('message-type', 'discover'), 'end']))\n\
         ans = srp(frames, iface='eth0', timeout=1, multi=True, filter='udp and port 68')[0]\n\
         print(len(ans))",
        mac = vm1.mac
    ));
    assert_eq!(replies.trim(), "0", "malformed DHCP got replies");

    // vm2 is undisturbed and vm1 still gets its lease.
    let env_path = node.state_dir.join("udhcpc-bound.env");
    assert!(udhcpc(&vm2, &hook, 5).status.success(), "vm2 got no lease");
    assert_eq!(
        env_file(&env_path)["ip"],
        lease_of(&node, "vm2", false).split('/').next().unwrap()
    );
    assert!(udhcpc(&vm1, &hook, 5).status.success(), "vm1 got no lease");
    assert_eq!(
        env_file(&env_path)["ip"],
        lease_of(&node, "vm1", false).split('/').next().unwrap()
    );
}

#[test]
fn same_lease_after_agent_restart_and_frames_counted_while_it_is_down() {
    let (mut node, vm1, _vm2) = bed();
    let hook = udhcpc_hook(&node.state_dir);
    let env_path = node.state_dir.join("udhcpc-bound.env");
    assert!(udhcpc(&vm1, &hook, 5).status.success(), "vm1 got no lease");
    let first = env_file(&env_path)["ip"].clone();

    node.kill_agent();
    let before = node.drops(drop_reason::SLOWPATH_NO_LISTENER);
    let out = udhcpc(&vm1, &hook, 2);
    assert!(!out.status.success(), "a lease without an agent?");
    assert!(
        node.drops(drop_reason::SLOWPATH_NO_LISTENER) >= before + 2,
        "frames with no listener not counted"
    );

    node.start_agent();
    node.wait_ports(&[&vm1.port, &_vm2.port]);
    fs::remove_file(&env_path).unwrap();
    vm1.ns
        .run(&["ip", "addr", "flush", "dev", "eth0", "scope", "global"]);
    assert!(udhcpc(&vm1, &hook, 5).status.success(), "vm1 got no lease");
    assert_eq!(
        env_file(&env_path)["ip"],
        first,
        "the lease changed across a restart"
    );
}

/// Runs the CLI against the node's API socket; its stdout.
fn cli(node: &Node, args: &[&str]) -> String {
    let out = std::process::Command::new(vmpath_bin())
        .args(args)
        .arg("--api-socket")
        .arg(node.api_socket())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running the vmpath CLI");
    assert!(
        out.status.success(),
        "vmpath {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The per-class rate-limit counts of a VM's interface, from `vm show -o json`.
fn rate_limited(node: &Node, vm: &str) -> BTreeMap<String, u64> {
    let v: serde_json::Value = serde_json::from_str(&cli(
        node,
        &["vm", "show", &format!("prod/{vm}"), "-o", "json"],
    ))
    .expect("vm show JSON");
    serde_json::from_value(v["interfaces"][0]["slowpath_rate_limited"].clone())
        .expect("slowpath_rate_limited")
}

/// DHCPv4 DISCOVERs the slow path received from a VM's interface.
fn discovers_received(node: &Node, vm: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&cli(
        node,
        &["vm", "show", &format!("prod/{vm}"), "-o", "json"],
    ))
    .expect("vm show JSON");
    v["interfaces"][0]["dhcp"]["received"]["dhcp4_discover"]
        .as_u64()
        .unwrap_or(0)
}

fn wait_link_local(vm: &Vm) {
    wait_for("a link-local address", Duration::from_secs(5), || {
        !vm.ns
            .run(&[
                "ip",
                "-6",
                "addr",
                "show",
                "dev",
                "eth0",
                "scope",
                "link",
                "-tentative",
            ])
            .trim()
            .is_empty()
    });
}

/// One VM floods the slow path (DISCOVERs, SOLICITs and RSs from a raw
/// socket, as fast as it goes); another VM on the node still gets its
/// DHCPv4 lease (udhcpc), its DHCPv6 address (dhclient -6) and its RA
/// (rdisc6); the flood is dropped in the data path, counted per port and
/// class, and the flooding port's own client gets its lease once it stops.
#[test]
fn a_flooding_vm_cannot_starve_another_vms_dhcp() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:d2:00:01", &[], None);
    let vm2 = node.add_vm("vm2", "52:54:00:d2:00:02", &[], None);
    node.write_config(
        "c.yaml",
        &[
            BLUE.to_string(),
            attachment("vm1", "blue", &vm1.port, &vm1.mac, ""),
            attachment("vm2", "blue", &vm2.port, &vm2.mac, ""),
        ]
        .join("---\n"),
    );
    node.set_agent_args(&["--metrics-addr", "127.0.0.1:9469"]);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    let hook = udhcpc_hook(&node.state_dir);
    let env_path = node.state_dir.join("udhcpc-bound.env");
    wait_link_local(&vm2);
    vm2.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.eth0.accept_ra=0"]);
    let limited_before = node.drops(drop_reason::SLOWPATH_RATE_LIMITED);

    let mac1: [u8; 6] = {
        let b: Vec<u8> = vm1
            .mac
            .split(':')
            .map(|x| u8::from_str_radix(x, 16).unwrap())
            .collect();
        b.try_into().unwrap()
    };
    let started = Instant::now();
    let flood = Flood::start(
        &vm1.ns.path(),
        "eth0",
        mac1,
        &[
            FloodKind::Dhcp4Discover,
            FloodKind::Dhcp6Solicit,
            FloodKind::RouterSolicit,
        ],
    );
    // Let the flood drain every bucket of vm1's port first.
    wait_for(
        "the flood to be rate-limited",
        Duration::from_secs(10),
        || node.drops(drop_reason::SLOWPATH_RATE_LIMITED) > limited_before + 1000,
    );

    let v4 = udhcpc(&vm2, &hook, 5);
    let rdisc = vm2.ns.run_status(&["rdisc6", "-1", "-w", "2000", "eth0"]);
    dhclient_hook(&node.state_dir);
    let v6 = dhclient(&vm2, &node.state_dir, true);
    release_dhclient(&vm2, &node.state_dir, true);
    let elapsed = started.elapsed();
    let sent = flood.stop();

    assert!(
        v4.status.success(),
        "vm2 got no DHCPv4 lease during the flood: {}",
        String::from_utf8_lossy(&v4.stderr)
    );
    assert_eq!(
        env_file(&env_path)["ip"],
        lease_of(&node, "vm2", false).split('/').next().unwrap()
    );
    let ra = String::from_utf8_lossy(&rdisc.stdout);
    assert!(
        rdisc.status.success() && ra.contains("fd20::/64"),
        "vm2 got no RA during the flood:\n{ra}"
    );
    assert!(v6.status.success(), "dhclient -6 failed during the flood");
    let env6 = env_file(&node.state_dir.join("dhclient-BOUND6.env"));
    assert_eq!(
        env6.get("new_ip6_address").map(String::as_str),
        Some(lease_of(&node, "vm2", true).split('/').next().unwrap()),
        "{env6:?}"
    );

    // The flood was dropped in the data path, under its reason, per port
    // and class; vm2 lost nothing.
    let limited = node.drops(drop_reason::SLOWPATH_RATE_LIMITED) - limited_before;
    let by_class = rate_limited(&node, "vm1");
    for class in ["dhcp4", "dhcp6", "router_solicit"] {
        assert!(
            by_class[class] > 0,
            "no {class} frames of vm1 rate-limited: {by_class:?}"
        );
    }
    assert_eq!(by_class.values().sum::<u64>(), limited);
    assert!(
        rate_limited(&node, "vm2").values().all(|n| *n == 0),
        "vm2 was rate-limited"
    );
    let text = cli(&node, &["vm", "show", "prod/vm1"]);
    assert!(
        text.contains(&format!("dhcp4 {}", by_class["dhcp4"])),
        "vm show lacks the rate-limited count:\n{text}"
    );
    let metrics = node.ns.run(&[
        "curl",
        "-sfS",
        "--max-time",
        "5",
        "http://127.0.0.1:9469/metrics",
    ]);
    let metric = metrics
        .lines()
        .find(|l| {
            l.starts_with("vmpath_port_slowpath_rate_limited_total{")
                && l.contains(&format!("port=\"{}\"", vm1.port))
                && l.contains("class=\"dhcp4\"")
        })
        .unwrap_or_else(|| panic!("no rate-limit metric for vm1:\n{metrics}"));
    let value: u64 = metric.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(value >= by_class["dhcp4"], "{metric}");

    // What reached the agent from vm1 is what its buckets let through:
    // per CPU, the burst plus the rate over the flood's time (default
    // dhcp4 limit: 20/s, burst 40), not the flood.
    let cpus = aya::util::nr_cpus().expect("nr_cpus") as u64;
    let allowed = cpus * (40 + 20 * (elapsed.as_secs() + 1));
    let received = discovers_received(&node, "vm1");
    assert!(
        received <= allowed,
        "{received} DISCOVERs of vm1 reached the agent, its limit allows {allowed} (flood sent {sent})"
    );
    assert!(sent > received * 10, "the flood sent only {sent} frames");

    // Flood over: vm1's own client gets its lease.
    fs::remove_file(&env_path).unwrap();
    assert!(
        udhcpc(&vm1, &hook, 5).status.success(),
        "vm1 got no lease after its flood"
    );
    assert_eq!(
        env_file(&env_path)["ip"],
        lease_of(&node, "vm1", false).split('/').next().unwrap()
    );
}
