//! A VM that attacks its neighbours, with real frames (scapy) from inside
//! its namespace, checked where a user would look: the other VMs'
//! neighbour tables, what their captures saw, the lease their DHCP client
//! took, and the typed drop counters. Every capture also expects a control
//! frame, so a capture that saw nothing is known to have worked.

use std::{
    io::{BufRead, BufReader},
    process::Child,
    time::Duration,
};

use vmpath_tests::{
    Netns, Node, Vm, qemu::Guest as _, vmpath::common::drop_reason, wait_for, yaml,
};

const BLUE: &str = "blue";

/// vm1 (the attacker), vm2 and vm3 on `blue` (IPAM Enabled: IP filter and
/// DHCP guard on; Disabled: both off), each with given IPv4 and IPv6
/// addresses.
struct Bed {
    node: Node,
    vm1: Vm,
    vm2: Vm,
    vm3: Vm,
}

fn three_vms(ipam: bool) -> Bed {
    let mut node = Node::new("a");
    let vm = |node: &Node, n: u8| {
        node.add_vm(
            &format!("vm{n}"),
            &format!("52:54:00:00:0{n}:01"),
            &[&format!("10.20.0.1{n}/16"), &format!("fd20::1{n}/64")],
            Some("10.20.0.1"),
        )
    };
    let (vm1, vm2, vm3) = (vm(&node, 1), vm(&node, 2), vm(&node, 3));
    let mut docs = vec![yaml::network(
        BLUE,
        100,
        &["10.20.0.0/16", "fd20::/64"],
        &["10.20.0.1", "fd20::1"],
        ipam,
    )];
    for (n, v) in [(1, &vm1), (2, &vm2), (3, &vm3)] {
        docs.push(yaml::attachment(
            &format!("vm{n}"),
            BLUE,
            "a",
            &v.port,
            &v.mac,
            &[&format!("10.20.0.1{n}/16"), &format!("fd20::1{n}/64")],
        ));
    }
    node.write_config("config.yaml", &yaml::docs(&docs));
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port, &vm3.port]);
    Bed {
        node,
        vm1,
        vm2,
        vm3,
    }
}

/// vm1 sends a forged NA for vm2's address (override set, its own MAC as
/// target link-layer address) to all nodes and to vm3, and an NS with vm2's
/// MAC as its source link-layer address: vm3's neighbour entries do not
/// move and vm3 still reaches vm2 over IPv6. vm1 announcing its own
/// address (the control) does move vm3's entry.
#[test]
fn rogue_nd_cannot_take_another_vms_ipv6_traffic() {
    let bed = three_vms(true);
    let (m1, m2, m3) = (&bed.vm1.mac, &bed.vm2.mac, &bed.vm3.mac);
    assert!(bed.vm3.ns.ping("fd20::12", 2), "vm3 -> vm2 IPv6 before");
    assert_eq!(bed.vm3.neighbour("fd20::12").unwrap_or_default(), *m2);
    // An entry for vm1 with a MAC nobody has: whoever updates it is seen.
    let stale = "52:54:00:00:99:99";
    bed.vm3.ns.run(&[
        "ip", "-6", "neigh", "replace", "fd20::11", "lladdr", stale, "dev", "eth0", "nud", "stale",
    ]);

    let before_target = bed.node.drops(drop_reason::ND_SPOOF_TARGET);
    let before_lladdr = bed.node.drops(drop_reason::ND_SPOOF_LLADDR);
    forge_na_for_vm2(&bed);
    bed.vm1.ns.scapy(&format!(
        "ns = ICMPv6ND_NS(tgt='fd20::13')/ICMPv6NDOptSrcLLAddr(lladdr='{m2}')
sendp(Ether(src='{m1}', dst='{m3}')/IPv6(src='fd20::11', dst='fd20::13', hlim=255)/ns, iface='eth0', count=3)
"
    ));
    wait_for(
        "the forged NA and NS counted",
        Duration::from_secs(5),
        || {
            bed.node.drops(drop_reason::ND_SPOOF_TARGET) == before_target + 6
                && bed.node.drops(drop_reason::ND_SPOOF_LLADDR) == before_lladdr + 3
        },
    );

    // The control: vm1 announces its own address, and vm3 takes it.
    bed.vm1.ns.scapy(&format!(
        "sendp(Ether(src='{m1}', dst='33:33:00:00:00:01')/IPv6(src='fd20::11', dst='ff02::1', hlim=255)/ICMPv6ND_NA(tgt='fd20::11', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{m1}'), iface='eth0', count=2)"
    ));
    wait_for(
        "vm3 takes vm1's own announcement",
        Duration::from_secs(5),
        || bed.vm3.neighbour("fd20::11").unwrap_or_default() == *m1,
    );
    // The forged NS came before the control and never changed the entry
    // to vm2's MAC; the forged NA never moved vm2's.
    assert_eq!(
        bed.vm3.neighbour("fd20::12").unwrap_or_default(),
        *m2,
        "vm3's entry for vm2 moved"
    );
    assert!(bed.vm3.ns.ping("fd20::12", 2), "vm3 -> vm2 IPv6 after");
    assert_eq!(bed.vm3.neighbour("fd20::12").unwrap_or_default(), *m2);
}

