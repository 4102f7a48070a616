//! [`Bound`]: a context made current on the calling thread, and the previous one made current again
//! afterwards; [`HeldContext`]: a context the crate holds, whose last handle is dropped without
//! changing the calling thread's current context.

use std::cell::{Cell, RefCell};
use std::ops::Deref;
use std::ptr;
use std::sync::{Arc, Weak};

use cudarc::driver::CudaContext;

use super::driver::{driver, CurrentContext, Driver, CAPTURE_MODE_RELAXED};
use crate::ServerError;

/// A context made current on the calling thread for the guard's life, the previous one made current
/// again when it drops, as a device guard does; on the crate's own threads ([`os`](crate::os))
/// the context stays bound, so a waiter thread switches once per burst of one context's fences
/// (see the CUDA guide, docs/cuda.md).
///
/// It binds through the driver, not cudarc's `bind_to_thread`, which first takes any error a
/// cudarc `Drop` stored in the context: that belongs to the user's next cudarc call.
#[must_use = "the context is current only while the guard lives"]
pub(super) struct Bound {
    /// What was current before, to restore; `None` if it was `ctx` or on the crate's own threads.
    previous: Option<CurrentContext>,
    /// The driver, to call while the context is bound.
    pub(super) driver: Driver,
    /// One of the crate's own threads (already relaxed, see [`relaxed`](Self::relaxed)).
    own: bool,
}

impl Bound {
    /// Make `call`, one of the driver's "potentially unsafe" calls during a graph capture (a query
    /// or a synchronize), in the relaxed capture mode, so it cannot invalidate a capture
    /// (`cuThreadExchangeStreamCaptureMode`: "if any other thread has a concurrent capture sequence
    /// initiated with CU_STREAM_CAPTURE_MODE_GLOBAL, this thread is prohibited from potentially
    /// unsafe API calls"; relaxed: "the local thread is not prohibited"). A user's thread gets its
    /// mode back after; the crate's own threads stay relaxed.
    pub(super) fn relaxed<T>(
        &self,
        call: impl FnOnce(Driver) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        if self.own {
            return call(self.driver);
        }
        let previous = match self.driver.exchange_capture_mode(CAPTURE_MODE_RELAXED) {
            Ok(previous) => previous,
            // Not made: the call is made as the thread's mode allows.
            Err(err) => {
                if !err.is_shut_down() {
                    log::debug!("the thread's CUDA capture mode could not be relaxed: {err}");
                }
                return call(self.driver);
            }
        };
        let result = call(self.driver);
        if let Err(err) = self.driver.exchange_capture_mode(previous) {
            log::debug!("the thread's CUDA capture mode could not be restored: {err}");
        }
        result
    }
}

thread_local! {
    /// On the crate's own threads: whether the capture mode is relaxed already.
    static RELAXED: Cell<bool> = const { Cell::new(false) };

    /// The context object this thread's binding was last made for by [`bind`] and left bound.
    /// Weak: it holds the allocation (no other context takes its address meanwhile), not the
    /// context.
    static LEFT_BOUND: RefCell<Weak<CudaContext>> = const { RefCell::new(Weak::new()) };
}

/// Make `ctx` current on this thread until the guard drops (on the crate's own threads, until
/// another is bound).
pub(super) fn bind(ctx: &Arc<CudaContext>) -> Result<Bound, ServerError> {
    let driver = driver()?;
    let own = crate::os::is_own_thread();
    if own {
        relax_own_thread(driver);
    }
    let previous = driver.ctx_get_current()?;
    // An equal handle does not prove `ctx` is bound: a context made later under a torn-down one's
    // handle leaves the thread's binding maybe stale (some drivers answer
    // CUDA_ERROR_CONTEXT_IS_DESTROYED through it). So it counts only if this very object bound it
    // here and stayed alive since (its retain kept the handle's context); else it is bound afresh,
    // once per thread and object.
    if previous.is(ctx) && left_bound_by(ctx) {
        return Ok(Bound {
            previous: None,
            driver,
            own,
        });
    }
    driver.ctx_set_current(ctx)?;
    let left_bound = own || previous.is(ctx);
    if left_bound {
        // Nothing to restore (on a user's thread, the handle was current already); not
        // remembered at thread exit.
        let _ = LEFT_BOUND.try_with(|left| *left.borrow_mut() = Arc::downgrade(ctx));
    }
    Ok(Bound {
        previous: (!left_bound).then_some(previous),
        driver,
        own,
    })
}

