//! Flooding at cluster scale: one network's broadcast reaches 512 local
//! ports and 1,000 other nodes, each exactly once (issue #34: the flood
//! lists are walked with `bpf_loop`, no longer 64 wide).
//!
//! The receivers are real: veth ports whose far ends sit in one namespace
//! (one namespace per VM costs nothing more to the data path and minutes
//! to the test), and VTEP addresses on an underlay namespace. Each counts
//! what reaches it with an AF_PACKET socket: the frames the data path
//! delivers with `bpf_redirect_peer` bypass the veth's own counters.

use std::{
    fs,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use vmpath_tests::{Netns, Node, UnderlayFamily, veth, vmpath_bin, yaml, yaml_overlay};

/// A broadcast ping's frames from the sender: what every member must get.
const PINGS: u64 = 3;
const SENDER_IP: &str = "10.20.0.2";
const SENDER_MAC: &str = "52:54:00:10:00:01";

/// An AF_PACKET socket on `ifname` of `ns`, every protocol, with a
/// receive buffer for `bytes` (frames are read after the traffic).
fn packet_socket(ns: &Netns, ifname: &str, bytes: i32) -> OwnedFd {
    let (path, ifname) = (ns.path(), ifname.to_string());
    std::thread::spawn(move || {
        let nsf = fs::File::open(&path).unwrap();
        // SAFETY: setns on an fd we own; it moves only this thread.
        assert_eq!(
            unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) },
            0
        );
        let name = std::ffi::CString::new(ifname.clone()).unwrap();
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert_ne!(ifindex, 0, "no {ifname} in {path}");
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK,
                i32::from(proto),
            )
        };
        assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
        // SAFETY: ours from here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an int option of the right size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&bytes as *const i32).cast(),
                4,
            )
        };
        // SAFETY: sockaddr_ll is plain data; all-zero is valid.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: a valid address of its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        fd
    })
    .join()
    .unwrap()
}

/// Every frame waiting on `fd` that came in (not ones the namespace sent).
fn drain(fd: &OwnedFd) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        // SAFETY: sockaddr_ll is plain data; all-zero is valid.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: the buffer and address outlive the call.
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                (&mut from as *mut libc::sockaddr_ll).cast(),
                &mut len,
            )
        };
        if n < 0 {
            return frames;
        }
        if from.sll_pkttype != libc::PACKET_OUTGOING {
            frames.push(buf[..n as usize].to_vec());
        }
    }
}

/// Is `f` (an Ethernet frame) one of the sender's broadcast pings?
fn is_sender_broadcast_ping(f: &[u8]) -> bool {
    let sender: std::net::Ipv4Addr = SENDER_IP.parse().unwrap();
    f.len() >= 34
        && f[0..6] == [0xff; 6]
        && f[12..14] == [0x08, 0x00]
        && f[23] == 1
        && f[26..30] == sender.octets()
}

/// The sender VM on `node`: its own namespace, IPv6 off (no ND or MLD
/// beside the pings), and its attachment.
fn sender(node: &Node) -> (vmpath_tests::Vm, String) {
    let vm = node.add_vm("snd", SENDER_MAC, &[], None);
    // `brd +`: 10.20.255.255 is the subnet's broadcast, sent to ff:ff:...
    let addr = format!("{SENDER_IP}/16");
    vm.ns
        .run(&["ip", "addr", "add", &addr, "brd", "+", "dev", "eth0"]);
    let doc = yaml::attachment(
        "snd",
        "blue",
        &node.name,
        &vm.port,
        SENDER_MAC,
        &[&format!("{SENDER_IP}/16")],
    );
    (vm, doc)
}

/// Raises `net.core.netdev_max_backlog` (a host-wide setting) to at
/// least `frames`: every copy of one flood is queued on the sending CPU's
/// backlog before any is processed, and past it the kernel drops them (the
/// default, 1000, is below a 1,000-node flood). docs/operations.md says
/// the same to operators; only ever raised here, never lowered.
pub fn ensure_backlog(frames: u32) {
    let path = "/proc/sys/net/core/netdev_max_backlog";
    let now: u32 = fs::read_to_string(path).unwrap().trim().parse().unwrap();
    if now < frames {
        fs::write(path, frames.to_string()).unwrap();
    }
}

