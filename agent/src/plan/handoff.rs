//! The hand-off to the node's stack (docs/kubernetes.md, "What crosses
//! into the cluster's own network"): an endpoint of a Primary network
//! sends its traffic to the cluster's Service and pod CIDRs and nodes up
//! the node's stack (`vm_egress`, `CLUSTER_NETWORK`), where kube-proxy's
//! rules translate Services and the node routes to other nodes' pods. Two
//! netfilter rules, in an nftables table of vmpath's own, finish the job:
//!
//! - the source is translated to the node's address (masquerade) on the
//!   way out, unless the destination is itself on a Primary network or in
//!   this node's own pod CIDRs: a backend elsewhere on the cluster's
//!   network could not route back to a Primary network's subnet (it
//!   follows no node), and a reply that missed this node's conntrack would
//!   never be translated back; a pod on this node answers through this
//!   node, which routes to the endpoint, so it sees the endpoint's own
//!   address (as the `bridge` plugin's pods see each other's);
//! - nothing from one Primary network's endpoint to another's is forwarded
//!   by the node's stack (a kube-proxy Service whose backend is one): the
//!   data path carries that, with the NetworkPolicy of both ends; through
//!   the stack it would skip the receiver's policy, and translated it would
//!   wear the node's address, which a policy isolating an endpoint still
//!   admits (its kubelet).
//!
//! The table is replaced whole in one `nft` transaction when the Primary
//! networks' subnets change, and deleted when none is left.

use std::{
    collections::BTreeSet,
    io::Write as _,
    process::{Command, Stdio},
    sync::atomic::{AtomicBool, Ordering},
};

use ipnet::IpNet;
use tracing::{debug, info, warn};
use vmpath_common::VXLAN_PORT;

use crate::{
    config::{ClusterCidrKind, model::Role},
    resolve::resolved::Resolved,
};

/// vmpath's nftables table (family `inet`).
pub const TABLE: &str = "vmpath_handoff";

/// Whether this agent wrote the table for at least one Primary network.
/// The plan hands nothing off until it has (`plan::north_south`): without
/// the drop rule, the stack would carry one endpoint's traffic to another
/// past its policy, so the hand-off fails closed (no `nft`, no hand-off).
static WRITTEN: AtomicBool = AtomicBool::new(false);

/// See [`WRITTEN`].
pub fn written() -> bool {
    WRITTEN.load(Ordering::Relaxed)
}

#[cfg(test)]
pub(crate) fn set_written_for_tests() {
    WRITTEN.store(true, Ordering::Relaxed);
}

/// What the rules are made of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// The Primary networks' subnets.
    pub primary: BTreeSet<IpNet>,
    /// This node's own pod CIDRs (its v1 Node's `spec.podCIDRs`): no
    /// masquerade towards them.
    pub local_pods: BTreeSet<IpNet>,
}

pub fn desired(cfg: &Resolved) -> Desired {
    let this_node = cfg.config.node_name.as_str();
    Desired {
        primary: cfg
            .config
            .networks
            .iter()
            .filter(|n| n.role == Role::Primary)
            .flat_map(|n| n.subnets.iter().map(|s| s.trunc()))
            .collect(),
        local_pods: cfg
            .config
            .cluster_cidrs
            .iter()
            .filter(|c| c.kind == ClusterCidrKind::Pod)
            .filter(|c| c.node.as_deref() == Some(this_node))
            .map(|c| c.cidr.trunc())
            .collect(),
    }
}

