//! Live migration, the agent's half. The data path moves the VM the
//! moment it speaks from the target (`vm_migrate` on the target port,
//! `learn_move` on the other nodes); this module reads what it did and
//! treats the migration as cut over on this node before the config says
//! so (KubeVirt's ready signal may come later), so the plan agrees with
//! the maps: the target advertises the VM's routes and serves it as
//! active, the source drops its port and withdraws. Whichever comes first,
//! the data path's event or `migration.ready`, finishes it. Nothing here
//! acts on a migration the config no longer names (a failed migration
//! moves nothing).

use std::collections::BTreeSet;

use tracing::{info, warn};
use vmpath_common::{ENDPOINT_REMOTE, EndpointKey};

use crate::{
    apply::dataplane::Dataplane, config::format_mac, plan::pending_target_port,
    resolve::resolved::Resolved, sys::clock::since_ms, sys::netif::ifindex_of,
};

#[derive(Default)]
pub struct Migrations {
    /// Target ports whose event was logged, so each is logged once.
    logged: BTreeSet<u32>,
    /// VMs this node saw move in its own endpoint map (logged once).
    moved: BTreeSet<String>,
}

impl Migrations {
    /// Marks as cut over (in this round's resolved `cfg`) every pending migration
    /// the data path has already carried out on this node, and drops
    /// events no pending or just-finished migration owns.
    pub fn tick(&mut self, cfg: &mut Resolved, node: &str, dp: &mut Dataplane) {
        let events: Vec<(u32, vmpath_common::MigrationEvent)> =
            dp.maps().migrated.iter().filter_map(|r| r.ok()).collect();
        let mut owned = BTreeSet::new();
        let nodes = &cfg.config.nodes;
        let vteps6 = dp.pinned_vteps6();
        // Only those whose documents name a migration (`Resolved::moving`:
        // no other entry is looked at).
        for &j in &cfg.moving {
            let att = &mut cfg.attachments[j as usize];
            let Some(m) = att.migration.clone() else {
                continue;
            };
            if m.target_node == node {
                let port = m
                    .target_port
                    .clone()
                    .unwrap_or_else(|| att.port.to_string());
                let Some(ifindex) = ifindex_of(&port) else {
                    continue;
                };
                owned.insert(ifindex);
                if pending_target_port(att, node).is_none() {
                    continue;
                }
                let Some((_, ev)) = events.iter().find(|(i, _)| *i == ifindex) else {
                    continue;
                };
                std::sync::Arc::make_mut(att).cut_over = true;
                if self.logged.insert(ifindex) {
                    info!(
                        vm = %att.key,
                        port,
                        mac = %format_mac(&ev.mac),
                        since_first_frame_ms = since_ms(ev.ktime_ns),
                        "migration: the VM spoke on the target port; cut over here before the ready signal"
                    );
                }
                continue;
            }
            // Any other node: did the VM's first frames from the target
            // move its endpoint here already?
            if att.cut_over || att.node == node && m.target_node == node {
                continue;
            }
            let (Some((mac, _)), Some(net), Some(target)) = (
                att.mac_resolved,
                cfg.config.network(&att.network),
                nodes.get(&m.target_node),
            ) else {
                continue;
            };
            // The target's VTEP value as the data path stores it (on an
            // IPv6 underlay, the handle it knows the node by).
            let target_vtep = match target.address {
                std::net::IpAddr::V4(a) => a.octets(),
                std::net::IpAddr::V6(a) => match vteps6.get(&a) {
                    Some(h) => *h,
                    None => continue,
                },
            };
            let key = EndpointKey::new(net.id, mac);
            let Ok(ep) = dp.maps().endpoints.get(&key, 0) else {
                continue;
            };
            if ep.kind == ENDPOINT_REMOTE && ep.node_ip4 == target_vtep && ep.migrate_to == [0; 4] {
                std::sync::Arc::make_mut(att).cut_over = true;
                if self.moved.insert(att.key.to_string()) {
                    info!(vm = %att.key, target = %m.target_node, "migration: the data path saw the VM on the target; cut over here before the ready signal");
                }
            }
        }
        for (ifindex, _) in &events {
            if !owned.contains(ifindex) {
                if let Err(e) = dp.maps_mut().migrated.remove(ifindex) {
                    warn!(ifindex, "removing a stale migration event: {e}");
                }
                self.logged.remove(ifindex);
            }
        }
        // Forget VMs whose migration is over, so a later one logs again.
        self.moved.retain(|k| {
            cfg.attachments
                .iter()
                .any(|a| a.migration.is_some() && a.key.to_string() == *k)
        });
    }
}
