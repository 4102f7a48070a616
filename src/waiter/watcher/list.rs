//! The watcher's list: the pool's operations that put held waits on it, take them off, and
//! resolve them when the watcher sees their words pass.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::timing::{Held, Watched};
use crate::waiter::contain;
use crate::waiter::pool::Pool;
use crate::waiter::state::{Action, Owner};
use crate::ServerError;

impl Pool {
    /// Entries handed to the watcher so far.
    pub(crate) fn published(&self) -> usize {
        self.shared.published.load(Ordering::Acquire)
    }

    /// How early the watcher wakes before an end it expects, as of `now`.
    pub(crate) fn watcher_early(&self, now: Instant) -> Duration {
        self.shared.watcher_early.get(now)
    }

    pub(crate) fn set_watcher_early(&self, early: Duration) {
        self.shared.watcher_early.set(early, Instant::now());
    }

    /// The watcher saw `entry`'s wait end with `result`, `took` after its
    /// hold began (`late`: at its first look after a sleep): unless its lane
    /// thread or shutdown resolved it meanwhile, it is held no more (its lane
    /// thread, still in the driver, takes the next once it wakes), its lane's
    /// history learns `took`, and it is delivered after the lock. Its entry
    /// leaves the list. Whether this delivered it.
    pub(crate) fn end_watched(
        &self,
        entry: &Watched,
        result: Result<(), ServerError>,
        took: Duration,
        late: bool,
    ) -> bool {
        let reports_stuck = self.reports_stuck();
        let mut state = self.lock();
        let lane = state.lanes.get_mut(&entry.lane);
        let ours = lane.is_some_and(|lane| lane.end_hold(&entry.slot, reports_stuck));
        if ours {
            state.history(entry.lane).seen(entry, took, late);
        }
        let removed = state.unwatch(&entry.slot);
        drop(state);
        // Plant for loom model `loom_the_watcher_and_the_driver_race_to_resolve_a_wait_once`.
        let ours =
            ours && !crate::waiter::plant::planted("watcher-takes-the-hold-delivers-nothing");
        let delivered = ours && self.deliver(&entry.slot, result);
        // Its fence may be the last copy left (its lane thread done with it).
        contain::drop(removed);
        delivered
    }

    /// The watcher leaves `entry` to its lane thread, which blocks on it in
    /// the driver: its word ran ahead of its event, or (`missed`) its window
    /// ended before the word passed, which its lane's history learns
    /// ([`LaneHistory::missed`](super::LaneHistory::missed)) unless the lane
    /// thread had taken the entry off first.
    pub(crate) fn unwatch(&self, entry: &Watched, missed: bool) {
        let mut state = self.lock();
        let removed = state.unwatch(&entry.slot);
        if missed && removed.is_some() {
            state.history(entry.lane).missed();
        }
        drop(state);
        contain::drop(removed);
    }

    /// A lane thread, about to block in the driver on its held wait, puts it
    /// on the watcher's list too (to race the driver), unless the lane's
    /// waits are too short to watch or the pool is shut down. What to do
    /// then, if it did.
    pub(crate) fn watch(&self, held: Held<'_>) -> Option<Action> {
        let early = self.watcher_early(held.started);
        let mut state = self.lock();
        if state.shutdown {
            return None;
        }
        let entry = state.history(held.lane).entry(held, early)?;
        let looks_from = entry.looks_from_at_the_earliest();
        state.watched.push(entry);
        self.shared.published.fetch_add(1, Ordering::Release);
        Some(state.watcher_for_work(Some(looks_from)))
    }

    /// The watcher's round: the entries to watch, into `entries` (empty);
    /// it waits for one up to its keep-alive. How many entries had been
    /// handed over by then (see [`Pool::published`]); `None` (and uncounted)
    /// when it should exit: idle past its keep-alive, or shut down.
    pub(crate) fn watch_round(&self, entries: &mut Vec<Watched>) -> Option<usize> {
        let mut state = self.lock();
        let mut timed_out = false;
        loop {
            entries.extend(state.watched.iter().cloned());
            if !entries.is_empty() && !state.shutdown {
                return Some(self.published());
            }
            if state.shutdown || timed_out {
                state.leave(Owner::Watcher);
                // The next watcher learns its own timing.
                self.set_watcher_early(Duration::ZERO);
                return None;
            }
            state.watcher_waits = true;
            let keep_alive = self.shared.config.keep_alive;
            let (woken, timeout) = state.wait_timeout(&self.shared.watch_work, keep_alive);
            state = woken;
            state.watcher_waits = false;
            timed_out = timeout;
        }
    }

    /// The watcher sleeps until `until`, unless an entry comes after the
    /// `published`th or the pool shuts down: how late it woke, if its time ran out.
    pub(crate) fn watcher_nap(&self, until: Instant, published: usize) -> Option<Duration> {
        let mut state = self.lock();
        if state.shutdown || self.published() != published {
            return None;
        }
        let left = until.saturating_duration_since(Instant::now());
        state.watcher_waits = true;
        state.watcher_nap_until = Some(until);
        let (mut state, timed_out) = state.wait_timeout(&self.shared.watch_work, left);
        state.watcher_waits = false;
        state.watcher_nap_until = None;
        timed_out.then(|| Instant::now().saturating_duration_since(until))
    }
}
