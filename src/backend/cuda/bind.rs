//! [`Bound`]: a context made current on the calling thread, and the
//! previous one made current again afterwards.

use std::cell::{Cell, RefCell};
use std::ptr;
use std::sync::{Arc, Weak};

use cudarc::driver::CudaContext;

use super::driver::{driver, driver_error, CurrentContext, Driver, CAPTURE_MODE_RELAXED};
use crate::ServerError;

/// A context made current on the calling thread for the guard's life; the
/// context that was current before is made current again when it drops, as a
/// device guard does, so executor threads (and threads that drop events) are
/// left as found and multi-GPU code on them keeps its device.
///
/// It binds through the driver, not cudarc's `bind_to_thread`: that first
/// takes any error a cudarc `Drop` stored in the context (cudarc's drops store
/// failures there instead of panicking), which belongs to the user's next
/// cudarc call, and would come back from here mislabelled as this crate's.
///
/// On the crate's own threads (the waiter's and the drop queue's, see
/// [`own_threads`](crate::own_threads)) nothing is restored: the context
/// stays bound, so a waiter thread querying a batch of fences of one context
/// switches contexts once, not twice per query. No executor runs there, and
/// user code that does (a value the drop queue drops) finds some context
/// current, as it would after any CUDA call; cudarc binds its own first.
#[must_use = "the context is current only while the guard lives"]
pub(super) struct Bound {
    /// What was current before, to restore; `None` when it already was `ctx`,
    /// or on the crate's own threads.
    previous: Option<CurrentContext>,
    driver: Driver,
    /// Whether this is one of the crate's own threads (already in the
    /// relaxed capture mode, see [`relaxed`](Self::relaxed)).
    own: bool,
}

impl Bound {
    /// The driver's calls, to make while the context is bound.
    pub(super) fn driver(&self) -> Driver {
        self.driver
    }

    /// Make `call`, one of the driver's "potentially unsafe" calls during a
    /// graph capture (a query or a synchronize), in the relaxed capture mode,
    /// so that it cannot invalidate a capture another thread (or this one)
    /// is making. The driver prohibits such calls on a thread in the default
    /// global mode while any thread captures in global mode, and invalidates
    /// that capture (`cuThreadExchangeStreamCaptureMode`: "if any other
    /// thread has a concurrent capture sequence initiated with
    /// CU_STREAM_CAPTURE_MODE_GLOBAL, this thread is prohibited from
    /// potentially unsafe API calls"; relaxed: "the local thread is not
    /// prohibited"). A user's thread gets its own mode back afterwards; the
    /// crate's own threads stay relaxed (set once, when they first bind).
    pub(super) fn relaxed<T>(
        &self,
        call: impl FnOnce(Driver) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        if self.own || crate::plant::planted("cuda-user-calls-in-global-capture-mode") {
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
    /// On the crate's own threads: whether the thread's capture mode is
    /// relaxed already (see [`Bound::relaxed`]).
    static RELAXED: Cell<bool> = const { Cell::new(false) };

    /// On the crate's own threads: the context this thread left bound.
    /// Weak, so it holds the allocation (no other context can take its
    /// address while it is kept here) and not the context.
    static LEFT_BOUND: RefCell<Weak<CudaContext>> = const { RefCell::new(Weak::new()) };
}

/// Make `ctx` current on this thread until the returned guard drops (on the
/// crate's own threads, until another is bound).
pub(super) fn bind(ctx: &Arc<CudaContext>) -> Result<Bound, ServerError> {
    if crate::plant::planted("cuda-bind-takes-stored-errors") {
        ctx.bind_to_thread()
            .map_err(|err| driver_error("cuCtxSetCurrent", err))?;
    }
    let driver = driver()?;
    let own = crate::own_threads::is_own();
    if own {
        relax_own_thread(driver);
    }
    let previous = driver.ctx_get_current()?;
    // A handle equal to the target is the target still bound, except on
    // the crate's own threads after the context it left there was torn
    // down: a context made later (a device's primary context retained
    // anew, say) can have the same handle, and the thread's binding is
    // stale (the driver answers CUDA_ERROR_CONTEXT_IS_DESTROYED there). So
    // there it counts only if this very context object bound it, alive all
    // along since (its `Arc` holds the context's retain).
    if previous.is(ctx)
        && (!own
            || left_bound_by(ctx)
            || crate::plant::planted("cuda-own-thread-trusts-stale-binding"))
    {
        return Ok(Bound {
            previous: None,
            driver,
            own,
        });
    }
    driver.ctx_set_current(ctx)?;
    if own {
        // During the thread's exit nothing is remembered: the next bind
        // (if any) switches again.
        let _ = LEFT_BOUND.try_with(|left| *left.borrow_mut() = Arc::downgrade(ctx));
        return Ok(Bound {
            previous: None,
            driver,
            own,
        });
    }
    Ok(Bound {
        previous: Some(previous),
        driver,
        own,
    })
}

/// Put one of the crate's own threads in the relaxed capture mode, once: its
/// queries and waits must never invalidate a user's graph capture (see
/// [`Bound::relaxed`]). No executor or user code runs there but what the drop
/// queue drops, for which the relaxed mode only allows more.
fn relax_own_thread(driver: Driver) {
    if crate::plant::planted("cuda-own-threads-in-global-capture-mode") {
        return;
    }
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

/// Whether `ctx` is the context object this (own) thread left bound.
fn left_bound_by(ctx: &Arc<CudaContext>) -> bool {
    LEFT_BOUND
        .try_with(|left| ptr::eq(left.borrow().as_ptr(), Arc::as_ptr(ctx)))
        .unwrap_or(false)
}

impl Drop for Bound {
    fn drop(&mut self) {
        let Some(previous) = self
            .previous
            .take()
            .filter(|_| !crate::plant::planted("cuda-previous-context-not-restored"))
        else {
            return;
        };
        // A context destroyed meanwhile is refused by the driver with an
        // error, reported here.
        match self.driver.ctx_restore(previous) {
            Ok(()) => {}
            // Logged once, where the shutdown was first seen.
            Err(err) if err.is_shut_down() => log::trace!("{err}"),
            Err(err) => log::debug!(
                "the thread's previous CUDA context could not be made current again: {err}"
            ),
        }
    }
}
