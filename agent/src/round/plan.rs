//! Stage 7, **plan**: the desired content of every map for this node
//! (`plan::plan_with_previous`), from the resolved config alone. Port ids
//! and service ids stay where they were ([`Previous`]): from the last
//! applied plan, or after a restart from what the data path holds.

use std::collections::BTreeMap;

use crate::plan::service::PortKey;

use crate::{
    apply::dataplane::Dataplane, config::AttachmentKey, plan::Plan, resolve::resolved::Resolved,
};

/// The ids the last plan gave: each VM interface's port id, each service
/// port's id.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Previous {
    pub port_ids: BTreeMap<AttachmentKey, u32>,
    pub services: BTreeMap<PortKey, u32>,
    /// IPv6 underlay: each other node's VTEP handle (`Plan::vteps6`).
    pub vteps6: BTreeMap<std::net::Ipv6Addr, [u8; 4]>,
}

impl Previous {
    /// The ids of the last applied plan.
    pub fn of_plan(plan: &Plan) -> Self {
        Previous {
            port_ids: plan
                .ports
                .values()
                .map(|pp| (pp.attachment.clone(), pp.info.port_id))
                .collect(),
            services: plan
                .services
                .services
                .iter()
                .map(|(k, s)| (PortKey::V4(*k), s.id))
                .chain(
                    plan.services
                        .services6
                        .iter()
                        .map(|(k, s)| (PortKey::V6(*k), s.id)),
                )
                .collect(),
            vteps6: plan.vteps6.clone(),
        }
    }

    /// After a restart: the ids the data path holds (`pinned_ports`:
    /// ifindex -> port id; `services`), given to the VM interfaces whose
    /// port on `node` has that ifindex.
    pub fn of_pinned(
        cfg: &Resolved,
        node: &str,
        ifindex_of: impl Fn(&str) -> Option<u32>,
        pinned_ports: &BTreeMap<u32, u32>,
        services: BTreeMap<PortKey, u32>,
    ) -> Self {
        let port_ids = cfg
            .attachments
            .iter()
            .filter(|a| !a.elsewhere && a.active_node() == node)
            .filter_map(|a| {
                ifindex_of(a.active_port())
                    .and_then(|i| pinned_ports.get(&i))
                    .map(|id| (a.key.clone(), *id))
            })
            .collect();
        Previous {
            port_ids,
            services,
            vteps6: BTreeMap::new(),
        }
    }

    /// The last plan's ids, or the data path's without one.
    pub fn of(last_plan: Option<&Plan>, dp: &Dataplane, cfg: &Resolved, node: &str) -> Self {
        if let Some(plan) = last_plan {
            return Self::of_plan(plan);
        }
        let pinned: BTreeMap<u32, u32> = dp
            .maps()
            .ports
            .iter()
            .filter_map(|r| r.ok())
            .map(|(i, info)| (i, info.port_id))
            .collect();
        let maps = dp.maps();
        let services = maps
            .services
            .iter()
            .filter_map(|r| r.ok())
            .map(|(k, s)| (PortKey::V4(k), s.id))
            .chain(
                maps.services6
                    .iter()
                    .filter_map(|r| r.ok())
                    .map(|(k, s)| (PortKey::V6(k), s.id)),
            )
            .collect();
        Previous {
            vteps6: dp.pinned_vteps6(),
            ..Self::of_pinned(cfg, node, crate::sys::netif::ifindex_of, &pinned, services)
        }
    }
}

/// Plans `cfg` for `node`; `ifindex_of` finds a port's interface.
pub fn plan(
    cfg: &Resolved,
    node: &str,
    ifindex_of: impl Fn(&str) -> Option<u32>,
    previous: &Previous,
    cache: &mut crate::plan::overlay::Cache,
) -> Plan {
    crate::plan::plan_with_previous(
        cfg,
        node,
        ifindex_of,
        &previous.port_ids,
        &previous.services,
        &previous.vteps6,
        cache,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::{
        resolve::resolve,
        tests::{BLUE, attachment, snapshot_of},
    };

    #[test]
    fn plans_present_ports_and_keeps_port_ids_across_a_restart() {
        let snap = snapshot_of(&format!(
            "{BLUE}---\n{}---\n{}",
            attachment("vm1", "a"),
            attachment("vm2", "a")
        ));
        let cfg = resolve(
            crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new()),
            "a",
        );
        // vm2's port does not exist yet.
        let ports = |p: &str| (p == "vm1p").then_some(11);
        let first = plan(
            &cfg,
            "a",
            ports,
            &Previous::default(),
            &mut Default::default(),
        );
        assert_eq!(first.ports.len(), 1);
        assert_eq!(first.missing_ports.len(), 1);

        // A restarted agent finds vm1's port id in the pinned ports.
        let id = first.ports.values().next().unwrap().info.port_id;
        let pinned = BTreeMap::from([(11, id)]);
        let previous = Previous::of_pinned(&cfg, "a", ports, &pinned, BTreeMap::new());
        assert_eq!(previous, Previous::of_plan(&first));
        assert_eq!(
            plan(&cfg, "a", ports, &previous, &mut Default::default()),
            first
        );
    }
}
