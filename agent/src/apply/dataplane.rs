//! Loads the eBPF object, pins its maps under the bpffs root, attaches the
//! VM-port program to ports through pinned tcx links, and writes the maps.
//!
//! Layout under the root:
//!   maps/v{MAP_LAYOUT_VERSION}/<map name>   pinned maps (bpftool-readable)
//!   links/vm_port-<ifindex>                pinned tcx links (ingress), one per port
//!   links/vm_from_stack-<ifindex>          and their egress links (what the
//!                                          node's stack sends meets policy)
//! Links and maps are pinned, so the data path keeps forwarding while the
//! agent is down; a new agent adopts them.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CString,
    fs, io,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapInfo, MapType, PerCpuArray, PerCpuValues},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        tc::{SchedClassifierLink, TcAttachOptions},
        xdp::XdpLink,
    },
};
use tracing::{debug, info, warn};
use vmpath_common::{
    AddrInfo, AddrKey, Endpoint, EndpointKey, FloodList, LearnedIp, LearnedMac, MAP_LAYOUT_VERSION,
    MapDef, MapKind, NetworkInfo, PortInfo, PortStats, SlowPath, drop_reason, map_names, maps,
    prog_names,
};

pub mod batch;
mod cut_over;
pub mod debug_log;
mod meter;
mod north_south;
pub use north_south::{UplinkXdp, XDP_PORTS_RECHECK};
mod overlay;
pub mod policy;
pub mod port_filters;
pub mod service;

use crate::plan::{Plan, layered::Layered};
use aya::maps::lpm_trie::LpmTrie;
use vmpath_common::{NatEntry, NatKey, RoutedAddr, SnatConfig, Subnet4, Subnet6};

/// The eBPF object built by build.rs: the data path.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vmpath"));

/// The bench's baseline programs (`bench_noop`, `bench_redirect_peer` and
/// their map `vmpb_peer`), a separate object built beside the data path's;
/// only a build with the `bench` feature (the test crate's bench) embeds it.
#[cfg(feature = "bench")]
static BENCH_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vmpath-bench"));

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// The kernel's map type of a shape in `vmpath_common::maps`.
fn map_type(kind: MapKind) -> MapType {
    match kind {
        MapKind::Hash => MapType::Hash,
        MapKind::LruHash => MapType::LruHash,
        MapKind::Array => MapType::Array,
        MapKind::PerCpuArray => MapType::PerCpuArray,
        MapKind::LpmTrie => MapType::LpmTrie,
        MapKind::ProgramArray => MapType::ProgramArray,
        MapKind::XskMap => MapType::XskMap,
        MapKind::RingBuf => MapType::RingBuf,
    }
}

pub fn maps_dir(root: &Path) -> PathBuf {
    root.join("maps").join(format!("v{MAP_LAYOUT_VERSION}"))
}

pub fn links_dir(root: &Path) -> PathBuf {
    root.join("links")
}

/// Where each of `prog_names::PORT_PROGRAMS` attaches on a port: `vm_port`
/// at ingress, every frame the VM sends; `vm_from_stack` at egress, what
/// the node's stack sends it.
const PORT_PROGRAMS: [(&str, TcAttachType); 2] = [
    (prog_names::PORT_PROGRAMS[0], TcAttachType::Ingress),
    (prog_names::PORT_PROGRAMS[1], TcAttachType::Egress),
];

fn link_pin(root: &Path, prog_name: &str, ifindex: u32) -> PathBuf {
    links_dir(root).join(format!("{prog_name}-{ifindex}"))
}

/// Makes sure `root` is on a bpffs, mounting one there if not.
pub fn ensure_bpffs(root: &Path) -> Result<()> {
    // The usual place; on a fresh host it may not be mounted yet (and
    // nothing can be created below an unmounted /sys/fs/bpf).
    let standard = Path::new("/sys/fs/bpf");
    if root.starts_with(standard) && standard.is_dir() && !is_bpffs(standard)? {
        mount_bpffs(standard)?;
    }
    fs::create_dir_all(root).with_context(|| format!("creating bpffs root {}", root.display()))?;
    if !is_bpffs(root)? {
        mount_bpffs(root)?;
    }
    Ok(())
}

fn mount_bpffs(at: &Path) -> Result<()> {
    let src = CString::new("bpf")?;
    let target = CString::new(at.as_os_str().as_encoded_bytes())?;
    // SAFETY: `src` and `target` are NUL-terminated CStrings alive for the call; a
    // null `data` pointer is allowed (bpffs takes no options).
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            src.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("mounting bpffs on {}", at.display()));
    }
    info!(at = %at.display(), "mounted bpffs");
    Ok(())
}

fn is_bpffs(path: &Path) -> Result<bool> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: `statfs` is a C struct of integers; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated CString alive for the call and `st` a live,
    // writable `statfs`.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error())
            .with_context(|| format!("statfs {}", path.display()));
    }
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// Loads every tail-called program (`vm_port` is loaded already) and
/// puts each in its slot of `vmp_progs`, from the contract's one table.
fn load_tail_calls(ebpf: &mut Ebpf) -> Result<()> {
    let mut fds = Vec::new();
    for (slot, name) in vmpath_common::tail_call::PROGRAMS {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the object"))?
            .try_into()?;
        if prog.fd().is_err() {
            retry_eagain(|| prog.load())
                .with_context(|| format!("loading (verifying) the {name} program"))?;
        }
        fds.push((slot, prog.fd()?.try_clone()?));
    }
    let map = ebpf
        .map_mut(map_names::PROGS)
        .ok_or_else(|| anyhow!("map {} missing", map_names::PROGS))?;
    let mut progs: aya::maps::ProgramArray<&mut MapData> = map.try_into()?;
    for (slot, fd) in &fds {
        progs.set(*slot, fd, 0)?;
    }
    Ok(())
}

/// Runs a program load, again when the verifier gave up with EAGAIN: it
/// does so when the loading thread has a signal pending, which a busy
/// multi-threaded agent (or test harness) may well have. libbpf retries the
/// same way.
pub(crate) fn retry_eagain(
    mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>,
) -> Result<(), aya::programs::ProgramError> {
    let mut tries = 0;
    loop {
        match load() {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && tries < 5 =>
            {
                tries += 1;
            }
            other => return other,
        }
    }
}

