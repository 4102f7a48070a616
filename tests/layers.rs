//! The layers of `src/lib.rs`'s Architecture table point only down: every
//! `crate::` path in a module's files (in `use` lines and in code; comments,
//! doc comments and string literals are skipped) names a module its layer
//! may import. The table below mirrors the one in `lib.rs`, by top-level
//! module, so files added to a folder are checked as they appear.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Modules every layer may import: the helpers, `api` and `error`.
const ANYWHERE: &[&str] = &[
    "loom",
    "fault_log",
    "own_threads",
    "panics",
    "fork",
    "plant",
    "shards",
    "idle_pool",
    "live_events",
    "error",
    "api",
];

/// Each top-level module and the modules it may import, besides itself and
/// [`ANYWHERE`] (for `api` and `error`, the whole list), bottom up as in
/// the Architecture table of `src/lib.rs`.
const LAYERS: &[(&str, &[&str])] = &[
    // The contract and the error: nothing else of the crate.
    ("error", &[]),
    ("api", &["error"]),
    // The helpers serve every layer and name none.
    ("loom", ANYWHERE),
    ("fault_log", ANYWHERE),
    ("own_threads", ANYWHERE),
    ("panics", ANYWHERE),
    ("fork", ANYWHERE),
    ("plant", ANYWHERE),
    ("shards", ANYWHERE),
    ("idle_pool", ANYWHERE),
    ("live_events", ANYWHERE),
    // Backends: not `event`, `fence`, the waiter or anything above (see
    // EXCEPTIONS for the fence they offer).
    ("backend", ANYWHERE),
    // Generic over `EventApi`: no backend by name.
    ("event", ANYWHERE),
    ("fence", &["event"]),
    ("waiter", &["event", "fence"]),
    // Either backend's fence, built on fences and the waiter.
    (
        "any_fence",
        &["backend", "event", "fence", "waiter", "any_stream"],
    ),
    (
        "any_stream",
        &["backend", "event", "fence", "waiter", "any_fence"],
    ),
    // Built on fences and the waiter; not on one another.
    (
        "profiler",
        &["backend", "event", "fence", "waiter", "any_fence"],
    ),
    (
        "drop_queue",
        &["backend", "event", "fence", "waiter", "any_fence"],
    ),
    // Either backend's profiler, on the profiler and `AnyStream`.
    (
        "any_profiler",
        &[
            "backend",
            "event",
            "fence",
            "waiter",
            "any_fence",
            "any_stream",
            "profiler",
        ],
    ),
];

/// Names a layer may import from a module it may not import otherwise:
/// (importing module, imported module, name).
const EXCEPTIONS: &[(&str, &str, &str)] = &[
    // `HostStream::fence` and `cuda::fence` hand out fences.
    ("backend", "fence", "EventFence"),
];

/// Crate-root names that are modules of another name.
const MODULE_ALIASES: &[(&str, &str)] = &[("host", "backend"), ("cuda", "backend")];

