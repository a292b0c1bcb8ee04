//! A live migration's cut-over against the agent's rounds: the data path
//! moves the VM the moment it speaks on the target, and a round whose
//! plan was made just before (its migration tick saw nothing yet) must not
//! put it back. Each node runs the agent's own stages on a real data path
//! in a namespace of its own: tick, plan, apply; the cut-over lands
//! between the tick and the apply, then the next round runs.
//!
//! On the target the cut-over is `vm_migrate` itself, run on the VM's
//! RARP with BPF_PROG_TEST_RUN. On the source and a third node it is
//! `vxlan_rx`'s `learn_move`, which a test run cannot reach (it needs the
//! tunnel metadata of a frame the vxlan driver decapsulated): the test
//! writes the two fields it writes (the namespace migration tests run it
//! for real).
//!
//! Without the guard, the stale plan moved the VM back to the stopped
//! source on every node but the target, where nothing else records the
//! move: its traffic was lost until `ready: true` (1 s in
//! `north_south_imported`'s three-node test, which caught it in CI).
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^cut_over::/)'

use std::process::Command;

use aya::programs::{TestRun as _, TestRunOptions};
use vmpath::{
    apply::dataplane::Dataplane, config, observe::migration::Migrations, plan::Plan,
    resolve::resolved::Resolved, sys::netif::ifindex_of,
};
use vmpath_common::{ENDPOINT_LOCAL, ENDPOINT_REMOTE, Endpoint, EndpointKey, PORT_F_PENDING};
use vmpath_tests::{
    prog_fixture::{BpffsRoot, SKB_CTX_LEN, in_fresh_netns, skb_ctx},
    yaml, yaml_overlay,
};

const NETWORK: u32 = 100;
const VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 1];
const NODE_A: [u8; 4] = [192, 0, 2, 1];
const NODE_B: [u8; 4] = [192, 0, 2, 2];

/// vm1 runs on a (port p1) and migrates to b (port p1b); c hosts the
/// network too. `ready`: KubeVirt's signal; `migrating: false`: the
/// migration is gone from the object (it failed), vm1 stays on a.
fn docs(ready: bool, migrating: bool) -> String {
    let migration = if migrating {
        format!(", migration: {{targetNode: b, targetPort: p1b, ready: {ready}}}")
    } else {
        String::new()
    };
    let nodes: Vec<String> = [("a", "192.0.2.1"), ("b", "192.0.2.2"), ("c", "192.0.2.3")]
        .iter()
        .map(|(name, address)| yaml_overlay::node(name, address))
        .collect();
    format!(
        "{}---
apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata: {{name: blue}}
spec: {{id: {NETWORK}, subnets: [10.20.0.0/16], ipam: {{mode: Disabled}}}}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {{name: vm1, namespace: prod}}
spec: {{vm: vm1, interface: eth0, network: blue, node: a, port: p1, mac: '52:54:00:00:00:01', ips: [10.20.0.11/16]{migration}}}
---
apiVersion: vmpath.dev/v1alpha1
kind: Attachment
metadata: {{name: vm4, namespace: prod}}
spec: {{vm: vm4, interface: eth0, network: blue, node: c, port: p4, mac: '52:54:00:00:00:04', ips: [10.20.0.14/16]}}
",
        yaml::docs(&nodes)
    )
}

