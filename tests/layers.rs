//! `src/lib.rs`'s Architecture layers point only down, and no files of `src/` name one another
//! in a circle: by `crate::`, `super::`, `self::` or child paths in code, re-exports seen through.
use std::collections::{BTreeMap as Map, BTreeSet as Set};
/// Each layer, bottom up as in the Architecture table, and what it may import besides itself
/// (`module::Name`: that name only; a module in no layer: nothing); `*`: the helpers.
const LAYERS: &str = "*: api error loom fault_log own_threads panics fork plant shards idle_pool progress_word os_thread
    live_events checked latency_histogram; error:; api: error progress_word; event: *; fence: * event; waiter: * event fence; backend: *
    fence::EventFence; any_fence: * backend event fence waiter any_stream; any_stream: * backend
    event fence waiter any_fence; profiler: * backend event fence waiter any_fence; drop_queue: *
    backend event fence waiter any_fence; any_profiler: * backend event fence waiter any_fence
    any_stream profiler";
/// Pairs of files that may name each other, with why; a circle made of such pairs passes.
const ALLOWED: &str = "backend/host/mod.rs backend/host/context.rs: re-exported; calls `error`
    backend/host/mod.rs backend/host/event.rs: re-exported; calls `error`
    backend/host/mod.rs backend/host/stream.rs: re-exported; calls `error` and `Host`
    backend/host/context.rs backend/host/stream.rs: a context and the streams it holds
    backend/host/event.rs backend/host/context.rs: an event's wait fails with its context's fault
    backend/host/stream.rs backend/host/event.rs: a stream records the events it pools
    backend/cuda/event.rs backend/cuda/fence_pool.rs: a pool and the events it lends
    any_fence.rs any_stream.rs: a stream of either backend makes fences; a fence waits on one";
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
    let layers = LAYERS.split(';').filter_map(|l| l.split_once(':'));
    let layers: Map<_, _> = layers.map(|(m, list)| (m.trim(), list)).collect();
    let helpers = layers["*"].split_whitespace().map(|m| (m, "*"));
    let may: Map<_, _> = helpers.chain(layers.clone()).collect(); // `api`, `error`: own lists
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
        let list = may.get(from).unwrap_or(&"").replace('*', layers["*"]) + " " + from;
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
    let tree = "== lib.rs\npub use waiter::Waiter;\n== fence.rs\nuse crate::{event::E, Waiter};
== api.rs\nuse crate::loom;\n== waiter/mod.rs\nuse crate::fence::F;\nmod c;\nmod d;\nmod e;
pub use self::c::C;\npub use d::D;\n== waiter/c.rs\nfn f(_: super::P) {}\n== waiter/d.rs
pub struct D;\nmod tests {\n    use super::*;\n}\n== waiter/e.rs\nuse super::P;";
    let (bad, circles) = check(tree);
    let expected = "src/api.rs: `api` names `crate::loom`
src/fence.rs: `fence` names `crate::waiter::Waiter`\nfence.rs -> waiter/mod.rs -> fence.rs
waiter/c.rs -> waiter/mod.rs -> waiter/c.rs";
    assert_eq!([Vec::from_iter(bad), circles].concat().join("\n"), expected);
    let clean = "== a.rs\nuse crate::b;\n== b.rs\n// crate::a\nconst A: &str = \"crate::a\";";
    assert!(check(clean).1.is_empty());
}
