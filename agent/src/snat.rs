//! The agent's share of SNAT: reserve the node's SNAT port range so the
//! host's own sockets never take a port the data path hands out, and sweep
//! expired flows out of the two flow tables, recounting each VM's ports
//! (its quota) from what remains, and idle flows opened from outside out
//! of `vmp_inbound`.

use std::{collections::BTreeMap, fs, io};

use tracing::{debug, warn};

use crate::{clock::monotonic_ns, dataplane::Maps};

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

/// Expires idle flows and rewrites the per-VM port counts; returns the
/// number of live flows.
pub fn sweep(maps: &mut Maps) -> usize {
    let Ok(cfg) = maps.snat_config.get(&0, 0) else {
        return 0;
    };
    let now = monotonic_ns();
    let mut live: BTreeMap<u32, u32> = BTreeMap::new();
    let mut expired = Vec::new();
    let mut total = 0usize;
    for (k, out) in maps.snat_out.iter().filter_map(|r| r.ok()) {
        let rkey = k.reply_to(&out);
        let back = maps.snat_in.get(&rkey, 0).ok();
        // The flow's last packet either way.
        let last = back.map_or(out.last_seen, |b| b.last_seen.max(out.last_seen));
        let state = back.map_or(out.state, |b| b.state.max(out.state));
        if now.saturating_sub(last) > cfg.timeout_ns(k.proto, state) {
            expired.push((k, rkey));
        } else {
            *live.entry(u32::from_ne_bytes(k.src)).or_default() += 1;
            total += 1;
        }
    }
    for (k, rkey) in &expired {
        let _ = maps.snat_out.remove(k);
        if maps
            .snat_in
            .get(rkey, 0)
            .is_ok_and(|b| b.addr == k.src && b.port == k.sport)
        {
            let _ = maps.snat_in.remove(rkey);
        }
    }
    if !expired.is_empty() {
        debug!(expired = expired.len(), live = total, "SNAT flows swept");
    }
    let stale: Vec<u32> = maps
        .snat_quota
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| !live.contains_key(k))
        .collect();
    for k in stale {
        let _ = maps.snat_quota.remove(&k);
    }
    for (vm, n) in live {
        if let Err(e) = maps.snat_quota.insert(vm, n, 0) {
            warn!("writing the SNAT quota: {e}");
        }
    }
    // Flows opened from outside (routed ingress on SNAT networks), by the
    // same timeouts.
    let idle: Vec<_> = maps
        .inbound
        .iter()
        .filter_map(|r| r.ok())
        .filter(|(k, f)| now.saturating_sub(f.last_seen) > cfg.timeout_ns(k.proto, f.state))
        .map(|(k, _)| k)
        .collect();
    for k in &idle {
        let _ = maps.inbound.remove(k);
    }
    total
}
