//! Live migration over the overlay, dual-stack: vm1 moves from node a to
//! node b while a client on node c streams UDP to its IPv4 and IPv6
//! addresses. The migration is simulated as KubeVirt runs one: a second VM
//! namespace with the same MAC and IPs on node b (the target pod),
//! `migration: {targetNode: b, ready: false}` in every node's config, then
//! the cut-over: the source stops, the target resumes and announces itself
//! (here only with an unsolicited neighbour advertisement; the bench's
//! runs with GARP and RARP, the real guest with QEMU's RARP), and later the
//! config says `ready: true`. The loss window is measured at the receivers,
//! per family. The bed and the cut-over are `vmpath_tests::migration`,
//! which `cargo xtask bench` runs too (its loss-window figure).

use std::time::Duration;

use vmpath_tests::{
    Netns, UnderlayFamily,
    migration::{
        Announce, GATEWAY, GATEWAY6, INTERVAL_MS, NET_ID, STREAM_COUNT, UDP_PORT, VM1_IP, VM1_IP6,
        VM1_MAC, loss_window, port_flags, receiver, start_migration, table100, table100_v6,
        three_nodes, three_nodes_over, vm1_endpoint, vtep_on, write_config,
    },
    vmpath::common,
    wait_for,
};

/// Under this on a shared 2-core machine; the data path alone takes a few
/// milliseconds, the rest is the test's own `ip` commands and scheduling.
const MAX_LOSS_WINDOW_MS: f64 = 500.0;

/// The target's first frame from the VM is an unsolicited neighbour
/// advertisement (no GARP, no RARP): it cuts over both families, the
/// pod's own IPv6 chatter as its link comes up (DAD from ::, MLD, router
/// solicitations) does not.
#[test]
fn live_migration_keeps_ip_mac_and_gateway_with_a_short_loss_window() {
    live_migration_over(UnderlayFamily::V4);
}

/// The same migration between nodes whose underlay is IPv6: the relay,
/// the data path's cut-over (a VM's first frame from the target's IPv6
/// VTEP) and the repointed endpoints work on handles of IPv6 addresses.
#[test]
fn live_migration_over_an_ipv6_underlay() {
    live_migration_over(UnderlayFamily::V6);
}

