//! Addresses of a subnet no VM may hold: the IPv4 network and broadcast
//! addresses (prefixes up to /30; a /31 or /32 has none), the IPv6
//! subnet-router anycast address (prefixes up to /126) and the network's
//! gateways. IPAM never hands them out; a static request for one is refused
//! on an IPAM network and reported as a warning on an IPAM-less one (an
//! imported VM may really be configured that way).

use std::net::IpAddr;

use ipnet::IpNet;

use super::{Config, ConfigError, Network};

/// Why `addr` is reserved on `net`, or `None` when a VM may hold it.
pub fn reserved_reason(net: &Network, addr: IpAddr) -> Option<String> {
    if net.gateway_ips.contains(&addr) {
        return Some(format!(
            "{addr} is the gateway IP of network {:?}",
            net.name
        ));
    }
    net.subnets
        .iter()
        .find_map(|subnet| subnet_reason(subnet, addr))
}

/// Why `addr` is a reserved address of `subnet` itself.
pub fn subnet_reason(subnet: &IpNet, addr: IpAddr) -> Option<String> {
    if !subnet.contains(&addr) {
        return None;
    }
    match subnet {
        IpNet::V4(n) if n.prefix_len() <= 30 => {
            if addr == IpAddr::V4(n.network()) {
                Some(format!("{addr} is the network address of {subnet}"))
            } else if addr == IpAddr::V4(n.broadcast()) {
                Some(format!("{addr} is the broadcast address of {subnet}"))
            } else {
                None
            }
        }
        IpNet::V6(n) if n.prefix_len() <= 126 && addr == IpAddr::V6(n.network()) => Some(format!(
            "{addr} is the subnet-router anycast address of {subnet}"
        )),
        _ => None,
    }
}

