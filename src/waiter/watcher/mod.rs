//! The watcher: an accelerator that races the lane threads' blocks in the driver by watching
//! streams' progress words. How it works: the [module docs](crate::waiter#the-watcher).
//!
//! - `timing.rs`: each lane's history and margin, the list's entries, how early the watcher
//!   wakes, its CPU budget;
//! - `state.rs`: the watcher's list, the lanes' histories and its sleep, under the pool's lock;
//! - `list.rs`: the pool's operations that put waits on the list and plan the watcher's naps;
//! - `thread.rs`: the watcher's thread.

mod list;
mod state;
mod thread;
mod timing;

pub(super) use state::WatcherState;
#[cfg(all(test, not(device_events_loom)))]
pub(super) use timing::{LaneHistory, EARLY_HALF_LIFE, FIRST_WINDOW};
