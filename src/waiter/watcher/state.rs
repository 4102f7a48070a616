//! [`WatcherState`]: the watcher's part of the pool's state, under its one lock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::timing::{Early, LaneHistory, Watched, HISTORIES};
use crate::sync::Arc;
use crate::waiter::slot::Slot;
use crate::waiter::waitable::LaneKey;

/// The watcher's part of the pool's state.
#[derive(Default)]
pub(crate) struct WatcherState {
    /// Held waits on the watcher's list; their lane threads block on them in the driver meanwhile.
    pub(crate) list: Vec<Watched>,
    /// The lanes' histories: the [`HISTORIES`] used last, kept while their lanes come and go.
    pub(crate) histories: BTreeMap<LaneKey, LaneHistory>,
    /// Counts uses of `histories`.
    history_uses: u64,
    /// Its thread is counted in.
    pub(crate) running: bool,
    /// It waits on the pool's `watch_work`: a new entry notifies it.
    pub(crate) waits: bool,
    /// While it waits, when its nap ends (none: it waits for entries).
    pub(crate) nap_until: Option<Instant>,
    /// How early it wakes before an end it expects, as its last nap measured (none yet).
    pub(crate) early: Option<Early>,
}

impl WatcherState {
    /// How early the watcher wakes before an end it expects, as of `now`.
    pub(crate) fn early(&self, now: Instant) -> Duration {
        self.early.map_or(Duration::ZERO, |early| early.at(now))
    }

    /// `key`'s history, made if new (the one used longest ago makes room).
    pub(crate) fn history(&mut self, key: LaneKey) -> &mut LaneHistory {
        self.history_uses += 1;
        if self.histories.len() >= HISTORIES && !self.histories.contains_key(&key) {
            if let Some((&oldest, _)) = self.histories.iter().min_by_key(|(_, h)| h.used) {
                self.histories.remove(&oldest);
            }
        }
        let history = self.histories.entry(key).or_default();
        history.used = self.history_uses;
        history
    }

    /// Take `slot`'s entry off the list, if it is there.
    pub(crate) fn unwatch(&mut self, slot: &Arc<Slot>) -> Option<Watched> {
        let index = self.list.iter().position(|e| Arc::ptr_eq(&e.slot, slot))?;
        Some(self.list.swap_remove(index))
    }
}
