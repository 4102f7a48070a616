//! [`Fence`]: what a [`DropQueue`](super::DropQueue) waits for, and how a value is settled once
//! its fence passes (dropped) or fails (leaked).

use crate::{panics, AnyFence, EventApi, EventFence, ServerError};

/// What a [`DropQueue`](super::DropQueue) waits for: [`EventFence`], [`AnyFence`], or yours.
pub trait Fence: Send + 'static {
    /// Block until the fence has passed (an [`EventFence`]'s own [`wait`](EventFence::wait)
    /// returns a future).
    ///
    /// # Errors
    ///
    /// The fence failed: the device faulted, or the driver refused the wait.
    fn wait_blocking(self) -> Result<(), ServerError>;

    /// Whether the fence has passed, without blocking; `Ok(false)` also from fences that cannot
    /// tell.
    ///
    /// # Errors
    ///
    /// The fence failed.
    fn is_passed(&self) -> Result<bool, ServerError> {
        Ok(false)
    }
}

/// If the fence's wait fails, the stream is synchronized instead (with a warning): when that
/// succeeds, everything queued before the fence has run. Only when the stream cannot be
/// synchronized either (a faulted stream or device) does the fence fail.
///
/// A stream-capture status ([`ServerError::is_stream_capture`]) is not worked around: the fence
/// marks a place in a graph that may be launched any time later, so the value is leaked.
impl<A: EventApi> Fence for EventFence<A> {
    fn wait_blocking(self) -> Result<(), ServerError> {
        let stream = self.stream();
        match self.wait_sync() {
            Ok(()) => Ok(()),
            Err(err) if err.is_stream_capture() => Err(err),
            Err(err) if A::stream_synchronize(stream).is_ok() => {
                let backend = A::BACKEND;
                log::warn!(
                    "{backend}: a fence's wait failed ({err}); the stream synchronized instead"
                );
                Ok(())
            }
            Err(err) => Err(err),
        }
    }

    fn is_passed(&self) -> Result<bool, ServerError> {
        self.is_complete()
    }
}

/// Each waits as its [`EventFence`] does.
impl Fence for AnyFence {
    fn wait_blocking(self) -> Result<(), ServerError> {
        match_backend!(self, AnyFence(fence) => fence.wait_blocking())
    }

    fn is_passed(&self) -> Result<bool, ServerError> {
        self.is_complete()
    }
}

/// Wait for `fence`, then drop `value`; if the fence fails (or its wait panics), leak the value
/// instead, with an error logged, and return the failure.
pub(super) fn settle<F: Fence, T>(fence: F, value: T) -> Result<(), ServerError> {
    let passed = panics::catch(|| fence.wait_blocking())
        .unwrap_or_else(|message| Err(ServerError::DropQueuePanicked { message }));
    match passed {
        Ok(()) => {
            drop_value(value);
            Ok(())
        }
        Err(err) => {
            panics::log(|| {
                if err.is_shut_down() {
                    // At process exit, say: the memory goes with the process.
                    log::debug!("a drop queue's fence failed, leaking its value: {err}");
                } else {
                    log::error!(
                        "a drop queue's fence failed, leaking its value rather than freeing \
                         memory the device may still read: {err}"
                    );
                }
            });
            std::mem::forget(value);
            Err(err)
        }
    }
}

/// Without waiting: drop `value` if `fence` has passed, else leak it (a fence that fails or
/// panics has not passed); the fence is dropped either way. Whether the value was dropped.
pub(super) fn drop_if_passed<F: Fence, T>(fence: F, value: T) -> bool {
    let passed = matches!(panics::catch(|| fence.is_passed()), Ok(Ok(true)));
    if passed {
        drop_value(value);
    } else {
        std::mem::forget(value);
    }
    let _ = panics::drop_caught(fence);
    passed
}

/// Drop a value whose fence passed; a panic in its `Drop` is logged, and the queue goes on.
pub(super) fn drop_value<T>(value: T) {
    if let Err(message) = panics::drop_caught(value) {
        panics::log(|| log::error!("a value's drop panicked in the drop queue: {message}"));
    }
}
