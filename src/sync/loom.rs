//! The crate's only locks and condition variable, the waiter's thread spawns and the clock its
//! watcher goes by: std's, or loom's under `cfg(device_events_loom)` so the waiter's models
//! explore every interleaving (as tokio's `src/loom/`).
//!
//! The locks ignore poisoning, as tokio's `loom/std/mutex.rs` does: user code and backend calls
//! run outside locks, so a panic never leaves a lock's data half-changed.

use std::fmt;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

#[cfg(device_events_loom)]
use loom::sync as imp;
#[cfg(not(device_events_loom))]
use std::sync as imp;

pub(crate) use imp::atomic::AtomicUsize;
pub(crate) use imp::Arc;

#[cfg(all(device_events_loom, not(test)))]
pub(crate) use loom::thread;
#[cfg(not(any(device_events_loom, test)))]
pub(crate) use std::thread;
// In test builds, one whose spawns a test can refuse.
#[cfg(test)]
pub(crate) use super::test_faults::thread;

/// A mutex whose `lock` ignores poisoning.
pub(crate) struct Mutex<T>(imp::Mutex<T>);

impl<T> Mutex<T> {
    /// `const` outside loom, so it can be a `static`.
    #[cfg(not(device_events_loom))]
    pub(crate) const fn new(value: T) -> Self {
        Self(imp::Mutex::new(value))
    }

    #[cfg(device_events_loom)]
    pub(crate) fn new(value: T) -> Self {
        Self(imp::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard {
            mutex: self,
            inner: self.0.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }
}

impl<T: Default> Default for Mutex<T> {
    fn default() -> Self {
        Self::new(T::default())
    }
}

impl<T> fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Mutex { .. }")
    }
}

/// A held [`Mutex`], with the mutex it came from (so that a timed wait under loom can let go of
/// the lock and take it again).
pub(crate) struct MutexGuard<'a, T> {
    #[cfg_attr(not(device_events_loom), allow(dead_code))]
    mutex: &'a Mutex<T>,
    inner: imp::MutexGuard<'a, T>,
}

impl<T> std::ops::Deref for MutexGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T> std::ops::DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

/// A condition variable for [`Mutex`], whose waits ignore poisoning.
pub(crate) struct Condvar {
    inner: imp::Condvar,
    /// Notifications sent so far: how a timed wait under loom tells a wake-up from a timeout.
    #[cfg(device_events_loom)]
    notifications: imp::atomic::AtomicUsize,
}

impl Default for Condvar {
    fn default() -> Self {
        Self::new()
    }
}

impl Condvar {
    #[cfg(not(device_events_loom))]
    pub(crate) const fn new() -> Self {
        Self {
            inner: imp::Condvar::new(),
        }
    }

    #[cfg(device_events_loom)]
    pub(crate) fn new() -> Self {
        Self {
            inner: imp::Condvar::new(),
            notifications: imp::atomic::AtomicUsize::new(0),
        }
    }

    pub(crate) fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        let MutexGuard { mutex, inner } = guard;
        MutexGuard {
            mutex,
            inner: self
                .inner
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// Wait at most `timeout`; also whether it timed out.
    #[cfg(not(device_events_loom))]
    pub(crate) fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        let MutexGuard { mutex, inner } = guard;
        let (inner, result) = self
            .inner
            .wait_timeout(inner, timeout)
            .unwrap_or_else(PoisonError::into_inner);
        (MutexGuard { mutex, inner }, result.timed_out())
    }

