//! A real QEMU guest on the vmpath pod network (issue 36), and its live
//! migration. KubeVirt's VM has `networks: [{name: default, multus:
//! {networkName: prod/blue, default: true}}]` on blue, `role: Primary`:
//! its virt-launcher pod carries `v1.multus-cni.io/default-network:
//! prod/blue` and gets its `eth0` from vmpath-cni as Multus calls it, the
//! guest bridged to it (KubeVirt's bridge binding) takes address, gateway
//! and resolver by vmpath's DHCP, nothing configured in the pod
//! (`qemu::migration::RealBed` on `BedNetwork::Pod`). Beside vmpath, the
//! cluster's own network (`vmpath_tests::cluster_net`): the `bridge` CNI
//! on every node, kube-proxy's rules, and on node c a DNS server and a web
//! server in cluster-network pods behind ClusterIPs.
//!
//! From the guest, as a user would check: a name resolved through the DNS
//! ClusterIP (the resolver its lease gave), HTTP to the web ClusterIP; a
//! kubelet-style HTTP probe from the guest's node to the pod's IP; and a
//! NodePort of node c (which never hosts the guest) reaching the guest's
//! web server from a cluster-network pod on c (reach: c routes the pod
//! network into its overlay). Then KubeVirt live-migrates it to node b
//! (the target pod made by vmpath-cni as Multus calls it), and the guest,
//! reading its own interface, has the same address and gateway, renews
//! the same lease with b's agent, and all of it works again, the probe
//! now from b, the NodePort now of c and of a, the node it left.

use std::time::Duration;

use vmpath_tests::{
    Netns, Node,
    cluster_net::{self, ClusterNet, DNS_IP, DOMAIN, Dns, Http, Proto, nslookup_answer},
    qemu::{
        Guest, QemuVm, again_if_a_guest_kernel_crashes,
        migration::{BedNetwork, GATEWAY, RealBed, VM1_IP, migrate},
    },
    wait_for,
};

/// The web Service's ClusterIP and its name.
const WEB_IP: &str = "10.96.0.20";
const WEB_NAME: &str = "web.prod.svc";
const WEB_BODY: &str = "hello from web, a cluster-network pod\n";
/// The guest's own web server, what kubelet probes.
const PROBE_PORT: u16 = 8080;
const PROBE_BODY: &str = "ok from the guest";
/// The NodePort of the guest's web server.
const NODE_PORT: u16 = 30080;

#[test]
fn a_real_guest_on_the_pod_network_reaches_the_clusters_dns_and_services_and_keeps_them_across_migration()
 {
    again_if_a_guest_kernel_crashes(
        a_real_guest_on_the_pod_network_reaches_the_clusters_dns_and_services_and_keeps_them_across_migration_once,
    );
}

fn a_real_guest_on_the_pod_network_reaches_the_clusters_dns_and_services_and_keeps_them_across_migration_once()
 {
    assert!(
        cluster_net::have_dnsmasq(),
        "dnsmasq is missing: run `cargo xtask setup`"
    );
    let mut bed = RealBed::boot_on(BedNetwork::Pod);
    let cluster = ClusterNet::new(&[&bed.nodes[0].ns, &bed.nodes[1].ns, &bed.nodes[2].ns]);

    // The cluster's own network: DNS and a web server in pods on node c,
    // kube-proxy's ClusterIPs for them on every node.
    let (dns_pod, dns_ip) = cluster.nodes[2].pod("dns");
    let (web_pod, web_ip) = cluster.nodes[2].pod("web");
    let (client_pod, _) = cluster.nodes[2].pod("client");
    let _dns = Dns::start(&dns_pod, &dns_ip, &[(WEB_NAME, WEB_IP)]);
    let _web = Http::start(&web_pod, 8080, WEB_BODY);
    cluster.kube_proxy(&[
        cluster_net::dns_service(DNS_IP, &dns_ip),
        cluster_net::one_endpoint_service(
            "prod/web:http",
            WEB_IP,
            80,
            Proto::Tcp,
            None,
            (&web_ip, 8080),
        ),
        // The guest's web server behind a NodePort on every node.
        cluster_net::one_endpoint_service(
            "prod/vm1:http",
            "10.96.0.40",
            80,
            Proto::Tcp,
            Some(NODE_PORT),
            (VM1_IP, PROBE_PORT),
        ),
    ]);
    let node_port = |i: usize| {
        let address = &cluster.nodes[i].address;
        assert_eq!(
            get(&client_pod, address, NODE_PORT, "/healthz"),
            Ok((200, format!("{PROBE_BODY}\n"))),
            "node {i}'s NodePort, from a cluster-network pod on c"
        );
    };
    // The guest's lease from vmpath: the claim's address, vmpath's gateway
    // as its router, the DNS ClusterIP as its resolver; the pod holds no
    // address of its own.
    assert!(bed.vm1.pod.holds_no_ip(), "the virt-launcher pod has an IP");
    let lease = bed.vm1.wait_lease();
    assert_eq!(
        (
            lease.get("ip").map(String::as_str),
            lease.get("router").map(String::as_str),
            lease.get("dns").map(String::as_str),
        ),
        (Some(VM1_IP), Some(GATEWAY), Some(DNS_IP)),
        "the guest's lease: {lease:?}"
    );
    let before = addresses_and_gateway(&bed.vm1);
    assert!(
        before.0.contains(&format!("{VM1_IP}/24")) && before.1 == format!("via {GATEWAY}"),
        "the guest's eth0 and default route: {before:?}"
    );
    // What kubelet probes: a web server in the guest.
    bed.vm1.run(&format!(
        "mkdir -p /www && echo '{PROBE_BODY}' > /www/healthz && httpd -p {PROBE_PORT} -h /www"
    ));
    reaches_the_cluster_and_is_probed(&bed, &bed.nodes[0], &web_ip);
    node_port(2);

    // KubeVirt live-migrates the guest to b (the peer on c streams pings
    // and TCP echoes at it meanwhile: RealBed's migration).
    let m = migrate(&mut bed);
    println!("the migration: {m:?}");
    assert_eq!((m.from.as_str(), m.to.as_str()), ("a", "b"));
    assert_eq!(m.tcp_error, None, "the peer's TCP connection broke: {m:?}");
    assert_eq!(m.gw_after, m.gw_before, "the guest's gateway entry: {m:?}");

    // The guest, reading its own interface: the same address and gateway;
    // it renews the same lease with b's agent.
    assert_eq!(
        addresses_and_gateway(&bed.vm1),
        before,
        "the guest's addresses and default route after the move"
    );
    let renewed = bed.vm1.renew_dhcp4(&lease);
    for key in ["ip", "router", "dns"] {
        assert_eq!(
            renewed.get(key),
            lease.get(key),
            "{key} in the lease renewed on b: {renewed:?}, before the move: {lease:?}"
        );
    }
    reaches_the_cluster_and_is_probed(&bed, &bed.nodes[1], &web_ip);
    node_port(2);
    node_port(0);
}

