//! `cargo xtask test`: setup, build the agent and the images, run every
//! test crate with VMPATH_BIN pointing at the agent binary the integration
//! tests start, VMPATH_IMAGE and VMPATH_IMAGE_NEXT at the image archives the
//! image tests run (the second reports another version: the upgrade's
//! target), VMPATH_BIRD_IMAGE at the BIRD sidecar's image. The runner is
//! cargo-nextest (`.config/nextest.toml`: how many tests at once, which
//! ones share the machine with nobody).
//!
//! The image tests' images are assembled from the tests' own debug build
//! (`image::Profile::Test`), after the other tests ran: seconds, where a
//! static build of its own was minutes of a cold run on two cores.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Result, bail};

use crate::{cargo, cmd, image, setup};

/// The version suffix of the image the upgrade test moves to.
const NEXT_SUFFIX: &str = "-next";

/// Every crate with tests but the eBPF one (bpf target only: its code is
/// tested by running it: tests/tests/*fixtures.rs).
const PACKAGES: [&str; 6] = [
    "vmpath-common",
    "vmpath-api",
    "vmpath",
    "vmpath-cni",
    "vmpath-tests",
    "xtask",
];

/// The tests that need the image archives (tests/tests/image.rs).
const IMAGE_TESTS: &str = "test(/^image::/)";

pub fn run(args: Vec<String>) -> Result<()> {
    cmd::require_root("cargo xtask test")?;
    let started = Instant::now();
    let phase = |what: &str| println!("test: {what} at {} s", started.elapsed().as_secs());
    setup::run()?;
    phase("set up");
    let bin = cargo::build_agent()?;
    phase("agent built");
    if !args.is_empty() {
        // A chosen set of tests: the images first, then one run.
        let images = build_images()?;
        return cmd::run(
            "running the tests",
            &mut nextest(&bin, Some(&images), &args),
        );
    }
    let first = cmd::status(
        "running the tests",
        &mut nextest(&bin, None, &["-E".into(), format!("not {IMAGE_TESTS}")]),
    )?;
    phase("tests run");
    let images = build_images()?;
    phase("images built");
    let second = cmd::status(
        "running the image tests",
        &mut nextest(&bin, Some(&images), &["-E".into(), IMAGE_TESTS.into()]),
    )?;
    phase("image tests run");
    if !first.success() || !second.success() {
        bail!(
            "tests failed (all but the image tests: {first}; the image tests: {second}); \
             each failure is listed above"
        );
    }
    Ok(())
}

/// `cargo nextest run` over every package, with the agent and (when built)
/// the images named in the environment.
fn nextest(bin: &Path, images: Option<&Images>, args: &[String]) -> Command {
    let mut c = cargo::cargo();
    c.args(["nextest", "run", "--no-tests=fail"]);
    for p in PACKAGES {
        c.args(["-p", p]);
    }
    // Filters and nextest's own options (`--no-capture`, `-j 1`, ...).
    c.args(args).env("VMPATH_BIN", bin);
    let mut shown = format!("VMPATH_BIN={}", bin.display());
    if let Some(i) = images {
        for (var, path) in [
            ("VMPATH_IMAGE", &i.current),
            ("VMPATH_IMAGE_NEXT", &i.next),
            ("VMPATH_BIRD_IMAGE", &i.bird),
        ] {
            c.env(var, path);
            shown.push_str(&format!(" {var}={}", path.display()));
        }
    }
    println!("$ {shown} {}", cmd::display(&c));
    c
}

/// The three archives the image tests run.
struct Images {
    current: PathBuf,
    next: PathBuf,
    bird: PathBuf,
}

/// vmpath's image, its successor and the BIRD image, from the tests'
/// debug build.
fn build_images() -> Result<Images> {
    let (current, next) = image::build_with_successor(NEXT_SUFFIX, image::Profile::Test)?;
    let bird = image::bird::build(&current)?;
    for i in [&current, &next, &bird] {
        println!("image: {} ({})", i.reference, i.archive.display());
    }
    Ok(Images {
        current: current.archive,
        next: next.archive,
        bird: bird.archive,
    })
}
