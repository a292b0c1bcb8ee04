//! The cluster-sized maps (`vmp_endpoints`, `vmp_addresses`) take the size
//! the operator gives at the agent's start (`--max-endpoints`,
//! `--max-addresses`): the default holds 250,000 endpoints and addresses,
//! a dual-stack cluster of 250,000 VMs fits once the addresses are sized
//! for it, and a restart with another size replaces
//! the pinned map rather than adopting a map of the wrong size.
//!
//! Needs root. Run with:
//!   cargo nextest run -p vmpath-tests -E 'test(/^map_sizes::/)'

use std::{net::Ipv6Addr, path::PathBuf, process::Command};

use aya::maps::MapInfo;
use vmpath::{
    apply::dataplane::{Dataplane, MapSizes},
    plan::Plan,
};
use vmpath_common::{
    ADDR_STATIC, AddrInfo, AddrKey, ENDPOINT_REMOTE, Endpoint, EndpointKey, MAP_LAYOUT_VERSION,
    map_names, maps,
};
use vmpath_tests::prog_fixture::{BpffsRoot, in_fresh_netns};

const NETWORK: u32 = 7;
const CLUSTER: u32 = 250_000;
// The defaults hold a cluster of 250,000 endpoints and addresses.
const _: () =
    assert!(maps::ENDPOINTS.max_entries >= CLUSTER && maps::ADDRESSES.max_entries >= CLUSTER);

fn pin(root: &BpffsRoot, name: &str) -> PathBuf {
    root.0.join(format!("maps/v{MAP_LAYOUT_VERSION}/{name}"))
}

fn max_entries(root: &BpffsRoot, name: &str) -> u32 {
    MapInfo::from_pin(pin(root, name))
        .unwrap_or_else(|e| panic!("{name} not pinned: {e}"))
        .max_entries()
}

/// What `bpftool` says the map costs (its `memlock` bytes), for the log.
fn memlock(root: &BpffsRoot, name: &str) -> String {
    let out = Command::new("bpftool")
        .args(["-j", "map", "show", "pinned"])
        .arg(pin(root, name))
        .output()
        .expect("running bpftool");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    format!("{} bytes", v["bytes_memlock"])
}

fn mac(i: u32) -> [u8; 6] {
    let b = i.to_be_bytes();
    [0x52, 0x54, b[0], b[1], b[2], b[3]]
}

fn remote_endpoint(i: u32) -> Endpoint {
    Endpoint {
        kind: ENDPOINT_REMOTE,
        node_ip4: [192, 0, 2, (i % 200) as u8 + 1],
        ..Default::default()
    }
}

/// A plan of `n` remote VMs of one network, each with an IPv4 and an IPv6
/// address (as the overlay plan writes other nodes' VMs).
fn cluster_plan(n: u32) -> Plan {
    let mut plan = Plan::default();
    for i in 0..n {
        plan.endpoints
            .insert(EndpointKey::new(NETWORK, mac(i)), remote_endpoint(i));
        let owner = AddrInfo {
            origin: ADDR_STATIC,
            mac: mac(i),
            ..Default::default()
        };
        let b = i.to_be_bytes();
        let mut v6 = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0).octets();
        v6[12..].copy_from_slice(&b);
        plan.addresses
            .insert(AddrKey::v4(NETWORK, [10, b[1], b[2], b[3]]), owner);
        plan.addresses.insert(AddrKey::v6(NETWORK, &v6), owner);
    }
    plan
}

#[test]
fn a_cluster_of_250000_endpoints_fits_once_the_maps_are_sized_for_it() {
    in_fresh_netns(|| {
        let root = BpffsRoot::new("sizes");

        // The default size holds 250,000 endpoints and as many addresses:
        // a dual-stack cluster of 250,000 VMs (500,000 addresses) does
        // not fit, and the agent says which map and which flag.
        let plan = cluster_plan(CLUSTER);
        let mut dp = Dataplane::open(&root.0).expect("loading the data path");
        assert_eq!(
            max_entries(&root, map_names::ENDPOINTS),
            maps::ENDPOINTS.max_entries
        );
        let e = dp
            .apply(&plan)
            .expect_err("500,000 addresses in the default 262,144");
        assert!(
            format!("{e:#}").contains(
                "vmp_addresses: 500000 entries to write, the map holds 262144 (raise --max-addresses)"
            ),
            "{e:#}"
        );
        drop(dp);

        // Sized at start: a restart replaces the pinned maps with ones of
        // the size asked for, and the whole cluster is programmed.
        let mut sizes = MapSizes::default();
        sizes.set(map_names::ENDPOINTS, 262_144).unwrap();
        sizes.set(map_names::ADDRESSES, 524_288).unwrap();
        let mut dp = Dataplane::open_sized(&root.0, &sizes).expect("loading the sized data path");
        assert_eq!(max_entries(&root, map_names::ENDPOINTS), 262_144);
        assert_eq!(max_entries(&root, map_names::ADDRESSES), 524_288);
        dp.apply(&plan).expect("programming 250,000 VMs");
        assert_eq!(dp.maps().endpoints.iter().count(), CLUSTER as usize);
        assert_eq!(dp.maps().addresses.iter().count(), 2 * CLUSTER as usize);
        eprintln!(
            "vmp_endpoints at 262,144: {}; vmp_addresses at 524,288: {}",
            memlock(&root, map_names::ENDPOINTS),
            memlock(&root, map_names::ADDRESSES)
        );
        drop(dp);

        // The same sizes again: the filled maps are adopted as they are.
        let dp = Dataplane::open_sized(&root.0, &sizes).expect("reloading the sized data path");
        assert_eq!(dp.maps().endpoints.iter().count(), CLUSTER as usize);
    });
}

#[test]
fn a_size_outside_the_range_or_of_another_map_is_refused_by_name() {
    let mut sizes = MapSizes::default();
    let e = sizes.set(map_names::ENDPOINTS, 100).unwrap_err();
    assert_eq!(
        e.to_string(),
        "vmp_endpoints: 100 entries is outside 1024..=4194304"
    );
    let e = sizes.set(map_names::PORTS, 100_000).unwrap_err();
    assert_eq!(
        e.to_string(),
        "map vmp_ports is not sized at start (sizable: vmp_endpoints, vmp_addresses)"
    );
}
