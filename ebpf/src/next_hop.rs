//! Next hops kept for north-south egress. `bpf_fib_lookup` (a FIB walk
//! and a neighbour lookup) was the largest single cost of a forwarded
//! frame. What it gave is kept for `HOP_KEEP_NS`: for SNAT in the flow's
//! outbound entry (`NatEntry::hop`), for routed frames in `vmp_hops4` /
//! `vmp_hops6` under the lookup's inputs (`HopKey4`, `HopKey6`). Frames in
//! between leave by the kept hop without a lookup, so a route or neighbour
//! change reaches traffic already flowing within `HOP_KEEP_NS`; anything
//! new looks up at once.

use aya_ebpf::{
    bindings::{BPF_NOEXIST, bpf_fib_lookup as FibParams},
    btf_maps::LruHashMap,
    macros::btf_map,
};
use vmpath_common::{HopKey4, HopKey6, KeptHop, L2Hop, maps};

/// Both tables' size (the contract gives them one).
const HOPS_MAX: usize = maps::HOPS4.max_entries as usize;
const _: () = assert!(maps::HOPS6.max_entries as usize == HOPS_MAX);

/// Routed IPv4 frames' FIB inputs -> the next hop the FIB gave.
#[btf_map(name = "vmp_hops4")]
static HOPS4: LruHashMap<HopKey4, KeptHop, HOPS_MAX> = LruHashMap::new();

/// `vmp_hops4`'s IPv6 twin.
#[btf_map(name = "vmp_hops6")]
static HOPS6: LruHashMap<HopKey6, KeptHop, HOPS_MAX> = LruHashMap::new();

/// How long a kept next hop is used before the FIB is asked again.
pub const HOP_KEEP_NS: u64 = 100_000_000;
/// `hop_stamp` units (2^20 ns, about a millisecond) in `HOP_KEEP_NS`.
const HOP_KEEP_UNITS: u32 = (HOP_KEEP_NS >> 20) as u32;

/// Where the forwarding takes a frame's next hop from: a kept one
/// (`kept()`), or `bpf_fib_lookup`, whose result `keep` stores where this
/// says (or nowhere). A plain struct, every field always set (an enum's
/// unused payload lets LLVM store an unset register, which the verifier
/// refuses), and small: `vm_egress`'s stack is nearly full.
#[derive(Clone, Copy)]
pub struct NextHop {
    /// The kept hop in its map entry; null: none.
    hop: *mut L2Hop,
    /// When it was looked up, in the same entry.
    checked: *mut u32,
    /// Now, as `checked` holds it.
    stamp: u32,
    /// `hop` is fresh: leave by it. Otherwise a lookup renews it.
    fresh: bool,
}

impl NextHop {
    /// `bpf_fib_lookup` for this frame alone.
    pub const LOOKUP: NextHop = NextHop {
        hop: core::ptr::null_mut(),
        checked: core::ptr::null_mut(),
        stamp: 0,
        fresh: false,
    };

    /// The kept hop to leave by, when there is a fresh one.
    #[inline(always)]
    pub fn kept(&self) -> Option<L2Hop> {
        if self.fresh && !self.hop.is_null() {
            // SAFETY: `hop` points into a map entry from `get_ptr_mut`,
            // valid until the program returns; a plain copy.
            Some(unsafe { *self.hop })
        } else {
            None
        }
    }
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
    let fresh = unsafe { (*hop).ifindex != 0 && stamp.wrapping_sub(*checked) <= HOP_KEEP_UNITS };
    NextHop {
        hop,
        checked,
        stamp,
        fresh,
    }
}

/// The next hop of a routed IPv4 frame with FIB inputs `key`.
#[inline(always)]
pub fn routed4(key: &HopKey4, now: u64) -> NextHop {
    routed(&HOPS4, key, now)
}

/// The next hop of a routed IPv6 frame with FIB inputs `key`.
#[inline(always)]
pub fn routed6(key: &HopKey6, now: u64) -> NextHop {
    routed(&HOPS6, key, now)
}

/// The next hop kept in `hops` under `key`. The first frame of a key
/// makes its entry (no hop yet), which the lookup then fills.
#[inline(always)]
fn routed<K>(hops: &LruHashMap<K, KeptHop, HOPS_MAX>, key: &K, now: u64) -> NextHop {
    if let Some(k) = hops.get_ptr_mut(key) {
        // SAFETY: field addresses inside the entry just looked up; no access.
        return unsafe { of_flow(&raw mut (*k).hop, &raw mut (*k).checked, now) };
    }
    // A full table evicts its least recently used hop; should the insert
    // fail all the same, the frame is looked up alone.
    let _ = hops.insert(key, &KeptHop::default(), u64::from(BPF_NOEXIST));
    match hops.get_ptr_mut(key) {
        // SAFETY: as above.
        Some(k) => unsafe { of_flow(&raw mut (*k).hop, &raw mut (*k).checked, now) },
        None => NextHop::LOOKUP,
    }
}

/// Keeps a successful lookup's result (`p`) where `next` says, when it may
/// be kept: a kept hop skips the FIB's check of the frame against the out
/// interface's MTU, so only a hop whose interface takes the network's MTU
/// (every frame is held to that first, `mtu::too_big`) is kept.
#[inline(always)]
pub fn keep(next: &NextHop, p: &FibParams, net_mtu: u16) {
    if next.fresh || next.hop.is_null() || next.checked.is_null() {
        return;
    }
    // SAFETY: `bpf_fib_lookup` returned success, which fills
    // `mtu_result` (the out interface's MTU; a plain u16 either way).
    let out_mtu = unsafe { p.__bindgen_anon_1.mtu_result };
    if net_mtu == 0 || out_mtu < net_mtu {
        return;
    }
    // SAFETY: `hop` and `checked` point into a map entry from
    // `get_ptr_mut`, valid until the program returns; plain stores.
    unsafe {
        *next.hop = L2Hop {
            ifindex: p.ifindex,
            dst_mac: p.dmac,
            src_mac: p.smac,
        };
        *next.checked = next.stamp;
    }
}
