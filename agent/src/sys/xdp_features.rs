//! A device's XDP features, from the kernel's `netdev` generic netlink
//! family (Linux 6.3+): whether XDP_REDIRECT may send to it
//! (`NETDEV_XDP_ACT_NDO_XMIT`). A veth reports it only while its peer
//! runs NAPI (an XDP program or GRO on the peer): without, `veth_xdp_xmit`
//! drops every frame, unseen by the data path's counters. A tap reports
//! it always.

use std::io;

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETDEV_CMD_DEV_GET: u8 = 1;
const NETDEV_A_DEV_IFINDEX: u16 = 1;
const NETDEV_A_DEV_XDP_FEATURES: u16 = 3;
/// `NETDEV_XDP_ACT_NDO_XMIT`: the device takes redirected XDP frames.
pub const NETDEV_XDP_ACT_NDO_XMIT: u64 = 1 << 2;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_HDR: usize = 16;
const GENL_HDR: usize = 4;

/// A generic netlink socket bound to the `netdev` family, in the calling
/// thread's network namespace.
pub struct Netdev {
    fd: std::os::fd::OwnedFd,
    family: u16,
    seq: u32,
}

impl Netdev {
    pub fn open() -> io::Result<Netdev> {
        // SAFETY: a plain socket(2) call; the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_GENERIC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let fd = unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) };
        let mut nd = Netdev {
            fd,
            family: GENL_ID_CTRL,
            seq: 0,
        };
        let reply = nd.request(
            GENL_ID_CTRL,
            CTRL_CMD_GETFAMILY,
            &attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0"),
        )?;
        let id = find_attr(&reply, CTRL_ATTR_FAMILY_ID)
            .filter(|v| v.len() >= 2)
            .map(|v| u16::from_ne_bytes([v[0], v[1]]))
            .ok_or_else(|| io::Error::other("no netdev family id in the reply"))?;
        nd.family = id;
        Ok(nd)
    }

    /// The XDP features (`NETDEV_XDP_ACT_*` bits) of the device `ifindex`.
    pub fn xdp_features(&mut self, ifindex: u32) -> io::Result<u64> {
        let reply = self.request(
            self.family,
            NETDEV_CMD_DEV_GET,
            &attr(NETDEV_A_DEV_IFINDEX, &ifindex.to_ne_bytes()),
        )?;
        find_attr(&reply, NETDEV_A_DEV_XDP_FEATURES)
            .filter(|v| v.len() >= 8)
            .map(|v| u64::from_ne_bytes(v[..8].try_into().unwrap_or_default()))
            .ok_or_else(|| io::Error::other(format!("no XDP features for ifindex {ifindex}")))
    }

    /// Does XDP_REDIRECT to the device `ifindex` deliver (not drop)?
    pub fn takes_redirects(&mut self, ifindex: u32) -> io::Result<bool> {
        Ok(self.xdp_features(ifindex)? & NETDEV_XDP_ACT_NDO_XMIT != 0)
    }

    /// Sends one request and returns the attributes of its reply.
    fn request(&mut self, msg_type: u16, cmd: u8, attrs: &[u8]) -> io::Result<Vec<u8>> {
        self.seq = self.seq.wrapping_add(1);
        let len = NLMSG_HDR + GENL_HDR + attrs.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&(len as u32).to_ne_bytes());
        msg.extend_from_slice(&msg_type.to_ne_bytes());
        msg.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&[cmd, 1, 0, 0]);
        msg.extend_from_slice(attrs);
        let raw = std::os::fd::AsRawFd::as_raw_fd(&self.fd);
        // SAFETY: `msg` is a live buffer of `msg.len()` bytes.
        let sent = unsafe { libc::send(raw, msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 16384];
        loop {
            // SAFETY: `buf` is a live, writable buffer of `buf.len()` bytes.
            let n = unsafe { libc::recv(raw, buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            let n = n as usize;
            if n < NLMSG_HDR {
                return Err(io::Error::other("short netlink reply"));
            }
            let hdr_len = u32::from_ne_bytes(buf[0..4].try_into().unwrap_or_default()) as usize;
            let ty = u16::from_ne_bytes([buf[4], buf[5]]);
            let seq = u32::from_ne_bytes(buf[8..12].try_into().unwrap_or_default());
            if seq != self.seq {
                continue;
            }
            let end = hdr_len.min(n);
            if ty == NLMSG_ERROR {
                let code = i32::from_ne_bytes(buf[16..20].try_into().unwrap_or_default());
                return Err(io::Error::from_raw_os_error(-code));
            }
            if end < NLMSG_HDR + GENL_HDR {
                return Err(io::Error::other("short generic netlink reply"));
            }
            return Ok(buf[NLMSG_HDR + GENL_HDR..end].to_vec());
        }
    }
}

/// One netlink attribute, padded to 4 bytes.
fn attr(ty: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut v = Vec::with_capacity(len.next_multiple_of(4));
    v.extend_from_slice(&(len as u16).to_ne_bytes());
    v.extend_from_slice(&ty.to_ne_bytes());
    v.extend_from_slice(value);
    v.resize(len.next_multiple_of(4), 0);
    v
}

/// The value of the first attribute of type `ty` in `attrs`.
fn find_attr(attrs: &[u8], ty: u16) -> Option<&[u8]> {
    let mut off = 0;
    while off + 4 <= attrs.len() {
        let len = usize::from(u16::from_ne_bytes([attrs[off], attrs[off + 1]]));
        let t = u16::from_ne_bytes([attrs[off + 2], attrs[off + 3]]) & 0x3fff;
        if len < 4 || off + len > attrs.len() {
            return None;
        }
        if t == ty {
            return Some(&attrs[off + 4..off + len]);
        }
        off += len.next_multiple_of(4);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_round_trip_with_padding() {
        let mut attrs = attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0");
        assert_eq!(attrs.len(), 12, "4 header + 7 value, padded to 12");
        attrs.extend(attr(CTRL_ATTR_FAMILY_ID, &0x1234u16.to_ne_bytes()));
        assert_eq!(
            find_attr(&attrs, CTRL_ATTR_FAMILY_ID),
            Some(&0x1234u16.to_ne_bytes()[..])
        );
        assert_eq!(
            find_attr(&attrs, CTRL_ATTR_FAMILY_NAME),
            Some(&b"netdev\0"[..])
        );
        assert_eq!(find_attr(&attrs, 9), None);
    }
}
