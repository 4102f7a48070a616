//! The waiter: `fence.await` without blocking an executor thread and without
//! spinning.
//!
//! The lane algorithm, how the waiter serves awaits, is described once, in
//! [`Waiter`]'s docs.

mod checked;
mod contain;
mod deadline;
mod future;
#[cfg(all(test, not(device_events_loom)))]
mod guard_tests;
mod handoff;
#[cfg(all(test, not(device_events_loom)))]
mod lane_cost_tests;
mod line_queue;
#[cfg(all(test, device_events_loom))]
mod loom_models;
#[cfg(test)]
mod mock_device;
mod permits;
mod pool;
#[cfg(all(test, not(device_events_loom)))]
mod pool_tests_support;
mod sched;
mod servers;
mod shard;
mod slot;
mod stats;
mod stuck;
#[cfg(all(test, not(device_events_loom)))]
mod stuck_tests;
mod waitable;

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

pub use future::FenceFuture;
pub(crate) use handoff::Handoff;
use handoff::PoolRef;
use pool::{Config, Pool};
pub use stats::{LatencyHistogram, WaiterStats, LATENCY_BUCKETS};
pub use stuck::StuckWait;
pub(crate) use waitable::{LaneKey, Waitable};

use crate::loom::RwLock;
use crate::{EventApi, EventFence, ServerError};

/// Default [`WaiterBuilder::max_threads`].
pub const DEFAULT_MAX_THREADS: usize = 64;
/// Default [`WaiterBuilder::keep_alive`].
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(10);
/// The most [`WaiterBuilder::max_threads`] accepts.
pub const MAX_THREADS_LIMIT: usize = 4096;
/// The longest [`WaiterBuilder::spin_budget`]: a first poll runs on the
/// executor's thread, so its spin is bounded whatever the setting.
pub const MAX_SPIN_BUDGET: Duration = Duration::from_millis(1);

