//! [`FenceFuture`]: `fence.await`, served by a [`Waiter`](super::Waiter).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::FusedFuture;

use super::handoff::Handoff;
use crate::{EventApi, EventFence, ServerError};

/// The future of [`EventFence::wait`] and `fence.await`: resolves once the
/// device has reached the fence, without blocking the polling thread.
///
/// The first poll asks the device once; a fence already reached (or resolved
/// when it was created) is ready at once, with no hand-off and no allocation.
/// Otherwise the wait moves to the [`Waiter`](super::Waiter)'s threads, which sleep in the
/// driver and wake this task.
///
/// # Errors
///
/// The fence's error (see [`EventFence::wait_sync`]), a fault of the stream,
/// [`ServerError::WaiterPanicked`] if a backend call panicked,
/// [`ServerError::WaiterGone`] if the waiter was shut down first,
/// [`ServerError::WaiterForked`] if the waiter was made (or the wait handed
/// to it) before this process forked, or [`ServerError::InvalidArgument`]
/// if polled again once it completed (rather than hang:
/// [`FusedFuture::is_terminated`] tells when not to poll).
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
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct FenceFuture<A: EventApi> {
    handoff: Handoff<EventFence<A>>,
}

impl<A: EventApi> FenceFuture<A> {
    pub(super) fn new(handoff: Handoff<EventFence<A>>) -> Self {
        Self { handoff }
    }

    /// Block the calling thread until the fence is reached or `timeout`
    /// passes, without spinning: the wait goes to the waiter's threads, and
    /// this thread sleeps until one of them wakes it. For synchronous code
    /// that must be able to give up (a watchdog on a kernel that may hang);
    /// async code uses `.await` with a timer instead.
    ///
    /// `None` when the time ran out: the future is left as it was, still
    /// handed off, to wait on again (this, or `.await`) or to drop, which
    /// cancels the wait. Nothing happens to the stream's work either way: the
    /// device goes on, and a later fence still waits for it.
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use std::time::Duration;
    ///
    /// let stream = HostStream::new()?;
    /// stream.launch(|| std::thread::sleep(Duration::from_millis(50)))?;
    /// let mut wait = stream.fence().wait();
    /// match wait.wait_sync_timeout(Duration::from_millis(1)) {
    ///     Some(result) => result?, // reached (or failed) in time
    ///     None => {
    ///         // Not yet: give up, or wait again, as long as you like.
    ///         wait.wait_sync_timeout(Duration::from_secs(10)).expect("reached")?;
    ///     }
    /// }
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As for the future: `Some(Err(..))` with the fence's error, a fault,
    /// or [`ServerError::WaiterGone`].
    #[doc(alias = "timeout")]
    pub fn wait_sync_timeout(
        &mut self,
        timeout: std::time::Duration,
    ) -> Option<Result<(), ServerError>> {
        let deadline = std::time::Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| {
                std::time::Instant::now() + std::time::Duration::from_secs(86_400 * 365)
            });
        super::deadline::block_until(self, deadline)
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
