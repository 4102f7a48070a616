//! Faults a test plants in the waiter's threads through this shim (test builds only): spawns
//! refused, and a panic where no call is contained. No waiter code calls them: the shim's thread
//! spawns and [`Checked::lock`](super::checked::Checked::lock) check them.
//!
//! Both are per OS thread. Under loom every thread of a model runs on the test's OS thread, so
//! they are the model's, not one model thread's: a model sets them at the start of each
//! iteration.

use std::cell::Cell;

thread_local! {
    static REFUSED_SPAWNS: Cell<usize> = const { Cell::new(0) };
    static PANIC_AT_NEXT_LOCK: Cell<bool> = const { Cell::new(false) };
}

/// The next `n` waiter thread spawns ([`thread::Builder::spawn`]) made from this thread fail.
pub(crate) fn refuse_spawns(n: usize) {
    REFUSED_SPAWNS.with(|left| left.set(n));
}

/// The next [`Checked::lock`](super::checked::Checked::lock) taken on this thread panics before
/// it locks: called by a test's backend code, which the waiter contains, it plants a panic
/// outside any contained call (where only a waiter thread's guard can give back what it holds).
pub(crate) fn panic_at_next_lock() {
    PANIC_AT_NEXT_LOCK.with(|planted| planted.set(true));
}

/// Panic if [`panic_at_next_lock`] planted one on this thread; it is used up.
#[cfg(multi_threading)]
pub(super) fn panic_if_planted() {
    if PANIC_AT_NEXT_LOCK.with(|planted| planted.replace(false)) {
        panic!("a panic planted by a test, outside any contained call");
    }
}

/// Whether this thread's next spawn is refused ([`refuse_spawns`]); the refusal is used up.
fn refused_spawn() -> bool {
    REFUSED_SPAWNS.with(|left| {
        let refused = left.get() > 0;
        left.set(left.get().saturating_sub(1));
        refused
    })
}

/// std's `thread` (loom's under `cfg(device_events_loom)`), whose `Builder` refuses the spawns a
/// test asked for ([`refuse_spawns`]).
pub(crate) mod thread {
    #[cfg(not(device_events_loom))]
    use std::thread as imp;

    #[cfg(device_events_loom)]
    use loom::thread as imp;

    pub(crate) use imp::*;

    /// `imp::Builder`, whose spawns fail while a test refuses them.
    pub(crate) struct Builder(imp::Builder);

    impl Builder {
        pub(crate) fn new() -> Self {
            Self(imp::Builder::new())
        }

        pub(crate) fn name(self, name: String) -> Self {
            Self(self.0.name(name))
        }

        pub(crate) fn spawn<F, T>(self, f: F) -> std::io::Result<JoinHandle<T>>
        where
            F: FnOnce() -> T + Send + 'static,
            T: Send + 'static,
        {
            if crate::sync::test_faults::refused_spawn() {
                return Err(std::io::Error::other("a spawn refused by a test"));
            }
            self.0.spawn(f)
        }
    }
}
