//! Calls into code the waiter does not own, each under `catch_unwind`: a
//! backend's query or block, a task's [`Waker`], the drop of a wait (its
//! fence, and so its event: an outside backend's release). A panic there
//! costs only the one wait it concerns; the waiter thread that made the call
//! finishes its batch and goes on, with its lane and its counts intact.
//! Payloads are dropped as [`crate::panics`] drops them.

use std::task::Waker;

use crate::panics;
use crate::ServerError;

/// Run a backend call; a panic becomes [`ServerError::WaiterPanicked`],
/// which resolves the wait it was for.
pub(super) fn backend<T>(call: impl FnOnce() -> Result<T, ServerError>) -> Result<T, ServerError> {
    panics::catch(call).unwrap_or_else(|message| Err(ServerError::WaiterPanicked { message }))
}

/// Wake a task. A waker that panics (a user's own executor, a test harness)
/// has its panic logged, once, and goes no further: the task's result is
/// already in its slot, and the waiter goes on to the next.
pub(super) fn wake(waker: Waker) {
    if let Err(message) = panics::catch(|| waker.wake()) {
        log(|| {
            log::error!(
                "a task's waker panicked when the waiter woke it (the waiter goes on): {message}"
            );
        });
    }
}

/// Drop `value` (a wait: its fence, and so its event). A panic in its drop
/// (an outside backend's event release) is logged, once, and goes no
/// further.
pub(super) fn drop<T>(value: T) {
    if let Err(message) = panics::drop_caught(value) {
        log(|| {
            log::error!(
                "dropping a wait's fence panicked on a waiter thread (the waiter goes on): \
                 {message}"
            );
        });
    }
}

/// Log through the application's logger ([`panics::log`]).
pub(super) fn log(line: impl FnOnce()) {
    panics::log(line);
}
