//! The pod network on vmpath (docs/kubernetes.md, "The pod network"): a
//! virt-launcher pod and a plain pod whose default network
//! (`v1.multus-cni.io/default-network`) is a vmpath NAD get their `eth0`
//! from vmpath-cni, called as Multus calls the default network (ifname
//! eth0, Multus's CNI_ARGS). The VM binds it as KubeVirt's bridge binding
//! does (a bridge in the launcher pod, a tap to the guest) and takes its
//! address and default route by DHCP; the plain pod gets its address and
//! the default route to vmpath's gateway from the plugin. The agent knows
//! the cluster's pod and Service CIDRs from its flags and refuses a Primary
//! network over them.

use std::{path::Path, time::Duration};

use serde_json::Value;
use vmpath_tests::{Netns, Node, multus, unique_tag, wait_for, yaml};

const NETWORK: &str = include_str!("../../agent/src/derive/fixtures/network.yaml");
const VM: &str = include_str!("../../agent/src/derive/fixtures/vm-pod-network.yaml");
const LAUNCHER: &str = "virt-launcher-vm1-x7k2p";
const VM_MAC: &str = "02:00:00:31:00:0b";
const VM_IP: &str = "10.31.0.11";
const GATEWAY: &str = "10.31.0.1";

/// ADD of the pod's default network (namespace prod), as Multus calls it.
fn add_default_network(
    node: &Node,
    conf: &str,
    pod: &str,
    uid: &str,
    netns: &Netns,
    container: &str,
) -> (bool, Value) {
    let call = multus::Call {
        conf,
        pod_namespace: "prod",
        pod,
        ifname: "eth0",
        netns,
        container,
    };
    multus::add_default_network(node, &call, uid)
}

/// The guest's DHCP client: records the lease and applies it (address and
/// default route), as a guest OS does.
fn dhcp(guest: &Netns, ifname: &str, dir: &Path) -> (String, String) {
    let hook = dir.join("hook.sh");
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nif [ \"$1\" = bound ]; then\n  echo \"$ip $router\" > {}/lease\n  ip addr add \"$ip/$mask\" dev \"$interface\"\n  ip route add default via \"$router\"\nfi\n",
            dir.display()
        ),
    )
    .unwrap();
    vmpath_tests::run(&["chmod", "+x", hook.to_str().unwrap()]);
    let out = vmpath_tests::udhcpc(guest, ifname, hook.to_str().unwrap(), 10);
    assert!(
        out.status.success(),
        "udhcpc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lease = std::fs::read_to_string(dir.join("lease")).unwrap();
    let (ip, router) = lease.trim().split_once(' ').expect("ip and router");
    (ip.to_string(), router.to_string())
}

/// Pod network blue (the fixture, `role: Primary`), IPv4 or dual-stack,
/// without the fixture's Node.
fn primary_network(dual_stack: bool) -> String {
    let mut net = NETWORK.replace("  id: 310\n", "  id: 310\n  role: Primary\n");
    if dual_stack {
        net = net
            .replace(
                "subnets: [10.31.0.0/24]",
                "subnets: [10.31.0.0/24, 'fd31::/64']",
            )
            .replace(
                "defaultGatewayIPs: [10.31.0.1]",
                "defaultGatewayIPs: [10.31.0.1, 'fd31::1']",
            );
        assert!(net.contains("fd31::1"), "{net}");
    }
    net.split("\n---\n")
        .filter(|d| !d.contains("kind: Node"))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// Pod web-0 (namespace prod) as the pod-network tests run it.
struct WebPod {
    ns: Netns,
    /// The plugin's ADD result.
    result: Value,
    /// The Pod object as written.
    doc: String,
}

/// Writes `primary`, pod web-0 whose default network it is, `extra`
/// documents and VM vault's Attachment (namespace bank, `vault_ips`),
/// starts the agent with the cluster's pod and Service CIDRs
/// (`cidrs`: the two flags' values), then makes web-0's `eth0` as Multus
/// calls vmpath-cni for a default network.
fn start_pod_network(
    node: &mut Node,
    vault: &vmpath_tests::Vm,
    vault_ips: &[&str],
    primary: &str,
    extra: &[String],
    cidrs: [&str; 2],
) -> WebPod {
    let tag = unique_tag();
    let web = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web-0\n  namespace: prod\n  uid: u-web-{tag}\n  \
         annotations: {{v1.multus-cni.io/default-network: prod/blue}}\n\
         spec: {{nodeName: {}}}\nstatus: {{phase: Running}}\n",
        node.name
    );
    let mut docs = vec![primary.to_string(), web.clone()];
    docs.extend(extra.iter().cloned());
    node.write_config("cluster.yaml", &docs.join("\n---\n"));
    node.write_config(
        "vault.yaml",
        &yaml::attachment(
            "vault",
            "blue",
            &node.name,
            &vault.port,
            &vault.mac,
            vault_ips,
        )
        .replace("namespace: prod", "namespace: bank"),
    );
    node.set_agent_args(&[
        "--cluster-pod-cidrs",
        cidrs[0],
        "--cluster-service-cidrs",
        cidrs[1],
    ]);
    node.start_agent();
    node.wait_ports(&[&vault.port]);
    let conf = multus::nad_conf(NETWORK, node);
    let ns = Netns::new(format!("vt{tag}-web"));
    let (ok, result) = add_default_network(
        node,
        &conf,
        "web-0",
        &format!("u-web-{tag}"),
        &ns,
        &format!("c{tag}web"),
    );
    assert!(ok, "ADD of the pod's eth0: {result}");
    WebPod {
        ns,
        result,
        doc: web,
    }
}

use vmpath_tests::cluster_net::address_of;

