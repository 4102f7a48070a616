//! The watcher, which races the lane threads' blocks by watching progress words; how it works: the
//! [module docs](crate::waiter#the-watcher). Each file's own docs say what it holds.

mod list;
mod state;
mod thread;
pub(super) mod timing;

pub(super) use state::WatcherState;
