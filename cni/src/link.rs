//! Links, addresses and routes over rtnetlink, in-process: one netlink
//! socket in the node's namespace and one opened inside the pod's (the
//! thread enters the pod's namespace only to open it). An ADD is a handful
//! of netlink messages, microseconds each, where spawning `ip` and
//! `nsenter` for each step cost milliseconds.

use std::{
    fs::File,
    io,
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
};

use futures_util::TryStreamExt as _;
use ipnet::IpNet;
use rtnetlink::{
    Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
    packet_route::{
        address::AddressHeaderFlags,
        link::{InfoData, InfoVeth, LinkAttribute, LinkMessage},
    },
};
use tokio::runtime::Runtime;
use vmpath_api::cni::PORT_ALIAS;

/// One link as the plugin looks at it.
#[derive(Debug, Clone)]
pub struct LinkInfo {
    pub ifname: String,
    pub index: u32,
    pub address: Option<String>,
    pub mtu: Option<u32>,
}

impl LinkInfo {
    fn of(msg: &LinkMessage) -> LinkInfo {
        let mut info = LinkInfo {
            ifname: String::new(),
            index: msg.header.index,
            address: None,
            mtu: None,
        };
        for attr in &msg.attributes {
            match attr {
                LinkAttribute::IfName(n) => info.ifname = n.clone(),
                LinkAttribute::Address(a) if a.len() == 6 => {
                    info.address = Some(
                        a.iter()
                            .map(|b| format!("{b:02x}"))
                            .collect::<Vec<_>>()
                            .join(":"),
                    );
                }
                LinkAttribute::Mtu(m) => info.mtu = Some(*m),
                _ => {}
            }
        }
        info
    }
}

/// Netlink connections: the node's namespace, and the pod's when given.
pub struct Netlink {
    rt: Runtime,
    host: Handle,
    pod: Option<(Handle, File, String)>,
}

/// Moves the calling thread into the namespace of `fd` (setns(2)).
fn enter(fd: &impl std::os::fd::AsRawFd) -> io::Result<()> {
    // SAFETY: setns on a valid, open namespace fd; affects this thread only.
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn connect(rt: &Runtime) -> io::Result<Handle> {
    // The socket belongs to the namespace it is opened in; the runtime only
    // drives it.
    let _ctx = rt.enter();
    let (conn, handle, _) = rtnetlink::new_connection()?;
    rt.spawn(conn);
    Ok(handle)
}

fn is_missing(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m)
        if m.raw_code() == -libc::ENODEV || m.raw_code() == -libc::ENOENT)
}

fn mac_bytes(mac: &str) -> Result<Vec<u8>, String> {
    let bytes: Vec<u8> = mac
        .split([':', '-'])
        .map(|p| u8::from_str_radix(p, 16))
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{mac:?} is not a MAC address"))?;
    if bytes.len() != 6 {
        return Err(format!("{mac:?} is not a MAC address"));
    }
    Ok(bytes)
}