/// The global addresses on the guest's eth0, sorted, and its IPv4
/// default route (`via <gateway>`), as the guest itself reads them.
fn addresses_and_gateway(guest: &QemuVm) -> (Vec<String>, String) {
    let mut addrs = guest.addresses();
    addrs.sort();
    let route = guest.run("ip -4 route show default");
    let via = route
        .split_whitespace()
        .skip_while(|w| *w != "via")
        .take(2)
        .collect::<Vec<_>>()
        .join(" ");
    (addrs, via)
}

/// From the guest: the web Service's name resolved through the DNS
/// ClusterIP (the resolver of its lease), HTTP to that ClusterIP answered
/// by the cluster-network pod; the guest's node (`node`) probes the pod's
/// IP as kubelet does (an HTTP GET from the node's own stack).
fn reaches_the_cluster_and_is_probed(bed: &RealBed, node: &Node, web_ip: &str) {
    let guest = &bed.vm1;
    let fqdn = format!("{WEB_NAME}.{DOMAIN}");
    let mut answer = None;
    wait_for(
        &format!("{fqdn} resolved in the guest on {}", node.name),
        Duration::from_secs(20),
        || {
            answer = nslookup_answer(&guest.run_status(&format!("nslookup {fqdn}")).1);
            answer.as_deref() == Some(WEB_IP)
        },
    );
    let resolv = guest.run("cat /etc/resolv.conf");
    assert!(
        resolv.contains(&format!("nameserver {DNS_IP}")),
        "the guest asked another resolver: {resolv}"
    );
    // busybox wget segfaults in this guest image (its static glibc):
    // the request is written to busybox nc, as HTTP/1.0.
    let (rc, response) = guest.run_status(&format!(
        "printf 'GET / HTTP/1.0\\r\\nHost: {WEB_NAME}\\r\\n\\r\\n' | nc -w 5 {WEB_IP} 80"
    ));
    assert!(
        rc == 0 && response.starts_with("HTTP/1.1 200 OK\r\n") && response.ends_with(WEB_BODY),
        "HTTP from the guest on {} to the web ClusterIP (backend {web_ip} on c): exit {rc}, {response:?}",
        node.name
    );
    assert_eq!(
        get(&node.ns, VM1_IP, PROBE_PORT, "/healthz"),
        Ok((200, format!("{PROBE_BODY}\n"))),
        "{}'s kubelet-style probe of the pod's IP",
        node.name
    );
}

/// An HTTP GET from `ns` (kubelet's `httpGet` probe from a node's own
/// stack, or a client in a pod): the status and body of `GET
/// http://ip:port/path` (`timeoutSeconds: 5`: a TCG guest on a busy
/// machine is slower than kubelet's default second), or why none came.
fn get(ns: &Netns, ip: &str, port: u16, path: &str) -> Result<(u16, String), String> {
    let out = ns.run_status(&[
        "python3",
        "-c",
        &format!(
            "import urllib.request\n\
             r = urllib.request.urlopen('http://{ip}:{port}{path}', timeout=5)\n\
             print(r.status); print(r.read().decode(), end='')\n"
        ),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    match text.split_once('\n') {
        Some((status, body)) if out.status.success() => status
            .parse()
            .map(|s| (s, body.to_string()))
            .map_err(|_| text.clone()),
        _ => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}
