//! The demo's namespaces and veth pairs.
//!
//! vmpd-node holds the host side `vmpd-vmN` of each VM's veth; the VM side
//! is `eth0` in `vmpd-vmN` with a fixed MAC, its IPs and a default route
//! via the network's gateway.

use std::process::Command;

use anyhow::Result;

use crate::cmd;

pub const NODE_NS: &str = "vmpd-node";

pub struct Net {
    pub name: &'static str,
    pub id: u32,
    pub subnets: &'static [&'static str],
    pub gateways: &'static [&'static str],
    pub ipam_enabled: bool,
}

pub const BLUE: Net = Net {
    name: "blue",
    id: 100,
    subnets: &["10.20.0.0/16", "fd20::/64"],
    gateways: &["10.20.0.1", "fd20::1"],
    ipam_enabled: true,
};

pub const RED: Net = Net {
    name: "red",
    id: 200,
    subnets: &["10.30.0.0/16"],
    gateways: &["10.30.0.1"],
    ipam_enabled: false,
};

pub const NETWORKS: [&Net; 2] = [&BLUE, &RED];

pub struct Vm {
    /// VM name; also its namespace is `vmpd-<name>` and its host-side port.
    pub name: &'static str,
    pub net: &'static Net,
    pub mac: &'static str,
    pub ips: &'static [&'static str],
}

impl Vm {
    /// The VM's namespace and, in the node namespace, its host-side port.
    pub fn ns(&self) -> String {
        format!("vmpd-{}", self.name)
    }
}

pub const VMS: [Vm; 3] = [
    Vm {
        name: "vm1",
        net: &BLUE,
        mac: "52:54:00:00:01:01",
        ips: &["10.20.0.11/16", "fd20::11/64"],
    },
    Vm {
        name: "vm2",
        net: &BLUE,
        mac: "52:54:00:00:02:01",
        ips: &["10.20.0.12/16", "fd20::12/64"],
    },
    Vm {
        name: "vm3",
        net: &RED,
        mac: "52:54:00:00:03:01",
        ips: &["10.30.0.13/16"],
    },
];

/// Every namespace the demo creates.
pub fn namespaces() -> Vec<String> {
    std::iter::once(NODE_NS.to_string())
        .chain(VMS.iter().map(Vm::ns))
        .collect()
}

fn ip(step: &str, args: &[&str]) -> Result<()> {
    cmd::run(step, Command::new("ip").args(args))
}

pub fn create() -> Result<()> {
    let step = "demo: creating namespaces";
    for ns in namespaces() {
        ip(step, &["netns", "add", &ns])?;
        ip(step, &["-n", &ns, "link", "set", "lo", "up"])?;
    }
    for vm in &VMS {
        create_vm(vm)?;
    }
    println!(
        "demo: namespaces {} with veth pairs vmpd-vmN (node side) <-> eth0 (VM side)",
        namespaces().join(" ")
    );
    Ok(())
}

fn create_vm(vm: &Vm) -> Result<()> {
    let step = &format!("demo: wiring {}", vm.name);
    let ns = vm.ns();
    // Both ends are created directly in their namespaces: nothing is left
    // in the host namespace even if a later step fails.
    ip(
        step,
        &[
            "link", "add", &ns, "netns", NODE_NS, "type", "veth", "peer", "name", "eth0",
            "address", vm.mac, "netns", &ns,
        ],
    )?;
    ip(step, &["-n", NODE_NS, "link", "set", &ns, "up"])?;
    for addr in vm.ips {
        let mut args = vec!["-n", &ns, "addr", "add", addr, "dev", "eth0"];
        if addr.contains(':') {
            args.push("nodad");
        }
        ip(step, &args)?;
    }
    ip(step, &["-n", &ns, "link", "set", "eth0", "up"])?;
    for gw in vm.net.gateways {
        let family = if gw.contains(':') { "-6" } else { "-4" };
        ip(
            step,
            &["-n", &ns, family, "route", "add", "default", "via", gw],
        )?;
    }
    Ok(())
}
