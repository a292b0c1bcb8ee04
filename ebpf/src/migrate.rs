//! Live migration in the data path.
//!
//! Target side: a port that is the target of a pending migration carries
//! `PORT_F_PENDING`. `vm_port` hands such a port's frames to `vm_migrate`
//! (a tail call: the VM-port program's stack is nearly full). The first
//! frame from the VM's own MAC means the VM resumed here: `vm_migrate`
//! points the VM's endpoint at this port, records an event for the agent
//! (which finishes the cut-over: routes, plan), clears the flag and
//! re-enters `vm_port`, which handles the frame as on any active port.
//! Nothing waits for an agent round, so traffic is back as soon as the VM
//! speaks (its GARP or QEMU's RARP, or any frame).
//!
//! Not every frame from that MAC is the VM: the target pod's interface
//! carries the VM's MAC from its CNI ADD on, and a pod kernel with IPv6 on
//! speaks from it at once (DAD from ::, MLD reports, router solicitations)
//! while the VM still runs on the source. `resumes` tells them apart; the
//! pod's own frames are dropped as `migration_not_resumed` and move nothing.
//!
//! Other nodes: see `learn_move`, called from `vxlan_rx`.

use aya_ebpf::{btf_maps::HashMap, macros::btf_map, programs::TcContext};
use vmpath_common::{ENDPOINT_REMOTE, EndpointKey, MigrationEvent, drop_reason, maps, tail_call};

use crate::{
    maps::ENDPOINTS,
    verdict::{PROGS, Verdict},
};

/// Target port ifindex -> the VM's first frame there (written once).
#[btf_map(name = "vmp_migrated")]
pub static MIGRATED: HashMap<u32, MigrationEvent, { maps::MIGRATED.max_entries as usize }> =
    HashMap::new();

/// From `vm_port`, for a pending target port, before anything is counted
/// (the frame is counted once, when `vm_port` runs again).
#[inline(always)]
pub fn to_vm_migrate(ctx: &TcContext) -> Verdict {
    // SAFETY: `ctx` is this program's own context; on success the tail call does
    // not return, otherwise execution falls through to the error below.
    unsafe { PROGS.tail_call(ctx, tail_call::VM_MIGRATE) };
    // Only reached when the slot is empty (agent still starting).
    Err(drop_reason::HELPER_FAILED)
}

/// From `vxlan_rx`: a frame from `src` arrived from the node `from`. If the
/// agent marked that MAC as migrating to `from`, the VM now speaks from
/// there (its GARP/RARP, flooded by the target node, reaches every node):
/// point the endpoint at `from` now rather than at the agent's next round.
/// Fields are written so a concurrent reader sees the old or the new
/// place, never a mix: the address first, the kind last.
///
/// Returns whether `vmp_endpoints` holds `src` at all (a local port or a
/// configured remote VM): only MACs it does not hold are learned from the
/// overlay (`overlay::learn_source`), so a remote frame never takes a
/// local VM's MAC and config always wins.
#[inline(always)]
pub fn learn_move(network: u32, src: [u8; 6], from: [u8; 4]) -> bool {
    let key = EndpointKey::new(network, src);
    let Some(ep) = ENDPOINTS.get_ptr_mut(&key) else {
        return false;
    };
    // SAFETY: `ep` is from `get_ptr_mut` (bpf_map_lookup_elem), valid until the
    // program returns; the fields are plain integers, each written whole.
    // The order in the doc comment is kept by volatile stores with a
    // compiler fence before the kind: the compiler may not reorder them,
    // and the JITs emit the stores in program order (x86's stores are
    // seen in that order by other CPUs).
    unsafe {
        let to = (*ep).migrate_to;
        if to == [0; 4] || to != from {
            return true;
        }
        core::ptr::write_volatile(&raw mut (*ep).node_ip4, from);
        core::ptr::write_volatile(&raw mut (*ep).migrate_to, [0; 4]);
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::Release);
        core::ptr::write_volatile(&raw mut (*ep).kind, ENDPOINT_REMOTE);
    }
    true
}
