//! The import graph of a crate's top-level modules, read from its sources, for the tests that
//! keep each crate's modules in one direction (`tests` of each crate call [`assert_acyclic`]).
//!
//! A module's edges are the modules its non-test code names with a `crate::` path (in `use`
//! declarations or inline, grouped `crate::{a, b}` too). Comment lines do not count, so doc links
//! do not; test code does not either: files named `tests.rs` or `*_tests.rs` and everything
//! from a `#[cfg(test)] mod NAME {` on are left out. A file in `src/NAME/` belongs to module
//! `NAME`. The crate root (`main.rs` or `lib.rs`) is not a node: it declares the modules and
//! holds the crate's shared vocabulary (constants, re-exports). A `crate::` path to an item of
//! the root counts as an edge to the module the root re-exports it from (`pub use NAME::...`),
//! and as no edge when the root defines it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Module name -> the modules it uses.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// Spelt in two pieces so that this file's own text holds no reference.
const PREFIX: &str = concat!("crate", "::");

/// The graph of the crate whose manifest directory is `manifest_dir` (its sources in `src/`,
/// its root `src/main.rs` or `src/lib.rs`). `skip` names modules to leave out (a test-only
/// module that reads the sources, say).
pub fn read(manifest_dir: &Path, skip: &[&str]) -> Graph {
    let src = manifest_dir.join("src");
    let root = if src.join("lib.rs").is_file() {
        "lib"
    } else {
        "main"
    };
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    let mut entries: Vec<_> = fs::read_dir(&src)
        .unwrap_or_else(|e| panic!("{}: {e}", src.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let Some(name) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
            continue;
        };
        let mut text = String::new();
        if path.is_dir() {
            read_tree(&path, &mut text);
        } else if path.extension().is_some_and(|e| e == "rs") && !is_test_file(&path) {
            text = non_test(&read_file(&path));
        } else {
            continue;
        }
        if (name == "main" || name == "lib") && name != root {
            continue; // a second target's root (a binary beside the library)
        }
        if !skip.contains(&name.as_str()) {
            sources.entry(name).or_default().push_str(&text);
        }
    }
    graph(&sources, root, skip)
}

fn read_file(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn is_test_file(path: &Path) -> bool {
    path.file_stem()
        .map(|s| s.to_string_lossy())
        .is_some_and(|s| s == "tests" || s.ends_with("_tests"))
}

/// Appends the non-test code of every `.rs` file under `dir` to `text`.
fn read_tree(dir: &Path, text: &mut String) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_tree(&path, text);
        } else if path.extension().is_some_and(|e| e == "rs") && !is_test_file(&path) {
            text.push_str(&non_test(&read_file(&path)));
            text.push('\n');
        }
    }
}

/// `text` up to its first `#[cfg(test)] mod NAME {` (inline test modules come last).
fn non_test(text: &str) -> String {
    let mut at = 0;
    while let Some(found) = text[at..].find("#[cfg(test)]") {
        let start = at + found;
        let rest = text[start + "#[cfg(test)]".len()..].trim_start();
        let rest = rest.strip_prefix("pub ").unwrap_or(rest);
        if let Some(after) = rest.strip_prefix("mod ") {
            let name_len = after.chars().take_while(|&c| is_ident(c)).count();
            if after[name_len..].trim_start().starts_with('{') {
                return text[..start].to_owned();
            }
        }
        at = start + 1;
    }
    text.to_owned()
}

/// The modules a crate root declares (`mod NAME;`, `pub mod NAME;`, `pub(crate) mod NAME;`),
/// test-only ones (`#[cfg(test)]` on the line before) left out.
pub fn declared(root: &str) -> BTreeSet<String> {
    declarations(root).0
}

/// The modules a crate root declares for every build, and those it declares for tests only.
fn declarations(root: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut always, mut tests) = (BTreeSet::new(), BTreeSet::new());
    let mut test_only = false;
    for line in root.lines().map(str::trim) {
        let decl = line
            .strip_prefix("pub(crate) ")
            .or_else(|| line.strip_prefix("pub "))
            .unwrap_or(line);
        if let Some(name) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            match test_only {
                false => always.insert(name.to_owned()),
                true => tests.insert(name.to_owned()),
            };
        }
        if !line.starts_with("#[") || line.starts_with("#[cfg(test)]") {
            test_only = line.starts_with("#[cfg(test)]");
        }
    }
    (always, tests)
}

