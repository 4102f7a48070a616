//! [`Waiter`], the handle users hold (cheap to clone: it owns the pool's `Arc`), its builder, and
//! `fence.await` ([`Awaitable`], `IntoFuture` for [`EventFence`]).

use std::fmt;
use std::future::IntoFuture;
use std::sync::OnceLock;
use std::time::Duration;

use super::future::FenceFuture;
use super::handoff::{Handoff, PoolRef};
use super::pool::{Config, Pool};
use super::stats::WaiterStats;
use super::stuck::StuckWait;
use super::waitable::Waitable;
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

/// A pool of threads that serve `fence.await` without blocking an executor thread; cheap to clone.
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
/// - **A reached fence costs one query**, at the future's first poll, with no thread involved
///   ([`spin_budget`](WaiterBuilder::spin_budget) lets it ask again for a while).
/// - **Otherwise a waiter thread waits, asleep** in the driver (on CUDA, `cuEventSynchronize` on a
///   blocking-sync event), and wakes the task. One thread serves a stream's waits in order: 10,000
///   awaits on 16 streams need 16 threads. Where the stream publishes its progress in host memory
///   and [watchers](WaiterBuilder::watchers) are on, one watcher thread races that sleep, and wakes
///   the task within microseconds of the work's end when it sees it first.
/// - **Bounded threads**, started on demand: at most [`max_threads`](WaiterBuilder::max_threads)
///   that block, plus one that polls the streams past that (a fast stream never waits behind a slow
///   one), plus the watcher where watchers are on: `max_threads + 2` at most (`max_threads + 1`
///   with `watchers(0)`). They leave after [`keep_alive`](WaiterBuilder::keep_alive) idle.
/// - **Cancel is drop.** The wait leaves at once; a waiter thread destroys its event soon after
///   (one it is blocked on, when the block ends).
/// - **Faults stay with their wait.** A panicking backend call resolves its wait with
///   [`ServerError::WaiterPanicked`]; a panicking waker, fence drop or logger costs only that call.
///   [`Waiter::shutdown`] resolves every pending wait with [`ServerError::WaiterGone`].
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
    /// The process-wide waiter of `fence.await` and [`EventFence::wait`], with the default
    /// settings; never shut down. A forked child has its own.
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
        if let Some(waiter) = (*FORKED.read()).filter(|waiter| !waiter.pool.is_forked()) {
            return waiter;
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

    /// A future that resolves once the device has reached `target` (an [`EventFence`],
    /// [`Profile`](crate::Profile), [`AnyFence`](crate::AnyFence) or
    /// [`AnyProfile`](crate::AnyProfile)), served by this waiter.
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

    /// Threads alive now: lane threads, plus the poller and the watcher if they run.
    pub fn threads(&self) -> usize {
        self.pool.gauges().threads
    }

    /// The most threads this waiter has had alive at once.
    pub fn peak_threads(&self) -> usize {
        self.pool.gauges().peak_threads
    }

    /// Waits handed to the threads and not finished; a dropped one leaves at once, unless a thread
    /// holds it right then.
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
        let mut gauges = self.pool.gauges();
        gauges.stuck = stuck;
        self.pool.counters().read(gauges)
    }

    /// The streams that have ended no pending wait for longer than
    /// [`stuck_after`](WaiterBuilder::stuck_after), one [`StuckWait`] each, for a health endpoint;
    /// empty while it is off. Changes and logs nothing.
    pub fn stuck(&self) -> Vec<StuckWait> {
        self.pool.stuck()
    }

    /// Resolve every pending wait with [`ServerError::WaiterGone`] (those a thread is blocked on
    /// too), refuse every new one that needs a thread (a fence already reached still answers `Ok`
    /// at its first poll), and let the threads exit; never blocks, and safe to call twice. On
    /// [`Waiter::global()`] it only logs a warning.
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

    /// The watchers setting ([`WaiterBuilder::watchers`]); 0: the watcher is off.
    pub fn watchers(&self) -> usize {
        self.pool.config().watchers
    }
}

/// The fewest cores on which [`default_watchers`] turns the watcher on.
pub const WATCHER_MIN_CORES: usize = 8;

/// [`WaiterBuilder::watchers`]' default: one on machines with at least [`WATCHER_MIN_CORES`] cores,
/// none below, where its thread competes with the very threads it wakes (the executor's, and on
/// the host backend the streams' workers) and a quarter of a core is a large share of the machine.
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
        let handoff = waiter.handoff(self);
        FenceFuture { handoff }
    }
}

