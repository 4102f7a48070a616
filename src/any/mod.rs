//! A fence, a stream and a profiler of either backend, chosen at run time: for code that
//! serves a GPU when there is one and CPU host streams when there is not.
//!
//! - `fence.rs`: [`AnyFence`] and its future;
//! - `stream.rs`: [`AnyStream`], which makes them;
//! - `profiler.rs`: [`AnyProfiler`], an [`EventProfiler`](crate::EventProfiler) per backend.

#[cfg(multi_threading)]
mod fence;
#[cfg(multi_threading)]
mod profiler;
mod stream;

#[cfg(multi_threading)]
pub use fence::{AnyFence, AnyFenceFuture};
#[cfg(multi_threading)]
pub use profiler::{AnyProfile, AnyProfileFuture, AnyProfileStart, AnyProfiler};
pub use stream::AnyStream;