/// A handle to a pool of waiter threads; cheap to clone (one `Arc`).
///
/// ```
/// use device_events::host::{Host, HostStream};
/// use device_events::{EventFence, Waiter};
/// use std::time::Duration;
///
/// let waiter = Waiter::builder()
///     .max_threads(4)
///     .keep_alive(Duration::from_secs(1))
///     .thread_name("gpu-waiter")
///     .build();
/// let stream = HostStream::new()?;
/// stream.launch(|| std::thread::sleep(Duration::from_millis(5)))?;
/// let fence = EventFence::<Host>::new(stream.handle());
/// futures::executor::block_on(waiter.wait(fence))?;
/// # Ok::<(), device_events::ServerError>(())
/// ```
///
/// # How it works: the lane algorithm
///
/// This is the one description of it; the README, the crate docs and the
/// code (the waiter's `pool.rs`, `sched.rs`, `shard.rs`, `servers.rs`) point
/// here.
///
/// 1. **First poll.** A future asks the device once (a query). A fence
///    already reached, or resolved when it was made, is ready at once: no
///    hand-off, no allocation. With a [`spin_budget`](WaiterBuilder::spin_budget)
///    (at most [`MAX_SPIN_BUDGET`]) it asks again until the budget is spent.
/// 2. **Hand-off.** Otherwise the wait goes into its stream's *lane*, ordered
///    by the record's place in the stream
///    ([`EventApi::stream_sequence`]).
///    Lanes live in shards, each behind its own lock, so hand-offs,
///    resolutions and cancellations on different streams do not contend; a
///    second lock, the scheduler's, is taken only when a lane starts (it
///    needs a thread) or ends, and on cancellation (see `pool.rs`).
/// 3. **One thread per busy lane.** Work on a stream completes in order, so
///    one *lane thread* serves a lane: it blocks on the oldest wait (sleeping
///    in the driver: `cuEventSynchronize` on a `BLOCKING_SYNC` event) and
///    resolves it. Then it takes the next wait out and asks it once. Not
///    reached (the usual case: a stream ends its work item after item), it
///    blocks on that one: one take from the lane and one query per wait.
///    Reached (a burst: work that ended while the thread was busy), it
///    resolves it and queries the later waits in batches, each twice the
///    last (from 2 up to 256) while all are reached, so a burst of thousands
///    costs a few lock round-trips per 256 waits and a short run puts back
///    no more unreached waits than it resolved; then it blocks on the first
///    not reached. 10,000 pending awaits on 16 streams need 16 threads.
///    Querying a batch is CPU work, so at most one lane thread per core
///    queries a batch at once; the others wait for a permit, asleep. The
///    wakes come after, with no permit held (see 7).
/// 4. **Bounded threads.** Lane threads start on demand, up to
///    [`max_threads`](WaiterBuilder::max_threads) (default
///    [`DEFAULT_MAX_THREADS`], at most [`MAX_THREADS_LIMIT`]), and leave after
///    [`keep_alive`](WaiterBuilder::keep_alive) idle (default
///    [`DEFAULT_KEEP_ALIVE`]). A new lane thread starts only while there are
///    fewer lane threads than lanes. When more lanes are busy than that, one
///    extra *poller* thread serves the rest: each round it asks each lane's
///    oldest wait, resolves what is reached, and backs off (doubling from
///    `POLL_BACKOFF_MIN` to `POLL_BACKOFF_MAX` in `servers.rs`, 50 µs to 1 ms)
///    when nothing moved. So a fast stream never waits behind a slow one, and
///    a waiter never has more than `max_threads + 1` threads. A lane thread
///    that runs out of work takes a lane back from the poller.
/// 5. **Cancellation.** Dropping a future *withdraws* its wait: out of its
///    lane at once, and a waiter thread (an idle one, else the poller, which
///    is started if it is not running) drops it, destroying its event off the
///    dropping thread. A burst of drops starts at most that one thread. Only
///    the wait a thread is blocked on right then stays with that thread until
///    its block ends.
/// 6. **Faults and shutdown.** A panic in a backend call resolves that wait
///    with [`ServerError::WaiterPanicked`] and the thread goes on.
///    [`Waiter::shutdown`] resolves every pending wait, the blocked ones too,
///    with [`ServerError::WaiterGone`].
/// 7. **Code the waiter calls but does not own.** A task's
///    [`Waker`](std::task::Waker), a fence's drop (its event's release, an
///    outside [`EventApi`]'s code) and the application's logger can panic.
///    Each call is made under `catch_unwind` and with no lock or resolve
///    permit held. A panicking wake costs only that wake: the task's result
///    is already in place (a later poll finds it), the panic is logged once,
///    and the thread finishes its batch and goes on; a panicking release
///    costs only that release. A waiter thread that unwinds all the same (a
///    bug in the waiter) fails the waits it held with
///    [`ServerError::WaiterPanicked`], uncounts itself and queues its lanes
///    for another thread on the way out: no future is left pending and no
///    count outlives its thread.
/// 8. **Fork.** A forked child has only the thread that forked. A waiter made
///    before the fork refuses waits there with [`ServerError::WaiterForked`],
///    and reads no state the parent's threads may have held;
///    [`Waiter::global()`] is made afresh in the child and serves it. A
///    future handed off before the fork is not woken in the child (the
///    thread that would wake it stayed in the parent): polled there, it
///    resolves at once with [`ServerError::WaiterForked`].
///
/// It depends on no executor: std [`Waker`](std::task::Waker)s only, so it
/// works under tokio (multi- and current-thread), `futures::executor`, and
/// any other runtime.
#[derive(Clone)]
pub struct Waiter {
    pool: Pool,
    /// The global waiter (or a clone of it), which is never shut down.
    global: bool,
}

