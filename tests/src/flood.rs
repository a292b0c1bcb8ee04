//! A misbehaving VM: slow-path frames (DHCPv4 DISCOVERs, DHCPv6 SOLICITs,
//! router solicitations) sent from a raw AF_PACKET socket in the VM's
//! namespace, back to back, as fast as the socket takes them, from the
//! VM's own MAC and link-local address (so port security lets them by).

use std::{
    fs,
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use vmpath::common::link_local_from_mac;

/// Which slow-path frames a flood sends (in turn).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloodKind {
    Dhcp4Discover,
    Dhcp6Solicit,
    RouterSolicit,
}

/// A running flood; `stop` ends it and says how many frames went out.
pub struct Flood {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<u64, String>>>,
}

impl Flood {
    /// Starts flooding out of `ifname` in the namespace at `ns_path`.
    pub fn start(ns_path: &str, ifname: &str, mac: [u8; 6], kinds: &[FloodKind]) -> Flood {
        let frames: Vec<Vec<u8>> = kinds.iter().map(|k| frame(*k, mac)).collect();
        assert!(!frames.is_empty(), "a flood needs a frame kind");
        let stop = Arc::new(AtomicBool::new(false));
        let (ns_path, ifname, flag) = (ns_path.to_string(), ifname.to_string(), stop.clone());
        let thread = std::thread::spawn(move || send_loop(&ns_path, &ifname, &frames, &flag));
        Flood {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the flood: the frames sent.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().expect("flood thread").join() {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => panic!("flood: {e}"),
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn send_loop(
    ns_path: &str,
    ifname: &str,
    frames: &[Vec<u8>],
    stop: &AtomicBool,
) -> Result<u64, String> {
    let ns = fs::File::open(ns_path).map_err(|e| format!("{ns_path}: {e}"))?;
    // SAFETY: setns on an fd we own; it moves only this thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "setns {ns_path}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let name = std::ffi::CString::new(ifname).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(format!("no interface {ifname} in {ns_path}"));
    }
    // SAFETY: plain socket(2); the fd is closed below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
    if fd < 0 {
        return Err(format!(
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: sockaddr_ll is plain data; all-zero is valid.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_ifindex = ifindex as i32;
    addr.sll_halen = 6;
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for f in frames {
            // SAFETY: the frame and address outlive the call.
            let rc = unsafe {
                libc::sendto(
                    fd,
                    f.as_ptr().cast(),
                    f.len(),
                    0,
                    (&addr as *const libc::sockaddr_ll).cast(),
                    size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            if rc > 0 {
                sent += 1;
            }
        }
    }
    // SAFETY: our fd.
    unsafe { libc::close(fd) };
    Ok(sent)
}

/// One frame of `kind` from `mac`.
pub fn frame(kind: FloodKind, mac: [u8; 6]) -> Vec<u8> {
    match kind {
        FloodKind::Dhcp4Discover => dhcp4_discover(mac, 0x0f100d),
        FloodKind::Dhcp6Solicit => {
            let dst = [0xff02, 0, 0, 0, 0, 0, 1, 2];
            // SOLICIT, transaction id, then a client id option (DUID-LL).
            let mut msg = vec![1, 0x0f, 0x10, 0x0d, 0, 1, 0, 10, 0, 3, 0, 1];
            msg.extend_from_slice(&mac);
            ipv6(mac, dst, 17, &udp6_payload(mac, dst, 546, 547, &msg))
        }
        FloodKind::RouterSolicit => {
            let dst = [0xff02, 0, 0, 0, 0, 0, 0, 2];
            // Type 133, code 0, checksum, reserved, source link-layer option.
            let mut icmp = vec![133, 0, 0, 0, 0, 0, 0, 0, 1, 1];
            icmp.extend_from_slice(&mac);
            let sum = checksum6(mac, dst, 58, &icmp);
            icmp[2..4].copy_from_slice(&sum.to_be_bytes());
            ipv6(mac, dst, 58, &icmp)
        }
    }
}

/// A broadcast DHCPv4 DISCOVER from `mac` (as udhcpc sends it).
pub fn dhcp4_discover(mac: [u8; 6], xid: u32) -> Vec<u8> {
    let mut bootp = vec![1, 1, 6, 0];
    bootp.extend_from_slice(&xid.to_be_bytes());
    bootp.extend_from_slice(&[0, 0, 0x80, 0]);
    bootp.resize(28, 0);
    bootp.extend_from_slice(&mac);
    bootp.resize(236, 0);
    bootp.extend_from_slice(&[99, 130, 83, 99, 53, 1, 1, 255]);
    let mut udp = Vec::with_capacity(8 + bootp.len());
    udp.extend_from_slice(&68u16.to_be_bytes());
    udp.extend_from_slice(&67u16.to_be_bytes());
    udp.extend_from_slice(&((8 + bootp.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(&bootp);
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + udp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0, 0, 64, 17, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255]);
    let sum = fold(sum16(&ip, 0));
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&ip);
    f.extend_from_slice(&udp);
    f
}

fn udp6_payload(mac: [u8; 6], dst: [u16; 8], sport: u16, dport: u16, data: &[u8]) -> Vec<u8> {
    let mut udp = Vec::with_capacity(8 + data.len());
    udp.extend_from_slice(&sport.to_be_bytes());
    udp.extend_from_slice(&dport.to_be_bytes());
    udp.extend_from_slice(&((8 + data.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(data);
    let sum = checksum6(mac, dst, 17, &udp);
    udp[6..8].copy_from_slice(&sum.to_be_bytes());
    udp
}

/// Ethernet + IPv6 from the link-local address of `mac` to the multicast
/// group `dst`.
fn ipv6(mac: [u8; 6], dst: [u16; 8], next: u8, payload: &[u8]) -> Vec<u8> {
    let dst = std::net::Ipv6Addr::from(dst).octets();
    let mut f = vec![0x33, 0x33, dst[12], dst[13], dst[14], dst[15]];
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    f.push(next);
    f.push(255);
    f.extend_from_slice(&link_local_from_mac(mac));
    f.extend_from_slice(&dst);
    f.extend_from_slice(payload);
    f
}

fn checksum6(mac: [u8; 6], dst: [u16; 8], next: u8, l4: &[u8]) -> u16 {
    let mut pseudo = link_local_from_mac(mac).to_vec();
    pseudo.extend_from_slice(&std::net::Ipv6Addr::from(dst).octets());
    pseudo.extend_from_slice(&(l4.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, next]);
    fold(sum16(l4, sum16(&pseudo, 0)))
}

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    for c in data.chunks(2) {
        acc += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}