fn live_migration_over(family: UnderlayFamily) {
    let bed = three_nodes_over(family);
    start_migration(&bed);
    // Pending: traffic still reaches the source.
    for dst in [VM1_IP, VM1_IP6] {
        assert!(
            bed.client.ping(dst),
            "client -> vm1 on a at {dst} while pending"
        );
    }
    let w = loss_window(&bed, Announce::UnsolicitedNa);
    eprintln!(
        "migration: source down -> target up took {:.1} ms (test commands)",
        w.commands_ms
    );
    for (family, s) in [("IPv4", &w.ipv4), ("IPv6", &w.ipv6)] {
        eprintln!(
            "migration {family}: loss window {:.1} ms (seq {} -> {} lost; receivers silent {:.1} ms), {} of {STREAM_COUNT} datagrams lost ({INTERVAL_MS} ms apart), {} received on the target; last on the source -> first on the target {:.1} ms; first datagram on the target {:.1} ms after its link came up; longest gap after ready: {:.1} ms",
            s.gap_ms,
            s.gap_seqs.0,
            s.gap_seqs.1,
            s.rx_silence_ms,
            s.lost,
            s.on_target,
            s.switch_ms,
            s.first_on_target_ms,
            s.ready_gap_ms
        );
    }
    for (family, s) in [("IPv4", &w.ipv4), ("IPv6", &w.ipv6)] {
        assert!(
            s.on_target > 1000,
            "{family}: the target received only {} datagrams",
            s.on_target
        );
        // What vmpath adds to the migration's pause (the test's own
        // cut-over commands, which a loaded machine stretches).
        assert!(
            s.gap_ms - w.commands_ms < MAX_LOSS_WINDOW_MS,
            "{family}: loss window {:.1} ms (seq {} -> {} lost) beyond {:.1} ms of cut-over commands",
            s.gap_ms,
            s.gap_seqs.0,
            s.gap_seqs.1,
            w.commands_ms
        );
        assert!(
            s.ready_gap_ms < MAX_LOSS_WINDOW_MS,
            "{family}: the ready signal cost {:.1} ms",
            s.ready_gap_ms
        );
    }
    // The agent logs the data path's cut-over on its next pass.
    bed.b
        .wait_log("the VM spoke on the target port", Duration::from_secs(10));

    // The VM kept its identity: `vmpath vm show` on b.
    wait_for("b serves vm1 as active", Duration::from_secs(10), || {
        port_flags(&bed.b, &bed.vm1t.port).is_some_and(|f| f & common::PORT_F_PENDING == 0)
            && port_flags(&bed.a, &bed.vm1.port).is_none()
    });
    let show = vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        "prod/vm1",
        "--api-socket",
        bed.b.api_socket().to_str().unwrap(),
    ]);
    for want in [VM1_MAC, VM1_IP, VM1_IP6, "cut-over"] {
        assert!(show.contains(want), "no {want:?} in:\n{show}");
    }

    // The gateway answers on b with the MAC the guest already had, in
    // both families.
    for (gw, lladdr) in [(GATEWAY, &w.gw_lladdr), (GATEWAY6, &w.gw6_lladdr)] {
        assert!(bed.vm1t.ping(gw), "vm1 (b) -> gateway {gw}");
        let neigh = bed.vm1t.ns.run(&["ip", "neigh", "show", gw, "dev", "eth0"]);
        assert!(
            neigh.contains(lladdr.as_str()),
            "gateway {gw}'s MAC changed: {neigh} vs {lladdr}"
        );
    }
    for dst in [VM1_IP, VM1_IP6] {
        assert!(bed.client.ping(dst), "client -> vm1 on b at {dst}");
    }

    // The /32 and the /128 moved: b advertises them, a withdrew them.
    wait_for("the routes moved to b", Duration::from_secs(10), || {
        table100(&bed.b.ns).contains(VM1_IP)
            && !table100(&bed.a.ns).contains(VM1_IP)
            && table100_v6(&bed.b.ns).contains(VM1_IP6)
            && !table100_v6(&bed.a.ns).contains(VM1_IP6)
    });
    // c points at b directly; nothing needs relaying any more.
    let ep = vm1_endpoint(&bed.c).unwrap();
    assert_eq!(
        (ep.kind, ep.node_ip4),
        (common::ENDPOINT_REMOTE, vtep_on(&bed, &bed.c, 2))
    );
}

#[test]
fn a_failed_migration_moves_nothing() {
    let bed = three_nodes();
    start_migration(&bed);
    // The migration is abandoned before the cut-over.
    write_config(&bed, None);
    wait_for("b drops the pending port", Duration::from_secs(10), || {
        port_flags(&bed.b, &bed.vm1t.port).is_none()
    });
    assert!(
        bed.client.ping(VM1_IP),
        "client -> vm1 on a after the failed migration"
    );
    assert!(port_flags(&bed.a, &bed.vm1.port).is_some());
    assert!(table100(&bed.a.ns).contains(VM1_IP));
    assert!(!table100(&bed.b.ns).contains(VM1_IP));
    // The client's node still points at a.
    let ep = vm1_endpoint(&bed.c).unwrap();
    assert_eq!(
        (ep.kind, ep.node_ip4, ep.migrate_to),
        (common::ENDPOINT_REMOTE, [192, 0, 2, 1], [0; 4])
    );
}

/// `count` UDP datagrams from `ns` to vm1, 2 ms apart (one way: vm1 sends
/// nothing back that would teach c where it is now).
fn send_udp(ns: &Netns, count: u32) {
    ns.run(&[
        "python3",
        "-c",
        &format!(
            "import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range({count}):
    s.sendto(b'relay', ('{VM1_IP}', {UDP_PORT}))
    time.sleep(0.002)
"
        ),
    ]);
}

/// Node a relays what still arrives for the VM after it moved: frames
/// from a node that still points at a go on to b, once (the relay TTL
/// marks them), and a relayed frame is never relayed again.
#[test]
fn the_source_relays_to_the_target_after_cut_over() {
    source_relays_over(UnderlayFamily::V4);
}

