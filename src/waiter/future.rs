//! [`FenceFuture`]: `fence.await`, served by a [`Waiter`].

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::FusedFuture;

use super::Handoff;
use super::Waiter;
use crate::{EventApi, EventFence, ServerError};

/// The future of [`EventFence::wait`] and `fence.await`: resolves once the
/// device has reached the fence, without blocking the polling thread.
///
/// The first poll asks the device once; a fence already reached (or resolved
/// when it was created) is ready at once, with no hand-off and no allocation.
/// Otherwise the wait moves to the [`Waiter`]'s threads, which sleep in the
/// driver and wake this task.
///
/// # Errors
///
/// The fence's error (see [`EventFence::wait_sync`]), a fault of the stream,
/// [`ServerError::WaiterPanicked`] if a backend call panicked, or
/// [`ServerError::WaiterGone`] if the waiter was shut down first.
///
/// # Cancel safety
///
/// Dropping the future cancels the wait and never blocks. A wait not yet
/// handed off drops its fence on the spot (destroying an event does not
/// block, even with its work pending). A handed-off wait leaves the waiter at
/// once, and a waiter thread destroys its event soon after, off the dropping
/// thread, so timeouts retried on a stuck stream pile nothing up. The one
/// exception is the wait a waiter thread is blocked on right then: that
/// thread drops it when its block ends. The stream's work is not affected.
///
/// Polling again after the future has completed returns `Poll::Pending`.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct FenceFuture<A: EventApi> {
    handoff: Handoff<EventFence<A>>,
}

impl<A: EventApi> FenceFuture<A> {
    pub(super) fn new(fence: EventFence<A>, waiter: &Waiter) -> Self {
        Self {
            handoff: waiter.handoff(fence),
        }
    }
}

impl<A: EventApi> Future for FenceFuture<A> {
    type Output = Result<(), ServerError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().handoff.poll(cx)
    }
}

// The fence is moved, never pinned: nothing here relies on a stable address.
impl<A: EventApi> Unpin for FenceFuture<A> {}

impl<A: EventApi> FusedFuture for FenceFuture<A> {
    fn is_terminated(&self) -> bool {
        self.handoff.is_terminated()
    }
}

impl<A: EventApi> fmt::Debug for FenceFuture<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}FenceFuture({})", A::BACKEND, self.handoff.phase())
    }
}

impl<A: EventApi> EventFence<A> {
    /// A future that resolves once the device has reached this fence, served
    /// by [`Waiter::global()`]; the same as `fence.await`, for combinators
    /// that want a [`Future`] (`futures::join!`, `select`, timeouts).
    ///
    /// ```
    /// use device_events::host::{Host, HostStream};
    /// use device_events::EventFence;
    ///
    /// # futures::executor::block_on(async {
    /// let a = HostStream::new()?;
    /// let b = HostStream::new()?;
    /// a.launch(|| { /* work */ })?;
    /// b.launch(|| { /* work */ })?;
    /// let (ra, rb) = futures::join!(
    ///     EventFence::<Host>::new(a.handle()).wait(),
    ///     EventFence::<Host>::new(b.handle()).wait(),
    /// );
    /// ra?;
    /// rb?;
    /// # Ok::<(), device_events::ServerError>(())
    /// # }).unwrap();
    /// ```
    pub fn wait(self) -> FenceFuture<A> {
        Waiter::global().wait(self)
    }
}

impl<A: EventApi> IntoFuture for EventFence<A> {
    type Output = Result<(), ServerError>;
    type IntoFuture = FenceFuture<A>;

    fn into_future(self) -> FenceFuture<A> {
        self.wait()
    }
}
