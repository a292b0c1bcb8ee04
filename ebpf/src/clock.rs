//! The clock of flow state: the `last_seen` of SNAT, inbound, policy,
//! Service and learned-endpoint entries. Their timeouts are seconds or
//! more and their refresh interval 100 ms, so a tick's precision
//! (CLOCK_MONOTONIC_COARSE) is plenty; the precise clock reads the
//! hypervisor's clock source on every call, which on a VM costs more than
//! a map lookup. Both count from boot like the agent's CLOCK_MONOTONIC,
//! which runs at most a tick ahead of this one.
//! Token buckets (`meter`) and event timestamps keep the precise clock.

use aya_ebpf::helpers::generated::bpf_ktime_get_coarse_ns;

/// Now, for flow state (nanoseconds since boot, to a tick).
#[inline(always)]
pub fn flow_now() -> u64 {
    // SAFETY: a helper call without arguments; it touches no memory of ours.
    unsafe { bpf_ktime_get_coarse_ns() }
}
