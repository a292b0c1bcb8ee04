//! Debug events through aya-log: off unless `vmp_debug` says otherwise, so
//! a quiet data path pays one array lookup per event site. The agent reads
//! the ring buffer and logs each event under `vmpath::datapath`.

use aya_log_ebpf::info;
use vmpath_common::debug_events;

use crate::maps::DEBUG;

#[inline(always)]
fn on(class: u32) -> bool {
    DEBUG.get(0).is_some_and(|bits| *bits & class != 0)
}

/// A dropped frame: the reason (a `drop_reason`) and the port id
/// (`NO_PORT_ID` when the frame had no port).
#[inline(always)]
pub fn drop_event(port_id: u32, reason: u32) {
    if on(debug_events::DROPS) {
        // aya-log's macros take a context they do not use.
        info!(&(), "drop reason={} port_id={}", reason, port_id);
    }
}

/// A migration target port took over its VM (the VM's first frame there).
#[inline(always)]
pub fn cut_over(ifindex: u32) {
    if on(debug_events::DECISIONS) {
        info!(&(), "migration cut-over ifindex={}", ifindex);
    }
}

/// The MAC a VM sends from, learned on a port whose MAC was not given.
#[inline(always)]
pub fn mac_learned(ifindex: u32, mac: &[u8; 6]) {
    if on(debug_events::DECISIONS) {
        info!(&(), "mac learned ifindex={} mac={:mac}", ifindex, *mac);
    }
}
