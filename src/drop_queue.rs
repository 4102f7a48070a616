//! [`DropQueue`]: keep values alive until their fence has passed, then drop
//! them off the caller's thread.
//!
//! The case it is for: a pinned host staging buffer that a device copy may
//! still read. Freeing it when the host is done with it would let the copy
//! read freed memory; waiting for the copy on the spot would stall whoever
//! freed it. Instead the buffer goes into the queue with a fence recorded
//! after the copy, and the queue's own thread drops it once the fence passes.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use crate::loom::{Condvar, Mutex, MutexGuard};
use crate::{EventApi, EventFence, ServerError};

/// Something that can be waited for: the contract a [`DropQueue`] needs.
/// [`EventFence`] implements it.
pub trait Fence: Send + 'static {
    /// Block until the fence has passed.
    ///
    /// # Errors
    ///
    /// The fence failed: the device faulted, or the driver refused the wait.
    fn wait(self) -> Result<(), ServerError>;

    /// Whether the fence has passed, without blocking: `Ok(true)` passed,
    /// `Ok(false)` not yet (also the answer of fences that cannot tell).
    ///
    /// # Errors
    ///
    /// The fence failed.
    fn is_passed(&self) -> Result<bool, ServerError> {
        Ok(false)
    }
}

/// The drop queue is where a fence pays off: a freed host buffer waits on one
/// rather than on the stream's owner.
///
/// If the fence's wait fails, the stream is synchronized instead (with a
/// warning), as the crate's other fallbacks do: when that succeeds, the
/// stream is idle, so everything queued before the fence has run and the
/// fence has passed. Only when the stream cannot be synchronized either (a
/// faulted stream or device) does the fence fail.
impl<A: EventApi> Fence for EventFence<A> {
    fn wait(self) -> Result<(), ServerError> {
        let stream = self.stream();
        match self.wait_sync() {
            Ok(()) => Ok(()),
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

/// Default [`DropQueue::new`] capacity.
pub const DEFAULT_DROP_QUEUE_CAPACITY: usize = 4096;

/// Keeps each value alive until its fence has passed, then drops it on the
/// queue's own thread, in push order.
///
/// - One thread waits each fence in turn, so a value waits behind every value
///   pushed before it, even one on another stream. Where streams run at
///   different paces, give each its own queue: a slow stream then holds back
///   (and fills) only its own.
/// - [`push`](Self::push) never blocks on the device.
/// - Memory is bounded: at most `capacity` values wait at once; a push beyond
///   that is refused and hands the fence and value back
///   ([`Rejected::Full`]), for the caller to wait itself or retry after
///   [`flush`](Self::flush).
/// - A fence whose wait fails is not given up at once: an [`EventFence`]
///   then synchronizes its stream, and if the stream is idle its value is
///   dropped as usual (the driver may merely have refused the wait while a
///   copy still ran; the synchronize waited for the copy). A fence that
///   **fails** even so (a faulted stream or device) says nothing about
///   whether the device still reads the value, so the value is **leaked**
///   (never dropped), with an error logged and counted in
///   [`leaked`](DropQueueStats::leaked): a leaked staging buffer is a bounded
///   loss, a freed one still read by the device is memory corruption.
/// - Dropping the queue is [`shutdown`](Self::shutdown): it **blocks** until
///   every fence has passed (as long as the slowest stream's queued work),
///   drops every value, and joins the thread. In async code, use
///   [`shutdown_async`](Self::shutdown_async) (and
///   [`flush_async`](Self::flush_async) for [`flush`](Self::flush)), which
///   block no thread.
/// - There is no `Default`: starting the queue's thread can fail, and
///   `Default` could not return that error. Use
///   `DropQueue::new(DEFAULT_DROP_QUEUE_CAPACITY)`.
///
/// ```
/// use device_events::drop_queue::DropQueue;
/// use device_events::host::{Host, HostStream};
/// use device_events::EventFence;
///
/// let stream = HostStream::new()?;
/// let queue = DropQueue::new(16)?;
/// let staging = vec![0u8; 1 << 20]; // say, a pinned host buffer
/// stream.launch(|| { /* a device copy reads the buffer */ })?;
/// // Returns at once; the buffer is dropped once the copy is done.
/// queue.push(EventFence::<Host>::new(stream.handle()), staging).ok();
/// queue.flush();
/// assert_eq!(queue.stats().dropped, 1);
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct DropQueue<F: Fence, T: Send + 'static> {
    shared: Arc<Shared<F, T>>,
    thread: Option<JoinHandle<()>>,
}

struct Shared<F, T> {
    state: Mutex<State<F, T>>,
    /// The queue's thread waits here for entries; flushes wait for progress.
    changed: Condvar,
}

struct State<F, T> {
    queue: VecDeque<(F, T)>,
    capacity: usize,
    in_flight: bool,
    closing: bool,
    /// Set by the queue's thread as it exits.
    exited: bool,
    stats: DropQueueStats,
    /// Tasks awaiting progress ([`DropQueue::flush_async`],
    /// [`DropQueue::shutdown_async`]): woken after each value and on exit.
    wakers: Vec<Waker>,
}

/// What a [`DropQueue`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropQueueStats {
    /// Values accepted by `push`.
    pub pushed: u64,
    /// Values dropped after their fence passed.
    pub dropped: u64,
    /// Values leaked because their fence failed.
    pub leaked: u64,
    /// Values waiting now (queued or being waited on).
    pub pending: usize,
    /// Of those, the ones the queue's thread has not taken up yet.
    pub queued: usize,
}

/// Why a push was refused; the fence and value come back.
///
/// An error (`Display` and [`std::error::Error`]), so `queue.push(..)?`
/// works; [`into_inner`](Self::into_inner) takes the fence and value back.
pub enum Rejected<F, T> {
    /// `capacity` values are already waiting.
    Full(F, T),
    /// The queue is shutting down.
    Closed(F, T),
}

impl<F, T> Rejected<F, T> {
    /// The fence and value that were refused.
    pub fn into_inner(self) -> (F, T) {
        match self {
            Self::Full(fence, value) | Self::Closed(fence, value) => (fence, value),
        }
    }
}

impl<F, T> fmt::Display for Rejected<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Full(..) => "the drop queue is full: its capacity of values are waiting",
            Self::Closed(..) => "the drop queue is shutting down",
        })
    }
}

