//! [`DropQueue`]: keep values alive until their fence has passed, then drop
//! them off the caller's thread.
//!
//! The case it is for: a pinned host staging buffer that a device copy may
//! still read. Freeing it when the host is done with it would let the copy
//! read freed memory; waiting for the copy on the spot would stall whoever
//! freed it. Instead the buffer goes into the queue with a fence recorded
//! after the copy, and the queue's own thread drops it once the fence passes.
//!
//! In this folder: `fence.rs`, the [`Fence`] trait and how a value is
//! settled once its fence passes; `queue.rs`, the [`DropQueue`] handle;
//! `stats.rs`, [`DropQueueStats`]; `shared.rs`, the state the handle, the
//! queue's thread and the futures share, and the thread itself;
//! `futures.rs`, [`PushFuture`] and [`Progress`]; `handed_back.rs`,
//! [`Rejected`] (with [`Refused`]) and [`HandedBack`], the values given back
//! to the caller.
//!
//! The queue exists where threads do (`cfg(multi_threading)`, set by
//! `build.rs`).

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
