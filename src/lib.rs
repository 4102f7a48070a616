//! Wait for GPU stream work from Rust: on the host, on another stream, or
//! with `.await`.
//!
//! # The problem
//!
//! GPU work is queued on streams and runs later. A caller that needs the
//! result must learn when the device has reached a point in a stream, and a
//! caller that owns the stream behind a lock must not block while holding it.
//!
//! # The answer
//!
//! An [`EventFence`] records a device event at the current end of a stream.
//! Recording costs the host nothing; whoever holds the fence then waits on its
//! own time:
//!
//! - [`EventFence::wait_sync`]: the host blocks until the device has reached
//!   the fence (for CUDA, sleeping in the driver, not spinning);
//! - [`EventFence::wait_async`]: another stream waits for it *on the device*,
//!   and the host never blocks;
//! - `fence.await` (or [`EventFence::wait`] for combinators): a [`Waiter`], a
//!   small pool of dedicated threads that sleep in the driver, one per busy
//!   stream, wakes the task; the executor's threads never block.
//!
//! Built on fences: [`EventProfiler`] measures device time between two points
//! of a stream with pooled timing events, and [`drop_queue::DropQueue`] keeps
//! values (host staging buffers) alive until their fence passes, then drops
//! them off the caller's thread.
//!
//! The crate promises what a driver promises: a refused event falls back to
//! synchronizing the stream, a refused device-side wait falls back to a host
//! wait (each with a warning logged through the [`log`] crate, targets
//! `device_events::*`; tracing users forward them with `tracing-log`), and
//! driver faults come back as [`ServerError`], never as a panic or a hang.
//! [`AnyFence`] holds a fence of either backend, [`AnyStream`] a stream, and
//! [`AnyProfiler`] times either.
//!
//! How the waiter serves awaits (lanes, one thread per busy stream, the
//! poller, the watcher, cancellation) is described once, in the [`waiter`]
//! module's docs.
//!
//! What blocks the calling thread (keep it off an executor's threads):
//! - waits: `wait_sync` of [`EventFence`], [`Event`], [`Profile`] and their
//!   `Any*` twins, [`FenceFuture::wait_sync_timeout`], `synchronize` of a
//!   [`HostStream`](host::HostStream) or an [`AnyStream`], and the
//!   [`EventApi`] synchronize calls;
//! - fallbacks: [`EventFence::new`] synchronizes its stream where the
//!   driver refuses the event, and [`EventFence::wait_async`] waits on the
//!   host where it refuses the device-side wait ([`EventFence::try_new`] and
//!   [`EventFence::try_wait_async`] return the refusal instead);
//! - the drop queue's `flush`, `push_blocking`, `shutdown`, `shutdown_now`
//!   (for the value it is waiting on) and its drop, and the drop or
//!   `wait_then_drop` of what it hands back (`HandedBack`, `Rejected`).
//!
//! In async code use `.await`, `flush_async`, `push_async` and
//! `shutdown_async`, which block no thread. Dropping a stream returns at
//! once, as `cuStreamDestroy` does: its queued work still runs, so a buffer
//! that work reads must outlive the work, not the stream.
//!
//! # Knobs
//!
//! `fence.await` uses [`Waiter::global()`]; [`Waiter::builder()`] makes
//! others: [`max_threads`](WaiterBuilder::max_threads) (1 to
//! [`MAX_THREADS_LIMIT`], default [`DEFAULT_MAX_THREADS`]),
//! [`keep_alive`](WaiterBuilder::keep_alive) (default
//! [`DEFAULT_KEEP_ALIVE`]), [`thread_name`](WaiterBuilder::thread_name), and
//! [`spin_budget`](WaiterBuilder::spin_budget) (default zero, at most
//! [`MAX_SPIN_BUDGET`]), [`watchers`](WaiterBuilder::watchers) (default
//! [`default_watchers`]) and [`stuck_after`](WaiterBuilder::stuck_after)
//! (off by default). [`Waiter::stats`] tells what a waiter is doing
//! ([`WaiterStats`]), [`Waiter::stuck`] which streams have not finished in
//! `stuck_after`; with the `serde` feature every stats type is
//! `Serialize`.
//!
//! # Backends
//!
//! | backend | module | streams | when |
//! |---|---|---|---|
//! | CUDA | `cuda` (feature `cuda`, default) | `cudarc` streams | a driver and device are present (loaded at run time) |
//! | Host | [`host`] | CPU worker queues | always; tests, demos, CPU pipelines |
//!
//! Both implement [`EventApi`], a static contract over raw handles shaped like
//! the CUDA driver API; [`Event`] owns one raw event.
//!
//! ```
//! use device_events::host::{Host, HostStream};
//! use device_events::EventFence;
//!
//! let a = HostStream::new()?;
//! let b = HostStream::new()?;
//! a.launch(|| { /* produce */ })?;
//! EventFence::<Host>::new(a.handle()).wait_async(b.handle())?; // b waits for a, on the "device"
//! b.launch(|| { /* consume */ })?;
//! EventFence::<Host>::new(b.handle()).wait_sync()?; // the host waits for both
//! # Ok::<(), device_events::ServerError>(())
//! ```
//!
//! # Architecture
//!
//! For contributors. Each module of the crate root is a layer: a file or a folder with a
//! front-door `mod.rs`. Bottom up, each may name the layers above it in this table, except those
//! in its "never names" column, and no layer below it except those in its "also names" column.
//! `tests/layers.rs` reads this table and checks every `crate::` path in `src/` against it.
//!
//! | layer | holds | never names | also names |
//! |---|---|---|---|
//! | `error` | [`ServerError`] | | |
//! | `sync` | the crate's locks and atomics (std's, or loom's in the waiter's models), a lock guard that checks its state's invariants, how state is spread over locks | | |
//! | `os` | the crate's only operating-system calls and its only `unsafe` outside the CUDA FFI file: forks, the crate's own threads, timer slack, thread CPU time | | |
//! | `panics` | panics in code the crate calls but does not own, caught with their payloads | | |
//! | `api` | the backend contract ([`EventApi`], [`EventFlags`], the process-wide order of recorded points, a stream's progress word) | | |
//! | `backend` | `cuda/` and `host/`: raw events and streams, the stream registry, fence-event pools, live-event counts; the FFI file `backend/cuda/driver.rs` | | `fence::EventFence`, to offer `cuda::fence` and [`host::HostStream::fence`] |
//! | `event` | [`Event`]: one raw event, destroyed (or pooled) on every path | `backend` | |
//! | `fence` | [`EventFence`]: record, the fallbacks, `wait_sync`, `wait_async` | `backend` | |
//! | `waiter` | [`Waiter`]: threads, lanes, the watcher, hand-off, the futures, stats | `backend` | |
//! | `profiler` | [`EventProfiler`]: device time between two points of a stream | | |
//! | `any` | [`AnyFence`], [`AnyStream`] and [`AnyProfiler`]: either backend, chosen at run time | | |
//! | `drop_queue` | [`drop_queue::DropQueue`] and its `Fence` trait (implemented there for [`EventFence`] and [`AnyFence`]) | `profiler` | |
//! | `metrics` | the stats published to the `metrics` crate's recorder (feature `metrics`) | | |
#![warn(missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

