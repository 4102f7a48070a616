//! Skipped tests, told in the test run's normal output: the harness captures
//! what a passing test prints, so a test that skips (no GPU, one device, no C
//! compiler) would otherwise look like a pass. Each binary prints, as it
//! exits, one line per reason with how many of its tests skipped for it.
// FFI (atexit, getpid), each unsafe block with a SAFETY note.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, Once};

/// How many tests skipped, by reason; the process that counted them.
static SKIPPED: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());
static REGISTER: Once = Once::new();
static COUNTED_IN: AtomicI32 = AtomicI32::new(0);

/// Record that `test` skips for `reason`: at the binary's exit a line tells
/// how many skipped for each reason (`test` is in the captured output).
pub fn skip(test: &str, reason: impl std::fmt::Display) {
    let reason = reason.to_string();
    eprintln!("skipping {test}: {reason}");
    *SKIPPED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .entry(reason)
        .or_default() += 1;
    REGISTER.call_once(|| {
        // SAFETY: `getpid` has no preconditions.
        COUNTED_IN.store(unsafe { libc::getpid() }, Ordering::SeqCst);
        // SAFETY: `tell` is a plain `extern "C" fn()` that lives as long as
        // the process, and calls nothing that panics (a failed write is
        // ignored), so it never unwinds into libc's `exit`.
        unsafe { libc::atexit(tell) };
    });
}

/// Print the counts, straight to the process's stderr (past the harness's
/// capture). Not in a forked child that exits normally.
extern "C" fn tell() {
    // SAFETY: `getpid` has no preconditions.
    if unsafe { libc::getpid() } != COUNTED_IN.load(Ordering::SeqCst) {
        return;
    }
    let Ok(skipped) = SKIPPED.try_lock() else {
        return;
    };
    let binary = std::env::args_os().next().unwrap_or_default();
    let binary = binary.to_string_lossy();
    let binary = binary.rsplit('/').next().unwrap_or_default();
    let binary = binary.rsplit_once('-').map_or(binary, |(name, _hash)| name);
    let mut stderr = std::io::stderr().lock();
    for (reason, count) in skipped.iter() {
        let tests = if *count == 1 { "test" } else { "tests" };
        let _ = writeln!(stderr, "SKIPPED {count} {tests} of {binary}: {reason}");
    }
}
