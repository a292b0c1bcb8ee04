//! Interface lookups in this network namespace: names to indexes, MTUs,
//! flags and addresses. The lowest layer of the agent: it knows no config
//! and no maps, so any module may ask it.

use std::{
    ffi::{CStr, CString},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

/// The ifindex of `name`, or `None` if no such interface exists here.
pub fn ifindex_of(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => None,
        i => Some(i),
    }
}

/// The name of interface `ifindex`, or `None` if there is none here.
pub fn name_of(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has room for IF_NAMESIZE bytes, as the call requires;
    // on success it holds a NUL-terminated name.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: if_indextoname succeeded: `buf` is NUL-terminated.
    let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// The interface that holds the address `addr` (either family).
pub fn holding(addr: IpAddr) -> Option<String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs built,
        // alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points at a sockaddr of the list.
        let held = match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: sa_family is AF_INET, so the sockaddr is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: sa_family is AF_INET6, so the sockaddr is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        if held == addr {
            // SAFETY: ifa_name is a NUL-terminated name owned by the list.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
                .to_string_lossy()
                .into_owned();
            found = Some(name);
            break;
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once; nothing of the
    // list is used after this.
    unsafe { libc::freeifaddrs(head) };
    found
}

/// Runs the interface ioctl `request` for `ifname` on a throwaway socket and
/// returns the filled request, or `None` when it fails. An ioctl, not
/// /sys/class/net, which would show the host's namespace under `nsenter --net`.
fn ifreq(ifname: &str, request: libc::Ioctl) -> Option<libc::ifreq> {
    // SAFETY: plain socket(2) call; the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req
        .ifr_name
        .iter_mut()
        .zip(ifname.bytes().take(libc::IFNAMSIZ - 1))
    {
        *dst = src as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq with a NUL-terminated name (at most
    // IFNAMSIZ - 1 bytes were copied into zeroes), `fd` is ours.
    let rc = unsafe { libc::ioctl(fd, request, &mut req) };
    // SAFETY: `fd` is open and closed once.
    unsafe { libc::close(fd) };
    (rc == 0).then_some(req)
}

/// The MTU of `ifname` (SIOCGIFMTU).
pub fn mtu_of(ifname: &str) -> Option<u32> {
    let req = ifreq(ifname, libc::SIOCGIFMTU)?;
    // SAFETY: SIOCGIFMTU succeeded, so the union holds ifru_mtu.
    Some(unsafe { req.ifr_ifru.ifru_mtu } as u32)
}

/// Whether `ifname` is administratively up (SIOCGIFFLAGS).
pub fn is_up(ifname: &str) -> bool {
    ifreq(ifname, libc::SIOCGIFFLAGS)
        // SAFETY: SIOCGIFFLAGS succeeded, so the union holds ifru_flags.
        .is_some_and(|req| (unsafe { req.ifr_ifru.ifru_flags } as i32 & libc::IFF_UP) != 0)
}

/// Whether `ifname` resolves no neighbours (`IFF_NOARP`).
pub fn is_noarp(ifname: &str) -> bool {
    ifreq(ifname, libc::SIOCGIFFLAGS)
        // SAFETY: SIOCGIFFLAGS succeeded, so the union holds ifru_flags.
        .is_some_and(|req| (unsafe { req.ifr_ifru.ifru_flags } as i32 & libc::IFF_NOARP) != 0)
}

/// Every address of this namespace's interfaces (IPv4 and IPv6).
pub fn local_addresses() -> std::collections::BTreeSet<std::net::IpAddr> {
    let mut out = std::collections::BTreeSet::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs built,
        // alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points at a sockaddr of the list.
        match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: sa_family is AF_INET, so the sockaddr is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.insert(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)).into());
            }
            libc::AF_INET6 => {
                // SAFETY: sa_family is AF_INET6, so the sockaddr is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.insert(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr).into());
            }
            _ => {}
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_by_name_and_by_address() {
        let lo = ifindex_of("lo").expect("lo exists in every namespace");
        assert!(lo > 0);
        assert_eq!(holding(Ipv4Addr::LOCALHOST.into()).as_deref(), Some("lo"));
        assert!(mtu_of("lo").is_some_and(|m| m >= 1280));
    }

    #[test]
    fn a_missing_interface_is_none() {
        assert_eq!(ifindex_of("vmp-no-such0"), None);
        assert_eq!(ifindex_of("bad\0name"), None);
        assert_eq!(mtu_of("vmp-no-such0"), None);
        assert!(!is_up("vmp-no-such0"));
        assert_eq!(holding(Ipv4Addr::new(192, 0, 2, 254).into()), None);
    }
}