/// Given addresses on IPAM-less networks that are a subnet's reserved
/// address: accepted, but worth telling the operator about.
pub fn warnings(cfg: &Config) -> Vec<ConfigError> {
    let mut out = Vec::new();
    for a in &cfg.attachments {
        let Some(net) = cfg.network(&a.network).filter(|n| !n.ipam) else {
            continue;
        };
        for (i, ip) in a.ips.iter().enumerate() {
            if let Some(why) = net.subnets.iter().find_map(|s| subnet_reason(s, ip.addr())) {
                out.push(ConfigError {
                    file: a.source.file.to_path_buf(),
                    document: a.source.document(),
                    field: format!("spec.ips[{i}]"),
                    message: format!("{why}; accepted because network {:?} has no IPAM", net.name),
                    about: a.source.origin.about(),
                    reason: None,
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn ipv4_network_and_broadcast_are_reserved_up_to_slash_30() {
        for (subnet, network, broadcast) in [
            ("10.76.0.0/16", "10.76.0.0", "10.76.255.255"),
            ("10.76.4.0/24", "10.76.4.0", "10.76.4.255"),
            ("10.76.4.8/29", "10.76.4.8", "10.76.4.15"),
            ("10.76.4.4/30", "10.76.4.4", "10.76.4.7"),
            ("10.0.0.0/8", "10.0.0.0", "10.255.255.255"),
        ] {
            let s = net(subnet);
            let why = subnet_reason(&s, ip(network)).unwrap();
            assert!(
                why.contains("network address") && why.contains(subnet),
                "{why}"
            );
            let why = subnet_reason(&s, ip(broadcast)).unwrap();
            assert!(
                why.contains("broadcast address") && why.contains(subnet),
                "{why}"
            );
        }
        // Hosts next to them are fine.
        assert_eq!(subnet_reason(&net("10.76.0.0/16"), ip("10.76.0.1")), None);
        assert_eq!(
            subnet_reason(&net("10.76.0.0/16"), ip("10.76.255.254")),
            None
        );
        assert_eq!(subnet_reason(&net("10.76.4.4/30"), ip("10.76.4.5")), None);
        assert_eq!(subnet_reason(&net("10.76.4.4/30"), ip("10.76.4.6")), None);
    }

    #[test]
    fn ipv4_slash_31_and_32_have_no_reserved_address() {
        assert_eq!(subnet_reason(&net("10.76.4.4/31"), ip("10.76.4.4")), None);
        assert_eq!(subnet_reason(&net("10.76.4.4/31"), ip("10.76.4.5")), None);
        assert_eq!(subnet_reason(&net("10.76.4.4/32"), ip("10.76.4.4")), None);
    }

    #[test]
    fn ipv6_subnet_router_anycast_is_reserved() {
        for (subnet, anycast, host) in [
            ("fd76::/64", "fd76::", "fd76::1"),
            ("fd76:0:0:100::/56", "fd76:0:0:100::", "fd76:0:0:1ff::ffff"),
            ("fd76::100/120", "fd76::100", "fd76::1ff"),
            ("fd76::4/126", "fd76::4", "fd76::7"),
        ] {
            let s = net(subnet);
            let why = subnet_reason(&s, ip(anycast)).unwrap();
            assert!(
                why.contains("subnet-router anycast") && why.contains(subnet),
                "{why}"
            );
            // IPv6 has no broadcast: the last address is a host.
            assert_eq!(subnet_reason(&s, ip(host)), None, "{host} in {subnet}");
        }
        // A /127 (RFC 6164 point-to-point) and a /128 have no anycast address.
        assert_eq!(subnet_reason(&net("fd76::4/127"), ip("fd76::4")), None);
        assert_eq!(subnet_reason(&net("fd76::4/128"), ip("fd76::4")), None);
    }

    #[test]
    fn addresses_outside_the_subnet_are_not_judged() {
        assert_eq!(subnet_reason(&net("10.76.0.0/16"), ip("10.77.0.0")), None);
        assert_eq!(subnet_reason(&net("fd76::/64"), ip("fd77::")), None);
        assert_eq!(subnet_reason(&net("fd76::/64"), ip("10.76.0.0")), None);
    }

    /// Validates one network (IPAM on or off) and one Attachment per
    /// requested address; returns the refusals and warnings by VM.
    fn validate_requests(ipam: bool, requests: &[&str]) -> (Config, Vec<String>) {
        let mode = if ipam { "Enabled" } else { "Disabled" };
        let mut docs = format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: red}}\nspec: {{id: 76, subnets: [10.76.0.0/16, 10.77.1.0/30, 'fd76::/64', 'fd77::/120'], defaultGatewayIPs: [10.76.0.1, 'fd76::1'], ipam: {{mode: {mode}}}}}\n"
        );
        let mut vms = Vec::new();
        for (i, ip) in requests.iter().enumerate() {
            let vm = format!("vm{i}");
            docs.push_str(&format!(
                "---\napiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {vm}-eth0, namespace: prod}}\nspec: {{vm: {vm}, interface: eth0, network: red, node: a, port: p{i}, mac: '52:54:00:00:00:{i:02x}', ips: ['10.76.9.{i}/16', '{ip}']}}\n"
            ));
            vms.push(vm);
        }
        let dir = std::env::temp_dir().join(format!(
            "vmpath-reserved-{}-{mode}-{}",
            std::process::id(),
            requests.len()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("c.yaml"), docs).unwrap();
        let snap = super::super::source::read_dir(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        (
            crate::round::validate(&snap, "a", &crate::config::AcceptedKeys::new()),
            vms,
        )
    }

    const RESERVED: [(&str, &str); 7] = [
        ("10.76.0.0/16", "network address of 10.76.0.0/16"),
        ("10.76.255.255/16", "broadcast address of 10.76.0.0/16"),
        ("10.77.1.0/30", "network address of 10.77.1.0/30"),
        ("10.77.1.3/30", "broadcast address of 10.77.1.0/30"),
        ("fd76::/64", "subnet-router anycast address of fd76::/64"),
        ("fd77::/120", "subnet-router anycast address of fd77::/120"),
        ("fd76::1/64", "gateway IP of network \"red\""),
    ];

    #[test]
    fn ipam_network_refuses_every_reserved_request_naming_document_and_field() {
        let (cfg, vms) = validate_requests(true, &RESERVED.map(|(ip, _)| ip));
        assert!(cfg.attachments.is_empty(), "{:?}", cfg.attachments);
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
        for ((ip, why), vm) in RESERVED.iter().zip(&vms) {
            let e = cfg
                .errors
                .iter()
                .find(|e| e.document == format!("Attachment prod/{vm}-eth0"))
                .unwrap_or_else(|| panic!("{ip} not refused: {:?}", cfg.errors));
            assert_eq!(e.field, "spec.ips[1]", "{e}");
            assert!(e.message.contains(why), "{ip}: {e}");
        }
    }

    #[test]
    fn ipam_network_accepts_hosts_next_to_the_reserved_addresses() {
        let hosts = [
            "10.76.0.2/16",
            "10.76.255.254/16",
            "10.77.1.2/30",
            "fd76::2/64",
            "fd77::ff/120",
        ];
        let (cfg, _) = validate_requests(true, &hosts);
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        assert_eq!(cfg.attachments.len(), hosts.len());
    }

    #[test]
    fn ipamless_network_accepts_reserved_requests_with_a_warning() {
        // All but the gateway, which the data path answers for itself.
        let requests = &RESERVED[..6];
        let (cfg, vms) = validate_requests(
            false,
            &requests.iter().map(|(ip, _)| *ip).collect::<Vec<_>>(),
        );
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        assert_eq!(cfg.attachments.len(), requests.len());
        assert_eq!(cfg.warnings.len(), requests.len(), "{:?}", cfg.warnings);
        for ((ip, why), vm) in requests.iter().zip(&vms) {
            let w = cfg
                .warnings
                .iter()
                .find(|w| w.document == format!("Attachment prod/{vm}-eth0"))
                .unwrap_or_else(|| panic!("no warning for {ip}: {:?}", cfg.warnings));
            assert_eq!(w.field, "spec.ips[1]");
            assert!(
                w.message.contains(why) && w.message.contains("no IPAM"),
                "{w}"
            );
        }
        let (cfg, _) = validate_requests(false, &["fd76::1/64"]);
        assert!(cfg.attachments.is_empty());
        assert!(
            cfg.errors[0].message.contains("gateway IP"),
            "{:?}",
            cfg.errors
        );
    }
}
