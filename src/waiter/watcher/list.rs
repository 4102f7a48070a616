//! The pool's operations on the watcher's list ([`WatcherState`](super::WatcherState)): put held
//! waits on it, plan the watcher's rounds and naps; a wait leaves it in [`Pool::end_hold`].

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::timing::{Early, Timing, Watched, MIN_NAP};
use crate::waiter::pool::Pool;
use crate::waiter::state::{Action, Role};
use crate::waiter::wait::Wait;
use crate::ProgressWord;

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

    /// A lane thread about to block on `wait`, held `since`, puts it on the watcher's list with its
    /// stream's `word` (copied under the lock; the word itself is dropped after it), unless its
    /// lane's history says not to or the pool is shut down: what to do then, if it did.
    pub(crate) fn watch(&self, wait: &Wait, word: &ProgressWord, since: Instant) -> Option<Action> {
        let mut state = self.lock();
        if state.shutdown {
            return None;
        }
        let watcher = &mut state.watcher;
        let early = watcher.early(since);
        let entry = watcher.history(wait.lane).entry(wait, word, since, early)?;
        let looks_from = entry.looks_from_at_the_earliest();
        watcher.list.push(entry);
        self.shared.published.fetch_add(1, Ordering::Release);
        Some(state.watcher_for_work(Some(looks_from)))
    }

    /// The watcher's round: its [`Plan`] by `timing`, once its list has an entry (it waits for one
    /// up to its keep-alive), with the entries copied into `entries` (empty) if the first is due
    /// within [`MIN_NAP`] (else it naps first, holding none: [`Pool::watcher_nap`]). `None` (and
    /// uncounted) when it should exit: idle past its keep-alive, or shut down.
    pub(crate) fn watch_round(&self, timing: &Timing, entries: &mut Vec<Watched>) -> Option<Plan> {
        let mut state = self.lock();
        let mut timed_out = false;
        loop {
            let first = state.watcher.list.iter().map(|e| timing.look_from(e)).min();
            if let Some(first) = first.filter(|_| !state.shutdown) {
                if first.saturating_duration_since(self.now()) < MIN_NAP {
                    entries.extend(state.watcher.list.iter().cloned());
                }
                let published = self.published();
                return Some(Plan { published, first });
            }
            if state.shutdown || timed_out {
                state.leave(Role::Watcher);
                return None;
            }
            state.watcher.waits = true;
            let keep_alive = self.shared.config.keep_alive;
            (state, timed_out) = state.wait_timeout(&self.shared.watch_work, keep_alive);
            state.watcher.waits = false;
        }
    }

    /// The watcher sleeps until `until`, unless an entry comes after the `published`th (one due
    /// before `until` wakes it: `State::watcher_for_work`) or the pool shuts down. Awake, unless
    /// entries came (its round plans again), it copies the entries on its list into `entries`
    /// (empty) to look at. A nap that ran its course teaches `timing` how late it woke, and so how
    /// early the watcher wakes; whether it did.
    pub(crate) fn watcher_nap(
        &self,
        until: Instant,
        published: usize,
        timing: &mut Timing,
        entries: &mut Vec<Watched>,
    ) -> bool {
        let mut state = self.lock();
        if state.shutdown || self.published() != published {
            return false;
        }
        state.watcher.waits = true;
        state.watcher.nap_until = Some(until);
        let clock = &self.shared.clock;
        let (mut state, timed_out) = state.wait_until(&self.shared.watch_work, until, clock);
        let watcher = &mut state.watcher;
        // Cleared by whoever decided to wake it, whether or not its notification came in time.
        let wake_sent = !std::mem::take(&mut watcher.waits);
        watcher.nap_until = None;
        if self.published() == published {
            entries.extend(watcher.list.iter().cloned());
        }
        if !timed_out {
            return false;
        }
        if cfg!(device_events_loom) && !wake_sent {
            // A loom model's nap runs out as the schedule chooses, its clock moved to the nap's
            // end: an entry due to be looked at before then should have woken the watcher.
            let overslept = watcher.list.iter().any(|e| timing.look_from(e) < until);
            assert!(
                !overslept,
                "the watcher napped past an entry due before its nap's end"
            );
        }
        let now = self.now();
        timing.overslept(now.saturating_duration_since(until));
        watcher.early = Some(Early {
            early: timing.early(),
            said: now,
        });
        true
    }
}
