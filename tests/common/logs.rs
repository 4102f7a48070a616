//! Captures log records so tests can assert that a fallback warned.
//!
//! The capture is process-wide and tests run in parallel, so a test must
//! never count all records: it looks only for records that carry a text only
//! it produces (its fault plan's label, which `faulty::inject` keeps unique,
//! or a panic message of its own).

use std::sync::{Arc, Mutex, Once};

static RECORDS: Mutex<Vec<(log::Level, String)>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

/// Code run on the logging thread as a line is logged ([`on_line`]).
type Hook = Arc<dyn Fn(&str) + Send + Sync>;
static HOOKS: Mutex<Vec<(String, Hook)>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        // With the logging thread's name: a test can tell who logged.
        let thread = std::thread::current();
        let line = format!("[{}] {}", thread.name().unwrap_or("?"), record.args());
        RECORDS
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .push((record.level(), line.clone()));
        let hooks: Vec<Hook> = (HOOKS.lock().unwrap_or_else(|poison| poison.into_inner()))
            .iter()
            .filter(|(needle, _)| line.contains(needle.as_str()))
            .map(|(_, hook)| hook.clone())
            .collect();
        hooks.iter().for_each(|hook| hook(&line));
    }

    fn flush(&self) {}
}

/// Install the capturing logger (once per test binary).
pub fn capture() {
    INSTALL.call_once(|| {
        log::set_logger(&Capture).expect("no other logger in tests");
        log::set_max_level(log::LevelFilter::Trace);
    });
}

/// Run `hook` on the logging thread, in the logger's call, for each line
/// containing `needle` (once it is captured): a logger that is slow, or
/// that calls back into the crate.
pub fn on_line(needle: &str, hook: impl Fn(&str) + Send + Sync + 'static) {
    (HOOKS.lock().unwrap_or_else(|poison| poison.into_inner()))
        .push((needle.to_owned(), Arc::new(hook)));
}

/// Warnings logged so far whose text contains `needle`.
pub fn warnings_containing(needle: &str) -> Vec<String> {
    containing(log::Level::Warn, needle)
}

/// Info lines logged so far whose text contains `needle`.
pub fn infos_containing(needle: &str) -> Vec<String> {
    containing(log::Level::Info, needle)
}

/// Debug lines logged so far whose text contains `needle`.
pub fn debugs_containing(needle: &str) -> Vec<String> {
    containing(log::Level::Debug, needle)
}

/// Errors logged so far whose text contains `needle`.
pub fn errors_containing(needle: &str) -> Vec<String> {
    containing(log::Level::Error, needle)
}

fn containing(level: log::Level, needle: &str) -> Vec<String> {
    RECORDS
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .iter()
        .filter(|(logged, line)| *logged == level && line.contains(needle))
        .map(|(_, line)| line.clone())
        .collect()
}
