//! `cargo xtask modgraph`: which top-level module of a crate uses which,
//! read from the sources' `crate::` paths, as a Mermaid graph (the one in
//! docs/architecture.md) and a list of import cycles. The tests at the end
//! fail on any cycle among the modules of the crates in [`ACYCLIC`], and on
//! any use of the agent's that goes against its [`AGENT_LAYERS`].
//!
//! It reads text, not the compiler's resolution: a `crate::x` path in code
//! (not in a comment) is a use of module `x`. That is what a reader sees,
//! and what makes a cycle: two modules each needing the other to be read.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

/// The crates whose modules must form no cycle (paths from the workspace
/// root).
#[cfg(test)]
pub const ACYCLIC: [&str; 6] = [
    "agent/src",
    "api/src",
    "cni/src",
    "common/src",
    "ebpf/src",
    "xtask/src",
];

/// The agent's top-level modules (agent/src), lowest first: each may use
/// only those before it. The round's stages each have a folder; their
/// order here is the round's (docs/architecture.md) but where a stage's
/// substance serves an earlier one: `config` (the documents every stage
/// reads) under them all, `publish`'s view under `read` (the Kubernetes
/// source reports its watches there), `observe` above `apply` (it reads
/// back what apply programmed). The node services come next, then the
/// round's driver chain, the controller, and the binary's faces. A new
/// top-level module must be placed here.
pub const AGENT_LAYERS: [&str; 17] = [
    // The operating system's plumbing.
    "sys",
    // The stages' substance.
    "config",
    "derive",
    "resolve",
    "publish",
    "read",
    "plan",
    "apply",
    "observe",
    // The node services.
    "slowpath",
    "monitor",
    "api",
    "metrics",
    // The round's driver chain, the controller, the binary's faces.
    "round",
    "controller",
    "agent",
    "cli",
];

/// Module -> the modules of the same folder it uses.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

#[derive(clap::Args)]
pub struct Options {
    /// The crate's source directory, from the workspace root.
    #[arg(default_value = "agent/src")]
    src: PathBuf,
}

pub fn run(o: Options) -> Result<()> {
    let src = crate::cargo::root().join(&o.src);
    let graph = graph_in(&src, &prefix_of(&o.src))?;
    print!("{}", mermaid(&graph));
    let cycles = cycles(&graph);
    if cycles.is_empty() {
        eprintln!("modgraph: {}: no import cycles", o.src.display());
    }
    for c in &cycles {
        eprintln!("modgraph: {}: cycle: {}", o.src.display(), c.join(" -> "));
    }
    if o.src == Path::new("agent/src") {
        let against = against_layers(&graph, &AGENT_LAYERS);
        if against.is_empty() {
            eprintln!("modgraph: agent/src: every use keeps to AGENT_LAYERS");
        }
        for a in &against {
            eprintln!("modgraph: agent/src: against the layers: {a}");
        }
    }
    Ok(())
}

/// Every module of `graph` that `layers` (lowest first) does not place,
/// and every use of a module placed at or above the user's own layer.
pub fn against_layers(graph: &Graph, layers: &[&str]) -> Vec<String> {
    let layer = |m: &str| layers.iter().position(|l| *l == m);
    let mut found = Vec::new();
    for (from, uses) in graph {
        let Some(at) = layer(from) else {
            found.push(format!("{from}: not in the layers"));
            continue;
        };
        for to in uses {
            match layer(to) {
                Some(l) if l < at => {}
                Some(_) => found.push(format!("{from} -> {to}: {to} is not below {from}")),
                None => found.push(format!("{from} -> {to}: {to} is not in the layers")),
            }
        }
    }
    found
}

/// The path prefix of the modules in `dir` (a crate's `src` or a folder
/// under it): `agent/src` -> `crate::`, `agent/src/round` ->
/// `crate::round::`.
fn prefix_of(dir: &Path) -> String {
    let mut prefix = "crate::".to_string();
    let mut below_src = false;
    for c in dir.components() {
        let c = c.as_os_str().to_string_lossy();
        if below_src {
            prefix.push_str(&format!("{c}::"));
        } else if c == "src" {
            below_src = true;
        }
    }
    prefix
}

/// The graph of the crate whose sources are in `src`: one node per file or
/// folder directly in it (but the crate roots `main.rs` and `lib.rs`).
#[cfg(test)]
pub fn graph(src: &Path) -> Result<Graph> {
    graph_in(src, "crate::")
}

