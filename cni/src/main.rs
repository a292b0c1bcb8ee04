//! `vmpath-cni`: the CNI plugin that creates a pod's port on a vmpath
//! network and hands it to the node's vmpath agent. Stateless: the agent
//! keeps the endpoints. Config (CNI 0.4.0, 1.0.0, 1.1.0):
//!
//! ```json
//! {"cniVersion": "1.1.0", "name": "blue", "type": "vmpath-cni",
//!  "network": "blue", "socket": "/run/vmpath/api.sock"}
//! ```

mod link;
mod plugin;

use rscni_plugin::{cni::Plugin, version::SpecVersion};

/// `vmpath-cni install DIR`: copies this binary into DIR (the DaemonSet's
/// init container puts it into the host's /opt/cni/bin), atomically so a
/// runtime never executes half a file.
fn install(dir: &std::path::Path) -> std::io::Result<()> {
    let me = std::env::current_exe()?;
    let tmp = dir.join(".vmpath-cni.tmp");
    std::fs::copy(&me, &tmp)?;
    std::fs::rename(&tmp, dir.join("vmpath-cni"))
}

/// `vmpath-cni 0.1.0 (revision 0123456789ab)`: the version (with the
/// suffix of a special build, as `vmpath --version`) and git revision.
fn version() -> String {
    let (suffix, len) = vmpath_common::version_stamp::suffix();
    format!(
        "vmpath-cni {}{} (revision {})",
        env!("CARGO_PKG_VERSION"),
        String::from_utf8_lossy(&suffix[..len]),
        env!("VMPATH_GIT_REVISION")
    )
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    if std::env::var_os("CNI_COMMAND").is_none()
        && matches!(argv.get(1).map(String::as_str), Some("--version" | "-V"))
    {
        println!("{}", version());
        return;
    }
    if std::env::var_os("CNI_COMMAND").is_none()
        && argv.get(1).map(String::as_str) == Some("install")
    {
        let Some(dir) = argv.get(2) else {
            eprintln!("usage: vmpath-cni install DIR");
            std::process::exit(2);
        };
        if let Err(e) = install(std::path::Path::new(dir)) {
            eprintln!("vmpath-cni: installing into {dir}: {e}");
            std::process::exit(1);
        }
        println!("vmpath-cni installed into {dir}");
        return;
    }
    let plugin = Plugin::new(
        SpecVersion::new(1, 1, 0),
        vec![
            SpecVersion::new(0, 4, 0),
            SpecVersion::new(1, 0, 0),
            SpecVersion::new(1, 1, 0),
        ],
    )
    .msg("vmpath-cni: ports on vmpath networks");
    if let Err(e) = plugin.run(&plugin::VmpathCni) {
        // The error JSON is on stdout already; the exit code is its code
        // (STATUS answers 50 while the agent is not ready).
        std::process::exit(u32::from(&e).clamp(1, 255) as i32);
    }
}