/// The packets the hand-off table's refusal rule starting `rule` counted,
/// and the table as listed.
fn stack_refusals(node: &Node, rule: &str) -> (u64, String) {
    let table = node
        .ns
        .run(&["nft", "list", "table", "inet", "vmpath_handoff"]);
    let packets = table
        .lines()
        .find(|l| l.contains(&format!("{rule} counter packets")))
        .and_then(|l| l.split("packets ").nth(1))
        .and_then(|n| n.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the refusal rule {rule:?}:\n{table}"));
    (packets, table)
}

#[test]
fn a_vm_and_a_pod_get_eth0_from_vmpath_as_their_default_network() {
    let mut node = Node::new("pn");
    let peer = node.add_vm(
        "vm2",
        "52:54:00:00:31:0c",
        &["10.31.0.12/24"],
        Some(GATEWAY),
    );
    let tag = unique_tag();
    // The network blue as the pod network (role: Primary), its NAD, the VM
    // of the fixture (multus default: true, its virt-launcher pod with the
    // default-network annotation, its claim), a plain pod whose default
    // network is blue; and a Primary network over the cluster's Service
    // CIDR, which is refused while the rest applies.
    let primary = NETWORK.replace("  id: 310\n", "  id: 310\n  role: Primary\n");
    let web = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web-0\n  namespace: prod\n  uid: u-web-{tag}\n  \
         annotations: {{v1.multus-cni.io/default-network: prod/blue}}\n\
         spec: {{nodeName: {}}}\nstatus: {{phase: Running}}\n",
        node.name
    );
    let clash = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: clash}\n\
                 spec: {id: 312, role: Primary, subnets: [10.96.4.0/24], ipam: {mode: Disabled}}\n";
    node.write_config(
        "cluster.yaml",
        &[
            primary
                .split("\n---\n")
                .filter(|d| !d.contains("kind: Node"))
                .collect::<Vec<_>>()
                .join("\n---\n"),
            VM.replace("node-a", &node.name),
            web,
            clash.to_string(),
        ]
        .join("\n---\n"),
    );
    node.write_config(
        "vm2.yaml",
        &yaml::attachment(
            "vm2",
            "blue",
            &node.name,
            &peer.port,
            &peer.mac,
            &["10.31.0.12/24"],
        ),
    );
    node.set_agent_args(&[
        "--cluster-pod-cidrs",
        "10.244.0.0/16,fd00:10:244::/56",
        "--cluster-service-cidrs",
        "10.96.0.0/12",
    ]);
    node.start_agent();
    node.wait_ports(&[&peer.port]);
    let conf = multus::nad_conf(NETWORK, &node);

    // The address spaces: clash is refused naming itself and the CIDR.
    let status = node.status().expect("status");
    let errors = status["config_errors"].to_string();
    assert!(
        errors.contains(
            "10.96.4.0/24 of Primary network \\\"clash\\\" overlaps the cluster's Service CIDR 10.96.0.0/12 (--cluster-service-cidrs)"
        ),
        "{errors}"
    );

    // The virt-launcher pod's eth0 (pod default sysctls: IPv6 on, as a
    // runtime leaves a new pod).
    let launcher = Netns::new(format!("vt{tag}-launcher"));
    let (ok, result) = add_default_network(
        &node,
        &conf,
        LAUNCHER,
        "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b",
        &launcher,
        &format!("c{tag}vm1"),
    );
    assert!(ok, "ADD of the virt-launcher pod's eth0: {result}");
    // The result makes the VM's address the pod's IP (what the runtime
    // reports to kubelet), with vmpath's gateway as the default route.
    assert_eq!(
        result["ips"][0]["address"],
        format!("{VM_IP}/24"),
        "{result}"
    );
    assert_eq!(result["ips"][0]["gateway"], GATEWAY, "{result}");
    assert!(
        result["routes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["dst"] == "0.0.0.0/0" && r["gw"] == GATEWAY),
        "{result}"
    );
    // Nothing in the pod: the VM behind it asks by DHCP.
    let addrs = launcher.run(&["ip", "-4", "addr", "show", "dev", "eth0"]);
    assert!(!addrs.contains("inet "), "{addrs}");
    let a = node.attachment_view("vm1").expect("VM vm1 derived");
    assert_eq!(
        (&a["namespace"], &a["interface"], &a["network"], &a["mac"]),
        (
            &"prod".into(),
            &"default".into(),
            &"blue".into(),
            &VM_MAC.into()
        ),
        "{a}"
    );
    assert_eq!(a["port"], result["interfaces"][0]["name"], "{a}\n{result}");

    // KubeVirt's bridge binding: eth0 into a bridge with the VM's tap; the
    // guest (its own namespace here) has the VMI's MAC.
    let guest = Netns::new(format!("vt{tag}-guest"));
    launcher.run(&["ip", "link", "add", "k6t-eth0", "type", "bridge"]);
    launcher.run(&["ip", "link", "set", "eth0", "master", "k6t-eth0"]);
    vmpath_tests::veth(&launcher, "tap0", &guest, "eth0");
    launcher.run(&["ip", "link", "set", "tap0", "master", "k6t-eth0"]);
    for dev in ["k6t-eth0", "tap0"] {
        launcher.run(&["ip", "link", "set", dev, "up"]);
    }
    guest.run(&["ip", "link", "set", "eth0", "address", VM_MAC]);
    guest.run(&["ip", "link", "set", "eth0", "up"]);
    let dir = std::env::temp_dir().join(format!("vmpath-pod-network-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let (ip, router) = dhcp(&guest, "eth0", &dir);
    assert_eq!(
        (ip.as_str(), router.as_str()),
        (VM_IP, GATEWAY),
        "the lease"
    );
    let routes = guest.run(&["ip", "-4", "route", "show", "default"]);
    assert!(routes.contains(&format!("via {GATEWAY}")), "{routes}");
    assert!(guest.ping(GATEWAY, 3), "the guest reaches vmpath's gateway");
    assert!(guest.ping("10.31.0.12", 3), "the guest reaches VM vm2");
    assert!(peer.ns.ping(VM_IP, 3), "VM vm2 reaches the guest");

    // A plain pod: eth0 with its address and the default route to the
    // gateway, from the plugin.
    let pod = Netns::new(format!("vt{tag}-web"));
    let (ok, result) = add_default_network(
        &node,
        &conf,
        "web-0",
        &format!("u-web-{tag}"),
        &pod,
        &format!("c{tag}web"),
    );
    assert!(ok, "ADD of the plain pod's eth0: {result}");
    let pod_ip = result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.split_once('/'))
        .map(|(ip, _)| ip.to_string())
        .unwrap_or_else(|| panic!("an address: {result}"));
    let addrs = pod.run(&["ip", "-4", "addr", "show", "dev", "eth0"]);
    assert!(addrs.contains(&format!("inet {pod_ip}/24")), "{addrs}");
    let routes = pod.run(&["ip", "-4", "route", "show", "default"]);
    assert!(
        routes.contains(&format!("default via {GATEWAY} dev eth0")),
        "{routes}"
    );
    let w = node.attachment_view("web-0").expect("pod web-0 derived");
    assert_eq!(w["interface"], "eth0", "{w}");
    assert!(pod.ping(VM_IP, 3), "the pod reaches the VM");
    assert!(guest.ping(&pod_ip, 3), "the VM reaches the pod");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The pod network and the cluster's own network (issue 36 items 2-4),
/// on the stand-in of `vmpath_tests::cluster_net`: node pc runs vmpath and
/// is node 0 of the cluster's network, node 1 only the cluster's network
/// (its pods, kube-proxy's rules, the API server). A pod whose `eth0` is
/// vmpath's (web-0, namespace prod) resolves names through the DNS
/// ClusterIP, reaches ClusterIPs over TCP and UDP whose backends are
/// cluster-network pods on the other node, the `kubernetes` Service, and
/// such a pod by address, translated to its node's address (the other
/// node cannot route back to a vmpath network). Its node's kubelet-style
/// probe and a cluster-network pod through a ClusterIP reach it. Its
/// egress policy applies to what it hands off. And the hand-off cannot
/// carry it to another vmpath endpoint (VM vault, namespace bank, whose
/// policy admits nothing) through a kube-proxy Service, translated or not.
#[test]
fn a_pod_on_the_pod_network_reaches_the_clusters_dns_services_and_pods_and_is_reached() {
    use vmpath_tests::cluster_net::{
        self, ClusterNet, DNS_IP, Dns, Echo, POD_CIDR, Proto, SERVICE_CIDR, ask, resolve,
    };
    use vmpath_tests::vmpath::common::drop_reason;

    assert!(
        cluster_net::have_dnsmasq(),
        "dnsmasq is missing: run `cargo xtask setup`"
    );
    let mut node = Node::new("pc");
    let other = Netns::new(format!("vt{}-pc1", unique_tag()));
    let cluster = ClusterNet::new(&[&node.ns, &other]);
    let (node_ip, other_ip) = (
        cluster.nodes[0].address.clone(),
        cluster.nodes[1].address.clone(),
    );

    // The cluster's network: DNS and a web server on the other node, a
    // client pod on this one, the API server on the other node's address.
    let (dns_pod, dns_ip) = cluster.nodes[1].pod("dns");
    let (web_pod, web_ip) = cluster.nodes[1].pod("web");
    let (client_pod, client_ip) = cluster.nodes[0].pod("client");
    let _client_tcp = Echo::start(&client_pod, Proto::Tcp, 8080);
    let _web_tcp = Echo::start(&web_pod, Proto::Tcp, 8080);
    let _web_udp = Echo::start(&web_pod, Proto::Udp, 5353);
    let _api = Echo::start(&other, Proto::Tcp, 6443);
    let _dns = Dns::start(
        &dns_pod,
        &dns_ip,
        &[
            ("web.prod.svc", "10.96.0.20"),
            ("kubernetes.default.svc", "10.96.0.1"),
        ],
    );

    // vmpath: blue is the pod network; VM vault (namespace bank) beside it.
    let vault = node.add_vm(
        "vault",
        "52:54:00:00:31:0d",
        &["10.31.0.13/24"],
        Some(GATEWAY),
    );
    // This node's v1 Node: its pod CIDR is the one the hand-off does not
    // masquerade towards.
    let this_node = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {}}}\nspec: {{podCIDRs: [{}]}}\n",
        node.name, cluster.nodes[0].pod_cidr
    );
    let pod = start_pod_network(
        &mut node,
        &vault,
        &["10.31.0.13/24"],
        &primary_network(false),
        &[this_node],
        [POD_CIDR, SERVICE_CIDR],
    );
    let pod_ip = address_of(&pod.result, false);
    let pod = pod.ns;
    let _pod_tcp = Echo::start(&pod, Proto::Tcp, 8080);
    // UDP: a one-way datagram is all an intruder needs, and an unconnected
    // socket takes the answer from whichever address it comes.
    let _vault_udp = Echo::start(&vault.ns, Proto::Udp, 5353);

    // kube-proxy's Services, on both nodes.
    let svc = cluster_net::one_endpoint_service;
    cluster.kube_proxy(&[
        cluster_net::dns_service(DNS_IP, &dns_ip),
        svc(
            "default/kubernetes:https",
            "10.96.0.1",
            443,
            Proto::Tcp,
            None,
            (&other_ip, 6443),
        ),
        svc(
            "prod/web:http",
            "10.96.0.20",
            80,
            Proto::Tcp,
            None,
            (&web_ip, 8080),
        ),
        svc(
            "prod/web:udp",
            "10.96.0.21",
            5353,
            Proto::Udp,
            None,
            (&web_ip, 5353),
        ),
        svc(
            "prod/web-0:http",
            "10.96.0.30",
            80,
            Proto::Tcp,
            Some(30080),
            (&pod_ip, 8080),
        ),
        svc(
            "prod/client:http",
            "10.96.0.50",
            80,
            Proto::Tcp,
            None,
            (&client_ip, 8080),
        ),
        svc(
            "bank/vault:udp",
            "10.96.0.40",
            5353,
            Proto::Udp,
            None,
            ("10.31.0.13", 5353),
        ),
    ]);

    // Names through the DNS ClusterIP (UDP to a pod on the other node).
    wait_for(
        "web.prod.svc resolved through the DNS ClusterIP",
        Duration::from_secs(20),
        || resolve(&pod, "web.prod.svc.cluster.local", DNS_IP).as_deref() == Some("10.96.0.20"),
    );
    assert_eq!(
        resolve(&pod, "kubernetes.default.svc.cluster.local", DNS_IP).as_deref(),
        Some("10.96.0.1")
    );
    // ClusterIPs over TCP and UDP to a pod on the other node, the
    // `kubernetes` Service, and that pod by address: each arrives from the
    // node's address, each answer comes back.
    let from_node = format!("probe from {node_ip}");
    assert_eq!(
        ask(&pod, Proto::Tcp, "10.96.0.20", 80),
        Some(from_node.clone()),
        "TCP ClusterIP"
    );
    assert_eq!(
        ask(&pod, Proto::Udp, "10.96.0.21", 5353),
        Some(from_node.clone()),
        "UDP ClusterIP"
    );
    assert_eq!(
        ask(&pod, Proto::Tcp, "10.96.0.1", 443),
        Some(from_node.clone()),
        "kubernetes Service"
    );
    assert_eq!(
        ask(&pod, Proto::Tcp, &web_ip, 8080),
        Some(from_node.clone()),
        "a cluster pod by address"
    );
    // A backend in this node's own pod CIDR answers through this node, so
    // it sees the endpoint's own address, by ClusterIP and by address.
    let from_pod = format!("probe from {pod_ip}");
    assert_eq!(
        ask(&pod, Proto::Tcp, "10.96.0.50", 80),
        Some(from_pod.clone()),
        "a ClusterIP whose backend is on this node; the hand-off:\n{}\nstatus: {}",
        node.ns
            .run(&["nft", "list", "table", "inet", "vmpath_handoff"]),
        node.status()
            .map(|s| s["errors"].to_string())
            .unwrap_or_default()
    );
    assert_eq!(
        ask(&pod, Proto::Tcp, &client_ip, 8080),
        Some(from_pod),
        "a cluster pod on this node by address"
    );

    // Reached: the node's kubelet-style TCP probe to the pod's IP, and a
    // cluster-network pod on this node through a ClusterIP and through
    // this node's NodePort, its own address kept.
    assert!(
        ask(&node.ns, Proto::Tcp, &pod_ip, 8080).is_some(),
        "kubelet's probe"
    );
    let via_cluster_ip = ask(&client_pod, Proto::Tcp, "10.96.0.30", 80).unwrap_or_default();
    assert!(
        via_cluster_ip.starts_with("probe from 10.244.0."),
        "{via_cluster_ip:?}"
    );
    assert!(
        ask(&client_pod, Proto::Tcp, &node_ip, 30080).is_some(),
        "the NodePort of this node"
    );

    // The tenant: the kube-proxy Service whose backend is VM vault (bank,
    // whose policy admits nothing) is not a way in: the node's stack
    // forwards nothing from one Primary network endpoint to another, so it
    // neither skips vault's policy nor wears the node's address there.
    node.write_config(
        "bank-policy.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {name: deny-in, namespace: bank}\n\
         spec: {podSelector: {}, policyTypes: [Ingress]}\n",
    );
    wait_for("vault isolated", Duration::from_secs(20), || {
        ask(&pod, Proto::Udp, "10.31.0.13", 5353).is_none()
    });
    assert!(
        node.drops(drop_reason::POLICY_DENIED_INGRESS) > 0,
        "denied by vault's policy"
    );
    assert_eq!(
        ask(&pod, Proto::Udp, "10.96.0.40", 5353),
        None,
        "web-0 reached vault through the node's stack"
    );
    let (refused, table) = stack_refusals(&node, "ip saddr @primary4 ip daddr @primary4");
    assert!(refused > 0, "the stack's refusal is counted:\n{table}");

    // web-0's own egress policy applies to what it hands off.
    node.write_config(
        "prod-policy.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {name: deny-out, namespace: prod}\n\
         spec: {podSelector: {}, policyTypes: [Egress]}\n",
    );
    wait_for("web-0's egress isolated", Duration::from_secs(20), || {
        ask(&pod, Proto::Tcp, "10.96.0.20", 80).is_none()
    });
    assert!(node.drops(drop_reason::POLICY_DENIED_EGRESS) > 0);
    assert!(
        ask(&node.ns, Proto::Tcp, &pod_ip, 8080).is_some(),
        "kubelet's probe under deny-all"
    );
}

