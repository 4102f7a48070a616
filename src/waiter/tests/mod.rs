//! The waiter's tests.
//!
//! - `unit.rs`: the pool, lanes, hand-off and watcher against a mock device;
//! - `guards.rs`: threads that unwind, refused spawns, panicking wakers;
//! - `loom_models.rs`: the loom models (`--cfg device_events_loom`);
//! - `mock_device.rs`: a device whose fences a test ends one by one, and which plants faults
//!   in the waiter thread that calls it;
//! - `readers.rs`: what tests read of a pool's state;
//! - `watcher_naps.rs`: what the watcher holds across a nap, and how early it says it wakes.

#[cfg(not(device_events_loom))]
mod guards;
#[cfg(device_events_loom)]
mod loom_models;
mod mock_device;
mod readers;
#[cfg(not(device_events_loom))]
mod unit;
#[cfg(not(device_events_loom))]
mod watcher_naps;
