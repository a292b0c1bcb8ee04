//! Per-port token buckets for the slow path: DHCPv4, DHCPv6 and router
//! solicitations a port may hand to the agent, so one flooding VM cannot
//! starve the others' DHCP and RAs nor burn the agent's CPU.
//!
//! The buckets are per CPU (`vmp_slow_meter` is a per-CPU array): each
//! CPU meters the frames it sees with plain loads and stores, no lock and
//! no shared cache line bouncing under a flood. The price is that a port
//! whose frames arrive on N CPUs at once can pass up to N times its rate;
//! that stays bounded (N is the node's CPU count) and a real client,
//! whose few frames all fit one bucket, never notices. A shared bucket
//! would need a spin lock per frame or would lose updates under races,
//! which bounds it no better.
//!
//! Credit is kept in nanoseconds (`MeterLimit`): refill is the time since
//! the last frame, so the data path needs no division.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use vmpath_common::{MeterBucket, MeterLimit, drop_reason, slow_class};

use crate::maps::{SLOW_LIMITS, SLOW_METER};

/// Spends one frame of `class` credit of `port_id`'s bucket, or refuses
/// with `SLOWPATH_RATE_LIMITED` (counted in the bucket too).
#[inline(always)]
pub fn admit(port_id: u32, class: usize) -> Result<(), u32> {
    if class >= slow_class::COUNT {
        return Ok(());
    }
    let Some(limits) = SLOW_LIMITS.get(port_id) else {
        return Ok(());
    };
    let limit = limits.class[class];
    if limit.cost_ns == 0 {
        return Ok(());
    }
    let Some(meter) = SLOW_METER.get_ptr_mut(port_id) else {
        return Ok(());
    };
    // Per-CPU slot: no other writer.
    // SAFETY: `meter` is from `get_ptr_mut` on a per-CPU array, valid for this run;
    // this CPU's slot has no other writer; `class` is index-checked.
    let bucket = unsafe { &mut (*meter).class[class] };
    if spend(bucket, &limit) {
        Ok(())
    } else {
        Err(drop_reason::SLOWPATH_RATE_LIMITED)
    }
}

/// Takes one frame's credit from `bucket` (refilled since its last use),
/// or counts the frame in `limited` and returns false.
#[inline(always)]
pub fn spend(bucket: &mut MeterBucket, limit: &MeterLimit) -> bool {
    // SAFETY: a helper call without arguments; it touches no memory of ours.
    let now = unsafe { bpf_ktime_get_ns() };
    // A last_ns in the future (a preloaded bucket) refills nothing.
    let elapsed = now.saturating_sub(bucket.last_ns);
    let credit = bucket.credit_ns.saturating_add(elapsed);
    let credit = if credit > limit.cap_ns {
        limit.cap_ns
    } else {
        credit
    };
    bucket.last_ns = if now > bucket.last_ns {
        now
    } else {
        bucket.last_ns
    };
    if credit >= limit.cost_ns {
        bucket.credit_ns = credit - limit.cost_ns;
        true
    } else {
        bucket.credit_ns = credit;
        bucket.limited += 1;
        false
    }
}
