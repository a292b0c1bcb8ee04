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
/// Frames the slow path serves per second, node-wide, and at once. Far
/// above what the ports' data-path limits let through in normal life;
/// reached only when many ports flood at their limit together.
pub const SERVE_RATE: u64 = 5_000;
pub const SERVE_BURST: u64 = 1_000;

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
    tokens: u64,
    last: Instant,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            tokens: SERVE_BURST,
            last: Instant::now(),
        }
    }
}

impl Budget {
    /// Frames that may be served now.
    pub fn available(&mut self) -> usize {
        let now = Instant::now();
        let earned = now.duration_since(self.last).as_nanos() as u64 * SERVE_RATE / 1_000_000_000;
        if earned > 0 {
            self.tokens = (self.tokens + earned).min(SERVE_BURST);
            // Keep the remainder: advance by exactly what was earned.
            self.last += Duration::from_nanos(earned * 1_000_000_000 / SERVE_RATE);
            if self.tokens == SERVE_BURST {
                self.last = now;
            }
        }
        self.tokens as usize
    }

    pub fn spend(&mut self, n: usize) {
        self.tokens = self.tokens.saturating_sub(n as u64);
    }

    /// How long until a frame may be served again (zero: now).
    pub fn wait(&mut self) -> Duration {
        if self.available() > 0 {
            Duration::ZERO
        } else {
            Duration::from_nanos(1_000_000_000 / SERVE_RATE)
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
        let mut b = Budget::default();
        assert_eq!(b.available(), SERVE_BURST as usize);
        b.spend(SERVE_BURST as usize);
        assert!(b.available() < SERVE_BURST as usize);
        b.last -= Duration::from_secs(10);
        assert_eq!(b.available(), SERVE_BURST as usize);
    }
}
