//! The imported-VM story end to end, north-south: two nodes and a BIRD
//! top-of-rack router on one underlay, an external host behind the ToR,
//! an IPAM-less network with spoof filtering off, `egress: SNAT` and
//! `advertise: {subnet: true, learned: true}` (the bed is
//! `vmpath_tests::north_south`). An imported VM with its old MAC, IP and
//! gateway (nothing assigned by vmpath) reaches the outside NAT'd to its
//! node's address, is reached from outside by its own address through the
//! ToR (its replies never SNATed), from whichever node the fabric picks
//! (the other relays over the overlay), and keeps both across a live
//! migration, during which fabric traffic still arriving at the old node
//! is relayed to the new one until BGP converges. A second VM whose
//! address vmpath only learned is reached the same way.
//!
//! Needs root. Run with:
//!   cargo xtask test -- north_south_imported

use std::time::Duration;

use serde_json::Value;
use vmpath_tests::{
    Netns, iperf3,
    north_south::{
        CVM_IP, EXT_IP, GATEWAY, IMP_IP, LRN_IP, NODE_A, NODE_B, NODE_C, STREAM_COUNT, bed,
        external_loss_window, overlay_tx, start_migration, tor_route,
    },
    wait_for,
};

/// As the east-west migration test: the data path itself takes a few
/// milliseconds, the rest is the test's own commands and scheduling on a
/// shared 2-core machine. Without the relay the window would be the BGP
/// convergence (seconds).
const MAX_LOSS_WINDOW_MS: f64 = 500.0;

/// The peer address an iperf3 TCP server in `server` saw for a 1 s run
/// from `client` to `server_ip`, and the client's report.
fn tcp_peer_seen(server: &Netns, client: &Netns, server_ip: &str) -> (String, Value) {
    let port = "5399";
    let srv = server.spawn(&["iperf3", "-s", "-1", "-J", "-p", port]);
    wait_for("iperf3 server to listen", Duration::from_secs(10), || {
        let ss = server.run_status(&["ss", "-Hltn", &format!("sport = :{port}")]);
        !String::from_utf8_lossy(&ss.stdout).trim().is_empty()
    });
    let out = client.run_status(&["iperf3", "-c", server_ip, "-p", port, "-t", "1", "-J"]);
    let client_json: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 client to {server_ip} printed no JSON ({e})"));
    assert!(
        client_json.get("error").is_none(),
        "iperf3 client to {server_ip}: {}",
        client_json["error"]
    );
    let out = srv.wait_with_output().unwrap();
    let server_json: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("iperf3 server printed no JSON ({e})"));
    let peer = server_json["start"]["connected"][0]["remote_host"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (peer, client_json)
}

