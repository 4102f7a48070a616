//! [`FenceFuture`]: `fence.await`, served by a [`Waiter`](super::Waiter).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use futures::future::FusedFuture;

use super::handoff::Handoff;
use crate::{EventApi, EventFence, ServerError};

/// The future of [`EventFence::wait`] and `fence.await`: resolves once the device has reached the
/// fence, without blocking the polling thread (see [`Waiter`](super::Waiter)).
///
/// # Errors
///
/// The fence's error (see [`EventFence::wait_sync`]), a fault of the stream,
/// [`ServerError::WaiterPanicked`] if a backend call panicked, [`ServerError::WaiterGone`] after
/// the waiter's shutdown, [`ServerError::WaiterForked`] if the waiter (or the wait) is from before
/// this process forked, or [`ServerError::InvalidArgument`] if polled again once complete, rather
/// than hang ([`FusedFuture::is_terminated`]).
///
/// # Cancel safety
///
/// Dropping it cancels the wait and never blocks: its event is destroyed at once, or soon after by
/// a waiter thread (one it is blocked on, when the block ends; destroying an event with pending
/// work is legal and does not block), so timeouts retried on a stuck stream pile nothing up. The
/// stream's work is not affected, and the stream and the waiter go on serving.
///
/// No future is left pending forever: a faulted stream resolves all its pending waits with the
/// fault (sticky, as on CUDA: a fence awaited after the fault fails with it too, even one the
/// stream had passed before); a dropped stream's waits resolve once its queued work is done
/// (dropping a stream does not wait for that work, as `cuStreamDestroy` does not); a panic in a
/// waker or an event's release is logged once and costs only that wait.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct FenceFuture<A: EventApi> {
    pub(super) handoff: Handoff<EventFence<A>>,
}

impl<A: EventApi> FenceFuture<A> {
    /// Block the calling thread, asleep, until the fence is reached or `timeout` passes (a watchdog
    /// on a kernel that may hang). `None` when the time ran out: the future is left to wait on
    /// again, or to drop.
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
    /// As for the future, as `Some(Err(..))`.
    #[doc(alias = "timeout")]
    pub fn wait_sync_timeout(&mut self, timeout: Duration) -> Option<Result<(), ServerError>> {
        let deadline = Instant::now().checked_add(timeout);
        // A wake-up before the park is kept by its token.
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(result) = self.handoff.poll(&mut cx) {
                return Some(result);
            }
            match deadline.map(|deadline| deadline.saturating_duration_since(Instant::now())) {
                Some(left) if left.is_zero() => return None,
                Some(left) => std::thread::park_timeout(left),
                None => std::thread::park(),
            }
        }
    }
}

/// Wakes a thread blocked in [`FenceFuture::wait_sync_timeout`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
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