/// One node's view of the cluster, as a round resolves it.
fn resolved(node: &str, docs: &str) -> Resolved {
    let dir = std::env::temp_dir().join(format!(
        "vmpath-cut-over-{}-{node}-{}",
        std::process::id(),
        vmpath::sys::hash::fnv1a(&[docs.as_bytes()])
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.yaml"), docs).unwrap();
    let snap = config::source::read_dir(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let validated = vmpath::round::validate(&snap, node, &vmpath::config::AcceptedKeys::new());
    assert!(validated.errors.is_empty(), "{:?}", validated.errors);
    let mut cfg = Resolved::new(validated);
    let _ = vmpath::resolve::ipam::assign(&mut cfg, &Default::default());
    cfg
}

/// The tick and plan stages of a round on `node`.
fn tick_and_plan(node: &str, docs: &str, ticks: &mut Migrations, dp: &mut Dataplane) -> Plan {
    let mut cfg = resolved(node, docs);
    ticks.tick(&mut cfg, node, dp);
    vmpath::plan::plan(&cfg, node, ifindex_of)
}

/// A whole round on `node`: tick, plan, apply.
fn round(node: &str, docs: &str, ticks: &mut Migrations, dp: &mut Dataplane) {
    let plan = tick_and_plan(node, docs, ticks, dp);
    dp.apply(&plan).unwrap();
}

fn veth(name: &str) {
    let ok = Command::new("ip")
        .args([
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            &format!("{name}-vm"),
        ])
        .status()
        .unwrap()
        .success();
    assert!(ok, "creating {name}");
    for dev in [name.to_string(), format!("{name}-vm")] {
        assert!(
            Command::new("ip")
                .args(["link", "set", &dev, "up"])
                .status()
                .unwrap()
                .success()
        );
    }
}

fn endpoint(dp: &Dataplane) -> Endpoint {
    dp.maps()
        .endpoints
        .get(&EndpointKey::new(NETWORK, VM_MAC), 0)
        .expect("vm1's endpoint")
}

/// QEMU's RARP announcement from the VM's MAC, as the guest resumes.
fn rarp() -> Vec<u8> {
    [
        &[0xff; 6][..],
        &VM_MAC,
        &[0x80, 0x35],
        &[0, 1, 8, 0, 6, 4, 0, 3],
        &VM_MAC,
        &[0; 4],
        &VM_MAC,
        &[0; 4],
    ]
    .concat()
}

/// Runs `vm_port` on `frame` as arriving on `ifindex`.
fn vm_port(dp: &Dataplane, ifindex: u32, frame: &[u8]) {
    let ctx: [u8; SKB_CTX_LEN] = skb_ctx(ifindex);
    let mut out = vec![0u8; 4096];
    dp.vm_port()
        .expect("vm_port")
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..Default::default()
        })
        .expect("test_run");
}

/// The target: `vm_migrate` made the endpoint local on the pending port
/// and cleared its flag; the round planned before keeps both (a resync too), the next
/// round's tick finds the event and plans the cut-over.
#[test]
fn a_round_planned_before_the_target_cut_over_does_not_undo_it() {
    // `resync`: that round is the periodic resync, which reads every map
    // back rather than trust what the agent wrote last.
    for resync in [false, true] {
        in_fresh_netns(|| {
            veth("p1b");
            let port = ifindex_of("p1b").unwrap();
            let root = BpffsRoot::new("cut-over-b");
            let mut dp = Dataplane::open(&root.0).expect("loading the data path");
            let mut ticks = Migrations::default();
            let pending = docs(false, true);
            round("b", &pending, &mut ticks, &mut dp);
            assert_eq!(
                (endpoint(&dp).kind, endpoint(&dp).node_ip4),
                (ENDPOINT_REMOTE, NODE_A),
                "pending: vm1 still at a"
            );

            // A round starts: its tick sees no event yet.
            let stale = tick_and_plan("b", &pending, &mut ticks, &mut dp);
            // The VM resumes on b.
            vm_port(&dp, port, &rarp());
            let moved = endpoint(&dp);
            assert_eq!(
                (moved.kind, moved.ifindex),
                (ENDPOINT_LOCAL, port),
                "vm_migrate did not cut over"
            );
            // The round applies what it planned.
            if resync {
                dp.forget_written();
            }
            dp.apply(&stale).unwrap();
            assert_eq!(
                endpoint(&dp),
                moved,
                "resync {resync}: a plan older than the cut-over put vm1 back at a"
            );
            let flags = dp.maps().ports.get(&port, 0).unwrap().flags;
            assert_eq!(
                flags & PORT_F_PENDING,
                0,
                "the target port is pending again"
            );

            // The next round: the tick finds the event; plan and maps agree.
            let next = tick_and_plan("b", &pending, &mut ticks, &mut dp);
            assert_eq!(next.endpoints[&EndpointKey::new(NETWORK, VM_MAC)], moved);
            assert_eq!(next.ports[&port].info.flags & PORT_F_PENDING, 0);
            dp.apply(&next).unwrap();
            assert_eq!(endpoint(&dp), moved);
        });
    }
}

/// The source and a third node: `learn_move` pointed the endpoint at the
/// target; the round planned before keeps it (a resync too), the next round's tick sees
/// it and plans it so. A migration that failed (gone from the object) is
/// still repaired: the guard keeps only a move to the planned target.
#[test]
fn a_round_planned_before_another_nodes_cut_over_does_not_undo_it() {
    for (node, resync) in [("a", false), ("c", false), ("a", true), ("c", true)] {
        in_fresh_netns(|| {
            veth("p1");
            let root = BpffsRoot::new(&format!("cut-over-{node}"));
            let mut dp = Dataplane::open(&root.0).expect("loading the data path");
            let mut ticks = Migrations::default();
            let pending = docs(false, true);
            round(node, &pending, &mut ticks, &mut dp);
            let before = endpoint(&dp);
            assert_eq!(
                before.migrate_to, NODE_B,
                "{node}: pending, marked to move to b"
            );

            let stale = tick_and_plan(node, &pending, &mut ticks, &mut dp);
            // vm1's GARP arrives from b: what `learn_move` writes.
            let moved = Endpoint {
                kind: ENDPOINT_REMOTE,
                node_ip4: NODE_B,
                migrate_to: [0; 4],
                ..before
            };
            dp.maps_mut()
                .endpoints
                .insert(EndpointKey::new(NETWORK, VM_MAC), moved, 0)
                .unwrap();
            if resync {
                dp.forget_written();
            }
            dp.apply(&stale).unwrap();
            assert_eq!(
                endpoint(&dp),
                moved,
                "{node}, resync {resync}: a plan older than the cut-over put vm1 back at a"
            );

            let next = tick_and_plan(node, &pending, &mut ticks, &mut dp);
            let planned = next.endpoints[&EndpointKey::new(NETWORK, VM_MAC)];
            assert_eq!(
                (planned.kind, planned.node_ip4, planned.migrate_to),
                (ENDPOINT_REMOTE, NODE_B, [0; 4]),
                "{node}: the next round did not see the cut-over"
            );
            dp.apply(&next).unwrap();
            assert_eq!(
                (endpoint(&dp).kind, endpoint(&dp).node_ip4),
                (ENDPOINT_REMOTE, NODE_B)
            );

            // Another time, the data path moves the entry, and the
            // migration is gone from the object before the agent saw the
            // move (KubeVirt failed it): the plan (vm1 on a) is written, the
            // move is not kept.
            let failed = docs(false, false);
            round(node, &failed, &mut ticks, &mut dp);
            let at_a = endpoint(&dp);
            assert_eq!(at_a.migrate_to, [0; 4], "{node}");
            assert_ne!(at_a.node_ip4, NODE_B, "{node}");
            let mut ticks = Migrations::default();
            round(node, &pending, &mut ticks, &mut dp);
            dp.maps_mut()
                .endpoints
                .insert(EndpointKey::new(NETWORK, VM_MAC), moved, 0)
                .unwrap();
            dp.apply(&vmpath::plan::plan(
                &resolved(node, &failed),
                node,
                ifindex_of,
            ))
            .unwrap();
            assert_eq!(
                endpoint(&dp),
                at_a,
                "{node}: a move to a target no longer planned was kept"
            );
        });
    }
}
