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
//! poller, cancellation) is described once, in [`Waiter`]'s docs (its
//! section "How it works: the lane algorithm"); see also its builder.
//!
//! # Knobs
//!
//! `fence.await` uses [`Waiter::global()`]; [`Waiter::builder()`] makes
//! others: [`max_threads`](WaiterBuilder::max_threads) (1 to
//! [`MAX_THREADS_LIMIT`], default [`DEFAULT_MAX_THREADS`]),
//! [`keep_alive`](WaiterBuilder::keep_alive) (default
//! [`DEFAULT_KEEP_ALIVE`]), [`thread_name`](WaiterBuilder::thread_name), and
//! [`spin_budget`](WaiterBuilder::spin_budget) (default zero, at most
//! [`MAX_SPIN_BUDGET`]), and [`stuck_after`](WaiterBuilder::stuck_after)
//! (off by default). [`Waiter::stats`] tells what a waiter is doing
//! ([`WaiterStats`]), [`Waiter::stuck`] which streams have not finished in
//! `stuck_after`; with the `serde` feature every stats type is
//! `Serialize`.
//!
//! # Architecture
//!
//! Layers, bottom up; each may use only those below it, and some not all
//! of those. `tests/layers.rs` checks every `crate::` path in `src/`
//! against a copy of this table.
//!
//! | layer | owns | may not import |
//! |---|---|---|
//! | `api`, `error` | the backend contract ([`EventApi`], [`EventFlags`], the process-wide order of recorded points) and [`ServerError`] | anything else of the crate (`api` names `error` and `progress_word`) |
//! | `backend::{host, cuda}` | raw events and streams, the stream registry, fence-event pools; all `unsafe` (the FFI file `backend/cuda/driver.rs`; the binding guard, events, pool and kernels sit on it without `unsafe`) | `event`, `fence`, the waiter and everything above them (they name [`EventFence`] only to offer `cuda::fence` and [`host::HostStream::fence`]) |
//! | `event` | [`Event`]: one raw event, destroyed (or pooled) on every path | any backend, fences, the waiter |
//! | `fence` | [`EventFence`]: record, the fallbacks, `wait_sync`, `wait_async` | the waiter, any backend by name |
//! | `waiter` | [`Waiter`]: threads, lanes, hand-off, the futures | any backend, the profiler, the drop queue, `any_fence` |
//! | `any_fence`, `any_stream` | [`AnyFence`] and [`AnyStream`]: a fence and a stream of either backend, built on fences and the waiter | the profiler, the drop queue |
//! | `profiler`, `drop_queue` | [`EventProfiler`], [`drop_queue::DropQueue`] and its `Fence` trait (implemented there for [`EventFence`] and [`AnyFence`]): built on fences and the waiter | one another |
//! | `any_profiler` | [`AnyProfiler`]: an [`EventProfiler`] per backend behind [`AnyStream`] | the drop queue |
//!
//! `loom` (the waiter's locks and threads, swapped for loom's in its models),
//! `fault_log` (warn once per faulted stream), `own_threads` (which
//! threads the crate started: the waiter and the drop queue mark theirs,
//! the CUDA backend leaves a context bound on them), `panics` (panics in
//! code the crate calls but does not own, caught with their payloads),
//! `fork` (whether this process is a fork of the one that made a pool),
//! `shards` (how state is spread over locks: by hash, by thread),
//! `idle_pool` (bounded pools of idle events: the fence-event pools),
//! `progress_word` (a stream's progress in host memory, set by the stream),
//! `live_events` (per-stream event counts for leak checks, feature
//! `test-util`), `checked` (a lock guard that checks its state's
//! invariants), `latency_histogram` ([`LatencyHistogram`]) and `plant` (the
//! planted-defect hooks) serve every layer; they, like `api` and `error`,
//! may be imported from any layer.
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
mod api;
mod error;

mod backend;

mod event;

mod fence;

#[cfg(multi_threading)]
mod waiter;

#[cfg(multi_threading)]
mod any_fence;
mod any_stream;

#[cfg(multi_threading)]
pub mod drop_queue;
#[cfg(multi_threading)]
mod profiler;

#[cfg(multi_threading)]
mod any_profiler;

#[cfg(multi_threading)]
mod checked;
mod fault_log;
mod fork;
mod idle_pool;
#[cfg(multi_threading)]
mod latency_histogram;
mod live_events;
mod loom;
#[cfg(multi_threading)]
mod os_thread;
mod own_threads;
mod panics;
mod plant;
mod progress_word;
mod shards;

#[cfg(multi_threading)]
pub use any_fence::{AnyFence, AnyFenceFuture};
#[cfg(multi_threading)]
pub use any_profiler::{AnyProfile, AnyProfileFuture, AnyProfileStart, AnyProfiler};
pub use any_stream::AnyStream;
pub use api::{EventApi, EventFlags};
#[cfg(feature = "cuda")]
pub use backend::cuda;
pub use backend::host;
pub use error::{status, ErrorSource, ServerError};
pub use event::Event;
pub use fence::EventFence;
#[cfg(multi_threading)]
pub use latency_histogram::{LatencyHistogram, LATENCY_BUCKETS};
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use live_events::LiveEvents;
#[cfg(multi_threading)]
pub use profiler::{
    EventProfiler, Profile, ProfileFuture, ProfileStart, ProfilerStats, DEFAULT_PROFILER_CAPACITY,
};
#[doc(hidden)]
pub use progress_word::ProgressWord;
#[cfg(multi_threading)]
pub use waiter::{
    default_watchers, Awaitable, FenceFuture, StuckWait, Waiter, WaiterBuilder, WaiterStats,
    DEFAULT_KEEP_ALIVE, DEFAULT_MAX_THREADS, MAX_SPIN_BUDGET, MAX_THREADS_LIMIT, WATCHER_MIN_CORES,
};

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(all(doctest, feature = "cuda"))]
pub struct ReadmeDoctests;
