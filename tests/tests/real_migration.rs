//! A real live migration: a QEMU guest moves from a virt-launcher pod on
//! node a to one on node b over the overlay (target `-incoming`, QMP
//! `migrate`, QEMU's own RARP self-announce, no test-sent GARP) while a
//! client on node c pings it every millisecond and holds a TCP connection
//! to it. Scenario in `vmpath_tests::qemu::migration`.

use vmpath_tests::{
    migration::{GATEWAY, VM1_IP, table100},
    qemu::{
        Guest, again_if_a_guest_kernel_crashes,
        migration::{RealBed, migrate},
    },
    wait_for,
};

#[test]
fn a_real_guest_migrates_with_its_tcp_connection_and_gateway_entry() {
    again_if_a_guest_kernel_crashes(
        a_real_guest_migrates_with_its_tcp_connection_and_gateway_entry_once,
    );
}

fn a_real_guest_migrates_with_its_tcp_connection_and_gateway_entry_once() {
    let mut bed = RealBed::boot();
    let m = migrate(&mut bed);
    println!(
        "real migration {} -> {} ({:?}, stop-and-copy: {}): QEMU downtime {:.0} ms, guest paused (STOP to \
         RESUME) {:.0} ms, total {:.0} ms; longest gap in the 1 ms pings {:.1} ms (beyond the \
         downtime {:.1} ms, beyond the pause {:.1} ms), first reply {:.1} ms after RESUME (RESUME -> \
         RARP {:.1} ms, RARP -> first ping on the target pod {:.1} ms, ping -> guest reply {:.1} \
         ms); {} of {} answered; {} TCP echoes, {} after the migration",
        m.from,
        m.to,
        bed.vm1.accel,
        m.stop_and_copy,
        m.downtime_ms,
        m.pause_ms,
        m.total_ms,
        m.gap_ms,
        m.added_ms(),
        m.added_to_pause_ms(),
        m.resume_to_reply_ms,
        m.resume_to_rarp_ms,
        m.rarp_to_request_ms,
        m.request_to_reply_ms,
        m.answered,
        m.sent,
        m.echoes,
        m.echoes_after
    );
    // QEMU announced the guest on the target; nothing else did.
    assert!(m.rarp_seen, "no RARP from the guest on the target pod");
    // One TCP connection, alive before and after.
    assert_eq!(m.tcp_error, None, "the TCP connection broke: {m:?}");
    assert!(m.echoes > 0 && m.echoes_after > 0, "{m:?}");
    // The guest's gateway entry is the one it had.
    assert_eq!(m.gw_after, m.gw_before, "{m:?}");
    // The stream came back after the guest resumed, and what it lost is
    // the guest's pause plus at most a second (one ping a millisecond);
    // the guest is reachable on b, where the /32 moved.
    assert!(
        m.resume_to_reply_ms.is_finite(),
        "no reply after the guest resumed: {m:?}"
    );
    let lost_ms = (m.sent - m.answered) as f64;
    assert!(
        lost_ms <= m.pause_ms + 1000.0,
        "lost {lost_ms} pings for a pause of {:.0} ms: {m:?}",
        m.pause_ms
    );
    assert!(bed.client.ping(VM1_IP), "client -> guest on b");
    assert!(bed.vm1.ping(GATEWAY), "guest on b -> gateway");
    wait_for(
        "the route moved to b",
        std::time::Duration::from_secs(20),
        || {
            table100(&bed.nodes[1].ns).contains(VM1_IP)
                && !table100(&bed.nodes[0].ns).contains(VM1_IP)
        },
    );
}
