//! Figure group 3: the control plane.
use anyhow::{Result, bail};

use crate::report::Section;

pub struct Options {
    pub runs: usize,
    pub sizes: Vec<usize>,
    pub latency_samples: usize,
}

pub fn run(_opts: &Options) -> Result<Section> {
    bail!("not built yet")
}

pub fn child(_n: usize) -> Result<()> {
    bail!("not built yet")
}