/// The whole table for `want`, as one `nft -f` script that replaces any
/// previous one atomically; or only its deletion when there is no Primary
/// network.
pub fn ruleset(want: &Desired) -> String {
    // Declaring it first makes the delete valid when it does not exist.
    let mut out = format!("table inet {TABLE} {{}}\ndelete table inet {TABLE}\n");
    if want.primary.is_empty() {
        return out;
    }
    let list = |nets: &BTreeSet<IpNet>, v4: bool| {
        nets.iter()
            .filter(|s| matches!(s, IpNet::V4(_)) == v4)
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let set = |name: &str, ty: &str, elements: &str| {
        let elements = if elements.is_empty() {
            String::new()
        } else {
            format!(" elements = {{ {elements} }};")
        };
        format!("  set {name} {{ type {ty}; flags interval;{elements} }}\n")
    };
    out.push_str(&format!("table inet {TABLE} {{\n"));
    out.push_str(&set("primary4", "ipv4_addr", &list(&want.primary, true)));
    out.push_str(&set("primary6", "ipv6_addr", &list(&want.primary, false)));
    out.push_str(&set(
        "local_pods4",
        "ipv4_addr",
        &list(&want.local_pods, true),
    ));
    out.push_str(&set(
        "local_pods6",
        "ipv6_addr",
        &list(&want.local_pods, false),
    ));
    out.push_str(
        "  chain forward {\n    type filter hook forward priority filter - 10; policy accept;\n    \
         ip saddr @primary4 ip daddr @primary4 counter drop comment \"endpoint to endpoint: the data path's, with policy\"\n    \
         ip6 saddr @primary6 ip6 daddr @primary6 counter drop comment \"endpoint to endpoint: the data path's, with policy\"\n",
    );
    // An endpoint's VXLAN to a node (masqueraded to this node's address,
    // or to this node itself) would enter that node's overlay as a node's
    // own frame: refused in both ways through the stack.
    let overlay = format!(
        "    ip saddr @primary4 udp dport {VXLAN_PORT} counter drop comment \"an endpoint's VXLAN: only nodes speak the overlay\"\n    \
         ip6 saddr @primary6 udp dport {VXLAN_PORT} counter drop comment \"an endpoint's VXLAN: only nodes speak the overlay\"\n"
    );
    out.push_str(&overlay);
    out.push_str("  }\n");
    out.push_str(&format!(
        "  chain input {{\n    type filter hook input priority filter - 10; policy accept;\n{overlay}  }}\n"
    ));
    out.push_str(
        "  chain postrouting {\n    type nat hook postrouting priority srcnat + 10; policy accept;\n    \
         ip saddr @primary4 ip daddr != @primary4 ip daddr != @local_pods4 counter masquerade comment \"the cluster cannot route back to a Primary network\"\n    \
         ip6 saddr @primary6 ip6 daddr != @primary6 ip6 daddr != @local_pods6 counter masquerade comment \"the cluster cannot route back to a Primary network\"\n  }\n}\n",
    );
    out
}

/// Runs an `nft -f -` script.
fn apply(script: &str) -> std::io::Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    // An `nft` that fails early stops reading: its status and stderr say
    // why, not the broken pipe.
    let written = child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes());
    let out = child.wait_with_output()?;
    if out.status.success() {
        written
    } else {
        Err(std::io::Error::other(format!(
            "nft -f: {} ({})",
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        )))
    }
}

/// Keeps the table equal to [`desired`].
#[derive(Default)]
pub struct Handoff {
    synced: Option<Desired>,
    /// Whether the last attempt failed and said so: one warning per
    /// failure streak, not one per round.
    warned: bool,
}

impl Handoff {
    pub fn tick(&mut self, cfg: &Resolved) {
        let want = desired(cfg);
        if self.synced.as_ref() == Some(&want) {
            return;
        }
        // Nothing to remove on a node that never had a Primary network.
        if self.synced.is_none() && want.primary.is_empty() {
            self.synced = Some(want);
            return;
        }
        match apply(&ruleset(&want)) {
            Ok(()) => {
                info!(
                    subnets = want.primary.len(),
                    local_pod_cidrs = want.local_pods.len(),
                    table = TABLE,
                    "hand-off rules written"
                );
                WRITTEN.store(!want.primary.is_empty(), Ordering::Relaxed);
                self.synced = Some(want);
                self.warned = false;
            }
            // Retried next round: `synced` stays as it was.
            Err(e) if !self.warned => {
                warn!(
                    "the hand-off's nftables table {TABLE}: {e} (will retry): endpoints of \
                     Primary networks hand nothing to the node's stack until it is written"
                );
                self.warned = true;
            }
            Err(e) => debug!("the hand-off's nftables table {TABLE}: {e} (will retry)"),
        }
    }
}

