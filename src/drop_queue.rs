//! [`DropQueue`]: keep values alive until their fence has passed, then drop
//! them off the caller's thread.
//!
//! The case it is for: a pinned host staging buffer that a device copy may
//! still read. Freeing it when the host is done with it would let the copy
//! read freed memory; waiting for the copy on the spot would stall whoever
//! freed it. Instead the buffer goes into the queue with a fence recorded
//! after the copy, and the queue's own thread drops it once the fence passes.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};
use std::thread::{JoinHandle, ThreadId};

use crate::loom::{Condvar, Mutex, MutexGuard};
use crate::{panics, AnyFence, EventApi, EventFence, ServerError};

/// Something that can be waited for: the contract a [`DropQueue`] needs.
/// [`EventFence`] and [`AnyFence`] implement it.
pub trait Fence: Send + 'static {
    /// Block until the fence has passed. (Named for what it does: an
    /// [`EventFence`]'s own [`wait`](EventFence::wait) returns a future.)
    ///
    /// # Errors
    ///
    /// The fence failed: the device faulted, or the driver refused the wait.
    fn wait_blocking(self) -> Result<(), ServerError>;

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
    fn wait_blocking(self) -> Result<(), ServerError> {
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

/// A drop queue may hold fences of either backend: each waits as its
/// [`EventFence`] does.
impl Fence for AnyFence {
    fn wait_blocking(self) -> Result<(), ServerError> {
        match self {
            #[cfg(feature = "cuda")]
            AnyFence::Cuda(fence) => fence.wait_blocking(),
            AnyFence::Host(fence) => fence.wait_blocking(),
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
/// - Memory is bounded: at most `capacity` values wait at once.
///   [`push_blocking`](Self::push_blocking) waits for room and
///   [`push_async`](Self::push_async) awaits it, so a caller never holds a
///   refused value; [`push`](Self::push) never blocks, and hands a refused
///   fence and value back ([`Rejected`]) for the caller to keep alive.
/// - **No value is ever dropped before its fence**, on any path: a refused
///   push hands it back (and [`Rejected::wait_then_drop`] keeps the promise
///   for the caller), [`shutdown_now`](Self::shutdown_now) hands back what
///   has not passed in a [`HandedBack`] whose drop waits for each fence, and
///   a [`push_async`](Self::push_async) future dropped before it resolved
///   queues its value all the same.
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
/// - A value's drop may use its own queue: `push_blocking` and `push_async`
///   there queue past the capacity, even while closing (only the queue's
///   thread makes room, and it drains the queue before it exits), and a
///   flush or shutdown there, blocking or awaited, returns at once rather
///   than wait for itself; the last handle to the queue dropped there lets
///   the thread finish on its own.
/// - There is no `Default`: starting the queue's thread can fail, and
///   `Default` could not return that error. Use
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
/// In async code, `queue.push_async(fence, staging).await` waits for room
/// without blocking a thread.
pub struct DropQueue<F: Fence, T: Send + 'static> {
    shared: Arc<Shared<F, T>>,
    thread: Option<JoinHandle<()>>,
}

struct Shared<F, T> {
    state: Mutex<State<F, T>>,
    /// The queue's thread waits here for entries; flushes and blocking
    /// pushes wait here for progress.
    changed: Condvar,
    /// The queue's thread, set once it is started (before any value can
    /// reach it): a value's drop runs there, and must not wait for it.
    thread: OnceLock<ThreadId>,
}

struct State<F, T> {
    /// Entries with their push numbers (1, 2, ...), in push order.
    queue: VecDeque<(u64, F, T)>,
    capacity: usize,
    /// The push number of the entry the queue's thread is waiting on.
    in_flight: Option<u64>,
    /// The lowest push number among the entries [`DropQueue::shutdown_now`]
    /// has taken out and not yet dropped or handed back.
    checking: Option<u64>,
    closing: bool,
    /// Set by the queue's thread, under this lock, when it has decided to
    /// exit (closing, nothing queued): from then on nobody else will drop a
    /// queued value.
    exited: bool,
    stats: DropQueueStats,
    /// Tasks awaiting progress ([`DropQueue::flush_async`],
    /// [`DropQueue::shutdown_async`], [`DropQueue::push_async`]): woken after
    /// each value and on exit.
    wakers: Wakers,
}

/// The wakers of pending futures, one per future: a future dropped before
/// it resolved takes its waker out again, so none is kept for a task that
/// no longer waits, and a poll finds its own entry without a scan.
#[derive(Default)]
struct Wakers {
    next: u64,
    by_future: HashMap<u64, Waker>,
}

impl Wakers {
    /// A number for a new future.
    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Keep `waker` for future `id`; the waker it replaces comes back, to
    /// be dropped outside the lock (a waker's drop is an executor's code).
    #[must_use]
    fn register(&mut self, id: u64, waker: &Waker) -> Option<Waker> {
        match self.by_future.get(&id) {
            Some(known) if known.will_wake(waker) => None,
            _ => self.by_future.insert(id, waker.clone()),
        }
    }

    /// Forget future `id`'s waker; it comes back, to be dropped outside the
    /// lock.
    #[must_use]
    fn remove(&mut self, id: u64) -> Option<Waker> {
        self.by_future.remove(&id)
    }

    /// All of them, to wake outside the lock (each woken future registers
    /// again if it still waits).
    fn take(&mut self) -> Vec<Waker> {
        self.by_future.drain().map(|(_, waker)| waker).collect()
    }
}

/// Wake `wakers`; a waker that panics (a user's executor) costs only its
/// own wake.
fn wake_all(wakers: Vec<Waker>) {
    for waker in wakers {
        if let Err(message) = panics::catch(|| waker.wake()) {
            panics::log(|| {
                log::error!("a task's waker panicked when the drop queue woke it: {message}")
            });
        }
    }
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
    /// Values handed back unpassed by [`DropQueue::shutdown_now`].
    pub handed_back: u64,
    /// Values waiting now (queued or being waited on).
    pub pending: usize,
    /// Of those, the ones the queue's thread has not taken up yet.
    pub queued: usize,
}

/// Why a push was refused; the fence and value come back, and the value
/// must be kept alive until the fence passes.
///
/// Dropping it drops the value **at once**, while the device may still read
/// it: wait for the fence first, with [`wait_then_drop`](Self::wait_then_drop),
/// or take both back with [`into_inner`](Self::into_inner). To never hold a
/// refused value, push with [`DropQueue::push_blocking`] or
/// [`DropQueue::push_async`], which wait for room.
///
/// It is an error (`Display` and [`std::error::Error`]); propagating it with
/// `?` drops the value wherever the error ends, so do that only with values
/// no device work reads.
#[must_use = "dropping a Rejected drops its value now, while the device may still read it: \
              call wait_then_drop() or into_inner()"]
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

impl<F: Fence, T> Rejected<F, T> {
    /// Block until the fence has passed, then drop the value, as the queue
    /// would have.
    ///
    /// # Errors
    ///
    /// The fence failed: the value is leaked, not dropped (see
    /// [`DropQueue`]), and the error logged.
    pub fn wait_then_drop(self) -> Result<(), ServerError> {
        let (fence, value) = self.into_inner();
        settle(fence, value)
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
                in_flight: None,
                checking: None,
                closing: false,
                exited: false,
                stats: DropQueueStats::default(),
                wakers: Wakers::default(),
            }),
            changed: Condvar::new(),
            thread: OnceLock::new(),
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("device-events-drop-queue".to_owned())
            .spawn(move || worker.run())
            .map_err(|err| ServerError::thread_spawn("DropQueue", err))?;
        let _ = shared.thread.set(thread.thread().id());
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Keep `value` alive until `fence` passes, then drop it on the queue's
    /// thread. Never blocks.
    ///
    /// # Errors
    ///
    /// [`Rejected::Full`] when `capacity` values are waiting, and
    /// [`Rejected::Closed`] while shutting down; both hand back the fence and
    /// the value, which the caller must keep alive until the fence passes
    /// ([`Rejected::wait_then_drop`]).
    pub fn push(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let state = self.shared.lock();
        if state.closing {
            return Err(Rejected::Closed(fence, value));
        }
        if state.pending() >= state.capacity {
            return Err(Rejected::Full(fence, value));
        }
        self.shared.enqueue(state, fence, value);
        Ok(())
    }

    /// Keep `value` alive until `fence` passes, then drop it on the queue's
    /// thread; when `capacity` values are waiting, block until one has
    /// been dropped. In async code, use [`push_async`](Self::push_async).
    ///
    /// On the queue's own thread (in a value's drop) it does not wait: the
    /// value is queued past the capacity (and even while the queue is
    /// closing), since only that thread makes room, and it drains the queue
    /// before it exits.
    ///
    /// # Errors
    ///
    /// [`Rejected::Closed`] while shutting down, with the fence and value,
    /// which the caller must keep alive until the fence passes
    /// ([`Rejected::wait_then_drop`]).
    pub fn push_blocking(&self, fence: F, value: T) -> Result<(), Rejected<F, T>> {
        let mut state = self.shared.lock();
        // On its own thread, in a value's drop, the thread has not exited
        // and will see the entry, closing or not.
        let own_thread = self.on_own_thread();
        loop {
            if state.closing && !own_thread {
                return Err(Rejected::Closed(fence, value));
            }
            if state.pending() < state.capacity || own_thread {
                self.shared.enqueue(state, fence, value);
                return Ok(());
            }
            state = self.shared.changed.wait(state);
        }
    }

    /// A future of [`push_blocking`](Self::push_blocking): resolves once the
    /// value is queued, waiting for room without blocking a thread (the
    /// queue's thread wakes it).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it resolved does not drop the value
    /// early: it is queued all the same (past the capacity), or, once the
    /// queue's thread has exited, its fence is waited for on the dropping
    /// thread before it is dropped.
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

    /// Whether the caller is the queue's own thread: in a value's drop.
    fn on_own_thread(&self) -> bool {
        self.shared.on_own_thread()
    }

    /// The most values that may wait at once.
    pub fn capacity(&self) -> usize {
        self.shared.lock().capacity
    }

    /// Block until every value pushed before this call has been dropped (or
    /// leaked, if its fence failed, or handed back by
    /// [`shutdown_now`](Self::shutdown_now)). In async code, use
    /// [`flush_async`](Self::flush_async).
    ///
    /// On the queue's own thread (in a value's drop) it returns at once: the
    /// queue cannot wait for itself.
    pub fn flush(&self) {
        if self.on_own_thread() {
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

    /// A future of [`flush`](Self::flush): resolves once every value pushed
    /// before this call has been dropped (or leaked). Blocks no thread: the
    /// queue's thread wakes it.
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

    /// Wait for every fence, drop every value, and join the thread. Blocks
    /// until the slowest fence passes; in async code, use
    /// [`shutdown_async`](Self::shutdown_async).
    ///
    /// On the queue's own thread (in a value's drop) it closes the queue and
    /// returns at once: the thread drops the rest, then exits.
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
        self.shared.close();
        let id = self.shared.lock().wakers.id();
        let thread = self.thread.take();
        let progress = Progress {
            shared: self.shared.clone(),
            until: Until::Exited,
            id,
        };
        async move {
            let stats = progress.await;
            // The thread has said it exits: joining it takes no time (and on
            // the thread itself, in a value's drop, is skipped).
            if let Some(thread) = thread.filter(|thread| thread.thread().id() != current_thread()) {
                if thread.join().is_err() {
                    log::error!("the drop queue's thread panicked");
                }
            }
            stats
        }
    }

    /// Stop without waiting on the device: values whose fence has already
    /// passed are dropped; the rest are handed back with their fences, in
    /// push order, for the caller to keep alive until their fences pass
    /// ([`HandedBack`]: its drop waits for them). The value being waited on
    /// when this is called is waited for.
    ///
    /// A fence whose [`is_passed`](Fence::is_passed) fails or panics is
    /// handed back, not dropped.
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
            if !crate::plant::planted("shutdown-now-uncounted") {
                state.stats.handed_back += entries.len() as u64;
            }
            state.checking = None;
        });
        self.close_and_join();
        HandedBack { entries }
    }

    fn close_and_join(&mut self) {
        self.shared.close();
        if let Some(thread) = self.thread.take() {
            // The last handle dropped by a value on the queue's own thread:
            // that thread finishes on its own.
            if thread.thread().id() != current_thread() && thread.join().is_err() {
                panics::log(|| log::error!("the drop queue's thread panicked"));
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

    /// Whether the caller is the queue's own thread: in a value's drop.
    fn on_own_thread(&self) -> bool {
        self.thread.get() == Some(&current_thread())
    }

    /// Refuse new pushes; wake the queue's thread, blocked pushers and
    /// pending push futures, so they learn it now.
    fn close(&self) {
        self.update_and_wake(|state| state.closing = true);
    }

    /// Change the state, then tell everyone who waits on it: blocked
    /// flushes and pushers (the condvar) and pending futures (their
    /// wakers, woken outside the lock).
    fn update_and_wake(&self, change: impl FnOnce(&mut State<F, T>)) {
        let wakers = {
            let mut state = self.lock();
            change(&mut state);
            state.wakers.take()
        };
        self.changed.notify_all();
        wake_all(wakers);
    }
}

fn current_thread() -> ThreadId {
    std::thread::current().id()
}

impl<F: Fence, T: Send + 'static> Shared<F, T> {
    /// Queue an entry (the caller checked room and closing) and wake the
    /// queue's thread.
    fn enqueue(&self, mut state: MutexGuard<'_, State<F, T>>, fence: F, value: T) {
        state.stats.pushed += 1;
        let number = state.stats.pushed;
        state.queue.push_back((number, fence, value));
        drop(state);
        self.changed.notify_all();
    }

    /// Take in a value whose push was abandoned (its future dropped): queued
    /// past the capacity, even while closing, as long as the queue's thread
    /// will still see it; once that thread has exited, waited for here.
    fn adopt(&self, fence: F, value: T) {
        let mut state = self.lock();
        if state.exited {
            state.stats.pushed += 1;
            drop(state);
            let dropped = settle(fence, value).is_ok();
            self.lock().count_settled(dropped);
        } else {
            self.enqueue(state, fence, value);
        }
    }

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
                    if let Some((number, fence, value)) = state.queue.pop_front() {
                        state.in_flight = Some(number);
                        break (fence, value);
                    }
                    if state.closing {
                        state.exited = true;
                        return;
                    }
                    state = self.changed.wait(state);
                }
            };
            let dropped = settle(fence, value).is_ok();
            self.update_and_wake(|state| {
                state.in_flight = None;
                state.count_settled(dropped);
            });
        }
    }

    /// The thread's last act: say it exits, and wake who awaits that.
    fn exit(&self) {
        self.update_and_wake(|state| state.exited = true);
    }
}

