//! The demo's config documents (docs/config.md): one Network per network and
//! one Attachment per VM, all in `demo.yaml`.

use std::{fmt::Write as _, fs, path::Path, path::PathBuf};

use anyhow::{Context as _, Result};

use super::{
    NODE,
    topology::{NETWORKS, Net, VMS, Vm},
};

const API_VERSION: &str = "vmpath.dev/v1alpha1";

fn list(items: &[&str]) -> String {
    format!("[{}]", items.join(", "))
}

fn network(n: &Net) -> String {
    let ipam = if n.ipam_enabled {
        "{mode: Enabled}"
    } else {
        "{mode: Disabled}"
    };
    format!(
        "apiVersion: {API_VERSION}
kind: Network
metadata: {{name: {name}}}
spec:
  id: {id}
  topology: Layer2
  subnets: {subnets}
  defaultGatewayIPs: {gateways}
  ipam: {ipam}
",
        name = n.name,
        id = n.id,
        subnets = list(n.subnets),
        gateways = list(n.gateways),
    )
}

fn attachment(vm: &Vm) -> String {
    format!(
        "apiVersion: {API_VERSION}
kind: Attachment
metadata: {{name: {name}-eth0, namespace: demo}}
spec:
  vm: {name}
  interface: eth0
  network: {network}
  node: {NODE}
  port: {port}
  mac: \"{mac}\"
  ips: {ips}
",
        name = vm.name,
        network = vm.net.name,
        port = vm.ns(),
        mac = vm.mac,
        ips = list(vm.ips),
    )
}

pub fn documents() -> String {
    let mut out = String::new();
    let docs = NETWORKS
        .iter()
        .map(|n| network(n))
        .chain(VMS.iter().map(attachment));
    for (i, doc) in docs.enumerate() {
        if i > 0 {
            out.push_str("---\n");
        }
        let _ = write!(out, "{doc}");
    }
    out
}

/// Writes `dir/demo.yaml` and returns `dir`.
pub fn write(dir: &Path) -> Result<PathBuf> {
    let step = "demo: writing the config";
    fs::create_dir_all(dir).with_context(|| format!("{step}: creating {}", dir.display()))?;
    let file = dir.join("demo.yaml");
    let yaml = documents();
    fs::write(&file, &yaml).with_context(|| format!("{step}: writing {}", file.display()))?;
    println!("demo: config {}:\n{yaml}", file.display());
    Ok(dir.to_path_buf())
}
