//! [`DropQueue`]: the handle a caller pushes to.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::fence::{drop_value, Fence};
use super::futures::{Progress, PushFuture, Until};
use super::handed_back::{HandedBack, Rejected};
use super::shared::{current_thread, Shared};
use super::stats::DropQueueStats;
use crate::sync::Mutex;
use crate::{panics, ServerError};

/// Default [`DropQueue::new`] capacity.
pub const DEFAULT_DROP_QUEUE_CAPACITY: usize = 4096;

/// Keeps each value alive until its fence has passed, then drops it on the queue's own thread,
/// in push order.
///
/// - One thread waits each fence in turn, so a value waits behind every value pushed before it,
///   even one on another stream. Give streams that run at different paces a queue each: a slow
///   stream then holds back (and fills) only its own.
/// - Memory is bounded: at most `capacity` values wait at once, but for those of refusals and
///   push futures dropped unanswered. [`push_blocking`](Self::push_blocking) waits for room and
///   [`push_async`](Self::push_async) awaits it; [`push`](Self::push) never blocks, and hands a
///   refused fence and value back ([`Rejected`]) for the caller to keep alive.
/// - **No value is ever dropped before its fence**, on any path: a refused push hands it back
///   ([`Rejected::wait_then_drop`] keeps the promise for the caller),
///   [`shutdown_now`](Self::shutdown_now) hands back what has not passed in a [`HandedBack`]
///   whose drop waits for each fence, and a [`Rejected`] or `push_async` future dropped
///   unanswered queues its value all the same, past the capacity (once the thread has exited,
///   it leaks a value whose fence has not passed).
/// - When a fence's wait fails, an [`EventFence`](crate::EventFence) synchronizes its stream,
///   and if the stream is idle its value is dropped as usual (the driver may merely have
///   refused the wait while a copy still ran). A fence that **fails** even so (a faulted stream
///   or device) says nothing about whether the device still reads the value, so the value is
///   **leaked** (never dropped), with an error logged and counted in
///   [`leaked`](DropQueueStats::leaked): a leaked staging buffer is a bounded loss, a freed one
///   still read by the device is memory corruption.
/// - Dropping the queue **blocks** until every fence has passed, as
///   [`shutdown`](Self::shutdown) does, but not while the dropping thread panics (see
///   [Drop](#drop)). In async code, use [`shutdown_async`](Self::shutdown_async) (and
///   [`flush_async`](Self::flush_async) for [`flush`](Self::flush)), which block no thread.
/// - A value's drop may use its own queue: `push_blocking` and `push_async` there queue past the
///   capacity, even while closing (only the queue's thread makes room, and it drains the queue
///   before it exits); a flush or shutdown there, blocking or awaited, returns at once rather
///   than wait for itself; the last handle dropped there lets the thread finish on its own.
/// - There is no `Default`: starting the thread can fail, and `Default` could not return that
///   error. Use `DropQueue::new(DEFAULT_DROP_QUEUE_CAPACITY)`.
///
/// ```
/// use device_events::drop_queue::DropQueue;
/// use device_events::host::HostStream;
///
/// let stream = HostStream::new()?;
/// let queue = DropQueue::new(16)?;
/// let staging = vec![0u8; 1 << 20]; // say, a pinned host buffer
/// stream.launch(|| { /* a device copy reads the buffer */ })?;
/// // Returns once there is room (at once, here); the buffer is dropped on
/// // the queue's thread once the copy is done.
/// if let Err(closed) = queue.push_blocking(stream.fence(), staging) {
///     closed.wait_then_drop()?; // shutting down: wait for the copy here
/// }
/// queue.flush();
/// assert_eq!(queue.stats().dropped, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// In async code, `queue.push_async(fence, staging).await` waits for room
/// without blocking a thread.
///
/// # Drop
///
/// Dropping the queue closes it to new pushes (as [`close`](Self::close)), then:
///
/// - **Normally**, it is [`shutdown`](Self::shutdown): it **blocks** until every queued fence
///   has passed (the slowest stream's queued work), drops every value, and joins the thread.
/// - **While the dropping thread panics** ([`std::thread::panicking`]: the queue dropped by an
///   unwind), it returns at once, without waiting for any fence: the thread is detached, and
///   goes on dropping each value once its fence passes, then exits. Waiting there could hang
///   the unwind for good, as when a failing test holds the queue over work it holds back
///   itself (a gate it drops after the queue). No value is dropped early: one whose fence
///   fails is leaked, as ever, and values still queued when the process exits are never
///   dropped (their memory goes with the process).
/// - On the queue's own thread (the last handle, dropped by a value's drop), it returns at
///   once too: the thread drops the rest, then exits.
/// - After [`shutdown_async`](Self::shutdown_async), whose future joins the thread, it returns
///   at once.
pub struct DropQueue<F: Fence, T: Send + 'static> {
    shared: Arc<Shared<F, T>>,
    /// Taken by the first to shut down: [`DropQueue::shutdown_async`] (via `&self`, so behind a
    /// lock) or the queue's drop.
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<F: Fence, T: Send + 'static> DropQueue<F, T> {
    /// A queue holding at most `capacity` waiting values, with its thread.
    ///
    /// # Errors
    ///
    /// [`ServerError::InvalidArgument`] for a capacity of 0; [`ServerError::ThreadSpawn`] when
    /// the thread could not be started.
    pub fn new(capacity: usize) -> Result<Self, ServerError> {
        if capacity == 0 {
            return Err(ServerError::InvalidArgument {
                what: "DropQueue capacity",
                reason: "0: no value could ever be pushed; use at least 1".to_owned(),
            });
        }
        let shared = Arc::new(Shared::new(capacity));
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("device-events-drop-queue".to_owned())
            .spawn(move || worker.run())
            .map_err(|err| ServerError::thread_spawn("DropQueue", err))?;
        let _ = shared.thread.set(thread.thread().id());
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Keep `value` alive until `fence` passes, then drop it on the queue's thread. Never blocks.
    ///
    /// # Errors
    ///
    /// [`Rejected::Full`] when `capacity` values are waiting, [`Rejected::Closed`] while shutting
    /// down; both hand back the fence and value, which the caller must keep alive until the
    /// fence passes ([`Rejected::wait_then_drop`]), or drop the refusal to queue the value anyway.
    pub fn push(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let state = self.shared.lock();
        if state.closing {
            return Err(Rejected::closed(self.shared.clone(), fence, value));
        }
        if state.pending() >= state.capacity {
            return Err(Rejected::full(self.shared.clone(), fence, value));
        }
        self.shared.enqueue(state, fence, value);
        Ok(())
    }

    /// As [`push`](Self::push), but when `capacity` values are waiting, block until one has been
    /// dropped. In async code, use [`push_async`](Self::push_async).
    ///
    /// On the queue's own thread (in a value's drop) it does not wait: the value is queued past
    /// the capacity, even while closing, since only that thread makes room, and it drains the
    /// queue before it exits.
    ///
    /// # Errors
    ///
    /// [`Rejected::Closed`] while shutting down, with the fence and value, which the caller must
    /// keep alive until the fence passes ([`Rejected::wait_then_drop`]).
    pub fn push_blocking(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let mut state = self.shared.lock();
        // On its own thread the thread has not exited and will see the entry, closing or not.
        let own_thread = self.shared.on_own_thread();
        loop {
            if state.closing && !own_thread {
                return Err(Rejected::closed(self.shared.clone(), fence, value));
            }
            if state.pending() < state.capacity || own_thread {
                self.shared.enqueue(state, fence, value);
                return Ok(());
            }
            state = self.shared.changed.wait(state);
        }
    }

    /// A future of [`push_blocking`](Self::push_blocking): resolves once the value is queued,
    /// waiting for room without blocking a thread (the queue's thread wakes it).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolved neither drops the value early nor blocks: it is
    /// queued all the same (past the capacity), as a dropped [`Rejected`] queues it.
    ///
    /// # Errors
    ///
    /// As for [`push_blocking`](Self::push_blocking).
    pub fn push_async(&self, fence: F, value: T) -> PushFuture<F, T> {
        let id = self.shared.lock().wakers.id();
        PushFuture {
            shared: self.shared.clone(),
            entry: Some((fence, value)),
            id,
        }
    }

    /// The most values that may wait at once.
    pub fn capacity(&self) -> usize {
        self.shared.lock().capacity
    }

    /// Block until every value pushed before this call has been dropped (or leaked, if its fence
    /// failed, or handed back by [`shutdown_now`](Self::shutdown_now)). In async code, use
    /// [`flush_async`](Self::flush_async).
    ///
    /// On the queue's own thread (in a value's drop) it returns at once: the queue cannot wait
    /// for itself.
    pub fn flush(&self) {
        if self.shared.on_own_thread() {
            panics::log(|| {
                log::warn!(
                    "DropQueue::flush called by a value's drop on the queue's own thread \
                     returns at once: the queue cannot wait for itself"
                );
            });
            return;
        }
        let mut state = self.shared.lock();
        let target = state.stats.pushed;
        while !state.handled(target) {
            state = self.shared.changed.wait(state);
        }
    }

    /// What the queue has done so far.
    pub fn stats(&self) -> DropQueueStats {
        self.shared.lock().stats()
    }

    /// A future of [`flush`](Self::flush): resolves once every value pushed before this call has
    /// been dropped (or leaked). Blocks no thread: the queue's thread wakes it.
    ///
    /// # Cancel safety
    ///
    /// Dropping it changes nothing: the values are dropped all the same.
    #[doc(alias = "flush")]
    pub fn flush_async(&self) -> Progress<F, T> {
        let mut state = self.shared.lock();
        let target = state.stats.pushed;
        let id = state.wakers.id();
        drop(state);
        Progress {
            shared: self.shared.clone(),
            until: Until::Handled(target),
            id,
        }
    }

    /// Wait for every fence, drop every value, and join the thread. Blocks until the slowest
    /// fence passes; in async code, use [`shutdown_async`](Self::shutdown_async).
    ///
    /// On the queue's own thread (in a value's drop) it closes the queue and returns at once:
    /// the thread drops the rest, then exits.
    pub fn shutdown(mut self) -> DropQueueStats {
        self.close_and_join();
        self.stats()
    }

    /// A future of [`shutdown`](Self::shutdown): refuses new pushes at once, then resolves with
    /// the final stats once every fence has passed, every value is dropped and the thread has
    /// exited. Blocks no thread.
    ///
    /// It takes `&self`, so a queue shared by a service's handlers (in an `Arc`) shuts down
    /// without a lock of the service's own: handlers that push meanwhile get
    /// [`Rejected::Closed`]. Every call's future resolves once the thread has exited; the
    /// queue's drop afterwards returns at once.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves leaves the queue closed to new pushes; its thread
    /// still drops every value, and exits on its own.
    ///
    /// ```
    /// use device_events::drop_queue::DropQueue;
    /// use device_events::host::HostStream;
    /// use std::sync::Arc;
    ///
    /// # futures::executor::block_on(async {
    /// let stream = HostStream::new()?;
    /// let queue = Arc::new(DropQueue::new(16)?);
    /// let handler = queue.clone(); // as a request handler holds it
    /// handler.push_async(stream.fence(), vec![0u8; 64]).await?;
    /// let stats = queue.shutdown_async().await;
    /// assert_eq!(stats.dropped, 1);
    /// assert!(handler.push(stream.fence(), vec![0u8; 64]).is_err(), "closed");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[doc(alias = "shutdown")]
    pub fn shutdown_async(&self) -> impl Future<Output = DropQueueStats> + Send + 'static {
        self.shared.close();
        let id = self.shared.lock().wakers.id();
        let thread = self.take_thread();
        let progress = Progress {
            shared: self.shared.clone(),
            until: Until::Exited,
            id,
        };
        async move {
            let stats = progress.await;
            // The thread has said it exits: joining takes no time (skipped on the thread itself).
            if let Some(thread) = thread.filter(|thread| thread.thread().id() != current_thread()) {
                if thread.join().is_err() {
                    log::error!("the drop queue's thread panicked");
                }
            }
            stats
        }
    }

    /// Stop without waiting on the device: values whose fence has already passed are dropped;
    /// the rest are handed back with their fences, in push order, for the caller to keep alive
    /// until their fences pass ([`HandedBack`]: its drop waits for them). The value being waited
    /// on when this is called is waited for. A fence whose [`is_passed`](Fence::is_passed) fails
    /// or panics is handed back, not dropped.
    pub fn shutdown_now(mut self) -> HandedBack<F, T> {
        self.shared.close();
        let waiting: Vec<(u64, F, T)> = {
            let mut state = self.shared.lock();
            state.checking = state.queue.front().map(|(number, ..)| *number);
            state.queue.drain(..).collect()
        };
        let mut entries = Vec::new();
        let mut dropped = 0;
        for (_, fence, value) in waiting {
            match panics::catch(|| fence.is_passed()) {
                Ok(Ok(true)) => {
                    drop_value(value);
                    dropped += 1;
                }
                Ok(_) => entries.push((fence, value)),
                Err(message) => {
                    panics::log(|| {
                        log::error!(
                            "a fence's is_passed panicked in DropQueue::shutdown_now; its value \
                             is handed back: {message}"
                        );
                    });
                    entries.push((fence, value));
                }
            }
        }
        self.shared.update_and_wake(|state| {
            state.stats.dropped += dropped;
            state.stats.handed_back += entries.len() as u64;
            state.checking = None;
        });
        self.close_and_join();
        HandedBack { entries }
    }

    /// Refuse new pushes from now on ([`Rejected::Closed`]; `push_async` futures not queued yet
    /// resolve with it too), without waiting: values already queued are still dropped, each once
    /// its fence has passed, and the thread exits once it has dropped the last;
    /// [`flush`](Self::flush), [`shutdown_async`](Self::shutdown_async) or the queue's drop wait
    /// for that. Safe to call more than once, and from any handle of a shared queue.
    pub fn close(&self) {
        self.shared.close();
    }

    /// The queue's thread, for the first caller that shuts the queue down.
    fn take_thread(&self) -> Option<JoinHandle<()>> {
        self.thread.lock().take()
    }

    fn close_and_join(&mut self) {
        self.shared.close();
        if let Some(thread) = self.take_thread() {
            // The last handle dropped by a value on the queue's own thread: it finishes on its own.
            if thread.thread().id() != current_thread() && thread.join().is_err() {
                panics::log(|| log::error!("the drop queue's thread panicked"));
            }
        }
    }

    /// The queue dropped by a panicking thread: close it and let its thread finish on its own,
    /// dropping each value once its fence passes. Joining could wait for good, on work that
    /// only the unwind (dropping a gate declared before the queue, say) would let finish.
    fn close_and_detach(&mut self) {
        self.shared.close();
        let Some(thread) = self.take_thread() else {
            return;
        };
        let pending = self.shared.lock().pending();
        if pending > 0 {
            panics::log(|| {
                log::warn!(
                    "a DropQueue dropped during a panic does not wait for its fences: its own \
                     thread drops the {pending} value(s) left as their fences pass"
                );
            });
        }
        // Detached: the thread owns its share of the state, and exits once the queue is empty.
        drop(thread);
    }
}

impl<F: Fence, T: Send + 'static> Drop for DropQueue<F, T> {
    /// See [`DropQueue`]'s `# Drop`: joins, unless this thread panics.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.close_and_detach();
        } else {
            self.close_and_join();
        }
    }
}

impl<F: Fence, T: Send + 'static> fmt::Debug for DropQueue<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DropQueue")
            .field("stats", &self.stats())
            .finish()
    }
}
