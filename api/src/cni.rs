//! What the `vmpath-cni` plugin hands the agent (`/v1/endpoints`), and
//! what the agent answers once the port is programmed.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The `ifalias` the plugin gives the host side of a pod's veth pair: the
/// agent takes a port carrying it as a VM port whatever its name.
pub const PORT_ALIAS: &str = "vmpath:cni-port";

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
