//! What the `vmpath-cni` plugin hands the agent (`/v1/endpoints`), and
//! what the agent answers once the port is programmed.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The `ifalias` the plugin gives the host side of a pod's veth pair: the
/// agent takes a port carrying it as a VM port whatever its name.
pub const PORT_ALIAS: &str = "vmpath:cni-port";

/// The host side's name of a pod's veth pair: `vmp` + 10 hex digits of
/// the FNV-1a hash of `{container_id}/{ifname}` (13 characters; the
/// kernel allows 15). Stable across versions of the plugin.
pub fn host_ifname(container_id: &str, ifname: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in format!("{container_id}/{ifname}").bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("vmp{:010x}", h & 0xff_ffff_ffff)
}

/// Whether `name` has the shape [`host_ifname`] gives: an interface the
/// plugin made, which the agent serves only once the plugin hands over
/// its endpoint (until then its appearing changes nothing).
pub fn is_host_ifname(name: &str) -> bool {
    name.len() == 13
        && name.starts_with("vmp")
        && name[3..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// How long the agent holds an ADD while it programs the port; the
/// client's timeout ([`crate::client::TIMEOUT`]) is longer.
pub const PROGRAM_TIMEOUT: Duration = Duration::from_secs(10);

/// What the plugin sends on ADD (`POST /v1/endpoints`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointRequest {
    pub container_id: String,
    pub ifname: String,
    pub netns: String,
    pub network: String,
    /// Host side of the veth pair.
    pub port: String,
    /// The pod side's MAC; absent for a VM whose MAC is learned from its
    /// traffic.
    #[serde(default)]
    pub mac: Option<String>,
    pub pod_namespace: String,
    pub pod_name: String,
    #[serde(default)]
    pub pod_uid: Option<String>,
    /// A virt-launcher pod: the VM behind it takes its addresses by DHCP.
    #[serde(default)]
    pub vm: bool,
}

/// What ADD answers once the port is programmed (and `GET
/// /v1/endpoints/{container}/{ifname}` any time): what the plugin puts in
/// its result (and configures in a plain pod).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointReply {
    pub endpoint: EndpointRequest,
    /// One of the API's attachment states (`local` once programmed), or
    /// `migration_target` (`types::state`).
    pub state: String,
    /// The MAC in force (given, or claimed).
    pub mac: Option<String>,
    /// Given or claimed addresses with prefix, e.g. `10.20.0.5/16`.
    pub ips: Vec<String>,
    pub gateways: Vec<String>,
    pub mtu: Option<u16>,
    /// The network's DNS servers and search domains (its DHCP options).
    #[serde(default)]
    pub dns: Dns,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dns {
    #[serde(default)]
    pub nameservers: Vec<String>,
    #[serde(default)]
    pub search: Vec<String>,
}

/// `GET /v1/endpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointList {
    pub endpoints: Vec<EndpointReply>,
}

/// `DELETE /v1/endpoints/{container}/{ifname}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removed {
    pub removed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes a released plugin sends: an agent of this version must
    /// take them, and this version must send the same.
    #[test]
    fn host_names_fit_differ_and_are_recognised() {
        let a = host_ifname("0123456789abcdef", "eth0");
        let b = host_ifname("0123456789abcdef", "eth1");
        // The plugin's names since round 1: a change would orphan ports.
        assert_eq!(
            a,
            "vmp".to_string()
                + &format!("{:010x}", {
                    let mut h: u64 = 0xcbf29ce484222325;
                    for c in b"0123456789abcdef/eth0" {
                        h ^= u64::from(*c);
                        h = h.wrapping_mul(0x100000001b3);
                    }
                    h & 0xff_ffff_ffff
                })
        );
        assert_eq!(a.len(), 13);
        assert_ne!(a, b);
        assert!(is_host_ifname(&a) && is_host_ifname(&b));
        for other in [
            "vmp-vxlan",
            "vmp-slow0",
            "eth0",
            "vmp0123456789a",
            "vmp012345678g",
            "VMP0123456789",
        ] {
            assert!(!is_host_ifname(other), "{other}");
        }
    }

    #[test]
    fn an_endpoint_request_keeps_its_wire_format() {
        let wire = r#"{"container_id":"c0ffee","ifname":"eth1","netns":"/run/netns/x","network":"blue","port":"vmp0123456789","mac":null,"pod_namespace":"default","pod_name":"web","pod_uid":null,"vm":true}"#;
        let request: EndpointRequest = serde_json::from_str(wire).unwrap();
        assert_eq!(serde_json::to_string(&request).unwrap(), wire);
        assert!(
            serde_json::from_str::<EndpointRequest>(&wire.replace("\"vm\"", "\"vmx\""))
                .unwrap_err()
                .to_string()
                .contains("unknown field `vmx`")
        );
    }

    #[test]
    fn a_reply_without_dns_has_none() {
        let wire = r#"{"endpoint":{"container_id":"c","ifname":"eth1","netns":"/n","network":"blue","port":"vmp1","pod_namespace":"d","pod_name":"p"},"state":"local","mac":null,"ips":["10.0.0.2/24"],"gateways":[],"mtu":1500}"#;
        let reply: EndpointReply = serde_json::from_str(wire).unwrap();
        assert_eq!(reply.dns, Dns::default());
        assert_eq!(reply.endpoint.mac, None);
    }
}