impl Waiter {
    /// The process-wide waiter that `fence.await` and [`EventFence::wait`]
    /// use, with the default settings. It is never shut down:
    /// [`shutdown`](Self::shutdown) on it (or on a clone of it) does nothing
    /// but log a warning, since every other `fence.await` in the process
    /// depends on it.
    ///
    /// A forked child gets one of its own, made on first use there: the
    /// parent's threads are not in the child.
    pub fn global() -> &'static Waiter {
        static GLOBAL: OnceLock<Waiter> = OnceLock::new();
        let global = GLOBAL.get_or_init(Waiter::new_global);
        if global.pool.is_forked() {
            return Self::forked_global();
        }
        global
    }

    /// The global waiter of a forked child: one per fork generation, made
    /// on first use and kept for the life of the process (a fork's worth of
    /// memory, once).
    #[cold]
    fn forked_global() -> &'static Waiter {
        static FORKED: RwLock<Option<&'static Waiter>> = RwLock::new(None);
        if let Some(waiter) = *FORKED.read() {
            if !waiter.pool.is_forked() {
                return waiter;
            }
        }
        let mut forked = FORKED.write();
        match *forked {
            Some(waiter) if !waiter.pool.is_forked() => waiter,
            _ => forked.insert(Box::leak(Box::new(Waiter::new_global()))),
        }
    }

    fn new_global() -> Waiter {
        Waiter {
            global: true,
            ..Waiter::builder().build()
        }
    }

    /// Settings for a waiter of your own.
    pub fn builder() -> WaiterBuilder {
        WaiterBuilder::default()
    }

    /// A future that resolves once the device has reached `target`, served by
    /// this waiter: an [`EventFence`] (a [`FenceFuture`]), a
    /// [`Profile`](crate::Profile) (its device time), an
    /// [`AnyFence`](crate::AnyFence) or an [`AnyProfile`](crate::AnyProfile).
    /// The one spelling of "wait for this, on that waiter"; `target.await`
    /// is the same on [`Waiter::global()`].
    pub fn wait<T: Awaitable>(&self, target: T) -> T::Future {
        target.wait_on(self)
    }

    /// The state machine of a future this waiter serves, for `waitable`.
    pub(crate) fn handoff<W: Waitable>(&self, waitable: W) -> Handoff<W> {
        let pool = if self.global {
            // The global waiter and its clones share the static one's pool.
            PoolRef::Global
        } else {
            PoolRef::Owned(self.pool.clone())
        };
        Handoff::new(waitable, pool)
    }

    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Threads alive now: lane threads, plus the poller if it runs.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The most threads this waiter has had alive at once.
    pub fn peak_threads(&self) -> usize {
        self.pool.peak_threads()
    }

    /// Waits handed to the threads and not finished: those in their lanes,
    /// those a thread has taken out to query, and the one each lane thread
    /// is blocked on. A wait whose future was dropped leaves the count at
    /// once, except one a thread is blocked on (or has out) right then,
    /// which counts until the thread lets go of it: for a blocked one, when
    /// its block ends. A fence ready at its first poll is never handed off,
    /// so never counted.
    pub fn pending(&self) -> usize {
        self.pool.pending()
    }

    /// A snapshot of what this waiter holds (gauges) and has done since it
    /// was made (counters, and a histogram of wake latencies), read without
    /// stopping it: the counters from per-thread stripes, the gauges under
    /// each lock in turn. See [`WaiterStats`].
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use device_events::Waiter;
    ///
    /// let waiter = Waiter::builder().build();
    /// let stream = HostStream::new()?;
    /// stream.launch(|| std::thread::sleep(std::time::Duration::from_millis(5)))?;
    /// futures::executor::block_on(waiter.wait(stream.fence()))?;
    /// let stats = waiter.stats();
    /// assert_eq!(stats.ready_at_first_poll + stats.handed_off, 1);
    /// assert_eq!(stats.resolved, stats.handed_off);
    /// println!("p99 wake: {:?}", stats.wake_latency.percentile(99.0));
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn stats(&self) -> WaiterStats {
        let counts = self.pool.counters.read();
        let (pending, cancelled_held) = self.pool.pending_and_cancelled_held();
        WaiterStats {
            threads: self.threads(),
            peak_threads: self.peak_threads(),
            pending,
            cancelled_held,
            stuck: self.pool.check_stuck().len(),
            ready_at_first_poll: counts.ready_at_first_poll,
            handed_off: counts.handed_off,
            resolved: counts.resolved,
            failed: counts.failed,
            cancelled: counts.cancelled,
            wake_latency: counts.wake_latency,
        }
    }

    /// The streams whose oldest pending wait has gone longer than
    /// [`stuck_after`](WaiterBuilder::stuck_after) without the stream ending
    /// a wait, one entry per stream, with how long, how many waits are
    /// queued behind it, and whether its own future was given up: for a
    /// health endpoint. Empty when `stuck_after` is off. Reading it also
    /// logs the ones not reported before.
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use device_events::Waiter;
    /// use std::time::Duration;
    ///
    /// let waiter = Waiter::builder().stuck_after(Duration::from_secs(5)).build();
    /// let stream = HostStream::new()?;
    /// futures::executor::block_on(waiter.wait(stream.fence()))?;
    /// assert!(waiter.stuck().is_empty(), "nothing waited 5 s");
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn stuck(&self) -> Vec<StuckWait> {
        self.pool.check_stuck()
    }

    /// Resolve every pending wait with [`ServerError::WaiterGone`], refuse
    /// new ones the same way, and let the threads exit. Waits a thread is
    /// blocked on resolve at once too (the thread lets go of them, and exits,
    /// when the device reaches them). Safe to call more than once; never
    /// blocks.
    ///
    /// Does nothing (but log a warning) on [`Waiter::global()`], which is
    /// never shut down.
    pub fn shutdown(&self) {
        if self.global {
            log::warn!(
                "Waiter::global() is never shut down: every fence.await in the process uses it; \
                 shut down a waiter of your own (Waiter::builder()) instead"
            );
            return;
        }
        self.pool.shutdown();
    }

    /// The spin budget in effect: the one given to
    /// [`WaiterBuilder::spin_budget`], at most [`MAX_SPIN_BUDGET`].
    pub fn spin_budget(&self) -> Duration {
        self.pool.config.spin_budget
    }
}