/// The same crossing over IPv6, on a dual-stack pod network: names
/// through the DNS Service's IPv6 ClusterIP (an AAAA query over IPv6), TCP
/// and UDP ClusterIPs, the `kubernetes` Service and a cluster pod by
/// address, all from the node's IPv6 address (ip6tables' kube-proxy
/// chains, the hand-off's `ip6` masquerade); kubelet's probe to the pod's
/// IPv6 address, a cluster pod on this node through an IPv6 ClusterIP (its
/// own address kept) and through this node's IPv6 NodePort; and the
/// tenant's way round: a kube-proxy Service whose backend is another
/// namespace's VM is refused by the stack (`ip6 saddr @primary6 ip6 daddr
/// @primary6`, counted) while the data path still carries the direct path.
#[test]
fn a_pod_on_a_dual_stack_pod_network_reaches_the_clusters_services_over_ipv6_and_is_reached() {
    use vmpath_tests::cluster_net::{
        self, ClusterNet, DNS_IP6, Dns, Echo, POD_CIDR, POD_CIDR6, Proto, SERVICE_CIDR,
        SERVICE_CIDR6, ask, resolve,
    };

    assert!(
        cluster_net::have_dnsmasq(),
        "dnsmasq is missing: run `cargo xtask setup`"
    );
    let mut node = Node::new("p6");
    let other = Netns::new(format!("vt{}-p61", unique_tag()));
    let cluster = ClusterNet::new(&[&node.ns, &other]);
    let (node_ip6, other_ip6) = (
        cluster.nodes[0].address6.clone(),
        cluster.nodes[1].address6.clone(),
    );

    let (dns_pod, _, dns_ip6) = cluster.nodes[1].pod_dual("dns");
    let (web_pod, _, web_ip6) = cluster.nodes[1].pod_dual("web");
    let (client_pod, _, client_ip6) = cluster.nodes[0].pod_dual("client");
    let _web_tcp = Echo::start6(&web_pod, Proto::Tcp, 8080);
    let _web_udp = Echo::start6(&web_pod, Proto::Udp, 5353);
    let _api = Echo::start6(&other, Proto::Tcp, 6443);
    let _dns = Dns::start_on(
        &dns_pod,
        &[&dns_ip6],
        &[
            ("web.prod.svc", "fd00:10:96::14"),
            ("kubernetes.default.svc", "fd00:10:96::1"),
        ],
    );

    // blue, dual-stack, is the pod network; VM vault (namespace bank) on it.
    let vault = node.add_vm(
        "vault",
        "52:54:00:00:31:0d",
        &["10.31.0.13/24", "fd31::13/64"],
        Some(GATEWAY),
    );
    let pod = start_pod_network(
        &mut node,
        &vault,
        &["10.31.0.13/24", "fd31::13/64"],
        &primary_network(true),
        &[],
        [
            &format!("{POD_CIDR},{POD_CIDR6}"),
            &format!("{SERVICE_CIDR},{SERVICE_CIDR6}"),
        ],
    );
    let pod_ip6 = address_of(&pod.result, true);
    let pod = pod.ns;
    wait_for(
        "web-0's IPv6 address past DAD",
        Duration::from_secs(10),
        || {
            !pod.run(&["ip", "-6", "addr", "show", "dev", "eth0", "tentative"])
                .contains("inet6")
        },
    );
    let _pod_tcp = Echo::start6(&pod, Proto::Tcp, 8080);
    let _vault_udp = Echo::start6(&vault.ns, Proto::Udp, 5353);

    let svc = cluster_net::one_endpoint_service;
    cluster.kube_proxy(&[
        cluster_net::dns_service(DNS_IP6, &dns_ip6),
        svc(
            "default/kubernetes:https",
            "fd00:10:96::1",
            443,
            Proto::Tcp,
            None,
            (&other_ip6, 6443),
        ),
        svc(
            "prod/web:http",
            "fd00:10:96::14",
            80,
            Proto::Tcp,
            None,
            (&web_ip6, 8080),
        ),
        svc(
            "prod/web:udp",
            "fd00:10:96::15",
            5353,
            Proto::Udp,
            None,
            (&web_ip6, 5353),
        ),
        svc(
            "prod/web-0:http",
            "fd00:10:96::1e",
            80,
            Proto::Tcp,
            Some(30080),
            (&pod_ip6, 8080),
        ),
        svc(
            "bank/vault:udp",
            "fd00:10:96::28",
            5353,
            Proto::Udp,
            None,
            ("fd31::13", 5353),
        ),
    ]);

    // Out: each arrives from the node's IPv6 address, each answer returns.
    wait_for(
        "web.prod.svc resolved through the DNS Service's IPv6 ClusterIP",
        Duration::from_secs(20),
        || {
            resolve(&pod, "web.prod.svc.cluster.local", DNS_IP6).as_deref()
                == Some("fd00:10:96::14")
        },
    );
    let from_node = format!("probe from {node_ip6}");
    assert_eq!(
        ask(&pod, Proto::Tcp, "fd00:10:96::14", 80),
        Some(from_node.clone()),
        "TCP ClusterIP over IPv6"
    );
    assert_eq!(
        ask(&pod, Proto::Udp, "fd00:10:96::15", 5353),
        Some(from_node.clone()),
        "UDP ClusterIP over IPv6"
    );
    assert_eq!(
        ask(&pod, Proto::Tcp, "fd00:10:96::1", 443),
        Some(from_node.clone()),
        "kubernetes Service over IPv6"
    );
    assert_eq!(
        ask(&pod, Proto::Tcp, &web_ip6, 8080),
        Some(from_node),
        "a cluster pod by its IPv6 address"
    );

    // In: kubelet's probe, a cluster pod on this node through a ClusterIP
    // (its own address kept) and through this node's NodePort.
    assert!(
        ask(&node.ns, Proto::Tcp, &pod_ip6, 8080).is_some(),
        "kubelet's probe to the pod's IPv6 address"
    );
    assert_eq!(
        ask(&client_pod, Proto::Tcp, "fd00:10:96::1e", 80),
        Some(format!("probe from {client_ip6}")),
        "a cluster pod through an IPv6 ClusterIP"
    );
    assert!(
        ask(&client_pod, Proto::Tcp, &node_ip6, 30080).is_some(),
        "the IPv6 NodePort of this node"
    );

    // The tenant's way round: vault directly (the data path) answers, the
    // kube-proxy Service with vault behind it (the stack) does not.
    assert_eq!(
        ask(&pod, Proto::Udp, "fd31::13", 5353),
        Some(format!("probe from {pod_ip6}")),
        "web-0 to vault through the data path"
    );
    assert_eq!(
        ask(&pod, Proto::Udp, "fd00:10:96::28", 5353),
        None,
        "web-0 reached vault through the node's stack"
    );
    let (refused, table) = stack_refusals(&node, "ip6 saddr @primary6 ip6 daddr @primary6");
    assert!(refused > 0, "the stack's refusal is counted:\n{table}");
}

