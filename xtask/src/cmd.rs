//! Running external tools. Every failure names the step it belongs to and
//! the command line, so a broken setup is obvious from the message.

use std::{
    io,
    process::{Command, ExitStatus, Stdio},
};

use anyhow::{Context as _, Result, bail};

/// The command line as a shell would show it.
pub fn display(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| quote(&a.to_string_lossy()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=+,@%^".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn spawn_error(step: &str, cmd: &Command, e: io::Error) -> anyhow::Error {
    let hint = if e.kind() == io::ErrorKind::NotFound {
        " (not installed? `cargo xtask setup` installs the tools)"
    } else {
        ""
    };
    anyhow::Error::new(e).context(format!(
        "{step}: could not start `{}`{hint}",
        cmd.get_program().to_string_lossy()
    ))
}

/// Runs `cmd` with inherited stdio; fails unless it exits 0.
pub fn run(step: &str, cmd: &mut Command) -> Result<()> {
    let status = status(step, cmd)?;
    if !status.success() {
        bail!("{step}: `{}` failed ({status})", display(cmd));
    }
    Ok(())
}

/// Runs `cmd` with inherited stdio and returns how it exited.
pub fn status(step: &str, cmd: &mut Command) -> Result<ExitStatus> {
    cmd.status().map_err(|e| spawn_error(step, cmd, e))
}

/// Runs `cmd` and returns its stdout; fails (with its stderr) unless it
/// exits 0.
pub fn output(step: &str, cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| spawn_error(step, cmd, e))?;
    if !out.status.success() {
        bail!(
            "{step}: `{}` failed ({}): {}",
            display(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("{step}: output of `{}`", display(cmd)))
}

/// Stdout of `cmd` if it could be started and exited 0; stderr is discarded.
pub fn probe(cmd: &mut Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Fails with a clear message unless this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub fn require_root(what: &str) -> Result<()> {
    if !is_root() {
        bail!(
            "{what} needs root (network namespaces, eBPF, bpffs); run it as root, e.g. `sudo -E env PATH=$PATH {what}`"
        );
    }
    Ok(())
}
