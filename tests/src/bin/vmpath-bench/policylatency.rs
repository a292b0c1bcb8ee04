//! Figure group 13: from writing a NetworkPolicy to the data path
//! enforcing it. The real agent (release build, file source) serves two
//! VMs, a and b; a sends b a stream of UDP probes, one every
//! millisecond, each a new flow (its own source and destination port,
//! so no conntrack entry carries it through a change) and carrying its
//! send time. Counted at b's eth0 (a raw socket: what the data path
//! delivered). Per trial:
//!   deny    a policy isolating b for ingress is written: the time from the
//!           write to the send time of the last probe that still arrived
//!   allow   a second policy allowing UDP from a is written: the time from
//!           the write to the send time of the first probe that arrived
//! then both files are removed and the stream passes again.

use std::{
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::sleep,
    time::Duration,
};

use anyhow::{Result, anyhow, bail};
use vmpath::config::parse_mac;
use vmpath_common::drop_reason;
use vmpath_tests::{Node, Vm};

use crate::{
    report::{Bar, Section},
    util::{self, RawSock, fmt, percentile},
};

pub struct Options {
    pub trials: usize,
}

const A_MAC: &str = "52:54:00:0d:00:0a";
const B_MAC: &str = "52:54:00:0d:00:0b";
const A_IP: [u8; 4] = [10, 30, 0, 10];
const B_IP: [u8; 4] = [10, 30, 0, 11];
/// Marks a probe's payload (then the send time, then the sequence number).
const MAGIC: &[u8; 4] = b"vplt";
const PROBE_INTERVAL: Duration = Duration::from_millis(1);
/// How long a change may take before the trial counts as failed.
const LIMIT: Duration = Duration::from_secs(10);
/// Quiet time after which a stream counts as stopped.
const QUIET: Duration = Duration::from_millis(300);

/// CLOCK_MONOTONIC in nanoseconds (the same clock in every thread).
fn now_ns() -> u64 {
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn attachment(name: &str, vm: &Vm, ip: [u8; 4]) -> String {
    format!(
        "apiVersion: vmpath.dev/v1alpha1\nkind: Attachment\nmetadata: {{name: {name}, namespace: lat, labels: {{app: {name}}}}}\nspec:\n  vm: {name}\n  interface: eth0\n  network: pol\n  node: a\n  port: {}\n  mac: \"{}\"\n  ips: [\"{}.{}.{}.{}/16\"]\n",
        vm.port, vm.mac, ip[0], ip[1], ip[2], ip[3]
    )
}

const DENY: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: b-isolated, namespace: lat}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  policyTypes: [Ingress]\n";
const ALLOW: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: b-from-a, namespace: lat}\nspec:\n  podSelector: {matchLabels: {app: b}}\n  ingress: [{from: [{podSelector: {matchLabels: {app: a}}}], ports: [{protocol: UDP, port: 20000, endPort: 30000}]}]\n";

/// The send times of the probes b received, in arrival order.
struct Arrivals(Mutex<Vec<u64>>);

impl Arrivals {
    /// The latest send time received, if any.
    fn last(&self) -> Option<u64> {
        self.0.lock().unwrap().iter().copied().max()
    }
    /// The earliest send time at or after `t`.
    fn first_since(&self, t: u64) -> Option<u64> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .copied()
            .filter(|&s| s >= t)
            .min()
    }
}

/// Waits until nothing sent in the last `QUIET` arrived (the stream is
/// stopped), at least `QUIET` after `since`; the last arrival's send time.
fn wait_stopped(arrivals: &Arrivals, since: u64) -> Result<u64> {
    let quiet = QUIET.as_nanos() as u64;
    loop {
        let now = now_ns();
        if now - since > LIMIT.as_nanos() as u64 {
            bail!(
                "probes still arrive {} s after the policy was written",
                LIMIT.as_secs()
            );
        }
        let last = arrivals.last().unwrap_or(0);
        // Probes are in flight for well under a millisecond.
        if now - since >= quiet && now.saturating_sub(last) >= quiet {
            return Ok(last);
        }
        sleep(Duration::from_millis(20));
    }
}

/// Waits for the first probe sent at or after `since` to arrive.
fn wait_passing(arrivals: &Arrivals, since: u64) -> Result<u64> {
    loop {
        if let Some(t) = arrivals.first_since(since) {
            return Ok(t);
        }
        if now_ns() - since > LIMIT.as_nanos() as u64 {
            bail!("no probe arrived {} s after the change", LIMIT.as_secs());
        }
        sleep(Duration::from_millis(5));
    }
}

