//! Fair service of one batch of slow-path frames: ports take turns, one
//! frame each per round, up to a per-port quota per batch, within a
//! node-wide budget of frames per second. A port within its data-path rate
//! then cannot push the others' frames behind its own, and the agent's CPU
//! for the slow path stays bounded whatever arrives.

use std::{
    collections::{BTreeMap, VecDeque},
    time::{Duration, Instant},
};

/// Frames read from the receive ring at once.
pub const BATCH: u32 = 256;
/// Frames one port is served per batch; the rest of its frames in the
/// batch are dropped (`over_quota`).
pub const PORT_QUOTA: usize = 16;
/// Frames the slow path serves per second by default, node-wide (the
/// agent's `--slowpath-serve-rate`). Far above what the ports' data-path
/// limits let through in normal life (every port of a node booting at once
/// is served within seconds); reached only when many ports flood at their
/// limit together. At the cost the bench measures (about 30000 frames/s
/// on one core) that is about a third of a core.
pub const DEFAULT_SERVE_RATE: u64 = 10_000;
/// The budget's burst: a fifth of a second's worth.
const BURST_SECONDS_DIV: u64 = 5;

/// What to do with each frame of a batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Indices of frames to serve, in order: round-robin over ports.
    pub serve: Vec<usize>,
    /// Over their port's quota for this batch.
    pub over_quota: Vec<usize>,
    /// Over the node-wide budget.
    pub over_budget: Vec<usize>,
}

/// Orders a batch by port (`port_of` each frame; None: no port, served
/// first so it is counted where it belongs) within `budget` frames.
pub fn schedule(ports: &[Option<u16>], budget: usize) -> Schedule {
    let mut out = Schedule::default();
    let mut queues: BTreeMap<Option<u16>, VecDeque<usize>> = BTreeMap::new();
    for (i, port) in ports.iter().enumerate() {
        let q = queues.entry(*port).or_default();
        if q.len() < PORT_QUOTA {
            q.push_back(i);
        } else {
            out.over_quota.push(i);
        }
    }
    // Rounds: one frame of each port with frames left.
    loop {
        let mut any = false;
        for q in queues.values_mut() {
            if let Some(i) = q.pop_front() {
                any = true;
                if out.serve.len() < budget {
                    out.serve.push(i);
                } else {
                    out.over_budget.push(i);
                }
            }
        }
        if !any {
            break;
        }
    }
    out
}

/// The node-wide serving budget: a token bucket over wall time.
pub struct Budget {
    rate: u64,
    burst: u64,
    tokens: u64,
    last: Instant,
}

impl Budget {
    /// `rate` frames per second (at least 1).
    pub fn new(rate: u64) -> Self {
        let rate = rate.max(1);
        let burst = (rate / BURST_SECONDS_DIV).max(BATCH as u64);
        Budget {
            rate,
            burst,
            tokens: burst,
            last: Instant::now(),
        }
    }

    /// Frames that may be served now.
    pub fn available(&mut self) -> usize {
        let now = Instant::now();
        let elapsed = now.duration_since(self.last).as_nanos();
        let earned = (elapsed * u128::from(self.rate) / 1_000_000_000) as u64;
        if earned > 0 {
            self.tokens = self.tokens.saturating_add(earned).min(self.burst);
            // Keep the remainder: advance by exactly what was earned.
            self.last += Duration::from_nanos(earned * 1_000_000_000 / self.rate);
            if self.tokens == self.burst {
                self.last = now;
            }
        }
        self.tokens as usize
    }

    pub fn spend(&mut self, n: usize) {
        self.tokens = self.tokens.saturating_sub(n as u64);
    }

    /// How long to sleep before serving again (zero: serve now). An empty
    /// budget waits for a port's quota worth, not a single frame's, so a
    /// saturated slow path wakes up rarely.
    pub fn wait(&mut self) -> Duration {
        if self.available() > 0 {
            Duration::ZERO
        } else {
            Duration::from_nanos(PORT_QUOTA as u64 * 1_000_000_000 / self.rate)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooding_port_cannot_push_a_quiet_one_back() {
        // 200 frames of port 1, then one of port 2 at the end of the batch.
        let mut ports = vec![Some(1); 200];
        ports.push(Some(2));
        let s = schedule(&ports, 1000);
        // Port 2's frame is served in the first round, second.
        assert_eq!(s.serve[..2], [0, 200]);
        assert_eq!(s.serve.len(), PORT_QUOTA + 1);
        assert_eq!(s.over_quota.len(), 200 - PORT_QUOTA);
        assert!(s.over_budget.is_empty());
    }

    #[test]
    fn ports_take_turns() {
        let ports = [Some(1), Some(1), Some(1), Some(2), Some(2), Some(3)];
        let s = schedule(&ports, 1000);
        assert_eq!(s.serve, [0, 3, 5, 1, 4, 2]);
    }

    #[test]
    fn the_budget_cuts_every_port_evenly() {
        let ports = [Some(1), Some(1), Some(1), Some(2), Some(2), Some(2)];
        let s = schedule(&ports, 4);
        assert_eq!(s.serve, [0, 3, 1, 4]);
        assert_eq!(s.over_budget, [2, 5]);
    }

    #[test]
    fn every_frame_is_accounted_once() {
        let ports: Vec<Option<u16>> = (0..BATCH as usize)
            .map(|i| {
                if i % 7 == 0 {
                    None
                } else {
                    Some((i % 5) as u16)
                }
            })
            .collect();
        let s = schedule(&ports, 50);
        let mut all: Vec<usize> = s
            .serve
            .iter()
            .chain(&s.over_quota)
            .chain(&s.over_budget)
            .copied()
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..ports.len()).collect::<Vec<_>>());
        assert_eq!(s.serve.len(), 50);
    }

    #[test]
    fn the_budget_refills_with_time_and_caps_at_its_burst() {
        let mut b = Budget::new(DEFAULT_SERVE_RATE);
        let burst = (DEFAULT_SERVE_RATE / BURST_SECONDS_DIV) as usize;
        assert_eq!(b.available(), burst);
        b.spend(burst);
        assert!(b.available() < burst);
        b.last -= Duration::from_secs(10);
        assert_eq!(b.available(), burst);
    }
}
