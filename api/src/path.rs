//! The API's paths. Names in a path are percent-encoded ([`encode`]); the
//! agent decodes each segment.

use std::fmt::Write as _;

pub const HEALTHZ: &str = "/healthz";
pub const READYZ: &str = "/readyz";
pub const STATUS: &str = "/v1/status";
pub const NETWORKS: &str = "/v1/networks";
pub const VMS: &str = "/v1/vms";
pub const ENDPOINTS: &str = "/v1/endpoints";
pub const MONITOR: &str = "/v1/monitor";
pub const DEBUG_DATAPATH: &str = "/v1/debug/datapath";

/// `GET /v1/networks/{name}`.
pub fn network(name: &str) -> String {
    format!("{NETWORKS}/{}", encode(name))
}

/// `GET /v1/networks/{name}?interfaces=false`: the network without its
/// VM interfaces' rows (what the CNI plugin asks on every ADD; the rows
/// are the network's whole cluster).
pub fn network_alone(name: &str) -> String {
    format!("{}?interfaces=false", network(name))
}

/// `GET /v1/vms/{namespace}/{vm}`.
pub fn vm(namespace: &str, vm: &str) -> String {
    format!("{VMS}/{}/{}", encode(namespace), encode(vm))
}

/// `GET` or `DELETE /v1/endpoints/{container}/{ifname}`. Container ids and
/// interface names never hold `/` (the agent refuses them).
pub fn endpoint(container_id: &str, ifname: &str) -> String {
    format!("{ENDPOINTS}/{container_id}/{ifname}")
}

/// Percent-encodes a path segment (names are DNS labels, but be safe).
pub fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Percent-decodes one path segment (what [`encode`] made; a `%` that
/// starts no escape stays as it is).
pub fn decode(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_encoded_ids_are_not() {
        assert_eq!(encode("prod/vm 1"), "prod%2Fvm%201");
        assert_eq!(encode("web-1.a_b~"), "web-1.a_b~");
        assert_eq!(vm("prod", "vm 1"), "/v1/vms/prod/vm%201");
        assert_eq!(network("blue"), "/v1/networks/blue");
        assert_eq!(endpoint("c0ffee", "eth1"), "/v1/endpoints/c0ffee/eth1");
    }
}
