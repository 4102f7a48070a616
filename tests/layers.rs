//! `src/lib.rs`'s Architecture layers point only down (this file reads its table), and no files of `src/` name one another
//! in a circle: by `crate::`, `super::`, `self::` or child paths in code, re-exports seen through.
use std::collections::{BTreeMap as Map, BTreeSet as Set};
/// Pairs of files that may name each other, with why; a circle made of such pairs passes.
const ALLOWED: &str = "backend/host/mod.rs backend/host/context.rs: re-exported; calls `error`
    backend/host/mod.rs backend/host/event.rs: re-exported; calls `error`
    backend/host/mod.rs backend/host/stream.rs: re-exported; calls `error` and `Host`
    backend/host/context.rs backend/host/stream.rs: a context and the streams it holds
    backend/host/event.rs backend/host/context.rs: an event's wait fails with its context's fault
    backend/host/stream.rs backend/host/event.rs: a stream records the events it pools
    backend/cuda/event.rs backend/cuda/fence_pool.rs: a pool and the events it lends
    any/fence.rs any/stream.rs: a stream of either backend makes fences; a fence waits on one";

/// What each layer may name besides itself, from the Architecture table of `lib_rs` (rows
/// bottom up: `| `layer` | holds | never names | also names |`), as a list of words.
fn layers(lib_rs: &str) -> Map<String, String> {
    let rows = lib_rs.lines().filter_map(|l| l.strip_prefix("//! | `"));
    let ticked = |cell: &str| Vec::from_iter(cell.split('`').skip(1).step_by(2).map(String::from));
    let (mut below, mut may) = (Vec::<String>::new(), Map::new());
    for row in rows {
        let cells: Vec<_> = row.split('|').collect();
        let (layer, never, also) = (
            row.split('`').next().unwrap(),
            ticked(cells[2]),
            ticked(cells[3]),
        );
        let names = below.iter().filter(|m| !never.contains(m)).chain(&also);
        may.insert(layer.to_owned(), Vec::from_iter(names.cloned()).join(" "));
        below.push(layer.to_owned());
    }
    may
}
type Lib = Map<String, Vec<String>>;
type Paths = Vec<Vec<String>>;

/// `text`'s paths (`a::b`) and braces, less `//` comments and strings (line by line).
fn tokens(text: &str) -> Vec<String> {
    let text = text.replace("\\\\", "").replace("\\\"", "");
    let code = text.lines().map(|l| l.split("//").next().unwrap());
    let mut code: String = code.collect::<Vec<_>>().join("\n");
    code = code.split('"').step_by(2).collect();
    for mark in ["{", "}"] {
        code = code.replace(mark, &format!(" {mark} "));
    }
    let words = code.split(|c: char| !c.is_alphanumeric() && !"_:{}*".contains(c));
    words.filter(|w| !w.is_empty()).map(String::from).collect()
}

/// The modules the path or `use` tree at `t[i]` names from module `at`, into `out`.
fn tree(t: &[String], mut i: usize, mut at: Vec<String>, lib: &Lib, out: &mut Paths) -> usize {
    for part in t[i].split("::").filter(|part| !part.is_empty()) {
        match part {
            "crate" => at.clear(),
            "super" => drop(at.pop()),
            "self" => {}
            _ if at.is_empty() && lib.contains_key(part) => at = lib[part].clone(),
            _ => at.push(part.to_owned()),
        }
    }
    if !t[i].ends_with("::") || t.get(i + 1).is_none_or(|w| w != "{") {
        out.push(at);
        return i + 1;
    }
    i += 2;
    while t.get(i).is_some_and(|w| w != "}") {
        i = tree(t, i, at.clone(), lib, out);
    }
    i + 1
}