/// Calls [`Shared::exit`] when the queue's thread ends, even by a panic.
struct ExitGuard<'a, F: Fence, T: Send + 'static>(&'a Shared<F, T>);

impl<F: Fence, T: Send + 'static> Drop for ExitGuard<'_, F, T> {
    fn drop(&mut self) {
        self.0.exit();
    }
}

/// Wait for `fence`, then drop `value`; if the fence fails (or its wait
/// panics), leak the value instead, with an error logged. `Err` is the
/// fence's failure: the value was leaked.
fn settle<F: Fence, T>(fence: F, value: T) -> Result<(), ServerError> {
    let passed = panics::catch(|| fence.wait_blocking())
        .unwrap_or_else(|message| Err(ServerError::DropQueuePanicked { message }));
    match passed {
        Ok(()) => {
            drop_value(value);
            Ok(())
        }
        Err(err) => {
            panics::log(|| {
                log::error!(
                    "a drop queue's fence failed, leaking its value rather than freeing memory \
                     the device may still read: {err}"
                );
            });
            std::mem::forget(value);
            Err(err)
        }
    }
}

/// What a [`Progress`] future waits for.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// This many values dropped, leaked or handed back.
    Handled(u64),
    /// The queue's thread exited (after handling everything).
    Exited,
}

