//! The watcher: an accelerator that races the lane threads' blocks in the driver by watching
//! streams' progress words. How it works: the [module docs](crate::waiter#the-watcher); each file's
//! own docs say what it holds.

mod list;
mod state;
mod thread;
pub(super) mod timing;

pub(super) use state::WatcherState;
