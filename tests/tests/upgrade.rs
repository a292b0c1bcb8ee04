//! An upgrade that changes the map layout: pins of another layout version,
//! or a pinned map of the wrong shape, are replaced while traffic flows,
//! and nothing the config defines is lost.

use std::time::Duration;

use vmpath_tests::{Node, run, wait_for};

#[test]
fn a_new_map_layout_is_adopted_without_losing_entries_or_packets() {
    let (mut node, vm1, vm2) = Node::with_two_vms("a", "52:54:00:e0:00");
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm1.ping("10.20.0.12"));
    node.kill_agent();

    // What an older agent would have left: its maps under another layout
    // version, and one map of a shape this build does not use.
    let maps = node.bpffs.join("maps");
    let current = format!("v{}", vmpath_common::MAP_LAYOUT_VERSION);
    std::fs::rename(maps.join(&current), maps.join("v0")).unwrap();
    std::fs::create_dir(maps.join(&current)).unwrap();
    let drops = maps.join(&current).join("vmp_drops");
    run(&[
        "bpftool",
        "map",
        "create",
        drops.to_str().unwrap(),
        "type",
        "percpu_array",
        "key",
        "4",
        "value",
        "8",
        "entries",
        "3",
        "name",
        "vmp_drops",
    ]);

    // Forwarding continues on the old maps while the agent is down and
    // while the new one takes over.
    let pinger = vm1
        .ns
        .spawn(&["ping", "-i", "0.01", "-w", "4", "-W", "1", "10.20.0.12"]);
    std::thread::sleep(Duration::from_millis(500));
    node.start_agent();
    wait_for(
        "the old layout to be retired",
        Duration::from_secs(10),
        || !maps.join("v0").exists(),
    );
    node.wait_ports(&[&vm1.port, &vm2.port]);
    let out = pinger.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(" 0% packet loss"),
        "packets lost during the upgrade:\n{report}"
    );

    // The new maps hold every entry the config defines, with this build's shape.
    let dump = run(&[
        "bpftool",
        "map",
        "dump",
        "pinned",
        maps.join(&current).join("vmp_ports").to_str().unwrap(),
    ]);
    assert_eq!(dump.matches("\"port_id\"").count(), 2, "{dump}");
    let info = run(&["bpftool", "map", "show", "pinned", drops.to_str().unwrap()]);
    let entries = format!(
        "max_entries {}",
        vmpath_tests::vmpath::common::drop_reason::COUNT
    );
    assert!(info.contains(&entries), "vmp_drops not replaced: {info}");
    assert!(
        node.agent_log().contains("replacing it"),
        "{}",
        node.agent_log()
    );
    assert!(vm2.ping("10.20.0.11"));
}

/// What an agent before the ports' tc filters left on a node: each port's
/// programs in tcx links pinned under `links/` (`vm_port-IFINDEX`), no
/// filter. Made here from the running programs themselves: each filter's
/// program is attached by tcx in the node's namespace and its link pinned
/// where that agent pinned it, then the filter is removed.
fn leave_tcx_links_as_an_older_agent(node: &Node, ports: &[&str]) {
    use aya::programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::FdLink,
        tc::{SchedClassifierLink, TcAttachOptions},
    };
    use std::os::fd::AsRawFd as _;
    let programs = node.port_programs();
    // Beside the node's bpffs root (program pins must be on a bpffs).
    let work = std::path::PathBuf::from(format!("{}-old-programs", node.bpffs.display()));
    let _ = std::fs::create_dir_all(&work);
    let ns_path = node.ns.path();
    let bpffs = node.bpffs.clone();
    let ports: Vec<String> = ports.iter().map(|p| p.to_string()).collect();
    let ifindexes: Vec<u32> = ports.iter().map(|p| node.ns.ifindex(p)).collect();
    let dir = work.clone();
    std::thread::spawn(move || {
        let work = dir;
        let ns = std::fs::File::open(&ns_path).unwrap();
        // SAFETY: setns on an fd we own; it moves only this thread.
        assert_eq!(
            unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) },
            0,
            "setns {ns_path}"
        );
        for (port, ifindex) in ports.iter().zip(&ifindexes) {
            for (name, at, hook) in [
                ("vm_from_stack", TcAttachType::Egress, "egress"),
                ("vm_port", TcAttachType::Ingress, "ingress"),
            ] {
                let id = programs
                    .iter()
                    .find(|(p, _)| *p == format!("{name}-{ifindex}"))
                    .unwrap_or_else(|| panic!("{name} not on {port}: {programs:?}"))
                    .1;
                let prog_pin = work.join(format!("{name}-{ifindex}"));
                let _ = std::fs::remove_file(&prog_pin);
                run(&[
                    "bpftool",
                    "prog",
                    "pin",
                    "id",
                    &id.to_string(),
                    prog_pin.to_str().unwrap(),
                ]);
                let mut prog = SchedClassifier::from_pin(&prog_pin).unwrap();
                let link = prog
                    .attach_with_options(port, at, TcAttachOptions::TcxOrder(LinkOrder::default()))
                    .unwrap();
                let link: SchedClassifierLink = prog.take_link(link).unwrap();
                let link: FdLink = link.try_into().unwrap();
                link.pin(bpffs.join("links").join(format!("{name}-{ifindex}")))
                    .unwrap();
                // The tcx program runs first: the filter can go.
                run(&[
                    "nsenter",
                    &format!("--net={ns_path}"),
                    "tc",
                    "filter",
                    "del",
                    "dev",
                    port,
                    hook,
                    "pref",
                    "1",
                ]);
            }
        }
    })
    .join()
    .unwrap();
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn an_older_agents_tcx_port_links_give_way_to_filters_without_losing_a_packet() {
    let (mut node, vm1, vm2) = Node::with_two_vms("t", "52:54:00:e1:00");
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    assert!(vm1.ping("10.20.0.12"));
    node.kill_agent();
    leave_tcx_links_as_an_older_agent(&node, &[&vm1.port, &vm2.port]);
    assert_eq!(node.port_programs(), vec![], "filters left");
    let pins = |node: &Node| -> Vec<String> {
        node.pinned_links()
            .into_iter()
            .map(|(p, _, _)| p)
            .filter(|p| p.starts_with("vm_"))
            .collect()
    };
    assert_eq!(pins(&node).len(), 4, "{:?}", node.pinned_links());
    // The older agent's links forward on their own.
    assert!(vm1.ping("10.20.0.12"));

    let pinger = vm1
        .ns
        .spawn(&["ping", "-i", "0.01", "-w", "4", "-W", "1", "10.20.0.12"]);
    std::thread::sleep(Duration::from_millis(500));
    node.start_agent();
    node.wait_ports(&[&vm1.port, &vm2.port]);
    wait_for("the older links to go", Duration::from_secs(10), || {
        pins(&node).is_empty()
    });
    let out = pinger.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(" 0% packet loss"),
        "packets lost as the filters took over:\n{report}"
    );
    let ports = node.port_programs();
    let mut want: Vec<String> = [&vm1.port, &vm2.port]
        .iter()
        .flat_map(|p| {
            let i = node.ns.ifindex(p);
            [format!("vm_from_stack-{i}"), format!("vm_port-{i}")]
        })
        .collect();
    want.sort();
    assert_eq!(
        ports.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>(),
        want
    );
    assert!(vm2.ping("10.20.0.11"));
}
