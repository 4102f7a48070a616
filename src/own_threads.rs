//! Which threads are this crate's own: the waiter's and the drop queue's,
//! started by the crate and running no executor.
//!
//! A backend may leave per-thread driver state on them that it must restore
//! on its callers' threads. The CUDA backend binds a stream's context around
//! every call and, on a caller's thread, makes the previous context current
//! again afterwards (executor threads keep their device); on the crate's own
//! threads it leaves the context bound, so a waiter thread querying a batch
//! of fences on one context switches contexts once, not twice per query.
//!
//! Marked by the threads themselves, when they start; read by backends. It
//! names neither, so layers still point down.

use std::cell::Cell;

thread_local! {
    static OWN: Cell<bool> = const { Cell::new(false) };
}

/// Mark the calling thread as one of the crate's own, for its whole life.
/// Called first thing by every thread the crate starts.
pub(crate) fn enter() {
    OWN.with(|own| own.set(true));
}

/// Whether the calling thread is one of the crate's own.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn is_own() -> bool {
    OWN.with(Cell::get)
}