/// Unpins maps of other layout versions (`maps/v<N>`, N != this build's):
/// programs still attached keep theirs alive until their links are swapped.
fn retire_old_layouts(root: &Path) -> Result<()> {
    let current = maps_dir(root);
    for entry in fs::read_dir(root.join("maps"))? {
        let dir = entry?.path();
        if dir != current && dir.is_dir() {
            warn!(dir = %dir.display(), "retiring maps of another layout version");
            fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    Ok(())
}

/// Checks a pinned map's shape against what this build expects.
fn check_pinned(path: &Path, spec: &MapDef) -> Result<bool> {
    if !path.exists() {
        return Ok(false);
    }
    let info = MapInfo::from_pin(path)
        .with_context(|| format!("opening pinned map {}", path.display()))?;
    let map_type = info.map_type()?;
    if map_type != self::map_type(spec.kind)
        || info.key_size() != spec.key_size
        || info.value_size() != spec.value_size
        || info.max_entries() != spec.max_entries
    {
        bail!(
            "pinned map {} is {:?} key {} value {} max {}, this build needs {:?} key {} value {} max {}",
            path.display(),
            map_type,
            info.key_size(),
            info.value_size(),
            info.max_entries(),
            self::map_type(spec.kind),
            spec.key_size,
            spec.value_size,
            spec.max_entries
        );
    }
    Ok(true)
}

/// Typed handles on the pinned maps.
pub struct Maps {
    pub ports: HashMap<MapData, u32, PortInfo>,
    pub endpoints: HashMap<MapData, EndpointKey, Endpoint>,
    pub addresses: HashMap<MapData, AddrKey, AddrInfo>,
    pub networks: HashMap<MapData, u32, NetworkInfo>,
    pub flood: HashMap<MapData, u32, FloodList>,
    pub drops: PerCpuArray<MapData, u64>,
    /// Indexed by port id.
    pub port_stats: PerCpuArray<MapData, PortStats>,
    pub learned_macs: HashMap<MapData, u32, LearnedMac>,
    pub learned_ips: HashMap<MapData, AddrKey, LearnedIp>,
    /// Ports that used an address another port holds (`learn::ip`).
    pub learn_conflicts: HashMap<MapData, AddrKey, LearnedIp>,
    pub routed: HashMap<MapData, AddrKey, RoutedAddr>,
    pub subnets4: LpmTrie<MapData, Subnet4, u32>,
    pub subnets6: LpmTrie<MapData, Subnet6, u32>,
    /// Subnets resolved over the overlay -> network id.
    pub resolve_prefixes: LpmTrie<MapData, vmpath_common::ResolvePrefix, u32>,
    /// What the uplink resolved over the overlay (`resolve`).
    pub resolved: HashMap<MapData, AddrKey, vmpath_common::ResolvedAddr>,
    pub snat_config: Array<MapData, SnatConfig>,
    pub snat_out: HashMap<MapData, NatKey, NatEntry>,
    pub snat_in: HashMap<MapData, NatKey, NatEntry>,
    pub snat_quota: HashMap<MapData, u32, u32>,
    /// Flows opened from outside to VMs on SNAT networks (`vmp_inbound`).
    pub inbound: HashMap<MapData, NatKey, vmpath_common::InboundFlow>,
    /// The IPv6 twins of the four maps above.
    pub snat6_out: HashMap<MapData, vmpath_common::NatKey6, vmpath_common::NatEntry6>,
    pub snat6_in: HashMap<MapData, vmpath_common::NatKey6, vmpath_common::NatEntry6>,
    pub snat6_quota: HashMap<MapData, [u8; 16], u32>,
    pub inbound6: HashMap<MapData, vmpath_common::NatKey6, vmpath_common::InboundFlow>,
    /// Next hops kept for routed egress (`vmp_hops4`, `vmp_hops6`).
    pub hops4: HashMap<MapData, vmpath_common::HopKey4, vmpath_common::KeptHop>,
    pub hops6: HashMap<MapData, vmpath_common::HopKey6, vmpath_common::KeptHop>,
    pub port_ids: HashMap<MapData, u32, u32>,
    pub slow: Array<MapData, SlowPath>,
    pub flood_remote: HashMap<MapData, u32, vmpath_common::RemoteFloodList>,
    pub overlay: Array<MapData, vmpath_common::OverlayConfig>,
    pub overlay_stats: PerCpuArray<MapData, PortStats>,
    /// VXLAN source learning: (network, MAC) -> the node's VTEP, written by
    /// the data path, pruned by the agent.
    pub remote_learned: HashMap<MapData, EndpointKey, vmpath_common::RemoteLearned>,
    /// IPv6 underlay: VTEP handle -> the node's IPv6 address, and back.
    pub vtep6: HashMap<MapData, [u8; 4], [u8; 16]>,
    pub vtep6_ids: HashMap<MapData, [u8; 16], [u8; 4]>,
    pub reach_nodes: HashMap<MapData, [u8; 4], u32>,
    /// Live migration: target ports whose VM spoke (`vm_migrate`).
    pub migrated: HashMap<MapData, u32, vmpath_common::MigrationEvent>,
    /// Slow-path limits per port id (`meter`).
    pub slow_limits: Array<MapData, vmpath_common::SlowLimits>,
    /// Slow-path token buckets per port id, per CPU (`meter`).
    pub slow_meter: PerCpuArray<MapData, vmpath_common::SlowMeter>,
    /// NetworkPolicy (`policy`).
    pub policy_endpoints: Array<MapData, vmpath_common::PolicyEndpoint>,
    pub policy_ipcache: LpmTrie<MapData, vmpath_common::IdentityPrefix, u32>,
    pub policy_rules: LpmTrie<MapData, vmpath_common::PolicyRuleKey, u32>,
    pub policy_flows: HashMap<MapData, vmpath_common::PolicyFlowKey, vmpath_common::PolicyFlow>,
    pub policy_stats: PerCpuArray<MapData, vmpath_common::PolicyStats>,
    pub policy_hits: PerCpuArray<MapData, u64>,
    pub policy_flood: HashMap<MapData, u32, FloodList>,
    /// ClusterIP Services (`service`).
    pub services: HashMap<MapData, vmpath_common::ServiceKey, vmpath_common::Service>,
    pub service_backends:
        HashMap<MapData, vmpath_common::ServiceBackendKey, vmpath_common::ServiceBackend>,
    pub service_flows: HashMap<MapData, vmpath_common::ServiceFlowKey, vmpath_common::ServiceFlow>,
    pub service_config: Array<MapData, u32>,
    pub service_stats: PerCpuArray<MapData, vmpath_common::ServiceStats>,
    /// IPv6 ClusterIP Services: the same shapes with 16-byte addresses.
    pub services6: HashMap<MapData, vmpath_common::ServiceKey6, vmpath_common::Service>,
    pub service6_backends:
        HashMap<MapData, vmpath_common::ServiceBackendKey, vmpath_common::ServiceBackend6>,
    /// Uplink XDP: ports it may redirect to (ifindex -> port id).
    pub xdp_ports: HashMap<MapData, u32, u32>,
    /// Uplink XDP: what it did, per CPU (`xdp_stat` slots).
    pub uplink_xdp_stats: PerCpuArray<MapData, u64>,
}

fn open_map(root: &Path, name: &str) -> Result<Map> {
    let path = maps_dir(root).join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening pinned map {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

impl Maps {
    /// Opens the pinned maps (also used by the CLI and tests).
    pub fn open(root: &Path) -> Result<Self> {
        Ok(Maps {
            ports: open_map(root, map_names::PORTS)?.try_into()?,
            endpoints: open_map(root, map_names::ENDPOINTS)?.try_into()?,
            addresses: open_map(root, map_names::ADDRESSES)?.try_into()?,
            networks: open_map(root, map_names::NETWORKS)?.try_into()?,
            flood: open_map(root, map_names::FLOOD)?.try_into()?,
            drops: open_map(root, map_names::DROPS)?.try_into()?,
            port_stats: open_map(root, map_names::PORT_STATS)?.try_into()?,
            learned_macs: open_map(root, map_names::LEARNED_MACS)?.try_into()?,
            learned_ips: open_map(root, map_names::LEARNED_IPS)?.try_into()?,
            learn_conflicts: open_map(root, map_names::LEARN_CONFLICTS)?.try_into()?,
            routed: open_map(root, map_names::ROUTED)?.try_into()?,
            subnets4: open_map(root, map_names::SUBNETS4)?.try_into()?,
            subnets6: open_map(root, map_names::SUBNETS6)?.try_into()?,
            resolve_prefixes: open_map(root, map_names::RESOLVE_PREFIXES)?.try_into()?,
            resolved: open_map(root, map_names::RESOLVED)?.try_into()?,
            snat_config: open_map(root, map_names::SNAT_CONFIG)?.try_into()?,
            snat_out: open_map(root, map_names::SNAT_OUT)?.try_into()?,
            snat_in: open_map(root, map_names::SNAT_IN)?.try_into()?,
            snat_quota: open_map(root, map_names::SNAT_QUOTA)?.try_into()?,
            inbound: open_map(root, map_names::INBOUND)?.try_into()?,
            snat6_out: open_map(root, map_names::SNAT6_OUT)?.try_into()?,
            snat6_in: open_map(root, map_names::SNAT6_IN)?.try_into()?,
            snat6_quota: open_map(root, map_names::SNAT6_QUOTA)?.try_into()?,
            inbound6: open_map(root, map_names::INBOUND6)?.try_into()?,
            hops4: open_map(root, map_names::HOPS4)?.try_into()?,
            hops6: open_map(root, map_names::HOPS6)?.try_into()?,
            port_ids: open_map(root, map_names::PORT_IDS)?.try_into()?,
            slow: open_map(root, map_names::SLOW)?.try_into()?,
            flood_remote: open_map(root, map_names::FLOOD_REMOTE)?.try_into()?,
            overlay: open_map(root, map_names::OVERLAY)?.try_into()?,
            overlay_stats: open_map(root, map_names::OVERLAY_STATS)?.try_into()?,
            remote_learned: open_map(root, map_names::REMOTE_LEARNED)?.try_into()?,
            vtep6: open_map(root, map_names::VTEP6)?.try_into()?,
            vtep6_ids: open_map(root, map_names::VTEP6_IDS)?.try_into()?,
            reach_nodes: open_map(root, map_names::REACH_NODES)?.try_into()?,
            migrated: open_map(root, map_names::MIGRATED)?.try_into()?,
            slow_limits: open_map(root, map_names::SLOW_LIMITS)?.try_into()?,
            slow_meter: open_map(root, map_names::SLOW_METER)?.try_into()?,
            policy_endpoints: open_map(root, map_names::POLICY_ENDPOINTS)?.try_into()?,
            policy_ipcache: open_map(root, map_names::POLICY_IPCACHE)?.try_into()?,
            policy_rules: open_map(root, map_names::POLICY_RULES)?.try_into()?,
            policy_flows: open_map(root, map_names::POLICY_FLOWS)?.try_into()?,
            policy_stats: open_map(root, map_names::POLICY_STATS)?.try_into()?,
            policy_hits: open_map(root, map_names::POLICY_HITS)?.try_into()?,
            policy_flood: open_map(root, map_names::POLICY_FLOOD)?.try_into()?,
            services: open_map(root, map_names::SERVICES)?.try_into()?,
            service_backends: open_map(root, map_names::SERVICE_BACKENDS)?.try_into()?,
            service_flows: open_map(root, map_names::SERVICE_FLOWS)?.try_into()?,
            service_config: open_map(root, map_names::SERVICE_CONFIG)?.try_into()?,
            service_stats: open_map(root, map_names::SERVICE_STATS)?.try_into()?,
            services6: open_map(root, map_names::SERVICES6)?.try_into()?,
            service6_backends: open_map(root, map_names::SERVICE6_BACKENDS)?.try_into()?,
            xdp_ports: open_map(root, map_names::XDP_PORTS)?.try_into()?,
            uplink_xdp_stats: open_map(root, map_names::UPLINK_XDP_STATS)?.try_into()?,
        })
    }

    /// Drop counters summed over CPUs, indexed by `drop_reason`.
    pub fn drop_counts(&self) -> Result<Vec<u64>> {
        (0..drop_reason::COUNT)
            .map(|i| Ok(self.drops.get(&i, 0)?.iter().sum()))
            .collect()
    }

    /// The uplink XDP program's counters summed over CPUs, indexed by
    /// `xdp_stat`.
    pub fn uplink_xdp_counts(&self) -> Result<Vec<u64>> {
        (0..vmpath_common::xdp_stat::COUNT)
            .map(|i| Ok(self.uplink_xdp_stats.get(&i, 0)?.iter().sum()))
            .collect()
    }

    /// The counters of the port at `ifindex` summed over CPUs (None: no
    /// such port is programmed).
    pub fn port_stats(&self, ifindex: u32) -> Result<Option<PortStats>> {
        let port = match self.ports.get(&ifindex, 0) {
            Ok(p) => p,
            Err(aya::maps::MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(Some(sum_per_cpu(&self.port_stats.get(&port.port_id, 0)?)))
    }
}

impl Maps {
    /// The NetworkPolicy counters of the port at `ifindex`, summed over
    /// CPUs (None: no such port is programmed).
    pub fn policy_stats(&self, ifindex: u32) -> Result<Option<vmpath_common::PolicyStats>> {
        let port = match self.ports.get(&ifindex, 0) {
            Ok(p) => p,
            Err(aya::maps::MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(Some(policy::policy_stats(
            &self.policy_stats,
            port.port_id,
        )?))
    }

    /// The Service counters of the port at `ifindex`, summed over CPUs
    /// (None: no such port is programmed).
    pub fn service_stats(&self, ifindex: u32) -> Result<Option<vmpath_common::ServiceStats>> {
        let port = match self.ports.get(&ifindex, 0) {
            Ok(p) => p,
            Err(aya::maps::MapError::KeyNotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        Ok(Some(service::service_stats(
            &self.service_stats,
            port.port_id,
        )?))
    }

    /// New flows each policy allowed (by policy index), summed over CPUs.
    pub fn policy_hits(&self, policies: usize) -> Result<Vec<u64>> {
        (0..policies.min(vmpath_common::MAX_POLICIES as usize) as u32)
            .map(|i| Ok(self.policy_hits.get(&i, 0)?.iter().sum()))
            .collect()
    }
}

/// Per-CPU counters summed.
pub fn sum_per_cpu(values: &PerCpuValues<PortStats>) -> PortStats {
    values.iter().fold(PortStats::default(), |mut acc, s| {
        acc.add(s);
        acc
    })
}

/// Swaps `$prog` into the link a previous agent pinned at `$pin` (no gap in
/// forwarding); `true` when adopted. A stale pin is removed so the caller
/// attaches anew. A macro because aya's link types share no trait for
/// `attach_to_link`.
macro_rules! adopt_pinned {
    ($prog:expr, $link:ty, $pin:expr, $prog_name:expr, $ifname:expr) => {{
        let prog = &mut *$prog;
        let adopted = $pin.exists()
            && match PinnedLink::from_pin($pin)
                .map_err(anyhow::Error::from)
                .and_then(|p| Ok(<$link>::try_from(FdLink::from(p))?))
                .and_then(|link| Ok(prog.attach_to_link(link)?))
            {
                Ok(id) => {
                    // The pin keeps the link; our fd is not needed.
                    drop(prog.take_link(id)?);
                    debug!(prog = $prog_name, ifname = $ifname, "adopted pinned link");
                    true
                }
                Err(e) => {
                    warn!(prog = $prog_name, ifname = $ifname, error = %e, "stale link pin, attaching anew");
                    let _ = fs::remove_file($pin);
                    false
                }
            };
        adopted
    }};
}

/// The sizes of the maps the operator sizes (`vmpath_common::sized`), by
/// map name; a map not named keeps its size in `maps::ALL`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapSizes(BTreeMap<&'static str, u32>);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MapSizeError {
    #[error("map {0} is not sized at start (sizable: {1})")]
    NotSizable(String, String),
    #[error("{name}: {value} entries is outside {min}..={max}")]
    OutOfRange {
        name: &'static str,
        value: u32,
        min: u32,
        max: u32,
    },
}

impl MapSizes {
    /// `name` (one of `vmpath_common::sized::MAPS`) holds `entries`.
    pub fn set(&mut self, name: &str, entries: u32) -> Result<(), MapSizeError> {
        use vmpath_common::sized;
        let Some(def) = sized::MAPS.iter().find(|d| d.name == name) else {
            let names: Vec<_> = sized::MAPS.iter().map(|d| d.name).collect();
            return Err(MapSizeError::NotSizable(name.to_string(), names.join(", ")));
        };
        if !(sized::MIN..=sized::MAX).contains(&entries) {
            return Err(MapSizeError::OutOfRange {
                name: def.name,
                value: entries,
                min: sized::MIN,
                max: sized::MAX,
            });
        }
        self.0.insert(def.name, entries);
        Ok(())
    }

    /// The shape the agent loads `def` with.
    pub fn shape(&self, def: &MapDef) -> MapDef {
        MapDef {
            max_entries: self.0.get(def.name).copied().unwrap_or(def.max_entries),
            ..*def
        }
    }
}

pub struct Dataplane {
    root: PathBuf,
    /// Kept alive so the program stays loaded while we attach it.
    ebpf: Ebpf,
    maps: Maps,
    /// Ports carrying this agent's programs, by ifindex; `None` until the
    /// first apply has read the node's port filters back (`sweep_ports`).
    attached: Option<BTreeSet<u32>>,
    /// The bench's baseline programs, once `load_bench_baselines` ran.
    #[cfg(feature = "bench")]
    bench: Option<Ebpf>,
    /// What this agent wrote to `vmp_slow_limits`, by port id.
    slow_limits_written: BTreeMap<u32, vmpath_common::SlowLimits>,
    /// What this agent wrote to `vmp_pol_ep`, by port id.
    policy_written: BTreeMap<u32, vmpath_common::PolicyEndpoint>,
    /// What this agent last wrote to the cluster-sized maps only it
    /// writes: the next apply writes the difference (`None`: it reads the
    /// maps back first).
    written: Option<Written>,
    /// What this agent last wrote to the Service maps, as `written`.
    services_written: Option<service::WrittenServices>,
    /// Native XDP on the uplink (`--uplink-xdp`).
    uplink_xdp: north_south::UplinkXdp,
}

impl Dataplane {
    /// Loads the object with every map pinned under `root` (adopting pins a
    /// previous agent left, after checking their shape).
    pub fn open(root: &Path) -> Result<Self> {
        Self::open_sized(root, &MapSizes::default())
    }

    /// `open` with the operator's map sizes (`--max-endpoints`, ...). A
    /// pinned map of another size is replaced like one of another layout.
    pub fn open_sized(root: &Path, sizes: &MapSizes) -> Result<Self> {
        ensure_bpffs(root)?;
        let maps_dir = maps_dir(root);
        fs::create_dir_all(&maps_dir)?;
        fs::create_dir_all(links_dir(root))?;
        let mut loader = EbpfLoader::new();
        let mut paths = Vec::new();
        // What each pinned map must look like before it is adopted.
        for def in &maps::ALL {
            let spec = &sizes.shape(def);
            if spec.max_entries != def.max_entries {
                loader.map_max_entries(spec.name, spec.max_entries);
            }
            let path = maps_dir.join(spec.name);
            match check_pinned(&path, spec) {
                Ok(true) => info!(map = spec.name, "adopting pinned map"),
                Ok(false) => {}
                Err(e) => {
                    // Another layout (an upgrade changed it): the running
                    // programs keep the old map through their own
                    // reference until their links get this build's
                    // programs; this build starts a new map, which the
                    // first reconcile fills from the config and the claims
                    // before any link is swapped.
                    warn!(map = spec.name, "{e:#}; replacing it");
                    fs::remove_file(&path)
                        .with_context(|| format!("unpinning {}", path.display()))?;
                }
            }
            paths.push((spec.name, path));
        }
        retire_old_layouts(root)?;
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .load(EBPF_OBJECT)
            .context("loading the eBPF object")?;
        for name in [
            prog_names::VM_PORT,
            prog_names::VM_FROM_STACK,
            prog_names::VXLAN_FROM_STACK,
            prog_names::SLOW_RETURN,
        ] {
            let prog: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the object"))?
                .try_into()?;
            retry_eagain(|| prog.load())
                .with_context(|| format!("loading (verifying) the {name} program"))?;
        }
        let slow_rx: &mut Xdp = ebpf
            .program_mut(prog_names::SLOW_RX)
            .ok_or_else(|| anyhow!("program {} missing from the object", prog_names::SLOW_RX))?
            .try_into()?;
        retry_eagain(|| slow_rx.load())
            .with_context(|| format!("loading (verifying) the {} program", prog_names::SLOW_RX))?;
        let uplink: &mut SchedClassifier = ebpf
            .program_mut(prog_names::UPLINK)
            .ok_or_else(|| anyhow!("program {} missing from the object", prog_names::UPLINK))?
            .try_into()?;
        retry_eagain(|| uplink.load()).context("loading (verifying) the uplink program")?;
        let uplink_xdp: &mut Xdp = ebpf
            .program_mut(prog_names::UPLINK_XDP)
            .ok_or_else(|| anyhow!("program {} missing from the object", prog_names::UPLINK_XDP))?
            .try_into()?;
        retry_eagain(|| uplink_xdp.load())
            .context("loading (verifying) the uplink's XDP program")?;
        overlay::load(&mut ebpf)?;
        load_tail_calls(&mut ebpf)?;
        // Debug events are a help, not a function: the data path runs
        // without their reader.
        if let Err(e) = debug_log::start(&mut ebpf) {
            warn!("{e:#}; data path debug events will not be shown");
        }
        let maps = Maps::open(root)?;
        Ok(Dataplane {
            root: root.to_path_buf(),
            ebpf,
            maps,
            attached: None,
            #[cfg(feature = "bench")]
            bench: None,
            slow_limits_written: BTreeMap::new(),
            policy_written: BTreeMap::new(),
            written: None,
            services_written: None,
            uplink_xdp: north_south::UplinkXdp::Off,
        })
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    /// The kernel ids of the programs this instance loaded, by name.
    pub fn program_ids(&self) -> BTreeMap<String, u32> {
        self.ebpf
            .programs()
            .filter_map(|(name, p)| Some((name.to_string(), p.info().ok()?.id())))
            .collect()
    }

    /// Direct map access, for fixture tests that program entries by hand.
    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// The loaded VM-port program (fixture tests run it with BPF_PROG_TEST_RUN).
    pub fn vm_port(&self) -> Result<&SchedClassifier> {
        Ok(self
            .ebpf
            .program(prog_names::VM_PORT)
            .ok_or_else(|| anyhow!("program {} missing", prog_names::VM_PORT))?
            .try_into()?)
    }

    /// A tc program of the object (or, with the `bench` feature, of the
    /// loaded baselines) by name, if loaded (`cargo xtask bench`).
    pub fn program(&self, name: &str) -> Option<&SchedClassifier> {
        #[cfg(feature = "bench")]
        if let Some(p) = self.bench.as_ref().and_then(|b| b.program(name)) {
            return p.try_into().ok();
        }
        self.ebpf.program(name)?.try_into().ok()
    }

    /// `program`, mutable (to attach or detach it).
    pub fn program_mut(&mut self, name: &str) -> Option<&mut SchedClassifier> {
        #[cfg(feature = "bench")]
        if let Some(b) = self.bench.as_mut()
            && b.program(name).is_some()
        {
            return b.program_mut(name)?.try_into().ok();
        }
        self.ebpf.program_mut(name)?.try_into().ok()
    }

    /// Loads the bench's baseline object and its programs; every frame
    /// `bench_redirect_peer` sees goes to `peer` (a veth's host side).
    #[cfg(feature = "bench")]
    pub fn load_bench_baselines(&mut self, peer: u32) -> Result<()> {
        let mut ebpf = Ebpf::load(BENCH_OBJECT).context("loading the bench object")?;
        for name in ["bench_noop", "bench_redirect_peer"] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("{name} missing from the bench object"))?
                .try_into()?;
            p.load().with_context(|| format!("loading {name}"))?;
        }
        let map = ebpf
            .map_mut("vmpb_peer")
            .ok_or_else(|| anyhow!("vmpb_peer missing from the bench object"))?;
        Array::<_, u32>::try_from(map)?.set(0, peer, 0)?;
        self.bench = Some(ebpf);
        Ok(())
    }

    /// The loaded object (the bench attaches its programs by hand).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// The eBPF object the agent embeds (the bench loads extra instances).
    pub fn object() -> &'static [u8] {
        EBPF_OBJECT
    }

    /// The bench's baseline object (never loaded by the agent).
    #[cfg(feature = "bench")]
    pub fn bench_object() -> &'static [u8] {
        BENCH_OBJECT
    }

    /// Attaches the VM port's programs (`PORT_PROGRAMS`) to `ifname` as tc
    /// filters (`port_filters`: why not tcx), or swaps them into the
    /// filters a previous agent left. Egress first: from the moment
    /// `vm_port` forwards the VM's frames, what the node's stack sends it
    /// meets its policy. An older agent's tcx link on the port (a pin) goes
    /// once the filter is there: no frame meets the port without a program.
    fn attach_port(&mut self, ifname: &str, ifindex: u32) -> Result<()> {
        for (prog_name, at) in PORT_PROGRAMS.iter().rev() {
            let prog: &mut SchedClassifier = self
                .ebpf
                .program_mut(prog_name)
                .ok_or_else(|| anyhow!("program {prog_name} missing"))?
                .try_into()?;
            let replaced = port_filters::attach(prog, ifname, *at)?;
            let pin = link_pin(&self.root, prog_name, ifindex);
            if pin.exists() {
                fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
                info!(
                    prog = prog_name,
                    ifname, "an older agent's tcx link replaced by a tc filter"
                );
            }
            if replaced {
                debug!(prog = prog_name, ifname, "swapped into the port's filter");
            } else {
                info!(prog = prog_name, ifname, "attached");
            }
        }
        Ok(())
    }

    /// After a start: the ports that carry port programs, read back from
    /// the kernel. Those the plan has no port for lose them (an endpoint
    /// removed while no agent ran); so do older agents' port pins. The
    /// planned ports are attached next, which swaps this agent's programs
    /// into their filters.
    fn sweep_ports(&mut self, plan: &Plan) -> Result<()> {
        let carrying = port_filters::ports_carrying().context("reading the ports' filters back")?;
        for ifindex in carrying.into_iter().filter(|i| !plan.ports.contains_key(i)) {
            port_filters::detach_port(ifindex)?;
            info!(ifindex, "detached port (no endpoint)");
        }
        for (ifindex, pin) in self.pinned_links()? {
            if !plan.ports.contains_key(&ifindex) {
                fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
                info!(ifindex, pin = %pin.display(), "removed an older agent's port link");
            }
        }
        Ok(())
    }

    /// Attaches the tc program `prog_name` at tcx ingress of `ifname` through
    /// a link pinned at `pin`; when a previous agent left that pin, swaps
    /// this agent's program into the existing link (no gap in forwarding).
    pub fn attach_tcx(&mut self, prog_name: &str, ifname: &str, pin: &Path) -> Result<()> {
        self.attach_tcx_at(prog_name, ifname, pin, TcAttachType::Ingress)
    }

    /// `attach_tcx` at `at` (ingress or egress).
    pub(crate) fn attach_tcx_at(
        &mut self,
        prog_name: &str,
        ifname: &str,
        pin: &Path,
        at: TcAttachType,
    ) -> Result<()> {
        let prog: &mut SchedClassifier = self
            .ebpf
            .program_mut(prog_name)
            .ok_or_else(|| anyhow!("program {prog_name} missing"))?
            .try_into()?;
        if adopt_pinned!(prog, SchedClassifierLink, pin, prog_name, ifname) {
            return Ok(());
        }
        let id = prog
            .attach_with_options(ifname, at, TcAttachOptions::TcxOrder(LinkOrder::default()))
            .with_context(|| format!("attaching {prog_name} at tcx {at:?} on {ifname}"))?;
        let link = prog.take_link(id)?;
        let fd_link: FdLink = link
            .try_into()
            .map_err(|e| anyhow!("tcx link is not an fd link: {e}"))?;
        fd_link
            .pin(pin)
            .with_context(|| format!("pinning link {}", pin.display()))?;
        info!(prog = prog_name, ifname, "attached");
        Ok(())
    }

    /// Attaches the XDP program `prog_name` on `ifname` in native (driver)
    /// mode through a pinned bpf link, or adopts the pinned one. Aya falls
    /// back to netlink attachment silently; that cannot be pinned, so it is
    /// refused here.
    pub fn attach_xdp(&mut self, prog_name: &str, ifname: &str, pin: &Path) -> Result<()> {
        let prog: &mut Xdp = self
            .ebpf
            .program_mut(prog_name)
            .ok_or_else(|| anyhow!("program {prog_name} missing"))?
            .try_into()?;
        if adopt_pinned!(prog, XdpLink, pin, prog_name, ifname) {
            return Ok(());
        }
        let id = prog
            .attach(ifname, XdpMode::Driver)
            .with_context(|| format!("attaching {prog_name} (native XDP) on {ifname}"))?;
        let link = prog.take_link(id)?;
        let fd_link: FdLink = link.try_into().map_err(|e| {
            anyhow!("XDP on {ifname} attached through netlink, not a bpf link (cannot pin): {e}")
        })?;
        fd_link
            .pin(pin)
            .with_context(|| format!("pinning link {}", pin.display()))?;
        info!(prog = prog_name, ifname, "attached native XDP");
        Ok(())
    }

    /// Pinned links of ports (`PORT_PROGRAMS`), with the ifindex of each.
    fn pinned_links(&self) -> Result<Vec<(u32, PathBuf)>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(links_dir(&self.root))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().to_string();
            if let Some(idx) = prog_names::port_pin_ifindex(&name) {
                out.push((idx, entry.path()));
            }
        }
        Ok(out)
    }

    /// Makes the kernel match `plan`: maps first (so a newly attached port
    /// finds its entries), then links; only what the plan no longer wants is
    /// removed.
    pub fn apply(&mut self, plan: &Plan) -> Result<()> {
        let mut phases = crate::sys::phases::Phases::start("apply");
        // Defense in depth: an interface may have been renamed or replaced
        // since the plan was made; nothing is written before this passes.
        for (ifindex, port) in &plan.ports {
            if !self.attached.as_ref().is_some_and(|a| a.contains(ifindex)) {
                crate::resolve::port_eligibility::recheck(*ifindex, &port.ifname)
                    .map_err(|e| anyhow!("refusing to attach: {e}"))?;
            }
        }
        phases.mark("recheck");
        // Only what changed since the last apply is written; the data path
        // never writes these maps, so nothing is read back (at 10,000 VMs a
        // read-back is tens of thousands of syscalls a round). Taken before
        // anything is written: after a failure, all is read back.
        let last = self.written.take();
        self.apply_north_south(plan, last.as_ref().map(|w| &w.routed))?;
        phases.mark("north_south");
        self.apply_overlay(plan)?;
        phases.mark("overlay");
        sync_since(
            &mut self.maps.networks,
            last.as_ref().map(|w| &w.networks),
            &plan.networks,
        )?;
        sync_since(
            &mut self.maps.flood,
            last.as_ref().map(|w| &w.flood),
            &plan.flood,
        )?;
        sync_layered_since(
            &mut self.maps.addresses,
            last.as_ref().map(|w| &w.addresses),
            &plan.addresses,
        )?;
        // The data path writes endpoints too (a migration's cut-over): the
        // entries it may have written are read back and made to match the
        // plan, except for a cut-over this round's plan predates
        // (`cut_over`); the others as the maps above.
        let ports: BTreeMap<u32, PortInfo> = plan.ports.iter().map(|(k, p)| (*k, p.info)).collect();
        let pending = pending_endpoints(&ports);
        let endpoints = match last.as_ref().and_then(|w| w.endpoints.as_ref()) {
            Some(written) => sync_endpoints_since(
                &mut self.maps.endpoints,
                written,
                &plan.endpoints,
                &pending,
                &ports,
            ),
            None => sync_keeping(
                &mut self.maps.endpoints,
                &plan.endpoints.to_map(),
                |k, want, have| cut_over::endpoint_moved(k, want, have, &ports),
            ),
        };
        self.written = Some(Written {
            networks: plan.networks.clone(),
            flood: plan.flood.clone(),
            addresses: plan.addresses.clone(),
            routed: plan.routed.clone(),
            // Unknown after a failed write: read back whole next time.
            endpoints: endpoints.is_ok().then(|| WrittenEndpoints {
                entries: plan.endpoints.clone(),
                pending,
            }),
        });
        endpoints?;
        let port_ids: BTreeMap<u32, u32> = plan
            .ports
            .iter()
            .map(|(ifindex, p)| (p.info.port_id, *ifindex))
            .collect();
        // Counters survive reconciles and restarts: a slot is zeroed only
        // when its port id goes to another port or to none (`vmp_port_ids`
        // says which port held it).
        let held: BTreeMap<u32, u32> = self.maps.port_ids.iter().filter_map(|r| r.ok()).collect();
        // One value per possible CPU, as the kernel lays them out.
        let nr_cpus = aya::util::nr_cpus().map_err(|(m, e)| anyhow!("{m}: {e}"))?;
        let zero = vec![PortStats::default(); nr_cpus];
        let reset: std::collections::BTreeSet<u32> = held
            .keys()
            .chain(port_ids.keys())
            .filter(|id| held.get(id) != port_ids.get(id))
            .copied()
            .collect();
        if !reset.is_empty() {
            use aya::maps::IterableMap as _;
            let slots: Vec<(u32, &[PortStats])> = reset.iter().map(|id| (*id, &zero[..])).collect();
            batch::update_batch_per_cpu(self.maps.port_stats.map(), &slots, batch::BPF_ANY)
                .context("zeroing port counters")?;
        }
        phases.mark("maps");
        self.apply_slow_limits(plan, &reset)?;
        phases.mark("slow_limits");
        self.apply_policy(plan)?;
        phases.mark("policy");
        self.apply_services(plan)?;
        phases.mark("services");
        sync_keeping(&mut self.maps.ports, &ports, |_, want, have| {
            cut_over::port_resumed(want, have)
        })?;
        sync(&mut self.maps.port_ids, &port_ids)?;
        self.refresh_xdp_ports(plan)?;
        phases.mark("ports");

        let mut attached = match self.attached.take() {
            Some(a) => a,
            None => {
                self.sweep_ports(plan)?;
                BTreeSet::new()
            }
        };
        // Kept even when an attach fails: what is attached stays known.
        let mut result = Ok(());
        for (ifindex, port) in &plan.ports {
            if !attached.contains(ifindex) {
                if let Err(e) = self.attach_port(&port.ifname, *ifindex) {
                    result = Err(e);
                    break;
                }
                attached.insert(*ifindex);
            }
        }
        let gone: Vec<u32> = attached
            .iter()
            .copied()
            .filter(|i| !plan.ports.contains_key(i))
            .collect();
        for ifindex in gone {
            match port_filters::detach_port(ifindex) {
                Ok(_) => {
                    attached.remove(&ifindex);
                    info!(ifindex, "detached port");
                }
                Err(e) if result.is_ok() => result = Err(e.into()),
                Err(_) => {}
            }
        }
        self.attached = Some(attached);
        result?;
        phases.mark("attach");
        // What was learned on a port that is gone (or got its MAC) is stale.
        let stale_macs: Vec<u32> = self
            .maps
            .learned_macs
            .iter()
            .filter_map(|r| r.ok())
            .filter(|(k, v)| {
                plan.ports.get(k).is_none_or(|p| {
                    p.info.flags & vmpath_common::PORT_F_MAC_KNOWN != 0 && p.info.mac != v.mac
                })
            })
            .map(|(k, _)| k)
            .collect();
        for k in stale_macs {
            let _ = self.maps.learned_macs.remove(&k);
        }
        let stale_ips: Vec<AddrKey> = self
            .maps
            .learned_ips
            .iter()
            .filter_map(|r| r.ok())
            .filter(|(k, v)| {
                // Still routed on to the VM that used it (it moved to
                // another node): kept while the plan routes it so.
                let routed_on = plan
                    .routed
                    .get(&AddrKey::from_ip(0, k.ip()))
                    .is_some_and(|r| r.ifindex == 0 && r.vm_mac == v.mac);
                !plan.ports.contains_key(&v.ifindex) && !routed_on
            })
            .map(|(k, _)| k)
            .collect();
        for k in stale_ips {
            let _ = self.maps.learned_ips.remove(&k);
        }
        // MACs learned from the overlay that the config now places itself
        // (or whose node left the network).
        self.prune_remote_learned(plan);
        phases.mark("prune");
        phases.log();
        Ok(())
    }
}

/// What [`Dataplane::apply`] last wrote to the maps only the agent writes,
/// and to `vmp_endpoints`.
struct Written {
    networks: BTreeMap<u32, NetworkInfo>,
    flood: BTreeMap<u32, FloodList>,
    /// Other nodes' layer shared with the plan: kept for a reference
    /// count, compared by identity.
    addresses: Layered<AddrKey, AddrInfo>,
    /// `vmp_routed`, the same way (the data path only reads it).
    routed: Layered<AddrKey, vmpath_common::RoutedAddr>,
    endpoints: Option<WrittenEndpoints>,
}

/// `vmp_endpoints` as the agent last wrote it, and the VMs its pending
/// target ports were for (`vm_migrate` may have written those since).
struct WrittenEndpoints {
    entries: Layered<EndpointKey, Endpoint>,
    pending: BTreeSet<EndpointKey>,
}

/// The endpoints `vm_migrate` may write: the VMs of pending target ports.
fn pending_endpoints(ports: &BTreeMap<u32, PortInfo>) -> BTreeSet<EndpointKey> {
    ports
        .values()
        .filter(|p| p.flags & vmpath_common::PORT_F_PENDING != 0)
        .map(|p| EndpointKey::new(p.network, p.mac))
        .collect()
}

/// `vmp_endpoints` against what this agent wrote last: only the entries
/// whose value changed are written or removed, and of the map only the
/// entries the data path may have written since are read: those of VMs
/// that were or are migrating (`learn_move` repoints an entry with a
/// `migrate_to`) and of pending target ports, then and now (`vm_migrate`).
/// A full read-back at 10,000 VMs was up to a fifth of a round's time.
fn sync_endpoints_since(
    map: &mut HashMap<MapData, EndpointKey, Endpoint>,
    written: &WrittenEndpoints,
    want: &Layered<EndpointKey, Endpoint>,
    pending: &BTreeSet<EndpointKey>,
    ports: &BTreeMap<u32, PortInfo>,
) -> Result<()> {
    let moving = |e: &Endpoint| e.migrate_to != [0; 4];
    let moving_in = |m: &BTreeMap<EndpointKey, Endpoint>| {
        m.iter()
            .filter(|(_, e)| moving(e))
            .map(|(k, _)| *k)
            .collect::<Vec<_>>()
    };
    // Keys whose entry in force moves, then or now: the layers' moving
    // entries (other nodes' layer once when it is the same), those a
    // local entry hides left out.
    let mut candidates = moving_in(&written.entries.local);
    candidates.extend(moving_in(&want.local));
    candidates.extend(moving_in(&written.entries.remote));
    if !std::sync::Arc::ptr_eq(&written.entries.remote, &want.remote) {
        candidates.extend(moving_in(&want.remote));
    }
    let volatile: BTreeSet<EndpointKey> = candidates
        .into_iter()
        .filter(|k| written.entries.get(k).is_some_and(moving) || want.get(k).is_some_and(moving))
        .chain(written.pending.iter().copied())
        .chain(pending.iter().copied())
        .collect();
    // Of the volatile entries, what the map holds now (absent: none).
    let held: BTreeMap<EndpointKey, Endpoint> = volatile
        .iter()
        .filter_map(|k| map.get(k, 0).ok().map(|e| (*k, e)))
        .collect();
    // A volatile entry is written unless the map holds it already (or a
    // cut-over this plan predates).
    let stale = |k: &EndpointKey, v: &Endpoint| {
        held.get(k)
            .is_none_or(|h| h != v && !cut_over::endpoint_moved(k, v, h, ports))
    };
    let mut gone: Vec<EndpointKey> = Vec::new();
    let mut changed: Vec<(EndpointKey, Endpoint)> = Vec::new();
    // The others where what was written and what is wanted differ: the
    // local layers' keys alone while other nodes' layer is the same.
    for (k, _, now) in written.entries.changes(want) {
        if volatile.contains(&k) {
            continue;
        }
        match now {
            Some(v) => changed.push((k, *v)),
            None => gone.push(k),
        }
    }
    for k in &volatile {
        match want.get(k) {
            Some(v) if stale(k, v) => changed.push((*k, *v)),
            Some(_) => {}
            None if held.contains_key(k) => gone.push(*k),
            None => {}
        }
    }
    gone.sort_unstable();
    changed.sort_unstable_by_key(|(k, _)| *k);
    write_difference_sized(map, &gone, &changed, want.len(), || want.to_map())
}

/// As [`sync_since`] for a map of this node's entries over other nodes'
/// ([`Layered`]): while other nodes' layer is the one last written, only
/// the local layers' keys are compared.
fn sync_layered_since<K, V>(
    map: &mut HashMap<MapData, K, V>,
    last: Option<&Layered<K, V>>,
    want: &Layered<K, V>,
) -> Result<()>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    let Some(last) = last else {
        return sync(map, &want.to_map());
    };
    let (mut gone, mut changed) = (Vec::new(), Vec::new());
    for (k, _, now) in last.changes(want) {
        match now {
            Some(v) => changed.push((k, *v)),
            None => gone.push(k),
        }
    }
    write_difference_sized(map, &gone, &changed, want.len(), || want.to_map())
}

impl Dataplane {
    /// The next apply reads every map back rather than trust what this
    /// agent wrote last (the periodic resync: a map someone else edited is
    /// repaired there).
    pub fn forget_written(&mut self) {
        self.written = None;
        self.services_written = None;
    }

    /// What this agent wrote last is not known (it forgot, or wrote
    /// nothing yet): the next apply reads every map back, whether or not
    /// the plan changed.
    pub fn read_back_due(&self) -> bool {
        self.written.is_none() || self.services_written.is_none()
    }
}

/// As [`sync`], against `last` (what this agent wrote last) when given:
/// only the entries whose value changed are written or removed, and
/// nothing is read.
fn sync_since<K, V>(
    map: &mut HashMap<MapData, K, V>,
    last: Option<&BTreeMap<K, V>>,
    want: &BTreeMap<K, V>,
) -> Result<()>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    let Some(last) = last else {
        return sync(map, want);
    };
    let (gone, changed) = difference(last, want);
    write_difference(map, &gone, &changed, want)
}

/// What went from `last` to `want` (keys) and what is new or changed
/// there (entries), both in key order: one walk over the two sorted maps
/// together, not a lookup per entry (at 10,000 VMs the address map has
/// 20,000 entries each round).
fn difference<K, V>(last: &BTreeMap<K, V>, want: &BTreeMap<K, V>) -> (Vec<K>, Vec<(K, V)>)
where
    K: Copy + Ord,
    V: Copy + PartialEq,
{
    use crate::sys::sorted::{Side, merge};
    let (mut gone, mut changed) = (Vec::new(), Vec::new());
    merge(
        last.iter(),
        want.iter(),
        |(k, _)| *k,
        |(k, _)| *k,
        |side| match side {
            Side::Old((k, _)) => gone.push(*k),
            Side::New((k, v)) => changed.push((*k, *v)),
            Side::Both((_, was), (k, v)) => {
                if was != v {
                    changed.push((*k, *v));
                }
            }
        },
    );
    (gone, changed)
}

/// Removes `gone` and writes `changed`, the difference the incremental
/// syncs found between what was written last and `want`; more than the
/// map holds is said by name, as a full sync says it.
fn write_difference<K, V>(
    map: &mut HashMap<MapData, K, V>,
    gone: &[K],
    changed: &[(K, V)],
    want: &BTreeMap<K, V>,
) -> Result<()>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    write_difference_sized(map, gone, changed, want.len(), || want.clone())
}

/// As [`write_difference`], with the wanted map's size, and the map
/// itself made only when it is too big for the kernel's.
fn write_difference_sized<K, V>(
    map: &mut HashMap<MapData, K, V>,
    gone: &[K],
    changed: &[(K, V)],
    want_len: usize,
    want: impl FnOnce() -> BTreeMap<K, V>,
) -> Result<()>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    use aya::maps::IterableMap as _;
    if !gone.is_empty() {
        batch::delete_batch(map.map(), gone).context("removing entries the plan dropped")?;
    }
    if !changed.is_empty() {
        // More than the map holds: the full sync says so by name.
        if let Ok(info) = map.map().info()
            && want_len > info.max_entries() as usize
        {
            return sync(map, &want());
        }
        batch::update_batch(map.map(), changed, batch::BPF_ANY)
            .context("writing the entries the plan changed")?;
    }
    Ok(())
}

