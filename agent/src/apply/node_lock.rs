//! One agent per node. The agent's very first act is to take an exclusive
//! `flock` on `<state dir>/agent.lock` and on the bpffs root itself, before
//! it opens a map, a link, a socket or the slow path: a second agent (an
//! operator's manual `vmpath agent`, an old binary during an upgrade) then
//! exits at once naming the holder and changes nothing.
//!
//! The kernel drops a flock when its holder dies, so a crashed or SIGTERMed
//! agent releases the node on its own; a deliberate handover (rolling
//! update) starts the new agent with `--lock-wait`, and it proceeds as soon
//! as the old one is gone.
//!
//! The holder (pid, start time, build) is written into the state-dir lock
//! file and, since bpffs holds neither regular files nor symlinks, as the
//! name of the one directory inside `<bpffs root>/agent-lock/`.

use std::{
    collections::BTreeMap,
    fs::{self, File, OpenOptions},
    io::{self, Read as _, Seek as _, Write as _},
    os::{fd::AsRawFd as _, unix::fs::OpenOptionsExt as _},
    path::{Path, PathBuf},
    sync::OnceLock,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

/// The lock file in the state dir.
pub const LOCK_NAME: &str = "agent.lock";
/// The holder's directory in the bpffs root (bpffs names have no '.').
pub const BPFFS_HOLDER: &str = "agent-lock";
const POLL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "another vmpath agent owns this node ({what} {}): {holder}; stop it first, or pass --lock-wait to take over once it exits",
        path.display()
    )]
    Held {
        what: &'static str,
        path: PathBuf,
        holder: String,
    },
    #[error(
        "another vmpath agent still owns this node after waiting {waited:?} ({what} {}): {holder}",
        path.display()
    )]
    WaitedTooLong {
        what: &'static str,
        path: PathBuf,
        holder: String,
        waited: Duration,
    },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// This build: its version, git revision and a hash of the eBPF object it
/// loads, so two binaries with different programs never share a build id.
pub fn build_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        format!(
            "{}+git.{}.ebpf.{:016x}",
            crate::sys::version::version(),
            crate::sys::version::REVISION,
            crate::sys::hash::fnv1a(&[crate::apply::dataplane::Dataplane::object()])
        )
    })
}

/// Who holds the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    /// Seconds since the epoch.
    pub started_unix: u64,
    pub build: String,
}

impl Holder {
    fn me() -> Self {
        Holder {
            pid: std::process::id(),
            started_unix: crate::sys::clock::unix_now(),
            build: build_id().to_string(),
        }
    }

    /// One word (it is also a directory name).
    fn encode(&self) -> String {
        format!(
            "pid={},started={},build={}",
            self.pid, self.started_unix, self.build
        )
    }

    fn decode(s: &str) -> Option<Self> {
        let mut pid = None;
        let mut started = None;
        let mut build = None;
        for part in s.split([',', ' ', '\n']).filter(|p| !p.is_empty()) {
            match part.split_once('=')? {
                ("pid", v) => pid = v.parse().ok(),
                ("started", v) => started = v.parse().ok(),
                ("build", v) => build = Some(v.to_string()),
                _ => {}
            }
        }
        Some(Holder {
            pid: pid?,
            started_unix: started?,
            build: build?,
        })
    }

    fn describe(found: Option<Self>) -> String {
        match found {
            Some(h) => format!(
                "pid {}, started {} ({}), build {}",
                h.pid,
                utc(h.started_unix),
                h.started_unix,
                h.build
            ),
            None => "holder unknown (it has not written its pid yet)".to_string(),
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a unix time (days to civil date after
/// Howard Hinnant's algorithm; no date crate for one line of output).
pub fn utc(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// The held node; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct NodeLock {
    _state: Option<File>,
    _bpffs: File,
    bpffs_holder: PathBuf,
}

impl NodeLock {
    /// Removes the holder record (`--cleanup` removes everything vmpath
    /// left under the bpffs root, this included).
    pub fn remove_bpffs_holder(&self) {
        let _ = fs::remove_dir_all(&self.bpffs_holder);
    }
}

/// Waits up to `wait` for an exclusive flock on `file`; `holder` says who
/// has it meanwhile.
fn flock_within(
    file: &File,
    wait: Duration,
    what: &'static str,
    path: &Path,
    holder: impl Fn() -> Option<Holder>,
) -> Result<(), LockError> {
    let start = Instant::now();
    let mut announced = false;
    loop {
        // SAFETY: flock on a descriptor this function borrows; no memory is
        // passed to the kernel.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(LockError::Io {
                what,
                path: path.to_path_buf(),
                source: err,
            });
        }
        if wait.is_zero() {
            return Err(LockError::Held {
                what,
                path: path.to_path_buf(),
                holder: Holder::describe(holder()),
            });
        }
        if start.elapsed() >= wait {
            return Err(LockError::WaitedTooLong {
                what,
                path: path.to_path_buf(),
                holder: Holder::describe(holder()),
                waited: wait,
            });
        }
        if !announced {
            info!(lock = %path.display(), holder = %Holder::describe(holder()), ?wait, "waiting for the agent that owns this node to exit");
            announced = true;
        }
        std::thread::sleep(POLL);
    }
}

fn read_state_holder(path: &Path) -> Option<Holder> {
    let mut s = String::new();
    File::open(path).ok()?.read_to_string(&mut s).ok()?;
    Holder::decode(&s)
}

/// bpffs refuses names with a '.': the build's dots become '_'.
fn bpffs_name(h: &Holder) -> String {
    h.encode().replace('.', "_")
}

fn read_bpffs_holder(path: &Path) -> Option<Holder> {
    fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok())
        .find_map(|e| Holder::decode(&e.file_name().to_str()?.replace('_', ".")))
}

