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
