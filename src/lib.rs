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
//! [`AnyFence`] holds a fence of either backend.
//!
//! # Knobs
//!
//! `fence.await` uses [`Waiter::global()`]; [`Waiter::builder()`] makes
//! others: [`max_threads`](WaiterBuilder::max_threads) (1 to 4096, default
//! 64), [`keep_alive`](WaiterBuilder::keep_alive) (default 10 s),
//! [`thread_name`](WaiterBuilder::thread_name), and
//! [`spin_budget`](WaiterBuilder::spin_budget) (default zero, at most
//! [`MAX_SPIN_BUDGET`]).
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

#[cfg(multi_threading)]
mod any_fence;
mod api;
mod backend;
#[cfg(multi_threading)]
pub mod drop_queue;
mod error;
mod event;
mod fault_log;
mod fence;
mod loom;
#[cfg(multi_threading)]
mod profiler;
#[cfg(multi_threading)]
mod waiter;

#[cfg(multi_threading)]
pub use any_fence::{AnyFence, AnyFenceFuture};
pub use api::{EventApi, EventFlags};
#[cfg(feature = "cuda")]
pub use backend::cuda;
pub use backend::host;
pub use error::ServerError;
pub use event::Event;
pub use fence::EventFence;
#[cfg(multi_threading)]
pub use profiler::{
    EventProfiler, Profile, ProfileFuture, ProfileStart, DEFAULT_PROFILER_CAPACITY,
};
#[cfg(multi_threading)]
pub use waiter::{
    Awaitable, FenceFuture, Waiter, WaiterBuilder, DEFAULT_KEEP_ALIVE, DEFAULT_MAX_THREADS,
    MAX_SPIN_BUDGET, MAX_THREADS_LIMIT,
};

/// The README's examples, compiled and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(all(doctest, feature = "cuda"))]
pub struct ReadmeDoctests;
