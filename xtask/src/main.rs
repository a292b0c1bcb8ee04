//! Project tasks: `cargo xtask setup | build-ebpf | clippy-ebpf | image | test | demo | bench | modgraph`.
//!
//! Each subcommand lives in its own module; `cmd` runs the tools they shell
//! out to and names the failing step, `cargo` knows the workspace.

mod bench;
mod build_ebpf;
mod cargo;
mod cmd;
mod demo;
mod guest;
mod image;
mod modgraph;
mod setup;
mod test;
mod toolchain;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "vmpath project tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install what the build and the tests need (apt packages, nightly
    /// rust-src and clippy, bpf-linker), mount bpffs and build the test guests
    /// (QEMU, kernel, initramfs). Quick when already done.
    Setup,
    /// Build the eBPF object on its own and print its path.
    BuildEbpf,
    /// Clippy over the eBPF crate (pinned nightly, bpf target), warnings
    /// denied; CI runs it next to the workspace's clippy.
    ClippyEbpf,
    /// Build vmpath's OCI image (static binaries, no base image, no
    /// registry) and the BIRD sidecar's (from the host's bird2 package)
    /// into target/image/, reproducibly; print their references, digests
    /// and sizes.
    Image(image::Options),
    /// Run setup, build the agent and the image and run the whole test
    /// suite (as root).
    Test {
        /// Arguments for `cargo nextest run`: test-name filters and its own
        /// options (`--no-capture`, `-j 1`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Draw which module of a crate uses which (Mermaid, to stdout) and
    /// name its import cycles (stderr).
    Modgraph(modgraph::Options),
    /// Build a one-node topology with three VM namespaces, run the agent
    /// and show traffic through the eBPF data path (as root).
    Demo(demo::Options),
    /// Run the benchmarks (as root; about 6 minutes) and write
    /// BENCHMARKS.md and BENCHMARKS.png at the repository root.
    Bench {
        /// Arguments for the bench (`--runs N`, `--quick`,
        /// `--only progcost,e2e,external,control,dhcp,migration,realmigration`).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The chain on one line, without a backtrace: the messages name
            // the step that failed.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Setup => setup::run(),
        Command::BuildEbpf => build_ebpf::run().map(|path| println!("{}", path.display())),
        Command::ClippyEbpf => build_ebpf::clippy(),
        Command::Image(opts) => image::run(&opts),
        Command::Test { args } => test::run(args),
        Command::Demo(opts) => demo::run(&opts),
        Command::Modgraph(opts) => modgraph::run(opts),
        Command::Bench { args } => bench::run(args),
    }
}
