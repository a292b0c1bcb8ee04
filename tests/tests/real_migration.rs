//! A real live migration, Kubernetes-driven and dual-stack: a QEMU guest
//! (bridge binding, IPv4 by DHCP, IPv6 by DHCPv6 and vmpath's RA) runs on
//! node a from its VMI, virt-launcher pod and NAD in the API server;
//! KubeVirt's target pod on node b is made by vmpath-cni as Multus calls it
//! (the VM's MAC, a fresh namespace with IPv6 on); the guest keeps
//! answering on a until QEMU moves it, then moves with its TCP connections (IPv4 and IPv6) while the
//! peer on node c pings it every millisecond in both families; on b it
//! renews both leases with b's agent and keeps its addresses. Scenario in
//! `vmpath_tests::qemu::migration`.

use std::time::Duration;

use vmpath_tests::{
    kubevirt,
    migration::table100,
    qemu::{
        Guest, again_if_a_guest_kernel_crashes,
        migration::{GATEWAY, GATEWAY6, RealBed, VM1_IP, VM1_IP6, migrate},
    },
    wait_for,
};

#[test]
fn a_kubevirt_migration_of_a_real_dual_stack_guest_moves_it_only_when_it_resumes() {
    again_if_a_guest_kernel_crashes(
        a_kubevirt_migration_of_a_real_dual_stack_guest_moves_it_only_when_it_resumes_once,
    );
}

