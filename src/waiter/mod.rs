//! The waiter: `fence.await` without blocking an executor thread and without
//! spinning.
//!
//! A [`Waiter`] is a small pool of dedicated threads (not the executor's)
//! that sleep in the driver on behalf of awaiting tasks: one thread per busy
//! stream, not one per pending wait. Each stream's waits form a *lane*,
//! ordered by fence sequence; the lane's thread blocks on the oldest, resolves
//! it, resolves every later one already reached, then blocks on the next. So
//! 10,000 pending awaits on 16 streams need about 16 threads.
//!
//! Threads start on demand up to [`WaiterBuilder::max_threads`] and leave
//! after [`WaiterBuilder::keep_alive`] idle. When more streams are busy than
//! that, one extra thread polls the rest with queries and a bounded backoff
//! (50 µs doubling to 1 ms), so a fast stream never waits behind a slow one:
//! a waiter never has more than `max_threads + 1` threads.
//!
//! It depends on no executor: std [`Waker`](std::task::Waker)s only, so it
//! works under tokio (multi- and current-thread), `futures::executor`, and
//! any other runtime.

mod future;
mod handoff;
#[cfg(all(test, loom))]
mod loom_models;
mod pool;
mod slot;
mod waitable;

use std::fmt;
use std::sync::OnceLock;
use std::time::Duration;

pub use future::FenceFuture;
pub(crate) use handoff::Handoff;
use pool::{Config, Pool};
pub(crate) use waitable::{LaneKey, Waitable};

use crate::loom::Arc;
use crate::{EventApi, EventFence};

/// Default [`WaiterBuilder::max_threads`].
pub const DEFAULT_MAX_THREADS: usize = 64;
/// Default [`WaiterBuilder::keep_alive`].
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(10);
/// The most [`WaiterBuilder::max_threads`] accepts.
pub const MAX_THREADS_LIMIT: usize = 4096;

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
#[derive(Clone)]
pub struct Waiter {
    pool: Arc<Pool>,
}

impl Waiter {
    /// The process-wide waiter that `fence.await` and [`EventFence::wait`]
    /// use, with the default settings. It is never shut down.
    pub fn global() -> &'static Waiter {
        static GLOBAL: OnceLock<Waiter> = OnceLock::new();
        GLOBAL.get_or_init(|| Waiter::builder().build())
    }

    /// Settings for a waiter of your own.
    pub fn builder() -> WaiterBuilder {
        WaiterBuilder::default()
    }

    /// A future that resolves once the device has reached `fence`, served by
    /// this waiter.
    pub fn wait<A: EventApi>(&self, fence: EventFence<A>) -> FenceFuture<A> {
        FenceFuture::new(fence, self)
    }

    /// The state machine of a future this waiter serves, for `waitable`.
    pub(crate) fn handoff<W: Waitable>(&self, waitable: W) -> Handoff<W> {
        Handoff::new(waitable, self.pool.clone())
    }

    /// Threads alive now: lane threads, plus the poller if it runs.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// The most threads this waiter has had alive at once.
    pub fn peak_threads(&self) -> usize {
        self.pool.peak_threads()
    }

    /// Waits handed to the threads and not yet resolved.
    pub fn pending(&self) -> usize {
        self.pool.pending()
    }

    /// Resolve every pending wait with
    /// [`ServerError::WaiterGone`](crate::ServerError::WaiterGone), refuse new
    /// ones the same way, and let the threads exit. Waits a thread is blocked
    /// on resolve at once too (the thread lets go of them, and exits, when the
    /// device reaches them). Safe to call more than once; never blocks.
    pub fn shutdown(&self) {
        self.pool.shutdown();
    }
}

impl fmt::Debug for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiter")
            .field("threads", &self.threads())
            .field("pending", &self.pending())
            .field("config", &self.pool.config)
            .finish()
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
    /// default `device-events-waiter`.
    pub fn thread_name(mut self, prefix: impl Into<String>) -> Self {
        self.config.thread_name = prefix.into();
        self
    }

    /// How long a first poll may spin on queries before handing the wait to
    /// a thread: trades a core for the last microseconds of wake latency.
    /// Default zero (one query, no spinning).
    pub fn spin_budget(mut self, spin_budget: Duration) -> Self {
        self.config.spin_budget = spin_budget;
        self
    }

    /// Build the waiter. No thread starts until a wait needs one.
    pub fn build(self) -> Waiter {
        Waiter {
            pool: Arc::new(Pool::new(self.config)),
        }
    }
}
