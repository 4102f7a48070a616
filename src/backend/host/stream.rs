//! [`HostStream`]: an in-order queue of CPU work on its own worker thread.

use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use super::context::{ContextShared, HostContext};
use super::error;
use super::event::{FencePool, HostEvent};
use super::Host;
use crate::api::HostWord;
use crate::backend::live_events::LiveEvents;
use crate::backend::registry::Registry;
use crate::sync::{Condvar, Mutex, MutexGuard};
use crate::{panics, EventFence, ServerError};

/// Every live host stream, so a copied handle can never dangle.
static STREAMS: Registry<StreamShared> = Registry::new();

thread_local! {
    /// The [`worker_key`] of the stream whose worker this thread is, while it serves it; 0 on
    /// every other thread. No destructor: any thread may read it, in any thread-local's drop too.
    static WORKER_OF: Cell<usize> = const { Cell::new(0) };
}

/// The key of the stream whose worker the calling thread is, if it is one.
pub(super) fn this_workers_stream() -> Option<usize> {
    Some(WORKER_OF.with(Cell::get)).filter(|&key| key != 0)
}

/// A CPU stream: launched closures run in order on its worker thread, as kernels on a GPU stream.
/// Events recorded on it are queue markers the worker passes; a device-side wait is a queued wait.
/// A panic in launched work faults its [`HostContext`] for good.
///
/// Dropping the stream returns at once, as `cuStreamDestroy` does ("in case the device is still
/// doing work in the stream hStream when cuStreamDestroy() is called, the function will return
/// immediately and the resources associated with hStream will be released automatically once
/// the device has completed all work in hStream"): queued work still runs, so a buffer it reads
/// must outlive the work, not the stream. A [`HostStreamHandle`] that outlives the stream gives
/// an error when used.
pub struct HostStream {
    shared: Arc<StreamShared>,
    handle: HostStreamHandle,
}

/// A copyable handle to a [`HostStream`], taken by [`EventFence::new`] and the [`Host`] calls; it
/// does not keep the stream alive.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostStreamHandle {
    /// No other stream ever has it.
    pub(super) id: u64,
}

pub(super) struct StreamShared {
    state: Mutex<StreamState>,
    pub(super) context: Arc<ContextShared>,
    work_queued: Condvar,
    /// Synchronizing threads wait here for the worker's progress.
    progressed: Condvar,
    live_events: LiveEvents,
    fence_pool: Arc<FencePool>,
    /// The order of points recorded on this stream, for the waiter.
    sequence: AtomicU64,
    /// The latest point passed, in that order.
    pub(super) progress: Arc<HostWord>,
}

#[derive(Default)]
struct StreamState {
    queue: VecDeque<Op>,
    /// Operations queued since the stream started.
    queued: u64,
    /// Operations finished (run, or dropped by a fault).
    finished: u64,
    /// Set when the owner drops the stream: no new work.
    closing: bool,
    /// The worker waits on `work_queued`: only then does a push wake it (a system call).
    worker_waiting: bool,
    /// Threads waiting on `progressed` in `synchronize`.
    synchronizing: usize,
}

enum Op {
    Work(Box<dyn FnOnce() + Send + 'static>),
    /// An event's record: its generation, and its number in the stream's order.
    Signal(HostEvent, u64, u64),
    Wait(HostEvent, u64),
}

impl HostStream {
    /// Start a stream and its worker thread on a [`HostContext`] of its own: a panic in its work
    /// faults no other stream. Streams that share events, profiles or faults go on one context:
    /// [`HostContext::new_stream`].
    ///
    /// # Errors
    ///
    /// [`ServerError::ThreadSpawn`] when the operating system refused to start the thread.
    pub fn new() -> Result<Self, ServerError> {
        Self::on(&HostContext::new())
    }

