//! The waiter: `fence.await` without blocking an executor thread and without
//! spinning. [`Waiter`]'s docs say what a user sees; this is how it works.
//!
//! # Words
//!
//! - **wait**: a handed-off future's fence, and the `Slot` its result goes to.
//! - **lane**: one stream's pending waits in order, keyed by the backend and
//!   `EventApi::stream_id`.
//! - **lane thread**: serves one lane at a time. **Poller** (at most one):
//!   asks the lanes past `max_threads` in rounds, drops withdrawn waits,
//!   watches for stalls. **Watcher** (at most one, where watchers are on):
//!   races the lane threads' blocks by watching progress words (below).
//! - **hand-off**: a first poll that found the fence not reached puts its
//!   wait in its lane. **Resolve**: leave a result in the slot, wake the task.
//! - **held**: the wait a lane thread has out to block on or ask. **batch**:
//!   waits taken out to ask together; **settle**: put back those not reached.
//! - **withdraw**: a dropped future's wait leaves its lane, for a waiter
//!   thread to drop. **stall**: no wait of a lane ended for `stuck_after`.
//!
//! # The lane algorithm
//!
//! 1. **First poll** (`handoff.rs`): one query (more within a spin budget);
//!    reached is ready at once, with no allocation.
//! 2. **Hand-off** (`pool.rs`, `state.rs`): the wait goes into its lane under the one
//!    lock. A wait that makes its lane picks who serves it: an idle lane
//!    thread, else one between lanes, else a new one (up to `max_threads`),
//!    else the poller. Decided under the lock, done after it (`Action`).
//! 3. **Serving a lane** (`threads.rs`): block on the oldest wait in the
//!    driver, always (where its stream keeps a progress word and watchers
//!    are on, it is put on the watcher's list first, to race the block); then,
//!    in one hold of the lock, resolve it (unless the watcher did) and take
//!    the next, and ask that once.
//!    Not reached (work ending item after item): block on it. Reached (a
//!    burst): ask the later waits in batches, doubling from 2 to 256 while
//!    all are reached. An idle lane is removed; its thread takes a queued
//!    lane, or one back from the poller, or exits after its keep-alive.
//! 4. **The poller** (`poller.rs`) asks its lanes in batches (from 1), backing off from
//!    50 µs to 1 ms while nothing moves, and wakes an idle lane thread to take
//!    a lane back. It exits after six idle rounds, unless `stuck_after` is on
//!    and a lane is left: then it looks every quarter of `stuck_after` and
//!    warns once per stall.
//! 5. **Withdraw**: the wait goes to the withdrawn list, for the poller or an
//!    idle lane thread to drop; one held or in a batch stays with its thread
//!    (and on the watcher's list, if there, until one of them is done).
//! 6. **Faults** (`contain.rs`): code the waiter does not own is called with
//!    no lock held, under `catch_unwind`: a panic costs only its wait. A
//!    thread that unwinds anyway gives back what it held (`Pool::recover`).
//! 7. **Shutdown** fails every wait, held ones too, and empties the
//!    watcher's list. A pool made before a **fork** refuses everything in
//!    the child and touches nothing.
//! 8. **The watcher** (below) exits after its keep-alive idle.
//!
//! # The watcher
//!
//! An accelerator that races the driver and never replaces it
//! (`watcher/`). Where a stream publishes its progress in host memory (a
//! [`ProgressWord`](crate::ProgressWord): an atomic the host stream's worker
//! sets; on CUDA, a page-locked word the stream writes with
//! `cuStreamWriteValue64` after each fence), a lane thread about to block on
//! its held wait first puts it on the watcher's list, with when it should
//! end: the least of the lane's last four waits (from the start of their
//! hold; a lane with fewer than two is looked at for 50 µs from the
//! hand-over). Then it blocks in the driver exactly as with the watcher off.
//!
//! The watcher sleeps until shortly before the first end due (earlier by
//! the most its recent sleeps overslept and the lane's margin; never more
//! than 20 ms at a time), then looks at the words of the entries due, a
//! memory load each, pausing and then yielding between looks. A word that
//! passed is confirmed by one query of the wait's event (so a faulted
//! stream still fails its waits), and the watcher resolves the wait. The
//! lane's held wait is taken under the lock by whichever of the two comes
//! first: each wait resolves exactly once, and none later than the driver's
//! wake. An entry not seen to end within its window (at most 200 µs of
//! looking), or whose word ran ahead of its event, leaves the list: its lane
//! thread is in the driver already.
//!
//! - **History per lane**, kept by the pool under the lane's key (for the
//!   1,024 lanes used last), not by a thread: a lane that goes idle between
//!   requests, or is served by another thread, keeps it. A sighting late
//!   after a sleep doubles that lane's margin (up to a quarter of its
//!   prediction); one in time shrinks it by an eighth.
//! - **Waits too short to watch** (predicted shorter than 150 µs, or than
//!   twice how early the watcher wakes, lately) are left to the driver,
//!   whose wake comes about as soon, without a wake-up of the watcher's
//!   thread on a host whose cores the streams keep busy; that
//!   figure halves every 100 ms it is not measured again, so a bad spell
//!   cannot switch the watcher off for good. A lane thread learns its lane's
//!   prediction as each wait ends, and skips the list (and its lock) while
//!   it says too short.
//! - **Its CPU is bounded by design**: at most 200 µs of looking per wait,
//!   and, over time, at most a quarter of one core for its thread (a budget
//!   that earns a quarter of the time passing, saves up at most 10 ms and
//!   spends each round's CPU time, from the thread's CPU clock; while it is
//!   spent, entries are left to the driver).
//!   [`WaiterStats::watcher_cpu`] reports its thread's CPU time.
//! - Streams whose words went off (a refused write, a capture) are not
//!   watched: the backend hands out no word for them.
//!
//! `state::State`'s invariants are checked as the lock is let go (debug and
//! loom builds, [`crate::sync::checked`]); the tests, loom models among them, are under `tests/`.

