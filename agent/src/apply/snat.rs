//! The agent's share of SNAT: reserve the node's SNAT port range so the
//! host's own sockets never take a port the data path hands out, and sweep
//! expired flows out of the two flow tables, recounting each VM's ports
//! (its quota) from what remains, and idle flows opened from outside out
//! of `vmp_inbound`; IPv4 and IPv6 alike.

use std::{collections::BTreeMap, fs, io};

use aya::maps::{HashMap, MapData};
use tracing::{debug, warn};
use vmpath_common::{InboundFlow, NatEntry, NatEntry6, NatKey, NatKey6, SnatConfig};

use crate::{apply::dataplane::Maps, sys::clock::monotonic_ns};

const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Adds `min-max` to `ip_local_reserved_ports` of this network namespace,
/// keeping whatever is reserved already.
pub fn reserve_ports(min: u16, max: u16) -> io::Result<()> {
    let range = format!("{min}-{max}");
    let current = fs::read_to_string(RESERVED_PORTS)?;
    let current = current.trim();
    if current.split(',').any(|r| r == range) {
        return Ok(());
    }
    let new = if current.is_empty() {
        range
    } else {
        format!("{current},{range}")
    };
    fs::write(RESERVED_PORTS, new)
}

/// One IP family's flow tables, as `sweep` walks them.
trait Family {
    type Key: aya::Pod + Ord;
    type Entry: aya::Pod;
    /// The VM address, as the quota map keys it.
    type Vm: aya::Pod + Ord;
    fn reply_to(k: &Self::Key, out: &Self::Entry) -> Self::Key;
    fn vm(k: &Self::Key) -> Self::Vm;
    /// Does the return entry `back` still lead to the VM side `k`?
    fn leads_to(back: &Self::Entry, k: &Self::Key) -> bool;
    fn last_seen(e: &Self::Entry) -> u64;
    fn state(e: &Self::Entry) -> u8;
    fn proto(k: &Self::Key) -> u8;
}

struct V4;
impl Family for V4 {
    type Key = NatKey;
    type Entry = NatEntry;
    type Vm = u32;
    fn reply_to(k: &NatKey, out: &NatEntry) -> NatKey {
        k.reply_to(out)
    }
    fn vm(k: &NatKey) -> u32 {
        u32::from_ne_bytes(k.src)
    }
    fn leads_to(back: &NatEntry, k: &NatKey) -> bool {
        back.addr == k.src && back.port == k.sport
    }
    fn last_seen(e: &NatEntry) -> u64 {
        e.last_seen
    }
    fn state(e: &NatEntry) -> u8 {
        e.state
    }
    fn proto(k: &NatKey) -> u8 {
        k.proto
    }
}

struct V6;
impl Family for V6 {
    type Key = NatKey6;
    type Entry = NatEntry6;
    type Vm = [u8; 16];
    fn reply_to(k: &NatKey6, out: &NatEntry6) -> NatKey6 {
        k.reply_to(out)
    }
    fn vm(k: &NatKey6) -> [u8; 16] {
        k.src
    }
    fn leads_to(back: &NatEntry6, k: &NatKey6) -> bool {
        back.addr == k.src && back.port == k.sport
    }
    fn last_seen(e: &NatEntry6) -> u64 {
        e.last_seen
    }
    fn state(e: &NatEntry6) -> u8 {
        e.state
    }
    fn proto(k: &NatKey6) -> u8 {
        k.proto
    }
}

/// Expires idle flows and rewrites the per-VM port counts, IPv4 and IPv6;
/// returns the number of live flows.
pub fn sweep(maps: &mut Maps) -> usize {
    let Ok(cfg) = maps.snat_config.get(&0, 0) else {
        return 0;
    };
    let now = monotonic_ns();
    let v4 = sweep_family::<V4>(
        &cfg,
        now,
        &mut maps.snat_out,
        &mut maps.snat_in,
        &mut maps.snat_quota,
        &mut maps.inbound,
    );
    let v6 = sweep_family::<V6>(
        &cfg,
        now,
        &mut maps.snat6_out,
        &mut maps.snat6_in,
        &mut maps.snat6_quota,
        &mut maps.inbound6,
    );
    v4 + v6
}

fn sweep_family<F: Family>(
    cfg: &SnatConfig,
    now: u64,
    out_map: &mut HashMap<MapData, F::Key, F::Entry>,
    in_map: &mut HashMap<MapData, F::Key, F::Entry>,
    quota: &mut HashMap<MapData, F::Vm, u32>,
    inbound: &mut HashMap<MapData, F::Key, InboundFlow>,
) -> usize {
    let mut live: BTreeMap<F::Vm, u32> = BTreeMap::new();
    let mut expired = Vec::new();
    let mut total = 0usize;
    for (k, out) in out_map.iter().filter_map(|r| r.ok()) {
        let rkey = F::reply_to(&k, &out);
        let back = in_map.get(&rkey, 0).ok();
        // The flow's last packet either way.
        let last = back.as_ref().map_or(F::last_seen(&out), |b| {
            F::last_seen(b).max(F::last_seen(&out))
        });
        let state = back
            .as_ref()
            .map_or(F::state(&out), |b| F::state(b).max(F::state(&out)));
        if now.saturating_sub(last) > cfg.timeout_ns(F::proto(&k), state) {
            expired.push((k, rkey));
        } else {
            *live.entry(F::vm(&k)).or_default() += 1;
            total += 1;
        }
    }
    for (k, rkey) in &expired {
        let _ = out_map.remove(k);
        if in_map.get(rkey, 0).is_ok_and(|b| F::leads_to(&b, k)) {
            let _ = in_map.remove(rkey);
        }
    }
    if !expired.is_empty() {
        debug!(expired = expired.len(), live = total, "SNAT flows swept");
    }
    let stale: Vec<F::Vm> = quota
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| !live.contains_key(k))
        .collect();
    for k in stale {
        let _ = quota.remove(&k);
    }
    for (vm, n) in live {
        if let Err(e) = quota.insert(vm, n, 0) {
            warn!("writing the SNAT quota: {e}");
        }
    }
    // Flows opened from outside (routed ingress on SNAT networks), by the
    // same timeouts.
    let idle: Vec<_> = inbound
        .iter()
        .filter_map(|r| r.ok())
        .filter(|(k, f)| now.saturating_sub(f.last_seen) > cfg.timeout_ns(F::proto(k), f.state))
        .map(|(k, _)| k)
        .collect();
    for k in &idle {
        let _ = inbound.remove(k);
    }
    total
}
