//! Calls into code the waiter does not own, each under `catch_unwind`: a backend's query or block,
//! a task's [`Waker`], a wait's drop (its event): a panic costs only that wait, not the thread.

use std::task::Waker;

use crate::panics;
use crate::ServerError;

/// Run a backend call; a panic becomes [`ServerError::WaiterPanicked`], which resolves the wait it
/// was for.
pub(super) fn backend<T>(call: impl FnOnce() -> Result<T, ServerError>) -> Result<T, ServerError> {
    panics::catch(call).unwrap_or_else(|message| Err(ServerError::WaiterPanicked { message }))
}

/// Wake a task (its result is already in its slot).
pub(super) fn wake(waker: Waker) {
    logged("a task's waker panicked when the waiter woke it", || {
        waker.wake()
    });
}

/// Drop `value` (a wait: its event).
pub(super) fn drop<T>(value: T) {
    logged(
        "dropping a wait's fence panicked on a waiter thread",
        || std::mem::drop(value),
    );
}

/// Run `call`; a panic in it is logged as `what` and goes no further.
fn logged(what: &str, call: impl FnOnce()) {
    if let Err(message) = panics::catch(call) {
        panics::log(|| log::error!("{what} (the waiter goes on): {message}"));
    }
}