/// Starts the agent and waits for `ports` programmed (bounded: a start
/// takes 10-60 s under load, and hundreds of ports more).
fn start_and_wait(node: &mut Node, ports: usize) {
    node.start_agent();
    let start = Instant::now();
    loop {
        let have = node.programmed_ports().map_or(0, |p| p.len());
        if have == ports {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(480),
            "{have} of {ports} ports programmed after 480 s; log:\n{}",
            node.agent_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `vmpath status -o json` against the node's agent: the API's answer, or
/// why there was none.
fn vmpath_status(node: &Node) -> Result<serde_json::Value, String> {
    let out = std::process::Command::new(vmpath_bin())
        .args(["status", "-o", "json", "--api-socket"])
        .arg(node.api_socket())
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

/// `vmpath status` run again and again from a thread, as `watch` would.
struct StatusWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<usize>,
}

impl StatusWatch {
    fn start(node: &Node) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let socket = node.api_socket();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut answers = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let ok = std::process::Command::new(vmpath_bin())
                    .args(["status", "-o", "json", "--api-socket"])
                    .arg(&socket)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                answers += usize::from(ok);
                std::thread::sleep(Duration::from_millis(100));
            }
            answers
        });
        StatusWatch { stop, thread }
    }

    /// Stops the watch; how many times `vmpath status` answered.
    fn stop(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn broadcast_pings(vm: &vmpath_tests::Vm) {
    // No answer comes (nobody has an address there): the exit status says
    // nothing; what arrived is counted by the receivers.
    let _ = vm.ns.run_status(&[
        "ping",
        "-b",
        "-c",
        &PINGS.to_string(),
        "-i",
        "0.2",
        "-W",
        "1",
        "10.20.255.255",
    ]);
}

/// 512 local ports of one network, besides the sender, each get every
/// broadcast frame exactly once.
#[test]
fn a_broadcast_reaches_512_local_ports_once_each() {
    const RECEIVERS: usize = 512;
    ensure_backlog(4096);
    let mut node = Node::new("a");
    let (vm, sender_doc) = sender(&node);
    vm.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]);
    // The receivers' far ends, in one namespace, IPv6 off before they
    // exist: they send nothing of their own.
    let far = Netns::new(format!("vt{}-far", node.tag));
    far.run(&["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]);
    far.run(&["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"]);
    let mut near_batch = String::new();
    let mut far_batch = String::new();
    let mut docs = vec![
        yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], false),
        sender_doc,
    ];
    for i in 0..RECEIVERS {
        let (port, mac) = (
            format!("vp{i}"),
            format!("52:54:00:20:{:02x}:{:02x}", i / 256, i % 256),
        );
        near_batch.push_str(&format!(
            "link add {port} type veth peer name f{i} address {mac} netns {}\nlink set {port} up\n",
            far.name
        ));
        far_batch.push_str(&format!("link set f{i} up\n"));
        let ip = format!("10.20.{}.{}/16", 1 + i / 250, 1 + i % 250);
        docs.push(yaml::attachment(
            &format!("r{i}"),
            "blue",
            "a",
            &port,
            &mac,
            &[&ip],
        ));
    }
    let batch = |ns: &Netns, text: &str, name: &str| {
        let file = node.config_dir.with_file_name(name);
        fs::write(&file, text).unwrap();
        ns.run(&["ip", "-batch", file.to_str().unwrap()]);
    };
    batch(&node.ns, &near_batch, "near.batch");
    batch(&far, &far_batch, "far.batch");
    node.write_config("c.yaml", &yaml::docs(&docs));
    // An operator watches `vmpath status` while the node comes up: its
    // listing of every port's programs must not stall the programming
    // (the two once shared one netlink socket, and the kernel answers a
    // second dump on a socket with EBUSY: no port was ever programmed).
    let watch = StatusWatch::start(&node);
    start_and_wait(&mut node, RECEIVERS + 1);
    let answers = watch.stop();
    assert!(
        answers > 0,
        "`vmpath status` never answered while ports were programmed"
    );
    let status = vmpath_status(&node).expect("`vmpath status -o json` after the ports");
    let ports = status["programs"]["ports"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        ports.iter().filter(|p| p["current"] == true).count(),
        2 * (RECEIVERS + 1),
        "`vmpath status` lists this agent's programs at both hooks of every port: {:?}",
        &ports[..ports.len().min(4)]
    );

    let sockets: Vec<OwnedFd> = (0..RECEIVERS)
        .map(|i| packet_socket(&far, &format!("f{i}"), 1 << 20))
        .collect();
    broadcast_pings(&vm);
    std::thread::sleep(Duration::from_secs(1));
    let counts: Vec<u64> = sockets
        .iter()
        .map(|s| {
            drain(s)
                .iter()
                .filter(|f| is_sender_broadcast_ping(f))
                .count() as u64
        })
        .collect();
    let wrong: Vec<(usize, u64)> = counts
        .iter()
        .enumerate()
        .filter(|(_, c)| **c != PINGS)
        .map(|(i, c)| (i, *c))
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {RECEIVERS} ports did not get each of {PINGS} broadcast pings once (port, frames): {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(20)]
    );
}

/// 1,000 other nodes host the network: a broadcast goes to each VTEP
/// exactly once per frame, VNI = the network id.
#[test]
fn a_broadcast_reaches_1000_remote_vteps_once_each() {
    broadcast_reaches_remote_vteps_over(UnderlayFamily::V4);
}

/// The same over an IPv6 underlay: 1,000 IPv6 VTEPs, each known to the
/// data path by its handle, each gets every copy once.
#[test]
fn a_broadcast_reaches_1000_remote_ipv6_vteps_once_each() {
    broadcast_reaches_remote_vteps_over(UnderlayFamily::V6);
}