/// Deletes the table: `vmpath agent --cleanup`. Without `nft` there is
/// nothing to delete: an agent that has no `nft` never wrote the table
/// (vmpath's image carries it; an agent run elsewhere may not have it, and
/// `--cleanup` must still clean the rest).
pub fn withdraw_all() -> std::io::Result<()> {
    match apply(&ruleset(&Desired::default())) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        done => done,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ruleset_replaces_the_table_whole_and_names_each_family() {
        let nets = |list: &[&str]| list.iter().map(|s| s.parse().unwrap()).collect();
        let want = Desired {
            primary: nets(&["10.31.0.0/24", "fd00:31::/64"]),
            local_pods: nets(&["10.244.0.0/24"]),
        };
        let r = ruleset(&want);
        assert!(r.starts_with(&format!(
            "table inet {TABLE} {{}}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n"
        )));
        assert!(r.contains("elements = { 10.31.0.0/24 }"), "{r}");
        assert!(r.contains("elements = { fd00:31::/64 }"), "{r}");
        assert!(r.contains("ip saddr @primary4 ip daddr @primary4 counter drop"));
        // An endpoint's VXLAN, towards another node and to this one.
        for chain in ["forward", "input"] {
            let body = r
                .split(&format!("chain {chain} {{"))
                .nth(1)
                .unwrap_or_default();
            let body = body.split("  }").next().unwrap_or_default();
            for rule in [
                "ip saddr @primary4 udp dport 4789 counter drop",
                "ip6 saddr @primary6 udp dport 4789 counter drop",
            ] {
                assert!(body.contains(rule), "{chain} lacks {rule}: {r}");
            }
        }
        assert!(
            r.contains(
                "set local_pods4 { type ipv4_addr; flags interval; elements = { 10.244.0.0/24 }; }"
            ),
            "{r}"
        );
        assert!(
            r.contains("set local_pods6 { type ipv6_addr; flags interval; }"),
            "{r}"
        );
        assert!(r.contains(
            "ip saddr @primary4 ip daddr != @primary4 ip daddr != @local_pods4 counter masquerade"
        ));
        assert_eq!(
            ruleset(&Desired::default()),
            format!("table inet {TABLE} {{}}\ndelete table inet {TABLE}\n")
        );
    }

    #[test]
    fn only_this_nodes_own_pod_cidrs_are_spared_the_masquerade() {
        // No vmpath Node document: a single node needs none.
        let docs = "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: blue}\n\
             spec: {id: 310, role: Primary, subnets: [10.31.0.0/24], defaultGatewayIPs: [10.31.0.1], ipam: {mode: Enabled}}\n---\n\
             apiVersion: v1\nkind: Node\nmetadata: {name: a}\nspec: {podCIDRs: [10.244.0.0/24, 'fd00:10:244::/64']}\n---\n\
             apiVersion: v1\nkind: Node\nmetadata: {name: b}\nspec: {podCIDRs: [10.244.1.0/24]}\n";
        let snap = crate::round::tests::snapshot_of(docs);
        let cfg = Resolved::new(crate::round::validate(
            &snap,
            "a",
            &crate::config::AcceptedKeys::new(),
        ));
        assert!(cfg.errors.is_empty(), "{:?}", cfg.errors);
        let want = desired(&cfg);
        let nets = |list: &[&str]| list.iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(want.primary, nets(&["10.31.0.0/24"]));
        // b's pod CIDR and the flags' cluster-wide ones still masquerade.
        assert_eq!(
            want.local_pods,
            nets(&["10.244.0.0/24", "fd00:10:244::/64"])
        );
    }
}
