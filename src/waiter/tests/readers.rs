//! What tests read of a pool's state.

use crate::waiter::pool::Pool;

/// What tests read of a pool's state.
impl Pool {
    /// The watcher's entries, for tests.
    pub(crate) fn watched_entries(&self) -> usize {
        self.lock().watcher.list.len()
    }

    /// Give `key`'s history a wait that took `took`, for tests.
    pub(crate) fn seed_history(
        &self,
        key: crate::waiter::waitable::LaneKey,
        took: std::time::Duration,
    ) {
        self.lock().watcher.history(key).ended(took);
    }

    /// How many waits `key`'s history has learnt, for tests.
    #[cfg(not(device_events_loom))]
    pub(crate) fn history_len(&self, key: crate::waiter::waitable::LaneKey) -> usize {
        self.lock()
            .watcher
            .histories
            .get(&key)
            .map_or(0, crate::waiter::watcher::timing::LaneHistory::len)
    }

    /// Whether the watcher sleeps on its condvar now, for tests.
    #[cfg(not(device_events_loom))]
    pub(crate) fn watcher_waits(&self) -> bool {
        self.lock().watcher.waits
    }

    /// If the watcher naps now, keep the lock until `past` after its nap's end, so that it wakes
    /// at least that late (as on a host whose timer slack or load delays wake-ups); the nap's end.
    #[cfg(not(device_events_loom))]
    pub(crate) fn hold_past_nap(&self, past: std::time::Duration) -> Option<std::time::Instant> {
        let state = self.lock();
        let until = state.watcher.nap_until?;
        while let Some(left) = (until + past).checked_duration_since(std::time::Instant::now()) {
            std::thread::sleep(left);
        }
        drop(state);
        Some(until)
    }

    /// While the watcher naps with one entry on its list, how many hold that entry's fence.
    #[cfg(not(device_events_loom))]
    pub(crate) fn fence_holders_in_nap(&self) -> Option<usize> {
        let state = self.lock();
        state.watcher.nap_until?;
        match state.watcher.list.as_slice() {
            [entry] => Some(std::sync::Arc::strong_count(&entry.waitable)),
            _ => None,
        }
    }

    /// Lane threads asleep for work now, for tests that need one idle.
    #[cfg(not(device_events_loom))]
    pub(crate) fn idle_threads(&self) -> usize {
        self.lock().idle
    }

    /// How early the watcher wakes before an end it expects, as of `now`, for tests.
    #[cfg(not(device_events_loom))]
    pub(crate) fn watcher_early(&self, now: std::time::Instant) -> std::time::Duration {
        self.lock().watcher.early(now)
    }
}
