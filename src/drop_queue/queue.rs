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
///   even one on another stream: give streams that run at different paces a queue each.
/// - At most `capacity` values wait at once, but for those of refusals and push futures dropped
///   unanswered. [`push_blocking`](Self::push_blocking) waits for room, and
///   [`push_async`](Self::push_async) awaits it; [`push`](Self::push) never blocks, and hands a
///   refused fence and value back ([`Rejected`]).
/// - **No value is ever dropped before its fence**, on any path: a refused push hands it back,
///   [`shutdown_now`](Self::shutdown_now) hands back what has not passed ([`HandedBack`]), and a
///   [`Rejected`] or `push_async` future dropped unanswered queues its value all the same.
/// - When a fence's wait fails, an [`EventFence`](crate::EventFence) synchronizes its stream,
///   and if that succeeds its value is dropped as usual. A fence that **fails** even so (a
///   faulted stream or device) leaves the value **leaked** (never dropped), with an error logged
///   and counted in [`leaked`](DropQueueStats::leaked): a leaked staging buffer is a bounded
///   loss, a freed one still read by the device is memory corruption.
/// - A value's drop may use its own queue: pushes there queue past the capacity, even while
///   closing, and a flush or shutdown there returns at once rather than wait for itself.
/// - There is no `Default`: starting the thread can fail. Use
///   `DropQueue::new(DEFAULT_DROP_QUEUE_CAPACITY)`.
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
/// # Drop
///
/// Dropping the queue closes it to new pushes (as [`close`](Self::close)), then:
///
/// - **Normally**, it is [`shutdown`](Self::shutdown): it **blocks** until every queued fence
///   has passed, drops every value, and joins the thread. In async code, use
///   [`shutdown_async`](Self::shutdown_async), after which the drop returns at once.
/// - **While the dropping thread panics** ([`std::thread::panicking`]), it returns at once: the
///   thread is detached, and goes on dropping each value once its fence passes. Waiting could
///   hang the unwind for good (a failing test holding the queue over work it holds back itself).
///   Values still queued when the process exits are never dropped.
/// - On the queue's own thread (the last handle, dropped by a value's drop), it returns at
///   once too: the thread drops the rest, then exits.
pub struct DropQueue<F: Fence, T: Send + 'static> {
    shared: Arc<Shared<F, T>>,
    /// Taken by the first to shut down (behind a lock for `shutdown_async(&self)`).
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
    /// down; both hand back the fence and value (see [`Rejected`]).
    pub fn push(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let state = self.shared.state.lock();
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
    /// dropped. In async code, use [`push_async`](Self::push_async). On the queue's own thread
    /// it queues past the capacity, even while closing: only that thread makes room, and it
    /// drains the queue before it exits.
    ///
    /// # Errors
    ///
    /// [`Rejected::Closed`] while shutting down, with the fence and value.
    pub fn push_blocking(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let mut state = self.shared.state.lock();
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
    /// blocking no thread.
    ///
    /// # Cancel safety
    ///
    /// As for [`PushFuture`]: dropped early, it queues the value all the same, without blocking.
    ///
    /// # Errors
    ///
    /// As for [`push_blocking`](Self::push_blocking).
    pub fn push_async(&self, fence: F, value: T) -> PushFuture<F, T> {
        let id = self.shared.state.lock().wakers.id();
        PushFuture {
            shared: self.shared.clone(),
            entry: Some((fence, value)),
            id,
        }
    }

    /// The most values that may wait at once.
    pub fn capacity(&self) -> usize {
        self.shared.state.lock().capacity
    }

    /// Block until every value pushed before this call has been dropped (or leaked, or handed back
    /// by [`shutdown_now`](Self::shutdown_now)); at once on the queue's own thread. In async code,
    /// use [`flush_async`](Self::flush_async).
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
        let mut state = self.shared.state.lock();
        let target = state.stats.pushed;
        while !state.handled(target) {
            state = self.shared.changed.wait(state);
        }
    }

    /// What the queue has done so far.
    pub fn stats(&self) -> DropQueueStats {
        self.shared.state.lock().stats()
    }

    /// A future of [`flush`](Self::flush), blocking no thread.
    ///
    /// # Cancel safety
    ///
    /// Dropping it changes nothing: the values are dropped all the same.
    #[doc(alias = "flush")]
    pub fn flush_async(&self) -> Progress<F, T> {
        self.progress(Until::Handled)
    }

    /// Wait for every fence, drop every value, and join the thread (on the queue's own thread,
    /// close it and return at once). In async code, use [`shutdown_async`](Self::shutdown_async).
    pub fn shutdown(mut self) -> DropQueueStats {
        self.close_and_join();
        self.stats()
    }

    /// A future of [`shutdown`](Self::shutdown), blocking no thread: refuses new pushes at once,
    /// then resolves with the final stats once the thread has exited.
    ///
    /// It takes `&self`, so a queue shared by a service's handlers (in an `Arc`) shuts down
    /// without a lock of the service's own: handlers that push meanwhile get
    /// [`Rejected::Closed`]. The queue's drop afterwards returns at once.
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
        let thread = self.thread.lock().take();
        let progress = self.progress(|_| Until::Exited);
        async move {
            let stats = progress.await;
            // The thread has said it exits: joining takes no time.
            if let Some(thread) = thread.filter(|thread| thread.thread().id() != current_thread()) {
                if thread.join().is_err() {
                    log::error!("the drop queue's thread panicked");
                }
            }
            stats
        }
    }

    /// Stop, waiting on the device only for the value the queue's thread is waiting on when this
    /// is called: values whose fence has passed are dropped, the rest handed back
    /// ([`HandedBack`]), as is a value whose [`is_passed`](Fence::is_passed) fails or panics.
    pub fn shutdown_now(mut self) -> HandedBack<F, T> {
        self.shared.close();
        let waiting: Vec<(u64, F, T)> = {
            let mut state = self.shared.state.lock();
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

    /// Refuse new pushes from now on ([`Rejected::Closed`], also for `push_async` futures not
    /// queued yet), without waiting: queued values are still dropped as their fences pass, then
    /// the thread exits. Safe to call more than once.
    pub fn close(&self) {
        self.shared.close();
    }

    /// A [`Progress`] future until `until` of the values pushed so far.
    fn progress(&self, until: impl FnOnce(u64) -> Until) -> Progress<F, T> {
        let mut state = self.shared.state.lock();
        Progress {
            until: until(state.stats.pushed),
            id: state.wakers.id(),
            shared: self.shared.clone(),
        }
    }

    fn close_and_join(&mut self) {
        self.shared.close();
        if let Some(thread) = self.thread.lock().take() {
            // On the queue's own thread (the last handle, dropped by a value): it finishes alone.
            if thread.thread().id() != current_thread() && thread.join().is_err() {
                panics::log(|| log::error!("the drop queue's thread panicked"));
            }
        }
    }

    /// The queue dropped by a panicking thread (see [`DropQueue`]'s `# Drop`).
    fn close_and_detach(&mut self) {
        self.shared.close();
        let Some(thread) = self.thread.lock().take() else {
            return;
        };
        let pending = self.shared.state.lock().pending();
        if pending > 0 {
            panics::log(|| {
                log::warn!(
                    "a DropQueue dropped during a panic does not wait for its fences: its own \
                     thread drops the {pending} value(s) left as their fences pass"
                );
            });
        }
        // Detached: the thread owns its share, and exits once the queue is empty.
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
