//! Per-CPU counters: every drop is counted under its reason and its port.
//! Port counters live in a per-CPU array indexed by the port's id, so
//! counting costs no hash lookup (the verifier inlines array lookups).

use vmpath_common::NO_PORT_ID;

use crate::maps::{DROPS, PORT_STATS};

#[inline(always)]
pub fn count_drop(port_id: u32, reason: u32) {
    crate::debug::drop_event(port_id, reason);
    if let Some(slot) = DROPS.get_ptr_mut(reason) {
        // SAFETY: a pointer into this CPU's slot of a per-CPU array, valid
        // for this run; no other writer (per-CPU, no preemption in BPF).
        unsafe { *slot += 1 };
    }
    if port_id == NO_PORT_ID {
        return;
    }
    if let Some(stats) = PORT_STATS.get_ptr_mut(port_id) {
        // SAFETY: as in `count_drop`: this CPU's slot, no other writer.
        unsafe { (*stats).drops += 1 };
    }
}

/// `n` drops under `reason` at once, no port's (a flood withheld from
/// `n` ports).
#[inline(always)]
pub fn count_drops(reason: u32, n: u32) {
    if let Some(slot) = DROPS.get_ptr_mut(reason) {
        // SAFETY: as in `count_drop`: this CPU's slot, no other writer.
        unsafe { *slot += u64::from(n) };
    }
}

/// A frame of `ctx` dropped at a program's entry: counted as
/// `count_drop`, and reported to `vmpath monitor` when someone listens.
#[inline(always)]
pub fn dropped(ctx: &aya_ebpf::programs::TcContext, ifindex: u32, port_id: u32, reason: u32) {
    count_drop(port_id, reason);
    crate::monitor::drop(ctx, ifindex, port_id, reason);
}

#[inline(always)]
pub fn count_rx(port_id: u32, bytes: u32) {
    if let Some(stats) = PORT_STATS.get_ptr_mut(port_id) {
        // SAFETY: as in `count_drop`: this CPU's slot, no other writer.
        unsafe {
            (*stats).rx_packets += 1;
            (*stats).rx_bytes += u64::from(bytes);
        }
    }
}

#[inline(always)]
pub fn count_tx(port_id: u32, bytes: u32) {
    if let Some(stats) = PORT_STATS.get_ptr_mut(port_id) {
        // SAFETY: as in `count_drop`: this CPU's slot, no other writer.
        unsafe {
            (*stats).tx_packets += 1;
            (*stats).tx_bytes += u64::from(bytes);
        }
    }
}

#[inline(always)]
pub fn count_gw_reply(port_id: u32) {
    if let Some(stats) = PORT_STATS.get_ptr_mut(port_id) {
        // SAFETY: as in `count_drop`: this CPU's slot, no other writer.
        unsafe { (*stats).gw_replies += 1 };
    }
}
