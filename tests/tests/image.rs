//! The container image (`cargo xtask image`) run as the DaemonSet runs it,
//! with podman: its init containers' commands do their job, the agent
//! started from the image forwards between VMs, a newer image takes over
//! the pinned state of an older one's agent without losing a packet, and
//! `--cleanup` from the image leaves the node as it was, and the BIRD
//! sidecar's image, run with the DaemonSet's command, capabilities and
//! bird.conf, exports the agent's per-VM routes to a BGP peer.
//!
//! The images are the archives in VMPATH_IMAGE, VMPATH_IMAGE_NEXT (the
//! same sources, built to report another version) and VMPATH_BIRD_IMAGE,
//! which `cargo xtask test` builds; without them the test builds them with
//! `cargo xtask image`.

use std::{
    cell::RefCell,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
    time::Duration,
};

use serde_json::Value;
use vmpath_tests::{
    AGENT_START_BOUND, Bird, Netns, Node, Vm, enable_forwarding, link, run, run_status, unique_tag,
    vmpath_bin, wait_for,
};

/// An image archive: from `env_var`, else built by `cargo xtask image`.
fn archive(env_var: &str, suffix: Option<&str>) -> PathBuf {
    archive_at(env_var, suffix, &["archive"])
}

/// [`archive`], with `key` the path to it in `cargo xtask image --json`'s
/// object (`archive`, or `bird`, `archive` for the BIRD image).
fn archive_at(env_var: &str, suffix: Option<&str>, key: &[&str]) -> PathBuf {
    if let Some(p) = std::env::var_os(env_var) {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut c = Command::new(env!("CARGO"));
    c.current_dir(root)
        .args(["run", "-q", "-p", "xtask", "--", "image", "--json"]);
    if let Some(s) = suffix {
        c.args(["--version-suffix", s]);
    }
    let out = c
        .stderr(Stdio::inherit())
        .output()
        .expect("cargo xtask image");
    assert!(out.status.success(), "cargo xtask image failed");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {text}"));
    let at = key.iter().fold(&v, |v, k| &v[k]);
    PathBuf::from(at.as_str().unwrap_or_else(|| panic!("no {key:?} in {v}")))
}

fn current_image() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| archive("VMPATH_IMAGE", None))
}

fn next_image() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| archive("VMPATH_IMAGE_NEXT", Some("-next")))
}

fn bird_image() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| archive_at("VMPATH_BIRD_IMAGE", None, &["bird", "archive"]))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

const ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=16384:16384",
    "--ulimit",
    "nproc=4096:4096",
];

/// A private podman (its own storage under a temp dir, removed on drop)
/// with the images it loaded.
struct Podman {
    dir: PathBuf,
    containers: RefCell<Vec<String>>,
}