/// Run `make`, a cudarc call that leaves a context bound (`CudaContext::new` does), then make the
/// previous context current again, as [`Bound`] does (not on the crate's own threads).
///
/// # Errors
///
/// The driver's, when it is not loaded or the current context cannot be asked; `make`'s own
/// result is returned as it is.
pub(super) fn keeping_current<T>(make: impl FnOnce() -> T) -> Result<T, ServerError> {
    let driver = driver()?;
    if crate::os::is_own_thread() {
        return Ok(make());
    }
    let previous = driver.ctx_get_current()?;
    let made = make();
    // Restored only if `make` changed it: a binding the thread had (even stale) is left as it was.
    let changed = driver.ctx_get_current().map_or(true, |now| now != previous);
    if changed {
        restore(driver, previous);
    }
    Ok(made)
}

/// Make `previous` current again; a failure is logged (a context destroyed meanwhile is refused by
/// the driver with an error; a shutdown, already logged where first seen, only at trace level).
fn restore(driver: Driver, previous: CurrentContext) {
    match driver.ctx_restore(previous) {
        Ok(()) => {}
        Err(err) if err.is_shut_down() => log::trace!("{err}"),
        Err(err) => {
            log::debug!("the thread's previous CUDA context could not be made current again: {err}")
        }
    }
}

/// Put one of the crate's own threads in the relaxed capture mode, once (see [`Bound::relaxed`]).
/// The only user code there is what the drop queue drops, for which relaxed only allows more.
fn relax_own_thread(driver: Driver) {
    let _ = RELAXED.try_with(|relaxed| {
        if relaxed.get() {
            return;
        }
        match driver.exchange_capture_mode(CAPTURE_MODE_RELAXED) {
            Ok(_) => relaxed.set(true),
            Err(err) if err.is_shut_down() => {}
            Err(err) => {
                log::debug!("a waiter thread's CUDA capture mode could not be relaxed: {err}")
            }
        }
    });
}

/// Whether `ctx` is the context object this thread's binding was made for.
fn left_bound_by(ctx: &Arc<CudaContext>) -> bool {
    LEFT_BOUND
        .try_with(|left| ptr::eq(left.borrow().as_ptr(), Arc::as_ptr(ctx)))
        .unwrap_or(false)
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            restore(self.driver, previous);
        }
    }
}

/// A context the crate holds (an event's, a kernel's, a pool's). cudarc's `Drop` of a context's
/// last handle leaves it current on the dropping thread; this restores the thread's previous one
/// after (not on the crate's own threads). Other handles drop as an `Arc` does.
pub(super) struct HeldContext(Option<Arc<CudaContext>>);

impl From<Arc<CudaContext>> for HeldContext {
    fn from(ctx: Arc<CudaContext>) -> Self {
        Self(Some(ctx))
    }
}

impl Deref for HeldContext {
    type Target = Arc<CudaContext>;

    fn deref(&self) -> &Arc<CudaContext> {
        self.0
            .as_ref()
            .expect("a HeldContext holds its context until it drops")
    }
}

impl Drop for HeldContext {
    fn drop(&mut self) {
        let Some(ctx) = self.0.take() else {
            return;
        };
        if super::driver::in_forked_child() {
            // cudarc's drop calls the driver: a forked child must not (see `in_forked_child`).
            std::mem::forget(ctx);
            return;
        }
        // As cheap as dropping the `Arc` (one atomic decrement); `Some` only for the last handle.
        let Some(last) = Arc::into_inner(ctx) else {
            return;
        };
        if crate::os::is_own_thread() {
            return;
        }
        let Ok(driver) = driver() else {
            return;
        };
        let Ok(previous) = driver.ctx_get_current() else {
            return;
        };
        // The thread had this very context current: cudarc leaves it so.
        let keep = previous.is(&last);
        drop(last);
        if !keep {
            restore(driver, previous);
        }
    }
}