mod contain;
mod future;
mod handoff;
pub(crate) mod latency_histogram;
mod plant;
mod poller;
mod pool;
mod recovery;
mod slot;
mod state;
mod stats;
mod stuck;
#[cfg(test)]
mod tests;
mod threads;
mod waitable;
mod watcher;

use std::fmt;
use std::future::IntoFuture;
use std::sync::OnceLock;
use std::time::Duration;

pub use future::FenceFuture;
pub(crate) use handoff::Handoff;
use handoff::PoolRef;
pub use latency_histogram::{LatencyHistogram, LATENCY_BUCKETS};
use pool::{Config, Pool};
pub use stats::WaiterStats;
pub use stuck::StuckWait;
pub(crate) use waitable::{LaneKey, Waitable};

use crate::sync::RwLock;
use crate::{EventApi, EventFence, ServerError};

/// Default [`WaiterBuilder::max_threads`].
pub const DEFAULT_MAX_THREADS: usize = 64;
/// Default [`WaiterBuilder::keep_alive`].
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(10);
/// The most [`WaiterBuilder::max_threads`] accepts.
pub const MAX_THREADS_LIMIT: usize = 4096;
/// The longest [`WaiterBuilder::spin_budget`] (it spins an executor thread).
pub const MAX_SPIN_BUDGET: Duration = Duration::from_millis(1);

/// A pool of waiter threads, which serve `fence.await` without blocking an
/// executor thread; cheap to clone.
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
/// - **A reached fence costs one query**, at the future's first poll, with
///   no thread involved ([`spin_budget`](WaiterBuilder::spin_budget) lets
///   it ask again for a while).
/// - **Otherwise a waiter thread waits, asleep** in the driver (on CUDA,
///   `cuEventSynchronize` on a blocking-sync event), and wakes the task.
///   One thread serves a stream's waits in order: 10,000 awaits on 16
///   streams need 16 threads. Where the stream publishes its progress in
///   host memory and [watchers](WaiterBuilder::watchers) are on, one
///   watcher thread races that sleep, and wakes the task within
///   microseconds of the work's end when it sees it first.
/// - **Bounded threads**, started on demand: at most
///   [`max_threads`](WaiterBuilder::max_threads) that block, plus one that
///   polls the streams past that (a fast stream never waits behind a slow
///   one), plus the watcher where watchers are on: `max_threads + 2` at
///   most (`max_threads + 1` with `watchers(0)`). They leave after
///   [`keep_alive`](WaiterBuilder::keep_alive) idle.
/// - **Cancel is drop.** The wait leaves at once; a waiter thread destroys
///   its event soon after (one it is blocked on, when the block ends).
/// - **Faults stay with their wait.** A panicking backend call resolves its
///   wait with [`ServerError::WaiterPanicked`]; a panicking waker, fence
///   drop or logger costs only that call. [`Waiter::shutdown`] resolves
///   every pending wait with [`ServerError::WaiterGone`].
/// - **Fork.** A waiter made before a fork refuses waits in the child
///   ([`ServerError::WaiterForked`]); [`Waiter::global()`] is made afresh.
/// - **Any executor**: it uses std [`Waker`](std::task::Waker)s only.
#[derive(Clone)]
pub struct Waiter {
    pool: Pool,
    /// The global waiter (or a clone of it), which is never shut down.
    global: bool,
}

