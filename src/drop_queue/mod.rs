//! [`DropQueue`]: keep values alive until their fence has passed, then drop them off the
//! caller's thread.
//!
//! The case it is for: a pinned host staging buffer that a device copy may still read. Freeing it
//! at once would let the copy read freed memory; waiting for the copy would stall whoever freed
//! it. Instead it goes into the queue with a fence recorded after the copy.
//!
//! - `fence.rs`: the [`Fence`] trait, and how a value is settled once its fence passes;
//! - `queue.rs`: the [`DropQueue`] handle;
//! - `stats.rs`: [`DropQueueStats`];
//! - `shared.rs`: the state the handle, the thread and the futures share, and the thread;
//! - `futures.rs`: [`PushFuture`] and [`Progress`];
//! - `handed_back.rs`: [`Rejected`], [`Refused`] and [`HandedBack`], values given back.
//!
//! The queue exists where threads do (`cfg(multi_threading)`, set by `build.rs`).

mod fence;
mod futures;
mod handed_back;
mod queue;
mod shared;
mod stats;

pub use fence::Fence;
pub use futures::{Progress, PushFuture};
pub use handed_back::{HandedBack, Refused, Rejected};
pub use queue::{DropQueue, DEFAULT_DROP_QUEUE_CAPACITY};
pub use stats::DropQueueStats;
