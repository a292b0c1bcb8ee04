//! Per-CPU counters: every drop is counted under its reason and its port.

use crate::maps::{DROPS, PORT_STATS};

#[inline(always)]
pub fn count_drop(ifindex: u32, reason: u32) {
    if let Some(slot) = DROPS.get_ptr_mut(reason) {
        // Per-CPU slot: no other writer.
        unsafe { *slot += 1 };
    }
    if let Some(stats) = PORT_STATS.get_ptr_mut(ifindex) {
        unsafe { (*stats).drops += 1 };
    }
}

#[inline(always)]
pub fn count_rx(ifindex: u32, bytes: u32) {
    if let Some(stats) = PORT_STATS.get_ptr_mut(ifindex) {
        unsafe {
            (*stats).rx_packets += 1;
            (*stats).rx_bytes += u64::from(bytes);
        }
    }
}

#[inline(always)]
pub fn count_tx(ifindex: u32, bytes: u32) {
    if let Some(stats) = PORT_STATS.get_ptr_mut(ifindex) {
        unsafe {
            (*stats).tx_packets += 1;
            (*stats).tx_bytes += u64::from(bytes);
        }
    }
}

#[inline(always)]
pub fn count_gw_reply(ifindex: u32) {
    if let Some(stats) = PORT_STATS.get_ptr_mut(ifindex) {
        unsafe { (*stats).gw_replies += 1 };
    }
}
