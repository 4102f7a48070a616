//! What tests read of a pool's state, and the faults planted in it.

use crate::waiter::pool::Pool;

/// What tests read of a pool's state, and its plants.
impl Pool {
    /// The faults planted in this pool.
    pub(crate) fn plants(&self) -> &super::plants::Plants {
        &self.shared.plants
    }

    /// The watcher's entries, for tests.
    pub(crate) fn watched_entries(&self) -> usize {
        self.lock().watched.len()
    }

    /// Give `key`'s history a wait that took `took`, for tests.
    #[cfg(not(device_events_loom))]
    pub(crate) fn seed_history(
        &self,
        key: crate::waiter::waitable::LaneKey,
        took: std::time::Duration,
    ) {
        self.lock().history(key).ended(took);
    }

    /// How many waits `key`'s history has learnt, for tests.
    #[cfg(not(device_events_loom))]
    pub(crate) fn history_len(&self, key: crate::waiter::waitable::LaneKey) -> usize {
        self.lock()
            .histories
            .get(&key)
            .map_or(0, crate::waiter::watcher::LaneHistory::len)
    }

    /// Whether the watcher sleeps on its condvar now, for tests.
    #[cfg(not(device_events_loom))]
    pub(crate) fn watcher_waits(&self) -> bool {
        self.lock().watcher_waits
    }

    /// Lane threads asleep for work now, for tests that need one idle.
    #[cfg(not(device_events_loom))]
    pub(crate) fn idle_threads(&self) -> usize {
        self.lock().idle
    }
}