/// The relay and its loop guard over an IPv6 underlay (the hop limit of
/// the outer IPv6 header carries the relay mark).
#[test]
fn the_source_relays_to_the_target_after_cut_over_an_ipv6_underlay() {
    source_relays_over(UnderlayFamily::V6);
}

fn source_relays_over(family: UnderlayFamily) {
    let bed = three_nodes_over(family);
    // The client knows vm1's MAC for good (no ARP probes whose answers
    // would teach c the new place), and the target says nothing but its
    // GARP (no IPv6 chatter).
    bed.client.ns.run(&[
        "ip",
        "neigh",
        "replace",
        VM1_IP,
        "lladdr",
        VM1_MAC,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ]);
    bed.vm1t
        .ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=1"]);
    start_migration(&bed);
    bed.vm1.ns.run(&["ip", "link", "set", "eth0", "down"]);
    bed.vm1t.ns.run(&["ip", "link", "set", "eth0", "up"]);
    bed.vm1t.ns.scapy(&format!(
        "sendp(Ether(src='{VM1_MAC}', dst='ff:ff:ff:ff:ff:ff')/ARP(op=1, hwsrc='{VM1_MAC}', psrc='{VM1_IP}', pdst='{VM1_IP}'), iface='eth0')"
    ));
    // Every agent finishes what the data path did (a and c learned the move
    // from the GARP), so none rewrites the entries set by hand below.
    for node in [&bed.a, &bed.c] {
        wait_for(
            &format!("node {} finishes the cut-over", node.name),
            Duration::from_secs(10),
            || {
                node.agent_log()
                    .contains("the data path saw the VM on the target")
            },
        );
    }
    wait_for("a drops the source port", Duration::from_secs(10), || {
        port_flags(&bed.a, &bed.vm1.port).is_none()
    });
    // Point c back at a by hand, as a node that has not heard yet would.
    // (c's agent may put back its pending entry: also at a.)
    let key = common::EndpointKey {
        network: NET_ID,
        mac: [0x52, 0x54, 0, 0, 1, 1],
        _pad: [0; 2],
    };
    let at = |node_ip4| common::Endpoint {
        kind: common::ENDPOINT_REMOTE,
        ifindex: 0,
        node_ip4,
        migrate_to: [0; 4],
        port_id: 0,
        identity: 0,
    };
    let a_on_c = vtep_on(&bed, &bed.c, 1);
    bed.c.maps().endpoints.insert(key, at(a_on_c), 0).unwrap();
    // A listener on the target, so no port-unreachable goes back to c.
    let out = std::env::temp_dir().join(format!("vmpath-relay-{}", bed.a.tag));
    let rx = receiver(&bed.vm1t.ns, &out, 3);
    std::thread::sleep(Duration::from_millis(500));
    let sent_before = bed.a.maps().overlay_stats().unwrap().tx_packets;
    send_udp(&bed.client.ns, 20);
    let relayed = bed.a.maps().overlay_stats().unwrap().tx_packets - sent_before;
    assert!(relayed >= 20, "a sent {relayed} of 20 frames on");
    assert_eq!(vm1_endpoint(&bed.c).map(|e| e.node_ip4), Some(a_on_c));

    // Loop guard: with b wrongly pointing vm1 at c, a's relay arrives at b
    // marked (outer TTL) and b drops it instead of sending it round again.
    let before = bed.b.drops(common::drop_reason::OVERLAY_NOT_RELAYED);
    let c_on_b = vtep_on(&bed, &bed.b, 3);
    bed.b.maps().endpoints.insert(key, at(c_on_b), 0).unwrap();
    send_udp(&bed.client.ns, 20);
    let refused = bed.b.drops(common::drop_reason::OVERLAY_NOT_RELAYED) - before;
    assert!(
        refused >= 20,
        "b refused only {refused} of 20 relayed frames"
    );
    rx.wait_with_output().unwrap();
    let delivered = std::fs::read_to_string(&out)
        .unwrap_or_default()
        .lines()
        .count();
    let _ = std::fs::remove_file(&out);
    assert_eq!(
        delivered, 20,
        "the target got {delivered} of the relayed datagrams"
    );
}