impl Podman {
    fn new() -> Podman {
        let dir = std::env::temp_dir().join(format!("vmpath-image-{}", unique_tag()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Podman {
            dir,
            containers: Default::default(),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let d = |p: &str| self.dir.join(p).display().to_string();
        let mut c = Command::new("podman");
        c.args(["--root", &d("root"), "--runroot", &d("runroot")])
            // vfs: no overlay mounts to leave behind.
            .args(["--storage-driver", "vfs"])
            // crun refuses this host's hybrid cgroups.
            .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
            .args(args)
            .stdin(Stdio::null());
        c
    }

    fn podman(&self, args: &[&str]) -> Output {
        self.command(args)
            .output()
            .expect("running podman (cargo xtask setup installs it)")
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.podman(args);
        assert!(
            out.status.success(),
            "podman {}: {}",
            args.join(" "),
            text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `podman run --rm` of `args` (options, image, command) with the
    /// ulimits this host allows (podman's defaults exceed its hard limits).
    fn run(&self, args: &[&str]) -> Output {
        let mut a = vec!["run", "--rm"];
        a.extend(ULIMITS);
        a.extend(args);
        self.podman(&a)
    }

    /// Loads an image archive; returns the reference it carries.
    fn load(&self, archive: &Path) -> String {
        let out = self.ok(&["load", "-i", archive.to_str().unwrap()]);
        let reference = out
            .lines()
            .find_map(|l| l.strip_prefix("Loaded image: "))
            .unwrap_or_else(|| panic!("podman load named no image: {out}"))
            .trim()
            .to_string();
        assert!(reference.contains(':'), "{reference}");
        reference
    }

    /// Runs `args` in a new container of `image` to completion, privileged
    /// in `node`'s network namespace with the host's bpffs and `mounts`.
    fn run_once(&self, image: &str, node: &Node, mounts: &[&Path], args: &[&str]) -> Output {
        let mut a = self.agent_options(node, mounts);
        a.push(image.into());
        a.extend(args.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        self.run(&a)
    }

    /// What the DaemonSet gives the agent: privileged here (the test bed's
    /// namespaces), the node's network namespace, the host's bpffs, and
    /// the directories it reads and writes at the same paths as outside.
    fn agent_options(&self, node: &Node, mounts: &[&Path]) -> Vec<String> {
        let mut a: Vec<String> = [
            "--privileged",
            "--network",
            &format!("ns:{}", node.ns.path()),
            "-v",
            "/sys/fs/bpf:/sys/fs/bpf",
            "-e",
            "RUST_LOG=info",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for m in mounts {
            a.push("-v".into());
            a.push(format!("{0}:{0}", m.display()));
        }
        a
    }

    /// Starts the agent from `image` in a detached container named `name`
    /// for `node`, with the test bed's usual flags plus `extra`.
    fn start_agent(&self, name: &str, image: &str, node: &Node, extra: &[&str]) {
        // `programmed_ports` must see this agent's status.
        let _ = std::fs::remove_file(node.state_dir.join("status.json"));
        self.containers.borrow_mut().push(name.to_string());
        let mut a: Vec<String> = ["run", "-d", "--name", name]
            .into_iter()
            .chain(ULIMITS)
            .map(String::from)
            .collect();
        a.extend(self.agent_options(node, &[&node.config_dir, &node.state_dir]));
        a.push(image.into());
        for s in [
            "vmpath",
            "agent",
            "--node",
            node.name.as_str(),
            "--interval-ms",
            "100",
            "--config-dir",
            node.config_dir.to_str().unwrap(),
            "--bpffs",
            node.bpffs.to_str().unwrap(),
            "--state-dir",
            node.state_dir.to_str().unwrap(),
            "--api-socket",
            node.api_socket().to_str().unwrap(),
        ]
        .into_iter()
        .chain(extra.iter().copied())
        {
            a.push(s.to_string());
        }
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        self.ok(&a);
    }

    fn logs(&self, name: &str) -> String {
        text(&self.podman(&["logs", name]))
    }

    fn running(&self, name: &str) -> bool {
        self.podman(&["inspect", "-f", "{{.State.Running}}", name])
            .stdout
            .starts_with(b"true")
    }

    /// Waits until the agent in `name` has programmed exactly `ports`.
    fn wait_ports(&self, name: &str, node: &Node, ports: &[&str]) {
        let mut want: Vec<String> = ports.iter().map(|s| s.to_string()).collect();
        want.sort();
        wait_for(
            &format!("the agent in {name} to program {want:?}"),
            AGENT_START_BOUND,
            || {
                assert!(
                    self.running(name),
                    "container {name} exited:\n{}",
                    self.logs(name)
                );
                node.programmed_ports().as_ref() == Some(&want)
            },
        );
    }

    /// `podman stop`: SIGTERM, as the kubelet stops a pod.
    fn stop(&self, name: &str) {
        self.ok(&["stop", "-t", "20", name]);
    }

    fn exec(&self, name: &str, args: &[&str]) -> String {
        let mut a = vec!["exec", name];
        a.extend(args);
        self.ok(&a)
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for name in self.containers.borrow().iter() {
            if std::thread::panicking() {
                eprintln!("--- container {name} ---\n{}", self.logs(name));
            }
            let _ = self.podman(&["rm", "-f", "-t", "0", name]);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A node with two VMs on one network; no agent yet.
/// A Primary network: the agent writes the pod network's hand-off table
/// (`table inet vmpath_handoff`) for it.
const PRIMARY_NETWORK: &str = "apiVersion: vmpath.dev/v1alpha1
kind: Network
metadata:
  name: pods
spec:
  id: 101
  role: Primary
  subnets: [\"10.99.0.0/16\"]
  defaultGatewayIPs: [\"10.99.0.1\"]
";

/// The hand-off table in the node's namespace, as nft lists it ("" when
/// there is none).
fn handoff_table(node: &Node) -> String {
    let out = node
        .ns
        .run_status(&["nft", "list", "table", "inet", "vmpath_handoff"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn bed(name: &str) -> (Node, Vm, Vm) {
    Node::with_two_vms(name, "52:54:00:c1:00")
}

/// `vmpath status -o json` from the image's own CLI in the container.
fn status(podman: &Podman, container: &str, node: &Node) -> Value {
    let out = podman.exec(
        container,
        &[
            "vmpath",
            "status",
            "-o",
            "json",
            "--api-socket",
            node.api_socket().to_str().unwrap(),
        ],
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[test]
fn the_image_runs_the_agent_its_init_steps_and_forwards_between_vms() {
    let (node, vm1, vm2) = bed("i");
    let podman = Podman::new();
    let image = podman.load(current_image());

    // The image is this build: `--version` of both binaries in it says the
    // same as the agent built from these sources, and the tag is
    // `<version>-<revision>`.
    let out_text = |out: Output| {
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let version = out_text(podman.run(&[&image, "vmpath", "--version"]));
    let here = run(&[vmpath_bin().to_str().unwrap(), "--version"]);
    assert_eq!(version, here, "the image's vmpath is not this build");
    let (v, rev) = version
        .trim()
        .strip_prefix("vmpath ")
        .and_then(|r| r.split_once(" (revision "))
        .unwrap_or_else(|| panic!("{version}"));
    let rev = rev.trim_end_matches(')');
    assert!(
        image.ends_with(&format!(":{v}-{rev}")) || (rev == "unknown" && image.ends_with(v)),
        "{image} is not tagged {v}-{rev}"
    );
    let cni_version = out_text(podman.run(&[&image, "vmpath-cni", "--version"]));
    assert_eq!(
        cni_version.trim(),
        format!("vmpath-cni {v} (revision {rev})")
    );
    // Nothing but vmpath in it: no shell.
    let shell = podman.run(&[&image, "sh", "-c", "true"]);
    assert!(
        !shell.status.success() && text(&shell).contains("executable file not found"),
        "the image has a shell: {}",
        text(&shell)
    );

    // The init containers' commands: mount-bpffs checks the bpffs and
    // exits; install-cni puts a working plugin where the host's runtime
    // finds it.
    let out = podman.run_once(
        &image,
        &node,
        &[],
        &[
            "vmpath",
            "agent",
            "--mount-bpffs",
            "--bpffs",
            node.bpffs.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "mount-bpffs: {}", text(&out));
    let cni_dir = node.state_dir.parent().unwrap().join("opt-cni-bin");
    std::fs::create_dir_all(&cni_dir).unwrap();
    let out = podman.run(&[
        "-v",
        &format!("{}:/host/opt/cni/bin", cni_dir.display()),
        &image,
        "vmpath-cni",
        "install",
        "/host/opt/cni/bin",
    ]);
    assert!(out.status.success(), "install-cni: {}", text(&out));
    let installed = Command::new(cni_dir.join("vmpath-cni"))
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .expect("the installed plugin runs on the host");
    let reply: Value = serde_json::from_slice(&installed.stdout).unwrap();
    assert_eq!(reply["cniVersion"], "1.1.0", "{reply}");

    // nft is there for the pod network's hand-off, and runs.
    let nft = out_text(podman.run(&[&image, "nft", "--version"]));
    assert!(nft.starts_with("nftables v"), "{nft}");

    // The agent from the image forwards, and writes the hand-off table of
    // a Primary network (its nftables table, with the image's nft).
    node.write_config("pods.yaml", PRIMARY_NETWORK);
    let agent = format!("vmpath-{}", node.tag);
    podman.start_agent(&agent, &image, &node, &[]);
    podman.wait_ports(&agent, &node, &[&vm1.port, &vm2.port]);
    wait_for(
        "the hand-off table from the image's agent",
        Duration::from_secs(30),
        || handoff_table(&node).contains("10.99.0.0/16"),
    );
    assert!(
        vm1.ping("10.20.0.12"),
        "vm1 -> vm2 through the image's agent"
    );
    assert!(vm2.ping("10.20.0.11"), "vm2 -> vm1");
    assert!(vm1.ping("10.20.0.1"), "vm1 -> the gateway");
    let tcp = vmpath_tests::iperf3(&vm2.ns, &vm1.ns, "10.20.0.12", false, 1);
    assert!(
        tcp["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0) > 0,
        "TCP vm1 -> vm2: {tcp}"
    );
    // Its CLI reports it ready, as this build, and its program sits in each
    // port's filter.
    let s = status(&podman, &agent, &node);
    assert_eq!(s["ready"], true, "{s}");
    let build = s["programs"]["build"].as_str().unwrap();
    assert!(build.starts_with(&format!("{v}+git.{rev}.")), "{build}");
    let vm_port = s["programs"]["loaded"]["vm_port"].as_u64().unwrap();
    let ports = node.port_programs();
    for port in [&vm1.port, &vm2.port] {
        let name = format!("vm_port-{}", node.ns.ifindex(port));
        assert!(
            ports.iter().any(|(p, prog)| *p == name && *prog == vm_port),
            "{port}: no filter running the agent's program: {ports:?}"
        );
    }
}

#[test]
fn a_newer_image_adopts_the_pinned_state_without_losing_a_packet() {
    let (node, vm1, vm2) = bed("u");
    let podman = Podman::new();
    let old_image = podman.load(current_image());
    let new_image = podman.load(next_image());
    assert_ne!(old_image, new_image);

    let old = format!("vmpath-old-{}", node.tag);
    podman.start_agent(&old, &old_image, &node, &[]);
    podman.wait_ports(&old, &node, &[&vm1.port, &vm2.port]);
    assert!(vm1.ping("10.20.0.12"));
    let old_links = node.pinned_links();
    let old_ports = node.port_programs();
    let old_maps = node.pinned_maps();
    let old_status = status(&podman, &old, &node);
    let old_build = old_status["programs"]["build"]
        .as_str()
        .unwrap()
        .to_string();
    let old_vm_port = old_status["programs"]["loaded"]["vm_port"]
        .as_u64()
        .unwrap();

    // A rolling update: the new pod starts while the old one still runs,
    // waits for the node, and takes over when the old one exits on SIGTERM.
    let pinger = vm1
        .ns
        .spawn(&["ping", "-i", "0.01", "-w", "6", "-W", "1", "10.20.0.12"]);
    let new = format!("vmpath-new-{}", node.tag);
    podman.start_agent(&new, &new_image, &node, &["--lock-wait", "60s"]);
    wait_for(
        "the new agent to wait for the old one",
        Duration::from_secs(20),
        || {
            podman
                .logs(&new)
                .contains("waiting for the agent that owns this node to exit")
        },
    );
    assert_eq!(
        node.pinned_links(),
        old_links,
        "the waiting agent touched a link"
    );
    assert_eq!(
        node.port_programs(),
        old_ports,
        "the waiting agent touched a port"
    );
    podman.stop(&old);
    wait_for(
        "the new agent's programs in every link",
        // It loads its programs once the old one has exited.
        AGENT_START_BOUND,
        || {
            let out = podman.podman(&[
                "exec",
                &new,
                "vmpath",
                "status",
                "-o",
                "json",
                "--api-socket",
                node.api_socket().to_str().unwrap(),
            ]);
            let Ok(s) = serde_json::from_slice::<Value>(&out.stdout) else {
                return false;
            };
            let p = &s["programs"];
            p["build"].as_str() != Some(old_build.as_str())
                && p["loaded"]["vm_port"]
                    .as_u64()
                    .is_some_and(|id| id != old_vm_port)
                && p["mismatches"] == serde_json::json!([])
                && p["links"]
                    .as_array()
                    .is_some_and(|l| l.len() == old_links.len())
                && p["ports"].as_array().is_some_and(|l| {
                    l.len() == old_ports.len() && l.iter().all(|f| f["current"] == true)
                })
        },
    );
    let out = pinger.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains(" 0% packet loss"),
        "packets lost in the upgrade:\n{report}"
    );

    // The new agent is the new version...
    let version = podman.exec(&new, &["vmpath", "--version"]);
    assert!(version.contains("-next "), "{version}");
    let s = status(&podman, &new, &node);
    let build = s["programs"]["build"].as_str().unwrap();
    assert!(build.contains("-next+git."), "{build}");
    // ...that adopted what the old one left: the same links, the same
    // ports' filters (now running its programs) and the same maps, with
    // their contents.
    let vm_port = s["programs"]["loaded"]["vm_port"].as_u64().unwrap();
    let links = node.pinned_links();
    assert_eq!(links.len(), old_links.len());
    for ((pin, link, _), (old_pin, old_link, _)) in links.iter().zip(&old_links) {
        assert_eq!(
            (pin, link),
            (old_pin, old_link),
            "links replaced, not adopted"
        );
    }
    node.assert_ports_kept_running(&old_ports, vm_port);
    assert_eq!(node.pinned_maps(), old_maps, "maps replaced, not adopted");
    assert!(
        podman.logs(&new).contains("adopting pinned map"),
        "{}",
        podman.logs(&new)
    );
    assert!(vm2.ping("10.20.0.11"));
    assert!(vm1.ping("10.20.0.1"));
}

/// What an agent may change on a node, as `ip` and bpftool show it: links
/// (name, kind, MAC, MTU, XDP), addresses, routes of every table, XDP and
/// tc (cls_bpf) programs. (tcx links are not listed per device here: the
/// test checks its pinned links are gone by id.)
fn node_state(node: &Node) -> Vec<String> {
    let json = |args: &[&str]| -> Value { serde_json::from_str(&node.ns.run(args)).unwrap() };
    let mut state = Vec::new();
    for l in json(&["ip", "-j", "-d", "link", "show"])
        .as_array()
        .unwrap()
    {
        state.push(format!(
            "link {} {} {} mtu {} xdp {}",
            l["ifname"], l["linkinfo"]["info_kind"], l["address"], l["mtu"], l["xdp"]
        ));
    }
    for a in json(&["ip", "-j", "addr", "show"]).as_array().unwrap() {
        for i in a["addr_info"].as_array().unwrap() {
            state.push(format!(
                "addr {} {}/{}",
                a["ifname"], i["local"], i["prefixlen"]
            ));
        }
    }
    // nftables tables (the hand-off's).
    for t in node.ns.run(&["nft", "list", "tables"]).lines() {
        state.push(format!("nft {t}"));
    }
    for family in ["-4", "-6"] {
        for r in json(&["ip", "-j", family, "route", "show", "table", "all"])
            .as_array()
            .unwrap()
        {
            state.push(format!(
                "route {} dev {} table {} proto {}",
                r["dst"], r["dev"], r["table"], r["protocol"]
            ));
        }
    }
    state.push(format!(
        "bpf {}",
        node.ns.run(&["bpftool", "-j", "net", "show"])
    ));
    state.sort();
    state
}

#[test]
fn cleanup_from_the_image_leaves_the_node_as_it_was() {
    let (node, vm1, vm2) = bed("x");
    // A route of someone else's in vmpath's table stays.
    node.ns.run(&[
        "ip",
        "route",
        "add",
        "192.0.2.99/32",
        "dev",
        "lo",
        "table",
        "100",
        "proto",
        "static",
    ]);
    // The ports' own IPv6 link-local addresses come on their own time:
    // wait for them, so that `before` is the settled node.
    for vm in [&vm1, &vm2] {
        wait_for(
            "the port's link-local address",
            Duration::from_secs(10),
            || {
                let out = node
                    .ns
                    .run(&["ip", "-6", "addr", "show", "dev", &vm.port, "scope", "link"]);
                out.contains("fe80") && !out.contains("tentative")
            },
        );
    }
    let before = node_state(&node);
    let podman = Podman::new();
    let image = podman.load(current_image());

    // A Primary network: the agent's nftables table is the node's too.
    node.write_config("pods.yaml", PRIMARY_NETWORK);
    let agent = format!("vmpath-{}", node.tag);
    podman.start_agent(&agent, &image, &node, &[]);
    podman.wait_ports(&agent, &node, &[&vm1.port, &vm2.port]);
    assert!(vm1.ping("10.20.0.12"));
    wait_for("the hand-off table", Duration::from_secs(30), || {
        !handoff_table(&node).is_empty()
    });
    let links = node.pinned_links();
    assert_ne!(node_state(&node), before, "the agent changed nothing");
    // Uninstall: the pod goes (the data path stays on purpose)...
    podman.stop(&agent);
    assert!(vm2.ping("10.20.0.11"), "the data path outlives the agent");
    // ...with an exported route left as a crash would leave it...
    node.ns.run(&[
        "ip",
        "route",
        "add",
        "10.20.0.77/32",
        "dev",
        "lo",
        "table",
        "100",
        "proto",
        "250",
    ]);
    // ...then `--cleanup`, from the image, as docs/install.md says.
    let out = podman.run_once(
        &image,
        &node,
        &[],
        &[
            "vmpath",
            "agent",
            "--cleanup",
            "--bpffs",
            node.bpffs.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "cleanup: {}", text(&out));

    // No link, no program (the kernel frees them after a grace period).
    for (_, link, prog) in links {
        wait_for(
            &format!("link {link} and program {prog} to go"),
            Duration::from_secs(10),
            || {
                !run_status(&["bpftool", "link", "show", "id", &link.to_string()])
                    .status
                    .success()
                    && !run_status(&["bpftool", "prog", "show", "id", &prog.to_string()])
                        .status
                        .success()
            },
        );
    }
    let left: Vec<_> = std::fs::read_dir(&node.bpffs)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left under the bpffs root: {left:?}");
    // The node as it was: links, addresses, routes, tc and XDP.
    let after = node_state(&node);
    let gone: Vec<_> = before.iter().filter(|l| !after.contains(l)).collect();
    let added: Vec<_> = after.iter().filter(|l| !before.contains(l)).collect();
    assert!(
        gone.is_empty() && added.is_empty(),
        "the node differs after cleanup:\n gone: {gone:#?}\n added: {added:#?}"
    );
    assert!(!vm1.ns.ping("10.20.0.12", 1), "still forwarded");
}

/// The DaemonSet's BIRD sidecar as deploy/ defines it: its command, the
/// capabilities it adds, its probe's command, and bird.conf from the
/// vmpath-bird ConfigMap.
struct BirdSidecar {
    command: Vec<String>,
    capabilities: Vec<String>,
    probe: Vec<String>,
    config: String,
}

fn deploy_yaml(file: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("deploy")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_saphyr::from_multiple::<Value>(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn deployed_bird_sidecar() -> BirdSidecar {
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap_or_else(|| panic!("not a list: {v}"))
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    let ds = deploy_yaml("daemonset.yaml")
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("the DaemonSet");
    let bird = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "bird")
        .expect("the bird container")
        .clone();
    assert!(bird["args"].is_null(), "the test runs `command` only");
    let config = deploy_yaml("configmap.yaml")
        .into_iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "vmpath-bird")
        .expect("the vmpath-bird ConfigMap")["data"]["bird.conf"]
        .as_str()
        .unwrap()
        .to_string();
    BirdSidecar {
        command: strings(&bird["command"]),
        capabilities: strings(&bird["securityContext"]["capabilities"]["add"]),
        probe: strings(&bird["livenessProbe"]["exec"]["command"]),
        config,
    }
}

/// BIRD on the ToR of the shipped bird.conf (192.0.2.1 and 2001:db8::1,
/// AS 65000): one session per family with the node (AS 65001), every
/// route learned into the ToR's kernel tables.
fn tor_bird_config() -> String {
    "router id 192.0.2.1;
protocol device { scan time 1; }
protocol kernel { scan time 1; ipv4 { import none; export all; }; }
protocol kernel { scan time 1; ipv6 { import none; export all; }; }
protocol bgp node4 { local 192.0.2.1 as 65000; neighbor 192.0.2.2 as 65001;
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv4 { import all; export none; }; }
protocol bgp node6 { local 2001:db8::1 as 65000; neighbor 2001:db8::2 as 65001;
  connect delay time 1; connect retry time 2; error wait time 1, 10;
  ipv6 { import all; export none; }; }
"
    .to_string()
}

#[test]
fn the_bird_image_exports_the_agents_vm_routes_to_a_bgp_peer() {
    let sidecar = deployed_bird_sidecar();
    // A node whose uplink eth0 faces the ToR the shipped bird.conf names
    // (its router id comes from "eth*"); one VM on a routed network
    // advertised per VM.
    let node = Node::new("r");
    let tor = Netns::new(format!("vt{}-tor", node.tag));
    link(
        &node.ns,
        "eth0",
        "192.0.2.2/30",
        &tor,
        "tor0",
        "192.0.2.1/30",
    );
    node.ns.run(&[
        "ip",
        "addr",
        "add",
        "2001:db8::2/64",
        "dev",
        "eth0",
        "nodad",
    ]);
    tor.run(&[
        "ip",
        "addr",
        "add",
        "2001:db8::1/64",
        "dev",
        "tor0",
        "nodad",
    ]);
    enable_forwarding(&node.ns);
    let vm = node.add_vm(
        "vm1",
        "52:54:00:c3:00:01",
        &["10.20.0.11/16", "fd20::11/64"],
        Some("10.20.0.1"),
    );
    node.write_config(
        "c.yaml",
        &vmpath_tests::yaml::docs(&[
            vmpath_tests::yaml::network(
                "green",
                500,
                &["10.20.0.0/16", "fd20::/64"],
                &["10.20.0.1", "fd20::1"],
                true,
            ) + "  egress: Routed\n  advertise: {perVM: true}\n",
            vmpath_tests::yaml::attachment(
                "vm1",
                "green",
                &node.name,
                &vm.port,
                &vm.mac,
                &["10.20.0.11/16", "fd20::11/64"],
            ),
        ]),
    );
    // Someone else's route in vmpath's table: BIRD must not export it.
    node.ns.run(&[
        "ip",
        "route",
        "add",
        "10.20.0.99/32",
        "dev",
        "lo",
        "table",
        "100",
        "proto",
        "static",
    ]);

    let podman = Podman::new();
    let vmpath_image = podman.load(current_image());
    let bird_image = podman.load(bird_image());
    // One tag for both: the one deploy/ sets.
    let tag = |r: &str| r.rsplit_once(':').unwrap().1.to_string();
    assert_eq!(tag(&bird_image), tag(&vmpath_image), "{bird_image}");
    assert!(bird_image.contains("/vmpath-bird:"), "{bird_image}");

    let agent = format!("vmpath-{}", node.tag);
    podman.start_agent(&agent, &vmpath_image, &node, &["--uplink", "eth0"]);
    podman.wait_ports(&agent, &node, &[&vm.port]);
    let tor_bird = Bird::start(&tor, "tor", &tor_bird_config());

    // The sidecar: the DaemonSet's command, not privileged, only its
    // capabilities, bird.conf read-only at /etc/bird, the control socket
    // on a volume of its own, in the node's network namespace.
    let dir = podman.dir.join("bird");
    let (etc, sock) = (dir.join("etc"), dir.join("run"));
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::create_dir_all(&sock).unwrap();
    std::fs::write(etc.join("bird.conf"), &sidecar.config).unwrap();
    let name = format!("bird-{}", node.tag);
    podman.containers.borrow_mut().push(name.clone());
    let mut args: Vec<String> = ["run", "-d", "--name", &name]
        .into_iter()
        .chain(ULIMITS)
        .map(String::from)
        .collect();
    args.extend(
        [
            "--network",
            &format!("ns:{}", node.ns.path()),
            "--cap-drop",
            "all",
        ]
        .map(String::from),
    );
    for cap in &sidecar.capabilities {
        args.extend(["--cap-add".to_string(), cap.clone()]);
    }
    args.extend([
        "-v".into(),
        format!("{}:/etc/bird:ro", etc.display()),
        "-v".into(),
        format!("{}:/run/bird", sock.display()),
        bird_image.clone(),
    ]);
    args.extend(sidecar.command.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    podman.ok(&args);

    // The liveness probe's birdc answers from the image.
    wait_for(
        "the sidecar's liveness probe",
        Duration::from_secs(20),
        || {
            assert!(
                podman.running(&name),
                "the BIRD container exited:\n{}",
                podman.logs(&name)
            );
            let mut probe = vec!["exec", name.as_str()];
            probe.extend(sidecar.probe.iter().map(String::as_str));
            let out = podman.podman(&probe);
            out.status.success() && text(&out).contains("Daemon is up and running")
        },
    );

    // The ToR learns the VM's /32 and /128 over BGP from the sidecar, and
    // only vmpath's routes.
    for prefix in ["10.20.0.11/32", "fd20::11/128"] {
        wait_for(
            &format!("the ToR to learn {prefix} from the BIRD image"),
            Duration::from_secs(60),
            || tor_bird.show_route().contains(prefix),
        );
    }
    let routes = tor_bird.show_route();
    assert!(
        !routes.contains("10.20.0.99"),
        "a route not vmpath's was exported:\n{routes}"
    );
    let via = tor.run(&["ip", "route", "show", "10.20.0.11"]);
    assert!(via.contains("via 192.0.2.2"), "ToR kernel route: {via}");
    // A user's check: the VM is reached from the ToR by its own address,
    // over the route the sidecar exported.
    assert!(tor.ping("10.20.0.11", 3), "ToR -> VM over the BGP route");

    // birdcl, the readline-less client, works from the image too.
    let protocols = podman.exec(
        &name,
        &["birdcl", "-s", "/run/bird/bird.ctl", "show", "protocols"],
    );
    assert!(
        protocols
            .lines()
            .any(|l| l.starts_with("tor4") && l.contains("Established")),
        "{protocols}"
    );
}
