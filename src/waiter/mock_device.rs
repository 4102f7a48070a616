//! A stand-in device for the waiter's unit tests and loom models: work that
//! ends when the test says, and fences on it that count the threads
//! blocked on them and their drops (their events destroyed). Built on the
//! crate's loom shim, so it serves both.

use std::sync::atomic::Ordering;

use super::waitable::{LaneKey, Waitable};
use crate::loom::{thread, Arc, AtomicUsize, Condvar, Mutex};
use crate::ServerError;

/// The "device": a flag its work sets when done.
#[derive(Default)]
pub(super) struct Device {
    reached: Mutex<bool>,
    changed: Condvar,
    /// Blocks on its fences begun so far.
    pub(super) blocked: AtomicUsize,
    /// Queries of its fences so far.
    pub(super) queried: AtomicUsize,
    /// Fences on it dropped so far.
    pub(super) fences_dropped: AtomicUsize,
    /// The threads the fences were dropped on.
    pub(super) dropped_on: Mutex<Vec<thread::ThreadId>>,
}

impl Device {
    /// A device whose work is already done.
    #[cfg_attr(device_events_loom, allow(dead_code))]
    pub(super) fn reached() -> Arc<Self> {
        let device = Arc::new(Self::default());
        device.finish();
        device
    }

    /// Its work ends: every fence on it is reached.
    pub(super) fn finish(&self) {
        *self.reached.lock() = true;
        self.changed.notify_all();
    }
}

/// A fence on a [`Device`], in lane `lane` at `sequence`.
pub(super) struct MockFence {
    pub(super) device: Arc<Device>,
    pub(super) lane: u64,
    pub(super) sequence: u64,
}

impl Waitable for MockFence {
    fn lane(&self) -> LaneKey {
        LaneKey::for_tests(self.lane)
    }

    fn sequence(&self) -> u64 {
        self.sequence
    }

    fn query(&self) -> Result<bool, ServerError> {
        self.device.queried.fetch_add(1, Ordering::SeqCst);
        Ok(*self.device.reached.lock())
    }

    fn block(&self) -> Result<(), ServerError> {
        self.device.blocked.fetch_add(1, Ordering::SeqCst);
        let mut reached = self.device.reached.lock();
        while !*reached {
            reached = self.device.changed.wait(reached);
        }
        Ok(())
    }
}

impl Drop for MockFence {
    fn drop(&mut self) {
        self.device.dropped_on.lock().push(thread::current().id());
        self.device.fences_dropped.fetch_add(1, Ordering::SeqCst);
    }
}
