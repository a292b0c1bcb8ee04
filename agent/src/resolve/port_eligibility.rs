//! Which interfaces may carry the VM-port program. A typo in an Attachment
//! (`port: lo`, the uplink, a host interface) must never take the node
//! down: only VM ports are touched.
//!
//! A port is eligible when it is none of: loopback, the uplink, vmpath's own
//! devices (slow path, VXLAN), an interface carrying one of the node's
//! addresses; and it is either
//! - created by vmpath's CNI plugin: marked with the ifalias
//!   [`CNI_MARKER`] (the plugin does not exist yet; this is its hook), or
//! - a veth or tap (tun) interface whose name matches the port pattern
//!   (`--port-pattern`); bridges, bonds, physical NICs and other kinds are
//!   refused.
//!
//! The check runs on every reconcile before addresses are claimed (an
//! ineligible port's Attachment is refused like a bad document), again right
//! before a program is attached (an interface can be renamed or replaced
//! in between), and once at start on the links an older agent left.

use std::{
    collections::BTreeMap,
    fmt, io,
    net::IpAddr,
    sync::{
        OnceLock,
        atomic::{AtomicUsize, Ordering},
    },
};

use futures_util::TryStreamExt as _;
use netlink_packet_route::{
    address::{AddressAttribute, AddressMessage},
    link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
};
use tracing::warn;
use vmpath_common::{SLOW0, SLOW1, VXLAN_IFNAME};

use crate::resolve::resolved::{Attachment, Resolved};

/// The ifalias vmpath's CNI plugin sets on the ports it creates.
pub use vmpath_api::cni::PORT_ALIAS as CNI_MARKER;
/// Names of VM ports in the tests, the demo (`vmpd-*`) and the examples
/// (`vm1-port`), and the usual veth/tap names of VM launchers.
pub const DEFAULT_PORT_PATTERN: &str = "vp*,vm*,veth*,tap*,vnet*";

/// What the node allows: the port name patterns and the uplink's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortPolicy {
    pub patterns: Vec<String>,
    pub uplink: String,
}

impl PortPolicy {
    /// `patterns` is a comma-separated list of globs (`*` and `?`).
    pub fn new(patterns: &str, uplink: &str) -> Self {
        PortPolicy {
            patterns: patterns
                .split(',')
                .map(|p| p.trim().to_string())
                .filter(|p| !p.is_empty())
                .collect(),
            uplink: uplink.to_string(),
        }
    }

    fn matches(&self, name: &str) -> bool {
        self.patterns.iter().any(|p| glob(p, name))
    }
}

/// `*` matches any run of characters, `?` one character.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// One interface of the node, as netlink shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iface {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` (veth, tun, bridge, bond, ...); none for a
    /// physical NIC.
    pub kind: Option<String>,
    pub loopback: bool,
    pub alias: Option<String>,
    /// Addresses on it, IPv6 link-local ones left out (every interface has
    /// one; they are not the node's).
    pub addrs: Vec<IpAddr>,
}

/// Why a port is not a VM port: the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ineligible {
    Loopback,
    Uplink,
    OwnDevice,
    NodeAddress(IpAddr),
    Kind(String),
    Pattern,
    Renamed(String),
}

impl Ineligible {
    /// Short rule name (for counts and tests).
    pub fn rule(&self) -> &'static str {
        match self {
            Ineligible::Loopback => "loopback",
            Ineligible::Uplink => "uplink",
            Ineligible::OwnDevice => "vmpath-device",
            Ineligible::NodeAddress(_) => "node-address",
            Ineligible::Kind(_) => "not-veth-or-tap",
            Ineligible::Pattern => "port-pattern",
            Ineligible::Renamed(_) => "renamed",
        }
    }
}

impl fmt::Display for Ineligible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {}: ", self.rule())?;
        match self {
            Ineligible::Loopback => write!(f, "it is the loopback interface"),
            Ineligible::Uplink => write!(f, "it is the node's uplink (--uplink)"),
            Ineligible::OwnDevice => write!(f, "it is vmpath's own device (slow path or VXLAN)"),
            Ineligible::NodeAddress(a) => write!(f, "it carries the node's address {a}"),
            Ineligible::Kind(k) => write!(
                f,
                "it is a {k}, not a veth or tap (VM ports are never bridges, bonds or physical NICs)"
            ),
            Ineligible::Pattern => write!(
                f,
                "its name matches no port pattern (--port-pattern) and vmpath's CNI plugin did not create it"
            ),
            Ineligible::Renamed(now) => write!(f, "the interface is now called {now:?}"),
        }
    }
}

