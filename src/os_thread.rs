//! What the operating system says of the calling thread, and the one setting the crate changes
//! for its own threads:
//!
//! - its timer slack: how late Linux may end its sleeps, to batch wake-ups. The default, 50 us,
//!   would swamp a sleep meant to end a few microseconds before a stream's work does, so a
//!   thread that sleeps to a predicted end lowers its own (`PR_SET_TIMERSLACK`, prctl(2));
//! - its CPU time (`CLOCK_THREAD_CPUTIME_ID`, clock_gettime(2)), which the waiter reports for
//!   its watcher.
//!
//! This file names no other layer of the crate.
#![allow(unsafe_code)]

use std::time::Duration;

/// The slack a watching thread asks for, in nanoseconds.
#[cfg(all(target_os = "linux", not(device_events_loom)))]
const SLACK_NANOS: std::ffi::c_ulong = 1_000;

/// Lower the calling thread's timer slack to a microsecond (Linux; elsewhere nothing). A refusal
/// only leaves the sleeps as late as before, so it is not reported.
pub(crate) fn lower_timer_slack() {
    #[cfg(all(target_os = "linux", not(device_events_loom)))]
    {
        extern "C" {
            fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
        }
        const PR_SET_TIMERSLACK: std::ffi::c_int = 29;
        // SAFETY: prctl(2) with PR_SET_TIMERSLACK reads its second argument as an unsigned long
        // by value (the slack in nanoseconds, passed as one) and touches no memory of ours; it
        // changes only the calling thread's timer slack, which nothing in this process relies on.
        unsafe { prctl(PR_SET_TIMERSLACK, SLACK_NANOS) };
    }
}

/// The CPU time the calling thread has used; `None` if the clock is refused.
#[cfg(all(target_os = "linux", not(device_events_loom)))]
pub(crate) fn cpu_time() -> Option<Duration> {
    /// `struct timespec` on Linux: `time_t` and `long` are both the C `long`.
    #[repr(C)]
    struct Timespec {
        seconds: std::ffi::c_long,
        nanos: std::ffi::c_long,
    }
    extern "C" {
        fn clock_gettime(clock: std::ffi::c_int, time: *mut Timespec) -> std::ffi::c_int;
    }
    const CLOCK_THREAD_CPUTIME_ID: std::ffi::c_int = 3;
    let mut time = Timespec {
        seconds: 0,
        nanos: 0,
    };
    // SAFETY: clock_gettime(2) writes one `struct timespec` (two C longs on Linux, as `Timespec`
    // is laid out) to the valid, exclusive pointer it is given, and touches nothing else.
    let status = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut time) };
    let seconds = u64::try_from(time.seconds).ok()?;
    let nanos = u32::try_from(time.nanos).ok()?;
    (status == 0).then(|| Duration::new(seconds, nanos))
}

/// The CPU time the calling thread has used: not read on this system.
#[cfg(not(all(target_os = "linux", not(device_events_loom))))]
pub(crate) fn cpu_time() -> Option<Duration> {
    None
}

#[cfg(all(test, target_os = "linux", not(device_events_loom)))]
mod tests {
    #[test]
    fn a_thread_that_spins_sees_its_cpu_time_grow_and_a_new_thread_starts_near_zero() {
        let start = super::cpu_time().expect("Linux has a thread CPU clock");
        let spun = std::time::Instant::now();
        while spun.elapsed() < std::time::Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let after = super::cpu_time().unwrap();
        assert!(after > start, "{after:?} after {start:?}");
        // Another thread's clock is its own: a new thread starts near zero.
        let fresh = std::thread::spawn(|| super::cpu_time().unwrap())
            .join()
            .unwrap();
        assert!(fresh < std::time::Duration::from_millis(5), "{fresh:?}");
    }
}