/// The graph of the modules directly in `dir`, whose paths from the crate
/// root start with `prefix` (`crate::` for the crate's own folder,
/// `crate::round::` for `round/`): a module uses a sibling it names by that
/// prefix, or by `super::` from its own file.
fn graph_in(src: &Path, prefix: &str) -> Result<Graph> {
    // A module is its file, its folder, or both (`x.rs` with `x/`).
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let path = entry?.path();
        let name = match path.file_name().and_then(|n| n.to_str()) {
            Some(n) if path.is_dir() => n.to_string(),
            Some(n) if n.ends_with(".rs") && !["main.rs", "lib.rs", "mod.rs"].contains(&n) => {
                n.trim_end_matches(".rs").to_string()
            }
            _ => continue,
        };
        modules.entry(name).or_default().push(path);
    }
    let mut graph = Graph::new();
    for (name, paths) in &modules {
        let mut uses = BTreeSet::new();
        for file in paths
            .iter()
            .map(|p| rust_files(p))
            .collect::<Result<Vec<_>>>()?
            .concat()
            .into_iter()
            .filter(|f| !is_test_module_file(f))
        {
            let text =
                fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
            // `super::` in a module's own file (`x.rs`, `x/mod.rs`) is the crate.
            let own_file = file.parent() == Some(src)
                || file.file_name().is_some_and(|n| n == "mod.rs")
                    && file.parent().and_then(Path::parent) == Some(src);
            for used in paths_from(&text, prefix, own_file) {
                if used != *name && modules.contains_key(&used) {
                    uses.insert(used);
                }
            }
        }
        graph.insert(name.clone(), uses);
    }
    Ok(graph)
}

/// Whether `file` is a unit-test module kept in a file of its own
/// (`#[cfg(test)] mod tests;` in its parent): like an inline test module,
/// not part of the layering.
fn is_test_module_file(file: &Path) -> bool {
    let (Some(dir), Some(stem)) = (file.parent(), file.file_stem().and_then(|s| s.to_str())) else {
        return false;
    };
    if stem == "mod" {
        return false;
    }
    // The parent module's file: `dir/mod.rs`, or `dir.rs` beside `dir/`.
    let parent = [dir.join("mod.rs"), dir.with_extension("rs")]
        .into_iter()
        .find(|p| p.is_file());
    parent
        .and_then(|p| fs::read_to_string(p).ok())
        .is_some_and(|text| declares_test_module(&text, stem))
}

/// Whether `parent`'s text declares `mod {name};` under `#[cfg(test)]`.
fn declares_test_module(parent: &str, name: &str) -> bool {
    parent.contains(&format!("#[cfg(test)]\nmod {name};"))
}

fn rust_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
        let p = entry?.path();
        if p.is_dir() {
            files.extend(rust_files(&p)?);
        } else if p.extension().is_some_and(|e| e == "rs") {
            files.push(p);
        }
    }
    Ok(files)
}

/// The first segment of every `crate::` path in `text`'s code (and of
/// every `super::` path when `super_is_crate`), groups (`crate::{a, b::c}`)
/// included; comments are skipped.
#[cfg(test)]
pub fn crate_paths(text: &str, super_is_crate: bool) -> BTreeSet<String> {
    paths_from(text, "crate::", super_is_crate)
}

/// The first segment after `prefix` of every path in `text`'s code (and
/// after `super::` when `super_is_parent`).
fn paths_from(text: &str, prefix: &str, super_is_parent: bool) -> BTreeSet<String> {
    // A module's unit tests (`#[cfg(test)] mod x { .. }`) may set up with
    // any module: they are not part of the layering.
    let text = without_test_modules(text);
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    let prefixes: &[&str] = if super_is_parent {
        &[prefix, "super::"]
    } else {
        &[prefix]
    };
    for prefix in prefixes {
        paths_after(&code, prefix, &mut found);
    }
    found
}

/// `text` without its `#[cfg(test)] mod x { .. }` blocks (braces counted
/// outside string and character literals).
fn without_test_modules(text: &str) -> String {
    const MARK: &str = "#[cfg(test)]\nmod ";
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(MARK) {
        out.push_str(&rest[..i]);
        let block = &rest[i..];
        let Some(open) = block.find(['{', ';']) else {
            return out;
        };
        if block.as_bytes()[open] == b';' {
            // `mod tests;`: the file is read on its own (and skipped there
            // only by its own marks).
            rest = &block[open + 1..];
            continue;
        }
        rest = match block_end(&block[open..]) {
            Some(end) => &block[open + end..],
            None => "",
        };
    }
    out.push_str(rest);
    out
}