impl<F, T> std::error::Error for Rejected<F, T> {}

impl<F: Fence, T: Send + 'static> DropQueue<F, T> {
    /// A queue holding at most `capacity` waiting values, with its thread.
    ///
    /// # Errors
    ///
    /// [`ServerError::InvalidArgument`] for a capacity of 0 (no value could
    /// ever be pushed); [`ServerError::ThreadSpawn`] when the thread could
    /// not be started.
    pub fn new(capacity: usize) -> Result<Self, ServerError> {
        if capacity == 0 {
            return Err(ServerError::InvalidArgument {
                what: "DropQueue capacity",
                reason: "0: no value could ever be pushed; use at least 1".to_owned(),
            });
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                capacity,
                in_flight: false,
                closing: false,
                exited: false,
                stats: DropQueueStats::default(),
                wakers: Vec::new(),
            }),
            changed: Condvar::new(),
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("device-events-drop-queue".to_owned())
            .spawn(move || worker.run())
            .map_err(|err| ServerError::ThreadSpawn {
                component: "DropQueue",
                reason: err.to_string(),
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Keep `value` alive until `fence` passes, then drop it on the queue's
    /// thread. Never blocks on the device.
    ///
    /// # Errors
    ///
    /// [`Rejected::Full`] when `capacity` values are waiting, and
    /// [`Rejected::Closed`] while shutting down; both hand back the fence and
    /// the value.
    pub fn push(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let mut state = self.shared.lock();
        if state.closing {
            return Err(Rejected::Closed(fence, value));
        }
        if state.pending() >= state.capacity {
            return Err(Rejected::Full(fence, value));
        }
        state.queue.push_back((fence, value));
        state.stats.pushed += 1;
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// The most values that may wait at once.
    pub fn capacity(&self) -> usize {
        self.shared.lock().capacity
    }

    /// Block until every value pushed before this call has been dropped (or
    /// leaked, if its fence failed). In async code, use
    /// [`flush_async`](Self::flush_async).
    pub fn flush(&self) {
        let mut state = self.shared.lock();
        let target = state.stats.pushed;
        while state.stats.dropped + state.stats.leaked < target {
            state = self.shared.changed.wait(state);
        }
    }

    /// What the queue has done so far.
    pub fn stats(&self) -> DropQueueStats {
        self.shared.lock().stats()
    }

    /// A future of [`flush`](Self::flush): resolves once every value pushed
    /// before this call has been dropped (or leaked). Blocks no thread: the
    /// queue's thread wakes it.
    ///
    /// # Cancel safety
    ///
    /// Dropping it changes nothing: the values are dropped all the same.
    #[doc(alias = "flush")]
    pub fn flush_async(&self) -> Progress<F, T> {
        let target = self.shared.lock().stats.pushed;
        Progress {
            shared: self.shared.clone(),
            until: Until::Handled(target),
        }
    }

    /// Wait for every fence, drop every value, and join the thread. Blocks
    /// until the slowest fence passes; in async code, use
    /// [`shutdown_async`](Self::shutdown_async).
    pub fn shutdown(mut self) -> DropQueueStats {
        self.close_and_join();
        self.stats()
    }

    /// A future of [`shutdown`](Self::shutdown): refuses new pushes at once,
    /// then resolves with the final stats once every fence has passed, every
    /// value is dropped and the thread has exited. Blocks no thread.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolves leaves the queue closed to new
    /// pushes; its thread still drops every value, and exits on its own.
    #[doc(alias = "shutdown")]
    pub fn shutdown_async(mut self) -> impl Future<Output = DropQueueStats> + Send + 'static {
        self.shared.lock().closing = true;
        self.shared.changed.notify_all();
        let thread = self.thread.take();
        let progress = Progress {
            shared: self.shared.clone(),
            until: Until::Exited,
        };
        async move {
            let stats = progress.await;
            // The thread has said it exits: joining it takes no time.
            if let Some(thread) = thread {
                if thread.join().is_err() {
                    log::error!("the drop queue's thread panicked");
                }
            }
            stats
        }
    }

    /// Stop without waiting on the device: values whose fence has already
    /// passed are dropped; the rest are handed back with their fences, in
    /// push order, for the caller to keep alive. The value being waited on
    /// when this is called is waited for.
    pub fn shutdown_now(mut self) -> Vec<(F, T)> {
        let waiting: Vec<(F, T)> = {
            let mut state = self.shared.lock();
            state.closing = true;
            state.queue.drain(..).collect()
        };
        let mut handed_back = Vec::new();
        for (fence, value) in waiting {
            match fence.is_passed() {
                Ok(true) => drop_value(value),
                _ => handed_back.push((fence, value)),
            }
        }
        self.close_and_join();
        handed_back
    }

    fn close_and_join(&mut self) {
        self.shared.lock().closing = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::error!("the drop queue's thread panicked");
            }
        }
    }
}

