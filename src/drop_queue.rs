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
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

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
/// - Dropping the queue is [`shutdown`](Self::shutdown): it waits for every
///   fence, drops every value, and joins the thread.
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
    stats: DropQueueStats,
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
pub enum Rejected<F, T> {
    /// `capacity` values are already waiting.
    Full(F, T),
    /// The queue is shutting down.
    Closed(F, T),
}

impl<F: Fence, T: Send + 'static> DropQueue<F, T> {
    /// A queue holding at most `capacity` waiting values (at least 1), with
    /// its thread.
    ///
    /// # Errors
    ///
    /// The thread could not be started.
    pub fn new(capacity: usize) -> Result<Self, ServerError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                capacity: capacity.max(1),
                in_flight: false,
                closing: false,
                stats: DropQueueStats::default(),
            }),
            changed: Condvar::new(),
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("device-events-drop-queue".to_owned())
            .spawn(move || worker.run())
            .map_err(|err| ServerError::Unavailable {
                backend: "DropQueue",
                reason: format!("could not start the drop queue's thread: {err}"),
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

    /// Block until every value pushed before this call has been dropped (or
    /// leaked, if its fence failed).
    pub fn flush(&self) {
        let mut state = self.shared.lock();
        let target = state.stats.pushed;
        while state.stats.dropped + state.stats.leaked < target {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// What the queue has done so far.
    pub fn stats(&self) -> DropQueueStats {
        let state = self.shared.lock();
        DropQueueStats {
            pending: state.pending(),
            queued: state.queue.len(),
            ..state.stats
        }
    }

    /// Wait for every fence, drop every value, and join the thread.
    pub fn shutdown(mut self) -> DropQueueStats {
        self.close_and_join();
        self.stats()
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
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<F: Fence, T: Send + 'static> Shared<F, T> {
    /// The queue's thread: wait for each fence in push order, then drop its
    /// value (or leak it if the fence failed).
    fn run(&self) {
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
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(PoisonError::into_inner);
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
            drop(state);
            self.changed.notify_all();
        }
    }
}

impl<F, T> State<F, T> {
    fn pending(&self) -> usize {
        self.queue.len() + usize::from(self.in_flight)
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
