//! Run a check in a forked child, for the fork tests.
// fork, alarm, _exit and waitpid: the FFI edge of the fork tests.
#![allow(unsafe_code)]

use std::io::Write;

/// Run `check` in a forked child and return its exit status: 0 when it
/// passed, 1 when it failed (it says why on stderr), 128 + the signal when
/// it was killed (SIGALRM after 20 s: something hung).
pub fn in_a_fork(check: impl FnOnce() -> Result<(), String>) -> i32 {
    // SAFETY: the child runs only `check`, in the one thread fork copies,
    // and leaves with `_exit` (no atexit handlers, no unwinding into the
    // harness); an alarm ends it if anything there hangs.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: alarm only schedules a signal for this process.
        unsafe { libc::alarm(20) };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check))
            .unwrap_or_else(|_| Err("the child panicked".to_owned()));
        let code = match outcome {
            Ok(()) => 0,
            Err(why) => {
                // Straight to fd 2: the harness's capture stays in the child.
                let _ = writeln!(std::io::stderr(), "forked child: {why}");
                1
            }
        };
        // SAFETY: ends the child at once, as a forked child should.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked here; `status` outlives the call.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    }
}
