//! Forwarding off in the node's network namespace. SNAT and routed egress
//! leave through the node's FIB (`bpf_fib_lookup`), which answers
//! "forwarding disabled" for every frame while `net.ipv4.ip_forward` (or
//! `net.ipv6.conf.all.forwarding`) is 0: all of it is dropped as
//! `route_no_route`. Routed ingress is delivered by the uplink program
//! without the FIB, but the VMs' answers are egress like any other. So
//! every network with a VM here and a gateway address of a family needs
//! that family's forwarding. The agent checks at start and every
//! [`CHECK_EVERY`], logs what it finds (and when it is fixed), and
//! `vmpath status` lists it under problems while it lasts.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tracing::{info, warn};

use crate::publish::view::{Published, View};

/// How often the sysctls are read again: an operator may fix them while
/// the agent runs.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The sysctl that switches it, as `sysctl -w` names it.
    pub fn sysctl(self) -> &'static str {
        match self {
            Family::V4 => "net.ipv4.ip_forward",
            Family::V6 => "net.ipv6.conf.all.forwarding",
        }
    }

    /// Its file; /proc/sys/net shows the namespace of whoever opens it,
    /// here the node's.
    fn path(self) -> &'static str {
        match self {
            Family::V4 => "/proc/sys/net/ipv4/ip_forward",
            Family::V6 => "/proc/sys/net/ipv6/conf/all/forwarding",
        }
    }
}

/// Whether `family`'s forwarding is on in the agent's namespace; `None`
/// when it cannot be read (no IPv6 in the kernel: nothing to forward).
pub fn enabled(family: Family) -> Option<bool> {
    std::fs::read_to_string(family.path())
        .ok()
        .map(|v| v.trim() != "0")
}

/// The networks that need each family's forwarding on this node: a VM
/// of theirs is served here and they have a gateway address of it (the
/// way out of the subnet).
pub fn needed(view: &View) -> BTreeMap<Family, Vec<String>> {
    let mut out: BTreeMap<Family, Vec<String>> = BTreeMap::new();
    for n in &view.networks {
        // Only rows that may be on this node can be served here: another
        // node's is not made to be read.
        let hosted = view
            .maybe_on_node()
            .any(|a| a.network == n.name && a.node == view.node);
        if !hosted {
            continue;
        }
        for family in [Family::V4, Family::V6] {
            let has_gateway = n
                .gateway_ips
                .iter()
                .any(|g| g.contains(':') == (family == Family::V6));
            if has_gateway {
                out.entry(family).or_default().push(n.name.clone());
            }
        }
    }
    out
}

/// What `vmpath status` says for each family whose forwarding is off
/// while a network needs it.
pub fn problems(view: &View, enabled: impl Fn(Family) -> Option<bool>) -> Vec<String> {
    needed(view)
        .into_iter()
        .filter(|(family, _)| enabled(*family) == Some(false))
        .map(|(family, networks)| {
            let sysctl = family.sysctl();
            format!(
                "forwarding is off in the node's network namespace ({sysctl}=0): \
                 egress (SNAT and routed) of network {} is dropped as route_no_route; \
                 set {sysctl}=1",
                networks.join(", ")
            )
        })
        .collect()
}

static CURRENT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Told what each check finds (the Kubernetes source posts it as Events
/// on the Node).
type Reporter = Box<dyn Fn(&[String]) + Send + Sync>;
static REPORTER: std::sync::OnceLock<Reporter> = std::sync::OnceLock::new();

/// Has every later check's findings passed to `report` too (once: the
/// first caller's stays).
pub fn report_to(report: Reporter) {
    let _ = REPORTER.set(report);
}

/// The problems the last check found.
pub fn current() -> Vec<String> {
    CURRENT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Checks what `shared` publishes against the sysctls now and every
/// [`CHECK_EVERY`], in a thread of its own.
pub fn watch(shared: Arc<Published>) {
    let spawned = std::thread::Builder::new()
        .name("forwarding".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            loop {
                check(&shared.view());
                std::thread::sleep(CHECK_EVERY);
            }
        });
    if let Err(e) = spawned {
        warn!("forwarding will not be checked: {e}");
    }
}

fn check(view: &View) {
    let now = problems(view, enabled);
    let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    for p in now.iter().filter(|p| !current.contains(p)) {
        warn!("{p}");
    }
    if !current.is_empty() && now.is_empty() {
        info!("forwarding is on for every network that needs it");
    }
    if let Some(report) = REPORTER.get() {
        report(&now);
    }
    *current = now;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::view::{AttachmentView, NetworkView, sample};

    fn view() -> View {
        let base = sample::view();
        let net = |name: &str, gateways: &[&str]| NetworkView {
            name: name.into(),
            gateway_ips: gateways.iter().map(|g| g.to_string()).collect(),
            ..base.networks[0].clone()
        };
        let vm = |network: &str, node: &str| AttachmentView {
            network: network.into(),
            ..sample::attachment("vm", node, None, "none")
        };
        View {
            node: "a".into(),
            networks: vec![
                net("blue", &["10.20.0.1", "fd20::1"]),
                net("red", &["10.30.0.1"]),
                net("elsewhere", &["10.40.0.1"]),
                net("l2", &[]),
            ],
            attachments: vec![
                vm("blue", "a").into(),
                vm("red", "a").into(),
                vm("elsewhere", "b").into(),
                vm("l2", "a").into(),
            ]
            .into(),
            ..base
        }
    }

    #[test]
    fn networks_with_a_vm_here_and_a_gateway_need_its_family() {
        let n = needed(&view());
        assert_eq!(n[&Family::V4], ["blue", "red"]);
        assert_eq!(n[&Family::V6], ["blue"]);
    }

    #[test]
    fn a_family_that_is_off_is_a_problem_naming_the_sysctl_and_networks() {
        let p = problems(&view(), |f| Some(f == Family::V6));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("net.ipv4.ip_forward=0"), "{}", p[0]);
        assert!(p[0].contains("network blue, red"), "{}", p[0]);
        assert!(p[0].contains("route_no_route"), "{}", p[0]);
        assert!(problems(&view(), |_| Some(true)).is_empty());
        // Unreadable (no IPv6): nothing to say.
        assert!(problems(&view(), |f| (f == Family::V4).then_some(true)).is_empty());
    }
}
