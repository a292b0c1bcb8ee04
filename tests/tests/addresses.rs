//! Addresses that stay with the VM: IPAM with persistent claims, static
//! requests, excludeSubnets, MAC detection and generation, learned IPs.

use std::time::Duration;

use serde_json::Value;
use vmpath_tests::{Node, wait_for, yaml};

fn network(name: &str, id: u32, body: &str) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: {name}}}\nspec:\n  id: {id}\n{body}"
    )
}

/// An Attachment on node `a`; `extra` holds optional spec lines (mac, ips,
/// macPolicy).
fn attachment(vm: &str, net: &str, port: &str, extra: &str) -> String {
    yaml::attachment_with(vm, net, "a", port, extra)
}

fn ips_of(view: &Value, origin: &str) -> Vec<String> {
    view["ips"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|ip| ip["origin"] == origin)
        .map(|ip| ip["address"].as_str().unwrap().to_string())
        .collect()
}

const BLUE: &str = "  subnets: [10.20.0.0/24, \"fd20::/64\"]\n  defaultGatewayIPs: [10.20.0.1, \"fd20::1\"]\n  excludeSubnets: [10.20.0.0/26, \"fd20::/65\"]\n  ipam: {mode: Enabled, lifecycle: Persistent}\n";

#[test]
fn claimed_addresses_and_detected_mac_survive_restart_and_port_recreation() {
    let mut node = Node::new("a");
    // No MAC and no IPs in the Attachment: IPAM claims, traffic tells the MAC.
    let vm = node.add_vm("vm1", "52:54:00:aa:00:01", &[], None);
    node.write_config(
        "c.yaml",
        &yaml::docs(&[
            network("blue", 100, BLUE),
            attachment("vm1", "blue", &vm.port, ""),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm.port]);

    let view = node.attachment_view("vm1").unwrap();
    let claimed = ips_of(&view, "claimed");
    assert_eq!(claimed.len(), 2, "one address per family: {view}");
    let v4: std::net::Ipv4Addr = claimed[0].split('/').next().unwrap().parse().unwrap();
    assert!(
        claimed[0].ends_with("/24") && v4.octets()[3] >= 64 && v4.octets()[3] < 255,
        "{v4} excluded or reserved"
    );
    assert_ne!(v4.to_string(), "10.20.0.1");
    let v6 = claimed.iter().find(|a| a.contains(':')).unwrap().clone();
    let v6_addr: std::net::Ipv6Addr = v6.split('/').next().unwrap().parse().unwrap();
    assert!(
        v6_addr.segments()[4] >= 0x8000,
        "{v6_addr} lies in the excluded fd20::/65"
    );
    assert!(
        view["mac"].is_null(),
        "MAC known before any traffic: {view}"
    );

    // The VM brings up the claimed address and sends one frame (an ARP for
    // its gateway, which the gateway answers).
    vm.ns
        .run(&["ip", "addr", "add", &claimed[0], "dev", "eth0"]);
    vm.ns
        .run(&["ip", "addr", "add", &v6, "dev", "eth0", "nodad"]);
    assert!(vm.ping("10.20.0.1"));
    wait_for("detected MAC", Duration::from_secs(5), || {
        node.attachment_view("vm1")
            .is_some_and(|v| v["mac"] == "52:54:00:aa:00:01" && v["mac_origin"] == "detected")
    });
    // `vmpath vm show` exposes it, with its origin.
    let show = vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        "prod/vm1",
        "--api-socket",
        node.api_socket().to_str().unwrap(),
    ]);
    assert!(
        show.contains("52:54:00:aa:00:01") && show.contains("detected"),
        "{show}"
    );

    // Restart the agent and re-create the port: same IPs, same MAC.
    node.kill_agent();
    node.ns.run(&["ip", "link", "del", &vm.port]);
    vmpath_tests::veth(&node.ns, &vm.port, &vm.ns, "eth0");
    vm.ns
        .run(&["ip", "link", "set", "eth0", "address", "52:54:00:aa:00:01"]);
    vm.ns
        .run(&["ip", "addr", "add", &claimed[0], "dev", "eth0"]);
    vm.ns.run(&["ip", "link", "set", "eth0", "up"]);
    node.ns.run(&["ip", "link", "set", &vm.port, "up"]);
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    let view = node.attachment_view("vm1").unwrap();
    assert_eq!(
        ips_of(&view, "claimed"),
        claimed,
        "claim changed across restart"
    );
    assert_eq!(view["mac"], "52:54:00:aa:00:01");
    assert_eq!(view["mac_origin"], "detected");
    assert!(vm.ping("10.20.0.1"));
    // The detected MAC is enforced now: another source MAC is dropped.
    let before = node.drops(vmpath_tests::vmpath::common::drop_reason::MAC_SPOOF);
    vm.ns
        .run(&["ip", "link", "set", "eth0", "address", "52:54:00:aa:00:99"]);
    assert!(!vm.ns.ping("10.20.0.1", 2));
    assert!(node.drops(vmpath_tests::vmpath::common::drop_reason::MAC_SPOOF) > before);
}

