//! The waiter's locks, atomics and thread spawns, swapped for loom's under
//! `cfg(loom)` so its models can explore every interleaving (as tokio's
//! `src/loom/` does).

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread;

#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::thread;

/// Lock `mutex`, taking the data of a poisoned one: every critical section
/// here leaves the state consistent before anything that can panic.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sleep the calling thread; under loom, yield so the model can go on.
pub(crate) fn sleep(duration: std::time::Duration) {
    #[cfg(not(loom))]
    std::thread::sleep(duration);
    #[cfg(loom)]
    {
        let _ = duration;
        loom::thread::yield_now();
    }
}