/// The future of [`DropQueue::flush_async`]: resolves with the queue's stats
/// once the values pushed before it was made have been handled.
///
/// Dropping it before it resolves takes its waker back out of the queue.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct Progress<F, T> {
    shared: Arc<Shared<F, T>>,
    until: Until,
    /// Its entry among the queue's wakers.
    id: u64,
}

impl<F, T> Future for Progress<F, T> {
    type Output = DropQueueStats;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<DropQueueStats> {
        if self.shared.on_own_thread() {
            // Awaited in a value's drop: the queue cannot wait for itself.
            return Poll::Ready(self.shared.lock().stats());
        }
        let mut state = self.shared.lock();
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
        if crate::plant::planted("dropped-flush-future-leaves-waker") {
            return;
        }
        let removed = self.shared.lock().wakers.remove(self.id);
        drop(removed);
    }
}

/// The future of [`DropQueue::push_async`]: resolves once the value is
/// queued (or refused because the queue is closing).
///
/// # Cancel safety
///
/// Dropping it before it resolved queues the value all the same, past the
/// capacity (or, once the queue's thread has exited, waits for its fence on
/// the dropping thread, then drops it): the value is never dropped before its
/// fence.
#[must_use = "futures do nothing unless you .await or poll them; dropping this one queues \
              its value all the same"]
