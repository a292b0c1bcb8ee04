//! Next hops kept per SNAT flow. `bpf_fib_lookup` (a FIB walk and a
//! neighbour lookup) was the largest single cost of a translated frame;
//! the outbound flow entry keeps what it gave (`NatEntry::hop`) for
//! `HOP_KEEP_NS`, and the flow's frames in between leave by that hop
//! without a lookup. A route or neighbour change therefore reaches an
//! established flow within `HOP_KEEP_NS`; a new flow looks up at once.

use aya_ebpf::bindings::bpf_fib_lookup as FibParams;
use vmpath_common::L2Hop;

/// How long a kept next hop is used before the FIB is asked again.
pub const HOP_KEEP_NS: u64 = 100_000_000;
/// `hop_stamp` units (2^20 ns, about a millisecond) in `HOP_KEEP_NS`.
const HOP_KEEP_UNITS: u32 = (HOP_KEEP_NS >> 20) as u32;

/// Where the forwarding takes a frame's next hop from.
#[derive(Clone, Copy)]
pub enum NextHop {
    /// `bpf_fib_lookup` for this frame alone.
    Lookup,
    /// `bpf_fib_lookup`, its result kept in a flow's entry (`keep`).
    LookupAndKeep {
        hop: *mut L2Hop,
        checked: *mut u32,
        stamp: u32,
    },
    /// A flow's kept result, younger than `HOP_KEEP_NS`.
    Kept(L2Hop),
}

/// The coarse clock (ns) as `NatEntry::hop_checked` holds it: 2^20 ns
/// units, wrapping after about 52 days (far past any flow's idle timeout,
/// and a wrap costs at most one lookup too few within `HOP_KEEP_NS`).
#[inline(always)]
pub fn hop_stamp(now: u64) -> u32 {
    (now >> 20) as u32
}

/// The next hop of a flow whose entry keeps one at `hop`, looked up at
/// `checked`: the kept one while it is fresh, else a lookup that renews it.
#[inline(always)]
pub fn of_flow(hop: *mut L2Hop, checked: *mut u32, now: u64) -> NextHop {
    let stamp = hop_stamp(now);
    // SAFETY: both point into a flow entry from `get_ptr_mut`
    // (bpf_map_lookup_elem), valid until the program returns; plain
    // integer reads. Another CPU may be renewing the same hop: it writes
    // what the FIB gave it, the same hop but for a route change racing it.
    unsafe {
        if (*hop).ifindex != 0 && stamp.wrapping_sub(*checked) <= HOP_KEEP_UNITS {
            NextHop::Kept(*hop)
        } else {
            NextHop::LookupAndKeep {
                hop,
                checked,
                stamp,
            }
        }
    }
}

/// Keeps a successful lookup's result (`p`) where `next` says, when it may
/// be kept: a kept hop skips the FIB's check of the frame against the out
/// interface's MTU, so only a hop whose interface takes the network's MTU
/// (every frame is held to that first, `mtu::too_big`) is kept.
#[inline(always)]
pub fn keep(next: NextHop, p: &FibParams, net_mtu: u16) {
    let NextHop::LookupAndKeep {
        hop,
        checked,
        stamp,
    } = next
    else {
        return;
    };
    // SAFETY: `bpf_fib_lookup` returned success, which fills
    // `mtu_result` (the out interface's MTU; a plain u16 either way).
    let out_mtu = unsafe { p.__bindgen_anon_1.mtu_result };
    if net_mtu == 0 || out_mtu < net_mtu {
        return;
    }
    // SAFETY: `hop` and `checked` point into a flow entry from
    // `get_ptr_mut`, valid until the program returns; plain stores.
    unsafe {
        *hop = L2Hop {
            ifindex: p.ifindex,
            dst_mac: p.dmac,
            src_mac: p.smac,
        };
        *checked = stamp;
    }
}
