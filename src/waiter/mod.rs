//! The waiter: `fence.await` without blocking an executor thread and without
//! spinning. [`Waiter`]'s docs say what a user sees; this is how it works,
//! for contributors.
//!
//! # Words
//!
//! - **wait**: one handed-off future's fence, with the `Slot` its
//!   result goes to.
//! - **lane**: the pending waits of one stream, in the stream's order
//!   (`EventApi::stream_sequence`), keyed by the backend and its number for
//!   the stream (`EventApi::stream_id`): one lane per stream.
//! - **waiter thread**: a thread of the waiter's own; a **lane thread**
//!   serves one lane at a time by blocking on its oldest wait (sleeping in
//!   the driver); the **poller** (at most one) serves the lanes past
//!   `max_threads` by asking their oldest waits in rounds, drops withdrawn
//!   waits, and watches for stuck streams.
//! - **hand-off**: a first poll that found the fence not reached puts its
//!   wait in its lane (`Pool::submit`).
//! - **resolve**: leave a wait's result in its slot and wake its task.
//! - **batch**: waits a thread takes out of a lane to query together;
//!   **settle**: put back those not reached.
//! - **withdraw**: a dropped future takes its wait out of its lane, for a
//!   waiter thread to drop (its event destroyed off the dropping thread).
//! - **stall**: a lane whose stream has ended no wait for `stuck_after`.
//!
//! # The lane algorithm
//!
//! 1. **First poll** (`handoff.rs`): one query (more within a spin budget);
//!    reached is ready at once, with no hand-off and no allocation.
//! 2. **Hand-off**: the wait goes into its lane, in the pool's one lock
//!    (`pool.rs`), which holds the lanes and the scheduler together. A wait
//!    that makes its lane also decides who serves it, in the same hold:
//!    an idle lane thread, else a lane thread between lanes (there are at
//!    least as many lane threads as lanes), else a new lane thread (up to
//!    `max_threads`), else the poller. Decisions are made under the lock and
//!    acted on after it (`Action`, carried out by `threads::act`).
//! 3. **Serving a lane** (`threads.rs`): block on the oldest wait; then, in
//!    one hold of the lock, resolve it and take the next oldest, and ask
//!    that one once. Not reached (work ending item after item): block on
//!    it. Reached (a burst): resolve it and query the later waits in
//!    batches, each twice the last (2 up to 256) while all are reached, at
//!    most one batch-querying thread per core (`permits.rs`). A lane its
//!    thread finds idle is removed; the thread takes a queued lane, or one
//!    back from the poller, or sleeps for its keep-alive and exits.
//! 4. **The poller**: each round it adopts the lanes queued for it, asks
//!    each one's oldest wait (then a batch, as above), and backs off from
//!    50 µs to 1 ms while nothing moves; it wakes an idle lane thread each
//!    round it has lanes, which takes one back. It exits after six idle
//!    rounds, or stays while `stuck_after` is on and any lane is left: then
//!    it looks for stalls every quarter of `stuck_after`, and warns once
//!    about each (`stuck.rs` says what a stall is; `Waiter::stuck` reads
//!    the same without logging).
//! 5. **Withdraw**: a dropped future's wait leaves its lane at once and goes
//!    to the pool's withdrawn list: the poller, an idle lane thread, or the
//!    poller started for it drops it. A wait a thread holds (blocked on, or
//!    out in a batch) stays with that thread until it lets go.
//! 6. **Faults** (`contain.rs`): every call into code the waiter does not
//!    own (a backend's query or block, a waker, a fence's drop, the logger)
//!    is made with no lock held and under `catch_unwind`; a panic costs only
//!    its wait. A waiter thread that unwinds anyway (a bug in the waiter)
//!    gives back what it held through its guard (`Pool::recover`): its
//!    waits fail, its lanes are queued again, its count is dropped.
//! 7. **Shutdown** takes every lane out and fails its waits, blocked ones
//!    too; batches out fail as they are settled. **Fork**: a pool made
//!    before a fork refuses everything in the child and touches nothing of
//!    the parent's (`crate::fork`).
//!
//! The lock's invariants (`pool::State`) are checked each time it is let
//! go, in debug and loom builds (`checked.rs`); the loom models are in
//! `loom_models.rs`.