/// Takes the node: the state-dir lock (unless `state_dir` is `None`, as
/// for `--cleanup`), then the bpffs root's. Nothing else is touched before
/// both are held, except creating the state dir and making sure the bpffs
/// root exists and is a bpffs (idempotent; without it there is nothing to
/// lock).
pub fn acquire(state_dir: Option<&Path>, bpffs: &Path, wait: Duration) -> anyhow::Result<NodeLock> {
    let deadline = Instant::now() + wait;
    let me = Holder::me();
    let state = match state_dir {
        Some(dir) => {
            let io_err = |source| LockError::Io {
                what: "state dir lock",
                path: dir.join(LOCK_NAME),
                source,
            };
            fs::create_dir_all(dir).map_err(io_err)?;
            let path = dir.join(LOCK_NAME);
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o644)
                .open(&path)
                .map_err(io_err)?;
            flock_within(&file, wait, "state dir lock", &path, || {
                read_state_holder(&path)
            })?;
            file.set_len(0).map_err(io_err)?;
            file.rewind().map_err(io_err)?;
            writeln!(file, "{}", me.encode()).map_err(io_err)?;
            Some(file)
        }
        None => None,
    };
    crate::apply::dataplane::ensure_bpffs(bpffs)?;
    let holder_dir = bpffs.join(BPFFS_HOLDER);
    let root = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(bpffs)
        .map_err(|source| LockError::Io {
            what: "bpffs root",
            path: bpffs.to_path_buf(),
            source,
        })?;
    let left = deadline.saturating_duration_since(Instant::now());
    flock_within(&root, left, "bpffs root", bpffs, || {
        read_bpffs_holder(&holder_dir)
    })?;
    let _ = fs::remove_dir_all(&holder_dir);
    if let Err(e) = fs::create_dir_all(holder_dir.join(bpffs_name(&me))) {
        warn!(path = %holder_dir.display(), "cannot record the holder under the bpffs root: {e}");
    }
    info!(pid = me.pid, build = %me.build, bpffs = %bpffs.display(), "this agent owns the node");
    Ok(NodeLock {
        _state: state,
        _bpffs: root,
        bpffs_holder: holder_dir,
    })
}

/// Parses `--lock-wait` values: `30s`, `500ms`, `2m` or plain seconds.
pub fn parse_wait(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m)"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m)")),
    }
}

// --- which programs the pinned links run --------------------------------

/// The programs this agent loaded, by name (set once the data path opens).
static OWN_PROGRAMS: OnceLock<BTreeMap<String, u32>> = OnceLock::new();

/// Programs loaded by builds, by program id: this agent's and, from the
/// state dir, the previous agents', so a link left with an older build's
/// program can be named.
const PROGRAMS_FILE: &str = "programs.json";
/// Older builds' entries kept in the record (they outlive few upgrades).
const KEEP_RECORDED: usize = 256;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Recorded {
    /// Program id -> (program name, build).
    programs: BTreeMap<u32, (String, String)>,
}

/// The running agent's state dir, where the record lives.
static STATE_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Records the programs this agent loaded (for `vmpath status`).
pub fn record_programs(state_dir: &Path, own: BTreeMap<String, u32>) {
    let _ = STATE_DIR.set(state_dir.to_path_buf());
    let path = state_dir.join(PROGRAMS_FILE);
    let mut rec: Recorded = fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    for (name, id) in &own {
        rec.programs
            .insert(*id, (name.clone(), build_id().to_string()));
    }
    while rec.programs.len() > KEEP_RECORDED {
        rec.programs.pop_first();
    }
    let tmp = state_dir.join(format!(".{PROGRAMS_FILE}.tmp"));
    let written = serde_json::to_vec_pretty(&rec)
        .map_err(io::Error::other)
        .and_then(|b| fs::write(&tmp, b))
        .and_then(|()| fs::rename(&tmp, &path));
    if let Err(e) = written {
        warn!(path = %path.display(), "recording the loaded programs: {e}");
    }
    info!(build = build_id(), programs = ?own, "programs loaded");
    let _ = OWN_PROGRAMS.set(own);
}