/// vm1's forged NA for vm2's address (override set, vm1's MAC as target
/// link-layer address), three times to all nodes and three times to vm3.
fn forge_na_for_vm2(bed: &Bed) {
    let (m1, m3) = (&bed.vm1.mac, &bed.vm3.mac);
    bed.vm1.ns.scapy(&format!(
        "na = ICMPv6ND_NA(tgt='fd20::12', R=0, S=0, O=1)/ICMPv6NDOptDstLLAddr(lladdr='{m1}')
sendp(Ether(src='{m1}', dst='33:33:00:00:00:01')/IPv6(src='fd20::11', dst='ff02::1', hlim=255)/na, iface='eth0', count=3)
sendp(Ether(src='{m1}', dst='{m3}')/IPv6(src='fd20::11', dst='fd20::13', hlim=255)/na, iface='eth0', count=3)
"
    ));
}

/// The documented IPAM-less behaviour, and proof that the test above can
/// fail: with the IP filter off (IPAM Disabled, no `portSecurity.ip`),
/// neighbour discovery is the VMs' own as on a plain bridge, and the same
/// forged NA does move vm3's entry for vm2 to vm1.
#[test]
fn rogue_nd_on_an_ipamless_network_is_the_vms_own() {
    let bed = three_vms(false);
    assert!(bed.vm3.ns.ping("fd20::12", 2), "vm3 -> vm2 IPv6");
    assert_eq!(
        bed.vm3.neighbour("fd20::12").unwrap_or_default(),
        bed.vm2.mac
    );
    let before = bed.node.drops(drop_reason::ND_SPOOF_TARGET);
    forge_na_for_vm2(&bed);
    wait_for("vm3 takes the forged NA", Duration::from_secs(5), || {
        bed.vm3.neighbour("fd20::12").unwrap_or_default() == bed.vm1.mac
    });
    assert_eq!(bed.node.drops(drop_reason::ND_SPOOF_TARGET), before);
}

/// A scapy capture on `vm`'s eth0 of every frame from `from_mac`, running
/// until the end marker (UDP to port 5002) arrives; `ready` is printed once
/// it listens. It prints `rogue4 rogue6 control`: the DHCPv4 and DHCPv6
/// server frames and the control frames it saw.
fn start_capture(vm: &Vm, from_mac: &str) -> Child {
    let script = format!(
        "from scapy.all import *
seen = [0, 0, 0]
def count(p):
    if p[Ether].src != '{from_mac}' or UDP not in p:
        return
    u = p[UDP]
    if u.sport == 67:
        seen[0] += 1
    elif u.sport == 547:
        seen[1] += 1
    elif u.dport == 5001:
        seen[2] += 1
sniff(iface='eth0', prn=count, timeout=120,
      stop_filter=lambda p: p[Ether].src == '{from_mac}' and UDP in p and p[UDP].dport == 5002,
      started_callback=lambda: print('ready', flush=True))
print(*seen, flush=True)
"
    );
    let mut child = vm
        .ns
        .spawn(&[vmpath_tests::SCAPY_PYTHON, "-u", "-c", &script]);
    let mut line = String::new();
    let stdout = child.stdout.as_mut().expect("capture stdout");
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert_eq!(
        line.trim(),
        "ready",
        "the capture in {} did not start",
        vm.ns.name
    );
    child
}

