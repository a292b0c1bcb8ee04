//! The test bed: network namespaces for nodes and VMs joined by veth pairs,
//! the real `vmpath` agent running in a node namespace with its own bpffs
//! root, and real tools (ping, iperf3, scapy, tcpdump) driving traffic.
//!
//! Every name is unique per test so tests run in parallel, and every
//! resource is released by a guard's `Drop`, also when a test fails.
//! Traffic only ever goes to addresses inside namespaces made here.

use std::{
    collections::BTreeMap,
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        OnceLock,
        atomic::{AtomicU32, Ordering},
    },
    thread::sleep,
    time::{Duration, Instant},
};

pub use vmpath;
use vmpath::apply::dataplane::Maps;

pub mod cluster_net;
pub mod flood;
pub mod kube_api;
pub mod kubevirt;
pub mod migration;
pub mod north_south;
pub mod prog_fixture;
pub mod qemu;

/// Debian's python3, which has scapy (the pyenv one on PATH does not).
pub const SCAPY_PYTHON: &str = "/usr/bin/python3";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Where the tags in use are held: one file per tag, locked by the test
/// process using it (`/run` is a tmpfs, gone at boot).
const TAG_DIR: &str = "/run/vmpath-test-tags";
/// Tags are this many base-36 characters (1.7 million of them): short,
/// as interface names are limited to 15 characters, and all of one
/// length, so no two (process, counter) pairs can spell the same one.
const TAG_LEN: u32 = 4;

/// A short tag no other live test process holds: the names of a bed's
/// namespaces, interfaces, bpffs and work directories are made from it.
/// It was `pid % 0xfff` and a counter, in hex, run together: two tests at
/// once now and then got the same tag (pids 4095 apart, or `1`+`23` and
/// `12`+`3`) and shared a bpffs root ("another vmpath agent owns this
/// node"). A tag is now held by an exclusive lock on its file for the
/// process's lifetime; the kernel drops the lock when the process ends.
pub fn unique_tag() -> String {
    static HELD: std::sync::Mutex<Vec<fs::File>> = std::sync::Mutex::new(Vec::new());
    fs::create_dir_all(TAG_DIR).unwrap_or_else(|e| panic!("creating {TAG_DIR}: {e}"));
    let space = 36u64.pow(TAG_LEN);
    loop {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        // Spread (pid, n) over the space (splitmix64's finaliser), so that
        // processes started one after another do not walk the same tags.
        let mut x = (u64::from(std::process::id()) << 32 | u64::from(n))
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        let mut v = x % space;
        let mut tag = String::new();
        for _ in 0..TAG_LEN {
            tag.insert(0, char::from_digit((v % 36) as u32, 36).unwrap());
            v /= 36;
        }
        let path = Path::new(TAG_DIR).join(&tag);
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        match file.try_lock() {
            Ok(()) => {
                HELD.lock().unwrap().push(file);
                return tag;
            }
            Err(fs::TryLockError::WouldBlock) => continue,
            Err(fs::TryLockError::Error(e)) => panic!("locking {}: {e}", path.display()),
        }
    }
}

/// One udhcpc run in `ns` on `ifname`: up to `tries` DISCOVERs a second
/// apart, then quit with a lease or without; `hook` is its script (never
/// the host's default, which would rewrite resolv.conf).
pub fn udhcpc(ns: &Netns, ifname: &str, hook: &str, tries: u32) -> Output {
    let tries = tries.to_string();
    ns.run_status(&[
        "udhcpc", "-i", ifname, "-n", "-q", "-f", "-t", &tries, "-T", "1", "-s", hook,
    ])
}

/// The agent binary: `VMPATH_BIN` (set by `cargo xtask test`), else built once.
pub fn vmpath_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    workspace_bin(&BIN, "VMPATH_BIN", "vmpath")
}

/// A binary of the workspace: the path in `env_var` when set, else built
/// by cargo (package and binary named `package`) once per test process.
/// `program` as an absolute path, found on `PATH` (itself when no file of
/// that name is there). A command run with an environment of its own that
/// sets `PATH` and names its program bare is forked, not spawned: the
/// standard library cannot look the program up in the child's `PATH`
/// with `posix_spawn`. Forking a process that holds a whole cluster's
/// objects (the bench's API server at 10,000 VMs) took about 90 ms of
/// page-table copying and teardown, and the bench counted it in the CNI
/// ADD.
pub fn on_path(program: &str) -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| PathBuf::from(program))
}

pub fn workspace_bin(cell: &'static OnceLock<PathBuf>, env_var: &str, package: &str) -> PathBuf {
    cell.get_or_init(|| {
        if let Some(p) = std::env::var_os(env_var) {
            return PathBuf::from(p);
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .to_path_buf();
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", package])
            .current_dir(&root)
            .status()
            .unwrap_or_else(|e| panic!("running cargo build -p {package}: {e}"));
        assert!(status.success(), "cargo build -p {package} failed");
        // Where that build put it: CARGO_TARGET_DIR when set, as cargo does.
        std::env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| root.join("target"), PathBuf::from)
            .join("debug")
            .join(package)
    })
    .clone()
}

