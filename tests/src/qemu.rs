//! Real guests: QEMU with a Debian cloud kernel and a busybox initramfs
//! (built by `cargo xtask setup`), laid out as KubeVirt's bridge binding.
//!
//! Each guest lives in a "virt-launcher pod" namespace holding the pod's NIC
//! `eth0` (its veth peer is the vmpath port on the node), a bridge
//! `k6t-eth0`, the tap `tap0` and QEMU. The pod has no IP at all: the guest
//! takes its address by DHCP from vmpath, or has it set statically.
//!
//! The test drives the guest over its second serial port: one command per
//! line, its output and exit status back between markers (see the init in
//! `xtask/src/guest/init`). [`QemuVm`] has the verbs of the namespace
//! [`Vm`], through [`Guest`], so a scenario can use either.

mod channel;
pub mod migration;
pub mod qmp;

use std::{
    cell::Cell,
    collections::BTreeMap,
    fs,
    panic::{AssertUnwindSafe, catch_unwind, resume_unwind},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use crate::{Netns, Node, Vm};
use channel::Channel;
use qmp::Qmp;

/// Where `cargo xtask setup` puts the guest artefacts.
pub const DEFAULT_GUEST_DIR: &str = "/var/cache/vmpath/guest";
/// Guest RAM: 96 MB is the least the kernel boots with.
pub const GUEST_MEMORY_MB: u32 = 128;
/// How long a TCG guest may take to boot on a loaded 2-core machine.
const BOOT_TIMEOUT: Duration = Duration::from_secs(90);
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// Boots of one guest before its test fails.
const BOOT_ATTEMPTS: u32 = 3;
/// Console lines that mean the guest's kernel died.
const CRASH_MARKERS: &[&str] = &["Kernel panic", "kernel BUG", "BUG: ", "Oops: "];
/// Runs of a scenario before its test fails, when what failed it was a
/// guest's own kernel crashing.
const SCENARIO_ATTEMPTS: u32 = 2;

thread_local! {
    /// Guests dropped on this thread whose kernel had crashed (the test's
    /// guests live and die on the test's thread).
    static GUEST_KERNEL_CRASHES: Cell<u32> = const { Cell::new(0) };
}

/// Runs `scenario` again, from scratch, when it failed and one of the
/// guests it made had its own kernel crash (Debian's 6.1 under TCG has hit
/// list corruption in virtio_net a few times in a hundred boots, also in a
/// target just after a migration). That crash is not what any test here
/// asks about; a failure without a guest crash fails at once, and the
/// rerun is said in the output.
pub fn again_if_a_guest_kernel_crashes<T>(scenario: impl Fn() -> T) -> T {
    let mut attempt = 1;
    loop {
        let before = GUEST_KERNEL_CRASHES.with(Cell::get);
        match catch_unwind(AssertUnwindSafe(&scenario)) {
            Ok(done) => return done,
            Err(failure) => {
                let crashed = GUEST_KERNEL_CRASHES.with(Cell::get) > before;
                if !crashed || attempt >= SCENARIO_ATTEMPTS {
                    resume_unwind(failure);
                }
                println!(
                    "a guest's kernel crashed during attempt {attempt} (its console is above); \
                     running the scenario again from scratch"
                );
                attempt += 1;
            }
        }
    }
}

/// The verbs a test uses on a VM, whether a namespace or a real guest.
pub trait Guest {
    /// Runs a shell command in the guest; panics unless it exits 0.
    fn run(&self, cmd: &str) -> String;
    /// Runs a shell command; returns its exit status and output.
    fn run_status(&self, cmd: &str) -> (i32, String);
    /// True when three pings to `dst` all get replies.
    fn ping(&self, dst: &str) -> bool {
        self.run_status(&format!("ping -c 3 -i 0.2 -W 2 {dst}")).0 == 0
    }
    /// The global addresses on `eth0`, with prefix length (`10.0.0.5/24`).
    fn addresses(&self) -> Vec<String> {
        let out = self.run("ip -o addr show dev eth0");
        out.lines()
            .filter(|l| !l.contains("scope link"))
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                w.find(|t| *t == "inet" || *t == "inet6")?;
                w.next().map(str::to_string)
            })
            .collect()
    }
    /// The MAC of the guest's neighbour entry for `ip`, if it has one.
    fn neighbour(&self, ip: &str) -> Option<String> {
        let out = self.run_status(&format!("ip neigh show {ip} dev eth0")).1;
        let mut w = out.split_whitespace();
        w.find(|t| *t == "lladdr")?;
        w.next().map(str::to_string)
    }
}

