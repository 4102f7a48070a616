//! The watcher's list: the pool's operations that put held waits on it, take them off, and
//! resolve them when the watcher sees their words pass.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::timing::{Held, Timing, Watched, MIN_NAP};
use crate::waiter::contain;
use crate::waiter::pool::Pool;
#[cfg(doc)]
use crate::waiter::state::State;
use crate::waiter::state::{Action, Owner};
use crate::ServerError;

/// What the watcher's round plans its nap from ([`Pool::watch_round`]).
pub(crate) struct Plan {
    /// Entries handed to the watcher by then.
    pub(crate) published: usize,
    /// When the first entry on its list is due to be looked at.
    pub(crate) first: Instant,
}

impl Pool {
    /// Entries handed to the watcher so far.
    pub(crate) fn published(&self) -> usize {
        self.shared.published.load(Ordering::Acquire)
    }

    /// How early the watcher wakes before an end it expects, as of `now`.
    pub(crate) fn watcher_early(&self, now: Instant) -> Duration {
        self.shared.watcher_early.get(now)
    }

    /// The watcher wakes `early` before an end it expects, as a nap that ended at `measured`
    /// showed.
    pub(crate) fn set_watcher_early(&self, early: Duration, measured: Instant) {
        self.shared.watcher_early.set(early, measured);
    }

    /// The watcher saw `entry`'s wait end with `result`, `took` after its hold began (`late`: at
    /// its first look after a sleep): unless its lane thread or shutdown resolved it meanwhile,
    /// end the hold, teach the lane's history and deliver it after the lock; the entry leaves
    /// the list. Whether this delivered it.
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

    /// The watcher leaves `entry` to its lane thread, blocked on it in the driver; a `missed`
    /// watch counts ([`LaneHistory::missed`](super::LaneHistory::missed)) unless the lane
    /// thread took the entry off first.
    pub(crate) fn unwatch(&self, entry: &Watched, missed: bool) {
        let mut state = self.lock();
        let removed = state.unwatch(&entry.slot);
        if missed && removed.is_some() {
            state.history(entry.lane).missed();
        }
        drop(state);
        contain::drop(removed);
    }

    /// A lane thread about to block on `held` puts it on the watcher's list, unless its lane's
    /// history says not to or the pool is shut down. What to do then, if it did.
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

    /// The watcher's round: how many entries had been handed over (see [`Pool::published`]),
    /// and when, by `timing`, the first on its list is due to be looked at; it waits for one up
    /// to its keep-alive. If that is within [`MIN_NAP`], the entries are copied into `entries`
    /// (empty) to look at now; else none is, and the watcher naps first holding none
    /// ([`Pool::watcher_nap`]). `None` (and uncounted) when it should exit: idle past its
    /// keep-alive, or shut down.
    pub(crate) fn watch_round(&self, timing: &Timing, entries: &mut Vec<Watched>) -> Option<Plan> {
        let mut state = self.lock();
        let mut timed_out = false;
        loop {
            let first = state
                .watched
                .iter()
                .map(|entry| timing.look_from(entry))
                .min();
            if let Some(first) = first.filter(|_| !state.shutdown) {
                if first.saturating_duration_since(self.now()) < MIN_NAP {
                    entries.extend(state.watched.iter().cloned());
                }
                let published = self.published();
                return Some(Plan { published, first });
            }
            if state.shutdown || timed_out {
                state.leave(Owner::Watcher);
                // The next watcher learns its own timing.
                self.set_watcher_early(Duration::ZERO, self.now());
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

    /// The watcher sleeps until `until`, unless an entry comes after the `published`th (one due
    /// before `until` wakes it: [`State::watcher_for_work`]) or the pool shuts down: how late it
    /// woke, if its time ran out. Awake, unless entries came (its round plans again), it copies
    /// the entries on its list into `entries` (empty) to look at: those taken off during the
    /// nap are gone for good. `timing` is the watcher's, which planned the nap.
    pub(crate) fn watcher_nap(
        &self,
        until: Instant,
        published: usize,
        timing: &Timing,
        entries: &mut Vec<Watched>,
    ) -> Option<Duration> {
        let mut state = self.lock();
        if state.shutdown || self.published() != published {
            return None;
        }
        state.watcher_waits = true;
        state.watcher_nap_until = Some(until);
        let clock = &self.shared.clock;
        let (mut state, timed_out) = state.wait_until(&self.shared.watch_work, until, clock);
        // Cleared by whoever decided to wake it, whether or not its notification came in time.
        let wake_sent = !state.watcher_waits;
        state.watcher_waits = false;
        state.watcher_nap_until = None;
        if self.published() == published {
            entries.extend(state.watched.iter().cloned());
        }
        if !timed_out {
            return None;
        }
        if cfg!(device_events_loom) && !wake_sent {
            // A loom model's nap runs out as the schedule chooses, its clock moved to the nap's
            // end: an entry due to be looked at before then should have woken the watcher.
            for entry in &state.watched {
                let overslept = timing.look_from(entry) < until;
                assert!(
                    !overslept,
                    "the watcher napped past an entry due before its nap's end"
                );
            }
        }
        Some(self.now().saturating_duration_since(until))
    }
}
