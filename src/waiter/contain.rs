//! Calls into code the waiter does not own, each under `catch_unwind`: a
//! backend's query or block, a task's [`Waker`], a wait's drop (its event).
//! A panic there costs only its wait; the thread goes on, its lane and
//! counts intact.

use std::task::Waker;

use crate::panics;
use crate::ServerError;

/// Run a backend call; a panic becomes [`ServerError::WaiterPanicked`],
/// which resolves the wait it was for.
pub(super) fn backend<T>(call: impl FnOnce() -> Result<T, ServerError>) -> Result<T, ServerError> {
    panics::catch(call).unwrap_or_else(|message| Err(ServerError::WaiterPanicked { message }))
}

/// Wake a task; a waker's panic is logged and goes no further (the result
/// is already in its slot).
pub(super) fn wake(waker: Waker) {
    if let Err(message) = panics::catch(|| waker.wake()) {
        panics::log(|| {
            log::error!(
                "a task's waker panicked when the waiter woke it (the waiter goes on): {message}"
            );
        });
    }
}

/// Drop `value` (a wait: its event); a panic in its drop is logged and goes
/// no further.
pub(super) fn drop<T>(value: T) {
    if let Err(message) = panics::drop_caught(value) {
        panics::log(|| {
            log::error!(
                "dropping a wait's fence panicked on a waiter thread (the waiter goes on): \
                 {message}"
            );
        });
    }
}
