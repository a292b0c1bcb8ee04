//! vmpath attaches only to VM ports: Attachments naming the loopback, the
//! uplink, vmpath's own devices, an interface with a node address or a
//! bridge are refused with the rule they break, nothing is claimed or
//! attached for them, and the node keeps working; a port that stops being
//! a VM port loses the program.

use std::time::Duration;

use serde_json::Value;
use vmpath_tests::{
    AGENT_START_BOUND, Netns, Node, iperf3, link, unique_tag, vmpath_bin, wait_for, yaml,
};

/// The VM-port programs on the node's interfaces (`vm_port-IFINDEX`).
fn pins(node: &Node) -> Vec<String> {
    node.port_programs().into_iter().map(|(p, _)| p).collect()
}

/// Whether `bpftool net` shows the VM-port program on `ifname` in the node.
fn vm_port_on(node: &Node, ifname: &str) -> bool {
    node.ns
        .run(&["bpftool", "net", "show", "dev", ifname])
        .contains("vm_port")
}

fn refusal<'a>(status: &'a Value, vm: &str) -> Option<&'a Value> {
    status["config_errors"]
        .as_array()?
        .iter()
        .find(|e| e["document"] == format!("Attachment prod/{vm}-eth0"))
}

/// An Attachment on an IPAM network without addresses: IPAM would claim
/// one if it were accepted.
fn bad(vm: &str, port: &str, i: u32) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {vm}-eth0, namespace: prod}}\nspec:\n  vm: {vm}\n  interface: eth0\n  network: blue\n  node: a\n  port: {port}\n  mac: \"52:54:00:0e:00:{i:02x}\"\n"
    )
}