fn broadcast_reaches_remote_vteps_over(family: UnderlayFamily) {
    const NODES: usize = 1000;
    let v6 = family == UnderlayFamily::V6;
    ensure_backlog(4096);
    let mut node = Node::new("a");
    let (vm, sender_doc) = sender(&node);
    vm.ns
        .run(&["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]);
    // The underlay: node a at 10.99.0.1 (fd99::1) routes the VTEP range
    // to the underlay namespace, which holds the 1,000 VTEP addresses.
    let (a_ip, ul_ip, plen, range) = if v6 {
        ("fd99::1", "fd99::2", 126, "fd68::/16")
    } else {
        ("10.99.0.1", "10.99.0.2", 30, "192.168.0.0/16")
    };
    let underlay = Netns::new(format!("vt{}-ul", node.tag));
    veth(&node.ns, "ul0", &underlay, "ul");
    let (a_cidr, ul_cidr) = (format!("{a_ip}/{plen}"), format!("{ul_ip}/{plen}"));
    node.ns
        .run(&["ip", "addr", "add", &a_cidr, "dev", "ul0", "nodad"]);
    node.ns.run(&["ip", "link", "set", "ul0", "up"]);
    underlay.run(&["ip", "addr", "add", &ul_cidr, "dev", "ul", "nodad"]);
    underlay.run(&["ip", "link", "set", "ul", "up"]);
    node.ns.run(&["ip", "route", "add", range, "via", ul_ip]);
    let vtep = |i: usize| -> std::net::IpAddr {
        if v6 {
            format!("fd68::{:x}:{:x}", 1 + i / 250, 1 + i % 250)
        } else {
            format!("192.168.{}.{}", 1 + i / 250, 1 + i % 250)
        }
        .parse()
        .unwrap()
    };
    let host_len = if v6 { 128 } else { 32 };
    let mut batch = String::new();
    let mut docs = vec![
        yaml_overlay::node("a", a_ip),
        yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], false),
        sender_doc,
    ];
    for i in 0..NODES {
        batch.push_str(&format!("addr add {}/{host_len} dev lo nodad\n", vtep(i)));
        let name = format!("n{i}");
        docs.push(yaml_overlay::node(&name, &vtep(i).to_string()));
        docs.push(yaml::attachment(
            &format!("v{i}"),
            "blue",
            &name,
            "eth0",
            &format!("52:54:00:30:{:02x}:{:02x}", i / 256, i % 256),
            &[&format!("10.20.{}.{}/16", 100 + i / 250, 1 + i % 250)],
        ));
    }
    let file = node.config_dir.with_file_name("vteps.batch");
    fs::write(&file, batch).unwrap();
    underlay.run(&["ip", "-batch", file.to_str().unwrap()]);
    node.write_config("c.yaml", &yaml::docs(&docs));
    start_and_wait(&mut node, 1);
    node.wait_log("overlay ready", Duration::from_secs(120));

    // The next hop resolved first: the kernel holds only about 100 frames
    // for a neighbour it is still resolving, and a flood is 1,000 at once.
    node.ns.run(&["ping", "-c", "1", "-W", "5", ul_ip]);
    // Every copy, read after the pings: 3,000 frames of about 150 bytes.
    let socket = packet_socket(&underlay, "ul", 64 << 20);
    broadcast_pings(&vm);
    std::thread::sleep(Duration::from_secs(2));
    let mut per_vtep: std::collections::BTreeMap<std::net::IpAddr, u64> = Default::default();
    for f in drain(&socket) {
        // Outer Ethernet, IPv4 (20 bytes) or IPv6 (40), UDP to 4789, VXLAN
        // with VNI 100, then the inner frame.
        let (udp, dst): (usize, std::net::IpAddr) = match f.get(12..14) {
            Some([0x08, 0x00]) if f.len() >= 14 + 20 && f[23] == 17 => {
                let dst: [u8; 4] = f[30..34].try_into().unwrap();
                (14 + usize::from(f[14] & 0x0f) * 4, dst.into())
            }
            Some([0x86, 0xdd]) if f.len() >= 14 + 40 && f[20] == 17 => {
                let dst: [u8; 16] = f[38..54].try_into().unwrap();
                (14 + 40, dst.into())
            }
            _ => continue,
        };
        if f.len() < udp + 16 + 14 || f[udp + 2..udp + 4] != 4789u16.to_be_bytes() {
            continue;
        }
        let vxlan = udp + 8;
        assert_eq!(f[vxlan + 4..vxlan + 7], [0, 0, 100], "VNI of a copy");
        if is_sender_broadcast_ping(&f[vxlan + 8..]) {
            *per_vtep.entry(dst).or_default() += 1;
        }
    }
    let wrong: Vec<String> = (0..NODES)
        .filter_map(|i| {
            let ip = vtep(i);
            let got = per_vtep.get(&ip).copied().unwrap_or(0);
            (got != PINGS).then(|| format!("{ip}: {got}"))
        })
        .collect();
    assert!(
        wrong.is_empty() && per_vtep.len() == NODES,
        "{} of {NODES} VTEPs did not get each of {PINGS} broadcast pings once ({} VTEPs got copies): {:?}",
        wrong.len(),
        per_vtep.len(),
        &wrong[..wrong.len().min(20)]
    );
}
