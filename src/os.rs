//! The crate's dealings with the operating system, and its only `unsafe` outside the CUDA FFI
//! file: whether this process is a fork, which threads are the crate's own, and what the
//! operating system says of (and lets the crate set for) the calling thread.
//!
//! - **Forks.** A forked child has only the thread that called `fork`: a pool's threads, and
//!   whoever held its locks at that moment, stay in the parent, while the child inherits their
//!   counts. A pool remembers the generation it was made in and, in a child, refuses waits
//!   instead of queuing them for threads that do not exist. The generation is a counter that a
//!   `pthread_atfork` child handler bumps: one relaxed load to read, on every hand-off.
//! - **Own threads.** The waiter's and the drop queue's threads mark themselves when they start.
//!   A backend may leave per-thread driver state on them that it must restore on its callers'
//!   threads (the CUDA backend leaves a context bound: `backend/cuda/bind.rs`).
//! - **Timer slack.** How late Linux may end a thread's sleeps, to batch wake-ups. The default,
//!   50 us, would swamp a sleep meant to end a few microseconds before a stream's work does, so a
//!   thread that sleeps to a predicted end lowers its own (`PR_SET_TIMERSLACK`, prctl(2)).
//! - **CPU time** of the calling thread (`CLOCK_THREAD_CPUTIME_ID`, clock_gettime(2)), which the
//!   waiter reports for its watcher.
//! - **Exit handlers** (atexit(3)), which the CUDA backend uses to stop reading memory that the
//!   driver's own exit handler may free.
//!
//! This file names no other layer of the crate.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(multi_threading)]
use std::time::Duration;

/// How many forks separate this process from the one that first asked.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The current fork generation, tracking forks from the first call on: take it when a pool
/// is made, and compare later reads of [`fork_generation`] with it.
pub(crate) fn track_forks() -> u64 {
    #[cfg(unix)]
    {
        static WATCH: std::sync::Once = std::sync::Once::new();
        WATCH.call_once(|| {
            // SAFETY: `pthread_atfork` takes three optional handlers and keeps them for the life
            // of the process; the one given is a plain `extern "C"` function that lives as long,
            // takes no arguments and does only what a child handler may (an atomic add:
            // async-signal-safe, no lock, no allocation).
            let status = unsafe { libc::pthread_atfork(None, None, Some(forked)) };
            if status != 0 {
                log::warn!(
                    "pthread_atfork failed ({status}): a waiter used in a forked child may hang"
                );
            }
        });
    }
    fork_generation()
}

/// The current fork generation, for comparing with one taken by [`track_forks`].
pub(crate) fn fork_generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// Run `handler` as the process exits (`atexit`), before the exit handlers registered earlier
/// (unix; elsewhere never); false where `atexit` refused it, which is logged (elsewhere than unix
/// nothing is registered, and nothing refused: true).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn at_exit(handler: extern "C" fn()) -> bool {
    #[cfg(unix)]
    {
        // SAFETY: atexit(3) keeps the pointer for the life of the process, and `handler` is a
        // plain `extern "C"` function that lives as long and takes no arguments; an `extern "C"`
        // function cannot unwind into libc's `exit` (a panic in it aborts).
        let registered = unsafe { libc::atexit(handler) } == 0;
        if !registered {
            log::warn!("atexit refused the crate's exit handler");
        }
        registered
    }
    #[cfg(not(unix))]
    {
        let _ = handler;
        true
    }
}

/// Runs in a forked child, in its one thread, before `fork` returns there.
#[cfg(unix)]
extern "C" fn forked() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

thread_local! {
    static OWN: Cell<bool> = const { Cell::new(false) };
}

/// Mark the calling thread as one of the crate's own, for its whole life. Called first thing by
/// every thread the crate starts.
#[cfg(multi_threading)]
pub(crate) fn mark_own_thread() {
    OWN.with(|own| own.set(true));
}

/// Whether the calling thread is one of the crate's own.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn is_own_thread() -> bool {
    OWN.with(Cell::get)
}

/// Lower the calling thread's timer slack to a microsecond (Linux; elsewhere nothing). A refusal
/// only leaves the sleeps as late as before, so it is not reported.
#[cfg(multi_threading)]
pub(crate) fn lower_timer_slack() {
    #[cfg(all(target_os = "linux", not(device_events_loom)))]
    {
        let slack_nanos: libc::c_ulong = 1_000;
        // SAFETY: prctl(2) with PR_SET_TIMERSLACK reads its second argument as an unsigned long
        // by value (the slack in nanoseconds) and touches no memory of ours; it changes only the
        // calling thread's timer slack, which nothing in this process relies on.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, slack_nanos) };
    }
}

/// The CPU time the calling thread has used; `None` if the clock is refused or not read on this
/// system.
#[cfg(multi_threading)]
pub(crate) fn thread_cpu_time() -> Option<Duration> {
    #[cfg(all(target_os = "linux", not(device_events_loom)))]
    {
        let mut time = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime(2) writes one `struct timespec` to the valid, exclusive pointer
        // it is given, and touches nothing else.
        let status = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut time) };
        let seconds = u64::try_from(time.tv_sec).ok()?;
        let nanos = u32::try_from(time.tv_nsec).ok()?;
        (status == 0).then(|| Duration::new(seconds, nanos))
    }
    #[cfg(not(all(target_os = "linux", not(device_events_loom))))]
    None
}

#[cfg(all(test, target_os = "linux", not(device_events_loom)))]
mod tests {
    #[test]
    fn a_thread_that_spins_sees_its_cpu_time_grow_and_a_new_thread_starts_near_zero() {
        let start = super::thread_cpu_time().expect("Linux has a thread CPU clock");
        let spun = std::time::Instant::now();
        while spun.elapsed() < std::time::Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let after = super::thread_cpu_time().unwrap();
        assert!(after > start, "{after:?} after {start:?}");
        // Another thread's clock is its own: a new thread starts near zero.
        let fresh = std::thread::spawn(|| super::thread_cpu_time().unwrap())
            .join()
            .unwrap();
        assert!(fresh < std::time::Duration::from_millis(5), "{fresh:?}");
    }
}