/// Removes what `want` lacks and writes what differs.
fn sync<K, V>(map: &mut HashMap<MapData, K, V>, want: &BTreeMap<K, V>) -> Result<()>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    sync_keeping(map, want, |_, _, _| false)
}

/// As [`sync`], but an entry whose value in the map `keep(key, wanted,
/// held)` accepts is left as it is (a value the data path wrote that the
/// plan has not caught up with).
fn sync_keeping<K, V>(
    map: &mut HashMap<MapData, K, V>,
    want: &BTreeMap<K, V>,
    keep: impl Fn(&K, &V, &V) -> bool,
) -> Result<()>
where
    K: aya::Pod + Ord,
    V: aya::Pod + PartialEq,
{
    use aya::maps::IterableMap as _;
    // Read in a few syscalls (a batch lookup), not two per entry.
    let have: BTreeMap<K, V> = match batch::lookup_batch::<K, V>(map.map()) {
        Ok(Some(entries)) => entries.into_iter().collect(),
        Ok(None) | Err(_) => map.iter().filter_map(|r| r.ok()).collect(),
    };
    // Batched (BPF_MAP_DELETE_BATCH / BPF_MAP_UPDATE_BATCH): one syscall
    // per MiB of entries rather than one per entry.
    let gone: Vec<K> = have
        .keys()
        .filter(|k| !want.contains_key(k))
        .copied()
        .collect();
    // Which map, for the error: BTF names are what bpftool shows.
    let name = |m: &MapData| {
        m.info()
            .ok()
            .and_then(|i| i.name_as_str().map(str::to_string))
            .unwrap_or_default()
    };
    if !gone.is_empty() {
        batch::delete_batch(map.map(), &gone)
            .with_context(|| format!("removing stale entries of {}", name(map.map())))?;
    }
    let changed: Vec<(K, V)> = want
        .iter()
        .filter(|(k, v)| have.get(k).is_none_or(|h| h != *v && !keep(k, v, h)))
        .map(|(k, v)| (*k, *v))
        .collect();
    if !changed.is_empty() {
        // More than the map holds: say so by name (and by flag, for the
        // maps sized at start) rather than as the kernel's E2BIG halfway.
        if let Ok(info) = map.map().info()
            && want.len() > info.max_entries() as usize
        {
            let n = name(map.map());
            let flag = match n.as_str() {
                map_names::ENDPOINTS => " (raise --max-endpoints)",
                map_names::ADDRESSES => " (raise --max-addresses)",
                _ => "",
            };
            bail!(
                "{n}: {} entries to write, the map holds {}{flag}",
                want.len(),
                info.max_entries()
            );
        }
        batch::update_batch(map.map(), &changed, batch::BPF_ANY)
            .with_context(|| format!("writing entries of {}", name(map.map())))?;
    }
    Ok(())
}