pub fn run(opts: &Options) -> Result<Section> {
    let mut node = Node::new("a");
    let a = node.add_vm("a", A_MAC, &["10.30.0.10/16"], None);
    let b = node.add_vm("b", B_MAC, &["10.30.0.11/16"], None);
    node.write_config(
        "base.yaml",
        &[
            "apiVersion: vmpath.dev/v1alpha1\nkind: Network\nmetadata: {name: pol}\nspec: {id: 130, subnets: [10.30.0.0/16], defaultGatewayIPs: [10.30.0.1], ipam: {mode: Enabled}}\n".to_string(),
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: lat}\n".to_string(),
            attachment("a", &a, A_IP),
            attachment("b", &b, B_IP),
        ]
        .join("---\n"),
    );
    node.start_agent();
    node.wait_ports(&[&a.port, &b.port]);
    let a_mac = parse_mac(A_MAC).map_err(|e| anyhow!(e))?;
    let b_mac = parse_mac(B_MAC).map_err(|e| anyhow!(e))?;

    let arrivals = Arrivals(Mutex::new(Vec::new()));
    let stop = AtomicBool::new(false);
    let (a_ns, b_ns) = (a.ns.path(), b.ns.path());
    let mut deny_ms = Vec::new();
    let mut allow_ms = Vec::new();
    let sent = std::thread::scope(|s| -> Result<u64> {
        let receiver = s.spawn(|| -> Result<()> {
            util::enter_netns(&b_ns)?;
            let sock = RawSock::open("eth0")?;
            sock.set_rcv_timeout(50);
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                let Some(n) = sock.recv(&mut buf) else {
                    continue;
                };
                // Ethernet, IPv4 (20 bytes), UDP from a, the probe payload.
                let f = &buf[..n];
                if n >= 42 + 16
                    && f[12..14] == [0x08, 0x00]
                    && f[23] == 17
                    && f[26..30] == A_IP
                    && &f[42..46] == MAGIC
                {
                    let sent = u64::from_be_bytes(f[46..54].try_into().unwrap());
                    arrivals.0.lock().unwrap().push(sent);
                }
            }
            Ok(())
        });
        let sender = s.spawn(|| -> Result<u64> {
            util::enter_netns(&a_ns)?;
            let sock = RawSock::open("eth0")?;
            let mut seq = 0u64;
            let mut next = now_ns();
            while !stop.load(Ordering::Relaxed) {
                let t = now_ns();
                let mut payload = Vec::with_capacity(20);
                payload.extend_from_slice(MAGIC);
                payload.extend_from_slice(&t.to_be_bytes());
                payload.extend_from_slice(&seq.to_be_bytes());
                // Every probe its own flow; ports never repeat in a run.
                let sport = 1024 + (seq % 60_000) as u16;
                let dport = 20_000 + (seq / 60_000) as u16;
                let frame = util::udp4(b_mac, a_mac, A_IP, B_IP, sport, dport, &payload);
                sock.send(&frame)?;
                seq += 1;
                next += PROBE_INTERVAL.as_nanos() as u64;
                let now = now_ns();
                if next > now {
                    sleep(Duration::from_nanos(next - now));
                }
            }
            Ok(seq)
        });
        let result = (|| -> Result<()> {
            // The stream passes before any policy.
            wait_passing(&arrivals, now_ns())?;
            for trial in 0..opts.trials {
                let t = now_ns();
                node.write_config("deny.yaml", DENY);
                let last = wait_stopped(&arrivals, t)?;
                deny_ms.push(last.saturating_sub(t) as f64 / 1e6);
                let t = now_ns();
                node.write_config("allow.yaml", ALLOW);
                let first = wait_passing(&arrivals, t)?;
                allow_ms.push((first - t) as f64 / 1e6);
                eprintln!(
                    "bench:   trial {trial}: deny enforced after {:.2} ms, allow after {:.2} ms",
                    deny_ms[trial], allow_ms[trial]
                );
                node.remove_config("deny.yaml");
                node.remove_config("allow.yaml");
                sleep(Duration::from_millis(100));
                wait_passing(&arrivals, now_ns())?;
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let sent = sender.join().map_err(|_| anyhow!("sender panicked"))??;
        receiver
            .join()
            .map_err(|_| anyhow!("receiver panicked"))??;
        result?;
        Ok(sent)
    })?;
    let denied = node.drops(drop_reason::POLICY_DENIED_INGRESS);
    if denied == 0 {
        bail!("no probe was counted as policy_denied_ingress");
    }
    let received = arrivals.0.lock().unwrap().len();

    let mut md = format!(
        "The agent (release build, file source) serves VMs a and b on one network. a sends b \
         a UDP probe every {} ms from a raw socket, each a new flow (its own ports, so no \
         conntrack entry of an allowed flow carries it through a change) and carrying its \
         send time; a raw socket on b's eth0 records what the data path delivered. \
         {} trials, each: **deny**: a NetworkPolicy selecting b with `policyTypes: \
         [Ingress]` and no rule is written into the config dir (write + rename, as a \
         ConfigMap update); the figure is the time from the write to the send time of the \
         last probe that still arrived. **allow**: a second policy allowing UDP from a is \
         written; the figure is the time from the write to the send time of the first probe \
         that arrived. Then both files are removed and the stream passes again. Resolution: \
         the probe interval.\n\n",
        PROBE_INTERVAL.as_millis(),
        opts.trials,
    );
    md.push_str("| change | p50 ms | p90 ms | min ms | max ms |\n|---|---|---|---|---|\n");
    for (name, v) in [
        ("deny: isolating policy written → probes dropped", &deny_ms),
        ("allow: allowing policy written → probes pass", &allow_ms),
    ] {
        let s = util::summary(v);
        md.push_str(&format!(
            "| {name} | {} | {} | {} | {} |\n",
            fmt(percentile(v, 50.0)),
            fmt(percentile(v, 90.0)),
            fmt(s.min),
            fmt(s.max)
        ));
    }
    md.push_str(&format!(
        "\nProbes sent {sent}, received {received}, counted as `policy_denied_ingress` \
         {denied}. The config-write → map-update figure of section 7 (the same file \
         notification, one Attachment) is the part of this that is not policy.\n"
    ));
    Ok(Section {
        title: "13. Policy update to enforcement latency".into(),
        markdown: md,
        bars: Vec::<Bar>::new(),
    })
}