    pub(super) fn on(context: &HostContext) -> Result<Self, ServerError> {
        let context = context.shared.clone();
        let live_events = LiveEvents::default();
        let shared = Arc::new(StreamShared {
            state: Mutex::new(StreamState::default()),
            fence_pool: Arc::new(FencePool::new(live_events.clone(), context.clone())),
            context,
            work_queued: Condvar::new(),
            progressed: Condvar::new(),
            live_events,
            sequence: AtomicU64::new(0),
            progress: Arc::default(),
        });
        shared.context.join(&shared)?;
        let (id, ()) = STREAMS.register(&shared, || ());
        let worker_shared = shared.clone();
        thread::Builder::new()
            .name(format!("host-stream-{id}"))
            .spawn(move || worker_shared.run())
            .map_err(|err| {
                STREAMS.remove(id);
                ServerError::thread_spawn("HostStream", err)
            })?;
        Ok(Self {
            shared,
            handle: HostStreamHandle { id },
        })
    }

    /// Queue `work` to run after everything queued on this stream before it.
    ///
    /// Work must not wait for its own stream's later work, which cannot start until it returns:
    /// as CUDA's host functions may be (`cuLaunchHostFunc`), such a wait is refused with
    /// [`status::NOT_PERMITTED`](crate::status::NOT_PERMITTED), never left to hang. That is
    /// [`synchronize`](Self::synchronize) of its own stream, and a query, `wait_sync` or `.await`
    /// of a fence or event recorded on it after the work. Waits for other streams are free, unless
    /// one waits in turn (`wait_async`) for this stream's later work: that wait, like one handed to
    /// another thread (a drop queue's `flush`), cannot be told apart, and never ends.
    ///
    /// # Errors
    ///
    /// The stream's context is faulted: an earlier launch panicked.
    pub fn launch<F>(&self, work: F) -> Result<(), ServerError>
    where
        F: FnOnce() + Send + 'static,
    {
        self.shared.push("launch", Op::Work(Box::new(work)))
    }

    /// A fence at the current end of this stream's work, as `EventFence::<Host>::new(handle)`: the
    /// host twin of `cuda::fence`.
    ///
    /// ```
    /// use device_events::host::HostStream;
    ///
    /// let stream = HostStream::new()?;
    /// stream.launch(|| { /* work */ })?;
    /// futures::executor::block_on(stream.fence().wait())?; // or `stream.fence().await`
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn fence(&self) -> EventFence<Host> {
        EventFence::new(self.handle)
    }

    /// Block until all work queued before the call has finished
    /// ([`Host::stream_synchronize`](crate::EventApi::stream_synchronize)).
    ///
    /// # Errors
    ///
    /// The stream's context is faulted: a launch panicked. Called from the stream's own work:
    /// [`status::NOT_PERMITTED`](crate::status::NOT_PERMITTED) ([`launch`](Self::launch)).
    pub fn synchronize(&self) -> Result<(), ServerError> {
        self.shared.synchronize()
    }

    /// The copyable handle that fences and [`Host`] calls take.
    pub fn handle(&self) -> HostStreamHandle {
        self.handle
    }

    /// This stream's [`LiveEvents`], readable after its drop. For tests: only with the
    /// `test-util` feature.
    ///
    /// ```
    /// use device_events::host::HostStream;
    ///
    /// let stream = HostStream::new()?;
    /// let live = stream.live_events();
    /// let fence = stream.fence();
    /// assert_eq!(live.count(), 1);
    /// fence.wait_sync()?; // consumes the fence, destroying its event
    /// assert_eq!(live.count(), 0);
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn live_events(&self) -> LiveEvents {
        self.shared.live_events.clone()
    }

    /// Whether work launched on a stream of this stream's context has panicked.
    pub fn is_faulted(&self) -> bool {
        self.shared.context.fault.get().is_some()
    }

    /// The context this stream belongs to.
    pub fn context(&self) -> HostContext {
        HostContext {
            shared: self.shared.context.clone(),
        }
    }
}

impl Drop for HostStream {
    /// Returns at once; the worker runs what is queued, then exits. Idle fence events are freed
    /// here, so `live_events` are exact on return.
    fn drop(&mut self) {
        STREAMS.remove(self.handle.id);
        self.shared.fence_pool.clear();
        self.shared.state.lock().closing = true;
        self.shared.work_queued.notify_all();
    }
}

impl HostStreamHandle {
    /// The stream's shared state, or an invalid-handle error once dropped.
    pub(super) fn resolve(self, call: &'static str) -> Result<Arc<StreamShared>, ServerError> {
        STREAMS
            .get(self.id)
            .map(|(shared, ())| shared)
            .ok_or_else(|| error::call(call, error::INVALID_HANDLE, "the stream was dropped"))
    }
}

impl StreamShared {
    pub(super) fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    /// A new event of this stream's context; refused once it is faulted.
    pub(super) fn create_event(&self, timing: bool) -> Result<HostEvent, ServerError> {
        self.context.check("event_create")?;
        Ok(HostEvent::create(
            timing,
            &self.live_events,
            &self.context,
            None,
        ))
    }

