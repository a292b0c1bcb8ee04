//! The config examples in `docs/examples/` are what newcomers copy: each
//! must load through the agent's own config reader and pass validation and
//! IPAM without a single refusal, plan without a problem on every node it
//! names, and appear verbatim in `docs/config.md` so the page cannot drift
//! from the checked files. No root needed.

use std::{
    fs,
    path::{Path, PathBuf},
};

use vmpath::{config, plan, resolve::ipam};

fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

fn examples() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(docs_dir().join("examples"))
        .expect("docs/examples exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no docs/examples/*.yaml");
    files
}

/// Reads `example` alone (as the agent reads a config dir), validated for
/// `node`, with IPAM run over it (no earlier claims).
fn load(example: &Path, node: &str) -> (usize, vmpath::resolve::resolved::Resolved) {
    let stem = example.file_stem().unwrap().to_string_lossy();
    let dir = std::env::temp_dir().join(format!(
        "vmpath-docs-example-{}-{stem}-{node}",
        std::process::id()
    ));
    fs::create_dir_all(&dir).unwrap();
    fs::copy(example, dir.join("example.yaml")).unwrap();
    let snap = config::source::read_dir(&dir);
    let _ = fs::remove_dir_all(&dir);
    assert!(
        snap.errors.is_empty(),
        "{}: not YAML: {:?}",
        example.display(),
        snap.errors
    );
    let mut cfg = vmpath::resolve::resolved::Resolved::new(vmpath::round::validate(
        &snap,
        node,
        &vmpath::config::AcceptedKeys::new(),
    ));
    let _ = ipam::assign(&mut cfg, &Default::default());
    (snap.documents.len(), cfg)
}

#[test]
fn every_example_is_accepted_whole_on_every_node_it_names() {
    for example in examples() {
        let (documents, cfg) = load(&example, "");
        let errors: Vec<String> = cfg.errors.iter().map(|e| e.to_string()).collect();
        assert!(
            errors.is_empty(),
            "{} has refusals:\n{}",
            example.display(),
            errors.join("\n")
        );
        assert_eq!(
            documents,
            cfg.config.nodes.len()
                + cfg.config.networks.len()
                + cfg.attachments.len()
                + cfg.config.namespaces.len(),
            "{}: a document was dropped without a refusal",
            example.display()
        );
        assert!(
            !cfg.config.nodes.is_empty(),
            "{}: no Node",
            example.display()
        );
        for node in cfg.config.nodes.keys() {
            let (_, cfg) = load(&example, node);
            assert!(
                cfg.errors.is_empty(),
                "{}: {:?}",
                example.display(),
                cfg.errors
            );
            // Every port exists, each with an ifindex of its own.
            let ifindex = |name: &str| {
                Some(
                    1000 + name
                        .bytes()
                        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)))
                        % 100_000,
                )
            };
            let plan = plan::plan(&cfg, node, ifindex);
            assert!(
                plan.problems.is_empty(),
                "{} on {node}: {:?}",
                example.display(),
                plan.problems
            );
            assert!(
                cfg.attachments.iter().all(|a| a.active_node() != node) || !plan.ports.is_empty(),
                "{} on {node}: no port planned",
                example.display()
            );
        }
    }
}

#[test]
fn the_config_reference_shows_every_example_verbatim() {
    let page = fs::read_to_string(docs_dir().join("config.md")).expect("docs/config.md");
    for example in examples() {
        let text = fs::read_to_string(&example).unwrap();
        assert!(
            page.contains(&format!("```yaml\n{text}```")),
            "docs/config.md does not show {} as it is",
            example.display()
        );
    }
}

/// `docs/examples/refused/` read as a config dir: each refusal is the one
/// `docs/config.md` prints (file, document, field and message; a message
/// may carry more after the documented text, such as a parser's position),
/// every documented refusal happens, and the valid documents apply.
#[test]
fn the_refused_examples_are_refused_as_documented() {
    const SHOWN_DIR: &str = "/etc/vmpath/";
    let dir = docs_dir().join("examples/refused");
    let snap = config::source::read_dir(&dir);
    let cfg = vmpath::round::validate(&snap, "node-a", &vmpath::config::AcceptedKeys::new());
    let page = fs::read_to_string(docs_dir().join("config.md")).expect("docs/config.md");
    let mut documented: Vec<&str> = page.lines().filter(|l| l.starts_with(SHOWN_DIR)).collect();
    assert!(!documented.is_empty(), "docs/config.md shows no refusal");
    let prefix = format!("{}/", dir.display());
    for error in &cfg.errors {
        let shown = error.to_string().replacen(&prefix, SHOWN_DIR, 1);
        let at = documented
            .iter()
            .position(|d| shown.starts_with(d))
            .unwrap_or_else(|| panic!("refusal not in docs/config.md: {shown}"));
        documented.remove(at);
    }
    assert!(
        documented.is_empty(),
        "documented but not refused: {documented:?}"
    );
    let accepted: Vec<&str> = cfg.attachments.iter().map(|a| a.name()).collect();
    assert_eq!(accepted, ["web-4-eth0"]);
    let networks: Vec<&str> = cfg.networks.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(networks, ["blue"]);
}

/// The README's config example is accepted whole as well.
#[test]
fn the_readme_example_is_accepted() {
    let readme = fs::read_to_string(docs_dir().join("../README.md")).expect("README.md");
    let blocks: Vec<&str> = readme
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(yaml, _)| yaml))
        .collect();
    assert!(!blocks.is_empty(), "README.md has no yaml example");
    for (i, yaml) in blocks.iter().enumerate() {
        let file = std::env::temp_dir().join(format!(
            "vmpath-docs-readme-{}-{i}.yaml",
            std::process::id()
        ));
        fs::write(&file, yaml).unwrap();
        let (documents, cfg) = load(&file, "node-a");
        let _ = fs::remove_file(&file);
        assert!(
            cfg.errors.is_empty(),
            "README example {i}: {:?}",
            cfg.errors
        );
        assert_eq!(
            documents,
            cfg.config.nodes.len() + cfg.config.networks.len() + cfg.attachments.len(),
            "README example {i}: a document was dropped"
        );
    }
}
