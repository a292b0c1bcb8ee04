//! `cargo xtask test`: setup, build the agent and the images, run every
//! test crate with VMPATH_BIN pointing at the agent binary the integration
//! tests start, VMPATH_IMAGE and VMPATH_IMAGE_NEXT at the image archives the
//! image tests run (the second reports another version: the upgrade's
//! target), VMPATH_BIRD_IMAGE at the BIRD sidecar's image. The runner is
//! cargo-nextest (`.config/nextest.toml`: how many tests at once, which
//! ones share the machine with nobody).
//!
//! The images' static build (profile `image-test`: release's settings,
//! unoptimised; `image::Profile::Test`) shares nothing with the tests'
//! debug build (other profile, other rustflags), and on two cores it is minutes
//! of a cold run. So it runs beside the tests, niced (the tests mostly wait
//! on packets and timers; a niced build takes only the CPU they leave), in
//! a target directory of its own (no lock shared with the tests' build),
//! and the image tests run once it is done.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

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
    let images = ImageBuild::start()?;
    if !args.is_empty() {
        // A chosen set of tests: the images first, then one run.
        let images = images.wait()?;
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
    let images = images.wait()?;
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

/// The images' build, running as a child process (`cargo xtask test-images`).
struct ImageBuild {
    child: Child,
    log: PathBuf,
    out: PathBuf,
}

impl ImageBuild {
    fn start() -> Result<ImageBuild> {
        let target = cargo::target_dir()?;
        let log = target.join("image-build.log");
        let out = target.join("image-build.json");
        let _ = fs::remove_file(&out);
        let exe = std::env::current_exe().context("locating xtask's own binary")?;
        let log_file =
            fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut c = Command::new("nice");
        c.args(["-n", "19"])
            .arg(exe)
            .arg("test-images")
            .arg(&out)
            .current_dir(cargo::root())
            .env("CARGO_TARGET_DIR", target.join("image-build"))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        println!(
            "$ {} (building the images beside the tests; log: {})",
            cmd::display(&c),
            log.display()
        );
        let child = c.spawn().context("starting the images' build")?;
        Ok(ImageBuild { child, log, out })
    }

    fn wait(mut self) -> Result<Images> {
        println!("waiting for the images' build ({})", self.log.display());
        let status = self.child.wait().context("waiting for the images' build")?;
        let log = fs::read_to_string(&self.log).unwrap_or_default();
        if !status.success() {
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "building the images failed ({status}); the end of {}:\n{}",
                self.log.display(),
                tail.join("\n")
            );
        }
        // What the build printed of the images (references, digests).
        for line in log.lines().filter(|l| l.starts_with("image: ")) {
            println!("{line}");
        }
        let text = fs::read_to_string(&self.out)
            .with_context(|| format!("reading {}", self.out.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", self.out.display()))?;
        let path = |k: &str| -> Result<PathBuf> {
            v[k].as_str()
                .map(PathBuf::from)
                .with_context(|| format!("{}: no {k}", self.out.display()))
        };
        Ok(Images {
            current: path("current")?,
            next: path("next")?,
            bird: path("bird")?,
        })
    }
}

/// `cargo xtask test-images <out>` (run by `test` above): build vmpath's
/// image, its successor and the BIRD image; write their archives' paths to
/// `out` as JSON.
pub fn build_images(out: &Path) -> Result<()> {
    let (current, next) = image::build_with_successor(NEXT_SUFFIX, image::Profile::Test)?;
    let bird = image::bird::build(&current)?;
    let v = json!({
        "current": current.archive,
        "next": next.archive,
        "bird": bird.archive,
    });
    fs::write(out, v.to_string()).with_context(|| format!("writing {}", out.display()))
}
