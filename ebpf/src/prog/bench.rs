//! Baselines for `cargo xtask bench`: the cheapest programs a tc hook can
//! run, measured beside the data path on the same hook. Their own object
//! (`vmpath-bench`), so the data path's object (`vmpath`, the one the agent
//! loads) does not carry them.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT},
    btf_maps::Array,
    helpers::generated::bpf_redirect_peer,
    macros::{btf_map, classifier},
    programs::TcContext,
};

/// Slot 0: the host-side ifindex `bench_redirect_peer` sends every frame
/// to (into that veth's peer namespace).
#[btf_map(name = "vmpb_peer")]
pub static BENCH_PEER: Array<u32, 1> = Array::new();

/// Does nothing: the fixed cost of running a tc program.
#[classifier]
pub fn bench_noop(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

/// One array lookup and `bpf_redirect_peer`: the least any tc forwarder
/// between VM namespaces can do.
#[classifier]
pub fn bench_redirect_peer(_ctx: TcContext) -> i32 {
    let Some(&target) = BENCH_PEER.get(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: a helper call with plain integer arguments; it touches no
    // memory of ours.
    let rc = unsafe { bpf_redirect_peer(target, 0) };
    if rc == i64::from(TC_ACT_REDIRECT) {
        TC_ACT_REDIRECT
    } else {
        TC_ACT_SHOT
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

// SAFETY: `LICENSE` is the object's only symbol of that name and a plain byte
// array; the loader reads the section, no Rust code links against it.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