/// The imports against the layers in files (each after a line `== path`), and the circles.
fn check(files: &str) -> (Set<String>, Vec<String>) {
    let module = |file: &str| {
        let path = file.trim_end_matches(".rs").trim_end_matches("/mod");
        Vec::from_iter(path.split('/').filter(|p| *p != "lib").map(String::from))
    };
    let files = files.split("\n== ").map(|f| f.trim_start_matches("== "));
    let files: Vec<_> = files.filter_map(|file| file.split_once('\n')).collect();
    let mods: Map<_, _> = files.iter().map(|(f, _)| (module(f), *f)).collect();
    let has = |list: &str, word: &str| list.split_whitespace().any(|w| w == word);
    let lib_rs = files.iter().find(|f| f.0 == "lib.rs").map_or("", |f| f.1);
    let may = layers(lib_rs);
    let (mut lib, mut bad, mut edges) = (Lib::new(), Set::new(), Set::new());
    for &(file, text) in files.iter().filter(|f| f.0 == "lib.rs").chain(&files) {
        // In the `mod tests` that ends a file, `super` is the file; other inline mods read as it.
        let (text, tests) = text.split_once("\nmod tests {").unwrap_or((text, ""));
        let t = [tokens(text), tokens(&tests.replace("super::", "self::"))].concat();
        let (here, mut paths, mut i) = (module(file), Vec::new(), 0);
        let mut walk = |i| tree(&t, i, here.clone(), &lib, &mut paths);
        while let Some(w) = t.get(i).map(|w| w.split("::").next().unwrap()) {
            let child = mods.contains_key(&[&here[..], &[w.to_owned()]].concat());
            let named = t[i].contains("::") && (child || ["crate", "self", "super"].contains(&w));
            i = if named { walk(i) } else { i + 1 };
        }
        let from = here.first().map_or("lib", String::as_str);
        let list = may.get(from).cloned().unwrap_or_default() + " " + from;
        for path in paths {
            let (name, shown) = (path[..path.len().min(2)].join("::"), path.join("::"));
            if from != "lib" && !has(&list, &path[0]) && !has(&list, &name) {
                bad.insert(format!("src/{file}: `{from}` names `crate::{shown}`"));
            }
            let to = (0..=path.len()).rev().find_map(|n| mods.get(&path[..n]));
            let to = to.filter(|&&to| to != file && to != "lib.rs");
            edges.extend(to.map(|&to| (file, to)));
            if from == "lib" {
                lib.insert(path.last().unwrap().clone(), path);
            }
        }
    }
    let pairs: Vec<_> = ALLOWED.lines().filter_map(|l| l.split_once(':')).collect();
    let pair = |s: &[&str]| pairs.iter().any(|p| has(p.0, s[0]) && has(p.0, s[1]));
    let (mut paths, mut circles) = (Vec::from_iter(files.iter().map(|f| vec![f.0])), vec![]);
    while let Some(path) = paths.pop() {
        for &(_, next) in edges.iter().filter(|e| e.0 == *path.last().unwrap()) {
            let longer = [&path[..], &[next]].concat();
            if next == path[0] && !longer.windows(2).all(pair) {
                circles.push(longer.join(" -> "));
            } else if next > path[0] && !path.contains(&next) {
                paths.push(longer);
            }
        }
    }
    circles.sort();
    (bad, circles)
}

#[test]
fn src_keeps_to_the_layers_and_names_no_circle() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/src/");
    let (mut dirs, mut src) = (vec![std::path::PathBuf::from(root)], String::new());
    while let Some(dir) = dirs.pop() {
        for path in std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()) {
            let name = path.strip_prefix(root).unwrap().to_string_lossy();
            match std::fs::read_to_string(&path) {
                Ok(text) => src += &format!("\n== {}\n{text}", name.replace('\\', "/")),
                Err(_) => dirs.push(path), // a folder
            }
        }
    }
    let (bad, circles) = check(&src);
    assert!(bad.is_empty(), "imports against the layers: {bad:#?}");
    assert!(!ALLOWED.contains("waiter/") && !ALLOWED.contains("drop_queue/"));
    assert!(circles.is_empty(), "circles:\n{}", circles.join("\n"));
}

/// The check itself: planted bad imports and circles are found; comments and strings name none.
#[test]
fn a_forbidden_import_and_a_planted_circle_are_found() {
    let tree = "== lib.rs\n//! | `api` | | | |\n//! | `event` | | `api` | `waiter::W` |
//! | `fence` | | | |\n//! | `waiter` | | | |\npub use waiter::Waiter;
== fence.rs\nuse crate::{event::E, Waiter};\n== event.rs\nuse crate::{api::A, waiter::W};
== api.rs\nuse crate::loom;\n== waiter/mod.rs\nuse crate::fence::F;\nmod c;\nmod d;\nmod e;
pub use self::c::C;\npub use d::D;\n== waiter/c.rs\nfn f(_: super::P) {}\n== waiter/d.rs
pub struct D;\nmod tests {\n    use super::*;\n}\n== waiter/e.rs\nuse super::P;";
    let (bad, circles) = check(tree);
    let expected = "src/api.rs: `api` names `crate::loom`\nsrc/event.rs: `event` names `crate::api::A`
src/fence.rs: `fence` names `crate::waiter::Waiter`\nevent.rs -> waiter/mod.rs -> fence.rs -> event.rs
fence.rs -> waiter/mod.rs -> fence.rs\nwaiter/c.rs -> waiter/mod.rs -> waiter/c.rs";
    assert_eq!([Vec::from_iter(bad), circles].concat().join("\n"), expected);
    let clean = "== a.rs\nuse crate::b;\n== b.rs\n// crate::a\nconst A: &str = \"crate::a\";";
    assert!(check(clean).1.is_empty());
}

/// The house the Architecture section describes: few files at the root, a front door in every
/// folder, and `unsafe` only in the CUDA FFI file and the operating-system file.
#[test]
fn src_has_few_root_files_a_front_door_per_folder_and_unsafe_in_two_files() {
    let root = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src"));
    let (mut dirs, mut root_files, mut unsafe_files) = (vec![root.clone()], 0, vec![]);
    while let Some(dir) = dirs.pop() {
        let entries = Vec::from_iter(std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()));
        let has = |name: &str| entries.iter().any(|p| p.file_name().unwrap() == name);
        assert!(
            dir == root || has("mod.rs"),
            "{} has no mod.rs",
            dir.display()
        );
        for path in entries {
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            root_files += usize::from(dir == root);
            let text = std::fs::read_to_string(&path).unwrap();
            if text.contains("allow(unsafe_code)") {
                let name = path.strip_prefix(&root).unwrap().to_string_lossy();
                unsafe_files.push(name.replace('\\', "/"));
            }
        }
    }
    assert!(root_files <= 8, "{root_files} .rs files directly in src/");
    unsafe_files.sort();
    assert_eq!(unsafe_files, ["backend/cuda/driver.rs", "os.rs"]);
}