pub struct PushFuture<F: Fence, T: Send + 'static> {
    shared: Arc<Shared<F, T>>,
    /// The fence and value, until queued or handed back.
    entry: Option<(F, T)>,
    /// Its entry among the queue's wakers.
    id: u64,
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
        let mut state = this.shared.lock();
        // The entry stays in the future until it is queued or handed back:
        // a panic in the waker's clone or drop (an executor's code) leaves
        // it to the future's drop, which queues it. On the queue's own
        // thread it is queued at once, as `push_blocking` queues it.
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
            Err(Rejected::Closed(fence, value))
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
            if crate::plant::planted("dropped-push-future-drops-value") {
                drop((fence, value));
            } else {
                self.shared.adopt(fence, value);
            }
        }
        let removed = self.shared.lock().wakers.remove(self.id);
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

/// The values [`DropQueue::shutdown_now`] handed back, with their fences, in
/// push order: none has passed yet.
///
/// Read them as a slice; take them over with [`into_vec`](Self::into_vec) or
/// by iterating (then keeping each value alive until its fence passes is
/// the caller's job); or let [`wait_then_drop`](Self::wait_then_drop), or
/// the drop, wait for each fence on this thread and drop its value (a value
/// whose fence fails is leaked, as in the queue).
#[must_use = "dropping the handed-back values blocks until each fence has passed; \
              keep them alive, or call wait_then_drop() where blocking is fine"]