/// What a capture counted: (DHCPv4 server, DHCPv6 server, control).
fn capture_counts(child: Child, ns: &Netns) -> (u64, u64, u64) {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let nums: Vec<u64> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(
        nums.len(),
        3,
        "capture in {}: {text}\n{}",
        ns.name,
        String::from_utf8_lossy(&out.stderr)
    );
    (nums[0], nums[1], nums[2])
}

/// vm1 runs a rogue DHCP server (DHCPOFFER and DHCPACK broadcasts, DHCPv6
/// ADVERTISE and REPLY to all nodes, its own server id and router) while
/// vm2 takes a lease with udhcpc: vm2 gets vmpath's lease, neither vm2 nor
/// vm3 ever sees a rogue frame (but both see vm1's control frames), and
/// every rogue frame is counted as `dhcp_spoof`.
#[test]
fn rogue_dhcp_server_reaches_nobody_and_udhcpc_gets_vmpaths_lease() {
    let bed = three_vms(true);
    // vm2 takes its address from DHCP instead.
    bed.vm2
        .ns
        .run(&["ip", "-4", "addr", "flush", "dev", "eth0"]);
    let m1 = bed.vm1.mac.clone();
    let cap2 = start_capture(&bed.vm2, &m1);
    let cap3 = start_capture(&bed.vm3, &m1);
    let before = bed.node.drops(drop_reason::DHCP_SPOOF);

    const ROUNDS: u64 = 20;
    let control = format!(
        "sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/IP(src='10.20.0.11', dst='255.255.255.255')/UDP(sport=5000, dport=5001)/Raw(b'control'), iface='eth0')"
    );
    let mut rogue = bed.vm1.ns.spawn(&[
        vmpath_tests::SCAPY_PYTHON,
        "-c",
        &format!(
            "from scapy.all import *
conf.verb = 0
m1 = '{m1}'
opts = [('server_id', '10.20.0.11'), ('router', '10.20.0.11'), ('subnet_mask', '255.255.0.0'), ('lease_time', 3600)]
def bootp(kind):
    return Ether(src=m1, dst='ff:ff:ff:ff:ff:ff')/IP(src='10.20.0.11', dst='255.255.255.255')/UDP(sport=67, dport=68)/BOOTP(op=2, yiaddr='10.20.0.99', siaddr='10.20.0.11', xid=RandInt())/DHCP(options=[('message-type', kind)] + opts + ['end'])
def dhcp6(msg):
    return Ether(src=m1, dst='33:33:00:01:00:02')/IPv6(src='fe80::5054:ff:fe00:101', dst='ff02::1:2')/UDP(sport=547, dport=546)/msg
for i in range({ROUNDS}):
    sendp([bootp('offer'), bootp('ack'), dhcp6(DHCP6_Advertise()), dhcp6(DHCP6_Reply())], iface='eth0')
    {control}
    time.sleep(0.2)
"
        ),
    ]);

    // A real client while the rogue keeps offering.
    let hook = bed.node.state_dir.join("udhcpc-hook.sh");
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\n[ \"$1\" = bound ] && echo \"$ip $serverid\" > {}/lease\nexit 0\n",
            bed.node.state_dir.display()
        ),
    )
    .unwrap();
    vmpath_tests::run(&["chmod", "+x", hook.to_str().unwrap()]);
    let out = vmpath_tests::udhcpc(&bed.vm2.ns, "eth0", hook.to_str().unwrap(), 5);
    assert!(
        out.status.success(),
        "udhcpc got no lease: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lease = std::fs::read_to_string(bed.node.state_dir.join("lease")).unwrap();
    assert_eq!(
        lease.trim(),
        "10.20.0.12 10.20.0.1",
        "vm2's lease (address, server id) is not vmpath's"
    );

    let status = rogue.wait().unwrap();
    assert!(status.success(), "the rogue server's script failed");
    bed.vm1.ns.scapy(&format!(
        "sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/IP(src='10.20.0.11', dst='255.255.255.255')/UDP(sport=5000, dport=5002), iface='eth0')"
    ));
    for (cap, vm) in [(cap2, &bed.vm2), (cap3, &bed.vm3)] {
        let (rogue4, rogue6, control) = capture_counts(cap, &vm.ns);
        assert_eq!((rogue4, rogue6), (0, 0), "{} saw rogue DHCP", vm.ns.name);
        assert_eq!(
            control, ROUNDS,
            "{} missed vm1's control frames",
            vm.ns.name
        );
    }
    assert_eq!(
        bed.node.drops(drop_reason::DHCP_SPOOF),
        before + 4 * ROUNDS,
        "every rogue frame counted as dhcp_spoof"
    );
}