/// The length of the `{ .. }` block `s` starts with.
fn block_end(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => {
                while let Some((_, c)) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '\'' => {
                // A character literal ('{', '\''); a lifetime has no closing quote.
                let ahead: String = s[i + 1..].chars().take(3).collect();
                if ahead.starts_with('\\') {
                    if let Some(j) = s[i + 2..].find('\'') {
                        while chars.peek().is_some_and(|(k, _)| *k <= i + 2 + j) {
                            chars.next();
                        }
                    }
                } else if ahead.chars().nth(1) == Some('\'') {
                    chars.next();
                    chars.next();
                }
            }
            '/' if s[i + 1..].starts_with('/') => {
                while chars.next().is_some_and(|(_, c)| c != '\n') {}
            }
            '{' => depth += 1,
            '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

fn paths_after(code: &str, prefix: &str, found: &mut BTreeSet<String>) {
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        // `$crate::` (macros) is the crate too; `x_crate::` is not.
        let preceded_by_ident = rest[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_');
        rest = &rest[i + prefix.len()..];
        if preceded_by_ident {
            continue;
        }
        let trimmed = rest.trim_start();
        if let Some(group) = trimmed.strip_prefix('{') {
            for item in top_level_items(group) {
                found.insert(item);
            }
        } else if let Some(id) = ident(trimmed) {
            found.insert(id);
        }
    }
}

/// The first identifier of each comma-separated item of a `{...}` group
/// (the text after its `{`), at the group's own depth.
fn top_level_items(group: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut depth = 0;
    let mut start = true;
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => start = true,
            c if start && depth == 0 && !c.is_whitespace() => {
                start = false;
                if let Some(id) = ident(&group[i..]) {
                    items.push(id);
                }
            }
            _ => {}
        }
    }
    items
}

fn ident(s: &str) -> Option<String> {
    let id: String = s
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!id.is_empty() && id != "self").then_some(id)
}

/// Every strongly connected component of more than one module, each as its
/// modules in order (Tarjan's algorithm).
pub fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a str) {
        let n = w.index.len();
        w.index.insert(v, n);
        w.low.insert(v, n);
        w.stack.push(v);
        w.on_stack.insert(v);
        for u in w.graph.get(v).into_iter().flatten() {
            let u = u.as_str();
            if !w.index.contains_key(u) {
                visit(w, u);
                let low = w.low[v].min(w.low[u]);
                w.low.insert(v, low);
            } else if w.on_stack.contains(u) {
                let low = w.low[v].min(w.index[u]);
                w.low.insert(v, low);
            }
        }
        if w.low[v] == w.index[v] {
            let mut component = Vec::new();
            while let Some(u) = w.stack.pop() {
                w.on_stack.remove(u);
                component.push(u.to_string());
                if u == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                w.found.push(component);
            }
        }
    }
    let mut w = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !w.index.contains_key(v.as_str()) {
            visit(&mut w, v);
        }
    }
    w.found
}

