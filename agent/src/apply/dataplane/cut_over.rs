//! What the data path writes on its own at a live migration's cut-over,
//! and which a round must not undo.
//!
//! The data path moves a VM the moment it speaks on the target
//! (`vm_migrate` there, `migrate::learn_move` in `vxlan_rx` everywhere
//! else); the agent finds out at its next tick (`observe::migration`).
//! A round whose tick ran just before the cut-over plans the migration as
//! still pending. Writing that plan would put the VM back on the source:
//! on every node but the target nothing records the move except the
//! endpoint itself, so the next tick would not see it either, and traffic
//! would go to the stopped source until the config says `ready`.
//! The maps' sync keeps these entries as the data path wrote them instead;
//! the next round's tick sees them and plans the cut-over.

use std::collections::BTreeMap;

use vmpath_common::{
    ENDPOINT_LOCAL, ENDPOINT_REMOTE, Endpoint, EndpointKey, PORT_F_PENDING, PortInfo,
};

/// Whether `have` (in `vmp_endpoints`) is the data path's cut-over of the
/// pending migration `want` (the plan's entry) describes. `ports` is the
/// plan's `vmp_ports`, by ifindex.
pub fn endpoint_moved(
    key: &EndpointKey,
    want: &Endpoint,
    have: &Endpoint,
    ports: &BTreeMap<u32, PortInfo>,
) -> bool {
    // Any node but the target: the plan points at the source and marks the
    // target's VTEP; `learn_move` pointed it at that VTEP and cleared the mark.
    let moved_to_target = want.migrate_to != [0; 4]
        && have.kind == ENDPOINT_REMOTE
        && have.node_ip4 == want.migrate_to
        && have.migrate_to == [0; 4];
    // The target: the plan points at the source and has a pending port for
    // this VM; `vm_migrate` made the endpoint local on that very port.
    let resumed_here = want.kind == ENDPOINT_REMOTE
        && have.kind == ENDPOINT_LOCAL
        && ports.get(&have.ifindex).is_some_and(|p| {
            p.flags & PORT_F_PENDING != 0
                && p.network == key.network
                && p.mac == key.mac
                && p.port_id == have.port_id
        });
    moved_to_target || resumed_here
}

/// Whether `have` (in `vmp_ports`) is the pending target port `want` with
/// the pending flag cleared by `vm_migrate` and nothing else changed.
pub fn port_resumed(want: &PortInfo, have: &PortInfo) -> bool {
    want.flags & PORT_F_PENDING != 0
        && *have
            == PortInfo {
                flags: want.flags & !PORT_F_PENDING,
                ..*want
            }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 1];
    const SOURCE: [u8; 4] = [192, 0, 2, 1];
    const TARGET: [u8; 4] = [192, 0, 2, 2];
    const OTHER: [u8; 4] = [192, 0, 2, 3];

    fn remote(at: [u8; 4], migrate_to: [u8; 4]) -> Endpoint {
        Endpoint {
            kind: ENDPOINT_REMOTE,
            node_ip4: at,
            migrate_to,
            ..Default::default()
        }
    }

    fn pending_port(flags: u16) -> PortInfo {
        PortInfo {
            port_id: 7,
            network: 100,
            mac: MAC,
            flags,
            ..Default::default()
        }
    }

    /// Plan entry, map entry, plan's ports, kept? The cases a round meets
    /// around a cut-over, and look-alikes it must still repair.
    #[test]
    fn only_the_data_paths_own_cut_over_of_a_pending_migration_is_kept() {
        let key = EndpointKey::new(100, MAC);
        let local_source = Endpoint {
            kind: ENDPOINT_LOCAL,
            ifindex: 3,
            port_id: 4,
            migrate_to: TARGET,
            ..Default::default()
        };
        let local_target = Endpoint {
            kind: ENDPOINT_LOCAL,
            ifindex: 12,
            port_id: 7,
            ..Default::default()
        };
        let ports_pending: BTreeMap<u32, PortInfo> = [(12, pending_port(PORT_F_PENDING))].into();
        let ports_active: BTreeMap<u32, PortInfo> = [(12, pending_port(0))].into();
        let none = BTreeMap::new();
        // `learn_move` keeps the source's ifindex and port id.
        let moved_from_source = Endpoint {
            kind: ENDPOINT_REMOTE,
            node_ip4: TARGET,
            migrate_to: [0; 4],
            ..local_source
        };
        /// What the row is, the plan's entry, the map's, the plan's ports, kept?
        type Case<'a> = (
            &'a str,
            Endpoint,
            Endpoint,
            &'a BTreeMap<u32, PortInfo>,
            bool,
        );
        let cases: [Case; 9] = [
            (
                "a third node, moved",
                remote(SOURCE, TARGET),
                remote(TARGET, [0; 4]),
                &none,
                true,
            ),
            (
                "the source, moved",
                local_source,
                moved_from_source,
                &none,
                true,
            ),
            (
                "the target, resumed on its pending port",
                remote(SOURCE, [0; 4]),
                local_target,
                &ports_pending,
                true,
            ),
            (
                "not moved yet",
                remote(SOURCE, TARGET),
                remote(SOURCE, TARGET),
                &none,
                false,
            ),
            (
                "no migration planned",
                remote(SOURCE, [0; 4]),
                remote(TARGET, [0; 4]),
                &none,
                false,
            ),
            (
                "moved elsewhere than the target",
                remote(SOURCE, TARGET),
                remote(OTHER, [0; 4]),
                &none,
                false,
            ),
            (
                "still marked",
                remote(SOURCE, TARGET),
                remote(TARGET, TARGET),
                &none,
                false,
            ),
            (
                "local on a port that is not pending",
                remote(SOURCE, [0; 4]),
                local_target,
                &ports_active,
                false,
            ),
            (
                "local on another VM's port",
                remote(SOURCE, [0; 4]),
                Endpoint {
                    port_id: 9,
                    ..local_target
                },
                &ports_pending,
                false,
            ),
        ];
        for (what, want, have, ports, kept) in cases {
            assert_eq!(endpoint_moved(&key, &want, &have, ports), kept, "{what}");
        }
    }

    #[test]
    fn a_pending_port_whose_flag_the_data_path_cleared_is_kept_and_nothing_else() {
        let want = pending_port(PORT_F_PENDING | 1);
        assert!(port_resumed(&want, &pending_port(1)));
        assert!(!port_resumed(&want, &want), "unchanged: nothing to keep");
        assert!(
            !port_resumed(&pending_port(1), &pending_port(0)),
            "not pending in the plan"
        );
        let other = PortInfo {
            port_id: 8,
            ..pending_port(1)
        };
        assert!(!port_resumed(&want, &other), "another port's values");
    }
}