/// Removes every link and map pin under `root`, and the port programs'
/// filters from every interface (`vmpath agent --cleanup`).
pub fn cleanup(root: &Path) -> Result<()> {
    for ifindex in port_filters::ports_carrying().context("reading the ports' filters")? {
        port_filters::detach_port(ifindex)?;
        info!(ifindex, "removed the port programs");
    }
    if !root.exists() {
        return Ok(());
    }
    for dir in [links_dir(root), root.join("maps")] {
        if dir.exists() {
            fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
    }
    Ok(())
}

/// The agent's expectations of the eBPF object, checked against the object
/// this build embeds (no kernel needed).
#[cfg(test)]
mod contract_tests {
    use super::*;
    use vmpath_common::{addr_family, kernel_af};

    fn object() -> aya_obj::Object {
        aya_obj::Object::parse(EBPF_OBJECT).expect("parsing the embedded eBPF object")
    }

    #[test]
    fn every_map_of_the_object_has_the_shape_common_defines() {
        let obj = object();
        for def in &maps::ALL {
            let m = obj
                .maps
                .get(def.name)
                .unwrap_or_else(|| panic!("map {} missing from the object", def.name));
            assert_eq!(
                (m.map_type(), m.key_size(), m.value_size(), m.max_entries()),
                (
                    map_type(def.kind) as u32,
                    def.key_size,
                    def.value_size,
                    def.max_entries
                ),
                "map {}: (type, key, value, max entries) in the object vs vmpath_common::maps",
                def.name
            );
        }
        assert!(
            obj.maps.contains_key(map_names::DEBUG_LOG),
            "aya-log's ring buffer {} missing: the data path's debug events would have nowhere to go",
            map_names::DEBUG_LOG
        );
        // aya-log's ring buffer is per load, never pinned.
        for name in obj
            .maps
            .keys()
            .filter(|n| !n.starts_with('.') && *n != map_names::DEBUG_LOG)
        {
            assert!(
                maps::ALL.iter().any(|d| d.name == name),
                "map {name} of the object has no shape in vmpath_common::maps (the agent would not pin it)"
            );
        }
    }

    #[test]
    fn every_program_the_agent_loads_is_in_the_object_and_no_bench_program_is() {
        let obj = object();
        for name in [
            prog_names::VM_PORT,
            prog_names::VM_FROM_STACK,
            prog_names::UPLINK,
            prog_names::VM_EGRESS,
            prog_names::SLOW_RX,
            prog_names::SLOW_RETURN,
            prog_names::VM_MIGRATE,
            prog_names::VM_REMOTE,
            prog_names::VXLAN_RX,
            prog_names::VM_NEIGH,
            prog_names::VM_FLOOD,
            prog_names::VM_SNAT6_EXT,
        ] {
            assert!(obj.programs.contains_key(name), "program {name} missing");
        }
        let bench: Vec<_> = obj
            .programs
            .keys()
            .filter(|n| n.starts_with("bench_"))
            .collect();
        assert!(
            bench.is_empty(),
            "bench programs in the production object: {bench:?}"
        );
        assert!(!obj.maps.contains_key("vmpb_peer"));
    }

    /// `bpf_fib_lookup` and `bpf_redirect_neigh` take the kernel's address
    /// families; `AddrKey` carries its own tag. Both were once named
    /// `AF_INET` with different values.
    #[test]
    fn kernel_address_families_are_the_kernels_and_differ_from_the_key_tags() {
        assert_eq!(i32::from(kernel_af::AF_INET), libc::AF_INET);
        assert_eq!(i32::from(kernel_af::AF_INET6), libc::AF_INET6);
        let v4 = std::net::IpAddr::from([192, 0, 2, 1]);
        let v6: std::net::IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(AddrKey::from_ip(7, v4).family, addr_family::IPV4);
        assert_eq!(AddrKey::from_ip(7, v6).family, addr_family::IPV6);
        assert_eq!(AddrKey::from_ip(7, v4).ip(), v4);
        assert_eq!(AddrKey::from_ip(7, v6).ip(), v6);
    }
}

/// `vmp_endpoints`' incremental sync on a real map (needs root).
#[cfg(test)]
mod endpoint_sync_tests {
    use super::*;
    use vmpath_common::{ENDPOINT_LOCAL, ENDPOINT_REMOTE, PORT_F_PENDING};

    const SOURCE: [u8; 4] = [192, 0, 2, 1];
    const TARGET: [u8; 4] = [192, 0, 2, 2];

    fn key(i: u8) -> EndpointKey {
        EndpointKey::new(100, [0x52, 0x54, 0, 0, 0, i])
    }

    fn remote(at: [u8; 4], migrate_to: [u8; 4], identity: u32) -> Endpoint {
        Endpoint {
            kind: ENDPOINT_REMOTE,
            node_ip4: at,
            migrate_to,
            identity,
            ..Default::default()
        }
    }

    /// Writes `want` as `apply` does after `written`; returns the map.
    fn synced(
        map: &mut HashMap<MapData, EndpointKey, Endpoint>,
        written: &BTreeMap<EndpointKey, Endpoint>,
        want: &BTreeMap<EndpointKey, Endpoint>,
        ports: &BTreeMap<u32, PortInfo>,
    ) -> BTreeMap<EndpointKey, Endpoint> {
        // What was written as other nodes' layer, what is wanted as this
        // node's: every key compared.
        let written = WrittenEndpoints {
            entries: Layered {
                local: BTreeMap::new(),
                remote: std::sync::Arc::new(written.clone()),
            },
            pending: BTreeSet::new(),
        };
        let want: Layered<_, _> = want.iter().map(|(k, v)| (*k, *v)).collect();
        sync_endpoints_since(map, &written, &want, &pending_endpoints(ports), ports).unwrap();
        map.iter().map(|r| r.unwrap()).collect()
    }

    #[test]
    fn only_what_changed_is_written_and_a_cut_over_the_plan_predates_is_kept() {
        let mut map = HashMap::<_, EndpointKey, Endpoint>::create(64, 0)
            .expect("creating a hash map (root?)");
        // vm1 migrating a -> b; vm2 and vm3 still; vm4's target port pending here.
        let pending_vm1 = remote(SOURCE, TARGET, 5);
        let before: BTreeMap<_, _> = [
            (key(1), pending_vm1),
            (key(2), remote(SOURCE, [0; 4], 5)),
            (key(3), remote(SOURCE, [0; 4], 5)),
            (key(4), remote(SOURCE, [0; 4], 5)),
        ]
        .into();
        let ports: BTreeMap<u32, PortInfo> = [(
            12,
            PortInfo {
                port_id: 7,
                network: 100,
                mac: key(4).mac,
                flags: PORT_F_PENDING,
                ..Default::default()
            },
        )]
        .into();
        sync(&mut map, &before).unwrap();
        // The data path: vm1 moved (`learn_move`), vm4 resumed here
        // (`vm_migrate`). Someone else rewrote vm3 (repaired at resync only:
        // the data path never writes a VM that is not moving).
        let moved_vm1 = remote(TARGET, [0; 4], 5);
        let resumed_vm4 = Endpoint {
            kind: ENDPOINT_LOCAL,
            ifindex: 12,
            port_id: 7,
            ..Default::default()
        };
        map.insert(key(1), moved_vm1, 0).unwrap();
        map.insert(key(4), resumed_vm4, 0).unwrap();
        map.insert(key(3), remote(TARGET, [0; 4], 9), 0).unwrap();
        // A round planned before either move, with new identities for vm1,
        // vm2 and vm4 (a policy edit), and vm3 unchanged.
        let mut want = before.clone();
        for k in [1, 2, 4] {
            want.get_mut(&key(k)).unwrap().identity = 6;
        }
        let got = synced(&mut map, &before, &want, &ports);
        assert_eq!(got[&key(1)], moved_vm1, "vm1's move undone");
        assert_eq!(got[&key(4)], resumed_vm4, "vm4's resumption undone");
        assert_eq!(got[&key(2)], want[&key(2)], "vm2's change not written");
        assert_eq!(got[&key(3)], remote(TARGET, [0; 4], 9), "vm3 was read back");
        // The next round saw both moves; vm2 left the cluster.
        let mut next = want.clone();
        next.insert(key(1), remote(TARGET, [0; 4], 6));
        next.insert(
            key(4),
            Endpoint {
                identity: 6,
                ..resumed_vm4
            },
        );
        next.remove(&key(2));
        let active: BTreeMap<u32, PortInfo> = [(
            12,
            PortInfo {
                flags: 0,
                ..ports[&12]
            },
        )]
        .into();
        let got = synced(&mut map, &want, &next, &active);
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[&key(1)], next[&key(1)]);
        assert_eq!(got[&key(4)], next[&key(4)]);
    }

    /// Over the same other nodes' layer, only this node's keys are
    /// compared and written: a local entry going uncovers the remote one
    /// it hid, a move the data path made is kept, and an entry nothing
    /// local touched is not read back (an edit by someone else waits for
    /// the resync).
    #[test]
    fn over_the_same_remote_layer_only_local_keys_are_written() {
        let mut map = HashMap::<_, EndpointKey, Endpoint>::create(64, 0)
            .expect("creating a hash map (root?)");
        let local = |ifindex: u32| Endpoint {
            kind: ENDPOINT_LOCAL,
            ifindex,
            port_id: ifindex,
            ..Default::default()
        };
        let remote_layer = std::sync::Arc::new(BTreeMap::from([
            (key(1), remote(SOURCE, [0; 4], 0)),
            (key(2), remote(SOURCE, [0; 4], 0)),
            (key(3), remote(SOURCE, TARGET, 0)),
        ]));
        let written = WrittenEndpoints {
            entries: Layered {
                local: BTreeMap::from([(key(2), local(5))]),
                remote: remote_layer.clone(),
            },
            pending: BTreeSet::new(),
        };
        sync(&mut map, &written.entries.to_map()).unwrap();
        // Someone else edits vm1; the data path moves vm3 to its target.
        map.insert(key(1), remote(TARGET, [0; 4], 9), 0).unwrap();
        let moved_vm3 = remote(TARGET, [0; 4], 0);
        map.insert(key(3), moved_vm3, 0).unwrap();
        // vm2 leaves this node (its remote entry shows again), vm4 comes.
        let want = Layered {
            local: BTreeMap::from([(key(4), local(6))]),
            remote: remote_layer,
        };
        let ports = BTreeMap::new();
        sync_endpoints_since(&mut map, &written, &want, &BTreeSet::new(), &ports).unwrap();
        let got: BTreeMap<EndpointKey, Endpoint> = map.iter().map(|r| r.unwrap()).collect();
        assert_eq!(got[&key(2)], remote(SOURCE, [0; 4], 0), "the hidden entry");
        assert_eq!(got[&key(4)], local(6));
        assert_eq!(got[&key(3)], moved_vm3, "the move undone");
        assert_eq!(got[&key(1)], remote(TARGET, [0; 4], 9), "vm1 was read back");
        assert_eq!(got.len(), 4);
    }
}