/// The graph as a Mermaid flowchart, users above what they use.
pub fn mermaid(graph: &Graph) -> String {
    let mut out = String::from("flowchart TD\n");
    for (from, uses) in graph {
        if uses.is_empty() {
            out.push_str(&format!("  {from}\n"));
        }
        for to in uses {
            out.push_str(&format!("  {from} --> {to}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_groups_are_read_and_comments_are_not() {
        let text = "use crate::{config::{Model, Network}, view, self};\n\
                    // crate::commented\n\
                    fn f() { crate::routes::sync(); let _ = $crate::metrics::X; }\n\
                    #[cfg(test)]\nmod tests {\n use crate::ipam; // '{' \"}\"\n}\n\
                    #[cfg(test)]\nmod more_tests {\n use crate::plan; let c = '}';\n}\n";
        let got: Vec<_> = crate_paths(text, false).into_iter().collect();
        assert_eq!(got, ["config", "metrics", "routes", "view"]);
        let got: Vec<_> = crate_paths("use super::{a, b};", true)
            .into_iter()
            .collect();
        assert_eq!(got, ["a", "b"]);
        assert!(crate_paths("use super::a;", false).is_empty());
    }

    #[test]
    fn a_test_module_in_a_file_of_its_own_is_known_by_its_parent() {
        let parent = "pub fn f() {}\n\n#[cfg(test)]\nmod tests;\nmod helpers;\n";
        assert!(declares_test_module(parent, "tests"));
        assert!(!declares_test_module(parent, "helpers"));
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let g = |edges: &[(&str, &str)]| {
            let mut g = Graph::new();
            for (a, b) in edges {
                g.entry(a.to_string()).or_default().insert(b.to_string());
                g.entry(b.to_string()).or_default();
            }
            g
        };
        assert!(cycles(&g(&[("a", "b"), ("b", "c")])).is_empty());
        assert_eq!(
            cycles(&g(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])),
            [["a", "b", "c"]]
        );
    }

    #[test]
    fn a_use_against_the_layers_is_found() {
        let g = |edges: &[(&str, &str)]| {
            let mut g = Graph::new();
            for (a, b) in edges {
                g.entry(a.to_string()).or_default().insert(b.to_string());
                g.entry(b.to_string()).or_default();
            }
            g
        };
        let layers = ["sys", "plan", "apply"];
        assert!(against_layers(&g(&[("apply", "plan"), ("plan", "sys")]), &layers).is_empty());
        assert_eq!(
            against_layers(&g(&[("plan", "apply"), ("sys", "sys2")]), &layers),
            [
                "plan -> apply: apply is not below plan",
                "sys -> sys2: sys2 is not in the layers",
                "sys2: not in the layers",
            ]
        );
    }

    /// The agent's top-level folders keep to [`AGENT_LAYERS`]: a stage, a
    /// service or plumbing uses only what lies below it (which also rules
    /// out a cycle among them).
    #[test]
    fn the_agent_keeps_to_its_layers() {
        let graph = graph(&crate::cargo::root().join("agent/src")).unwrap();
        assert!(
            graph.len() > 10,
            "agent/src: only {} modules read",
            graph.len()
        );
        let against = against_layers(&graph, &AGENT_LAYERS);
        assert!(
            against.is_empty(),
            "agent/src against AGENT_LAYERS (xtask/src/modgraph.rs; `cargo xtask modgraph` draws the graph):\n{}",
            against.join("\n")
        );
    }

    /// The layering docs/architecture.md draws: no crate of [`ACYCLIC`] has
    /// two modules that need each other.
    #[test]
    fn no_crate_has_an_import_cycle() {
        let mut all = Vec::new();
        for src in ACYCLIC {
            let graph = graph(&crate::cargo::root().join(src)).unwrap();
            assert!(!graph.is_empty(), "{src}: no modules read");
            for c in cycles(&graph) {
                all.push(format!("{src}: {}", c.join(" <-> ")));
            }
        }
        assert!(
            all.is_empty(),
            "import cycles (`cargo xtask modgraph <src>` draws the graph):\n{}",
            all.join("\n")
        );
    }

    /// Every folder of those crates too (`round/`, `config/`, `apply/`,
    /// the eBPF crate's `prog/` and `snat/`, ...): its modules form no
    /// cycle among themselves.
    #[test]
    fn no_folder_has_an_import_cycle() {
        fn folders(dir: &Path, prefix: &str, out: &mut Vec<(PathBuf, String)>) {
            for entry in fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    let name = path.file_name().unwrap().to_str().unwrap().to_string();
                    let inner = format!("{prefix}{name}::");
                    out.push((path.clone(), inner.clone()));
                    folders(&path, &inner, out);
                }
            }
        }
        let mut all = Vec::new();
        let mut checked = 0;
        for src in ACYCLIC {
            let mut dirs = Vec::new();
            folders(&crate::cargo::root().join(src), "crate::", &mut dirs);
            for (dir, prefix) in dirs {
                let graph = graph_in(&dir, &prefix).unwrap();
                checked += 1;
                for c in cycles(&graph) {
                    all.push(format!("{}: {}", dir.display(), c.join(" <-> ")));
                }
            }
        }
        assert!(checked > 5, "only {checked} folders read");
        assert!(
            all.is_empty(),
            "import cycles in folders:\n{}",
            all.join("\n")
        );
    }

    /// The eBPF crate's programs' entries (`prog/`) sit above its library:
    /// no library module uses them (ebpf/src/prog/mod.rs says why).
    #[test]
    fn the_ebpf_library_never_uses_the_program_entries() {
        let graph = graph(&crate::cargo::root().join("ebpf/src")).unwrap();
        assert!(graph.contains_key("prog"), "ebpf/src/prog not read");
        let users: Vec<_> = graph
            .iter()
            .filter(|(_, uses)| uses.contains("prog"))
            .map(|(m, _)| m.as_str())
            .collect();
        assert!(users.is_empty(), "library modules using prog: {users:?}");
    }
}
