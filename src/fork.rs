//! Whether this process is a `fork()` of the one that made a thread pool.
//!
//! A forked child has only the thread that called `fork`: a pool's threads,
//! and whoever held its locks at that moment, stay in the parent, while the
//! child inherits their counts. A pool remembers the generation it was made
//! in and, in a child, refuses waits instead of queuing them for threads
//! that do not exist. The generation is a counter that a `pthread_atfork`
//! child handler bumps: one relaxed load to read, on every hand-off.
//!
//! This file names no other layer of the crate.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// How many forks separate this process from the one that first asked.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The current generation, watching for forks from the first call on: take
/// it when a pool is made, and compare later reads with it.
pub(crate) fn generation() -> u64 {
    watch();
    GENERATION.load(Ordering::Relaxed)
}

/// The current generation, for comparing with one taken by
/// [`generation`] (which started the watch).
pub(crate) fn current() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

#[cfg(unix)]
fn watch() {
    static WATCH: std::sync::Once = std::sync::Once::new();
    WATCH.call_once(|| {
        // SAFETY: `pthread_atfork` takes three optional handlers and keeps
        // them for the life of the process; the one given is a plain
        // `extern "C"` function that lives as long, takes no arguments and
        // does only what a child handler may (an atomic add: async-signal-
        // safe, no lock, no allocation).
        let status = unsafe { pthread_atfork(None, None, Some(forked)) };
        if status != 0 {
            log::warn!(
                "pthread_atfork failed ({status}): a waiter used in a forked child may hang"
            );
        }
    });
}

#[cfg(not(unix))]
fn watch() {}

/// Runs in a forked child, in its one thread, before `fork` returns there.
#[cfg(unix)]
extern "C" fn forked() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

#[cfg(unix)]
extern "C" {
    /// POSIX: register fork handlers (in libc on every Unix Rust supports).
    fn pthread_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
    ) -> std::ffi::c_int;
}