pub struct HandedBack<F: Fence, T> {
    entries: Vec<(F, T)>,
}

impl<F: Fence, T> HandedBack<F, T> {
    /// The fences and values, for the caller to keep alive.
    pub fn into_vec(mut self) -> Vec<(F, T)> {
        std::mem::take(&mut self.entries)
    }

    /// Block until each fence has passed, dropping its value as it does.
    ///
    /// # Errors
    ///
    /// The first fence that failed; every failed fence's value is leaked.
    pub fn wait_then_drop(mut self) -> Result<(), ServerError> {
        let mut first = Ok(());
        for (fence, value) in std::mem::take(&mut self.entries) {
            if let Err(err) = settle(fence, value) {
                if first.is_ok() {
                    first = Err(err);
                }
            }
        }
        first
    }
}

impl<F: Fence, T> Deref for HandedBack<F, T> {
    type Target = [(F, T)];

    fn deref(&self) -> &[(F, T)] {
        &self.entries
    }
}

impl<F: Fence, T> IntoIterator for HandedBack<F, T> {
    type Item = (F, T);
    type IntoIter = std::vec::IntoIter<(F, T)>;

    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl<F: Fence, T> Drop for HandedBack<F, T> {
    fn drop(&mut self) {
        for (fence, value) in self.entries.drain(..) {
            let _ = settle(fence, value);
        }
    }
}

impl<F: Fence, T> fmt::Debug for HandedBack<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandedBack")
            .field("len", &self.entries.len())
            .finish()
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
        self.queue.len() + usize::from(self.in_flight.is_some())
    }

    /// Count a value [`settle`]d: dropped, or leaked when its fence failed.
    fn count_settled(&mut self, dropped: bool) {
        if dropped {
            self.stats.dropped += 1;
        } else {
            self.stats.leaked += 1;
        }
    }

    /// Whether the first `target` values pushed are all dropped, leaked or
    /// handed back: none of them is queued, waited on, or being checked by
    /// `shutdown_now` (by push number, since `shutdown_now` hands back later
    /// values while an earlier one is still waited on). Also once the
    /// thread has exited with nothing being checked: nothing more will be
    /// handled then.
    fn handled(&self, target: u64) -> bool {
        let after = |number: Option<u64>| number.is_none_or(|number| number > target);
        let settled = after(self.in_flight)
            && after(self.queue.front().map(|(number, ..)| *number))
            && after(self.checking);
        settled || (self.exited && self.checking.is_none())
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

/// Drop a value whose fence passed; a panic in its `Drop` (or in its
/// payload's) is logged, and the queue goes on.
fn drop_value<T>(value: T) {
    if let Err(message) = panics::drop_caught(value) {
        panics::log(|| log::error!("a value's drop panicked in the drop queue: {message}"));
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