/// One `crate::` path found in a file.
#[derive(Debug)]
struct Import {
    line: usize,
    /// The path's segments after `crate::`.
    path: Vec<String>,
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("reading {}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// `text` with comments (doc comments too), string literals and character
/// literals blanked out, lines kept, so what is left is code.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && !chars[..i]
                .last()
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                match chars.get(j) {
                    None => break,
                    Some('"') if (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    _ => j += 1,
                }
            }
            for &skipped in &chars[i..j.min(chars.len())] {
                out.push(blank(skipped));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < chars.len() {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}'), not a lifetime.
            let end = if next == Some('\\') {
                chars[i + 2..]
                    .iter()
                    .position(|&c| c == '\'')
                    .map(|p| i + 2 + p)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for _ in i..=end {
                        out.push(' ');
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Every `crate::` path in `code`, a `use` tree expanded into its paths.
fn imports(code: &str) -> Vec<Import> {
    let chars: Vec<char> = code.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while let Some(at) = find(&chars, i, "crate::") {
        i = at + "crate::".len();
        let before = at.checked_sub(1).map(|b| chars[b]);
        if before.is_some_and(|b| b.is_alphanumeric() || b == '_' || b == '$') {
            continue;
        }
        let line = 1 + chars[..at].iter().filter(|&&c| c == '\n').count();
        let mut paths = Vec::new();
        let end = use_tree(&chars, i, Vec::new(), &mut paths);
        i = end;
        for path in paths {
            if !path.is_empty() {
                found.push(Import { line, path });
            }
        }
    }
    found
}

fn find(chars: &[char], from: usize, needle: &str) -> Option<usize> {
    let needle: Vec<char> = needle.chars().collect();
    (from..chars.len().saturating_sub(needle.len() - 1))
        .find(|&at| chars[at..].starts_with(&needle))
}

fn skip_space(chars: &[char], mut i: usize) -> usize {
    while chars.get(i).is_some_and(|c| c.is_whitespace()) {
        i += 1;
    }
    i
}

/// Parse a path or `use` tree at `i` (after `crate::`), pushing each full
/// path (prefixed by `prefix`) into `out`; returns where it ended.
fn use_tree(
    chars: &[char],
    i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let mut i = skip_space(chars, i);
    loop {
        if chars.get(i) == Some(&'{') {
            i += 1;
            loop {
                i = skip_space(chars, i);
                match chars.get(i) {
                    None => return i,
                    Some('}') => return i + 1,
                    Some(',') => i += 1,
                    Some(_) => {
                        let end = use_tree(chars, i, prefix.clone(), out);
                        if end == i {
                            i += 1; // not a path: skip it
                        } else {
                            i = end;
                        }
                    }
                }
            }
        }
        let start = i;
        while chars
            .get(i)
            .is_some_and(|c| c.is_alphanumeric() || *c == '_')
        {
            i += 1;
        }
        if start == i {
            out.push(prefix);
            return i;
        }
        prefix.push(chars[start..i].iter().collect());
        let after = skip_space(chars, i);
        if chars.get(after) == Some(&':') && chars.get(after + 1) == Some(&':') {
            i = skip_space(chars, after + 2);
        } else {
            out.push(prefix);
            return i;
        }
    }
}

/// The crate-root names `src/lib.rs` re-exports, with the top-level module
/// each comes from.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let code = code_only(lib);
    let chars: Vec<char> = code.chars().collect();
    let mut names = BTreeMap::new();
    let mut i = 0;
    while let Some(at) = find(&chars, i, "pub use ") {
        i = at + "pub use ".len();
        let mut paths = Vec::new();
        let end = use_tree(&chars, i, Vec::new(), &mut paths);
        i = end;
        for path in paths {
            if let (Some(module), Some(name)) = (path.first(), path.last()) {
                names.insert(name.clone(), module.clone());
            }
        }
    }
    names
}

/// The top-level module a file under `src/` belongs to; `None` for `lib.rs`.
fn module_of(file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src()).unwrap();
    let mut parts = relative.components();
    let first = parts.next()?.as_os_str().to_str()?.to_owned();
    if parts.next().is_some() {
        return Some(first);
    }
    match first.strip_suffix(".rs")? {
        "lib" => None,
        name => Some(name.to_owned()),
    }
}

/// What an import names: (module, the name imported from it, if any), or
/// an error for a name this test cannot place.
fn resolve(
    path: &[String],
    modules: &[&str],
    reexports: &BTreeMap<String, String>,
) -> Result<(String, Option<String>), String> {
    let first = path[0].as_str();
    if let Some((_, module)) = MODULE_ALIASES.iter().find(|(alias, _)| *alias == first) {
        return Ok(((*module).to_owned(), path.get(1).cloned()));
    }
    if modules.contains(&first) {
        return Ok((first.to_owned(), path.get(1).cloned()));
    }
    match reexports.get(first) {
        Some(module) => {
            let module = MODULE_ALIASES
                .iter()
                .find(|(alias, _)| alias == module)
                .map_or(module.as_str(), |(_, target)| target);
            Ok((module.to_owned(), Some(first.to_owned())))
        }
        None => Err(format!(
            "`crate::{first}` is neither a module in tests/layers.rs's table nor a name \
             src/lib.rs re-exports"
        )),
    }
}

/// The violations in `files` (path, text), one line each.
fn violations(files: &[(PathBuf, String)], lib: &str) -> Vec<String> {
    let modules: Vec<&str> = LAYERS.iter().map(|(module, _)| *module).collect();
    let reexports = reexports(lib);
    let mut found = Vec::new();
    for (file, text) in files {
        let Some(module) = module_of(file) else {
            continue;
        };
        let shown = file
            .strip_prefix(src().parent().unwrap())
            .unwrap()
            .display();
        let Some((_, allowed)) = LAYERS.iter().find(|(name, _)| *name == module) else {
            found.push(format!(
                "{shown}: module `{module}` is not in tests/layers.rs's table of layers: add it \
                 (and to the Architecture table in src/lib.rs)"
            ));
            continue;
        };
        let allowed_anywhere = !matches!(module.as_str(), "api" | "error");
        for import in imports(&code_only(text)) {
            let (target, name) = match resolve(&import.path, &modules, &reexports) {
                Ok(resolved) => resolved,
                Err(why) => {
                    found.push(format!("{shown}:{}: {why}", import.line));
                    continue;
                }
            };
            let ok = target == module
                || allowed.contains(&target.as_str())
                || (allowed_anywhere && ANYWHERE.contains(&target.as_str()))
                || EXCEPTIONS.iter().any(|(from, to, allowed_name)| {
                    *from == module && *to == target && name.as_deref() == Some(*allowed_name)
                });
            if !ok {
                found.push(format!(
                    "{shown}:{}: `crate::{}`: layer `{module}` may not import `{target}` (see \
                     the Architecture table in src/lib.rs)",
                    import.line,
                    import.path.join("::"),
                ));
            }
        }
    }
    found
}

fn read_src() -> (Vec<(PathBuf, String)>, String) {
    let mut paths = Vec::new();
    rust_files(&src(), &mut paths);
    let files = paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            (path, text)
        })
        .collect();
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    (files, lib)
}

#[test]
fn every_layer_imports_only_what_the_architecture_table_allows() {
    let (files, lib) = read_src();
    assert!(files.len() > 10, "src/ was found and read");
    let found = violations(&files, &lib);
    let mut message = String::new();
    for line in &found {
        writeln!(message, "  {line}").unwrap();
    }
    assert!(found.is_empty(), "imports against the layers:\n{message}");
}

#[test]
fn the_table_covers_every_top_level_module() {
    let (files, _) = read_src();
    for (file, _) in &files {
        if let Some(module) = module_of(file) {
            assert!(
                LAYERS.iter().any(|(name, _)| *name == module),
                "{}: module `{module}` is not in the table",
                file.display()
            );
        }
    }
}

/// The check itself: it sees through comments and strings, expands `use`
/// trees, resolves crate-root names, and names the file and line.
#[test]
fn a_forbidden_import_is_reported_with_its_file_and_line() {
    let lib = "pub use fence::EventFence;\npub use waiter::{Waiter, FenceFuture};\n";
    let file = |path: &str, text: &str| (src().join(path), text.to_owned());
    let files = [
        file(
            "fence.rs",
            "// crate::waiter in a comment\n/// [`Waiter`](crate::Waiter)\n\
             const S: &str = \"crate::waiter\";\nuse crate::{event::Event,\n    Waiter};\n",
        ),
        file(
            "waiter/pool.rs",
            "fn f() { crate::backend::host::Host::x(); }\n",
        ),
        file(
            "backend/host/stream.rs",
            "use crate::{EventFence, FenceFuture};\n",
        ),
        file("event.rs", "use crate::host::Host;\n"),
        file("api.rs", "use crate::loom::Mutex;\n"),
        file(
            "drop_queue.rs",
            "use crate::profiler::Profile;\nuse crate::AnyFence as _;\n",
        ),
    ];
    let lib = format!("{lib}pub use any_fence::AnyFence;\n");
    let found = violations(&files, &lib);
    let expected = [
        "src/fence.rs:4: `crate::Waiter`: layer `fence` may not import `waiter`",
        "src/waiter/pool.rs:1: `crate::backend::host::Host::x`: layer `waiter` may not import `backend`",
        "src/backend/host/stream.rs:1: `crate::FenceFuture`: layer `backend` may not import `waiter`",
        "src/event.rs:1: `crate::host::Host`: layer `event` may not import `backend`",
        "src/api.rs:1: `crate::loom::Mutex`: layer `api` may not import `loom`",
        "src/drop_queue.rs:1: `crate::profiler::Profile`: layer `drop_queue` may not import `profiler`",
    ];
    assert_eq!(found.len(), expected.len(), "{found:#?}");
    for (found, expected) in found.iter().zip(expected) {
        assert!(found.starts_with(expected), "{found}\nexpected {expected}");
    }
}
