//! The compiler's semantics, checked through a model of the data path's
//! two lookups (longest prefix in the ipcache, then in the rules).

use std::net::IpAddr;

use super::*;
use crate::config;

const TCP: u8 = 6;
const UDP: u8 = 17;

/// Namespaces x, y, z (labels ns=<name>), endpoints a, b, c in each
/// (labels pod=<name>), all local on network 100; then `policies`.
fn world(policies: &str) -> (Resolved, BTreeMap<AttachmentKey, u32>) {
    let mut docs = String::from(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec: {id: 100, subnets: [10.1.0.0/16], ipam: {mode: Disabled}}\n",
    );
    for (n, ns) in ["x", "y", "z"].iter().enumerate() {
        docs.push_str(&format!(
            "---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {ns}, labels: {{ns: {ns}}}}}\n"
        ));
        for (p, pod) in ["a", "b", "c"].iter().enumerate() {
            docs.push_str(&format!(
                "---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {pod}, namespace: {ns}, labels: {{pod: {pod}}}}}\nspec: {{vm: {pod}, interface: eth0, network: blue, node: n1, port: p{ns}{pod}, ips: [10.1.{n}.{}/16], ports: [{{name: serve-80, port: 80}}, {{name: serve-81-udp, port: 81, protocol: UDP}}]}}\n",
                p + 1
            ));
        }
    }
    docs.push_str(policies);
    let dir = std::env::temp_dir().join(format!(
        "vmpath-policy-{}-{:x}",
        std::process::id(),
        crate::sys::hash::fnv1a(&[docs.as_bytes()])
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.yaml"), &docs).unwrap();
    let snap = config::source::read_dir(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = crate::round::validate(&snap, "n1", &crate::config::AcceptedKeys::new());
    assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
    let resolved = Resolved::new(cfg);
    let local = resolved
        .attachments
        .iter()
        .enumerate()
        .map(|(i, a)| (a.key.clone(), i as u32 + 1))
        .collect();
    (resolved, local)
}

fn ip(ns: &str, pod: &str) -> IpAddr {
    let n = ["x", "y", "z"].iter().position(|x| *x == ns).unwrap();
    let p = ["a", "b", "c"].iter().position(|x| *x == pod).unwrap();
    format!("10.1.{n}.{}", p + 1).parse().unwrap()
}

fn port_of(local: &BTreeMap<AttachmentKey, u32>, ns: &str, pod: &str) -> u32 {
    local[&AttachmentKey::new(ns.into(), pod.into(), "eth0".into())]
}

/// The data path's verdict on a new flow of `port_id` going `dir` with
/// the peer at `peer`.
fn allows(c: &Compiled, port_id: u32, dir: u8, peer: IpAddr, proto: u8, dport: u16) -> bool {
    let Some(ep) = c.endpoints.get(&port_id) else {
        return true;
    };
    let bit = if dir == policy_dir::INGRESS {
        POL_F_INGRESS
    } else {
        POL_F_EGRESS
    };
    if ep.flags & bit == 0 {
        return true;
    }
    let (full, data) = cache_key(100, &IpNet::from(peer));
    let id = c
        .ipcache
        .iter()
        .filter(|((len, pfx), _)| {
            *len <= full && prefix_eq(&pfx_bytes(pfx), &pfx_bytes(&data), *len)
        })
        .max_by_key(|((len, _), _)| *len)
        .map(|(_, id)| *id)
        .unwrap_or(identity::WORLD);
    [id, identity::ANY].iter().any(|id| {
        let key = PolicyRuleKey::new(port_id, dir, *id, proto, dport);
        c.rules
            .keys()
            .any(|(len, k)| prefix_eq(&rule_bytes(k), &rule_bytes(&key), *len))
    })
}

fn pfx_bytes(p: &IdentityPrefix) -> Vec<u8> {
    p.network.iter().chain(p.addr.iter()).copied().collect()
}

fn rule_bytes(k: &PolicyRuleKey) -> Vec<u8> {
    let mut v = k.port_id.to_vec();
    v.push(k.direction);
    v.extend(k.identity);
    v.push(k.proto);
    v.extend(k.port);
    v
}

fn prefix_eq(a: &[u8], b: &[u8], bits: u32) -> bool {
    (0..bits as usize).all(|i| (a[i / 8] >> (7 - i % 8)) & 1 == (b[i / 8] >> (7 - i % 8)) & 1)
}

fn policy(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
    )
}

const IN: u8 = policy_dir::INGRESS;
const OUT: u8 = policy_dir::EGRESS;

#[test]
fn no_policy_isolates_nothing() {
    let (cfg, local) = world("");
    let c = compile(&cfg, &local);
    assert!(c.endpoints.is_empty() && c.rules.is_empty());
}

#[test]
fn default_deny_ingress_isolates_only_ingress_of_its_namespace() {
    let (cfg, local) = world(&policy(
        "x",
        "deny",
        "{podSelector: {}, policyTypes: [Ingress]}",
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(!allows(&c, xa, IN, ip("x", "b"), TCP, 80));
    assert!(!allows(&c, xa, IN, "192.0.2.1".parse().unwrap(), UDP, 81));
    assert!(allows(&c, xa, OUT, ip("y", "b"), TCP, 80));
    assert!(allows(
        &c,
        port_of(&local, "y", "a"),
        IN,
        ip("x", "b"),
        TCP,
        80
    ));
}

#[test]
fn egress_rules_isolate_egress_by_default() {
    // No policyTypes: Egress because egress rules are given.
    let (cfg, local) = world(&policy(
        "x",
        "dns",
        "{podSelector: {}, egress: [{ports: [{protocol: UDP, port: 53}, {protocol: TCP, port: 53}]}]}",
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(allows(
        &c,
        xa,
        OUT,
        "198.51.100.53".parse().unwrap(),
        UDP,
        53
    ));
    assert!(!allows(
        &c,
        xa,
        OUT,
        "198.51.100.53".parse().unwrap(),
        UDP,
        54
    ));
    assert!(!allows(&c, xa, OUT, ip("x", "b"), TCP, 80));
    // And ingress too (always in the default policyTypes), nothing allowed.
    assert!(!allows(&c, xa, IN, ip("x", "b"), TCP, 80));
}

#[test]
fn pod_selector_peer_is_in_the_policys_namespace() {
    let (cfg, local) = world(&policy(
        "x",
        "from-b",
        "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}]}]}",
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(allows(&c, xa, IN, ip("x", "b"), TCP, 80));
    assert!(allows(&c, xa, IN, ip("x", "b"), UDP, 81));
    assert!(!allows(&c, xa, IN, ip("y", "b"), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("x", "c"), TCP, 80));
    // x/b is not selected: not isolated.
    assert!(allows(
        &c,
        port_of(&local, "x", "b"),
        IN,
        ip("z", "c"),
        TCP,
        80
    ));
}

#[test]
fn namespace_and_pod_selector_in_one_peer_are_anded() {
    let (cfg, local) = world(&policy(
        "x",
        "and",
        "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{namespaceSelector: {matchExpressions: [{key: ns, operator: In, values: [y]}]}, podSelector: {matchLabels: {pod: b}}}]}]}",
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(allows(&c, xa, IN, ip("y", "b"), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("y", "c"), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("x", "b"), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("z", "b"), TCP, 80));
}

#[test]
fn namespace_selector_alone_takes_every_endpoint_there() {
    let (cfg, local) = world(&policy(
        "x",
        "ns",
        "{podSelector: {}, ingress: [{from: [{namespaceSelector: {matchLabels: {ns: z}}}]}]}",
    ));
    let c = compile(&cfg, &local);
    let xb = port_of(&local, "x", "b");
    for pod in ["a", "b", "c"] {
        assert!(allows(&c, xb, IN, ip("z", pod), TCP, 81));
        assert!(!allows(&c, xb, IN, ip("y", pod), TCP, 81));
    }
}

#[test]
fn ip_block_with_except() {
    // 10.1.1.0/24 is namespace y; its .2 (y/b) is excepted.
    let (cfg, local) = world(&policy(
        "x",
        "cidr",
        "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{ipBlock: {cidr: 10.1.1.0/24, except: [10.1.1.2/32]}}]}]}",
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(allows(&c, xa, IN, ip("y", "a"), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("y", "b"), TCP, 80));
    assert!(allows(&c, xa, IN, ip("y", "c"), TCP, 80));
    assert!(allows(&c, xa, IN, "10.1.1.200".parse().unwrap(), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("z", "a"), TCP, 80));
    assert!(!allows(&c, xa, IN, "192.0.2.1".parse().unwrap(), TCP, 80));
}

#[test]
fn end_port_ranges_and_protocols() {
    let (cfg, local) = world(&policy(
        "x",
        "range",
        "{podSelector: {matchLabels: {pod: a}}, ingress: [{ports: [{protocol: TCP, port: 81, endPort: 90}, {protocol: UDP, port: 80}]}]}",
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    let peer = ip("z", "c");
    assert!(!allows(&c, xa, IN, peer, TCP, 80));
    for p in 81..=90 {
        assert!(allows(&c, xa, IN, peer, TCP, p), "{p}");
    }
    assert!(!allows(&c, xa, IN, peer, TCP, 91));
    assert!(allows(&c, xa, IN, peer, UDP, 80));
    assert!(!allows(&c, xa, IN, peer, UDP, 81));
}

#[test]
fn named_ports_resolve_where_declared() {
    let (cfg, local) = world(&format!(
        "{}{}",
        policy(
            "x",
            "named-in",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{ports: [{port: serve-80}, {protocol: UDP, port: serve-81-udp}, {port: nowhere}]}]}",
        ),
        policy(
            "y",
            "named-out",
            "{podSelector: {matchLabels: {pod: a}}, policyTypes: [Egress], egress: [{to: [{namespaceSelector: {}}], ports: [{port: serve-80}]}]}",
        )
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(allows(&c, xa, IN, ip("z", "c"), TCP, 80));
    assert!(allows(&c, xa, IN, ip("z", "c"), UDP, 81));
    // The name is declared for UDP only on 81, for TCP only on 80.
    assert!(!allows(&c, xa, IN, ip("z", "c"), TCP, 81));
    assert!(!allows(&c, xa, IN, ip("z", "c"), UDP, 80));
    let ya = port_of(&local, "y", "a");
    assert!(allows(&c, ya, OUT, ip("x", "b"), TCP, 80));
    assert!(!allows(&c, ya, OUT, ip("x", "b"), TCP, 81));
}

#[test]
fn two_policies_are_a_union() {
    let (cfg, local) = world(&format!(
        "{}{}",
        policy(
            "x",
            "one",
            "{podSelector: {matchLabels: {pod: a}}, ingress: [{from: [{podSelector: {matchLabels: {pod: b}}}], ports: [{port: 80}]}]}",
        ),
        policy(
            "x",
            "two",
            "{podSelector: {}, ingress: [{from: [{podSelector: {matchLabels: {pod: c}}}], ports: [{protocol: UDP, port: 81}]}]}",
        )
    ));
    let c = compile(&cfg, &local);
    let xa = port_of(&local, "x", "a");
    assert!(allows(&c, xa, IN, ip("x", "b"), TCP, 80));
    assert!(!allows(&c, xa, IN, ip("x", "b"), UDP, 81));
    assert!(allows(&c, xa, IN, ip("x", "c"), UDP, 81));
    assert!(!allows(&c, xa, IN, ip("x", "c"), TCP, 80));
    assert_eq!(c.selected_by[&cfg.attachments[0].key].len(), 2);
}

#[test]
fn port_prefixes_cover_a_range_exactly() {
    assert_eq!(port_prefixes(80, 80), vec![(80, 16)]);
    assert_eq!(port_prefixes(80, 81), vec![(80, 15)]);
    for (lo, hi) in [(1u16, 65535u16), (81, 90), (1000, 1023), (32768, 60999)] {
        let mut covered = Vec::new();
        for (start, bits) in port_prefixes(lo, hi) {
            let size = 1u32 << (16 - bits);
            assert_eq!(u32::from(start) % size, 0, "aligned");
            covered.extend(u32::from(start)..u32::from(start) + size);
        }
        assert_eq!(covered, (u32::from(lo)..=u32::from(hi)).collect::<Vec<_>>());
    }
}

#[test]
fn bad_policies_are_refused_naming_the_field() {
    let docs = [
        policy("x", "p1", "{podSelector: {}, ingress: [{ports: [{port: 90, endPort: 80}]}]}"),
        policy("x", "p2", "{podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/8, except: [11.0.0.0/16]}}]}]}"),
        policy("x", "p3", "{podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}]}]}"),
        policy("x", "p4", "{podSelector: {}, ingress: [{ports: [{protocol: ICMP}]}]}"),
        "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p5}\nspec: {podSelector: {}}\n".to_string(),
    ]
    .concat();
    let dir = std::env::temp_dir().join(format!("vmpath-policy-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.yaml"), &docs).unwrap();
    let snap = config::source::read_dir(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = crate::round::validate(&snap, "n1", &crate::config::AcceptedKeys::new());
    let fields: Vec<(&str, &str)> = cfg
        .errors
        .iter()
        .map(|e| (e.document.as_str(), e.field.as_str()))
        .collect();
    assert_eq!(
        fields,
        [
            ("NetworkPolicy x/p1", "spec.ingress[0].ports[0].endPort"),
            (
                "NetworkPolicy x/p2",
                "spec.ingress[0].from[0].ipBlock.except[0]"
            ),
            ("NetworkPolicy x/p3", "spec.ingress[0].from[0].ipBlock"),
            ("NetworkPolicy x/p4", "spec.ingress[0].ports[0].protocol"),
            ("NetworkPolicy p5", "metadata.namespace"),
        ]
    );
    assert!(cfg.policies.is_empty());
}

/// The identity an endpoint address has in `c` (its /32 in the ipcache).
fn identity_of(c: &Compiled, addr: IpAddr) -> u32 {
    c.ipcache[&cache_key(100, &IpNet::from(addr))]
}

#[test]
fn identity_numbers_keep_their_meaning_when_policies_are_added() {
    let wide = policy(
        "x",
        "wide",
        "{podSelector: {matchLabels: {pod: b}}, ingress: [{from: [{ipBlock: {cidr: 10.1.0.0/16}}]}]}",
    );
    // Put first, so every ipBlock index after it shifts; it holds x/a
    // alone, so only x/a's identity changes what it is.
    let narrow = policy(
        "x",
        "narrow",
        "{podSelector: {matchLabels: {pod: c}}, ingress: [{from: [{ipBlock: {cidr: 10.1.0.1/32}}]}]}",
    );
    let (cfg1, local1) = world(&wide);
    let (cfg2, local2) = world(&format!("{narrow}{wide}"));
    let before = compile(&cfg1, &local1);
    let after = compile(&cfg2, &local2);
    let all_before: BTreeSet<u32> = before.ipcache.values().copied().collect();
    for ns in ["x", "y", "z"] {
        for pod in ["a", "b", "c"] {
            let (old, new) = (
                identity_of(&before, ip(ns, pod)),
                identity_of(&after, ip(ns, pod)),
            );
            if (ns, pod) == ("x", "a") {
                // A new identity gets a number no identity had before, so
                // no address or rule written earlier can mean it.
                assert!(
                    !all_before.contains(&new),
                    "x/a's new identity {new} reuses a number of the previous compile"
                );
            } else {
                assert_eq!(old, new, "{ns}/{pod}'s identity was renumbered");
            }
        }
    }
    // And the verdicts are what the policies say.
    let xc = port_of(&local2, "x", "c");
    assert!(allows(&after, xc, IN, ip("x", "a"), TCP, 80));
    assert!(!allows(&after, xc, IN, ip("x", "b"), TCP, 80));
}

/// A network's guarded flood list leaves out the ports isolated for
/// ingress and says how many it left out (each withholding is a counted
/// `policy_denied_ingress` in the data path); a network without such a
/// port has none.
#[test]
fn guarded_flood_lists_leave_out_and_count_the_ports_isolated_for_ingress() {
    let mut c = Compiled::default();
    for (id, flags) in [
        (1, POL_F_INGRESS),
        (2, 0),
        (3, POL_F_INGRESS | POL_F_EGRESS),
    ] {
        c.endpoints.insert(
            id,
            PolicyEndpoint {
                flags,
                identity: 300 + id,
            },
        );
    }
    let list = |ids: &[u32]| {
        let mut l = vmpath_common::FloodList::default();
        for (i, id) in ids.iter().enumerate() {
            l.ifindex[i] = 100 + id;
            l.port_id[i] = *id;
        }
        l.count = ids.len() as u32;
        l
    };
    let flood = BTreeMap::from([(7, list(&[1, 2, 3])), (8, list(&[2]))]);
    c.guard_floods(&flood);
    let mut want = list(&[2]);
    want.withheld = 2;
    assert_eq!(c.flood, BTreeMap::from([(7, want)]));
}
