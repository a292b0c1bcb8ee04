//! Where a pass spends its time, logged at debug level: the figures to
//! look at when a change takes long to reach the data path.

use std::time::{Duration, Instant};

pub struct Phases {
    what: &'static str,
    last: Instant,
    marks: Vec<(&'static str, Duration)>,
}

impl Phases {
    pub fn start(what: &'static str) -> Self {
        Phases {
            what,
            last: Instant::now(),
            marks: Vec::new(),
        }
    }

    /// Ends the phase called `phase` now.
    pub fn mark(&mut self, phase: &'static str) {
        let now = Instant::now();
        self.marks.push((phase, now - self.last));
        self.last = now;
    }

    /// The phases as `name=1.23ms ...`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .marks
            .iter()
            .map(|(p, d)| format!("{p}={:.2}ms", d.as_secs_f64() * 1e3))
            .collect();
        parts.join(" ")
    }

    pub fn log(&self) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(phases = %self.summary(), "{} timing", self.what);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_every_phase_in_order() {
        let mut p = Phases::start("test");
        p.mark("read");
        p.mark("apply");
        let s = p.summary();
        assert!(s.starts_with("read="), "{s}");
        assert!(s.contains(" apply="), "{s}");
        assert!(s.ends_with("ms"), "{s}");
    }
}