/// Items the root re-exports by name: `pub use NAME::...::Item;` and `pub use NAME::{A, B};`.
fn reexports(root: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in root.lines().map(str::trim) {
        let Some(path) = line
            .strip_prefix("pub use ")
            .and_then(|r| r.strip_suffix(';'))
        else {
            continue;
        };
        let path = path.strip_prefix(PREFIX).unwrap_or(path);
        let module: String = path.chars().take_while(|&c| is_ident(c)).collect();
        if module.is_empty() {
            continue;
        }
        let items = match path.split_once('{') {
            Some((_, group)) => group
                .trim_end_matches('}')
                .split(',')
                .map(|i| i.rsplit("::").next().unwrap_or(i).trim().to_owned())
                .collect(),
            None => vec![path.rsplit("::").next().unwrap_or(path).trim().to_owned()],
        };
        for item in items {
            let item = item
                .rsplit(" as ")
                .next()
                .unwrap_or(&item)
                .trim()
                .to_owned();
            if !item.is_empty() && item != "self" && item != "*" {
                out.insert(item, module.clone());
            }
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first path segment after each `crate::` in `text`, comment lines left out.
pub fn references(text: &str) -> BTreeSet<String> {
    let code: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect();
    let code = code.join("\n");
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices(PREFIX) {
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let rest = &code[at + PREFIX.len()..];
        match rest.strip_prefix('{') {
            Some(group) => found.extend(group_heads(group)),
            None => {
                let head: String = rest.chars().take_while(|&c| is_ident(c)).collect();
                if !head.is_empty() {
                    found.insert(head);
                }
            }
        }
    }
    found
}

/// The first segment of each item of a `{a::B, c, d::{e, f}}` group (`group` follows the `{`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let (mut depth, mut expecting) = (1, true);
    let mut current = String::new();
    for c in group.chars() {
        if depth == 1 && expecting && is_ident(c) {
            current.push(c);
            continue;
        }
        if !current.is_empty() {
            heads.push(std::mem::take(&mut current));
            expecting = false;
        }
        match c {
            '{' => depth += 1,
            '}' if depth == 1 => break,
            '}' => depth -= 1,
            ',' if depth == 1 => expecting = true,
            _ => {}
        }
    }
    heads
}

/// Which module uses which, from the modules' sources (`root` among them).
pub fn graph(sources: &BTreeMap<String, String>, root: &str, skip: &[&str]) -> Graph {
    let root_text = sources.get(root).map_or("", String::as_str);
    let reexported = reexports(root_text);
    // Modules the root declares for tests only are test code.
    let (_, test_only) = declarations(root_text);
    let mut graph = Graph::new();
    for (module, text) in sources
        .iter()
        .filter(|(m, _)| *m != root && !test_only.contains(*m))
    {
        let edges = references(text)
            .into_iter()
            .filter_map(|head| {
                if sources.contains_key(&head) && head != root && !test_only.contains(&head) {
                    Some(head)
                } else {
                    reexported.get(&head).cloned()
                }
            })
            .filter(|m| m != module && !skip.contains(&m.as_str()));
        graph.insert(module.clone(), edges.collect());
    }
    graph
}

/// A cycle of `graph` (its modules in order, the first repeated at the end), if there is one.
pub fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Visiting,
        Done,
    }
    fn visit(
        graph: &Graph,
        module: &str,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(module) {
            Some(Mark::Done) => return None,
            Some(Mark::Visiting) => {
                let start = path.iter().position(|m| m == module).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(module.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(module.to_owned(), Mark::Visiting);
        path.push(module.to_owned());
        for next in graph.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(graph, next, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(module.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|m| visit(graph, m, &mut marks, &mut Vec::new()))
}

/// The modules that lie on some cycle of `graph` (those of its strongly connected groups of
/// more than one).
pub fn modules_in_cycles(graph: &Graph) -> BTreeSet<String> {
    // A module is on a cycle when it reaches itself.
    graph
        .keys()
        .filter(|m| {
            let mut seen = BTreeSet::new();
            let mut todo: Vec<&String> = graph[*m].iter().collect();
            while let Some(n) = todo.pop() {
                if n == *m {
                    return true;
                }
                if seen.insert(n) {
                    todo.extend(graph.get(n).into_iter().flatten());
                }
            }
            false
        })
        .cloned()
        .collect()
}

/// The graph, one `module -> uses` line per module.
pub fn show(graph: &Graph) -> String {
    graph
        .iter()
        .map(|(m, uses)| format!("{m} -> {}", Vec::from_iter(uses.iter().cloned()).join(", ")))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every module the crate root declares was read (a module the reading missed would hide its
/// edges).
fn assert_all_read(manifest_dir: &str, graph: &Graph, skip: &[&str]) {
    let src = Path::new(manifest_dir).join("src");
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{} has no lib.rs or main.rs", src.display()));
    let missing: Vec<_> = declared(&read_file(&root))
        .into_iter()
        .filter(|m| !graph.contains_key(m) && !skip.contains(&m.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "modules {missing:?} declared in {} were not read",
        root.display()
    );
}

/// Panics, naming a cycle and showing the graph, when the crate at `manifest_dir` has an import
/// cycle among its modules (`skip` left out; see [`read`]). Returns the graph for further checks.
pub fn assert_acyclic(manifest_dir: &str, skip: &[&str]) -> Graph {
    let graph = read(Path::new(manifest_dir), skip);
    assert_all_read(manifest_dir, &graph, skip);
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "import cycle in {manifest_dir}: {}\nthe module graph:\n{}",
            cycle.join(" -> "),
            show(&graph)
        );
    }
    graph
}

/// Import cycles among sibling files of a module directory (`src/a/b.rs` naming
/// `super::c` and `src/a/c.rs` naming `super::b`), for every directory under the crate's `src/`:
/// `DIR: b -> c -> b` each. `mod.rs` is the directory's root and no node; test files are left
/// out.
pub fn sibling_cycles(manifest_dir: &Path) -> Vec<String> {
    let mut dirs = Vec::new();
    collect_dirs(&manifest_dir.join("src"), &mut dirs);
    let mut found = Vec::new();
    for dir in dirs {
        let mut sources = BTreeMap::new();
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "rs") && !is_test_file(&p) {
                let name = p.file_stem().map(|s| s.to_string_lossy().into_owned());
                if let Some(name) = name.filter(|n| n != "mod") {
                    sources.insert(name, non_test(&read_file(&p)));
                }
            }
        }
        let mut graph = Graph::new();
        for (module, text) in &sources {
            let uses = sources
                .keys()
                .filter(|other| *other != module && names_sibling(text, other))
                .cloned()
                .collect();
            graph.insert(module.clone(), uses);
        }
        if let Some(cycle) = find_cycle(&graph) {
            found.push(format!("{}: {}", dir.display(), cycle.join(" -> ")));
        }
    }
    found
}

/// Whether `text`'s non-comment lines name `super::NAME` (alone or in a `super::{...}` group).
fn names_sibling(text: &str, name: &str) -> bool {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .any(|l| {
            let direct = l.match_indices("super::").any(|(i, _)| {
                let rest = &l[i + "super::".len()..];
                rest.strip_prefix(name)
                    .is_some_and(|after| !after.starts_with(is_ident))
            });
            let grouped = l.split("super::{").skip(1).any(|g| {
                g.split('}')
                    .next()
                    .unwrap_or_default()
                    .split(',')
                    .any(|item| item.trim().split("::").next() == Some(name))
            });
            direct || grouped
        })
}

/// Every directory under `dir`, `dir` included.
fn collect_dirs(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    out.push(dir.to_path_buf());
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.path().is_dir() {
            collect_dirs(&e.path(), out);
        }
    }
}

/// The `Result<_, String>` types in the non-test code of the crate at `manifest_dir`
/// (`file: Result<...>` each), for crates whose errors are types.
pub fn string_errors(manifest_dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in production_files(manifest_dir) {
        for (i, _) in text.match_indices("Result<") {
            if i > 0 && text[..i].ends_with(|c: char| is_ident(c) || c == ':') {
                // `ApiResult<`, `io::Result<`: a name of its own, not this one.
                if !text[..i].ends_with("::") {
                    continue;
                }
            }
            let args = generic_args(&text[i + "Result<".len()..]);
            if args.len() == 2 && args[1].trim() == "String" {
                found.push(format!("{}: Result<{}>", path.display(), args.join(",")));
            }
        }
    }
    found
}

/// The crate's production sources: every `.rs` file under `src/` but test files and the
/// modules the root declares for tests only, each with its test code cut (see [`read`]).
fn production_files(manifest_dir: &Path) -> Vec<(std::path::PathBuf, String)> {
    let src = manifest_dir.join("src");
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .find(|p| p.is_file())
        .map(|p| read_file(&p))
        .unwrap_or_default();
    let (_, test_only) = declarations(&root);
    let mut files = Vec::new();
    collect_rs(&src, &mut files);
    files.sort();
    files
        .into_iter()
        .filter(|path| {
            let module = path
                .strip_prefix(&src)
                .ok()
                .and_then(|p| p.components().next())
                .map(|c| {
                    c.as_os_str()
                        .to_string_lossy()
                        .trim_end_matches(".rs")
                        .to_owned()
                });
            !module.is_some_and(|m| test_only.contains(&m))
        })
        .map(|path| {
            let text = non_test(&read_file(&path));
            (path, text)
        })
        .collect()
}

/// The production functions of the crate at `manifest_dir` longer than `max` lines (from the
/// `fn` line to its closing brace) whose comment above does not say why (a line with
/// `Long:`), as `(file:line name, lines)`.
pub fn long_functions(manifest_dir: &Path, max: usize) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    for (path, text) in production_files(manifest_dir) {
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let Some(name) = fn_name(line) else {
                continue;
            };
            let indent = line.len() - line.trim_start().len();
            let Some(open) = (i..lines.len()).find(|&j| {
                let l = lines[j].trim_end();
                l.ends_with('{') || l.ends_with(';')
            }) else {
                continue;
            };
            if lines[open].trim_end().ends_with(';') {
                continue; // a declaration without a body
            }
            let close = format!("{}}}", " ".repeat(indent));
            let Some(end) = (open + 1..lines.len()).find(|&j| lines[j].trim_end() == close) else {
                continue;
            };
            let len = end - i + 1;
            let reasoned = lines[..i]
                .iter()
                .rev()
                .take_while(|l| {
                    let t = l.trim_start();
                    t.starts_with("//") || t.starts_with("#[")
                })
                .any(|l| l.contains("Long:"));
            if len > max && !reasoned {
                found.push((format!("{}:{} {name}", path.display(), i + 1), len));
            }
        }
    }
    found
}

/// The name a `fn` item line declares (`pub(crate) async fn name(`, ...).
fn fn_name(line: &str) -> Option<&str> {
    let mut rest = line.trim_start();
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    for prefix in ["const ", "async ", "unsafe "] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let end = rest.find(|c: char| !is_ident(c))?;
    (end > 0).then(|| &rest[..end])
}

/// Every non-test `.rs` file under `dir`.
fn collect_rs(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_rs(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") && !is_test_file(&p) {
            out.push(p);
        }
    }
}