/// A waiter of its own with the default settings: `Waiter::builder().build()`.
impl Default for Waiter {
    fn default() -> Self {
        Self::builder().build()
    }
}

impl fmt::Debug for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiter")
            .field("threads", &self.threads())
            .field("pending", &self.pending())
            .field("global", &self.global)
            .field("config", &self.pool.config)
            .finish()
    }
}

/// What [`Waiter::wait`] accepts: [`EventFence`], [`Profile`](crate::Profile),
/// [`AnyFence`](crate::AnyFence) and [`AnyProfile`](crate::AnyProfile).
/// Sealed: implemented in this crate only.
pub trait Awaitable: sealed::Sealed {
    /// The future [`Waiter::wait`] returns for it.
    type Future: std::future::Future;

    /// Hand `self` to `waiter`; call [`Waiter::wait`] instead.
    #[doc(hidden)]
    fn wait_on(self, waiter: &Waiter) -> Self::Future;
}

/// Keeps [`Awaitable`] implemented by this crate's types only.
pub(crate) mod sealed {
    /// The seal: a public trait in a private module.
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

impl<A: EventApi> sealed::Sealed for EventFence<A> {}

impl<A: EventApi> Awaitable for EventFence<A> {
    type Future = FenceFuture<A>;

    fn wait_on(self, waiter: &Waiter) -> FenceFuture<A> {
        FenceFuture::new(self, waiter)
    }
}

/// Settings for a [`Waiter`].
#[derive(Debug, Clone)]
pub struct WaiterBuilder {
    config: Config,
}

impl Default for WaiterBuilder {
    fn default() -> Self {
        Self {
            config: Config {
                max_threads: DEFAULT_MAX_THREADS,
                keep_alive: DEFAULT_KEEP_ALIVE,
                thread_name: "device-events-waiter".to_owned(),
                spin_budget: Duration::ZERO,
                resolvers: std::thread::available_parallelism().map_or(4, usize::from),
                stuck_after: None,
            },
        }
    }
}

impl WaiterBuilder {
    /// How many threads may sleep in the driver at once, one per busy
    /// stream: 1 to [`MAX_THREADS_LIMIT`] (values outside are clamped);
    /// default [`DEFAULT_MAX_THREADS`]. One more thread polls the streams
    /// beyond that while there are any.
    pub fn max_threads(mut self, max_threads: usize) -> Self {
        self.config.max_threads = max_threads.clamp(1, MAX_THREADS_LIMIT);
        self
    }

    /// How long an idle thread stays for more work before it exits; default
    /// [`DEFAULT_KEEP_ALIVE`]. Zero makes threads leave as soon as idle.
    pub fn keep_alive(mut self, keep_alive: Duration) -> Self {
        self.config.keep_alive = keep_alive;
        self
    }

    /// The prefix of the threads' names (`{prefix}-{n}`, `{prefix}-poller`);
    /// default `device-events-waiter`. It may not contain a NUL byte (the
    /// operating system could not name a thread with it):
    /// [`try_build`](Self::try_build) rejects such a prefix.
    pub fn thread_name(mut self, prefix: impl Into<String>) -> Self {
        self.config.thread_name = prefix.into();
        self
    }