/// `match $value` over an enum with a `Cuda` (feature `cuda`) and a `Host` variant, both arms
/// binding `$x..` and giving `$body` (or, for `(_) => BACKEND`, the variant's backend name): the
/// one-backend-at-a-time dispatch of the `Any*` types.
macro_rules! match_backend {
    ($value:expr, $enum:ident(_) => BACKEND) => {
        match $value {
            #[cfg(feature = "cuda")]
            $enum::Cuda(_) => <$crate::cuda::Cuda as $crate::EventApi>::BACKEND,
            $enum::Host(_) => <$crate::host::Host as $crate::EventApi>::BACKEND,
        }
    };
    ($value:expr, $enum:ident($($x:ident),+) => $body:expr) => {
        match $value {
            #[cfg(feature = "cuda")]
            $enum::Cuda($($x),+) => $body,
            $enum::Host($($x),+) => $body,
        }
    };
}

// In the order of the layers, bottom up (see "Architecture" above); the
// blank lines keep rustfmt from sorting them.
mod error;

mod sync;

mod os;

mod panics;

mod api;

mod backend;

mod event;

mod fence;

#[cfg(multi_threading)]
pub mod waiter;

#[cfg(multi_threading)]
mod profiler;

mod any;

#[cfg(multi_threading)]
pub mod drop_queue;

#[cfg(all(multi_threading, feature = "metrics"))]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;

pub use any::AnyStream;
#[cfg(multi_threading)]
pub use any::{
    AnyFence, AnyFenceFuture, AnyProfile, AnyProfileFuture, AnyProfileStart, AnyProfiler,
};
#[doc(hidden)]
pub use api::ProgressWord;
pub use api::{EventApi, EventFlags};
#[cfg(feature = "cuda")]
pub use backend::cuda;
pub use backend::host;
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use backend::live_events::LiveEvents;
pub use error::{status, ErrorSource, ServerError};
pub use event::Event;
pub use fence::EventFence;
#[cfg(multi_threading)]
pub use profiler::{
    EventProfiler, Profile, ProfileFuture, ProfileStart, ProfilerStats, DEFAULT_PROFILER_CAPACITY,
};
#[cfg(multi_threading)]
#[doc(inline)]
pub use waiter::{
    default_watchers, Awaitable, FenceFuture, LatencyHistogram, StuckWait, Waiter, WaiterBuilder,
    WaiterStats, DEFAULT_KEEP_ALIVE, DEFAULT_MAX_THREADS, LATENCY_BUCKETS, MAX_SPIN_BUDGET,
    MAX_THREADS_LIMIT, WATCHER_MIN_CORES,
};

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(all(doctest, feature = "cuda"))]
pub struct ReadmeDoctests;