/// What the node's stack delivers to a pod-network endpoint meets the
/// endpoint's ingress policy (`vm_from_stack`, the port's tcx egress): a
/// cluster-network pod on this node, by the pod's address (the node routes
/// it) and through a kube-proxy ClusterIP (translated by the node, its
/// source kept), is refused once a policy isolates the pod, and counted;
/// the node's own kubelet-style probe still passes, as Kubernetes
/// defines; an `ipBlock` naming the cluster pod's CIDR lets it in again,
/// and its answers come back (the endpoint's egress passes on the flow
/// the ingress check recorded).
#[test]
fn an_isolated_pod_network_endpoint_admits_its_nodes_kubelet_and_only_what_its_policy_allows_from_the_cluster()
 {
    use vmpath_tests::cluster_net::{ClusterNet, Echo, POD_CIDR, Proto, SERVICE_CIDR, ask};
    use vmpath_tests::vmpath::common::drop_reason;

    let mut node = Node::new("pi");
    let other = Netns::new(format!("vt{}-pi1", unique_tag()));
    let cluster = ClusterNet::new(&[&node.ns, &other]);
    let (client_pod, client_ip) = cluster.nodes[0].pod("client");
    let vault = node.add_vm(
        "vault",
        "52:54:00:00:31:0d",
        &["10.31.0.13/24"],
        Some(GATEWAY),
    );
    let this_node = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {}}}\nspec: {{podCIDRs: [{}]}}\n",
        node.name, cluster.nodes[0].pod_cidr
    );
    let pod = start_pod_network(
        &mut node,
        &vault,
        &["10.31.0.13/24"],
        &primary_network(false),
        &[this_node],
        [POD_CIDR, SERVICE_CIDR],
    );
    let pod_ip = address_of(&pod.result, false);
    let pod = pod.ns;
    let _pod_tcp = Echo::start(&pod, Proto::Tcp, 8080);
    cluster.kube_proxy(&[vmpath_tests::cluster_net::one_endpoint_service(
        "prod/web-0:http",
        "10.96.0.30",
        80,
        Proto::Tcp,
        None,
        (&pod_ip, 8080),
    )]);
    let from_client = format!("probe from {client_ip}");
    wait_for(
        "the cluster pod reaches web-0 by address",
        Duration::from_secs(20),
        || ask(&client_pod, Proto::Tcp, &pod_ip, 8080).as_deref() == Some(from_client.as_str()),
    );
    assert_eq!(
        ask(&client_pod, Proto::Tcp, "10.96.0.30", 80).as_deref(),
        Some(from_client.as_str()),
        "through the ClusterIP, not isolated yet"
    );

    // Isolated for ingress: nothing the cluster sends is admitted.
    node.write_config(
        "prod-policy.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {name: deny-in, namespace: prod}\n\
         spec: {podSelector: {}, policyTypes: [Ingress]}\n",
    );
    let denied = node.drops(drop_reason::POLICY_DENIED_INGRESS);
    wait_for("web-0 isolated", Duration::from_secs(20), || {
        ask(&client_pod, Proto::Tcp, &pod_ip, 8080).is_none()
    });
    assert_eq!(
        ask(&client_pod, Proto::Tcp, "10.96.0.30", 80),
        None,
        "the cluster pod through the ClusterIP"
    );
    assert!(
        node.drops(drop_reason::POLICY_DENIED_INGRESS) > denied,
        "the refusals are counted as policy's"
    );
    assert_eq!(
        ask(&node.ns, Proto::Tcp, &pod_ip, 8080).as_deref(),
        Some(format!("probe from {}", cluster.nodes[0].address).as_str()),
        "kubelet's probe from the node passes an isolating policy"
    );

    // An ipBlock of the cluster's pod CIDR admits the cluster pod again,
    // by address and through the ClusterIP; its answers come back.
    node.write_config(
        "prod-policy.yaml",
        &format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {{name: from-cluster-pods, namespace: prod}}\n\
             spec:\n  podSelector: {{}}\n  policyTypes: [Ingress]\n  \
             ingress:\n  - from: [{{ipBlock: {{cidr: {POD_CIDR}}}}}]\n    \
             ports: [{{protocol: TCP, port: 8080}}]\n"
        ),
    );
    wait_for(
        "the ipBlock admits the cluster pod",
        Duration::from_secs(20),
        || ask(&client_pod, Proto::Tcp, &pod_ip, 8080).as_deref() == Some(from_client.as_str()),
    );
    assert_eq!(
        ask(&client_pod, Proto::Tcp, "10.96.0.30", 80).as_deref(),
        Some(from_client.as_str()),
        "through the ClusterIP"
    );

    // Isolated both ways: web-0's answers pass its egress policy on the
    // flows the stack's frames opened, TCP and UDP from the cluster pod,
    // and UDP from the node, which no reply's shape tells from a datagram
    // web-0 would start; web-0's own new flows do not.
    let _pod_udp = Echo::start(&pod, Proto::Udp, 5353);
    let _client_tcp = Echo::start(&client_pod, Proto::Tcp, 8080);
    node.write_config(
        "prod-policy.yaml",
        &format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {{name: from-cluster-pods, namespace: prod}}\n\
             spec:\n  podSelector: {{}}\n  policyTypes: [Ingress, Egress]\n  \
             ingress:\n  - from: [{{ipBlock: {{cidr: {POD_CIDR}}}}}]\n    \
             ports: [{{protocol: TCP, port: 8080}}, {{protocol: UDP, port: 5353}}]\n"
        ),
    );
    let denied_out = node.drops(drop_reason::POLICY_DENIED_EGRESS);
    wait_for("web-0 isolated for egress", Duration::from_secs(20), || {
        ask(&pod, Proto::Tcp, &client_ip, 8080).is_none()
    });
    assert!(node.drops(drop_reason::POLICY_DENIED_EGRESS) > denied_out);
    assert_eq!(
        ask(&client_pod, Proto::Tcp, &pod_ip, 8080).as_deref(),
        Some(from_client.as_str()),
        "TCP from the cluster pod, answered"
    );
    assert_eq!(
        ask(&client_pod, Proto::Udp, &pod_ip, 5353).as_deref(),
        Some(from_client.as_str()),
        "UDP from the cluster pod, answered"
    );
    assert_eq!(
        ask(&node.ns, Proto::Udp, &pod_ip, 5353).as_deref(),
        Some(format!("probe from {}", cluster.nodes[0].address).as_str()),
        "UDP from the node, answered"
    );
}