/// vm1 sends unicast to a MAC nobody has: with every other port's MAC
/// known and filtered, no VM gets a copy (nobody can sniff traffic for an
/// absent MAC by sharing the network), each frame is counted as
/// `no_destination`. VLAN-tagged broadcasts from vm1 reach nobody either
/// (`ethertype`). vm1's plain broadcasts (the control) reach both.
#[test]
fn unknown_unicast_and_vlan_tagged_frames_reach_no_vm() {
    let bed = three_vms(true);
    let m1 = bed.vm1.mac.clone();
    let cap2 = start_capture(&bed.vm2, &m1);
    let cap3 = start_capture(&bed.vm3, &m1);
    let before = bed.node.drops(drop_reason::NO_DESTINATION);
    let before_tagged = bed.node.drops(drop_reason::ETHERTYPE);
    const FRAMES: u64 = 10;
    // Counted as "rogue4" by the capture: UDP from port 67, here simply a
    // marker on frames no VM may see.
    bed.vm1.ns.scapy(&format!(
        "for i in range({FRAMES}):
    sendp(Ether(src='{m1}', dst='52:54:00:00:0f:0f')/IP(src='10.20.0.11', dst='10.20.0.99')/UDP(sport=67, dport=9), iface='eth0')
    sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/Dot1Q(vlan=10)/IP(src='10.20.0.11', dst='255.255.255.255')/UDP(sport=67, dport=9), iface='eth0')
    sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/IP(src='10.20.0.11', dst='255.255.255.255')/UDP(sport=5000, dport=5001), iface='eth0')
sendp(Ether(src='{m1}', dst='ff:ff:ff:ff:ff:ff')/IP(src='10.20.0.11', dst='255.255.255.255')/UDP(sport=5000, dport=5002), iface='eth0')
"
    ));
    for (cap, vm) in [(cap2, &bed.vm2), (cap3, &bed.vm3)] {
        let (unknown, _, control) = capture_counts(cap, &vm.ns);
        assert_eq!(
            unknown, 0,
            "{} saw unicast for a MAC nobody has or a VLAN-tagged frame",
            vm.ns.name
        );
        assert_eq!(
            control, FRAMES,
            "{} missed vm1's control frames",
            vm.ns.name
        );
    }
    assert_eq!(
        bed.node.drops(drop_reason::NO_DESTINATION),
        before + FRAMES,
        "every unknown unicast frame counted as no_destination"
    );
    assert_eq!(
        bed.node.drops(drop_reason::ETHERTYPE),
        before_tagged + FRAMES,
        "every VLAN-tagged frame counted as ethertype"
    );
}
