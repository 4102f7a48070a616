//! The watcher: an accelerator that races the lane threads' blocks in the driver by watching
//! streams' progress words. How it works: the [module docs](crate::waiter#the-watcher).
//!
//! - `timing.rs`: each lane's history and margin, the list's entries, how early the watcher
//!   wakes, its CPU budget;
//! - `list.rs`: the pool's operations on the watcher's list;
//! - `thread.rs`: the watcher's thread.

mod list;
mod thread;
mod timing;

pub(super) use timing::{too_short, Early, Held, LaneHistory, Watched, HISTORIES};
#[cfg(all(test, not(device_events_loom)))]
pub(super) use timing::{EARLY_HALF_LIFE, FIRST_WINDOW};
