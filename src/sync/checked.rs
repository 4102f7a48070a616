//! [`Checked`]: a lock guard that checks its state's invariants as the lock is let go (debug and
//! loom builds), so a broken state fails where it broke.

use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use crate::sync::{Clock, Condvar, Mutex, MutexGuard};

/// State whose invariants one look can check.
pub(crate) trait Invariants {
    /// Panic if an invariant does not hold.
    fn check_invariants(&self);
}

const CHECKING: bool = cfg!(any(debug_assertions, device_events_loom));

/// A guard of a [`Mutex`] around state with [`Invariants`].
pub(crate) struct Checked<'a, T: Invariants> {
    /// `None` only while it waits, and in its drop.
    guard: Option<MutexGuard<'a, T>>,
}

impl<'a, T: Invariants> Checked<'a, T> {
    pub(crate) fn lock(mutex: &'a Mutex<T>) -> Self {
        #[cfg(test)]
        crate::sync::test_faults::panic_if_planted();
        Self {
            guard: Some(mutex.lock()),
        }
    }

    /// Let go of the lock (checked), wait on `condvar` at most `timeout`, hold it again; and
    /// whether it timed out.
    pub(crate) fn wait_timeout(mut self, condvar: &Condvar, timeout: Duration) -> (Self, bool) {
        let guard = self.guard.take().expect("a checked guard holds its lock");
        if CHECKING {
            guard.check_invariants();
        }
        let (guard, timed_out) = condvar.wait_timeout(guard, timeout);
        (Self { guard: Some(guard) }, timed_out)
    }

    /// [`Checked::wait_timeout`] until `deadline` by `clock` ([`Condvar::wait_until`]).
    pub(crate) fn wait_until(
        mut self,
        condvar: &Condvar,
        deadline: Instant,
        clock: &Clock,
    ) -> (Self, bool) {
        let guard = self.guard.take().expect("a checked guard holds its lock");
        if CHECKING {
            guard.check_invariants();
        }
        let (guard, timed_out) = condvar.wait_until(guard, deadline, clock);
        (Self { guard: Some(guard) }, timed_out)
    }
}

impl<T: Invariants> Deref for Checked<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.guard.as_ref().expect("a checked guard holds its lock")
    }
}

impl<T: Invariants> DerefMut for Checked<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("a checked guard holds its lock")
    }
}

impl<T: Invariants> Drop for Checked<'_, T> {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.take() {
            // Not while unwinding: a second panic would abort.
            if CHECKING && !std::thread::panicking() {
                guard.check_invariants();
            }
        }
    }
}