mod checked;
mod contain;
mod deadline;
mod future;
#[cfg(all(test, not(device_events_loom)))]
mod guard_tests;
mod handoff;
#[cfg(all(test, device_events_loom))]
mod loom_models;
#[cfg(test)]
mod mock_device;
mod permits;
mod pool;
mod slot;
mod stats;
mod stuck;
mod threads;
#[cfg(all(test, not(device_events_loom)))]
mod unit_tests;
mod waitable;

use std::fmt;
use std::future::IntoFuture;
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

/// A handle to a pool of waiter threads, which serve `fence.await` without
/// blocking an executor thread; cheap to clone (one `Arc`).
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
/// # What you can rely on
///
/// - **A reached fence costs one query.** A future's first poll asks the
///   device; a fence already reached (or resolved when it was made) is
///   ready then, with no thread involved. A
///   [`spin_budget`](WaiterBuilder::spin_budget) lets it ask again for a
///   while first.
/// - **Otherwise a waiter thread waits, asleep.** It blocks in the driver
///   (on CUDA, `cuEventSynchronize` on a blocking-sync event) and wakes the
///   task when the device gets there. A stream's waits are served in the
///   stream's order, so one thread serves every wait on a busy stream:
///   10,000 pending awaits on 16 streams need 16 threads.
/// - **Bounded threads.** Threads start on demand, at most
///   [`max_threads`](WaiterBuilder::max_threads) that block plus one that
///   polls the busy streams past that (so a fast stream never waits behind
///   a slow one), and leave after
///   [`keep_alive`](WaiterBuilder::keep_alive) idle.
/// - **Cancel is drop.** Dropping a future takes its wait out at once, and
///   a waiter thread destroys its event soon after, off the dropping
///   thread. Only a wait a thread is blocked on right then stays with that
///   thread until its block ends.
/// - **Faults stay with their wait.** A panic in a backend call resolves
///   that wait with [`ServerError::WaiterPanicked`]; a task's waker, a
///   fence's drop or the logger that panics costs only that call.
///   [`Waiter::shutdown`] resolves every pending wait with
///   [`ServerError::WaiterGone`].
/// - **Fork.** A waiter made before a fork refuses waits in the child with
///   [`ServerError::WaiterForked`]; [`Waiter::global()`] is made afresh
///   there.
/// - **Any executor.** It uses std [`Waker`](std::task::Waker)s only:
///   tokio (multi- and current-thread), `futures::executor`, and others.
#[derive(Clone)]
pub struct Waiter {
    pool: Pool,
    /// The global waiter (or a clone of it), which is never shut down.
    global: bool,
}