/// The rules a name alone decides, for ports not present (yet): `lo`, the
/// uplink and vmpath's own devices are never VM ports, also before they
/// exist (vmpath creates its devices after the first reconcile).
pub fn judge_name(policy: &PortPolicy, name: &str) -> Result<(), Ineligible> {
    if name == "lo" {
        return Err(Ineligible::Loopback);
    }
    if name == policy.uplink {
        return Err(Ineligible::Uplink);
    }
    if [SLOW0, SLOW1, VXLAN_IFNAME].contains(&name) {
        return Err(Ineligible::OwnDevice);
    }
    Ok(())
}

/// Judges one interface against the policy.
pub fn judge(policy: &PortPolicy, iface: &Iface) -> Result<(), Ineligible> {
    if iface.loopback {
        return Err(Ineligible::Loopback);
    }
    judge_name(policy, &iface.name)?;
    if let Some(a) = iface.addrs.first() {
        return Err(Ineligible::NodeAddress(*a));
    }
    match iface.kind.as_deref() {
        Some("veth") | Some("tun") => {}
        Some("bridge") => return Err(Ineligible::Kind("bridge".into())),
        Some("bond") => return Err(Ineligible::Kind("bond".into())),
        None => return Err(Ineligible::Kind("physical NIC".into())),
        Some(other) => return Err(Ineligible::Kind(format!("{other} interface"))),
    }
    if iface.alias.as_deref() == Some(CNI_MARKER) || policy.matches(&iface.name) {
        Ok(())
    } else {
        Err(Ineligible::Pattern)
    }
}

// --- netlink ----------------------------------------------------------------

/// The links and addresses of the calling thread's namespace, dumped over
/// the agent's one netlink connection.
fn dump() -> io::Result<(Vec<LinkMessage>, Vec<AddressMessage>)> {
    let to_io = |e: rtnetlink::Error| io::Error::other(e.to_string());
    crate::sys::netlink::run(|handle| async move {
        let links: Vec<LinkMessage> = handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(to_io)?;
        let addrs: Vec<AddressMessage> = handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(to_io)?;
        Ok((links, addrs))
    })?
}

/// Every interface of the node's network namespace, by name.
pub fn interfaces() -> io::Result<BTreeMap<String, Iface>> {
    let (links, addrs) = dump()?;
    let mut by_index: BTreeMap<u32, Iface> = BTreeMap::new();
    for link in links {
        let mut iface = Iface {
            index: link.header.index,
            name: String::new(),
            kind: None,
            loopback: link.header.flags.contains(LinkFlags::Loopback),
            alias: None,
            addrs: Vec::new(),
        };
        for attr in link.attributes {
            match attr {
                LinkAttribute::IfName(n) => iface.name = n,
                LinkAttribute::IfAlias(a) => iface.alias = Some(a),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        if let LinkInfo::Kind(kind) = info {
                            iface.kind = Some(match kind {
                                InfoKind::Other(s) => s,
                                k => k.to_string(),
                            });
                        }
                    }
                }
                _ => {}
            }
        }
        by_index.insert(iface.index, iface);
    }
    for addr in addrs {
        let Some(iface) = by_index.get_mut(&addr.header.index) else {
            continue;
        };
        for attr in addr.attributes {
            if let AddressAttribute::Address(ip) = attr {
                let link_local =
                    matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
                if !link_local && !iface.addrs.contains(&ip) {
                    iface.addrs.push(ip);
                }
            }
        }
    }
    Ok(by_index
        .into_values()
        .map(|i| (i.name.clone(), i))
        .collect())
}

// --- the agent's uses ---------------------------------------------------------

static POLICY: OnceLock<PortPolicy> = OnceLock::new();
static REFUSED: AtomicUsize = AtomicUsize::new(0);