use vmpath_tests::{Underlay, UnderlayFamily, yaml_overlay};

/// Two vmpath nodes on an underlay of `family` with the cluster's own
/// network across them: pod web-0 (the pod network's eth0, dual-stack on
/// an IPv6 underlay) on node a with VM vault (bank) beside it, its
/// network-status written back as Multus writes it and read by both
/// agents; a cluster-network pod on b; TCP echo servers in web-0.
struct ReachBed {
    a: Node,
    b: Node,
    cluster: vmpath_tests::cluster_net::ClusterNet,
    family: UnderlayFamily,
    vault: vmpath_tests::Vm,
    pod: Netns,
    /// web-0's address of the underlay's family, and the client's.
    pod_ip: String,
    client_pod: Netns,
    client_ip: String,
    _underlay: Underlay,
    _echo: Vec<vmpath_tests::cluster_net::Echo>,
}

impl ReachBed {
    /// Writes one NetworkPolicy `name` of namespace prod, selecting every
    /// pod, isolated for ingress with `ingress` (its YAML, or nothing), to
    /// both nodes.
    fn policy(&self, name: &str, ingress: &str) {
        let doc = format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
             metadata: {{name: {name}, namespace: prod}}\n\
             spec:\n  podSelector: {{}}\n  policyTypes: [Ingress]\n{ingress}"
        );
        self.a.write_config("prod-policy.yaml", &doc);
        self.b.write_config("prod-policy.yaml", &doc);
    }

    /// web-0 isolated: the cluster pod on b and b's own stack are refused
    /// (counted on a; another node is not web-0's kubelet) while a's own
    /// stack passes; then an `ipBlock` of `pod_cidr` admits the pod again
    /// (`from_client`: what web-0's echo answers it).
    fn isolated_then_admitted(&self, pod_cidr: &str, from_client: &str) {
        use vmpath_tests::cluster_net::{Proto, ask};
        use vmpath_tests::vmpath::common::drop_reason;
        let (a, b, pod_ip, client) = (&self.a, &self.b, &self.pod_ip, &self.client_pod);
        self.policy("deny-in", "");
        let denied = a.drops(drop_reason::POLICY_DENIED_INGRESS);
        wait_for("web-0 isolated", Duration::from_secs(20), || {
            ask(client, Proto::Tcp, pod_ip, 8080).is_none()
        });
        assert!(a.drops(drop_reason::POLICY_DENIED_INGRESS) > denied);
        assert_eq!(
            ask(&b.ns, Proto::Tcp, pod_ip, 8080),
            None,
            "another node is not web-0's kubelet"
        );
        assert!(
            ask(&a.ns, Proto::Tcp, pod_ip, 8080).is_some(),
            "web-0's own node is"
        );
        self.policy(
            "from-cluster-pods",
            &format!("  ingress:\n  - from: [{{ipBlock: {{cidr: '{pod_cidr}'}}}}]\n"),
        );
        wait_for(
            &format!("the ipBlock {pod_cidr} admits the cluster pod on b"),
            Duration::from_secs(20),
            || ask(client, Proto::Tcp, pod_ip, 8080).as_deref() == Some(from_client),
        );
    }

    fn start(family: UnderlayFamily) -> ReachBed {
        use vmpath_tests::cluster_net::{
            ClusterNet, Echo, POD_CIDR, POD_CIDR6, Proto, SERVICE_CIDR, SERVICE_CIDR6,
        };
        let v6 = family == UnderlayFamily::V6;
        let underlay = Underlay::new();
        let mut a = Node::new("ra");
        let mut b = Node::new("rb");
        underlay.plug(&a.ns, "ul0", &family.node_cidr(1), 1500);
        underlay.plug(&b.ns, "ul0", &family.node_cidr(2), 1500);
        let cluster = ClusterNet::new(&[&a.ns, &b.ns]);
        let (client_pod, client4, client6) = cluster.nodes[1].pod_dual("client");
        let nodes = [
            yaml_overlay::node(&a.name, &family.node_ip(1)),
            yaml_overlay::node(&b.name, &family.node_ip(2)),
        ]
        .join("\n---\n");
        let vault = a.add_vm(
            "vault",
            "52:54:00:00:31:0d",
            &["10.31.0.13/24"],
            Some(GATEWAY),
        );
        let cidrs = if v6 {
            [
                format!("{POD_CIDR},{POD_CIDR6}"),
                format!("{SERVICE_CIDR},{SERVICE_CIDR6}"),
            ]
        } else {
            [POD_CIDR.to_string(), SERVICE_CIDR.to_string()]
        };
        let primary = primary_network(v6);
        let web = start_pod_network(
            &mut a,
            &vault,
            &["10.31.0.13/24"],
            &primary,
            std::slice::from_ref(&nodes),
            [&cidrs[0], &cidrs[1]],
        );
        let ips: Vec<String> = [false, true]
            .into_iter()
            .filter(|six| !*six || v6)
            .map(|six| format!("\"{}\"", address_of(&web.result, six)))
            .collect();
        let mac = web.result["interfaces"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["sandbox"].is_string())
            .and_then(|i| i["mac"].as_str())
            .unwrap_or_else(|| panic!("the pod's MAC in {}", web.result))
            .to_string();
        // What Multus writes back once the ADD answered, which every
        // node's agent reads: the pod's interface on the pod network.
        let with_status = web.doc.replace(
            "annotations: {v1.multus-cni.io/default-network: prod/blue}",
            &format!(
                "annotations: {{v1.multus-cni.io/default-network: prod/blue, \
                 k8s.v1.cni.cncf.io/network-status: '[{{\"name\":\"prod/blue\",\"interface\":\"eth0\",\
                 \"ips\":[{}],\"mac\":\"{mac}\",\"default\":true}}]'}}",
                ips.join(",")
            ),
        );
        assert_ne!(with_status, web.doc);
        let cluster_yaml = [primary, with_status, nodes].join("\n---\n");
        a.write_config("cluster.yaml", &cluster_yaml);
        b.write_config("cluster.yaml", &cluster_yaml);
        b.set_agent_args(&[
            "--cluster-pod-cidrs",
            &cidrs[0],
            "--cluster-service-cidrs",
            &cidrs[1],
        ]);
        b.start_agent();
        let mut echo = vec![Echo::start(&web.ns, Proto::Tcp, 8080)];
        if v6 {
            echo.push(Echo::start6(&web.ns, Proto::Tcp, 8080));
        }
        ReachBed {
            pod_ip: address_of(&web.result, v6),
            client_ip: if v6 { client6 } else { client4 },
            a,
            b,
            cluster,
            family,
            vault,
            pod: web.ns,
            client_pod,
            _underlay: underlay,
            _echo: echo,
        }
    }
}

