//! A thread's timer slack: how late Linux may end its sleeps, to batch wake-ups. The default,
//! 50 us, would swamp a sleep meant to end a few microseconds before a stream's work does, so a
//! thread that sleeps to a predicted end lowers its own (`PR_SET_TIMERSLACK`, prctl(2)).
//!
//! This file names no other layer of the crate.
#![allow(unsafe_code)]

/// The slack a watching thread asks for, in nanoseconds.
#[cfg(all(target_os = "linux", not(device_events_loom)))]
const SLACK_NANOS: std::ffi::c_ulong = 1_000;

/// Lower the calling thread's timer slack to a microsecond (Linux; elsewhere nothing). A refusal
/// only leaves the sleeps as late as before, so it is not reported.
pub(crate) fn lower_for_this_thread() {
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
