//! [`PushFuture`] and [`Progress`]: waiting for room and for progress without blocking a thread.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::fence::Fence;
use super::handed_back::Rejected;
use super::shared::Shared;
use super::stats::DropQueueStats;

#[derive(Debug, Clone, Copy)]
pub(super) enum Until {
    /// This many values dropped, leaked or handed back.
    Handled(u64),
    /// The queue's thread exited (after handling everything).
    Exited,
}

/// The future of [`DropQueue::flush_async`](super::DropQueue::flush_async) and `shutdown_async`:
/// resolves with the queue's stats. Dropping it takes its waker back out of the queue.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct Progress<F, T> {
    pub(super) shared: Arc<Shared<F, T>>,
    pub(super) until: Until,
    /// Its entry among the queue's wakers.
    pub(super) id: u64,
}

impl<F, T> Future for Progress<F, T> {
    type Output = DropQueueStats;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<DropQueueStats> {
        if self.shared.on_own_thread() {
            // Awaited in a value's drop: the queue cannot wait for itself.
            return Poll::Ready(self.shared.state.lock().stats());
        }
        let mut state = self.shared.state.lock();
        let done = match self.until {
            Until::Handled(target) => state.handled(target),
            Until::Exited => state.exited,
        };
        let (result, replaced) = if done {
            (Poll::Ready(state.stats()), state.wakers.remove(self.id))
        } else {
            (Poll::Pending, state.wakers.register(self.id, cx.waker()))
        };
        drop(state);
        drop(replaced);
        result
    }
}

impl<F, T> Drop for Progress<F, T> {
    fn drop(&mut self) {
        let removed = self.shared.state.lock().wakers.remove(self.id);
        drop(removed);
    }
}

/// The future of [`DropQueue::push_async`](super::DropQueue::push_async): resolves once the value
/// is queued (or refused because the queue is closing).
///
/// # Cancel safety
///
/// Dropping it before it resolved queues the value all the same, past the capacity, without
/// blocking, as a dropped [`Rejected`] does: the value is never dropped before its fence.
#[must_use = "futures do nothing unless you .await or poll them; dropping this one queues \
              its value all the same"]
pub struct PushFuture<F: Fence, T: Send + 'static> {
    pub(super) shared: Arc<Shared<F, T>>,
    /// The fence and value, until queued or handed back.
    pub(super) entry: Option<(F, T)>,
    pub(super) id: u64,
}

impl<F: Fence, T: Send + 'static> Future for PushFuture<F, T> {
    type Output = Result<(), Rejected<F, T>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.entry.is_none() {
            // Resolved already: the value was queued or handed back.
            return Poll::Ready(Ok(()));
        }
        let own_thread = this.shared.on_own_thread();
        let mut state = this.shared.state.lock();
        // The entry stays in the future until it is queued or handed back: a panic in the waker's
        // clone or drop (an executor's code) leaves it to the future's drop, which queues it. On
        // the queue's own thread it is queued at once, as `push_blocking` queues it.
        let closed = state.closing && !own_thread;
        if !closed && state.pending() >= state.capacity && !own_thread {
            let replaced = state.wakers.register(this.id, cx.waker());
            drop(state);
            drop(replaced);
            return Poll::Pending;
        }
        let removed = state.wakers.remove(this.id);
        let Some((fence, value)) = this.entry.take() else {
            unreachable!("checked above, and only this future takes it")
        };
        let result = if closed {
            drop(state);
            Err(Rejected::closed(this.shared.clone(), fence, value))
        } else {
            this.shared.enqueue(state, fence, value);
            Ok(())
        };
        drop(removed);
        Poll::Ready(result)
    }
}

// The entry is moved in and out, never pinned in place.
impl<F: Fence, T: Send + 'static> Unpin for PushFuture<F, T> {}

impl<F: Fence, T: Send + 'static> Drop for PushFuture<F, T> {
    fn drop(&mut self) {
        // The value first: nothing that can panic comes before it is safe.
        if let Some((fence, value)) = self.entry.take() {
            self.shared.adopt(fence, value);
        }
        let removed = self.shared.state.lock().wakers.remove(self.id);
        drop(removed);
    }
}

impl<F: Fence, T: Send + 'static> fmt::Debug for PushFuture<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PushFuture")
            .field("queued", &self.entry.is_none())
            .finish_non_exhaustive()
    }
}

impl<F, T> fmt::Debug for Progress<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progress")
            .field("until", &self.until)
            .finish_non_exhaustive()
    }
}
