//! The data path's debug events: aya-log records from the eBPF programs,
//! read from their ring buffer by a thread of their own and logged through
//! `tracing` under the target `vmpath::datapath`. Which events the kernel
//! emits is switched at run time in `vmp_debug` (`vmpath debug datapath`);
//! all are off by default.

use std::{os::fd::AsFd as _, path::Path};

use anyhow::{Context as _, Result, anyhow};
use aya::{
    Ebpf,
    maps::{Array, Map, MapData},
};
use aya_log::EbpfLogger;
use tracing::{info, warn};
use vmpath_common::{drop_reason, map_names};

/// Starts reading the object's debug events. The logger lives in its
/// thread for the life of the agent: dropping it would close the ring
/// buffer the loaded programs write to.
pub fn start(ebpf: &mut Ebpf) -> Result<()> {
    let mut logger = EbpfLogger::init_with_logger(ebpf, ToTracing)
        .map_err(|e| anyhow!("opening the data path's debug ring buffer: {e}"))?;
    std::thread::Builder::new()
        .name("vmpath-dp-log".into())
        .spawn(move || {
            // The logger's ring-buffer fd, duplicated: `flush` needs the
            // logger itself mutably while the loop waits on the fd.
            let fd = match logger.as_fd().try_clone_to_owned() {
                Ok(fd) => fd,
                Err(e) => return warn!("data path debug events: {e}; no events"),
            };
            crate::sys::ring_wait::drain_when_readable(
                fd.as_fd(),
                "data path debug events",
                || logger.flush(),
            );
        })
        .context("starting the data path debug reader")?;
    Ok(())
}

/// Which debug events the data path emits (`GET`/`PUT /v1/debug/datapath`).
pub use vmpath_api::types::Switches;

/// Which events are on, as `vmp_debug` under `bpffs` holds them.
pub fn get(bpffs: &Path) -> Result<Switches> {
    let map = open(bpffs)?;
    Ok(Switches::from_bits(
        map.get(&0, 0).context("reading vmp_debug")?,
    ))
}

/// Switches the data path's debug events to `to`.
pub fn set(bpffs: &Path, to: Switches) -> Result<()> {
    let mut map = open(bpffs)?;
    map.set(0, to.bits(), 0).context("writing vmp_debug")?;
    info!(
        drops = to.drops,
        decisions = to.decisions,
        "data path debug events switched"
    );
    Ok(())
}

fn open(bpffs: &Path) -> Result<Array<MapData, u32>> {
    let path = crate::apply::dataplane::maps_dir(bpffs).join(map_names::DEBUG);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    Ok(Array::try_from(Map::from_map_data(data)?)?)
}

/// aya-log hands each record to a `log::Log`; this one passes it on to
/// `tracing` at info level (the kernel side already filtered what is on).
struct ToTracing;

impl log::Log for ToTracing {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = readable(&record.args().to_string());
        info!(target: "vmpath::datapath", "{line}");
    }

    fn flush(&self) {}
}

/// Names the drop reason in a `drop reason=N ...` event.
pub fn readable(event: &str) -> String {
    let Some(rest) = event.strip_prefix("drop reason=") else {
        return event.to_string();
    };
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let name = digits
        .parse::<usize>()
        .ok()
        .and_then(|n| drop_reason::NAMES.get(n));
    match name {
        Some(name) => format!("drop reason={name}{}", &rest[digits.len()..]),
        None => event.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drop_event_names_its_reason() {
        let n = drop_reason::MAC_SPOOF;
        assert_eq!(
            readable(&format!("drop reason={n} port_id=3")),
            format!("drop reason={} port_id=3", drop_reason::NAMES[n as usize])
        );
    }

    #[test]
    fn switches_round_trip_through_the_map_bits() {
        for drops in [false, true] {
            for decisions in [false, true] {
                let s = Switches { drops, decisions };
                assert_eq!(Switches::from_bits(s.bits()), s);
            }
        }
        assert_eq!(Switches::default().bits(), 0, "all off by default");
    }

    #[test]
    fn other_events_and_unknown_reasons_pass_unchanged() {
        assert_eq!(
            readable("migration cut-over ifindex=7"),
            "migration cut-over ifindex=7"
        );
        assert_eq!(
            readable("drop reason=999 port_id=1"),
            "drop reason=999 port_id=1"
        );
    }
}