/// Reached from another node (docs/kubernetes.md; `ebpf/src/reach.rs`): web-0
/// runs on node a; node b routes the pod network's subnet into its vxlan
/// device, whose program sends it to a over the overlay, and a sends
/// web-0's answers back to b's stack, whose conntrack saw them leave. A
/// cluster-network pod on b reaches web-0 by address (its own address
/// seen), b's NodePort (kube-proxy's translation on b) and b's own stack
/// reach it too. web-0's ingress policy judges them all by address on a:
/// isolated, the cluster pod on b and b's node are refused and counted
/// (only a, web-0's own node, passes as its kubelet), and an `ipBlock` of
/// the cluster's pod CIDR lets the pod in again. Without the reach, b has
/// no route to the pod network at all.
#[test]
fn a_pod_network_endpoint_is_reached_from_another_nodes_pods_nodeport_and_stack() {
    use vmpath_tests::cluster_net::{POD_CIDR, Proto, ask};
    use vmpath_tests::vmpath::common::drop_reason;

    let bed = ReachBed::start(UnderlayFamily::V4);
    let ReachBed {
        a,
        b,
        cluster,
        family,
        vault,
        pod,
        client_pod,
        ..
    } = &bed;
    let (pod_ip, client_ip, b_ip) = (&bed.pod_ip, &bed.client_ip, &cluster.nodes[1].address);
    cluster.kube_proxy(&[vmpath_tests::cluster_net::one_endpoint_service(
        "prod/web-0:http",
        "10.96.0.30",
        80,
        Proto::Tcp,
        Some(30080),
        (pod_ip, 8080),
    )]);

    // A cluster pod on b, by address: over the overlay, its address kept.
    let from_client = format!("probe from {client_ip}");
    wait_for(
        "a cluster pod on b reaches web-0 on a by address",
        Duration::from_secs(30),
        || ask(client_pod, Proto::Tcp, pod_ip, 8080).as_deref() == Some(from_client.as_str()),
    );
    // b's NodePort and ClusterIP (kube-proxy on b translates to web-0).
    assert!(
        ask(client_pod, Proto::Tcp, b_ip, 30080).is_some(),
        "b's NodePort to web-0 on a"
    );
    assert_eq!(
        ask(client_pod, Proto::Tcp, "10.96.0.30", 80).as_deref(),
        Some(from_client.as_str()),
        "the ClusterIP from a cluster pod on b"
    );
    // b's own stack (kubelet-style, from another node).
    let from_b = ask(&b.ns, Proto::Tcp, pod_ip, 8080).unwrap_or_default();
    assert!(from_b.starts_with("probe from "), "b's stack: {from_b:?}");

    // Isolated: what b sends is judged on a, by address.
    bed.isolated_then_admitted(POD_CIDR, &from_client);

    // The tenants: the overlay's reserved VNI carries another node's
    // stack, so whoever could write it could hand web-0 a frame from any
    // address (one the ipBlock admits) or hand a node's stack one from
    // any endpoint. A cluster pod on b writes VXLAN with that VNI to a
    // (refused: from no node), VM vault (bank, a Primary endpoint on a)
    // to b's VTEP (refused at its port's egress: as the node's own frame
    // it would pass) and to a itself (refused by the hand-off's table);
    // each inner datagram claims a cluster pod's address towards web-0's
    // UDP listener. None arrives; a genuine datagram does.
    let seen = a.state_dir.parent().unwrap().join("web0-udp.log");
    let mut sink = pod.spawn(&[
        "python3",
        "-c",
        &format!(
            "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             s.bind(('0.0.0.0', 5353))\nwhile True:\n    d, _ = s.recvfrom(2048)\n    \
             open('{}', 'a').write(d.decode(errors='replace') + '\\n')\n",
            seen.display()
        ),
    ]);
    let received = || std::fs::read_to_string(&seen).unwrap_or_default();
    let genuine = |mark: &str| {
        wait_for(
            &format!("web-0 receives the cluster pod's {mark}"),
            Duration::from_secs(10),
            || {
                client_pod.scapy(&format!(
                    "send(IP(dst='{pod_ip}')/UDP(sport=40001, dport=5353)/Raw(b'{mark}'))"
                ));
                received().contains(mark)
            },
        )
    };
    bed.policy(
        "from-cluster-pods",
        &format!(
            "  ingress:\n  - from: [{{ipBlock: {{cidr: {POD_CIDR}}}}}]\n    \
             ports: [{{protocol: TCP, port: 8080}}, {{protocol: UDP, port: 5353}}]\n"
        ),
    );
    genuine("GENUINE-BEFORE");
    let a_ip = cluster.nodes[0].address.clone();
    let forged = |to: &str, mark: &str| {
        format!(
            "send(IP(dst='{to}')/UDP(sport=40000, dport=4789)/VXLAN(vni=0, flags=0x08)/\
             Ether(src='02:00:00:00:00:99', dst='02:00:00:00:00:98')/\
             IP(src='10.244.1.99', dst='{pod_ip}')/UDP(sport=40002, dport=5353)/Raw(b'{mark}'), count=3)"
        )
    };
    let unknown_vtep = a.drops(drop_reason::OVERLAY_UNKNOWN_VTEP);
    client_pod.scapy(&forged(&a_ip, "FORGED-BY-A-POD"));
    let injection = a.drops(drop_reason::OVERLAY_INJECTION);
    vault
        .ns
        .scapy(&forged(&family.node_ip(2), "FORGED-BY-A-VM-TO-B"));
    vault.ns.scapy(&forged(&a_ip, "FORGED-BY-A-VM-TO-A"));
    genuine("GENUINE-AFTER");
    let log = received();
    let _ = sink.kill();
    let _ = sink.wait();
    assert!(
        !log.contains("FORGED"),
        "web-0 received a forged frame:\n{log}"
    );
    assert!(
        a.drops(drop_reason::OVERLAY_UNKNOWN_VTEP) > unknown_vtep,
        "the pod's VXLAN, from no node, is refused and counted on a"
    );
    assert!(
        a.drops(drop_reason::OVERLAY_INJECTION) > injection,
        "the VM's VXLAN to b is refused at its port's egress and counted"
    );
    let table =
        a.ns.run(&["nft", "list", "table", "inet", "vmpath_handoff"]);
    let refused: u64 = table
        .lines()
        .filter(|l| l.contains("udp dport 4789 counter packets"))
        .filter_map(|l| {
            l.split("packets ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    assert!(
        refused > 0,
        "the VM's VXLAN to a, refused by the stack:\n{table}"
    );
}

/// The same reach over IPv6, on an IPv6 underlay (every Node's VTEP an
/// IPv6 address) and a dual-stack pod network: a cluster pod on node b
/// reaches web-0 on node a by its IPv6 address, its own IPv6 address
/// seen, and so does b's stack; isolated, both are refused and counted on
/// a while a's own stack passes (its kubelet), and an `ipBlock` of the
/// cluster's IPv6 pod CIDR admits the pod again.
#[test]
fn a_dual_stack_pod_network_endpoint_is_reached_from_another_node_over_an_ipv6_underlay() {
    use vmpath_tests::cluster_net::{POD_CIDR6, Proto, ask};

    let bed = ReachBed::start(UnderlayFamily::V6);
    let (b, pod_ip, client) = (&bed.b, &bed.pod_ip, &bed.client_pod);
    assert!(pod_ip.contains(':'), "{pod_ip}");
    let from_client = format!("probe from {}", bed.client_ip);
    wait_for(
        "a cluster pod on b reaches web-0 on a by its IPv6 address",
        Duration::from_secs(30),
        || ask(client, Proto::Tcp, pod_ip, 8080).as_deref() == Some(from_client.as_str()),
    );
    let from_b = ask(&b.ns, Proto::Tcp, pod_ip, 8080).unwrap_or_default();
    assert!(from_b.starts_with("probe from "), "b's stack: {from_b:?}");

    bed.isolated_then_admitted(POD_CIDR6, &from_client);
}