#[cfg(test)]
mod difference_tests {
    use super::*;

    #[test]
    fn the_difference_names_what_went_and_what_is_new_or_changed() {
        // (what was written, what is wanted, gone, changed)
        type Row = (
            &'static [(u8, u8)],
            &'static [(u8, u8)],
            &'static [u8],
            &'static [(u8, u8)],
        );
        let rows: [Row; 6] = [
            (&[], &[], &[], &[]),
            (&[], &[(1, 1), (2, 2)], &[], &[(1, 1), (2, 2)]),
            (&[(1, 1), (2, 2)], &[], &[1, 2], &[]),
            (&[(1, 1), (2, 2)], &[(1, 1), (2, 2)], &[], &[]),
            (
                &[(1, 1), (3, 3), (5, 5)],
                &[(2, 2), (3, 4), (5, 5), (6, 6)],
                &[1],
                &[(2, 2), (3, 4), (6, 6)],
            ),
            (&[(1, 1), (9, 9)], &[(5, 5)], &[1, 9], &[(5, 5)]),
        ];
        for (last, want, gone, changed) in rows {
            let map = |e: &[(u8, u8)]| e.iter().copied().collect::<BTreeMap<u8, u8>>();
            let got = difference(&map(last), &map(want));
            assert_eq!(
                got,
                (gone.to_vec(), changed.to_vec()),
                "{last:?} -> {want:?}"
            );
        }
    }
}