#[test]
fn static_request_may_use_excluded_range_and_conflicts_name_both() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:bb:00:01", &[], None);
    let vm2 = node.add_vm("vm2", "52:54:00:bb:00:02", &["10.20.0.10/24"], None);
    node.write_config(
        "c.yaml",
        &yaml::docs(&[
            network("blue", 100, BLUE),
            attachment("vm1", "blue", &vm1.port, "  mac: \"52:54:00:bb:00:01\"\n"),
            // Inside excludeSubnets: exactly what they are for.
            attachment(
                "vm2",
                "blue",
                &vm2.port,
                "  mac: \"52:54:00:bb:00:02\"\n  ips: [10.20.0.10/24]\n",
            ),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    let v1 = node.attachment_view("vm1").unwrap();
    let claimed = ips_of(&v1, "claimed");
    let v1_ip4 = claimed.iter().find(|a| !a.contains(':')).unwrap().clone();
    assert_eq!(
        ips_of(&node.attachment_view("vm2").unwrap(), "given"),
        ["10.20.0.10/24"]
    );
    vm1.ns.run(&["ip", "addr", "add", &v1_ip4, "dev", "eth0"]);
    assert!(vm1.ping("10.20.0.10"));

    // vm3 asks for vm1's claimed address: refused, naming both; vm1 keeps it.
    let vm3 = node.add_vm("vm3", "52:54:00:bb:00:03", &[], None);
    let cfg = std::fs::read_to_string(node.config_dir.join("c.yaml")).unwrap();
    node.write_config(
        "c.yaml",
        &format!(
            "{cfg}---\n{}",
            attachment(
                "vm3",
                "blue",
                &vm3.port,
                &format!("  mac: \"52:54:00:bb:00:03\"\n  ips: [{v1_ip4}]\n")
            )
        ),
    );
    wait_for(
        "the conflict to be refused",
        Duration::from_secs(10),
        || {
            node.agent_log()
                .lines()
                .any(|l| l.contains("refused:") && l.contains("prod/vm3-eth0"))
        },
    );
    let log = node.agent_log();
    let line = log
        .lines()
        .find(|l| l.contains("refused:") && l.contains("prod/vm3-eth0"))
        .unwrap();
    assert!(
        line.contains("spec.ips") && line.contains("prod/vm1/eth0"),
        "{line}"
    );
    assert_eq!(
        ips_of(&node.attachment_view("vm1").unwrap(), "claimed"),
        claimed
    );
    assert!(vm1.ping("10.20.0.10"), "vm1 disturbed by the conflict");

    // Deleting vm1's Attachment releases its claim: now vm3 may have it.
    let without_vm1: Vec<String> = std::fs::read_to_string(node.config_dir.join("c.yaml"))
        .unwrap()
        .split("---\n")
        .filter(|d| !d.contains("vm: vm1"))
        .map(String::from)
        .collect();
    node.write_config("c.yaml", &without_vm1.join("---\n"));
    wait_for(
        "vm3 to get the released address",
        Duration::from_secs(10),
        || {
            node.attachment_view("vm3")
                .is_some_and(|v| ips_of(&v, "given") == [v1_ip4.clone()])
        },
    );
    assert!(node.agent_log().contains("claim released"));
}

#[test]
fn generated_mac_is_stable_and_locally_administered() {
    let mut node = Node::new("a");
    let vm = node.add_vm("vm1", "52:54:00:cc:00:01", &[], None);
    node.write_config(
        "c.yaml",
        &yaml::docs(&[
            network("blue", 100, BLUE),
            attachment("vm1", "blue", &vm.port, "  macPolicy: Generate\n"),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    let view = node.attachment_view("vm1").unwrap();
    assert_eq!(view["mac_origin"], "generated");
    let mac = view["mac"].as_str().unwrap().to_string();
    let first = u8::from_str_radix(&mac[..2], 16).unwrap();
    assert!(
        first & 0x02 != 0 && first & 0x01 == 0,
        "{mac} is not locally administered unicast"
    );
    node.kill_agent();
    node.start_agent();
    node.wait_ports(&[&vm.port]);
    assert_eq!(node.attachment_view("vm1").unwrap()["mac"], mac.as_str());
}

#[test]
fn ips_a_vm_uses_on_an_ipamless_network_are_learned_and_exposed() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:dd:00:01", &["10.30.0.77/16"], None);
    let vm2 = node.add_vm("vm2", "52:54:00:dd:00:02", &["10.30.0.78/16"], None);
    let red =
        "  subnets: [10.30.0.0/16]\n  defaultGatewayIPs: [10.30.0.1]\n  ipam: {mode: Disabled}\n";
    node.write_config(
        "c.yaml",
        &yaml::docs(&[
            network("red", 200, red),
            attachment("vm1", "red", &vm1.port, "  mac: \"52:54:00:dd:00:01\"\n"),
            attachment("vm2", "red", &vm2.port, "  mac: \"52:54:00:dd:00:02\"\n"),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    // Imported VMs keep what they had: nothing is assigned...
    assert!(ips_of(&node.attachment_view("vm1").unwrap(), "claimed").is_empty());
    // ...and what they use is seen.
    assert!(vm1.ping("10.30.0.78"));
    wait_for("learned IPs", Duration::from_secs(5), || {
        node.attachment_view("vm1")
            .is_some_and(|v| ips_of(&v, "learned") == ["10.30.0.77"])
            && node
                .attachment_view("vm2")
                .is_some_and(|v| ips_of(&v, "learned") == ["10.30.0.78"])
    });
}

/// The `vmpath status` text for the node.
fn status_text(node: &Node) -> String {
    let out = std::process::Command::new(vmpath_tests::vmpath_bin())
        .arg("status")
        .arg("--api-socket")
        .arg(node.api_socket())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn reserved_addresses_are_refused_on_ipam_networks_and_warned_about_elsewhere() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:ee:00:01", &["10.76.0.11/16"], None);
    let vm2 = node.add_vm("vm2", "52:54:00:ee:00:02", &["10.76.0.12/16"], None);
    let vm9 = node.add_vm("vm9", "52:54:00:ee:00:09", &["10.88.255.255/16"], None);
    let ipam = "  subnets: [10.76.0.0/16, \"fd76::/64\"]\n  defaultGatewayIPs: [10.76.0.1, \"fd76::1\"]\n  ipam: {mode: Enabled}\n";
    let imported = "  subnets: [10.88.0.0/16]\n  ipam: {mode: Disabled}\n";
    let good = yaml::docs(&[
        network("red", 76, ipam),
        network("old", 88, imported),
        attachment(
            "vm1",
            "red",
            &vm1.port,
            "  mac: \"52:54:00:ee:00:01\"\n  ips: [10.76.0.11/16]\n",
        ),
        attachment(
            "vm2",
            "red",
            &vm2.port,
            "  mac: \"52:54:00:ee:00:02\"\n  ips: [10.76.0.12/16]\n",
        ),
        // An imported VM really configured with its subnet's broadcast address.
        attachment(
            "vm9",
            "old",
            &vm9.port,
            "  mac: \"52:54:00:ee:00:09\"\n  ips: [10.88.255.255/16]\n",
        ),
    ]);
    node.write_config("c.yaml", &good);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port, &vm9.port]);
    assert!(vm1.ping("10.76.0.12"));

    // A careless import: broadcast, network and subnet-router anycast
    // addresses requested on the IPAM network.
    let bad = [
        (
            "vm3",
            "10.76.255.255/16",
            "broadcast address of 10.76.0.0/16",
        ),
        ("vm4", "10.76.0.0/16", "network address of 10.76.0.0/16"),
        (
            "vm5",
            "\"fd76::/64\"",
            "subnet-router anycast address of fd76::/64",
        ),
    ];
    let mut all = vec![good];
    for (i, (vm, ip, _)) in bad.iter().enumerate() {
        all.push(attachment(
            vm,
            "red",
            &format!("vpx{i}"),
            &format!("  mac: \"52:54:00:ee:01:0{i}\"\n  ips: [{ip}]\n"),
        ));
    }
    node.write_config("c.yaml", &all.join("---\n"));
    wait_for("the three refusals", Duration::from_secs(10), || {
        node.status()
            .is_some_and(|s| s["config_errors"].as_array().is_some_and(|e| e.len() == 3))
    });
    let status = node.status().unwrap();
    for (vm, _, why) in bad {
        let e = status["config_errors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["document"] == format!("Attachment prod/{vm}-eth0"))
            .unwrap_or_else(|| panic!("{vm} not refused: {status}"));
        assert_eq!(e["field"], "spec.ips[0]", "{e}");
        assert!(e["message"].as_str().unwrap().contains(why), "{e}");
        assert!(node.attachment_view(vm).is_none(), "{vm} accepted");
    }
    // Nothing was claimed for them, and the running VMs are undisturbed.
    assert!(!node.agent_log().contains("prod/vm3/eth0"));
    assert!(vm1.ping("10.76.0.12"));
    assert!(vm2.ping("10.76.0.11"));
    // The imported VM is accepted with a warning `vmpath status` shows.
    let text = status_text(&node);
    assert!(
        text.contains("config warnings: 1")
            && text.contains("Attachment prod/vm9-eth0: field spec.ips[0]: 10.88.255.255 is the broadcast address of 10.88.0.0/16"),
        "{text}"
    );
    assert_eq!(
        ips_of(&node.attachment_view("vm9").unwrap(), "given"),
        ["10.88.255.255/16"]
    );
}

#[test]
fn on_an_ipamless_network_the_running_port_keeps_its_address_and_mac_across_restart() {
    let mut node = Node::new("a");
    let vm1 = node.add_vm("vm1", "52:54:00:65:00:50", &["10.65.0.50/16"], None);
    let vm2 = node.add_vm("vm2", "52:54:00:65:00:60", &["10.65.0.60/16"], None);
    let plain =
        "  subnets: [10.65.0.0/16]\n  defaultGatewayIPs: [10.65.0.1]\n  ipam: {mode: Disabled}\n";
    node.write_config(
        "c.yaml",
        &yaml::docs(&[
            network("plain", 65, plain),
            attachment(
                "vm1",
                "plain",
                &vm1.port,
                "  mac: \"52:54:00:65:00:50\"\n  ips: [10.65.0.50/16]\n",
            ),
            attachment(
                "vm2",
                "plain",
                &vm2.port,
                "  mac: \"52:54:00:65:00:60\"\n  ips: [10.65.0.60/16]\n",
            ),
        ]),
    );
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm2.ping("10.65.0.50"));
    // Later: vm3 asks for vm1's address, vm4 for its MAC (no claim holds
    // either: the network has no IPAM, the MAC is given).
    let newcomers = yaml::docs(&[
        attachment(
            "vm3",
            "plain",
            "vpx3",
            "  mac: \"52:54:00:65:00:53\"\n  ips: [10.65.0.50/16]\n",
        ),
        attachment(
            "vm4",
            "plain",
            "vpx4",
            "  mac: \"52:54:00:65:00:50\"\n  ips: [10.65.0.54/16]\n",
        ),
    ]);
    node.write_config("z.yaml", &newcomers);
    let refusal = |node: &Node, vm: &str| {
        node.status().and_then(|s| {
            s["config_errors"]
                .as_array()?
                .iter()
                .find(|e| e["document"] == format!("Attachment prod/{vm}-eth0"))
                .map(|e| {
                    format!(
                        "{}: {}",
                        e["field"].as_str().unwrap(),
                        e["message"].as_str().unwrap()
                    )
                })
        })
    };
    wait_for("vm3 and vm4 refused", Duration::from_secs(10), || {
        refusal(&node, "vm3").is_some() && refusal(&node, "vm4").is_some()
    });

    // The newcomers' file renamed to sort first; the agent restarted.
    node.kill_agent();
    node.remove_config("z.yaml");
    node.write_config("0.yaml", &newcomers);
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    let says = |node: &Node| {
        (
            refusal(node, "vm1"),
            refusal(node, "vm3"),
            refusal(node, "vm4"),
        )
    };
    let expected = (
        None,
        Some("spec.ips: IP 10.65.0.50 is already held by VM interface prod/vm1/eth0 on network \"plain\"".to_string()),
        Some("spec.mac: MAC 52:54:00:65:00:50 is already held by VM interface prod/vm1/eth0 on network \"plain\"".to_string()),
    );
    assert_eq!(says(&node), expected, "{}", node.status().unwrap());
    assert!(vm2.ping("10.65.0.50"), "vm2 -> vm1 after restart");
    assert!(vm1.ping("10.65.0.60"), "vm1 -> vm2 after restart");
    // A re-read (the file written again) changes nothing.
    let reads = |node: &Node| node.agent_log().matches("config read").count();
    let before = reads(&node);
    node.write_config("0.yaml", &format!("# again\n{newcomers}"));
    wait_for("the config read again", Duration::from_secs(10), || {
        reads(&node) > before
    });
    assert_eq!(says(&node), expected);
    assert!(vm2.ping("10.65.0.50"), "vm2 -> vm1 after a re-read");
}
