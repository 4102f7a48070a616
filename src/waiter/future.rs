//! [`FenceFuture`]: `fence.await`, served by a [`Waiter`].

use std::fmt;
use std::future::{Future, IntoFuture};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::FusedFuture;

use super::pool::{Pool, Wait};
use super::slot::Slot;
use super::Waiter;
use crate::loom::Arc;
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
/// Dropping the future cancels the wait and never blocks: a wait not yet
/// handed off drops its fence on the spot (destroying an event does not block,
/// even with its work pending); a handed-off wait is marked cancelled, and the
/// waiter drops it (destroying its event on a waiter thread) when it next
/// reaches it. The stream's work is not affected.
///
/// Polling again after the future has completed returns `Poll::Pending`.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct FenceFuture<A: EventApi> {
    state: State<A>,
    pool: Arc<Pool>,
}

enum State<A: EventApi> {
    /// Not polled yet: the fence is still here.
    First(EventFence<A>),
    /// Handed to the waiter.
    Waiting(Arc<Slot>),
    Done,
}

impl<A: EventApi> FenceFuture<A> {
    pub(super) fn new(fence: EventFence<A>, waiter: &Waiter) -> Self {
        Self {
            state: State::First(fence),
            pool: waiter.pool.clone(),
        }
    }

    /// The first poll: ask (and spin, if the waiter allows) before handing
    /// off. Returns the result, or the slot the waiter will fill.
    fn first_poll(
        &self,
        fence: EventFence<A>,
        cx: &mut Context<'_>,
    ) -> Result<Arc<Slot>, Result<(), ServerError>> {
        let budget = self.pool.config.spin_budget;
        // Read the clock only when spinning is allowed: a ready fence's await
        // costs one query.
        let started = (!budget.is_zero()).then(Instant::now);
        loop {
            match catch_unwind(AssertUnwindSafe(|| fence.is_complete())) {
                Ok(Ok(true)) => return Err(Ok(())),
                Ok(Err(err)) => return Err(Err(err)),
                Err(payload) => {
                    return Err(Err(ServerError::WaiterPanicked {
                        message: ServerError::panic_message(payload.as_ref()),
                    }))
                }
                Ok(Ok(false)) if started.is_some_and(|started| started.elapsed() < budget) => {
                    std::hint::spin_loop();
                }
                Ok(Ok(false)) => break,
            }
        }
        let slot = Arc::new(Slot::new(cx.waker().clone()));
        let wait = Wait {
            waitable: Box::new(fence),
            slot: slot.clone(),
        };
        Pool::submit(&self.pool, wait).map(|()| slot).map_err(Err)
    }
}

impl<A: EventApi> Future for FenceFuture<A> {
    type Output = Result<(), ServerError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match std::mem::replace(&mut this.state, State::Done) {
            State::First(fence) => match this.first_poll(fence, cx) {
                Ok(slot) => {
                    this.state = State::Waiting(slot);
                    Poll::Pending
                }
                Err(result) => Poll::Ready(result),
            },
            State::Waiting(slot) => match slot.poll(cx) {
                Poll::Ready(result) => Poll::Ready(result),
                Poll::Pending => {
                    this.state = State::Waiting(slot);
                    Poll::Pending
                }
            },
            State::Done => Poll::Pending,
        }
    }
}

// The fence is moved, never pinned: nothing here relies on a stable address.
impl<A: EventApi> Unpin for FenceFuture<A> {}

impl<A: EventApi> FusedFuture for FenceFuture<A> {
    fn is_terminated(&self) -> bool {
        matches!(self.state, State::Done)
    }
}

impl<A: EventApi> Drop for FenceFuture<A> {
    fn drop(&mut self) {
        if let State::Waiting(slot) = &self.state {
            slot.cancel();
        }
    }
}

impl<A: EventApi> fmt::Debug for FenceFuture<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::First(_) => "first poll",
            State::Waiting(_) => "waiting",
            State::Done => "done",
        };
        write!(f, "{}FenceFuture({state})", A::BACKEND)
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