/// Sets the node's policy once, at agent start (the data path's re-check
/// before attach reads it; without it, as in fixture tests, there is none).
pub fn set_policy(policy: PortPolicy) {
    let _ = POLICY.set(policy);
}

/// The policy set at start, if any.
pub fn policy() -> Option<&'static PortPolicy> {
    POLICY.get()
}

/// Attachments whose port is refused right now (for `vmpath status`).
pub fn refused_count() -> usize {
    REFUSED.load(Ordering::Relaxed)
}

/// The ports an attachment uses on `node`: its active port, and a pending
/// migration's target port (the plan serves it before cut-over).
fn ports_on<'a>(a: &'a Attachment, node: &str) -> Vec<(&'static str, &'a str)> {
    let mut out = Vec::new();
    if a.elsewhere {
        return out;
    }
    if a.active_node() == node {
        let field = if a.active_port() == a.port {
            "spec.port"
        } else {
            "spec.migration.targetPort"
        };
        out.push((field, a.active_port()));
    }
    if let Some(m) = &a.migration
        && !m.ready
        && m.target_node == node
    {
        out.push((
            "spec.migration.targetPort",
            m.target_port.as_deref().unwrap_or(&a.port),
        ));
    }
    out
}

/// Refuses, like a bad document, every Attachment whose port on this node
/// exists and is not a VM port: before IPAM, so nothing is claimed for it,
/// and before planning, so nothing is attached (and a port that stopped
/// being eligible is detached by the next apply). Ports not present yet are
/// judged by name alone ([`judge_name`]).
pub fn refuse_ineligible(cfg: &mut Resolved, node: &str, policy: &PortPolicy) {
    let ifaces = match interfaces() {
        Ok(i) => i,
        Err(e) => {
            // Nothing can be judged this round. Running ports stay as they
            // are; a new attach is still refused by `recheck`, which fails
            // closed.
            warn!("listing interfaces to check ports: {e}");
            return;
        }
    };
    let mut refusals = Vec::new();
    for a in cfg.local_entries() {
        for (field, port) in ports_on(a, node) {
            let verdict = match ifaces.get(port) {
                Some(iface) => judge(policy, iface),
                None => judge_name(policy, port),
            };
            if let Err(why) = verdict {
                refusals.push((
                    a.key.clone(),
                    field,
                    format!("port {port:?} is not a VM port: {why}"),
                ));
                break;
            }
        }
    }
    REFUSED.store(refusals.len(), Ordering::Relaxed);
    for (key, field, msg) in refusals {
        cfg.refuse(&key, field, msg);
    }
}

/// The re-check right before the data path attaches to `ifindex`, planned
/// under the name `ifname`: still that interface, and still a VM port.
pub fn recheck(ifindex: u32, ifname: &str) -> Result<(), String> {
    let Some(policy) = POLICY.get() else {
        return Ok(());
    };
    let ifaces = interfaces().map_err(|e| format!("cannot list interfaces: {e}"))?;
    let Some(iface) = ifaces.values().find(|i| i.index == ifindex) else {
        return Err(format!("port {ifname:?} (ifindex {ifindex}) is gone"));
    };
    let verdict = if iface.name != ifname {
        Err(Ineligible::Renamed(iface.name.clone()))
    } else {
        judge(policy, iface)
    };
    verdict.map_err(|why| format!("port {ifname:?} (ifindex {ifindex}) is not a VM port: {why}"))
}