impl Waiter {
    /// The process-wide waiter of `fence.await` and [`EventFence::wait`],
    /// with the default settings; never shut down. A forked child has its own.
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

    /// A future that resolves once the device has reached `target` (an
    /// [`EventFence`], [`Profile`](crate::Profile), [`AnyFence`](crate::AnyFence)
    /// or [`AnyProfile`](crate::AnyProfile)), served by this waiter.
    pub fn wait<T: Awaitable>(&self, target: T) -> T::Future {
        target.wait_on(self)
    }

    /// The state machine of a future this waiter serves, for `waitable`.
    pub(crate) fn handoff<W: Waitable>(&self, waitable: W) -> Handoff<W> {
        let pool = if self.global {
            PoolRef::Global(|| &Waiter::global().pool)
        } else {
            PoolRef::Owned(self.pool.clone())
        };
        Handoff::new(waitable, pool)
    }

    /// Threads alive now: lane threads, plus the poller and the watcher if
    /// they run.
    pub fn threads(&self) -> usize {
        self.pool.gauges().threads
    }

    /// The most threads this waiter has had alive at once.
    pub fn peak_threads(&self) -> usize {
        self.pool.gauges().peak_threads
    }

    /// Waits handed to the threads and not finished; a dropped one leaves at
    /// once, unless a thread holds it right then.
    pub fn pending(&self) -> usize {
        self.pool.gauges().pending
    }

    /// What this waiter holds and has done, read without side effects.
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use device_events::Waiter;
    ///
    /// let waiter = Waiter::builder().build();
    /// futures::executor::block_on(waiter.wait(HostStream::new()?.fence()))?;
    /// let stats = waiter.stats();
    /// assert_eq!(stats.ready_at_first_poll + stats.handed_off, 1);
    /// println!("p99 wake: {:?}", stats.wake_latency.percentile(99.0));
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn stats(&self) -> WaiterStats {
        let stuck = self.pool.stuck().len();
        self.pool.counters().read(WaiterStats {
            stuck,
            ..self.pool.gauges()
        })
    }

    /// The streams that have ended no pending wait for longer than
    /// [`stuck_after`](WaiterBuilder::stuck_after), one [`StuckWait`] each,
    /// for a health endpoint; empty while it is off. Changes and logs nothing.
    pub fn stuck(&self) -> Vec<StuckWait> {
        self.pool.stuck()
    }

    /// Resolve every pending wait with [`ServerError::WaiterGone`] (those a
    /// thread is blocked on too), refuse new ones so, and let the threads
    /// exit; never blocks. On [`Waiter::global()`] it only logs a warning.
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

    /// The spin budget in effect (at most [`MAX_SPIN_BUDGET`]).
    pub fn spin_budget(&self) -> Duration {
        self.pool.config().spin_budget
    }

    /// The watchers setting ([`WaiterBuilder::watchers`]): from 1, a watcher
    /// thread races the driver's wake-ups; 0: every wait ends in the driver
    /// alone.
    pub fn watchers(&self) -> usize {
        self.pool.config().watchers
    }
}

/// The fewest cores on which [`default_watchers`] turns the watcher on.
pub const WATCHER_MIN_CORES: usize = 8;

/// [`WaiterBuilder::watchers`]' default: one on machines with at least
/// [`WATCHER_MIN_CORES`] cores, none below. On fewer cores the watcher
/// thread competes with the very threads it wakes (the executor's, and on
/// the host backend the streams' workers), and a quarter of a core is a
/// large share of the machine.
pub fn default_watchers() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    usize::from(cores >= WATCHER_MIN_CORES)
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
    /// `fence.await` as a [`Future`](std::future::Future), for combinators
    /// (`futures::join!`, `select`, timeouts); served by [`Waiter::global()`].
    ///
    /// ```
    /// use device_events::host::HostStream;
    ///
    /// # futures::executor::block_on(async {
    /// let (a, b) = (HostStream::new()?, HostStream::new()?);
    /// let (ra, rb) = futures::join!(a.fence().wait(), b.fence().wait());
    /// ra.and(rb)
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
                stuck_after: None,
                watchers: default_watchers(),
            },
        }
    }
}