/// Runs a command, panicking with its output if it fails.
pub fn run(args: &[&str]) -> String {
    let out = run_status(args);
    assert!(
        out.status.success(),
        "command failed: {}\nstdout: {}\nstderr: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn run_status(args: &[&str]) -> Output {
    Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", args[0]))
}

/// The last `n` lines of `text` (an agent's log, for a failure's
/// message), joined by `sep`.
pub fn last_lines(text: &str, n: usize, sep: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(sep)
}

/// How long a test waits for a starting agent to program its first ports.
/// A liveness bound, not a speed check: the kernel's verifier takes about
/// 3 s of CPU per agent (vm_egress, vm_port and uplink most of it), so
/// eight agents loading at once on two cores take 14 s each, and in CI,
/// beside the image tests' podman and the lints' build, one took 30 s
/// before it programmed anything (stop 52's CI: the image tests waited
/// 30 s). Every wait that includes an agent's program load uses this.
pub const AGENT_START_BOUND: Duration = Duration::from_secs(120);

/// Polls `cond` until it holds or `timeout` passes.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        sleep(Duration::from_millis(50));
    }
}

/// A network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// `UdpRcvbufErrors` of this namespace's stack: datagrams the kernel
    /// delivered to a socket whose buffer was full (a receiver starved of
    /// CPU, not a loss on the path).
    pub fn udp_rcvbuf_errors(&self) -> u64 {
        let out = self.run(&["nstat", "-az", "UdpRcvbufErrors"]);
        out.lines()
            .find_map(|l| l.strip_prefix("UdpRcvbufErrors"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    pub fn new(name: String) -> Self {
        let _ = run_status(&["ip", "netns", "del", &name]);
        run(&["ip", "netns", "add", &name]);
        let ns = Netns { name };
        ns.run(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }

    fn command(&self, args: &[&str]) -> Command {
        // nsenter, not `ip netns exec`: the latter remounts /sys and would
        // hide the shared bpffs.
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path()))
            .args(args)
            .stdin(Stdio::null());
        c
    }

    pub fn run(&self, args: &[&str]) -> String {
        let out = self.run_status(args);
        assert!(
            out.status.success(),
            "in {}: {} failed\nstdout: {}\nstderr: {}",
            self.name,
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn run_status(&self, args: &[&str]) -> Output {
        self.command(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", args[0]))
    }

    pub fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot spawn {}: {e}", args[0]))
    }

    /// The ifindex of an interface in this namespace.
    pub fn ifindex(&self, ifname: &str) -> u32 {
        let out = self.run(&["ip", "-j", "link", "show", "dev", ifname]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j output");
        v[0]["ifindex"].as_u64().expect("ifindex") as u32
    }

    /// True when `ping` gets every reply.
    pub fn ping(&self, dst: &str, count: u32) -> bool {
        let c = count.to_string();
        self.run_status(&["ping", "-c", &c, "-i", "0.2", "-W", "1", dst])
            .status
            .success()
    }

    /// `ping` from the source address `src` (e.g. one the VM does not
    /// own); true when ping succeeds (a reply came back).
    pub fn ping_from(&self, src: &str, dst: &str, count: u32) -> bool {
        let c = count.to_string();
        self.run_status(&["ping", "-c", &c, "-i", "0.2", "-W", "1", "-I", src, dst])
            .status
            .success()
    }

    /// Runs a scapy script (Debian's python3) in this namespace.
    pub fn scapy(&self, script: &str) -> String {
        self.run(&[
            SCAPY_PYTHON,
            "-c",
            &format!("from scapy.all import *\nconf.verb = 0\n{script}"),
        ])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run_status(&["ip", "netns", "del", &self.name]);
    }
}

/// A VM: its own namespace with `eth0`, whose veth peer (the port) lives in
/// the node namespace.
pub struct Vm {
    pub ns: Netns,
    pub port: String,
    pub mac: String,
}

impl Vm {
    pub fn ping(&self, dst: &str) -> bool {
        self.ns.ping(dst, 3)
    }
}

/// A node: a namespace, a config dir and the agent running in it.
pub struct Node {
    pub name: String,
    pub ns: Netns,
    pub tag: String,
    pub bpffs: PathBuf,
    pub config_dir: PathBuf,
    pub state_dir: PathBuf,
    pub log_path: PathBuf,
    agent: Option<Child>,
    /// Extra `vmpath agent` arguments (see [`Node::set_agent_args`]).
    agent_args: Vec<String>,
    /// Another agent binary than [`vmpath_bin`] (see [`Node::set_agent_bin`]).
    agent_bin: Option<PathBuf>,
}

impl Node {
    pub fn new(name: &str) -> Self {
        let tag = unique_tag();
        let ns = Netns::new(format!("vt{tag}-{name}"));
        let work = std::env::temp_dir().join(format!("vmpath-test-{tag}-{name}"));
        let _ = fs::remove_dir_all(&work);
        let config_dir = work.join("config");
        let state_dir = work.join("state");
        fs::create_dir_all(&config_dir).unwrap();
        fs::create_dir_all(&state_dir).unwrap();
        Node {
            name: name.to_string(),
            ns,
            bpffs: PathBuf::from(format!("/sys/fs/bpf/vmpath-test-{tag}-{name}")),
            log_path: work.join("agent.log"),
            config_dir,
            state_dir,
            tag,
            agent: None,
            agent_args: Vec::new(),
            agent_bin: None,
        }
    }

    /// A node with VMs vm1 (10.20.0.11) and vm2 (10.20.0.12) on network
    /// blue (10.20.0.0/16), their MACs `<mac_prefix>:01` and `:02`, and
    /// the config written; no agent yet.
    pub fn with_two_vms(name: &str, mac_prefix: &str) -> (Node, Vm, Vm) {
        let node = Node::new(name);
        let vm1 = node.add_vm("vm1", &format!("{mac_prefix}:01"), &["10.20.0.11/16"], None);
        let vm2 = node.add_vm("vm2", &format!("{mac_prefix}:02"), &["10.20.0.12/16"], None);
        let attach = |name: &str, vm: &Vm, ip: &str| {
            yaml::attachment(name, "blue", &node.name, &vm.port, &vm.mac, &[ip])
        };
        node.write_config(
            "c.yaml",
            &yaml::docs(&[
                yaml::network("blue", 100, &["10.20.0.0/16"], &["10.20.0.1"], true),
                attach("vm1", &vm1, "10.20.0.11/16"),
                attach("vm2", &vm2, "10.20.0.12/16"),
            ]),
        );
        (node, vm1, vm2)
    }

    /// The VM-port programs (tc filters on the node's interfaces), as
    /// `bpftool net show` lists them: (`PROGRAM-IFINDEX`, e.g.
    /// `vm_port-7`, program id), sorted.
    pub fn port_programs(&self) -> Vec<(String, u64)> {
        let v: serde_json::Value =
            serde_json::from_str(&self.ns.run(&["bpftool", "-j", "net", "show"])).unwrap();
        let mut out = Vec::new();
        for section in v.as_array().into_iter().flatten() {
            for f in section["tc"].as_array().into_iter().flatten() {
                let name = f["name"].as_str().unwrap_or_default();
                if ["vm_port", "vm_from_stack"].contains(&name) {
                    out.push((
                        format!("{name}-{}", f["ifindex"]),
                        f["id"].as_u64().unwrap_or_default(),
                    ));
                }
            }
        }
        out.sort();
        out
    }

    /// Asserts the ports still carry the filters of `old` (from
    /// [`port_programs`](Self::port_programs)), each `vm_port` one now
    /// running program `vm_port`: an agent that took over swapped its
    /// program in rather than attaching anew.
    pub fn assert_ports_kept_running(&self, old: &[(String, u64)], vm_port: u64) {
        let ports = self.port_programs();
        assert_eq!(ports.len(), old.len(), "{ports:?} vs {old:?}");
        for ((port, prog), (old_port, _)) in ports.iter().zip(old) {
            assert_eq!(port, old_port);
            if port.starts_with("vm_port-") {
                assert_eq!(*prog, vm_port, "{port} runs another program");
            }
        }
    }

    /// Every pinned link: (pin name, link id, program id), as bpftool sees
    /// them, sorted.
    pub fn pinned_links(&self) -> Vec<(String, u64, u64)> {
        let mut out: Vec<_> = fs::read_dir(self.bpffs.join("links"))
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let v = bpftool_json(&["link", "show", "pinned", path.to_str().unwrap()]);
                (
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    v["id"].as_u64().unwrap(),
                    v["prog_id"].as_u64().unwrap(),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Every pinned map of this build's layout: name -> map id.
    pub fn pinned_maps(&self) -> BTreeMap<String, u64> {
        fs::read_dir(self.maps_dir())
            .unwrap()
            .map(|e| {
                let path = e.unwrap().path();
                let v = bpftool_json(&["map", "show", "pinned", path.to_str().unwrap()]);
                (
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    v["id"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// The directory of this build's pinned maps.
    pub fn maps_dir(&self) -> PathBuf {
        self.bpffs
            .join(format!("maps/v{}", vmpath::common::MAP_LAYOUT_VERSION))
    }

    /// `bpftool map dump` of pinned map `name` (this build's layout).
    pub fn dump_map(&self, name: &str) -> String {
        run(&[
            "bpftool",
            "map",
            "dump",
            "pinned",
            self.maps_dir().join(name).to_str().unwrap(),
        ])
    }

    /// Makes a VM namespace with `eth0` (MAC `mac`, `addrs` configured, the
    /// default route via `gateway` when given) and its port `vp<tag><name>`
    /// in this node.
    pub fn add_vm(&self, name: &str, mac: &str, addrs: &[&str], gateway: Option<&str>) -> Vm {
        let ns = Netns::new(format!("vt{}-{name}", self.tag));
        let port = format!("vp{}{name}", self.tag);
        assert!(port.len() <= 15, "port name {port} too long");
        veth(&self.ns, &port, &ns, "eth0");
        ns.run(&["ip", "link", "set", "eth0", "address", mac]);
        for a in addrs {
            if a.contains(':') {
                ns.run(&["ip", "addr", "add", a, "dev", "eth0", "nodad"]);
            } else {
                ns.run(&["ip", "addr", "add", a, "dev", "eth0"]);
            }
        }
        ns.run(&["ip", "link", "set", "eth0", "up"]);
        self.ns.run(&["ip", "link", "set", &port, "up"]);
        if let Some(gw) = gateway {
            ns.run(&["ip", "route", "add", "default", "via", gw]);
        }
        Vm {
            ns,
            port,
            mac: mac.to_string(),
        }
    }

    /// Writes (or replaces) one config file.
    pub fn write_config(&self, file: &str, yaml: &str) {
        // Write then rename, as a ConfigMap update would: never half a file.
        let tmp = self.config_dir.join(format!(".{file}.tmp"));
        fs::File::create(&tmp)
            .unwrap()
            .write_all(yaml.as_bytes())
            .unwrap();
        fs::rename(&tmp, self.config_dir.join(file)).unwrap();
    }

    pub fn remove_config(&self, file: &str) {
        let _ = fs::remove_file(self.config_dir.join(file));
    }

    pub fn start_agent(&mut self) {
        assert!(self.agent.is_none(), "agent already running");
        // `wait_ports` must see this agent's status, not a previous one's.
        let _ = fs::remove_file(self.state_dir.join("status.json"));
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap();
        let child = self
            .agent_command(&[])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting the agent");
        self.agent = Some(child);
    }

    /// The `vmpath agent` command `start_agent` runs, with `extra`
    /// arguments last (a later flag wins): for a second agent beside it.
    pub fn agent_command(&self, extra: &[&str]) -> Command {
        self.agent_command_at(&self.state_dir, &self.api_socket(), extra)
    }

    /// [`Node::agent_command`] with another state dir and API socket.
    pub fn agent_command_at(&self, state_dir: &Path, api_socket: &Path, extra: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.ns.path()))
            .arg(self.agent_bin.clone().unwrap_or_else(vmpath_bin))
            .args(["agent", "--node", &self.name, "--interval-ms", "100"])
            .arg("--config-dir")
            .arg(&self.config_dir)
            .arg("--bpffs")
            .arg(&self.bpffs)
            .arg("--state-dir")
            .arg(state_dir)
            .arg("--api-socket")
            .arg(api_socket)
            .args(&self.agent_args)
            .args(extra)
            // VMPATH_AGENT_LOG raises the agents' log level when a run
            // needs their debug output (e.g. `vmpath=debug`).
            .env(
                "RUST_LOG",
                std::env::var("VMPATH_AGENT_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null());
        c
    }

    /// The running agent's pid (nsenter execs it: the child is the agent).
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent.as_ref().map(|c| c.id())
    }

    /// Hands the running agent over to the caller, so another can be
    /// started (an upgrade's handover); the caller stops and reaps it.
    pub fn take_agent(&mut self) -> Option<Child> {
        self.agent.take()
    }

    /// The agent binary every later `start_agent` runs (a bench's build to
    /// compare with), instead of [`vmpath_bin`].
    pub fn set_agent_bin(&mut self, bin: &Path) {
        self.agent_bin = Some(bin.to_path_buf());
    }

    /// Extra arguments for every later `start_agent` (e.g. `--metrics-addr`).
    pub fn set_agent_args(&mut self, args: &[&str]) {
        self.agent_args = args.iter().map(|s| s.to_string()).collect();
    }

    /// The agent's admin API socket.
    pub fn api_socket(&self) -> PathBuf {
        self.state_dir.join("api.sock")
    }

    /// SIGKILLs the agent (pins stay, as after a crash).
    pub fn kill_agent(&mut self) {
        if let Some(mut child) = self.agent.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn agent_running(&mut self) -> bool {
        match &mut self.agent {
            Some(c) => c.try_wait().map(|s| s.is_none()).unwrap_or(false),
            None => false,
        }
    }

    pub fn agent_log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits until the agent's log contains `text` (what it logs on its
    /// next pass, after the state a test saw already changed).
    pub fn wait_log(&self, text: &str, timeout: Duration) {
        wait_for(
            &format!("node {}'s agent to log {text:?}", self.name),
            timeout,
            || self.agent_log().contains(text),
        );
    }

    /// The agent's status (state dir `status.json`) as of the view it last
    /// published. The agent writes the file on a thread of its own after
    /// the round has answered (a CNI ADD returns, a port is programmed,
    /// before the file has it), so while the agent answers `/healthz`, the
    /// file is read until it has that view's generation (at most 5 s).
    pub fn status(&self) -> Option<serde_json::Value> {
        let read = || -> Option<serde_json::Value> {
            let text = fs::read_to_string(self.state_dir.join("status.json")).ok()?;
            serde_json::from_str(&text).ok()
        };
        let Some(published) = self.published_generation() else {
            return read();
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let status = read();
            let caught_up = status
                .as_ref()
                .and_then(|s| s["generation"].as_u64())
                .is_some_and(|g| g >= published);
            if caught_up || Instant::now() >= deadline {
                return status;
            }
            sleep(Duration::from_millis(5));
        }
    }

    /// The generation of the view the agent last published (`GET
    /// /healthz`: no netlink, no copy of the view), if it answers within a
    /// second.
    fn published_generation(&self) -> Option<u64> {
        use std::io::{Read as _, Write as _};
        let mut sock = std::os::unix::net::UnixStream::connect(self.api_socket()).ok()?;
        sock.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        sock.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
        // HTTP/1.0: the whole body, and the connection closed.
        sock.write_all(b"GET /healthz HTTP/1.0\r\nHost: agent\r\n\r\n")
            .ok()?;
        let mut reply = Vec::new();
        sock.read_to_end(&mut reply).ok()?;
        let at = reply.windows(4).position(|w| w == b"\r\n\r\n")?;
        let body: serde_json::Value = serde_json::from_slice(&reply[at + 4..]).ok()?;
        body["generation"].as_u64()
    }

    /// The agent's view of `vm`'s interface (what `vmpath vm show` shows),
    /// `None` while its status lists none.
    pub fn attachment_view(&self, vm: &str) -> Option<serde_json::Value> {
        self.status()?["attachments"]
            .as_array()?
            .iter()
            .find(|a| a["vm"] == vm)
            .cloned()
    }

    /// The addresses (with prefix) the agent's status gives `vm`, in its
    /// order; empty while it lists none.
    pub fn vm_addresses(&self, vm: &str) -> Vec<String> {
        self.attachment_view(vm)
            .and_then(|a| {
                a["ips"].as_array().map(|ips| {
                    ips.iter()
                        .filter_map(|ip| ip["address"].as_str().map(String::from))
                        .collect()
                })
            })
            .unwrap_or_default()
    }

    /// Waits until the agent has programmed exactly these ports.
    pub fn wait_ports(&mut self, ports: &[&str]) {
        let mut want: Vec<String> = ports.iter().map(|s| s.to_string()).collect();
        want.sort();
        let log = self.log_path.clone();
        let start = Instant::now();
        loop {
            assert!(
                self.agent_running(),
                "agent exited; log:\n{}",
                fs::read_to_string(&log).unwrap_or_default()
            );
            let have = self.programmed_ports();
            if have.as_ref() == Some(&want) {
                return;
            }
            assert!(
                start.elapsed() < AGENT_START_BOUND,
                "agent did not program ports {want:?} within {AGENT_START_BOUND:?} (status ports {have:?}); log:\n{}",
                self.agent_log()
            );
            sleep(Duration::from_millis(50));
        }
    }

    /// The ports the agent's last status lists as programmed, sorted
    /// (`None` before it wrote one): for whichever agent runs, a process
    /// of the test's or a container.
    pub fn programmed_ports(&self) -> Option<Vec<String>> {
        self.status().map(|s| {
            let mut v: Vec<String> = s["attachments"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter(|a| !a["ifindex"].is_null())
                        .filter_map(|a| a["port"].as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            v.sort();
            v
        })
    }

    pub fn maps(&self) -> Maps {
        Maps::open(&self.bpffs).expect("opening the node's pinned maps")
    }

    /// A drop counter, summed over CPUs.
    pub fn drops(&self, reason: u32) -> u64 {
        self.maps().drop_counts().unwrap()[reason as usize]
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill_agent();
        // In the node's own namespace: cleanup also deletes the slow path
        // veths, the vxlan device and the routes in table 100, which must
        // never be the host's.
        let _ = Command::new("nsenter")
            .arg(format!("--net={}", self.ns.path()))
            .arg(vmpath_bin())
            .args(["agent", "--cleanup", "--bpffs"])
            .arg(&self.bpffs)
            .stderr(Stdio::null())
            .stdout(Stdio::null())
            .status();
        let _ = fs::remove_dir(&self.bpffs);
        if std::thread::panicking() {
            eprintln!(
                "--- agent log of node {} ---\n{}",
                self.name,
                self.agent_log()
            );
        }
        if let Some(work) = self.config_dir.parent() {
            let _ = fs::remove_dir_all(work);
        }
    }
}

/// Runs iperf3 from `client` to `server_ip` served in `server`; returns the
/// client's JSON report. `udp` sends at 50 Mbit/s: at 200, beside three
/// other tests on two cores, iperf3's receiver lost 20-45% to its own full
/// socket buffer (a receiver falling behind, not the data path).
pub fn iperf3(
    server: &Netns,
    client: &Netns,
    server_ip: &str,
    udp: bool,
    seconds: u32,
) -> serde_json::Value {
    let port = 5201 + (COUNTER.fetch_add(1, Ordering::SeqCst) % 1000) as u16;
    iperf3_via(server, port, client, server_ip, port, udp, seconds)
}

/// [`iperf3`] with the server on `server_port` and the client connecting
/// to `dst:dst_port`: a Service's address and port that lead to it.
pub fn iperf3_via(
    server: &Netns,
    server_port: u16,
    client: &Netns,
    dst: &str,
    dst_port: u16,
    udp: bool,
    seconds: u32,
) -> serde_json::Value {
    let server_ip = dst;
    let port = server_port.to_string();
    let mut srv = server.spawn(&["iperf3", "-s", "-1", "-p", &port]);
    let secs = seconds.to_string();
    let dst_port = dst_port.to_string();
    let mut args = vec!["iperf3", "-c", dst, "-p", &dst_port, "-t", &secs, "-J"];
    if udp {
        args.extend(["-u", "-b", "50M"]);
    }
    // Connect only once the server listens (iperf3 -J reports a refused
    // connection in its JSON, not always in its exit code).
    wait_for("iperf3 server to listen", Duration::from_secs(10), || {
        let ss = server.run_status(&["ss", "-Hltn", &format!("sport = :{port}")]);
        !String::from_utf8_lossy(&ss.stdout).trim().is_empty()
    });
    let out = client.run_status(&args);
    let _ = srv.kill();
    let _ = srv.wait();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "iperf3 to {server_ip} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        report.get("error").is_none(),
        "iperf3 to {server_ip} failed: {}",
        report["error"]
    );
    report
}

/// `bpftool -j <args>`, parsed.
pub fn bpftool_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["bpftool", "-j"];
    all.extend_from_slice(args);
    serde_json::from_str(&run(&all)).unwrap_or_else(|e| panic!("{all:?}: {e}"))
}

/// Minimal YAML for the documents tests use.
pub mod yaml {
    pub fn network(name: &str, id: u32, subnets: &[&str], gateways: &[&str], ipam: bool) -> String {
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {{name: {name}}}\nspec:\n  id: {id}\n  subnets: [{}]\n  defaultGatewayIPs: [{}]\n  ipam: {{mode: {}}}\n",
            quoted(subnets),
            quoted(gateways),
            if ipam { "Enabled" } else { "Disabled" }
        )
    }

    pub fn attachment(
        name: &str,
        network: &str,
        node: &str,
        port: &str,
        mac: &str,
        ips: &[&str],
    ) -> String {
        attachment_with(
            name,
            network,
            node,
            port,
            &format!("  mac: \"{mac}\"\n  ips: [{}]\n", quoted(ips)),
        )
    }

    /// VM `name`'s eth0 in namespace `prod`; `extra` holds further spec
    /// lines (mac, ips, macPolicy, ...), each indented by two spaces.
    pub fn attachment_with(
        name: &str,
        network: &str,
        node: &str,
        port: &str,
        extra: &str,
    ) -> String {
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}-eth0, namespace: prod}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: {network}\n  node: {node}\n  port: {port}\n{extra}"
        )
    }

    fn quoted(items: &[&str]) -> String {
        items
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn docs(docs: &[String]) -> String {
        docs.join("---\n")
    }
}

// ---------------------------------------------------------------------------
// North-south: a top-of-rack router, external hosts, BIRD
// ---------------------------------------------------------------------------

/// Joins `a` and `b` with a veth pair (`a_if` in `a`, `b_if` in `b`), each
/// end with an address (`""`: none) and up.
pub fn link(a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_if: &str, b_addr: &str) {
    veth(a, a_if, b, b_if);
    for (ns, ifname, addr) in [(a, a_if, a_addr), (b, b_if, b_addr)] {
        if !addr.is_empty() {
            let mut args = vec!["ip", "addr", "add", addr, "dev", ifname];
            if addr.contains(':') {
                args.push("nodad");
            }
            ns.run(&args);
        }
        ns.run(&["ip", "link", "set", ifname, "up"]);
    }
}

/// A veth pair: `a_if` in `a`, `b_if` in `b`, both down and unaddressed.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) {
    run(&[
        "ip", "link", "add", a_if, "netns", &a.name, "type", "veth", "peer", "name", b_if, "netns",
        &b.name,
    ]);
}

/// Turns IPv4 and IPv6 forwarding on in `ns`.
pub fn enable_forwarding(ns: &Netns) {
    ns.run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    ns.run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
}

/// A BIRD 2 daemon inside a namespace, with its own config, control socket
/// and pid file in a temporary directory (never the system service).
/// Killed on drop.
pub struct Bird {
    pub name: String,
    pub dir: PathBuf,
    child: Option<Child>,
}

impl Bird {
    pub fn start(ns: &Netns, name: &str, config: &str) -> Bird {
        let dir = std::env::temp_dir().join(format!("vmpath-bird-{}-{name}", ns.name));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("bird.conf");
        fs::write(&conf, config).unwrap();
        let log = fs::File::create(dir.join("bird.out")).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net={}", ns.path()))
            .args(["bird", "-f", "-c"])
            .arg(&conf)
            .arg("-s")
            .arg(dir.join("bird.ctl"))
            .arg("-P")
            .arg(dir.join("bird.pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting bird");
        let bird = Bird {
            name: name.to_string(),
            dir,
            child: Some(child),
        };
        wait_for(
            &format!("bird {name} control socket"),
            Duration::from_secs(10),
            || bird.dir.join("bird.ctl").exists(),
        );
        bird
    }

    /// `birdc -s SOCK <args>`.
    pub fn birdc(&self, args: &[&str]) -> String {
        let sock = self.dir.join("bird.ctl");
        let mut all = vec!["birdc", "-s", sock.to_str().unwrap()];
        all.extend_from_slice(args);
        run(&all)
    }

    pub fn show_route(&self) -> String {
        self.birdc(&["show", "route"])
    }

    pub fn output(&self) -> String {
        fs::read_to_string(self.dir.join("bird.out")).unwrap_or_default()
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- bird {} output ---\n{}", self.name, self.output());
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// BIRD on a node, as docs/operations.md ("Route export") describes:
/// learns the agent's table (100) and exports only protocol-250 routes to
/// the ToR over eBGP.
pub fn bird_node_config(
    router_id: &str,
    local: &str,
    local_as: u32,
    tor: &str,
    tor_as: u32,
) -> String {
    format!(
        "router id {router_id};
protocol device {{ scan time 1; }}
protocol kernel vmpath4 {{ kernel table 100; learn; scan time 1; ipv4 {{ import all; export none; }}; }}
filter vmpath_out {{ if krt_source = 250 then accept; reject; }}
protocol bgp tor {{ local {local} as {local_as}; neighbor {tor} as {tor_as};
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import none; export filter vmpath_out; }}; }}
"
    )
}

/// BIRD on a ToR: takes every route the node offers and installs it in the
/// ToR's main table.
pub fn bird_tor_config(
    router_id: &str,
    local: &str,
    local_as: u32,
    node: &str,
    node_as: u32,
) -> String {
    format!(
        "router id {router_id};
protocol device {{ scan time 1; }}
protocol kernel {{ scan time 1; ipv4 {{ import none; export all; }}; }}
protocol bgp node {{ local {local} as {local_as}; neighbor {node} as {node_as};
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import all; export none; }}; }}
"
    )
}

// ---------------------------------------------------------------------------
// Overlay: an underlay joining several nodes (and foreign VTEPs)
// ---------------------------------------------------------------------------

/// An underlay L2 segment: a namespace holding a Linux bridge; `plug` joins
/// another namespace to it with a veth carrying an underlay address.
pub struct Underlay {
    pub ns: Netns,
    ports: AtomicU32,
}

impl Underlay {
    pub fn new() -> Self {
        let ns = Netns::new(format!("vt{}-ul", unique_tag()));
        ns.run(&["ip", "link", "add", "br0", "type", "bridge"]);
        ns.run(&["ip", "link", "set", "br0", "up"]);
        Underlay {
            ns,
            ports: AtomicU32::new(0),
        }
    }

    /// Joins `ns` to the underlay as `ifname` with `addr` (e.g.
    /// `192.0.2.1/24`) and `mtu` on both ends of the veth.
    pub fn plug(&self, ns: &Netns, ifname: &str, addr: &str, mtu: u32) {
        let peer = format!("p{}", self.ports.fetch_add(1, Ordering::SeqCst));
        link(ns, ifname, addr, &self.ns, &peer, "");
        let mtu = mtu.to_string();
        ns.run(&["ip", "link", "set", ifname, "mtu", &mtu]);
        self.ns.run(&["ip", "link", "set", &peer, "mtu", &mtu]);
        self.ns.run(&["ip", "link", "set", &peer, "master", "br0"]);
    }
}

impl Default for Underlay {
    fn default() -> Self {
        Self::new()
    }
}

/// The family of an overlay test bed's underlay: the overlay tests run
/// over both (VXLAN over IPv4 and over IPv6; one family per cluster).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnderlayFamily {
    V4,
    V6,
}

impl UnderlayFamily {
    /// Underlay address `i` (from 1): `192.0.2.<i>` or `fd00:192::<i>`.
    pub fn node_ip(self, i: u8) -> String {
        match self {
            UnderlayFamily::V4 => format!("192.0.2.{i}"),
            UnderlayFamily::V6 => format!("fd00:192::{i:x}"),
        }
    }

    /// `node_ip(i)` with the underlay's prefix length, for `Underlay::plug`.
    pub fn node_cidr(self, i: u8) -> String {
        match self {
            UnderlayFamily::V4 => format!("{}/24", self.node_ip(i)),
            UnderlayFamily::V6 => format!("{}/64", self.node_ip(i)),
        }
    }

    /// Outer headers of a VXLAN frame on this underlay (IP + UDP + VXLAN
    /// + inner Ethernet): what the vxlan device's MTU leaves off.
    pub fn vxlan_overhead(self) -> u32 {
        match self {
            UnderlayFamily::V4 => vmpath::common::VXLAN_OVERHEAD,
            UnderlayFamily::V6 => vmpath::common::VXLAN6_OVERHEAD,
        }
    }

    /// scapy's outer network layer from `src` to `dst` on this underlay.
    pub fn scapy_ip(self, src: &str, dst: &str) -> String {
        match self {
            UnderlayFamily::V4 => format!("IP(src='{src}', dst='{dst}')"),
            UnderlayFamily::V6 => format!("IPv6(src='{src}', dst='{dst}')"),
        }
    }
}

pub mod yaml_overlay {
    /// A Node document with its underlay (VTEP) address.
    pub fn node(name: &str, address: &str) -> String {
        format!(
            "apiVersion: vmpath.dev/v1alpha1\nkind: Node\nmetadata: {{name: {name}}}\nspec:\n  address: '{address}'\n"
        )
    }
}

/// [`bird_node_config`] with IPv6 as well: the agent's /128s learned from
/// table 100 (`vmpath6`) and exported on an ipv6 channel of the same
/// (IPv4) session, with `next_hop6` (the node's IPv6 address on the link)
/// as their next hop.
pub fn bird_node_config_dual(
    router_id: &str,
    local: &str,
    local_as: u32,
    tor: &str,
    tor_as: u32,
    next_hop6: &str,
) -> String {
    format!(
        "router id {router_id};
protocol device {{ scan time 1; }}
protocol kernel vmpath4 {{ kernel table 100; learn; scan time 1; ipv4 {{ import all; export none; }}; }}
protocol kernel vmpath6 {{ kernel table 100; learn; scan time 1; ipv6 {{ import all; export none; }}; }}
filter vmpath_out {{ if krt_source = 250 then accept; reject; }}
protocol bgp tor {{ local {local} as {local_as}; neighbor {tor} as {tor_as};
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import none; export filter vmpath_out; }};
  ipv6 {{ import none; export filter vmpath_out; next hop address {next_hop6}; }}; }}
"
    )
}

/// [`bird_tor_config`] with an ipv6 channel and IPv6 kernel export too.
pub fn bird_tor_config_dual(
    router_id: &str,
    local: &str,
    local_as: u32,
    node: &str,
    node_as: u32,
) -> String {
    format!(
        "router id {router_id};
protocol device {{ scan time 1; }}
protocol kernel {{ scan time 1; ipv4 {{ import none; export all; }}; }}
protocol kernel {{ scan time 1; ipv6 {{ import none; export all; }}; }}
protocol bgp node {{ local {local} as {local_as}; neighbor {node} as {node_as};
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 {{ import all; export none; }};
  ipv6 {{ import all; export none; }}; }}
"
    )
}

// ---------------------------------------------------------------------------
// Multus's side of a pod's secondary interface: the CNI plugin called with
// the NAD's config
// ---------------------------------------------------------------------------

pub mod multus {
    use std::{
        io::Write as _,
        path::PathBuf,
        process::{Command, Output, Stdio},
        sync::OnceLock,
    };

    use serde_json::Value;

    use crate::{Netns, Node};

    pub fn cni_bin() -> PathBuf {
        static BIN: OnceLock<PathBuf> = OnceLock::new();
        crate::workspace_bin(&BIN, "VMPATH_CNI_BIN", "vmpath-cni")
    }

    /// One pod interface as Multus hands it to the plugin.
    pub struct Call<'a> {
        pub conf: &'a str,
        pub pod_namespace: &'a str,
        pub pod: &'a str,
        pub ifname: &'a str,
        pub netns: &'a Netns,
        pub container: &'a str,
    }

    /// Runs `command` (ADD, DEL) in `node`'s namespace: whether it
    /// succeeded, and the JSON it printed (Null for none).
    pub fn call(node: &Node, command: &str, c: &Call) -> (bool, Value) {
        let cni_args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={}",
            c.pod_namespace, c.pod
        );
        call_with(node, command, c, &cni_args, c.conf)
    }

    /// ADD of a pod's default network, as Multus calls it for
    /// `v1.multus-cni.io/default-network`: `CNI_IFNAME` (eth0) and the
    /// CNI_ARGS the runtime gave Multus (the pod's infra container and
    /// `uid`), no selection element (so no MAC). Whether it succeeded, and
    /// the result.
    pub fn add_default_network(node: &Node, c: &Call, uid: &str) -> (bool, Value) {
        let cni_args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={uid}",
            c.pod_namespace, c.pod, c.container
        );
        call_with(node, "ADD", c, &cni_args, c.conf)
    }

    /// [`call`] with `cni_args` as `CNI_ARGS` and `conf` as the network
    /// configuration on stdin.
    pub fn call_with(
        node: &Node,
        command: &str,
        c: &Call,
        cni_args: &str,
        conf: &str,
    ) -> (bool, Value) {
        let env = [
            ("CNI_CONTAINERID", c.container),
            ("CNI_NETNS", &c.netns.path()),
            ("CNI_IFNAME", c.ifname),
            ("CNI_ARGS", cni_args),
        ];
        let out = run_plugin(node, command, &env, conf);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json = if stdout.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&stdout).unwrap_or_else(|_| {
                panic!(
                    "plugin output is not JSON: {stdout}\nstderr: {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
        };
        (out.status.success(), json)
    }

    /// Runs vmpath-cni in `node`'s namespace as a runtime would:
    /// `CNI_COMMAND=command`, the `env` given (and PATH, CNI_PATH, nothing
    /// else), `stdin` written to it.
    pub fn run_plugin(node: &Node, command: &str, env: &[(&str, &str)], stdin: &str) -> Output {
        let mut child = Command::new(crate::on_path("nsenter"))
            .arg(format!("--net={}", node.ns.path()))
            .arg(cni_bin())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", "/opt/cni/bin")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running vmpath-cni");
        // VERSION does not read stdin: the plugin may be gone before it is
        // written (a broken pipe), as with any runtime.
        let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
        child.wait_with_output().unwrap()
    }

    /// The `spec.config` of the NetworkAttachmentDefinition in `yaml`,
    /// with the agent's socket: what Multus passes the plugin.
    pub fn nad_conf(yaml: &str, node: &Node) -> String {
        let config = yaml
            .split("\n---\n")
            .find(|d| d.contains("kind: NetworkAttachmentDefinition"))
            .and_then(|d| d.split("config: '").nth(1))
            .and_then(|c| c.split('\'').next())
            .expect("a NAD's spec.config");
        let mut conf: Value = serde_json::from_str(config).unwrap();
        conf["socket"] = node.api_socket().to_str().unwrap().into();
        conf.to_string()
    }
}