impl Netlink {
    /// Connects in this namespace, and in `netns` (a path such as
    /// `/proc/PID/ns/net` or `/run/netns/NAME`) when given.
    pub fn open(netns: Option<&str>) -> Result<Netlink, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(|e| format!("netlink runtime: {e}"))?;
        let host = connect(&rt).map_err(|e| format!("netlink socket: {e}"))?;
        let pod = match netns {
            None => None,
            Some(path) => {
                let ns = File::open(path).map_err(|e| format!("opening {path}: {e}"))?;
                let home = File::open("/proc/thread-self/ns/net")
                    .map_err(|e| format!("opening this thread's namespace: {e}"))?;
                enter(&ns.as_fd()).map_err(|e| format!("entering {path}: {e}"))?;
                let handle = connect(&rt);
                // Back home before anything else, whatever happened.
                enter(&home.as_fd()).map_err(|e| format!("leaving {path}: {e}"))?;
                let handle = handle.map_err(|e| format!("netlink socket in {path}: {e}"))?;
                Some((handle, ns, path.to_string()))
            }
        };
        Ok(Netlink { rt, host, pod })
    }

    fn pod(&self) -> Result<&(Handle, File, String), String> {
        self.pod
            .as_ref()
            .ok_or_else(|| "no pod namespace given".to_string())
    }

    fn get(&self, handle: &Handle, name: &str) -> Result<Option<LinkInfo>, String> {
        let found = self.rt.block_on(async {
            handle
                .link()
                .get()
                .match_name(name.to_string())
                .execute()
                .try_next()
                .await
        });
        match found {
            Ok(msg) => Ok(msg.as_ref().map(LinkInfo::of)),
            Err(e) if is_missing(&e) => Ok(None),
            Err(e) => Err(format!("looking up {name}: {e}")),
        }
    }

    /// The link `name` in the node's namespace.
    pub fn host_link(&self, name: &str) -> Result<Option<LinkInfo>, String> {
        self.get(&self.host, name)
    }

    /// The link `name` in the pod's namespace.
    pub fn pod_link(&self, name: &str) -> Result<Option<LinkInfo>, String> {
        self.get(&self.pod()?.0, name)
    }

    /// Creates the veth pair: `host` here, `ifname` directly in the pod's
    /// namespace with `mac` when given, both with `mtu`, both up; the host
    /// side carries [`PORT_ALIAS`]. With `quiet`, the pod side's kernel
    /// IPv6 is off before it comes up ([`Netlink::quiet_ipv6`]). Nothing is
    /// left behind on failure.
    pub fn create_veth(
        &self,
        host: &str,
        ifname: &str,
        mac: Option<&str>,
        mtu: u32,
        quiet: bool,
    ) -> Result<LinkInfo, String> {
        let (pod, ns, path) = self.pod()?;
        if self.get(pod, ifname)?.is_some() {
            return Err(format!("{ifname} already exists in {path}"));
        }
        // A stale host side (an ADD that crashed) would block the name.
        self.delete(host)?;
        let mut peer = LinkMessageBuilder::<LinkUnspec>::default()
            .name(ifname.to_string())
            .mtu(mtu)
            .setns_by_fd(ns.as_raw_fd());
        if let Some(mac) = mac {
            peer = peer.address(mac_bytes(mac)?);
        }
        let msg = LinkVeth::new(host, ifname)
            .mtu(mtu)
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer.build())))
            .build();
        self.rt
            .block_on(async { self.host.link().add(msg).execute().await })
            .map_err(|e| format!("creating veth {host} / {ifname} in {path}: {e}"))?;
        let finish = || -> Result<LinkInfo, String> {
            let host_side = self
                .get(&self.host, host)?
                .ok_or_else(|| format!("{host} vanished"))?;
            let pod_side = self
                .get(pod, ifname)?
                .ok_or_else(|| format!("{ifname} vanished from {path}"))?;
            if quiet {
                self.quiet_ipv6(ifname)?;
            }
            self.rt
                .block_on(async {
                    pod.link()
                        .set(LinkUnspec::new_with_index(pod_side.index).up().build())
                        .execute()
                        .await?;
                    // The agent attaches only to VM ports: this alias marks
                    // the port as the plugin's (its port-eligibility rule).
                    self.host
                        .link()
                        .set(
                            LinkUnspec::new_with_index(host_side.index)
                                .alias(PORT_ALIAS)
                                .up()
                                .build(),
                        )
                        .execute()
                        .await
                })
                .map_err(|e| format!("bringing up {host} / {ifname}: {e}"))?;
            Ok(pod_side)
        };
        finish().inspect_err(|_| {
            let _ = self.delete(host);
        })
    }

    /// Switches the kernel's own IPv6 off on the pod's `ifname`:
    /// `addr_gen_mode` 1 (no link-local address) and `disable_ipv6` 1, in
    /// the pod's namespace. A VM pod's interface carries the VM's MAC and
    /// is only bridged to the VM; were its kernel to speak (DAD from ::,
    /// MLD, router solicitation the moment the link is up), a live
    /// migration's target would look as if the VM had resumed there while
    /// it still runs on the source. Must run before the link goes up. A
    /// kernel without IPv6 has nothing to switch off.
    fn quiet_ipv6(&self, ifname: &str) -> Result<(), String> {
        let (_, ns, path) = self.pod()?;
        let home = File::open("/proc/thread-self/ns/net")
            .map_err(|e| format!("opening this thread's namespace: {e}"))?;
        enter(&ns.as_fd()).map_err(|e| format!("entering {path}: {e}"))?;
        // /proc/sys/net is the namespace of the thread that opens it.
        let written = (|| {
            if !std::path::Path::new("/proc/sys/net/ipv6").exists() {
                return Ok(());
            }
            for (key, value) in [("addr_gen_mode", "1"), ("disable_ipv6", "1")] {
                let file = format!("/proc/sys/net/ipv6/conf/{ifname}/{key}");
                std::fs::write(&file, value)
                    .map_err(|e| format!("setting {file} to {value} in {path}: {e}"))?;
            }
            Ok(())
        })();
        // Back home before anything else, whatever happened.
        enter(&home.as_fd()).map_err(|e| format!("leaving {path}: {e}"))?;
        written
    }

    /// Deletes `name` here (its veth peer goes with it); absent is fine.
    pub fn delete(&self, name: &str) -> Result<(), String> {
        let Some(link) = self.get(&self.host, name)? else {
            return Ok(());
        };
        match self
            .rt
            .block_on(async { self.host.link().del(link.index).execute().await })
        {
            Ok(()) => Ok(()),
            Err(e) if is_missing(&e) => Ok(()),
            Err(e) => Err(format!("deleting {name}: {e}")),
        }
    }

    /// Gives the pod's `ifname` (index `index`) `addresses` and a route per
    /// entry of `routes` (destination, gateway).
    pub fn configure_pod(
        &self,
        index: u32,
        addresses: &[IpNet],
        routes: &[(IpNet, IpAddr)],
    ) -> Result<(), String> {
        let (pod, _, path) = self.pod()?;
        for a in addresses {
            let mut req = pod.address().add(index, a.addr(), a.prefix_len());
            if a.addr().is_ipv6() {
                // The agent's IPAM already made the address unique.
                req.message_mut().header.flags |= AddressHeaderFlags::Nodad;
            }
            self.rt
                .block_on(req.execute())
                .map_err(|e| format!("adding {a} in {path}: {e}"))?;
        }
        for (dst, gw) in routes {
            let msg = RouteMessageBuilder::<IpAddr>::new()
                .destination_prefix(dst.addr(), dst.prefix_len())
                .and_then(|b| b.gateway(*gw))
                .map_err(|e| format!("route {dst} via {gw}: {e}"))?
                .output_interface(index)
                .build();
            self.rt
                .block_on(pod.route().add(msg).replace().execute())
                .map_err(|e| format!("route {dst} via {gw} in {path}: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_or_are_refused() {
        assert_eq!(
            mac_bytes("02:00:0a:ff:00:01").unwrap(),
            [2, 0, 10, 255, 0, 1]
        );
        assert!(mac_bytes("02:00:0a:ff:00").is_err());
        assert!(mac_bytes("zz:00:0a:ff:00:01").is_err());
    }
}