    /// A fence event from this stream's pool, or a new one; refused once it is faulted.
    pub(super) fn take_fence_event(&self) -> Result<HostEvent, ServerError> {
        self.context.check("event_create")?;
        Ok(self.fence_pool.take())
    }

    /// Queue `op` unless the stream is faulted or closing.
    fn push(&self, call: &'static str, op: Op) -> Result<(), ServerError> {
        // Before the lock, which the parent's worker may have held at a fork.
        self.context.not_forked(call)?;
        let state = self.state.lock();
        self.accepting(&state, call)?;
        self.enqueue(state, op);
        Ok(())
    }

    /// Queue `op` (checked under the lock handed over) and wake a sleeping worker.
    // Not inlined: an idle stream's `record` (the common fence) skips it and is faster without it.
    #[inline(never)]
    fn enqueue(&self, mut state: MutexGuard<'_, StreamState>, op: Op) {
        state.queue.push_back(op);
        state.queued += 1;
        let wake = state.worker_waiting;
        drop(state);
        if wake {
            self.work_queued.notify_one();
        }
    }

    /// Queue a marker for a new generation of `event`; returns the record's sequence number.
    pub(super) fn record(&self, event: &HostEvent) -> Result<u64, ServerError> {
        // Lock order: stream, then event. Under the stream lock, the generation and the sequence
        // keep queue order.
        if event.inner.context.id != self.context.id {
            return Err(error::call(
                "event_record",
                error::INVALID_HANDLE,
                "the event and the stream are from different contexts",
            ));
        }
        self.context.not_forked("event_record")?;
        let state = self.state.lock();
        self.accepting(&state, "event_record")?;
        let sequence = self.next_sequence();
        if state.queue.is_empty() && state.finished == state.queued {
            // Idle: the event is reached now, with no marker (the worker advanced the word for
            // every point before, then counted it).
            event.record_reached();
            self.progress.advance(sequence);
            return Ok(sequence);
        }
        let generation = event.next_generation(self.worker_key());
        self.enqueue(state, Op::Signal(event.clone(), generation, sequence));
        Ok(sequence)
    }

    /// Queue a wait for the latest record of `event`.
    pub(super) fn wait_event(&self, event: &HostEvent) -> Result<(), ServerError> {
        // An event of the parent's, in a forked child, is never signalled.
        event.inner.context.not_forked("stream_wait_event")?;
        let generation = event.latest_generation();
        if generation == 0 {
            // Never recorded: complete, by the driver's rule.
            return self.accepting(&self.state.lock(), "stream_wait_event");
        }
        self.push("stream_wait_event", Op::Wait(event.clone(), generation))
    }

    /// Block until everything queued before this call has finished.
    pub(super) fn synchronize(&self) -> Result<(), ServerError> {
        const CALL: &str = "stream_synchronize";
        self.context.not_forked(CALL)?;
        let mut state = self.state.lock();
        let target = state.queued;
        loop {
            self.context.check(CALL)?;
            if state.finished >= target {
                return Ok(());
            }
            if self.runs_on_this_thread() {
                return Err(waits_for_itself(CALL));
            }
            state.synchronizing += 1;
            state = self.progressed.wait(state);
            state.synchronizing -= 1;
        }
    }

    /// Refuse a call on a faulted context or a closing stream.
    fn accepting(&self, state: &StreamState, call: &'static str) -> Result<(), ServerError> {
        self.context.check(call)?;
        if state.closing {
            return Err(error::call(
                call,
                error::INVALID_HANDLE,
                "the stream is being dropped",
            ));
        }
        Ok(())
    }

