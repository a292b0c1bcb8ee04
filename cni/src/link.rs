//! Links and addresses, through iproute2 (`ip`, and `nsenter` for the pod's
//! namespace). Why not a netlink crate: the plugin runs once per call and
//! does a handful of operations; iproute2 is on every node a CNI runtime
//! runs on, and keeps this binary small and free of an async runtime.

use std::process::Command;

/// Runs `ip ARGS`, in `netns` when given; the error names the command and
/// what `ip` said.
pub fn ip(netns: Option<&str>, args: &[&str]) -> Result<String, String> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={ns}")).arg("ip");
            c
        }
        None => Command::new("ip"),
    };
    cmd.args(args);
    let out = cmd
        .output()
        .map_err(|e| format!("running ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "ip {}{}: {}",
            args.join(" "),
            netns.map(|n| format!(" (in {n})")).unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One link as `ip -j link show` describes it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct LinkInfo {
    pub ifname: String,
    #[serde(default)]
    pub address: Option<String>,
    #[serde(default)]
    pub mtu: Option<u32>,
}

/// The link `name` in `netns` (or here), or `None` when it does not exist.
pub fn show(netns: Option<&str>, name: &str) -> Option<LinkInfo> {
    let out = ip(netns, &["-j", "link", "show", "dev", name]).ok()?;
    serde_json::from_str::<Vec<LinkInfo>>(&out)
        .ok()?
        .into_iter()
        .next()
}

/// Creates the veth pair: `host` here, `ifname` in `netns` with `mac` when
/// given, both with `mtu`. Nothing is left behind on failure.
/// The ifalias of every host-side port this plugin creates; the agent's
/// `port_eligibility::CNI_MARKER` (the crates share no library, so a test
/// in the agent's suite checks the two agree).
pub const CNI_PORT_ALIAS: &str = "vmpath:cni-port";

pub fn create_veth(
    host: &str,
    peer_tmp: &str,
    netns: &str,
    ifname: &str,
    mac: Option<&str>,
    mtu: u32,
) -> Result<LinkInfo, String> {
    if show(Some(netns), ifname).is_some() {
        return Err(format!("{ifname} already exists in {netns}"));
    }
    // A stale host side (an ADD that crashed) would block the name.
    if show(None, host).is_some() {
        let _ = ip(None, &["link", "del", host]);
    }
    let mtu = mtu.to_string();
    ip(
        None,
        &[
            "link", "add", host, "mtu", &mtu, "type", "veth", "peer", "name", peer_tmp, "mtu",
            &mtu, "netns", netns,
        ],
    )?;
    let finish = || -> Result<LinkInfo, String> {
        let mut args = vec!["link", "set", peer_tmp, "name", ifname];
        if let Some(mac) = mac {
            args.extend(["address", mac]);
        }
        ip(Some(netns), &args)?;
        ip(Some(netns), &["link", "set", ifname, "up"])?;
        // The agent attaches only to VM ports: this alias marks the port
        // as the plugin's (the agent's port-eligibility rule for CNI ports).
        ip(None, &["link", "set", "dev", host, "alias", CNI_PORT_ALIAS])?;
        ip(None, &["link", "set", host, "up"])?;
        show(Some(netns), ifname).ok_or_else(|| format!("{ifname} vanished from {netns}"))
    };
    finish().inspect_err(|_| {
        let _ = ip(None, &["link", "del", host]);
    })
}

/// Deletes `name` here (its veth peer goes with it); absent is fine.
pub fn delete(name: &str) -> Result<(), String> {
    if show(None, name).is_none() {
        return Ok(());
    }
    match ip(None, &["link", "del", name]) {
        Ok(_) => Ok(()),
        Err(_) if show(None, name).is_none() => Ok(()),
        Err(e) => Err(e),
    }
}
