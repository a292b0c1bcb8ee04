//! Small helpers: statistics, network namespaces per thread, frames, the
//! machine description.

use std::{fs, os::fd::AsRawFd, process::Command};

use anyhow::{Context as _, Result, bail};

/// Median and spread of repeated runs.
#[derive(Clone, Debug)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

pub fn summary(samples: &[f64]) -> Summary {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return Summary {
            median: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
        };
    }
    let median = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    Summary {
        median,
        min: v[0],
        max: v[v.len() - 1],
    }
}

/// Per-round paired ratios `a[i] / b[i]` (the two measured back to back in
/// round i), summarised: noise that moves a whole round cancels out.
pub fn paired_ratio(a: &[f64], b: &[f64]) -> Summary {
    let ratios: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    summary(&ratios)
}

/// The order of `n` setups in round `round`: rotated by one each round, so
/// none always goes first (or last) after the same neighbour.
pub fn rotated(n: usize, round: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |k| (k + round) % n)
}

/// A percentile (0..=100) of `samples`, nearest rank.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

/// A number with a sensible count of digits.
pub fn fmt(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    let a = x.abs();
    if a >= 1000.0 {
        format!("{x:.0}")
    } else if a >= 100.0 {
        format!("{x:.1}")
    } else if a >= 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// `median (min–max)`.
/// The drop counters that are not zero, as `name count`, by reason.
pub fn nonzero_drops(drops: &[u64]) -> Vec<String> {
    drops
        .iter()
        .enumerate()
        .filter(|(_, n)| **n != 0)
        .map(|(i, n)| format!("{} {n}", vmpath_common::drop_reason::NAMES[i]))
        .collect()
}

/// The drops that moved, as `reason n, ...`, or `none`.
pub fn drops_text(drops: &[u64]) -> String {
    let names = nonzero_drops(drops);
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

pub fn fmt_summary(s: &Summary) -> String {
    format!("{} ({}–{})", fmt(s.median), fmt(s.min), fmt(s.max))
}

/// Runs `f` on a new thread that has entered the network namespace at
/// `ns_path` (`/run/netns/NAME`). Sockets made there stay in that namespace.
pub fn in_netns<T: Send>(ns_path: &str, f: impl FnOnce() -> T + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| -> Result<T> {
            enter_netns(ns_path)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// Moves the calling thread into the network namespace at `ns_path`.
pub fn enter_netns(ns_path: &str) -> Result<()> {
    let f = fs::File::open(ns_path).with_context(|| format!("opening {ns_path}"))?;
    // SAFETY: setns on an fd we own; affects only this thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns {ns_path}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Pins the calling thread to one CPU.
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET and
    // sched_setaffinity(0, ..) touch only it and this thread's mask.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!("pinning to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs a command, failing with its stderr.
pub fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "{} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Peak and current RSS (kB) of a process from /proc/PID/status.
pub fn rss_kb(pid: &str) -> (u64, u64) {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// The machine, for the report.
pub fn machine() -> Vec<(String, String)> {
    let cpu = fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let get = |args: &[&str]| sh(args).map(|s| s.trim().to_string()).unwrap_or_default();
    let mem = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse::<u64>().ok())
        .map(|kb| format!("{:.1} GiB", kb as f64 / 1048576.0))
        .unwrap_or_default();
    vec![
        ("nproc".into(), get(&["nproc"])),
        ("CPU".into(), cpu),
        ("memory".into(), mem),
        ("kernel".into(), get(&["uname", "-r"])),
        (
            "date".into(),
            get(&["date", "-u", "+%Y-%m-%d %H:%M:%S UTC"]),
        ),
        ("rustc".into(), get(&["rustc", "--version"])),
    ]
}

// ---------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------

pub type Mac = [u8; 6];
pub type Ip4 = [u8; 4];

pub fn csum(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        sum += u32::from(w);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn eth(dst: Mac, src: Mac, ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(128);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

fn ipv4(f: &mut Vec<u8>, src: Ip4, dst: Ip4, proto: u8, payload_len: usize) {
    let start = f.len();
    let tot = (20 + payload_len) as u16;
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&tot.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0x40, 0, 64, proto, 0, 0]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&dst);
    let c = csum(&f[start..start + 20]);
    f[start + 10..start + 12].copy_from_slice(&c.to_be_bytes());
}

/// Ethernet + IPv4 + UDP with `payload` (UDP checksum 0: allowed in IPv4).
pub fn udp4(
    dst_mac: Mac,
    src_mac: Mac,
    src: Ip4,
    dst: Ip4,
    sport: u16,
    dport: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = eth(dst_mac, src_mac, 0x0800);
    ipv4(&mut f, src, dst, 17, 8 + payload.len());
    f.extend_from_slice(&sport.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

/// A 64-byte-on-the-wire UDP frame (60 bytes + FCS).
pub fn udp4_min(dst_mac: Mac, src_mac: Mac, src: Ip4, dst: Ip4) -> Vec<u8> {
    udp4(dst_mac, src_mac, src, dst, 4000, 9, &[0u8; 18])
}

/// ICMP echo request with 56 bytes of data (what ping sends).
pub fn echo4(dst_mac: Mac, src_mac: Mac, src: Ip4, dst: Ip4) -> Vec<u8> {
    let mut f = eth(dst_mac, src_mac, 0x0800);
    ipv4(&mut f, src, dst, 1, 64);
    let start = f.len();
    f.extend_from_slice(&[8, 0, 0, 0, 0x12, 0x34, 0, 1]);
    f.extend(0..56u8);
    let c = csum(&f[start..]);
    f[start + 2..start + 4].copy_from_slice(&c.to_be_bytes());
    f
}

/// ARP request (who-has `tpa` tell `spa`), broadcast, padded to 60 bytes.
pub fn arp_request(src_mac: Mac, spa: Ip4, tpa: Ip4) -> Vec<u8> {
    let mut f = eth([0xff; 6], src_mac, 0x0806);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&spa);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&tpa);
    f.resize(60, 0);
    f
}

pub fn mac_str(m: &Mac) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

// ---------------------------------------------------------------------------
// Raw sockets
// ---------------------------------------------------------------------------

/// An AF_PACKET raw socket bound to one interface of the calling thread's
/// namespace.
pub struct RawSock {
    pub fd: i32,
}

impl RawSock {
    pub fn open(ifname: &str) -> Result<Self> {
        let proto = (libc::ETH_P_ALL as u16).to_be() as i32;
        // SAFETY: plain socket syscalls on values we own.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
        if fd < 0 {
            bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
        }
        let name = std::ffi::CString::new(ifname)?;
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as i32;
        if ifindex == 0 {
            unsafe { libc::close(fd) };
            bail!("no interface {ifname}");
        }
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto as u16;
        sll.sll_ifindex = ifindex;
        let rc = unsafe {
            libc::bind(
                fd,
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc != 0 {
            unsafe { libc::close(fd) };
            bail!("bind AF_PACKET: {}", std::io::Error::last_os_error());
        }
        Ok(RawSock { fd })
    }

    pub fn set_rcv_timeout(&self, ms: u64) {
        let tv = libc::timeval {
            tv_sec: (ms / 1000) as i64,
            tv_usec: ((ms % 1000) * 1000) as i64,
        };
        unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
    }

    /// Skips the qdisc layer (the VM side would not have one to speak of).
    pub fn qdisc_bypass(&self) {
        let one: i32 = 1;
        unsafe {
            libc::setsockopt(
                self.fd,
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                &one as *const _ as *const libc::c_void,
                4,
            )
        };
    }

    pub fn send(&self, frame: &[u8]) -> Result<()> {
        let rc = unsafe {
            libc::send(
                self.fd,
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
            )
        };
        if rc < 0 {
            bail!("send: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receives one incoming frame (our own outgoing ones are skipped);
    /// `None` on timeout.
    pub fn recv(&self, buf: &mut [u8]) -> Option<usize> {
        loop {
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            let rc = unsafe {
                libc::recvfrom(
                    self.fd,
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                    &mut sll as *mut _ as *mut libc::sockaddr,
                    &mut len,
                )
            };
            if rc < 0 {
                return None;
            }
            if sll.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            return Some(rc as usize);
        }
    }

    /// Sends `frame` `batch` times per sendmmsg call until `stop`; returns
    /// the number of frames the kernel accepted.
    pub fn blast(&self, frame: &[u8], batch: usize, stop: &std::sync::atomic::AtomicBool) -> u64 {
        let mut iov = libc::iovec {
            iov_base: frame.as_ptr() as *mut libc::c_void,
            iov_len: frame.len(),
        };
        let mut msgs: Vec<libc::mmsghdr> = (0..batch)
            .map(|_| {
                let mut m: libc::mmsghdr = unsafe { std::mem::zeroed() };
                m.msg_hdr.msg_iov = &mut iov;
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        let mut sent = 0u64;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let rc = unsafe { libc::sendmmsg(self.fd, msgs.as_mut_ptr(), batch as u32, 0) };
            if rc > 0 {
                sent += rc as u64;
            }
        }
        sent
    }
}

impl Drop for RawSock {
    fn drop(&mut self) {
        unsafe { libc::close(self.fd) };
    }
}