    /// The context is faulted: drop the queue, failing its markers, and wake synchronizers (for
    /// [`ContextShared::poison`], and a worker that finds work queued after it).
    pub(super) fn fault_with(&self, message: &str) {
        let (dropped, synchronizing) = {
            let mut state = self.state.lock();
            let dropped: Vec<Op> = state.queue.drain(..).collect();
            for op in &dropped {
                if let Op::Signal(event, generation, _) = op {
                    event.fail(*generation, message);
                }
            }
            state.finished += dropped.len() as u64;
            (dropped, state.synchronizing > 0)
        };
        if synchronizing {
            self.progressed.notify_all();
        }
        // Closures are dropped outside the lock (their drops may touch this stream), each on its
        // own: one that panics costs only itself.
        for op in dropped {
            if let Err(message) = panics::drop_caught(op) {
                panics::log(|| log::error!("dropping work a fault discarded panicked: {message}"));
            }
        }
    }

    /// This stream's key in [`WORKER_OF`] and in its events' pending records: its address, which
    /// no other live stream has (its worker holds it alive while a record of it is pending).
    pub(super) fn worker_key(&self) -> usize {
        std::ptr::from_ref(self).addr()
    }

    /// Whether the calling thread is this stream's worker.
    fn runs_on_this_thread(&self) -> bool {
        this_workers_stream() == Some(self.worker_key())
    }

    /// The worker: run operations in order until closed and drained.
    fn run(&self) {
        WORKER_OF.with(|worker| worker.set(self.worker_key()));
        loop {
            let op = {
                let mut state = self.state.lock();
                loop {
                    if let Some(message) = self.context.fault.get() {
                        if !state.queue.is_empty() {
                            // Queued before the fault reached this stream: never runs.
                            drop(state);
                            self.fault_with(message);
                            state = self.state.lock();
                            continue;
                        }
                    }
                    if let Some(op) = state.queue.pop_front() {
                        break op;
                    }
                    if state.closing {
                        WORKER_OF.with(|worker| worker.set(0));
                        return;
                    }
                    state.worker_waiting = true;
                    state = self.work_queued.wait(state);
                    state.worker_waiting = false;
                }
            };
            let fault = match op {
                Op::Work(work) => panics::catch(work).err(),
                Op::Signal(event, generation, sequence) => {
                    event.signal(generation, || self.progress.advance(sequence));
                    None
                }
                Op::Wait(event, generation) => event
                    .wait_record(generation, "stream_wait_event")
                    .err()
                    .map(|err| format!("a stream this one waited on failed: {err}")),
            };
            if let Some(message) = fault {
                self.context.poison(message);
            }
            let synchronizing = {
                let mut state = self.state.lock();
                state.finished += 1;
                state.synchronizing > 0
            };
            if synchronizing {
                self.progressed.notify_all();
            }
        }
    }
}

/// The error for a wait, from a stream's own work, for that stream's later work: CUDA's host
/// functions "must not perform any synchronization that may depend on outstanding CUDA work not
/// mandated to run earlier", and a call from one "may result in CUDA_ERROR_NOT_PERMITTED"
/// (`cuLaunchHostFunc`).
pub(super) fn waits_for_itself(call: &'static str) -> ServerError {
    error::call(
        call,
        error::NOT_PERMITTED,
        "called from the stream's own work, for work queued on it after that work, which cannot \
         run until it returns",
    )
}

impl fmt::Debug for HostStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStream")
            .field("id", &self.handle.id)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for HostStreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostStreamHandle({})", self.id)
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_worker_knows_its_own_stream_only() {
        let (stream, other) = (HostStream::new().unwrap(), HostStream::new().unwrap());
        let (own, others) = (stream.shared.clone(), other.shared.clone());
        let (sender, seen) = std::sync::mpsc::channel();
        let on_worker = move || {
            let _ = sender.send((own.runs_on_this_thread(), others.runs_on_this_thread()));
        };
        stream.launch(on_worker).unwrap();
        let timeout = std::time::Duration::from_secs(20);
        assert_eq!(seen.recv_timeout(timeout), Ok((true, false)));
        assert!(
            !stream.shared.runs_on_this_thread(),
            "the test's thread is no worker"
        );
    }
}