impl Waiter {
    /// The process-wide waiter that `fence.await` and [`EventFence::wait`]
    /// use, with the default settings. It is never shut down (see
    /// [`shutdown`](Self::shutdown)). A forked child gets one of its own,
    /// made on first use there.
    pub fn global() -> &'static Waiter {
        static GLOBAL: OnceLock<Waiter> = OnceLock::new();
        let global = GLOBAL.get_or_init(Waiter::new_global);
        if global.pool.is_forked() {
            return Self::forked_global();
        }
        global
    }

    /// A forked child's global waiter: one per generation, kept for good.
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
    /// `target.await` is the same on [`Waiter::global()`].
    pub fn wait<T: Awaitable>(&self, target: T) -> T::Future {
        target.wait_on(self)
    }

    /// The state machine of a future this waiter serves, for `waitable`.
    pub(crate) fn handoff<W: Waitable>(&self, waitable: W) -> Handoff<W> {
        let pool = if self.global {
            // The global waiter and its clones share the static one's pool.
            PoolRef::Global(|| &Waiter::global().pool)
        } else {
            PoolRef::Owned(self.pool.clone())
        };
        Handoff::new(waitable, pool)
    }

    /// Threads alive now: lane threads, plus the poller if it runs.
    pub fn threads(&self) -> usize {
        self.pool.threads().0
    }

    /// The most threads this waiter has had alive at once.
    pub fn peak_threads(&self) -> usize {
        self.pool.threads().1
    }

    /// Waits handed to the threads and not finished. A wait whose future was
    /// dropped leaves the count at once, except one a thread holds right
    /// then (blocked on, or querying), until it lets go. A fence ready at
    /// its first poll is never handed off, so never counted.
    pub fn pending(&self) -> usize {
        self.pool.pending().0
    }

    /// A snapshot of what this waiter holds (gauges) and has done since it
    /// was made (counters, and a histogram of wake latencies), read without
    /// stopping it and without side effects. See [`WaiterStats`].
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
        let (pending, cancelled_held) = self.pool.pending();
        let (threads, peak_threads) = self.pool.threads();
        WaiterStats {
            threads,
            peak_threads,
            pending,
            cancelled_held,
            stuck: self.pool.stuck().len(),
            ..self.pool.counters().read()
        }
    }

    /// The streams whose oldest pending wait has gone longer than
    /// [`stuck_after`](WaiterBuilder::stuck_after) without the stream ending
    /// a wait, one entry per stream, with how long, how many waits are
    /// queued behind it, and whether its own future was given up: for a
    /// health endpoint. Empty when `stuck_after` is off. Reading it changes
    /// nothing and logs nothing.
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
        self.pool.stuck()
    }

    /// Resolve every pending wait with [`ServerError::WaiterGone`] (those a
    /// thread is blocked on too), refuse new ones the same way, and let the
    /// threads exit. Safe to call more than once; never blocks. On
    /// [`Waiter::global()`], on which every `fence.await` depends, it does
    /// nothing but log a warning.
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
        self.pool.config().spin_budget
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
            .field("config", self.pool.config())
            .finish()
    }
}

/// What [`Waiter::wait`] accepts (sealed: this crate's types only).
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
        FenceFuture::new(waiter.handoff(self))
    }
}

impl<A: EventApi> EventFence<A> {
    /// A future that resolves once the device has reached this fence, served
    /// by [`Waiter::global()`]; the same as `fence.await`, for combinators
    /// that want a [`Future`](std::future::Future) (`futures::join!`, `select`, timeouts).
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

    /// Report streams stuck for longer than `after`: a stream whose oldest
    /// pending wait has gone `after` without the stream ending a wait is
    /// listed by [`Waiter::stuck`] and warned about once per stall. Off by
    /// default (a kernel may rightly run for minutes); zero turns it off.
    /// [`StuckWait`] says how a stall is timed.
    ///
    /// While it is on and a wait is pending, the poller runs (within the
    /// bound of [`max_threads`](Self::max_threads) + 1) and looks every
    /// quarter of `after` (at most once a millisecond): the warning comes
    /// from that thread, with no lock held, never from a task's poll or a
    /// read of the stats. Each hand-off also formats its stream's name
    /// (the `Debug` of its handle).
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
        if let Some(unusable) = self.config.unusable() {
            return Err(unusable);
        }
        Ok(self.build())
    }

    /// Build the waiter. No thread starts until a wait needs one.
    ///
    /// A setting no thread could be started with (see
    /// [`try_build`](Self::try_build)) is logged as an error, and every wait
    /// that needs a thread resolves with that [`ServerError::InvalidArgument`];
    /// a fence reached at its first poll still resolves `Ok`, so the failure
    /// can look intermittent: `try_build` shows it at once.
    pub fn build(self) -> Waiter {
        if let Some(unusable) = self.config.unusable() {
            log::error!("{unusable}");
        }
        Waiter {
            pool: Pool::new(self.config),
            global: false,
        }
    }
}
