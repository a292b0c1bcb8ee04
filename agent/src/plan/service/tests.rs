//! Service + EndpointSlice documents compiled into map entries.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;
use crate::config::{self, ConfigError};
use vmpath_common::ADDR_STATIC;

const TCP: u8 = 6;
const UDP: u8 = 17;
const BLUE: u32 = 100;
const RED: u32 = 200;

/// Endpoints b1..b3 (10.1.0.11-13 and fd00:1::11-13) on blue, r1
/// (10.2.0.11) on red, then `docs`.
fn config(docs: &str) -> Config {
    let mut all = String::from(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\nspec: {id: 100, subnets: [10.1.0.0/16, \"fd00:1::/64\"], ipam: {mode: Disabled}}\n---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: red}\nspec: {id: 200, subnets: [10.2.0.0/16], ipam: {mode: Disabled}}\n",
    );
    for (i, name) in ["b1", "b2", "b3"].iter().enumerate() {
        all.push_str(&format!(
            "---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: default}}\nspec: {{vm: {name}, interface: eth0, network: blue, node: n1, port: p{name}, mac: \"52:54:00:00:00:{:02x}\", ips: [10.1.0.{}/16, \"fd00:1::{}/64\"]}}\n",
            i + 1,
            i + 11,
            i + 11
        ));
    }
    all.push_str("---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {name: r1, namespace: default}\nspec: {vm: r1, interface: eth0, network: red, node: n1, port: pr1, mac: \"52:54:00:00:01:01\", ips: [10.2.0.11/16]}\n");
    all.push_str(docs);
    let dir = std::env::temp_dir().join(format!(
        "vmpath-service-{}-{:x}",
        std::process::id(),
        crate::sys::hash::fnv1a(&[all.as_bytes()])
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.yaml"), &all).unwrap();
    let snap = config::source::read_dir(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    crate::round::validate(&snap, "n1", &crate::config::AcceptedKeys::new())
}

fn compiled(docs: &str) -> Compiled {
    let cfg = config(docs);
    assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
    compile_with(&cfg, &BTreeMap::new())
}

fn errors(docs: &str) -> Vec<ConfigError> {
    config(docs).errors
}

const WEB: &str = "---\napiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec:\n  clusterIP: 10.96.0.10\n  ports:\n  - {name: http, port: 80, targetPort: http}\n  - {name: dns, port: 53, targetPort: 5353, protocol: UDP}\n";

fn slice(name: &str, endpoints: &str, ports: &str) -> String {
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: default, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nendpoints: {endpoints}\nports: {ports}\n"
    )
}

const PORTS: &str =
    "[{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]";

fn svc(c: &Compiled, net: u32, port: u16, proto: u8) -> Option<Service> {
    c.services
        .get(&ServiceKey::new(net, [10, 96, 0, 10], port, proto))
        .copied()
}

/// The backends of a Service port as (address, port).
fn backends(c: &Compiled, s: &Service) -> Vec<(Ipv4Addr, u16)> {
    (0..s.count)
        .map(|slot| {
            let b = c.backends[&ServiceBackendKey {
                service: s.id,
                slot,
            }];
            (Ipv4Addr::from(b.addr), b.port)
        })
        .collect()
}

#[test]
fn ready_endpoints_on_the_network_become_the_backends_of_each_port() {
    let c = compiled(&format!(
        "{WEB}{}",
        slice(
            "web-1",
            "[{addresses: [10.1.0.11]}, {addresses: [10.1.0.12], conditions: {ready: true}}, {addresses: [10.1.0.13], conditions: {ready: false}}]",
            PORTS
        )
    ));
    let http = svc(&c, BLUE, 80, TCP).unwrap();
    // The named targetPort is the slice's port of that name.
    assert_eq!(
        backends(&c, &http),
        [
            ("10.1.0.11".parse().unwrap(), 8080),
            ("10.1.0.12".parse().unwrap(), 8080)
        ]
    );
    let dns = svc(&c, BLUE, 53, UDP).unwrap();
    assert_eq!(dns.count, 2);
    assert_ne!(dns.id, http.id);
    assert_eq!(backends(&c, &dns)[0].1, 5353);
    // The backend's MAC travels with it.
    let b = c.backends[&ServiceBackendKey {
        service: http.id,
        slot: 0,
    }];
    assert_eq!(b.mac, [0x52, 0x54, 0, 0, 0, 1]);
    // Only on the network its endpoints are on.
    assert_eq!(svc(&c, RED, 80, TCP), None);
    assert_eq!(http.flags, 0);
    assert_eq!(c.names[&http.id].0, "default/web:80/TCP");
}

#[test]
fn slices_are_merged_and_addresses_off_the_networks_do_not_count() {
    let c = compiled(&format!(
        "{WEB}{}{}",
        slice(
            "web-1",
            "[{addresses: [10.1.0.11]}, {addresses: [192.0.2.7]}]",
            PORTS
        ),
        slice("web-2", "[{addresses: [10.1.0.13]}]", PORTS),
    ));
    let http = svc(&c, BLUE, 80, TCP).unwrap();
    assert_eq!(
        backends(&c, &http),
        [
            ("10.1.0.11".parse().unwrap(), 8080),
            ("10.1.0.13".parse().unwrap(), 8080)
        ]
    );
}

#[test]
fn a_service_whose_endpoints_are_all_elsewhere_is_left_alone() {
    let c = compiled(&format!(
        "{WEB}{}",
        slice("web-1", "[{addresses: [192.0.2.7]}]", PORTS)
    ));
    assert!(c.services.is_empty(), "{:?}", c.services);
}

#[test]
fn no_ready_backend_programs_a_reject_and_terminating_ones_serve_as_a_last_resort() {
    // Endpoints on blue, none ready: the port is there with no backend.
    let c = compiled(&format!(
        "{WEB}{}",
        slice(
            "web-1",
            "[{addresses: [10.1.0.11], conditions: {ready: false}}]",
            PORTS
        )
    ));
    assert_eq!(svc(&c, BLUE, 80, TCP).unwrap().count, 0);
    // No endpoint at all: a reject on every network.
    let c = compiled(&format!("{WEB}{}", slice("web-1", "[]", PORTS)));
    assert_eq!(svc(&c, BLUE, 80, TCP).unwrap().count, 0);
    assert_eq!(svc(&c, RED, 80, TCP).unwrap().count, 0);
    // Serving while terminating: used only when nothing is ready.
    let c = compiled(&format!(
        "{WEB}{}",
        slice(
            "web-1",
            "[{addresses: [10.1.0.11], conditions: {ready: false, serving: true, terminating: true}}]",
            PORTS
        )
    ));
    assert_eq!(svc(&c, BLUE, 80, TCP).unwrap().count, 1);
    let c = compiled(&format!(
        "{WEB}{}",
        slice(
            "web-1",
            "[{addresses: [10.1.0.11], conditions: {ready: false, serving: true, terminating: true}}, {addresses: [10.1.0.12]}]",
            PORTS
        )
    ));
    let http = svc(&c, BLUE, 80, TCP).unwrap();
    assert_eq!(backends(&c, &http), [("10.1.0.12".parse().unwrap(), 8080)]);
}

#[test]
fn a_slice_without_ports_takes_a_numeric_target_port() {
    let c = compiled(&format!(
        "{WEB}{}",
        slice("web-1", "[{addresses: [10.1.0.11]}]", "[]")
    ));
    // dns: targetPort 5353; http: a named targetPort nothing resolves.
    assert_eq!(svc(&c, BLUE, 53, UDP).unwrap().count, 1);
    assert_eq!(svc(&c, BLUE, 80, TCP).unwrap().count, 0);
}

#[test]
fn session_affinity_client_ip_sets_the_flag_and_timeout() {
    let sticky = WEB.replace(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n",
    );
    let c = compiled(&format!(
        "{sticky}{}",
        slice("web-1", "[{addresses: [10.1.0.11]}]", PORTS)
    ));
    let s = svc(&c, BLUE, 80, TCP).unwrap();
    assert_eq!((s.flags, s.affinity_timeout), (SVC_F_AFFINITY, 60));
    // Without a config: Kubernetes' default, 3 hours.
    let sticky = WEB.replace(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  sessionAffinity: ClientIP\n",
    );
    let c = compiled(&format!(
        "{sticky}{}",
        slice("web-1", "[{addresses: [10.1.0.11]}]", PORTS)
    ));
    assert_eq!(svc(&c, BLUE, 80, TCP).unwrap().affinity_timeout, 10800);
}

#[test]
fn headless_and_external_name_services_are_not_translated() {
    let headless = WEB.replace("clusterIP: 10.96.0.10", "clusterIP: None");
    let c = compiled(&format!(
        "{headless}{}",
        slice("web-1", "[{addresses: [10.1.0.11]}]", PORTS)
    ));
    assert!(c.services.is_empty());
    let ext = "---\napiVersion: v1\nkind: Service\nmetadata: {name: ext, namespace: default}\nspec: {type: ExternalName, externalName: example.com}\n";
    assert!(compiled(ext).services.is_empty());
}

#[test]
fn bad_services_and_slices_are_refused_naming_the_field() {
    let cases = [
        (
            WEB.replace("clusterIP: 10.96.0.10", "clusterIP: 10.96.0.300"),
            "spec.clusterIP[0]",
        ),
        (
            WEB.replace("port: 80,", "port: 70000,"),
            "spec.ports[0].port",
        ),
        (WEB.replace("{name: dns, ", "{"), "spec.ports[1].name"),
        (
            WEB.replace(
                "  clusterIP: 10.96.0.10\n",
                "  clusterIP: 10.96.0.10\n  sessionAffinity: Cookie\n",
            ),
            "spec.sessionAffinity",
        ),
        (
            WEB.replace("apiVersion: v1\n", "apiVersion: v2\n"),
            "apiVersion",
        ),
        (
            WEB.replace("namespace: default", "labels: {}"),
            "metadata.namespace",
        ),
        (
            slice("web-1", "[{addresses: [10.1.0]}]", PORTS),
            "endpoints[0].addresses[0]",
        ),
        (
            slice("web-1", "[]", PORTS).replace("addressType: IPv4", "addressType: IPv5"),
            "addressType",
        ),
        (
            slice("web-1", "[]", PORTS)
                .replace("addressType: IPv4\n", "addressType: IPv4\nbogus: 1\n"),
            "bogus",
        ),
    ];
    for (doc, field) in cases {
        let errs = errors(&doc);
        assert!(
            errs.iter().any(|e| e.field == field),
            "want an error at {field} for\n{doc}\ngot {errs:?}"
        );
    }
}

#[test]
fn a_cluster_ip_that_is_a_vms_address_or_on_a_network_is_refused_naming_both() {
    // green has no subnets: only its VM's own address is known.
    let green = "---\napiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: green}\nspec: {id: 300, ipam: {mode: Disabled}}\n---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {name: g1-eth0, namespace: prod}\nspec: {vm: g1, interface: eth0, network: green, node: n1, port: pg1, mac: \"52:54:00:00:02:01\", ips: [192.168.5.5/24]}\n";
    for (ip, want) in [
        (
            "192.168.5.5",
            "Service default/web: ClusterIP 192.168.5.5 is the address of Attachment prod/g1-eth0 (VM g1) on network \"green\"",
        ),
        (
            "10.1.0.12",
            "Service default/web: ClusterIP 10.1.0.12 is the address of Attachment default/b2 (VM b2) on network \"blue\"",
        ),
        (
            "10.2.7.7",
            "Service default/web: ClusterIP 10.2.7.7 is inside subnet 10.2.0.0/16 of network \"red\", where VMs have their addresses",
        ),
    ] {
        let cfg = config(&format!("{green}{}", WEB.replace("10.96.0.10", ip)));
        assert_eq!(cfg.errors.len(), 1, "{ip}: {:?}", cfg.errors);
        let e = &cfg.errors[0];
        assert_eq!(
            (e.document.as_str(), e.field.as_str(), e.message.as_str()),
            ("Service default/web", "spec.clusterIP[0]", want)
        );
        assert!(cfg.services.is_empty(), "{ip}: the Service was kept");
        // Nothing else is disturbed: every VM stays.
        assert_eq!(cfg.attachments.len(), 5, "{ip}");
    }
    // Off every network: accepted as before.
    let cfg = config(&format!("{green}{WEB}"));
    assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
    assert_eq!(cfg.services.len(), 1);
}

#[test]
fn fair_shares_give_small_namespaces_all_they_ask() {
    let demands: BTreeMap<&str, usize> = [("a", 100_000), ("b", 10), ("c", 5000), ("d", 6000)]
        .into_iter()
        .collect();
    let s = fair_shares(&demands, 16384);
    assert_eq!(s["b"], 10);
    // What b leaves is split evenly among the three larger ones.
    assert_eq!(s["c"], 5000);
    assert_eq!(s["d"], (16384 - 10 - 5000) / 2);
    assert_eq!(s["a"], 16384 - 10 - 5000 - s["d"]);
    assert!(s.values().sum::<usize>() <= 16384);
}

/// A Service `ns/name` on 10.96.1.`vip` with TCP ports 1..=n and no slice
/// (translated on every network: a reject).
fn many_ports(ns: &str, name: &str, vip: u8, n: u16) -> crate::config::service::Service {
    crate::config::service::Service {
        namespace: ns.into(),
        name: name.into(),
        cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 1, vip))],
        ports: (1..=n)
            .map(|p| ServicePort {
                name: format!("p{p}"),
                port: p,
                protocol: Protocol::Tcp,
                target_port: Some(p),
            })
            .collect(),
        affinity_timeout: None,
    }
}

/// `vmp_addresses` as the plan has it (every endpoint with its MAC), and
/// the ports programmed before.
fn compile_with(cfg: &Config, previous: &BTreeMap<PortKey, u32>) -> Compiled {
    let mut addresses = BTreeMap::new();
    for a in &cfg.attachments {
        let net = cfg.network(&a.network).unwrap().id;
        for ip in &a.ips {
            addresses.insert(
                AddrKey::from_ip(net, ip.addr()),
                AddrInfo {
                    origin: ADDR_STATIC,
                    mac: a.mac.unwrap(),
                    ..Default::default()
                },
            );
        }
    }
    compile(
        cfg,
        &addresses.into_iter().collect(),
        &[BLUE, RED].into_iter().collect(),
        previous,
    )
}

fn programmed(c: &Compiled) -> BTreeMap<PortKey, u32> {
    c.services
        .iter()
        .map(|(k, s)| (PortKey::V4(*k), s.id))
        .chain(c.services6.iter().map(|(k, s)| (PortKey::V6(*k), s.id)))
        .collect()
}

#[test]
fn a_huge_service_in_one_namespace_leaves_the_others_translated_and_is_reported_once() {
    let mut cfg = config(&format!(
        "{WEB}{}",
        slice("web-1", "[{addresses: [10.1.0.11]}]", PORTS)
    ));
    let before = compile_with(&cfg, &BTreeMap::new());
    let web = svc(&before, BLUE, 80, TCP).unwrap();
    // "aaa" sorts before "default"; on two networks its 10,000 ports are
    // 20,000 Service ports, more than the data path holds.
    cfg.services.insert(0, many_ports("aaa", "huge", 1, 10_000));
    let after = compile_with(&cfg, &programmed(&before));
    assert_eq!(
        svc(&after, BLUE, 80, TCP),
        Some(web),
        "default/web lost its place or id"
    );
    assert!(svc(&after, BLUE, 53, UDP).is_some());
    assert_eq!(after.services.len(), MAX_SERVICES as usize);
    let huge: Vec<&String> = after
        .problems
        .iter()
        .filter(|p| p.contains("aaa/huge"))
        .collect();
    assert_eq!(
        huge,
        [&format!(
            "Service aaa/huge: {} of its 10000 ports not translated: namespace \"aaa\" has its share of the data path's Service ports (16382 of 16384)",
            // The last ports, cut on both networks, each counted once.
            (20_000 - 16382) / 2
        )],
        "{:?}",
        after.problems
    );
    // Without what was programmed, the order alone does not matter either.
    let cold = compile_with(&cfg, &BTreeMap::new());
    assert!(svc(&cold, BLUE, 80, TCP).is_some());
}

#[test]
fn what_is_programmed_stays_when_a_newcomer_of_the_same_namespace_does_not_fit() {
    let mut cfg = config("");
    cfg.services
        .push(many_ports("aaa", "huge", 1, MAX_SERVICES as u16 / 2));
    let before = compile_with(&cfg, &BTreeMap::new());
    assert_eq!(before.services.len(), MAX_SERVICES as usize);
    assert!(before.problems.is_empty(), "{:?}", before.problems);
    // A newcomer sorting first: it is the one left out.
    cfg.services.insert(0, many_ports("aaa", "a-new", 2, 3));
    let after = compile_with(&cfg, &programmed(&before));
    assert_eq!(after.services, before.services, "programmed ports moved");
    assert_eq!(
        after.problems,
        [
            "Service aaa/a-new: port 1/TCP, 2/TCP, 3/TCP not translated: namespace \"aaa\" has its share of the data path's Service ports (16384 of 16384)"
        ]
    );
}

/// `WEB`, dual-stack: 10.96.0.10 and fd00:96::10 (`policy`: its
/// `ipFamilyPolicy`).
fn web_dual(policy: &str) -> String {
    WEB.replace(
        "  clusterIP: 10.96.0.10\n",
        &format!(
            "  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ipFamilies: [IPv4, IPv6]\n  ipFamilyPolicy: {policy}\n"
        ),
    )
}

fn slice6(name: &str, endpoints: &str, ports: &str) -> String {
    slice(name, endpoints, ports).replace("addressType: IPv4", "addressType: IPv6")
}

const VIP6: [u8; 16] = [0xfd, 0, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10];

fn svc6(c: &Compiled, net: u32, port: u16, proto: u8) -> Option<Service> {
    c.services6
        .get(&ServiceKey6::new(net, VIP6, port, proto))
        .copied()
}

/// The IPv6 backends of a Service port as (address, port).
fn backends6(c: &Compiled, s: &Service) -> Vec<(Ipv6Addr, u16)> {
    (0..s.count)
        .map(|slot| {
            let b = c.backends6[&ServiceBackendKey {
                service: s.id,
                slot,
            }];
            (Ipv6Addr::from(b.addr), b.port)
        })
        .collect()
}

#[test]
fn a_dual_stack_service_translates_each_cluster_ip_to_its_own_familys_backends() {
    for policy in ["PreferDualStack", "RequireDualStack"] {
        let c = compiled(&format!(
            "{}{}{}",
            web_dual(policy),
            slice(
                "web-v4",
                "[{addresses: [10.1.0.11]}, {addresses: [10.1.0.12]}]",
                PORTS
            ),
            slice6(
                "web-v6",
                "[{addresses: [\"fd00:1::12\"]}, {addresses: [\"fd00:1::13\"], conditions: {ready: false}}]",
                PORTS
            ),
        ));
        assert!(c.problems.is_empty(), "{policy}: {:?}", c.problems);
        let http4 = svc(&c, BLUE, 80, TCP).unwrap();
        let http6 = svc6(&c, BLUE, 80, TCP).unwrap();
        assert_eq!(
            backends(&c, &http4),
            [
                ("10.1.0.11".parse().unwrap(), 8080),
                ("10.1.0.12".parse().unwrap(), 8080)
            ]
        );
        // Only the IPv6 slice's ready endpoint, never an IPv4 one.
        assert_eq!(
            backends6(&c, &http6),
            [("fd00:1::12".parse().unwrap(), 8080)]
        );
        let b = c.backends6[&ServiceBackendKey {
            service: http6.id,
            slot: 0,
        }];
        assert_eq!(b.mac, [0x52, 0x54, 0, 0, 0, 2]);
        // One id space over both families; each port of each family named.
        assert_ne!(http4.id, http6.id);
        assert_eq!(c.names[&http6.id].0, "default/web:80/TCP");
        assert_eq!(svc6(&c, BLUE, 53, UDP).unwrap().count, 1);
        // Where the endpoints are, as for IPv4.
        assert_eq!(svc6(&c, RED, 80, TCP), None);
        // Ids stay where they were across a recompile, both families.
        let again = compile_with(
            &config(&format!(
                "{}{}{}",
                web_dual(policy),
                slice("web-v4", "[{addresses: [10.1.0.11]}]", PORTS),
                slice6("web-v6", "[{addresses: [\"fd00:1::12\"]}]", PORTS),
            )),
            &programmed(&c),
        );
        assert_eq!(svc6(&again, BLUE, 80, TCP).unwrap().id, http6.id);
        assert_eq!(svc(&again, BLUE, 80, TCP).unwrap().id, http4.id);
    }
}

#[test]
fn an_ipv6_single_stack_service_is_translated_and_rejects_without_backends() {
    let web6 = WEB.replace(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: \"fd00:96::10\"\n  ipFamilies: [IPv6]\n  ipFamilyPolicy: SingleStack\n  sessionAffinity: ClientIP\n",
    );
    let c = compiled(&format!(
        "{web6}{}",
        slice6("web-v6", "[{addresses: [\"fd00:1::11\"]}]", PORTS)
    ));
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    assert!(c.services.is_empty(), "an IPv4 port out of nowhere");
    let http = svc6(&c, BLUE, 80, TCP).unwrap();
    assert_eq!(
        backends6(&c, &http),
        [("fd00:1::11".parse().unwrap(), 8080)]
    );
    assert_eq!(http.flags, SVC_F_AFFINITY);
    assert_eq!(http.affinity_timeout, 10800);
    // No slice address at all: on every network, a reject (count 0).
    let c = compiled(&web6);
    assert_eq!(svc6(&c, BLUE, 80, TCP).unwrap().count, 0);
    assert_eq!(svc6(&c, RED, 80, TCP).unwrap().count, 0);
}

#[test]
fn ip_families_and_policies_are_checked_as_the_api_server_does_naming_the_field() {
    let single = web_dual("SingleStack");
    let cases = [
        (
            single.as_str().to_string(),
            "spec.ipFamilyPolicy",
            "SingleStack takes one family; this Service has two (set PreferDualStack or RequireDualStack)",
        ),
        (
            web_dual("Sometimes"),
            "spec.ipFamilyPolicy",
            "\"Sometimes\" is not SingleStack, PreferDualStack or RequireDualStack",
        ),
        (
            web_dual("PreferDualStack").replace("[IPv4, IPv6]", "[IPv6, IPv4]"),
            "spec.ipFamilies[0]",
            "IPv6 is not the family of clusterIPs[0] 10.96.0.10",
        ),
        (
            web_dual("PreferDualStack").replace("[IPv4, IPv6]", "[IPv4, IPv4]"),
            "spec.ipFamilies[1]",
            "IPv4 is listed twice",
        ),
        (
            web_dual("PreferDualStack").replace("\"fd00:96::10\"]", "10.96.0.11]"),
            "spec.clusterIPs[1]",
            "10.96.0.11 is of the same family as 10.96.0.10 (a dual-stack Service has one ClusterIP per family)",
        ),
        (
            WEB.replace(
                "  clusterIP: 10.96.0.10\n",
                "  clusterIP: 10.96.0.10\n  ipFamilyPolicy: RequireDualStack\n",
            ),
            "spec.ipFamilyPolicy",
            "RequireDualStack needs a ClusterIP of each family; clusterIP has only 10.96.0.10",
        ),
    ];
    for (doc, field, message) in cases {
        let errs = errors(&doc);
        assert!(
            errs.iter()
                .any(|e| e.field == field && e.message == message),
            "want {message:?} at {field} for\n{doc}\ngot {errs:?}"
        );
    }
    // PreferDualStack with only one family is what a single-stack
    // cluster gives: accepted, translated.
    let prefer = WEB.replace(
        "  clusterIP: 10.96.0.10\n",
        "  clusterIP: 10.96.0.10\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: PreferDualStack\n",
    );
    assert!(svc(&compiled(&prefer), BLUE, 80, TCP).is_some());
}

#[test]
fn an_ipv6_cluster_ip_that_is_a_vms_address_or_on_a_network_is_refused_naming_both() {
    // A tenant's Service may not take a VM's IPv6 address, nor one in an
    // IPv6 subnet where VMs have theirs; as for IPv4, in either place of
    // a dual-stack Service's ClusterIPs.
    for (ip, want) in [
        (
            "fd00:1::12",
            "Service default/web: ClusterIP fd00:1::12 is the address of Attachment default/b2 (VM b2) on network \"blue\"",
        ),
        (
            "fd00:1::7777",
            "Service default/web: ClusterIP fd00:1::7777 is inside subnet fd00:1::/64 of network \"blue\", where VMs have their addresses",
        ),
    ] {
        let cfg = config(&web_dual("RequireDualStack").replace("fd00:96::10", ip));
        assert_eq!(cfg.errors.len(), 1, "{ip}: {:?}", cfg.errors);
        let e = &cfg.errors[0];
        assert_eq!(
            (e.document.as_str(), e.field.as_str(), e.message.as_str()),
            ("Service default/web", "spec.clusterIPs[1]", want)
        );
        assert!(cfg.services.is_empty(), "{ip}: the Service was kept");
        assert_eq!(cfg.attachments.len(), 4, "{ip}");
    }
}