impl<A: EventApi> EventFence<A> {
    /// `fence.await` as a [`Future`](std::future::Future), for combinators (`futures::join!`,
    /// `select`, timeouts); served by [`Waiter::global()`].
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
    /// How many threads may sleep in the driver at once, one per busy stream (1 to
    /// [`MAX_THREADS_LIMIT`], clamped; default [`DEFAULT_MAX_THREADS`]). One more thread polls the
    /// streams beyond that (a query each, backing off from 50 µs to 1 ms while nothing moves), so a
    /// busy stream is never left waiting behind another's work; those streams' waits may end up to
    /// 1 ms later. [`WaiterStats::threads`] near `max_threads` for long says raise it.
    pub fn max_threads(mut self, max_threads: usize) -> Self {
        self.config.max_threads = max_threads.clamp(1, MAX_THREADS_LIMIT);
        self
    }

    /// How long an idle thread stays (zero: it leaves at once); default [`DEFAULT_KEEP_ALIVE`].
    pub fn keep_alive(mut self, keep_alive: Duration) -> Self {
        self.config.keep_alive = keep_alive;
        self
    }

    /// The prefix of the threads' names (`{prefix}-{n}`, `-poller`, `-watcher`); default
    /// `device-events-waiter`. Linux shows 15 bytes of a name: 7 or fewer keep each whole. No
    /// thread can be named with a NUL byte: [`try_build`](Self::try_build) rejects such a prefix.
    pub fn thread_name(mut self, prefix: impl Into<String>) -> Self {
        self.config.thread_name = prefix.into();
        self
    }

    /// How long a first poll may spin before handing the wait to a thread, on the executor's
    /// thread: default zero, at most [`MAX_SPIN_BUDGET`] (clamped). It loads the stream's progress
    /// word where the backend keeps one (the host does), then asks the event once; else queries.
    pub fn spin_budget(mut self, spin_budget: Duration) -> Self {
        self.config.spin_budget = spin_budget.min(MAX_SPIN_BUDGET);
        self
    }

    /// Whether a watcher thread races the driver's wake-ups by watching streams' progress words
    /// (any value from 1: one thread watches every stream); 0: every wait ends in the driver alone.
    /// Default [`default_watchers`]: on with at least [`WATCHER_MIN_CORES`] cores.
    ///
    /// It never holds a wait back (see [`Waiter`]), and costs one thread, at most 200 µs of looking
    /// per wait and at most a quarter of one core over time ([`WaiterStats::watcher_cpu`] reports
    /// it). Waits shorter than 150 µs are left to the driver, and so are most of a stream's waits
    /// while its watches keep missing. Streams of items of steady length gain most; where the
    /// streams keep every core busy it gains little and tail latencies can be longer. Ask for
    /// `watchers(1)` on a small machine when wake latency matters more than that CPU. Figures:
    /// `docs/performance.md` in the repository; how it works: the
    /// [module docs](crate::waiter#the-watcher).
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

    /// Report streams stuck for longer than `after` ([`Waiter::stuck`]) and warn once per stall.
    /// Off by default (a kernel may rightly run for minutes); zero turns it off. While it is on and
    /// a wait is pending, the poller runs (the one thread beyond [`max_threads`](Self::max_threads)
    /// besides the watcher) and looks every quarter of `after`, at most once a millisecond.
    ///
    /// A stall is warned about within a quarter of `after` past it, with no lock of the waiter's
    /// held (a slow logger holds up no wait), naming the stream, how long its oldest wait has
    /// waited, how many wait behind it, and whether that wait's future gave up on it (a timeout
    /// does not end the stall: the stream is still held). A long queue that keeps moving is not
    /// stuck, nor is a stream whose every wait was given up while queued (not blocked on).
    pub fn stuck_after(mut self, after: Duration) -> Self {
        self.config.stuck_after = (!after.is_zero()).then_some(after);
        self
    }

    /// Build the waiter, checking the settings first.
    ///
    /// # Errors
    ///
    /// [`ServerError::InvalidArgument`] for a setting no thread could be started with (a
    /// [`thread_name`](Self::thread_name) with a NUL byte).
    pub fn try_build(self) -> Result<Waiter, ServerError> {
        self.config.unusable().map_or_else(|| Ok(self.build()), Err)
    }

    /// Build the waiter; no thread starts until a wait needs one. A setting no thread could start
    /// with is logged, and fails each wait that needs a thread ([`try_build`](Self::try_build)
    /// returns it instead).
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
