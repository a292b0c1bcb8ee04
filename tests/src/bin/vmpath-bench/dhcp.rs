//! Figure group 4: DHCP through the slow path.
use anyhow::{Result, bail};

use crate::report::Section;

pub struct Options {
    pub runs: usize,
    pub seconds: u64,
}

pub fn run(_opts: &Options) -> Result<Section> {
    bail!("not built yet")
}