impl<F: Fence, T: Send + 'static> Drop for DropQueue<F, T> {
    fn drop(&mut self) {
        self.close_and_join();
    }
}

impl<F, T> Shared<F, T> {
    fn lock(&self) -> MutexGuard<'_, State<F, T>> {
        self.state.lock()
    }
}

impl<F: Fence, T: Send + 'static> Shared<F, T> {
    /// The queue's thread: wait for each fence in push order, then drop its
    /// value (or leak it if the fence failed).
    fn run(&self) {
        crate::own_threads::enter();
        // Whichever way the thread ends, awaiting shutdowns learn it.
        let _exit = ExitGuard(self);
        loop {
            let (fence, value) = {
                let mut state = self.lock();
                loop {
                    if let Some(entry) = state.queue.pop_front() {
                        state.in_flight = true;
                        break entry;
                    }
                    if state.closing {
                        return;
                    }
                    state = self.changed.wait(state);
                }
            };
            let passed =
                catch_unwind(AssertUnwindSafe(|| fence.wait())).unwrap_or_else(|payload| {
                    Err(ServerError::WaiterPanicked {
                        message: ServerError::panic_message(payload.as_ref()),
                    })
                });
            let leaked = match passed {
                Ok(()) => {
                    drop_value(value);
                    false
                }
                Err(err) => {
                    log::error!("a drop queue's fence failed, leaking its value rather than freeing memory the device may still read: {err}");
                    std::mem::forget(value);
                    true
                }
            };
            let mut state = self.lock();
            state.in_flight = false;
            if leaked {
                state.stats.leaked += 1;
            } else {
                state.stats.dropped += 1;
            }
            let wakers = std::mem::take(&mut state.wakers);
            drop(state);
            self.changed.notify_all();
            wakers.into_iter().for_each(Waker::wake);
        }
    }

    /// The thread's last act: say it exits, and wake who awaits that.
    fn exit(&self) {
        let mut state = self.lock();
        state.exited = true;
        let wakers = std::mem::take(&mut state.wakers);
        drop(state);
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// Calls [`Shared::exit`] when the queue's thread ends, even by a panic.
struct ExitGuard<'a, F: Fence, T: Send + 'static>(&'a Shared<F, T>);

impl<F: Fence, T: Send + 'static> Drop for ExitGuard<'_, F, T> {
    fn drop(&mut self) {
        self.0.exit();
    }
}

/// What a [`Progress`] future waits for.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// This many values dropped or leaked.
    Handled(u64),
    /// The queue's thread exited (after handling everything).
    Exited,
}

/// The future of [`DropQueue::flush_async`]: resolves with the queue's stats
/// once the values pushed before it was made have been handled.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct Progress<F, T> {
    shared: Arc<Shared<F, T>>,
    until: Until,
}

