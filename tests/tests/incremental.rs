//! The incremental control plane reaches what a full recompute reaches:
//! a real agent takes a seeded random sequence of changes (VMs added,
//! changed and deleted on this node and others, labels and policies
//! edited, a network's MTU, migrations named), one round each; then its
//! pinned maps are dumped, the agent restarted (a cold agent derives every
//! object again and reads every map back) and the maps dumped again: they
//! must be the same, map by map. The seed is printed;
//! `VMPATH_INCREMENTAL_SEED=<n>` replays one.

use std::collections::BTreeMap;

use vmpath_tests::{Node, wait_for, yaml};

/// The maps the plan decides (not counters, flows or what the data path
/// learns on its own).
const MAPS: &[&str] = &[
    "vmp_ports",
    "vmp_port_ids",
    "vmp_endpoints",
    "vmp_addresses",
    "vmp_networks",
    "vmp_flood",
    "vmp_slow_limits",
    "vmp_pol_ep",
    "vmp_pol_ipcache",
    "vmp_pol_rules",
    "vmp_routed",
    "vmp_svc",
    "vmp_svc_backends",
];

fn dump(node: &Node) -> BTreeMap<&'static str, String> {
    MAPS.iter().map(|m| (*m, node.dump_map(m))).collect()
}

/// splitmix64: the sequence from its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

const APPS: [&str; 3] = ["web", "db", "cache"];

/// VM `name`'s Attachment: `app` its label, on `node` (a migration to
/// `target` named when given).
fn vm_doc(name: &str, node: &str, port: &str, n: u8, app: &str, target: Option<&str>) -> String {
    let migration = target
        .map(|t| format!("  migration: {{targetNode: {t}, targetPort: {name}t}}\n"))
        .unwrap_or_default();
    yaml::attachment_with(
        name,
        "blue",
        node,
        port,
        &format!(
            "  mac: '52:54:00:3a:00:{n:02x}'\n  ips: [10.46.0.{}/24]\n{migration}",
            u32::from(n) + 20
        ),
    )
    .replace(
        "namespace: prod}",
        &format!("namespace: prod, labels: {{app: {app}}}}}"),
    )
}

fn network(mtu: u32) -> String {
    yaml::network("blue", 46, &["10.46.0.0/24"], &["10.46.0.1"], false) + &format!("  mtu: {mtu}\n")
}

#[test]
fn the_maps_after_increments_are_the_maps_of_a_full_recompute() {
    let seed: u64 = std::env::var("VMPATH_INCREMENTAL_SEED")
        .ok()
        .map(|s| s.parse().expect("VMPATH_INCREMENTAL_SEED: a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("incremental seed {seed} (VMPATH_INCREMENTAL_SEED={seed} replays it)");
    let mut rng = Rng(seed);

    let mut node = Node::new("a");
    // Three VMs on this node, with real ports.
    let local: Vec<_> = (1..=3u8)
        .map(|n| {
            node.add_vm(
                &format!("l{n}"),
                &format!("52:54:00:3a:00:{n:02x}"),
                &[&format!("10.46.0.{}/24", u32::from(n) + 20)],
                None,
            )
        })
        .collect();
    node.write_config("network.yaml", &network(1450));
    for (i, vm) in local.iter().enumerate() {
        let n = i as u8 + 1;
        node.write_config(
            &format!("l{n}.yaml"),
            &vm_doc(&format!("l{n}"), "a", &vm.port, n, "web", None),
        );
    }
    node.start_agent();
    let ports: Vec<&str> = local.iter().map(|v| v.port.as_str()).collect();
    node.wait_ports(&ports);

    // Each step changes some objects, then names a marker VM on another
    // node: once the agent shows the marker, its round took the step.
    let mut mtu = 1450;
    let mut last_marker = String::new();
    for step in 0..24u32 {
        let what = match rng.below(6) {
            0 | 1 => {
                // A VM on another node added or replaced.
                let n = 10 + rng.below(8) as u8;
                let node_name = ["b", "c"][rng.below(2) as usize];
                let target = (rng.below(3) == 0).then_some("a");
                let app = APPS[rng.below(3) as usize];
                node.write_config(
                    &format!("r{n}.yaml"),
                    &vm_doc(
                        &format!("r{n}"),
                        node_name,
                        &format!("r{n}p"),
                        n,
                        app,
                        target,
                    ),
                );
                format!("r{n} on {node_name} ({app}, migration to {target:?})")
            }
            2 => {
                let n = 10 + rng.below(8) as u8;
                node.remove_config(&format!("r{n}.yaml"));
                format!("r{n} deleted")
            }
            3 => {
                // A local VM's labels.
                let n = 1 + rng.below(3) as u8;
                let app = APPS[rng.below(3) as usize];
                node.write_config(
                    &format!("l{n}.yaml"),
                    &vm_doc(
                        &format!("l{n}"),
                        "a",
                        &local[n as usize - 1].port,
                        n,
                        app,
                        None,
                    ),
                );
                format!("l{n} labelled {app}")
            }
            4 => {
                let p = rng.below(2);
                if rng.below(3) == 0 {
                    node.remove_config(&format!("policy{p}.yaml"));
                    format!("policy{p} deleted")
                } else {
                    let (to, from) = (APPS[rng.below(3) as usize], APPS[rng.below(3) as usize]);
                    node.write_config(
                        &format!("policy{p}.yaml"),
                        &format!("apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: p{p}, namespace: prod}}\nspec:\n  podSelector: {{matchLabels: {{app: {to}}}}}\n  policyTypes: [Ingress]\n  ingress: [{{from: [{{podSelector: {{matchLabels: {{app: {from}}}}}}}]}}]\n"),
                    );
                    format!("policy{p}: {from} -> {to}")
                }
            }
            _ => {
                mtu = if mtu == 1450 { 1400 } else { 1450 };
                node.write_config("network.yaml", &network(mtu));
                format!("blue's mtu {mtu}")
            }
        };
        last_marker = format!("m{step}");
        node.write_config(
            "marker.yaml",
            &vm_doc(&last_marker, "c", "mp", 200, "none", None),
        );
        eprintln!("step {step}: {what}");
        let marker = last_marker.clone();
        wait_for(
            &format!("the agent to take step {step}"),
            std::time::Duration::from_secs(120),
            || node.attachment_view(&marker).is_some(),
        );
    }
    let increments = dump(&node);

    // A cold agent: every object derived again, every map read back.
    node.kill_agent();
    node.start_agent();
    node.wait_ports(&ports);
    wait_for(
        "the restarted agent to derive the last marker",
        std::time::Duration::from_secs(120),
        || node.attachment_view(&last_marker).is_some(),
    );
    let full = dump(&node);
    for map in MAPS {
        assert_eq!(
            increments[map], full[map],
            "seed {seed}: {map} after the increments differs from a full recompute's"
        );
    }
}
