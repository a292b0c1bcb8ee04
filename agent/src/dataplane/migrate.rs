//! The live-migration part of the data path: `vm_migrate` in its
//! tail-call slot, `vm_port` in the slot `vm_migrate` re-enters it by, and
//! the `vmp_migrated` event map the agent polls.

use anyhow::{Context as _, Result, anyhow};
use aya::maps::MapData;
use vmpath_common::{map_names, prog_names, tail_call};

/// Loads `vm_migrate` and fills both slots; `vm_port` is loaded already.
pub(super) fn load(ebpf: &mut aya::Ebpf) -> Result<()> {
    let prog: &mut aya::programs::SchedClassifier = ebpf
        .program_mut(prog_names::VM_MIGRATE)
        .ok_or_else(|| anyhow!("program {} missing", prog_names::VM_MIGRATE))?
        .try_into()?;
    super::retry_eagain(|| prog.load()).context("loading (verifying) the vm_migrate program")?;
    let migrate_fd = prog.fd()?.try_clone()?;
    let vm_port: &aya::programs::SchedClassifier = ebpf
        .program(prog_names::VM_PORT)
        .ok_or_else(|| anyhow!("program {} missing", prog_names::VM_PORT))?
        .try_into()?;
    let port_fd = vm_port.fd()?.try_clone()?;
    let map = ebpf
        .map_mut(map_names::PROGS)
        .ok_or_else(|| anyhow!("map {} missing", map_names::PROGS))?;
    let mut progs: aya::maps::ProgramArray<&mut MapData> = map.try_into()?;
    progs.set(tail_call::VM_MIGRATE, &migrate_fd, 0)?;
    progs.set(tail_call::VM_PORT, &port_fd, 0)?;
    Ok(())
}