impl<F, T> Future for Progress<F, T> {
    type Output = DropQueueStats;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<DropQueueStats> {
        let mut state = self.shared.lock();
        let done = match self.until {
            Until::Handled(target) => state.stats.dropped + state.stats.leaked >= target,
            Until::Exited => state.exited,
        };
        if done {
            return Poll::Ready(state.stats());
        }
        if !state.wakers.iter().any(|waker| waker.will_wake(cx.waker())) {
            state.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl<F, T> fmt::Debug for Progress<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Progress")
            .field("until", &self.until)
            .finish_non_exhaustive()
    }
}

impl<F, T> State<F, T> {
    fn pending(&self) -> usize {
        self.queue.len() + usize::from(self.in_flight)
    }

    /// What the queue has done so far, and what waits now.
    fn stats(&self) -> DropQueueStats {
        DropQueueStats {
            pending: self.pending(),
            queued: self.queue.len(),
            ..self.stats
        }
    }
}

/// Drop a value whose fence passed; a panic in its `Drop` is logged, and the
/// queue goes on.
fn drop_value<T>(value: T) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| drop(value))) {
        log::error!(
            "a value's drop panicked in the drop queue: {}",
            ServerError::panic_message(payload.as_ref())
        );
    }
}

impl<F: Fence, T: Send + 'static> fmt::Debug for DropQueue<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DropQueue")
            .field("stats", &self.stats())
            .finish()
    }
}

impl<F, T> fmt::Debug for Rejected<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Full(..) => "Rejected::Full",
            Self::Closed(..) => "Rejected::Closed",
        })
    }
}