    /// How long a first poll may spin on queries before handing the wait to
    /// a thread: trades a core for the last microseconds of wake latency.
    /// Default zero (one query, no spinning). At most [`MAX_SPIN_BUDGET`]
    /// (longer values are clamped): the spin runs on the executor's thread.
    pub fn spin_budget(mut self, spin_budget: Duration) -> Self {
        self.config.spin_budget = spin_budget.min(MAX_SPIN_BUDGET);
        self
    }

    /// Report streams stuck for longer than `after`: each stall is logged
    /// once (a warning naming the stream, how long its oldest wait has
    /// waited and how many waits are queued behind it), its end is logged
    /// once (at info level), and [`Waiter::stuck`] lists those stuck now.
    /// Off by default (a kernel may rightly run for minutes: only the
    /// service knows how long is too long); zero turns it off.
    ///
    /// A stall is timed from the hand-off that found its stream idle, or
    /// from the end of the last wait on it, whichever is later: a stream
    /// with a long queue that keeps finishing work is not stuck, however
    /// long its last wait has been queued. A wait given up (its future
    /// dropped, as by a timeout) while a thread is blocked on it still holds
    /// its stream: the stall goes on, and is reported, until the device
    /// gets past it. One given up while queued leaves the queue, and the
    /// stall goes on for the waits behind it; a stream with no wait left is
    /// no longer watched (its stall's end is logged then).
    ///
    /// The lines are logged with no lock of the waiter's held, in order, by
    /// one thread at a time: a logger may block, or read the waiter's
    /// stats, without holding up or deadlocking the waiter. That thread may
    /// be a waiter thread, or the one that found the stall: a task's, in
    /// the first poll of a future that hands a wait off, or one reading
    /// [`Waiter::stuck`] or [`Waiter::stats`].
    ///
    /// It adds no thread: the waiter looks for stuck waits when a wait is
    /// handed off, when its poller ends a round, and when the idle lane
    /// thread that holds the idle watch (one at a time) wakes on its own
    /// timeout: together at most once per quarter of `after`, and at most
    /// once a millisecond. It also looks whenever [`Waiter::stuck`] or
    /// [`Waiter::stats`] is read. So a stream that hangs while another lane
    /// thread is idle is warned about within a quarter of `after` past it,
    /// if that thread's [`keep_alive`](WaiterBuilder::keep_alive) lasts that
    /// long. One that hangs while no thread is idle and nothing is handed off
    /// is found by the next read of those two: a service that serves them to
    /// a health check or a metrics scrape is told at that check at the
    /// latest. While on, the idle thread holding the watch wakes once per
    /// quarter of `after` (at most once a millisecond) until its keep-alive
    /// ends, each stream that becomes busy costs its name (the `Debug` of
    /// its handle, formatted with no lock held), and each wait a server
    /// ends, a read of the clock.
    pub fn stuck_after(mut self, after: Duration) -> Self {
        self.config.stuck_after = (!after.is_zero()).then_some(after);
        self
    }

    /// Build the waiter, checking the settings first. No thread starts until
    /// a wait needs one.
    ///
    /// # Errors
    ///
    /// [`ServerError::InvalidArgument`] for a setting no thread could be
    /// started with: a [`thread_name`](Self::thread_name) with a NUL byte.
    pub fn try_build(self) -> Result<Waiter, ServerError> {
        if let Some(invalid) = self.config.invalid() {
            return Err(invalid);
        }
        Ok(self.build())
    }

    /// Build the waiter. No thread starts until a wait needs one.
    ///
    /// A setting no thread could be started with (see
    /// [`try_build`](Self::try_build), which reports it here instead) is
    /// logged as an error, and every wait handed to the waiter's threads
    /// then resolves with that [`ServerError::InvalidArgument`]; nothing
    /// panics. A fence already reached at its first poll needs no thread and
    /// still resolves `Ok`, so the failure shows only on waits that wait,
    /// and can look intermittent: build with `try_build` to see it at once.
    pub fn build(self) -> Waiter {
        if let Some(invalid) = self.config.invalid() {
            log::error!("{invalid}");
        }
        Waiter {
            pool: Pool::new(self.config),
            global: false,
        }
    }
}