impl WaiterBuilder {
    /// How many threads may sleep in the driver at once, one per busy stream
    /// (1 to [`MAX_THREADS_LIMIT`], clamped; default [`DEFAULT_MAX_THREADS`]).
    /// One more polls the streams beyond that.
    pub fn max_threads(mut self, max_threads: usize) -> Self {
        self.config.max_threads = max_threads.clamp(1, MAX_THREADS_LIMIT);
        self
    }

    /// How long an idle thread stays for more work; default
    /// [`DEFAULT_KEEP_ALIVE`]. Zero: threads leave as soon as idle.
    pub fn keep_alive(mut self, keep_alive: Duration) -> Self {
        self.config.keep_alive = keep_alive;
        self
    }

    /// The prefix of the threads' names (`{prefix}-{n}`, `{prefix}-poller`);
    /// default `device-events-waiter`. No thread can be named with a NUL
    /// byte: [`try_build`](Self::try_build) rejects such a prefix.
    pub fn thread_name(mut self, prefix: impl Into<String>) -> Self {
        self.config.thread_name = prefix.into();
        self
    }

    /// How long a first poll may spin before handing the wait to a thread,
    /// on the executor's thread: default zero, at most [`MAX_SPIN_BUDGET`]
    /// (clamped). Where the backend publishes the stream's progress in host
    /// memory (the host backend does), it spins reading that, with no driver
    /// call, and asks the event once the stream is there; elsewhere it spins
    /// on queries.
    pub fn spin_budget(mut self, spin_budget: Duration) -> Self {
        self.config.spin_budget = spin_budget.min(MAX_SPIN_BUDGET);
        self
    }

    /// Whether a watcher thread races the driver's wake-ups by watching
    /// streams' progress words (any value from 1: one thread watches every
    /// stream); 0: every wait ends in the driver alone. Default
    /// [`default_watchers`]: on with at least [`WATCHER_MIN_CORES`] cores.
    ///
    /// The watcher never delays a wait: its lane thread blocks in the driver
    /// all the same, and whichever sees the end first resolves it. Where it
    /// wins, the task wakes within microseconds of the work's end rather
    /// than after the driver's wake-up (tens of microseconds on CUDA's
    /// blocking-sync events, more on a loaded host). It costs one thread
    /// (`max_threads + 2` in all), at most 200 µs of looking per wait and, by
    /// design, at most a quarter of one core over time
    /// ([`WaiterStats::watcher_cpu`] reports it). Ask for `watchers(1)` on a
    /// small machine when wake latency matters more than that CPU: streams
    /// of items of steady length (about 1 ms and longer) gain most; waits
    /// shorter than 150 µs are left to the driver. How it works: the module
    /// docs of `src/waiter/mod.rs`.
    ///
    /// ```
    /// use device_events::Waiter;
    ///
    /// let sleepers_only = Waiter::builder().watchers(0).build();
    /// assert_eq!(sleepers_only.watchers(), 0);
    /// ```
    pub fn watchers(mut self, watchers: usize) -> Self {
        self.config.watchers = watchers;
        self
    }

    /// Report streams stuck for longer than `after` ([`Waiter::stuck`]) and
    /// warn once per stall. Off by default (a kernel may rightly run for
    /// minutes); zero turns it off. While it is on and a wait is pending, the
    /// poller runs (the one thread beyond [`max_threads`](Self::max_threads)
    /// besides the watcher) and looks every quarter of `after`, at most once
    /// a millisecond.
    pub fn stuck_after(mut self, after: Duration) -> Self {
        self.config.stuck_after = (!after.is_zero()).then_some(after);
        self
    }

    /// Build the waiter, checking the settings first.
    ///
    /// # Errors
    ///
    /// [`ServerError::InvalidArgument`] for a setting no thread could be
    /// started with (a [`thread_name`](Self::thread_name) with a NUL byte).
    pub fn try_build(self) -> Result<Waiter, ServerError> {
        if let Some(unusable) = self.config.unusable() {
            return Err(unusable);
        }
        Ok(self.build())
    }

    /// Build the waiter; no thread starts until a wait needs one. A setting
    /// no thread could start with is logged, and fails each wait that needs a
    /// thread ([`try_build`](Self::try_build) returns it instead).
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
