//! vmpath's data path: the programs' entries in `prog/` (one file per hook
//! or program family; a frame's way through a program reads top to bottom
//! there), over the library modules here, which the programs share
//! (parsing, maps, switching, policy, Services, routing, SNAT, the
//! overlay, counters, ...). The library never uses `prog`, and no two
//! modules use each other (`cargo xtask modgraph ebpf/src`; a test of the
//! xtask crate checks).
#![no_std]
#![no_main]
#![allow(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys are passed as `&key`, the way the helpers take them (a pointer); \
              aya-ebpf's `impl Borrow<K>` would take them by value too"
)]

mod arp;
mod clock;
mod counters;
mod csum;
mod debug;
mod frag;
mod fwd;
mod host;
mod icmp;
mod learn;
mod maps;
mod meter;
mod migrate;
mod monitor;
mod mtu;
mod nd;
mod neigh;
mod next_hop;
mod overlay;
mod parse;
mod policy;
mod prog;
mod reach;
mod resolve;
mod route;
mod service;
mod service6;
mod slowpath;
mod snat;
mod spoof;
mod verdict;

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