#[test]
fn only_vm_ports_are_attached_and_a_port_that_stops_being_one_is_detached() {
    let mut node = Node::new("a");
    let ext = Netns::new(format!("vt{}-ext", unique_tag()));
    link(
        &node.ns,
        "up0",
        "192.0.2.1/24",
        &ext,
        "eth0",
        "192.0.2.2/24",
    );
    let vm1 = node.add_vm("vm1", "52:54:00:0e:01:01", &["10.20.0.11/16"], None);
    let vm2 = node.add_vm("vm2", "52:54:00:0e:01:02", &["10.20.0.12/16"], None);
    // Host interfaces whose names match the port pattern: only the other
    // rules keep vmpath off them. A dummy where the kernel has the driver,
    // else a veth (so only the node-address rule can refuse it).
    if !node
        .ns
        .run_status(&["ip", "link", "add", "vmdummy0", "type", "dummy"])
        .status
        .success()
    {
        node.ns.run(&[
            "ip",
            "link",
            "add",
            "vmdummy0",
            "type",
            "veth",
            "peer",
            "name",
            "vmdummy0p",
        ]);
    }
    for cmd in [
        "ip addr add 198.51.100.1/32 dev vmdummy0",
        "ip link set vmdummy0 up",
        "ip link add vmbr0 type bridge",
        "ip link set vmbr0 up",
    ] {
        node.ns.run(&cmd.split(' ').collect::<Vec<_>>());
    }
    let cases = [
        ("lo", "lo", "rule loopback"),
        ("up", "up0", "rule uplink"),
        ("vx", "vmp-vxlan", "rule vmpath-device"),
        ("slow", "vmp-slow0", "rule vmpath-device"),
        (
            "dummy",
            "vmdummy0",
            "rule node-address: it carries the node's address 198.51.100.1",
        ),
        ("bridge", "vmbr0", "rule not-veth-or-tap: it is a bridge"),
    ];
    let mut docs = vec![
        vmpath_tests::yaml_overlay::node("a", "192.0.2.1"),
        yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
        yaml::attachment("vm1", "blue", "a", &vm1.port, &vm1.mac, &["10.20.0.11/16"]),
        yaml::attachment("vm2", "blue", "a", &vm2.port, &vm2.mac, &["10.20.0.12/16"]),
    ];
    for (i, (vm, port, _)) in cases.iter().enumerate() {
        docs.push(bad(vm, port, i as u32));
    }
    node.write_config("c.yaml", &yaml::docs(&docs));
    node.set_agent_args(&["--uplink", "up0", "--metrics-addr", "off"]);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    // vmp-vxlan appears once the overlay is up: its refusal comes then.
    wait_for("every bad port refused", Duration::from_secs(20), || {
        node.status()
            .is_some_and(|s| cases.iter().all(|(vm, _, _)| refusal(&s, vm).is_some()))
    });
    let status = node.status().unwrap();
    for (vm, port, rule) in cases {
        let e = refusal(&status, vm).unwrap();
        let msg = e["message"].as_str().unwrap();
        assert_eq!(e["field"], "spec.port", "{e}");
        assert!(
            msg.contains(&format!("port {port:?} is not a VM port")) && msg.contains(rule),
            "{vm}: {msg}"
        );
        assert!(
            !node.agent_log().contains(&format!("vm=prod/{vm}/eth0")),
            "something was claimed or done for {vm}"
        );
        assert!(!vm_port_on(&node, port), "the VM-port program on {port}");
    }
    // The only VM-port programs are the VMs'.
    let vm_links: Vec<String> = pins(&node)
        .into_iter()
        .filter(|p| p.starts_with("vm_port-"))
        .collect();
    let mut want = vec![
        format!("vm_port-{}", node.ns.ifindex(&vm1.port)),
        format!("vm_port-{}", node.ns.ifindex(&vm2.port)),
    ];
    want.sort();
    assert_eq!(vm_links, want);
    let text = String::from_utf8(
        std::process::Command::new(vmpath_bin())
            .args(["status", "--api-socket"])
            .arg(node.api_socket())
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(text.contains("ineligible ports: 6"), "{text}");

    // The node's loopback and uplink, and the VMs, keep working.
    assert!(node.ns.ping("127.0.0.1", 2));
    assert!(node.ns.ping("192.0.2.2", 2));
    assert!(ext.ping("192.0.2.1", 2));
    iperf3(&node.ns, &node.ns, "127.0.0.1", false, 1);
    iperf3(&ext, &node.ns, "192.0.2.2", false, 1);
    assert!(vm1.ping("10.20.0.12"));
    iperf3(&vm2.ns, &vm1.ns, "10.20.0.12", false, 1);

    // A VM port renamed into a name outside the pattern is detached.
    let vm2_index = node.ns.ifindex(&vm2.port);
    node.ns
        .run(&["ip", "link", "set", &vm2.port, "name", "eth5"]);
    wait_for("vm2's port to be detached", Duration::from_secs(10), || {
        !pins(&node).contains(&format!("vm_port-{vm2_index}"))
    });
    assert!(!vm_port_on(&node, "eth5"));
    assert!(!vm2.ping("10.20.0.11"), "vm2 still switched by vmpath");

    // An agent that finds its program on an interface that is no VM port
    // (here: vm1's port now carries a node address) removes it, saying so.
    node.kill_agent();
    let vm1_index = node.ns.ifindex(&vm1.port);
    assert!(pins(&node).contains(&format!("vm_port-{vm1_index}")));
    node.ns
        .run(&["ip", "addr", "add", "203.0.113.7/32", "dev", &vm1.port]);
    node.start_agent();
    wait_for("the stale program removed", AGENT_START_BOUND, || {
        !pins(&node).contains(&format!("vm_port-{vm1_index}"))
    });
    // The agent says so just after it removed the link: wait for the line
    // rather than read the log at once.
    let said = |log: &str| {
        log.lines().any(|l| {
            l.contains("removed the VM-port programs from an interface that is not a VM port")
                && l.contains(&vm1.port)
                && l.contains("203.0.113.7")
        })
    };
    let waited = std::time::Instant::now();
    while !said(&node.agent_log()) && waited.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = node.agent_log();
    assert!(said(&log), "{log}");
    assert!(!vm_port_on(&node, &vm1.port));
}