/// The IPv6 routes vmpath advertises per VM on a node (table 100).
fn table100_v6(ns: &vmpath_tests::Netns) -> String {
    let out = ns.run_status(&["ip", "-6", "route", "show", "table", "100", "proto", "250"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn a_kubevirt_migration_of_a_real_dual_stack_guest_moves_it_only_when_it_resumes_once() {
    let mut bed = RealBed::boot();
    let m = migrate(&mut bed);
    println!(
        "real migration {} -> {} ({:?}, stop-and-copy: {}): QEMU downtime {:.0} ms, guest paused (STOP to \
         RESUME) {:.0} ms, total {:.0} ms; longest gap in the 1 ms pings IPv4 {:.1} ms, IPv6 {:.1} ms \
         (IPv4 beyond the downtime {:.1} ms, beyond the pause {:.1} ms), first reply after RESUME \
         IPv4 {:.1} ms, IPv6 {:.1} ms (RESUME -> RARP {:.1} ms, RARP -> first ping on the target pod \
         {:.1} ms, ping -> guest reply {:.1} ms); answered IPv4 {} of {}, IPv6 {} of {}; TCP echoes \
         IPv4 {} ({} after), IPv6 {} ({} after); before the move, with the target pod up: {:?} of \
         15 pings answered (IPv4, IPv6), vm show on the target: {:?}",
        m.from,
        m.to,
        bed.vm1.accel,
        m.stop_and_copy,
        m.downtime_ms,
        m.pause_ms,
        m.total_ms,
        m.gap_ms,
        m.ipv6.gap_ms,
        m.added_ms(),
        m.added_to_pause_ms(),
        m.resume_to_reply_ms,
        m.ipv6.resume_to_reply_ms,
        m.resume_to_rarp_ms,
        m.rarp_to_request_ms,
        m.request_to_reply_ms,
        m.answered,
        m.sent,
        m.ipv6.answered,
        m.ipv6.sent,
        m.echoes,
        m.echoes_after,
        m.tcp6.echoes,
        m.tcp6.echoes_after,
        m.window_replies,
        m.window_show,
    );
    // Until QEMU moved the guest, a served it: the peer's pings in both
    // families all answered, and b showed no cut-over.
    assert_eq!(m.window_replies, (15, 15), "{m:?}");
    assert_eq!(m.window_show.0, "a", "b took the VM before it moved: {m:?}");
    assert!(m.window_show.1.starts_with("pending"), "{m:?}");
    // QEMU announced the guest on the target; nothing else did.
    assert!(m.rarp_seen, "no RARP from the guest on the target pod");
    // One TCP connection in each family, made while the target pod was
    // up, alive before and after.
    assert_eq!(m.tcp_error, None, "the IPv4 TCP connection broke: {m:?}");
    assert_eq!(m.tcp6.error, None, "the IPv6 TCP connection broke: {m:?}");
    assert!(m.echoes > 0 && m.echoes_after > 0, "{m:?}");
    assert!(m.tcp6.echoes > 0 && m.tcp6.echoes_after > 0, "{m:?}");
    // The guest's gateway entries are the ones it had.
    assert_eq!(m.gw_after, m.gw_before, "{m:?}");
    assert_eq!(m.gw6_after, m.gw6_before, "{m:?}");
    // Both streams came back after the guest resumed, at the guest's
    // RARP (the data path's cut-over; KubeVirt's word came 2 s later): the
    // longest silence in each is the guest's pause plus at most a second.
    // (What a stream of 1 ms pings loses besides, a TCG guest answering
    // two of them on a busy machine, is printed, not judged.)
    for (family, resume_to_reply_ms, gap_ms) in [
        ("IPv4", m.resume_to_reply_ms, m.gap_ms),
        ("IPv6", m.ipv6.resume_to_reply_ms, m.ipv6.gap_ms),
    ] {
        assert!(
            resume_to_reply_ms.is_finite(),
            "no {family} reply after the guest resumed: {m:?}"
        );
        assert!(
            gap_ms <= m.pause_ms + 1000.0,
            "{family} silent {gap_ms:.0} ms for a pause of {:.0} ms: {m:?}",
            m.pause_ms
        );
    }
    // The guest renews its leases with b's agent and keeps its addresses:
    // DHCPv4 (udhcpc renews at SIGUSR1) and DHCPv6 (dhclient restarted
    // from its lease: a CONFIRM, as RFC 8415 has a client that may have
    // moved to another link do).
    let lease = bed.vm1.wait_lease();
    let renewed = bed.vm1.renew_dhcp4(&lease);
    assert_eq!(
        (renewed.get("ip"), renewed.get("serverid")),
        (lease.get("ip"), lease.get("serverid")),
        "the renewed lease: {renewed:?}, before the move: {lease:?}"
    );
    assert_eq!(renewed.get("ip").map(String::as_str), Some(VM1_IP));
    bed.vm1.stop_dhcp6();
    bed.vm1.start_dhcp6();
    let lease6 = bed.vm1.wait_lease6();
    assert_eq!(
        lease6.get("ip6").map(String::as_str),
        Some(VM1_IP6),
        "the guest's DHCPv6 lease after the move: {lease6:?}"
    );
    let dhcp = dhcp_counters(&bed.nodes[1]);
    assert!(
        dhcp["replied"]["dhcp4_request"].as_u64() >= Some(1),
        "b's agent answered no DHCPv4 REQUEST of the guest: {dhcp}"
    );
    let replied6: u64 = dhcp["replied"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(kind, _)| kind.starts_with("dhcp6_"))
        .filter_map(|(_, n)| n.as_u64())
        .sum();
    assert!(
        replied6 >= 1,
        "b's agent answered no DHCPv6 message of the guest: {dhcp}"
    );
    println!(
        "leases after the move: DHCPv4 {renewed:?}; DHCPv6 {lease6:?}; b's slow path for the guest: {dhcp}"
    );

    // The guest is on b, where its /32 and /128 moved, and says so.
    for dst in [VM1_IP, VM1_IP6] {
        assert!(bed.peer.ping(dst, 3), "peer -> guest on b at {dst}");
    }
    assert!(bed.vm1.ping(GATEWAY), "guest on b -> gateway");
    assert_eq!(
        bed.vm1
            .run_status(&format!("ping6 -c 3 -i 0.2 -W 2 {GATEWAY6}"))
            .0,
        0,
        "guest on b -> IPv6 gateway"
    );
    wait_for("the routes moved to b", Duration::from_secs(20), || {
        let (a, b) = (&bed.nodes[0].ns, &bed.nodes[1].ns);
        table100(b).contains(VM1_IP)
            && !table100(a).contains(VM1_IP)
            && table100_v6(b).contains(VM1_IP6)
            && !table100_v6(a).contains(VM1_IP6)
    });
    let show = kubevirt::vm_show(&bed.nodes[1], "prod/vm1");
    for want in ["node:       b", "local", VM1_IP, VM1_IP6] {
        assert!(show.contains(want), "no {want:?} in:\n{show}");
    }
}

/// The DHCP counters of the guest's interface on `node`'s agent (`vmpath
/// vm show -o json`): received, replied and dropped, by message kind.
fn dhcp_counters(node: &vmpath_tests::Node) -> serde_json::Value {
    let show = vmpath_tests::run(&[
        vmpath_tests::vmpath_bin().to_str().unwrap(),
        "vm",
        "show",
        "prod/vm1",
        "-o",
        "json",
        "--api-socket",
        node.api_socket().to_str().unwrap(),
    ]);
    let detail: serde_json::Value = serde_json::from_str(&show).expect("vm show JSON");
    detail["interfaces"][0]["dhcp"].clone()
}