impl Guest for Vm {
    fn run(&self, cmd: &str) -> String {
        self.ns.run(&["sh", "-c", cmd])
    }

    fn run_status(&self, cmd: &str) -> (i32, String) {
        let out = self.ns.run_status(&["sh", "-c", cmd]);
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.status.code().unwrap_or(-1), text)
    }
}

/// The directory with QEMU, the kernel and the initramfs.
pub fn guest_dir() -> PathBuf {
    std::env::var_os("VMPATH_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_GUEST_DIR))
}

/// How QEMU runs the guests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

/// KVM when `/dev/kvm` is a hardware KVM, TCG otherwise or when
/// `VMPATH_QEMU_ACCEL=tcg`; printed once, so the test output says which.
pub fn accel() -> Accel {
    static ACCEL: OnceLock<Accel> = OnceLock::new();
    *ACCEL.get_or_init(|| {
        let (accel, why) = match std::env::var("VMPATH_QEMU_ACCEL").as_deref() {
            Ok("tcg") => (Accel::Tcg, "VMPATH_QEMU_ACCEL=tcg"),
            Ok("kvm") => (Accel::Kvm, "VMPATH_QEMU_ACCEL=kvm"),
            _ if !Path::new("/dev/kvm").exists() => (Accel::Tcg, "no /dev/kvm"),
            // Firecracker's PVM: KVM_CREATE_VM works but the guest kernel
            // does not boot on it.
            _ if Path::new("/sys/module/kvm_pvm").exists() => {
                (Accel::Tcg, "/dev/kvm is kvm_pvm, which boots no guest")
            }
            _ => (Accel::Kvm, "/dev/kvm present"),
        };
        println!("qemu guests: {accel:?} ({why})");
        accel
    })
}

/// How the guest configures `eth0` at boot.
#[derive(Clone, Debug)]
pub enum GuestNet {
    /// busybox udhcpc, which keeps renewing.
    Dhcp,
    /// A static address (`10.30.0.5/24`) and optionally a default gateway.
    Static {
        addr: String,
        gateway: Option<String>,
    },
}

/// A virt-launcher pod on a node: its NIC `eth0` (peer of the node's port
/// `port`), the bridge `k6t-eth0` and the tap `tap0` on it. No IP.
pub struct Pod {
    pub ns: Netns,
    pub port: String,
}

/// The node's port for the pod `name` (what an attachment names).
pub fn pod_port(node: &Node, name: &str) -> String {
    let port = format!("vp{}{name}", node.tag);
    assert!(port.len() <= 15, "port name {port} too long");
    port
}

impl Pod {
    pub fn new(node: &Node, name: &str) -> Pod {
        let ns = Netns::new(format!("vt{}-{name}", node.tag));
        let port = pod_port(node, name);
        // Nothing in the pod may speak for itself (link-local addresses,
        // router solicitations): only the guest sends on the port.
        for sysctl in [
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        ] {
            ns.run(&["sysctl", "-qw", sysctl]);
        }
        crate::veth(&node.ns, &port, &ns, "eth0");
        ns.run(&["ip", "link", "add", "k6t-eth0", "type", "bridge"]);
        ns.run(&["ip", "tuntap", "add", "tap0", "mode", "tap"]);
        for ifname in ["eth0", "tap0"] {
            ns.run(&["ip", "link", "set", ifname, "master", "k6t-eth0"]);
        }
        for ifname in ["k6t-eth0", "eth0", "tap0"] {
            ns.run(&["ip", "link", "set", ifname, "up"]);
        }
        node.ns.run(&["ip", "link", "set", &port, "up"]);
        Pod { ns, port }
    }

    /// KubeVirt's bridge binding in a pod whose interface `ifname` the CNI
    /// plugin made (its veth peer is the node's `port`, the VM's MAC on
    /// it): virt-launcher gives the VM that MAC and the interface another
    /// (two bridge ports with one MAC would keep the VM's frames on the
    /// bridge), then bridges it to the tap. The bridge and tap are kept
    /// quiet, as vmpath-cni keeps the interface, whatever the namespace's
    /// defaults.
    pub fn launcher(ns: Netns, ifname: &str, port: String) -> Pod {
        let bridge = format!("k6t-{}", &ifname[ifname.len().saturating_sub(11)..]);
        let own_mac = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ns.name.hash(&mut h);
            let b = h.finish().to_be_bytes();
            format!("0a:58:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3])
        };
        ns.run(&["ip", "link", "add", &bridge, "type", "bridge"]);
        ns.run(&["ip", "tuntap", "add", "tap0", "mode", "tap"]);
        for dev in [bridge.as_str(), "tap0"] {
            for (key, value) in [("addr_gen_mode", "1"), ("disable_ipv6", "1")] {
                ns.run(&[
                    "sysctl",
                    "-qw",
                    &format!("net.ipv6.conf.{dev}.{key}={value}"),
                ]);
            }
        }
        ns.run(&["ip", "link", "set", ifname, "down"]);
        ns.run(&["ip", "link", "set", ifname, "address", &own_mac]);
        for dev in [ifname, "tap0"] {
            ns.run(&["ip", "link", "set", dev, "master", &bridge]);
        }
        for dev in [bridge.as_str(), ifname, "tap0"] {
            ns.run(&["ip", "link", "set", dev, "up"]);
        }
        Pod { ns, port }
    }

    /// True when the pod holds no IPv4 or global IPv6 address.
    pub fn holds_no_ip(&self) -> bool {
        let out = self.ns.run(&["ip", "-o", "addr", "show"]);
        out.lines()
            .filter(|l| !l.contains(" lo "))
            .all(|l| !l.contains("inet"))
    }
}

/// A QEMU guest in its pod, killed on drop.
pub struct QemuVm {
    pub pod: Pod,
    pub mac: String,
    pub accel: Accel,
    /// When QEMU was started.
    pub started: Instant,
    /// None only between a kill and the next launch.
    qemu: Option<Child>,
    work: PathBuf,
    channel: Mutex<Channel>,
    append: String,
    /// Started with `-incoming` (a migration target).
    incoming: bool,
}

/// The guest's DHCP lease as its udhcpc hook recorded it.
pub type Lease = BTreeMap<String, String>;

impl QemuVm {
    /// Boots a guest in a new pod on `node`.
    pub fn boot(node: &Node, name: &str, mac: &str, net: GuestNet) -> QemuVm {
        Self::boot_in(Pod::new(node, name), mac, net)
    }

    /// Boots a guest in `pod`.
    pub fn boot_in(pod: Pod, mac: &str, net: GuestNet) -> QemuVm {
        let append = match &net {
            GuestNet::Dhcp => "vmpath.dhcp=1".to_string(),
            GuestNet::Static { addr, gateway } => match gateway {
                Some(gw) => format!("vmpath.ip={addr} vmpath.gw={gw}"),
                None => format!("vmpath.ip={addr}"),
            },
        };
        let mut vm = Self::spawn(pod, mac, append, false);
        for attempt in 1..=BOOT_ATTEMPTS {
            match vm.wait_booted() {
                Ok(()) => return vm,
                // The guest's own kernel crashing under TCG is not what any
                // test here asks about (it has hit Debian's virtio_net page
                // lists a few times in a hundred boots); boot it again in
                // the same pod, and say so.
                Err(crash) if attempt < BOOT_ATTEMPTS => {
                    println!(
                        "guest {}: its kernel crashed while booting (attempt {attempt}: {crash}); \
                         booting it again. console:\n{}",
                        vm.pod.ns.name,
                        vm.console()
                    );
                    vm.relaunch();
                }
                Err(crash) => panic!(
                    "guest {} did not boot in {BOOT_ATTEMPTS} attempts ({crash}); console:\n{}\nqemu:\n{}",
                    vm.pod.ns.name,
                    vm.console(),
                    vm.qemu_log()
                ),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Waits until the guest answers on its command channel; the error
    /// says why it never will (its kernel crashed, QEMU exited, time ran
    /// out).
    fn wait_booted(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        loop {
            let answer = self
                .channel
                .lock()
                .unwrap()
                .request("true", Duration::from_secs(1));
            if answer.is_ok() {
                return Ok(());
            }
            if let Some(line) = self.crash_line() {
                return Err(line);
            }
            if let Some(Ok(Some(status))) = self.qemu.as_mut().map(Child::try_wait) {
                return Err(format!("qemu exited ({status})"));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no answer on its command channel within {BOOT_TIMEOUT:?}"
                ));
            }
            // A closed channel answers at once: do not spin.
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The console line saying the guest's kernel died, if it did.
    fn crash_line(&self) -> Option<String> {
        self.console()
            .lines()
            .find(|l| CRASH_MARKERS.iter().any(|m| l.contains(m)))
            .map(|l| l.trim().to_string())
    }

    /// Kills QEMU and starts it again, fresh, in the same pod.
    fn relaunch(&mut self) {
        self.kill();
        for f in ["console.log", "qemu.log", "ctl.sock", "qmp.sock"] {
            let _ = fs::remove_file(self.work.join(f));
        }
        self.launch();
    }

    /// Starts the migration target of `source` in a new pod on `node`:
    /// the same machine, waiting for the source's state (`-incoming`).
    pub fn incoming(node: &Node, name: &str, source: &QemuVm) -> QemuVm {
        Self::incoming_in(Pod::new(node, name), source)
    }

    /// Starts the migration target of `source` in `pod`.
    pub fn incoming_in(pod: Pod, source: &QemuVm) -> QemuVm {
        let vm = Self::spawn(pod, &source.mac, source.append.clone(), true);
        vm.qmp().wait_status("inmigrate");
        vm
    }

    fn spawn(pod: Pod, mac: &str, append: String, incoming: bool) -> QemuVm {
        let work = std::env::temp_dir().join(format!("vmpath-qemu-{}", pod.ns.name));
        let _ = fs::remove_dir_all(&work);
        fs::create_dir_all(&work).unwrap();
        let mut vm = QemuVm {
            pod,
            mac: mac.to_string(),
            accel: accel(),
            started: Instant::now(),
            qemu: None,
            channel: Mutex::new(Channel::default()),
            append,
            incoming,
            work,
        };
        vm.launch();
        vm
    }

    /// Starts QEMU for this guest and connects its command channel.
    fn launch(&mut self) {
        let dir = guest_dir();
        let qemu_root = dir.join("qemu");
        let binary = qemu_root.join("usr/bin/qemu-system-x86_64");
        assert!(
            binary.exists() && dir.join("initramfs.cpio").exists(),
            "no guest artefacts in {}: run `cargo xtask setup` (as root)",
            dir.display()
        );
        let work = &self.work;
        let path = |f: &str| work.join(f).display().to_string();
        let (accel_arg, cpu) = match self.accel {
            Accel::Tcg => ("tcg,tb-size=32", "max"),
            Accel::Kvm => ("kvm", "host"),
        };
        let log = fs::File::create(work.join("qemu.log")).unwrap();
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.pod.ns.path()))
            .arg(&binary)
            .env(
                "LD_LIBRARY_PATH",
                qemu_root.join("usr/lib/x86_64-linux-gnu"),
            )
            .arg("-L")
            .arg(qemu_root.join("usr/share/qemu"))
            .arg("-L")
            .arg(qemu_root.join("usr/share/seabios"))
            .args(["-machine", "pc", "-accel", accel_arg, "-cpu", cpu])
            .args(["-m", &GUEST_MEMORY_MB.to_string(), "-smp", "1"])
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .arg("-kernel")
            .arg(dir.join("vmlinuz"))
            .arg("-initrd")
            .arg(dir.join("initramfs.cpio"))
            .args([
                "-append",
                // no_timer_check: a slow TCG guest on a loaded host
                // otherwise fails the IO-APIC timer check and panics.
                &format!(
                    "console=ttyS0 quiet panic=-1 no_timer_check {}",
                    self.append
                ),
                "-no-reboot",
            ])
            .args(["-serial", &format!("file:{}", path("console.log"))])
            .args([
                "-chardev",
                &format!("socket,id=ctl,path={},server=on,wait=off", path("ctl.sock")),
                "-serial",
                "chardev:ctl",
            ])
            .args([
                "-qmp",
                &format!("unix:{},server=on,wait=off", path("qmp.sock")),
            ])
            .args([
                "-netdev",
                "tap,id=net0,ifname=tap0,script=no,downscript=no",
                "-device",
                &format!("virtio-net-pci,netdev=net0,mac={},romfile=", self.mac),
            ]);
        if self.incoming {
            cmd.args(["-incoming", &format!("unix:{}", path("migrate.sock"))]);
        }
        self.started = Instant::now();
        self.qemu = Some(
            cmd.stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("starting qemu-system-x86_64"),
        );
        // Connect at once: the guest's first words are not kept for later.
        let sock = self.work.join("ctl.sock");
        let deadline = Instant::now() + Duration::from_secs(10);
        let channel = loop {
            if let Some(c) = Channel::connect(&sock) {
                break c;
            }
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "qemu made no control socket; log:\n{}",
                self.qemu_log()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        self.channel = Mutex::new(channel);
    }

    fn assert_running(&mut self) {
        if let Some(Ok(Some(status))) = self.qemu.as_mut().map(Child::try_wait) {
            panic!("qemu exited ({status}); log:\n{}", self.qemu_log());
        }
    }

    pub fn qemu_log(&self) -> String {
        fs::read_to_string(self.work.join("qemu.log")).unwrap_or_default()
    }

    /// The guest's serial console (kernel messages, init's complaints).
    pub fn console(&self) -> String {
        fs::read_to_string(self.work.join("console.log")).unwrap_or_default()
    }

    fn wait_ready(&self) {
        let ok = self.channel.lock().unwrap().wait_ready(BOOT_TIMEOUT);
        assert!(
            ok,
            "guest {} did not answer on its command channel within {BOOT_TIMEOUT:?}; console:\n{}\nqemu:\n{}",
            self.pod.ns.name,
            self.console(),
            self.qemu_log()
        );
    }

    /// After a migration: the guest answers on this QEMU's channel.
    pub fn wait_resumed(&self) {
        self.wait_ready();
    }

    /// A QMP session with this QEMU.
    pub fn qmp(&self) -> Qmp {
        Qmp::connect(&self.work.join("qmp.sock"))
    }

    /// The path the target of a migration listens on.
    pub fn migrate_uri(&self) -> String {
        format!("unix:{}", self.work.join("migrate.sock").display())
    }

    /// Waits for the lease the guest's udhcpc took, and returns it.
    pub fn wait_lease(&self) -> Lease {
        let (rc, out) = self.run_status(
            "i=0; while [ ! -f /run/lease ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; cat /run/lease",
        );
        assert_eq!(
            rc,
            0,
            "guest {} got no DHCP lease: {out}\nconsole:\n{}",
            self.pod.ns.name,
            self.console()
        );
        lease_fields(&out)
    }

    /// Starts ISC dhclient for DHCPv6 on eth0 (the image's `dhclient -6`
    /// with the hook `/etc/dhclient6.sh`, which writes `/run/lease6`), in
    /// the background: it keeps the lease and renews it. Its lease file
    /// and pid are in /run; a second call after [`QemuVm::stop_dhcp6`]
    /// starts from the lease it had (a CONFIRM, then the same address).
    pub fn start_dhcp6(&self) {
        // dhclient binds to the link-local address: past DAD first (what
        // ISC's own dhclient-script waits for at PREINIT6).
        let (rc, addrs) = self.run_status(
            "i=0; while { ! ip -6 addr show dev eth0 scope link | grep -q fe80 || \
             ip -6 addr show dev eth0 | grep -q tentative; } && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; \
             ip -6 addr show dev eth0; [ $i -lt 300 ]",
        );
        assert_eq!(
            rc, 0,
            "guest {}: no link-local address past DAD in 30 s: {addrs}",
            self.pod.ns.name
        );
        self.run(
            "dhclient -6 -d -v -cf /dev/null -sf /etc/dhclient6.sh -lf /run/dhclient6.leases \
             -pf /run/dhclient6.pid eth0 </dev/null >/dev/console 2>&1 &",
        );
    }

    /// Stops dhclient -6 without releasing its lease (the address stays).
    pub fn stop_dhcp6(&self) {
        self.run(
            "kill $(cat /run/dhclient6.pid); i=0; while kill -0 $(cat /run/dhclient6.pid) 2>/dev/null && \
             [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done; rm -f /run/lease6",
        );
    }

    /// Waits (45 s) for `/run/lease6`, the DHCPv6 lease the hook recorded.
    pub fn wait_lease6(&self) -> Lease {
        let (rc, out) = self.run_status(
            "i=0; while [ ! -f /run/lease6 ] && [ $i -lt 450 ]; do sleep 0.1; i=$((i+1)); done; cat /run/lease6",
        );
        assert_eq!(
            rc,
            0,
            "guest {} got no DHCPv6 lease: {out}\ndhclient's hook calls: {}\nconsole:\n{}",
            self.pod.ns.name,
            self.run_status("cat /run/dhclient6.log").1,
            self.console()
        );
        lease_fields(&out)
    }

    /// Makes busybox udhcpc renew its DHCPv4 lease now (SIGUSR1) and waits
    /// (45 s) for the hook's record of the renewed lease: a `/run/lease`
    /// newer than `after` (the `uptime` of the one before).
    pub fn renew_dhcp4(&self, after: &Lease) -> Lease {
        let before = after.get("uptime").cloned().unwrap_or_default();
        let (rc, out) = self.run_status(&format!(
            "kill -USR1 $(pidof udhcpc) || exit 1; i=0; \
             while grep -qx 'uptime={before}' /run/lease && [ $i -lt 450 ]; do sleep 0.1; i=$((i+1)); done; \
             grep -qx 'uptime={before}' /run/lease && exit 1; cat /run/lease"
        ));
        assert_eq!(
            rc,
            0,
            "guest {} did not renew its DHCP lease: {out}\nconsole:\n{}",
            self.pod.ns.name,
            self.console()
        );
        lease_fields(&out)
    }

    /// QEMU's resident memory, KiB.
    pub fn rss_kib(&self) -> u64 {
        let Some(qemu) = &self.qemu else { return 0 };
        let status = fs::read_to_string(format!("/proc/{}/status", qemu.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Runs `cmd` with its line sent in two writes `pause` apart (see
    /// [`Channel::request_paused`]): (exit status, output).
    pub fn run_paused(&self, cmd: &str, pause: Duration) -> (i32, String) {
        self.channel
            .lock()
            .unwrap()
            .request_paused(cmd, pause, COMMAND_TIMEOUT)
            .unwrap_or_else(|e| panic!("guest {}: `{cmd}`: {e}", self.pod.ns.name))
    }

    /// Kills QEMU now (the source after a migration).
    pub fn kill(&mut self) {
        if let Some(mut qemu) = self.qemu.take() {
            let _ = qemu.kill();
            let _ = qemu.wait();
        }
    }
}

impl Guest for QemuVm {
    fn run(&self, cmd: &str) -> String {
        let (rc, out) = self.run_status(cmd);
        assert_eq!(
            rc, 0,
            "in guest {}: `{cmd}` exited {rc}: {out}",
            self.pod.ns.name
        );
        out
    }

    fn run_status(&self, cmd: &str) -> (i32, String) {
        self.channel
            .lock()
            .unwrap()
            .request(cmd, COMMAND_TIMEOUT)
            .unwrap_or_else(|e| {
                panic!(
                    "guest {}: `{cmd}`: {e}; console:\n{}",
                    self.pod.ns.name,
                    self.console()
                )
            })
    }
}

impl Drop for QemuVm {
    fn drop(&mut self) {
        self.kill();
        if let Some(line) = self.crash_line() {
            GUEST_KERNEL_CRASHES.with(|n| n.set(n.get() + 1));
            eprintln!("guest {}: its kernel crashed: {line}", self.pod.ns.name);
        }
        if std::thread::panicking() {
            eprintln!(
                "--- console of guest {} ---\n{}\n--- qemu ---\n{}",
                self.pod.ns.name,
                self.console(),
                self.qemu_log()
            );
        }
        let _ = fs::remove_dir_all(&self.work);
    }
}

/// `key=value` lines (the DHCP hooks' records) as a map.
fn lease_fields(text: &str) -> Lease {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