/// The top-level arguments of a generic list that starts right after its `<`.
fn generic_args(text: &str) -> Vec<String> {
    let (mut depth, mut args, mut cur) = (1usize, Vec::new(), String::new());
    for c in text.chars() {
        match c {
            '<' | '(' | '[' => depth += 1,
            '>' | ')' | ']' => {
                depth -= 1;
                if depth == 0 {
                    args.push(cur);
                    return args;
                }
            }
            ',' if depth == 1 => {
                args.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    args
}

/// The modules of an acyclic `graph` by level, top first: a module's level is one more than the
/// highest of the modules it uses (0: it uses none), so every arrow points to a lower level.
/// `None` when the graph has a cycle.
pub fn levels(graph: &Graph) -> Option<Vec<Vec<String>>> {
    fn level(graph: &Graph, module: &str, memo: &mut BTreeMap<String, usize>) -> usize {
        if let Some(l) = memo.get(module) {
            return *l;
        }
        let l = graph
            .get(module)
            .into_iter()
            .flatten()
            .map(|m| level(graph, m, memo) + 1)
            .max()
            .unwrap_or(0);
        memo.insert(module.to_owned(), l);
        l
    }
    if find_cycle(graph).is_some() {
        return None;
    }
    let mut memo = BTreeMap::new();
    let mut by_level: Vec<Vec<String>> = Vec::new();
    for m in graph.keys() {
        let l = level(graph, m, &mut memo);
        if by_level.len() <= l {
            by_level.resize(l + 1, Vec::new());
        }
        by_level[l].push(m.clone());
    }
    by_level.reverse();
    Some(by_level)
}

/// [`levels`] as text, one line per level, top first: `LEVEL  module module ...`.
pub fn layer_picture(graph: &Graph) -> Option<String> {
    let levels = levels(graph)?;
    let top = levels.len().saturating_sub(1);
    Some(
        levels
            .iter()
            .enumerate()
            .map(|(i, ms)| format!("{:>2}  {}", top - i, ms.join(" ")))
            .collect::<Vec<_>>()
            .join("\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edges(list: &[(&str, &[&str])]) -> Graph {
        list.iter()
            .map(|(m, uses)| {
                let uses = uses.iter().map(|u| (*u).to_owned()).collect();
                ((*m).to_owned(), uses)
            })
            .collect()
    }

    #[test]
    fn references_are_read_from_paths_and_groups_but_not_comments() {
        let text = [
            "//! See [`crate::doc`].",
            "use crate::a::{B, C};",
            "use crate::{b, c::{D, E}, d::F};",
            "    let x = crate::e::f(notcrate::g);",
            "    /// crate::h in a doc comment",
        ]
        .join("\n");
        let found: Vec<String> = references(&text).into_iter().collect();
        assert_eq!(found, ["a", "b", "c", "d", "e"]);
    }

    #[test]
    fn test_modules_are_left_out() {
        let text = "use crate::a::B;\n#[cfg(test)]\nmod tests {\n    use crate::z;\n}\n";
        assert_eq!(non_test(text), "use crate::a::B;\n");
        let root = "mod a;\npub mod b;\n#[cfg(test)]\nmod c_tests;\npub(crate) mod d;\n";
        assert_eq!(Vec::from_iter(declared(root)), ["a", "b", "d"]);
        // A module the root declares for tests only is no node, and no edge leads to it.
        let sources: BTreeMap<String, String> = [
            ("lib", "mod a;\n#[cfg(test)]\nmod fake;\n"),
            ("a", "use crate::fake::F;\n"),
            ("fake", "use crate::a::A;\n"),
        ]
        .into_iter()
        .map(|(m, t)| (m.to_owned(), t.to_owned()))
        .collect();
        let g = graph(&sources, "lib", &[]);
        assert_eq!(Vec::from_iter(g.keys().cloned()), ["a"]);
        assert!(g["a"].is_empty(), "{}", show(&g));
    }

    #[test]
    fn root_items_lead_to_the_module_they_are_re_exported_from() {
        let sources: BTreeMap<String, String> = [
            (
                "lib",
                "mod a;\nmod b;\npub use a::{Thing, Other as O};\npub use b::Error;\n",
            ),
            ("a", "use crate::O; use crate::ROOT_CONST;"),
            ("b", "use crate::Thing; use crate::ROOT_CONST;"),
        ]
        .iter()
        .map(|(m, t)| ((*m).to_owned(), (*t).to_owned()))
        .collect();
        let g = graph(&sources, "lib", &[]);
        assert_eq!(Vec::from_iter(g.keys().cloned()), ["a", "b"]);
        assert_eq!(Vec::from_iter(g["b"].clone()), ["a"]);
        assert!(g["a"].is_empty(), "{}", show(&g));
        assert_eq!(find_cycle(&g), None);
    }

    #[test]
    fn a_cycle_is_found_and_a_layered_graph_has_none() {
        let layered = edges(&[("a", &["b", "c"]), ("b", &["c"]), ("c", &[])]);
        assert_eq!(find_cycle(&layered), None);
        assert!(modules_in_cycles(&layered).is_empty());
        let cyclic = edges(&[("a", &["b"]), ("b", &["c"]), ("c", &["a"]), ("d", &["a"])]);
        assert_eq!(
            find_cycle(&cyclic).map(|c| c.join(" -> ")).as_deref(),
            Some("a -> b -> c -> a")
        );
        assert_eq!(Vec::from_iter(modules_in_cycles(&cyclic)), ["a", "b", "c"]);
    }

    #[test]
    fn levels_put_every_module_above_what_it_uses() {
        let g = edges(&[("a", &["b", "c"]), ("b", &["c"]), ("c", &[]), ("d", &["c"])]);
        assert_eq!(levels(&g).unwrap(), [vec!["a"], vec!["b", "d"], vec!["c"]]);
        assert_eq!(layer_picture(&g).unwrap(), " 2  a\n 1  b d\n 0  c");
        let cyclic = edges(&[("a", &["b"]), ("b", &["a"])]);
        assert_eq!(levels(&cyclic), None);
    }

    #[test]
    fn string_errors_are_found_in_nested_generics_and_other_results_are_not() {
        let args = generic_args("Option<Vec<u8>>, String> {");
        assert_eq!(args, ["Option<Vec<u8>>", " String"]);
        assert_eq!(
            generic_args("HashMap<String, String>, io::Error>"),
            ["HashMap<String, String>", " io::Error"]
        );
    }

    #[test]
    fn sibling_references_are_read_alone_and_in_groups() {
        assert!(names_sibling("use super::request::{A, B};", "request"));
        assert!(names_sibling("use super::{device::X, layered};", "device"));
        assert!(!names_sibling("use super::requests::A;", "request"));
        assert!(!names_sibling("// see super::request", "request"));
        assert!(!names_sibling("use super::*;", "request"));
    }

    #[test]
    fn function_lines_are_recognised() {
        assert_eq!(fn_name("    pub(crate) async fn run(x: u8) {"), Some("run"));
        assert_eq!(fn_name("fn main() {"), Some("main"));
        assert_eq!(fn_name("    pub const fn new<T>() -> Self {"), Some("new"));
        assert_eq!(fn_name("    let f = |x| x; // fn not"), None);
        assert_eq!(fn_name("    /// fn documented()"), None);
    }
}