/// At start: removes the VM-port programs from every interface that is
/// not a VM port (an older agent's doing, or a renamed link), saying so.
/// Returns how many interfaces lost them.
pub fn repair(policy: &PortPolicy) -> usize {
    use crate::sys::tc_filters as port_filters;
    let (ifaces, carrying) =
        match interfaces().and_then(|i| Ok((i, port_filters::ports_carrying()?))) {
            Ok(found) => found,
            Err(e) => {
                warn!("listing interfaces to check attached ports: {e}");
                return 0;
            }
        };
    let mut removed = 0;
    for ifindex in carrying {
        let Some(iface) = ifaces.values().find(|i| i.index == ifindex) else {
            continue;
        };
        if let Err(why) = judge(policy, iface) {
            match port_filters::detach_port(ifindex) {
                Ok(_) => {
                    removed += 1;
                    warn!(ifname = %iface.name, ifindex, "removed the VM-port programs from an interface that is not a VM port: {why}");
                }
                Err(e) => {
                    warn!(ifname = %iface.name, ifindex, "cannot remove the VM-port programs from an interface that is not a VM port ({why}): {e}")
                }
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, kind: Option<&str>) -> Iface {
        Iface {
            index: 7,
            name: name.into(),
            kind: kind.map(String::from),
            loopback: false,
            alias: None,
            addrs: Vec::new(),
        }
    }

    fn policy() -> PortPolicy {
        PortPolicy::new(DEFAULT_PORT_PATTERN, "up0")
    }

    #[test]
    fn globs() {
        assert!(glob("vp*", "vp1a2vm1"));
        assert!(glob("vm*", "vm"));
        assert!(glob("*-port", "vm1-port"));
        assert!(glob("tap?", "tap0"));
        assert!(!glob("tap?", "tap10"));
        assert!(!glob("vp*", "up0"));
        assert!(glob("*", ""));
        assert!(glob("a*b*c", "aXXbYYc"));
        assert!(!glob("a*b*c", "aXXbYY"));
    }

    #[test]
    fn vm_ports_are_eligible() {
        for (name, kind) in [
            ("vp12vm1", "veth"),
            ("vmpd-vm1", "veth"),
            ("tap3", "tun"),
            ("vnet0", "tun"),
        ] {
            assert_eq!(judge(&policy(), &iface(name, Some(kind))), Ok(()), "{name}");
        }
    }

    #[test]
    fn each_rule_refuses_with_its_reason() {
        let mut lo = iface("lo", None);
        lo.loopback = true;
        let mut with_addr = iface("vmdummy", Some("veth"));
        with_addr.addrs.push("192.0.2.1".parse().unwrap());
        let cases = [
            (lo, "loopback"),
            (iface("up0", Some("veth")), "uplink"),
            (iface(SLOW0, Some("veth")), "vmpath-device"),
            (iface(SLOW1, Some("veth")), "vmpath-device"),
            (iface(VXLAN_IFNAME, Some("vxlan")), "vmpath-device"),
            (with_addr, "node-address"),
            (iface("vmbr0", Some("bridge")), "not-veth-or-tap"),
            (iface("vmbond0", Some("bond")), "not-veth-or-tap"),
            (iface("vmeth0", None), "not-veth-or-tap"),
            (iface("vmdummy0", Some("dummy")), "not-veth-or-tap"),
            (iface("eth5", Some("veth")), "port-pattern"),
        ];
        for (i, rule) in cases {
            let why = judge(&policy(), &i).unwrap_err();
            assert_eq!(why.rule(), rule, "{}: {why}", i.name);
            assert!(
                why.to_string().starts_with(&format!("rule {rule}: ")),
                "{why}"
            );
        }
    }

    #[test]
    fn absent_ports_are_judged_by_name_alone() {
        for (name, rule) in [
            ("lo", "loopback"),
            ("up0", "uplink"),
            (VXLAN_IFNAME, "vmpath-device"),
        ] {
            assert_eq!(judge_name(&policy(), name).unwrap_err().rule(), rule);
        }
        // A port that does not exist yet may still be a CNI port.
        assert_eq!(judge_name(&policy(), "lxc1234"), Ok(()));
    }

    #[test]
    fn the_cni_marker_admits_a_port_outside_the_pattern_but_not_past_the_other_rules() {
        let mut cni = iface("lxc1234", Some("veth"));
        assert_eq!(judge(&policy(), &cni).unwrap_err(), Ineligible::Pattern);
        cni.alias = Some(CNI_MARKER.into());
        assert_eq!(judge(&policy(), &cni), Ok(()));
        cni.kind = Some("bridge".into());
        assert!(judge(&policy(), &cni).is_err());
    }

    #[test]
    fn lists_this_namespaces_interfaces() {
        // Every namespace has a loopback; its addresses are the node's.
        let ifaces = interfaces().unwrap();
        let lo = ifaces.get("lo").expect("lo listed");
        assert!(lo.loopback);
        assert_eq!(judge(&policy(), lo).unwrap_err(), Ineligible::Loopback);
    }
}
