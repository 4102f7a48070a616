//! [`Plants`]: faults a test plants in one pool (test builds only).

/// Faults a test plants in one pool: the next `escapes` times a lane thread
/// or the poller holds waits it panics outside any contained call, and the
/// next `watcher_escapes` times the watcher starts a round; the next
/// `refused_spawns` spawns fail.
#[derive(Default)]
pub(crate) struct Plants {
    pub(crate) escapes: crate::sync::AtomicUsize,
    pub(crate) watcher_escapes: crate::sync::AtomicUsize,
    pub(crate) refused_spawns: crate::sync::AtomicUsize,
}

impl Plants {
    /// Whether a fault is left in `counter`; it is used up.
    pub(crate) fn take(counter: &crate::sync::AtomicUsize) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        counter
            .fetch_update(SeqCst, SeqCst, |left| left.checked_sub(1))
            .is_ok()
    }
}