pub use vmpath_api::types::{LinkProgram, PortProgram, ProgramsStatus};

/// Reads every pinned link under the bpffs root and says whose program
/// each runs.
pub fn programs_status(bpffs: &Path) -> ProgramsStatus {
    use aya::programs::links::PinnedLink;
    let loaded = OWN_PROGRAMS.get().cloned().unwrap_or_default();
    let recorded: Recorded = STATE_DIR
        .get()
        .and_then(|d| fs::read(d.join(PROGRAMS_FILE)).ok())
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let mut links = Vec::new();
    let mut mismatches = Vec::new();
    let mut entries: Vec<PathBuf> = fs::read_dir(crate::apply::dataplane::links_dir(bpffs))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    entries.sort();
    for path in entries {
        let pin = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let info = match PinnedLink::from_pin(&path)
            .map_err(anyhow::Error::from)
            .and_then(|l| Ok(aya::programs::links::FdLink::from(l).info()?))
        {
            Ok(i) => i,
            Err(e) => {
                mismatches.push(format!("{pin}: unreadable: {e}"));
                continue;
            }
        };
        let program_id = info.program_id();
        let current = loaded.values().any(|id| *id == program_id);
        let build = if current {
            Some(build_id().to_string())
        } else {
            recorded.programs.get(&program_id).map(|(_, b)| b.clone())
        };
        if !current && !loaded.is_empty() {
            mismatches.push(format!(
                "{pin}: runs program {program_id} loaded by {}, not this agent's (build {})",
                build.as_deref().unwrap_or("an unknown build"),
                build_id()
            ));
        }
        links.push(LinkProgram {
            pin,
            link_id: info.id(),
            program_id,
            build,
            current,
        });
    }
    let mut ports = Vec::new();
    match crate::sys::tc_filters::on_node() {
        Ok(filters) => {
            for f in filters {
                let current = loaded.values().any(|id| *id == f.program_id);
                let build = if current {
                    Some(build_id().to_string())
                } else {
                    recorded.programs.get(&f.program_id).map(|(_, b)| b.clone())
                };
                let hook = if f.ingress { "ingress" } else { "egress" };
                if !current && !loaded.is_empty() {
                    mismatches.push(format!(
                        "port ifindex {} {hook}: runs program {} loaded by {}, not this agent's (build {})",
                        f.ifindex,
                        f.program_id,
                        build.as_deref().unwrap_or("an unknown build"),
                        build_id()
                    ));
                }
                ports.push(PortProgram {
                    ifindex: f.ifindex,
                    hook: hook.to_string(),
                    name: f.name,
                    program_id: f.program_id,
                    build,
                    current,
                });
            }
        }
        Err(e) => mismatches.push(format!("the ports' filters: unreadable: {e}")),
    }
    ProgramsStatus {
        build: build_id().to_string(),
        loaded,
        links,
        ports,
        mismatches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_round_trips_and_reads_as_a_date() {
        let h = Holder {
            pid: 4242,
            started_unix: 1_780_000_000,
            build: "0.1.0+ebpf.00ff".into(),
        };
        assert_eq!(Holder::decode(&h.encode()), Some(h.clone()));
        let name = bpffs_name(&h);
        assert!(!name.contains('.'), "{name}");
        assert_eq!(Holder::decode(&name.replace('_', ".")), Some(h.clone()));
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_780_000_000), "2026-05-28T20:26:40Z");
        assert!(Holder::describe(Some(h)).contains("pid 4242, started 2026-05-28T20:26:40Z"));
    }

    #[test]
    fn lock_wait_durations() {
        assert_eq!(parse_wait("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_wait("0"), Ok(Duration::ZERO));
        assert_eq!(parse_wait("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_wait("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_wait("soon").is_err());
        assert!(parse_wait("3h").is_err());
    }

    #[test]
    fn a_second_holder_is_refused_naming_the_first_and_waits_when_asked() {
        let dir = std::env::temp_dir().join(format!("vmpath-lock-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join(LOCK_NAME);
        let open = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .unwrap()
        };
        let first = open();
        flock_within(&first, Duration::ZERO, "state dir lock", &path, || None).unwrap();
        fs::write(&path, Holder::me().encode()).unwrap();
        // flock is per open file description: a second open conflicts even
        // in the same process, as a second agent's would.
        let second = open();
        let err = flock_within(&second, Duration::ZERO, "state dir lock", &path, || {
            read_state_holder(&path)
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())) && err.contains(build_id()),
            "{err}"
        );
        let err =
            flock_within(&second, Duration::from_millis(300), "x", &path, || None).unwrap_err();
        assert!(matches!(err, LockError::WaitedTooLong { .. }), "{err}");
        // Released (the holder exits): the waiting one proceeds.
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(first);
        });
        flock_within(&second, Duration::from_secs(10), "x", &path, || None).unwrap();
        release.join().unwrap();
        let _ = fs::remove_dir_all(&dir);
    }
}
