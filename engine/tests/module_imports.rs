//! The engine's top-level modules import one another without a circle: each type lives with
//! the lowest module that needs it, and a module only uses those below it. This test reads the
//! engine's sources (test code left out), builds the graph of `crate::module` uses between
//! top-level modules and fails on any cycle, naming its edges.
//!
//! The layers, bottom up: the protocol's state machines, the store and the fabrics (and the
//! small modules they share: configuration, errors, statistics, tables); the services' state
//! machines (`intent`, `replication`); the runtime, which runs steps on the protocol and drives
//! the replication rounds; the worker, with the services that act through workers of their own
//! (the intent service: `worker::intent`); the node, which starts them all. A service above the
//! runtime that must hear of a runtime event registers a listener the runtime defines
//! (`runtime::GrantListener`) instead of being named by it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source without comments and without the unit tests (a `#[cfg(test)]` item and what
/// follows it in the file: the tests module closes every file that has one).
fn code_of(source: &str) -> String {
    let mut code = String::new();
    for line in source.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            break;
        }
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// The top-level modules named by one `crate::` path's first segment or, for `crate::{…}`, by
/// each item of the group.
fn uses_in(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `ferry_crate::`, say
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let first = item.trim().split("::").next().unwrap_or("").trim();
                if !first.is_empty() {
                    out.push(first.to_string());
                }
            }
        } else {
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            out.push(name);
        }
    }
    out
}

/// Names the crate root re-exports (`pub use module::{A, B}` in `lib.rs`), by their module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut names = BTreeMap::new();
    for statement in code_of(lib).split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else { continue };
        let Some((module, items)) = path.split_once("::") else { continue };
        for item in items.trim_matches(|c| c == '{' || c == '}' || char::is_whitespace(c)).split(',') {
            let item = item.trim();
            if !item.is_empty() {
                names.insert(item.to_string(), module.trim().to_string());
            }
        }
    }
    names
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let names = reexports(&std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs"));
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph = Graph::new();
    for file in files {
        let relative = file.strip_prefix(&src).expect("under src").to_string_lossy().replace('\\', "/");
        let top = relative.split('/').next().unwrap_or("").trim_end_matches(".rs").to_string();
        if top == "lib" || relative.ends_with("/tests.rs") {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&file).expect("a source file"));
        for used in uses_in(&code) {
            let module = names.get(&used).cloned().unwrap_or(used);
            if module != top && !module.is_empty() {
                graph.entry(top.clone()).or_default().entry(module).or_default().insert(relative.clone());
            }
        }
    }
    graph
}

/// Strongly connected components of more than one module (Tarjan's algorithm).
fn cycles(graph: &Graph) -> Vec<BTreeSet<String>> {
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<BTreeSet<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                s.found.push(component);
            }
        }
    }
    let mut s = State { graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on_stack: BTreeSet::new(), found: Vec::new() };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn the_engines_modules_import_one_another_without_a_circle() {
    let graph = graph();
    assert!(graph.contains_key("protocol") && graph.contains_key("worker"), "the reader found no modules: {:?}", graph.keys());
    let found = cycles(&graph);
    let described: Vec<String> = found
        .iter()
        .map(|component| {
            let edges: Vec<String> = component
                .iter()
                .flat_map(|from| {
                    graph[from]
                        .iter()
                        .filter(|(to, _)| component.contains(*to))
                        .map(move |(to, files)| format!("{from} -> {to} ({})", files.iter().cloned().collect::<Vec<_>>().join(", ")))
                })
                .collect();
            edges.join("; ")
        })
        .collect();
    assert!(found.is_empty(), "the engine's modules import one another in a circle: {}", described.join(" | "));
}

/// The reader itself: it finds a planted circle, sees through groups and re-exports, and leaves
/// comments and tests out.
#[test]
fn the_reader_finds_a_circle() {
    let code = code_of("use crate::{a::X, b};\n// crate::c\nlet x = crate::Name;\nmod tests {}\n#[cfg(test)]\nuse crate::d;\n");
    assert_eq!(uses_in(&code), vec!["a", "b", "Name"]);
    assert_eq!(reexports("pub use node::{Node, SlotAddress};\npub use table::Table;").get("Table").map(String::as_str), Some("table"));
    let mut graph = Graph::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        graph.entry(from.into()).or_default().entry(to.into()).or_default();
    }
    let found = cycles(&graph);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].iter().map(String::as_str).collect::<Vec<_>>(), vec!["a", "b", "c"]);
}
