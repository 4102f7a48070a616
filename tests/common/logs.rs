//! Captures log records so tests can assert that a fallback warned.
//!
//! The capture is process-wide and tests run in parallel, so a test must
//! never count all records: it looks only for records that carry a text only
//! it produces (its fault plan's label, which `faulty::inject` keeps unique,
//! or a panic message of its own).

use std::sync::{Mutex, Once};

static RECORDS: Mutex<Vec<(log::Level, String)>> = Mutex::new(Vec::new());
static INSTALL: Once = Once::new();

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
            .push((record.level(), line));
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