/// What `ns` sees as the source of an ICMP echo request arriving on
/// `ifname` while `ping` runs.
fn echo_source_seen(ns: &Netns, ifname: &str, ping: impl FnOnce() -> bool) -> String {
    let dump = ns.spawn(&[
        "timeout",
        "10",
        "tcpdump",
        "-n",
        "-l",
        "-c",
        "1",
        "-i",
        ifname,
        "icmp[icmptype] = 8",
    ]);
    std::thread::sleep(Duration::from_millis(700));
    assert!(ping(), "ping failed");
    let out = dump.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn imported_vm_nat_out_routed_in_from_any_node_and_across_a_migration() {
    let bed = bed(2);

    // Out: NAT'd to the hosting node's address (ICMP and TCP).
    let seen = echo_source_seen(&bed.ext, "ext0", || bed.imp.ping(EXT_IP));
    assert!(
        seen.contains(&format!("{NODE_A} > {EXT_IP}")),
        "the external host did not see node a's address: {seen}"
    );
    let (peer, _) = tcp_peer_seen(&bed.ext, &bed.imp.ns, EXT_IP);
    assert_eq!(peer, NODE_A, "TCP from the imported VM leaves NAT'd");

    // In: by the VM's own address, which the VM sees un-NATed; TCP works
    // both ways, so the VM's replies were not SNATed.
    let seen = echo_source_seen(&bed.imp.ns, "eth0", || bed.ext.ping(IMP_IP, 3));
    assert!(
        seen.contains(&format!("{EXT_IP} > {IMP_IP}")),
        "the VM did not see the external host's own address: {seen}"
    );
    let (peer, json) = tcp_peer_seen(&bed.imp.ns, &bed.ext, IMP_IP);
    assert_eq!(peer, EXT_IP, "the VM's server saw {peer}");
    let bps = json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    assert!(bps > 1e7, "TCP external -> imported VM only {bps} bit/s");
    // UDP in (iperf3 at 200 Mbit/s): the datagrams reach the VM by its own
    // address. Loss at the receivers depends on the machine's load, so
    // only what arrived is judged.
    let udp = iperf3(&bed.imp.ns, &bed.ext, IMP_IP, true, 1);
    let sum = &udp["end"]["sum"];
    let got = sum["packets"].as_f64().unwrap_or(0.0) - sum["lost_packets"].as_f64().unwrap_or(0.0);
    assert!(
        got > 1000.0,
        "UDP external -> imported VM: only {got} datagrams arrived"
    );

    // A VM whose address vmpath only learned: its node advertises the /32,
    // it goes out NAT'd as that node, and comes in by its own address.
    let seen = echo_source_seen(&bed.ext, "ext0", || bed.lrn.ping(EXT_IP));
    assert!(
        seen.contains(&format!("{NODE_B} > {EXT_IP}")),
        "the learned-address VM did not leave as node b: {seen}"
    );
    let (peer, _) = tcp_peer_seen(&bed.lrn.ns, &bed.ext, LRN_IP);
    assert_eq!(peer, EXT_IP, "the learned-address VM's server saw {peer}");

    // The fabric picks the other node (a more specific route on the ToR
    // than BGP's): node b relays to node a over the overlay.
    bed.tor
        .run(&["ip", "route", "add", IMP_IP, "via", NODE_B, "metric", "1"]);
    let relayed = overlay_tx(&bed.b);
    let seen = echo_source_seen(&bed.imp.ns, "eth0", || bed.ext.ping(IMP_IP, 3));
    assert!(
        seen.contains(&format!("{EXT_IP} > {IMP_IP}")),
        "relayed ingress did not reach the VM un-NATed: {seen}"
    );
    let (peer, _) = tcp_peer_seen(&bed.imp.ns, &bed.ext, IMP_IP);
    assert_eq!(peer, EXT_IP, "relayed TCP: the VM's server saw {peer}");
    assert!(
        overlay_tx(&bed.b) >= relayed + 3,
        "node b sent nothing over the overlay: the relay was not used"
    );
    bed.tor
        .run(&["ip", "route", "del", IMP_IP, "via", NODE_B, "metric", "1"]);

    // Live migration a -> b while the external host streams to the VM.
    start_migration(&bed);
    assert!(bed.ext.ping(IMP_IP, 2), "external -> VM while pending");
    let w = external_loss_window(&bed);
    eprintln!(
        "north-south migration loss window: {:.1} ms ({:.1} ms of it the test's own cut-over commands; receivers silent {:.1} ms), {} of {STREAM_COUNT} datagrams lost, {} on the target ({} before the ToR's route moved, {:.0} ms after the cut-over), {} frames relayed by the source",
        w.gap_ms,
        w.commands_ms,
        w.rx_silence_ms,
        w.lost,
        w.on_target,
        w.on_target_before_converged,
        w.converged_ms,
        w.relayed
    );
    assert!(w.on_target > 1000, "the target got only {}", w.on_target);
    // The ToR moves its route only after the source's agent withdrew it
    // and the target's announced it: what it sent to the source meanwhile
    // reached the VM on the target through the source's relay.
    assert!(
        w.relayed > 0 && w.on_target_before_converged > 0,
        "fabric traffic still arriving at the source after the cut-over was not relayed ({} frames relayed, {} received on the target before the ToR converged)",
        w.relayed,
        w.on_target_before_converged
    );
    // What vmpath adds to the migration's pause (the test's commands).
    assert!(
        w.beyond_commands_ms() < MAX_LOSS_WINDOW_MS,
        "external loss window {:.1} ms beyond {:.1} ms of cut-over commands",
        w.gap_ms,
        w.commands_ms
    );

    // After: the per-VM route moved; the VM keeps both directions, NAT'd
    // now as node b.
    wait_for(
        "the ToR route to the VM via node b",
        Duration::from_secs(30),
        || tor_route(&bed, IMP_IP).contains(&format!("via {NODE_B}")),
    );
    let seen = echo_source_seen(&bed.ext, "ext0", || bed.imp_t.ping(EXT_IP));
    assert!(
        seen.contains(&format!("{NODE_B} > {EXT_IP}")),
        "after the migration the VM did not leave as node b: {seen}"
    );
    let (peer, _) = tcp_peer_seen(&bed.imp_t.ns, &bed.ext, IMP_IP);
    assert_eq!(
        peer, EXT_IP,
        "after the migration the VM's server saw {peer}"
    );
    assert!(bed.imp_t.ping(GATEWAY), "the gateway on b");
}

/// Three nodes: the fabric sends the imported VM's traffic to node c,
/// which hosts the network but not the VM, all along (a route on the ToR
/// more specific than BGP's). Node c relays to node a, then, once the
/// VM's announcement from node b reached it over the overlay, to node b:
/// the external stream follows the VM through the migration without the
/// fabric moving at all.
#[test]
fn three_nodes_ingress_through_a_third_node_follows_the_vm_across_a_migration() {
    let bed = bed(3);
    let (c, _) = bed.c.as_ref().expect("three nodes");
    // Node c's own VM is reached directly, by its own address.
    assert!(bed.ext.ping(CVM_IP, 2), "external -> node c's VM");
    bed.tor
        .run(&["ip", "route", "add", IMP_IP, "via", NODE_C, "metric", "1"]);
    let relayed = overlay_tx(c);
    let seen = echo_source_seen(&bed.imp.ns, "eth0", || bed.ext.ping(IMP_IP, 3));
    assert!(
        seen.contains(&format!("{EXT_IP} > {IMP_IP}")),
        "ingress through node c did not reach the VM on a un-NATed: {seen}"
    );
    let (peer, _) = tcp_peer_seen(&bed.imp.ns, &bed.ext, IMP_IP);
    assert_eq!(peer, EXT_IP, "through node c: the VM's server saw {peer}");
    assert!(overlay_tx(c) >= relayed + 3, "node c relayed nothing");

    start_migration(&bed);
    let relayed = overlay_tx(c);
    let w = external_loss_window(&bed);
    let relayed = overlay_tx(c) - relayed;
    eprintln!(
        "three nodes, ingress through node c: loss window {:.1} ms over the whole stream ({:.1} ms of it the test's own cut-over commands; receivers silent {:.1} ms), {} of {STREAM_COUNT} lost, {} on the target, {relayed} frames relayed by node c",
        w.gap_to_end_ms, w.commands_ms, w.rx_silence_ms, w.lost, w.on_target
    );
    assert!(w.on_target > 1000, "the target got only {}", w.on_target);
    assert!(
        relayed >= STREAM_COUNT - w.lost,
        "node c relayed {relayed} frames: the stream did not go through it"
    );
    assert!(
        w.to_end_beyond_commands_ms() < MAX_LOSS_WINDOW_MS,
        "loss window through node c {:.1} ms beyond {:.1} ms of cut-over commands",
        w.gap_to_end_ms,
        w.commands_ms
    );
    // After the migration the VM still answers through node c, NAT'd out
    // as node b.
    let (peer, _) = tcp_peer_seen(&bed.imp_t.ns, &bed.ext, IMP_IP);
    assert_eq!(
        peer, EXT_IP,
        "after the migration the VM's server saw {peer}"
    );
    let seen = echo_source_seen(&bed.ext, "ext0", || bed.imp_t.ping(EXT_IP));
    assert!(
        seen.contains(&format!("{NODE_B} > {EXT_IP}")),
        "after the migration the VM did not leave as node b: {seen}"
    );
}
