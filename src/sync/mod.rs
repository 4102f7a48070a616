//! Locks, shared state and the rules that keep it whole:
//!
//! - `loom.rs`: the crate's only locks and condition variable, the atomics shared with the
//!   waiter's models, the waiter's thread spawns and its watcher's clock, re-exported here;
//! - `checked.rs`: [`checked::Checked`], a lock guard that checks its state's invariants;
//! - `shards.rs`: how state is spread over locks, by hash or by thread;
//! - `test_faults.rs` (test builds): refused spawns and planted panics, for the waiter's tests.

#[cfg(multi_threading)]
pub(crate) mod checked;
mod loom;
pub(crate) mod shards;
#[cfg(test)]
pub(crate) mod test_faults;

pub(crate) use loom::*;
