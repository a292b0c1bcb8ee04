//! `vmpath-cni`: the CNI plugin that creates a pod's port on a vmpath
//! network and hands it to the node's vmpath agent. Stateless: the agent
//! keeps the endpoints. Config (CNI 0.4.0, 1.0.0, 1.1.0):
//!
//! ```json
//! {"cniVersion": "1.1.0", "name": "blue", "type": "vmpath-cni",
//!  "network": "blue", "socket": "/run/vmpath/api.sock"}
//! ```

mod agent;
mod link;
mod plugin;

use rscni_plugin::{cni::Plugin, version::SpecVersion};

fn main() {
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