    /// Wait at most `timeout`; also whether it timed out.
    ///
    /// loom 0.7's own timed wait never times out, so a model could never see an idle thread leave.
    /// Here a zero timeout (`keep_alive(0)`) is the schedule's choice: the wait lets go of the
    /// lock, yields, and takes it again, woken if a notification came meanwhile, else timed out
    /// (a later notification is lost, as on a real condition variable). Any other timeout never
    /// runs out, so a model with a long keep-alive deadlocks on a lost wake-up, not hides it.
    #[cfg(device_events_loom)]
    pub(crate) fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        if !timeout.is_zero() {
            return (self.wait(guard), false);
        }
        let seen = self.notifications.load(imp::atomic::Ordering::SeqCst);
        let mutex = guard.mutex;
        drop(guard);
        loom::thread::yield_now();
        let guard = mutex.lock();
        let timed_out = self.notifications.load(imp::atomic::Ordering::SeqCst) == seen;
        (guard, timed_out)
    }

    /// Wait until `deadline` by `clock`, or a notification; also whether it timed out.
    #[cfg(not(device_events_loom))]
    pub(crate) fn wait_until<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        deadline: Instant,
        clock: &Clock,
    ) -> (MutexGuard<'a, T>, bool) {
        self.wait_timeout(guard, deadline.saturating_duration_since(clock.now()))
    }

    /// Wait until `deadline` by `clock`, or a notification; also whether it timed out.
    ///
    /// Under loom, whether the deadline comes before a notification is the schedule's choice, as
    /// for a zero timeout ([`Condvar::wait_timeout`]); a wait that times out moves `clock` on to
    /// its deadline, so what is due by then is due.
    #[cfg(device_events_loom)]
    pub(crate) fn wait_until<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        deadline: Instant,
        clock: &Clock,
    ) -> (MutexGuard<'a, T>, bool) {
        let (guard, timed_out) = self.wait_timeout(guard, Duration::ZERO);
        if timed_out {
            clock.pass_to(deadline);
        }
        (guard, timed_out)
    }

    pub(crate) fn notify_one(&self) {
        #[cfg(device_events_loom)]
        self.notifications
            .fetch_add(1, imp::atomic::Ordering::SeqCst);
        self.inner.notify_one();
    }

    pub(crate) fn notify_all(&self) {
        #[cfg(device_events_loom)]
        self.notifications
            .fetch_add(1, imp::atomic::Ordering::SeqCst);
        self.inner.notify_all();
    }
}

/// The time that the waiter's watcher, and the lane threads that hand it their waits, go by:
/// std's clock; under loom, one that stands still but where a timed wait runs out
/// ([`Condvar::wait_until`]), so that a model sees the same times in each run of a schedule, and
/// time passes only as far as a nap's end.
#[cfg_attr(not(device_events_loom), derive(Default))]
pub(crate) struct Clock {
    #[cfg(device_events_loom)]
    epoch: Instant,
    /// Nanoseconds passed since `epoch`. Not loom's atomic: time is no memory for a model to
    /// explore, and it moves only under the waiter's lock.
    #[cfg(device_events_loom)]
    passed: std::sync::atomic::AtomicU64,
}

#[cfg(device_events_loom)]
impl Default for Clock {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            passed: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl Clock {
    #[cfg(not(device_events_loom))]
    pub(crate) fn now(&self) -> Instant {
        Instant::now()
    }

    #[cfg(device_events_loom)]
    pub(crate) fn now(&self) -> Instant {
        let passed = self.passed.load(std::sync::atomic::Ordering::SeqCst);
        self.epoch + Duration::from_nanos(passed)
    }

    /// Time passes to `instant`, unless it has already.
    #[cfg(device_events_loom)]
    fn pass_to(&self, instant: Instant) {
        let nanos = instant.saturating_duration_since(self.epoch).as_nanos();
        let nanos = u64::try_from(nanos).unwrap_or(u64::MAX);
        self.passed
            .fetch_max(nanos, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A read-write lock that ignores poisoning. Always std's: the stream registries it guards are in
/// no loom model, and `static`.
pub(crate) struct RwLock<T>(std::sync::RwLock<T>);

impl<T> RwLock<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(std::sync::RwLock::new(value))
    }

    pub(crate) fn read(&self) -> std::sync::RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn write(&self) -> std::sync::RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}
