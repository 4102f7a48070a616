//! [`Pool`]: a waiter's state behind one lock and every decision made under
//! it; what is left to do after is an [`Action`]. See [`crate::waiter`].

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::contain;
use super::slot::Slot;
use super::stats::{Counters, WaiterStats};
use super::stuck::{self, StuckWait};
use super::waitable::{LaneKey, Waitable};
use super::watch::{Early, Held, LaneHistory, Watched, HISTORIES};
use crate::sync::checked::{Checked, Invariants};
use crate::sync::{Arc, AtomicUsize, Condvar, Mutex};
use crate::ServerError;
use std::sync::atomic::Ordering;

/// The waiter's settings; see `WaiterBuilder`.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) max_threads: usize,
    pub(crate) keep_alive: Duration,
    pub(crate) thread_name: String,
    pub(crate) spin_budget: Duration,
    /// `None`: stuck streams are not reported.
    pub(crate) stuck_after: Option<Duration>,
    /// The most threads that watch progress words (0: none; one watches them all).
    pub(crate) watchers: usize,
}

impl Config {
    /// Why no thread could be started with these settings, if so.
    pub(crate) fn unusable(&self) -> Option<ServerError> {
        let name = &self.thread_name;
        name.contains('\0').then(|| ServerError::InvalidArgument {
            what: "Waiter thread_name",
            reason: format!("{name:?} contains a NUL byte, which no thread name may"),
        })
    }
}

/// A waiter's shared state, held by its handles and threads.
#[derive(Clone)]
pub(crate) struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    config: Config,
    /// [`Config::unusable`], worked out once: every hand-off's error.
    unusable: Option<ServerError>,
    state: Mutex<State>,
    /// Idle lane threads wait here for a lane.
    work: Condvar,
    /// The poller waits here between rounds.
    poller_work: Condvar,
    counters: Counters,
    /// The watcher waits here for entries, and sleeps here toward the next one due.
    watch_work: Condvar,
    /// Entries handed to the watcher so far: one that looks at others re-plans when it moves.
    published: AtomicUsize,
    /// How early the watcher wakes before an end it expects.
    watcher_early: Early,
    /// The process generation the pool was made in ([`crate::os`]).
    fork_generation: u64,
    #[cfg(test)]
    plants: super::plants::Plants,
}

/// A wait's place in its lane: its sequence in its stream, then its
/// hand-off's ticket (so a backend whose numbers repeat loses no wait).
pub(crate) type Place = (u64, u64);

/// Who serves a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owner {
    /// Its key is in a queue, for a lane thread or the poller.
    Queued,
    Thread(usize),
    Poller,
    Watcher,
}

/// One pending wait: what to wait on and where its result goes.
pub(crate) struct Wait {
    /// Shared with the watcher while it watches the wait.
    pub(crate) waitable: std::sync::Arc<dyn Waitable>,
    pub(crate) slot: Arc<Slot>,
    lane: LaneKey,
    place: Place,
    /// Its stream's name while stuck streams are reported (made before the
    /// hand-off: the backend's `Debug`).
    name: Option<std::sync::Arc<str>>,
}

impl Wait {
    /// Its number in its stream.
    pub(super) fn sequence(&self) -> u64 {
        self.place.0
    }

    pub(crate) fn new(
        waitable: std::sync::Arc<dyn Waitable>,
        slot: Arc<Slot>,
        lane: LaneKey,
        name: Option<std::sync::Arc<str>>,
    ) -> Self {
        let place = (waitable.sequence(), 0);
        Self {
            waitable,
            slot,
            lane,
            place,
            name,
        }
    }
}

/// A stream's lane.
struct Lane {
    waits: BTreeMap<Place, Wait>,
    owner: Owner,
    /// The wait its lane thread has out, for shutdown to resolve.
    held: Option<Arc<Slot>>,
    /// Its waits out in a batch.
    out: usize,
    /// Since when it has ended no wait: the hand-off that found it idle, or
    /// its last wait's end (kept while `stuck_after` is on).
    since: Instant,
    /// The stall since `since` was warned about.
    reported: bool,
    name: Option<std::sync::Arc<str>>,
}

impl Lane {
    /// Nothing queued, held or out: its owner removes it.
    fn is_idle(&self) -> bool {
        self.waits.is_empty() && self.held.is_none() && self.out == 0
    }

    /// Its held wait, if it is still `slot`'s (not resolved by shutdown),
    /// ended: it is held no more, and the lane progressed. Whether it was.
    fn end_hold(&mut self, slot: &Arc<Slot>, watching: bool) -> bool {
        let ours = self.held.take_if(|held| Arc::ptr_eq(held, slot)).is_some();
        self.progressed(watching && ours);
        ours
    }

    fn progressed(&mut self, watching: bool) {
        if watching {
            self.since = Instant::now();
            self.reported = false;
        }
    }
}

/// Everything under the lock. Invariants: a lane is `Queued` exactly while
/// its key is in a queue; `lane_threads`, `poller` and `watcher` count the
/// threads started or about to be, until they leave; `notified <= idle <=
/// lane_threads`; entries in `watched` have a watcher; after `shutdown` no
/// lane is left.
#[derive(Default)]
pub(super) struct State {
    lanes: BTreeMap<LaneKey, Lane>,
    /// Lanes for lane threads (one woken, started or between lanes each).
    for_threads: VecDeque<LaneKey>,
    /// Lanes for the poller; a lane thread out of work takes them first.
    for_poller: VecDeque<LaneKey>,
    lane_threads: usize,
    /// Lane threads asleep for work, and the wake-ups sent them not taken.
    idle: usize,
    notified: usize,
    poller: bool,
    peak_threads: usize,
    next_thread: usize,
    next_ticket: u64,
    /// Waits whose futures were dropped, for a waiter thread to drop.
    withdrawn: Vec<Wait>,
    /// Held waits on the watcher's list; their lane threads block on them
    /// in the driver meanwhile.
    watched: Vec<Watched>,
    /// The lanes' histories, for the watcher's predictions: the
    /// [`HISTORIES`] used last, kept while their lanes come and go.
    histories: BTreeMap<LaneKey, LaneHistory>,
    /// Counts uses of `histories`.
    history_uses: u64,
    watcher: bool,
    /// The watcher waits on `watch_work`: a new entry notifies it.
    watcher_waits: bool,
    /// While it waits, when its nap ends (none: it waits for entries).
    watcher_nap_until: Option<Instant>,
    pub(super) shutdown: bool,
}

/// What is left to do once the lock is let go; threads to start are
/// counted in already.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use]
pub(super) struct Action {
    pub(super) wake_thread: bool,
    pub(super) spawn_thread: Option<usize>,
    pub(super) wake_poller: bool,
    pub(super) spawn_poller: bool,
    pub(super) wake_watcher: bool,
    pub(super) spawn_watcher: bool,
}

impl State {
    /// Queue new lane `key` and decide who serves it: an idle lane thread,
    /// else one between lanes (as many lane threads as lanes), else a new
    /// one, else the poller. While `watching` the poller runs too.
    pub(super) fn place(&mut self, key: LaneKey, max_threads: usize, watching: bool) -> Action {
        let mut action = Action::default();
        if self.shutdown {
            return action;
        }
        if self.wake_idle() {
            action.wake_thread = true;
        } else if self.lane_threads < self.lanes.len() && self.lane_threads < max_threads {
            action.spawn_thread = Some(self.add_lane_thread());
        } else if self.lane_threads < self.lanes.len() {
            self.for_poller.push_back(key);
            return self.poller_for_work();
        }
        self.for_threads.push_back(key);
        action.spawn_poller = watching && !self.poller && self.add_poller();
        action
    }

    /// The poller has work: wake it, or start it.
    fn poller_for_work(&mut self) -> Action {
        Action {
            wake_poller: self.poller,
            spawn_poller: !self.poller && self.add_poller(),
            ..Action::default()
        }
    }

    /// Withdrawn waits to drop: by the poller if it runs, else an idle
    /// thread, else the poller started; never a new lane thread.
    pub(super) fn dispose(&mut self) -> Action {
        if !self.poller && self.wake_idle() {
            return Action {
                wake_thread: true,
                ..Action::default()
            };
        }
        self.poller_for_work()
    }

    /// Count a wake-up for an idle lane thread not woken yet, if any.
    fn wake_idle(&mut self) -> bool {
        let idle = self.idle > self.notified;
        self.notified += usize::from(idle);
        idle
    }

    /// A lane thread woke (notified, spuriously, or timed out).
    fn woke(&mut self) {
        // Plant for loom model `loom_an_idle_thread_timing_out_races_a_submit`.
        if !super::plant::planted("woke-keeps-idle-count") {
            self.idle -= 1;
        }
        self.notified = self.notified.saturating_sub(1);
    }

    /// Count in a new lane thread: its number.
    fn add_lane_thread(&mut self) -> usize {
        self.lane_threads += 1;
        self.next_thread += 1;
        self.peak_threads = self.peak_threads.max(self.threads());
        self.next_thread
    }

    /// Count in the poller (there is none).
    fn add_poller(&mut self) -> bool {
        self.poller = true;
        self.peak_threads = self.peak_threads.max(self.threads());
        true
    }

    fn threads(&self) -> usize {
        self.lane_threads + usize::from(self.poller) + usize::from(self.watcher)
    }

    fn leave(&mut self, owner: Owner) {
        match owner {
            Owner::Poller => self.poller = false,
            Owner::Watcher => self.watcher = false,
            Owner::Thread(_) | Owner::Queued => self.lane_threads -= 1,
        }
    }

    /// The watcher has entries, the new one to be looked at from `looks_from`
    /// at the earliest (none: at once): wake it if it waits and would not
    /// wake by then anyway, or start it.
    fn watcher_for_work(&mut self, looks_from: Option<Instant>) -> Action {
        let spawn_watcher = !self.watcher;
        if spawn_watcher {
            self.watcher = true;
            self.peak_threads = self.peak_threads.max(self.threads());
        }
        let wakes_in_time = matches!(
            (looks_from, self.watcher_nap_until),
            (Some(looks_from), Some(until)) if until <= looks_from
        );
        let wake_watcher = self.watcher_waits && !wakes_in_time;
        self.watcher_waits &= !wake_watcher;
        Action {
            wake_watcher,
            spawn_watcher,
            ..Action::default()
        }
    }

    /// Take every entry from the watcher (their lane threads block in the
    /// driver already), to drop after the lock.
    fn unwatch_all(&mut self) -> Vec<Watched> {
        std::mem::take(&mut self.watched)
    }

    /// Take `slot`'s entry off the watcher's list, if it is there.
    fn unwatch(&mut self, slot: &Arc<Slot>) -> Option<Watched> {
        let index = self
            .watched
            .iter()
            .position(|entry| Arc::ptr_eq(&entry.slot, slot))?;
        Some(self.watched.swap_remove(index))
    }

    /// `key`'s history, made if new (the one used longest ago makes room).
    fn history(&mut self, key: LaneKey) -> &mut LaneHistory {
        self.history_uses += 1;
        if self.histories.len() >= HISTORIES && !self.histories.contains_key(&key) {
            let oldest = self
                .histories
                .iter()
                .min_by_key(|(_, history)| history.used);
            if let Some((&oldest, _)) = oldest {
                self.histories.remove(&oldest);
            }
        }
        let history = self.histories.entry(key).or_default();
        history.used = self.history_uses;
        history
    }

    fn lane_of(&mut self, key: LaneKey, owner: Owner) -> Option<&mut Lane> {
        self.lanes.get_mut(&key).filter(|lane| lane.owner == owner)
    }

    /// Put `wait` in its lane; whether that made the lane.
    pub(super) fn insert(&mut self, wait: Wait) -> bool {
        let made = !self.lanes.contains_key(&wait.lane);
        let lane = self.lanes.entry(wait.lane).or_insert_with(|| Lane {
            waits: BTreeMap::new(),
            owner: Owner::Queued,
            held: None,
            out: 0,
            since: wait.slot.handed_at(),
            reported: false,
            name: wait.name.clone(),
        });
        if lane.is_idle() && !lane.reported {
            lane.since = lane.since.max(wait.slot.handed_at());
        }
        lane.waits.insert(wait.place, wait);
        made
    }

    /// Lane thread `owner` is done with `key`: whether it has waits again.
    fn release(&mut self, key: LaneKey, owner: Owner) -> bool {
        let Some(lane) = self.lane_of(key, owner) else {
            return false;
        };
        if lane.is_idle() {
            self.lanes.remove(&key);
            return false;
        }
        !lane.waits.is_empty()
    }

    /// Lane thread `owner` takes `key`'s oldest wait out to block on or ask.
    fn take_oldest(&mut self, key: LaneKey, owner: Owner) -> Option<Wait> {
        let lane = self.lane_of(key, owner)?;
        let (_, wait) = lane.waits.pop_first()?;
        lane.held = Some(wait.slot.clone());
        Some(wait)
    }

    /// For `owner`: a lane queued for threads, else for the poller, else one
    /// of the poller's with nothing out.
    fn claim(&mut self, owner: Owner) -> Option<LaneKey> {
        let queued = self.for_threads.pop_front();
        let key = match queued.or_else(|| self.for_poller.pop_front()) {
            Some(key) => key,
            None if self.poller => {
                *self
                    .lanes
                    .iter()
                    .find(|(_, lane)| lane.owner == Owner::Poller && lane.out == 0)?
                    .0
            }
            None => return None,
        };
        self.lanes.get_mut(&key).expect("a queued lane").owner = owner;
        Some(key)
    }
}

impl Invariants for State {
    fn check_invariants(&self) {
        let queued = self
            .lanes
            .values()
            .filter(|lane| lane.owner == Owner::Queued);
        let queues = self.for_threads.len() + self.for_poller.len();
        assert_eq!(queued.count(), queues, "queued lanes and queues differ");
        assert!(self.notified <= self.idle && self.idle <= self.lane_threads);
        assert!(self.peak_threads >= self.threads());
        assert!(self.for_threads.is_empty() || self.lane_threads > 0);
        assert!(self.for_poller.is_empty() || self.poller || self.lane_threads > 0);
        assert!(
            !self.shutdown || self.lanes.is_empty(),
            "lanes after shutdown"
        );
        assert!(
            self.watched.is_empty() || self.watcher,
            "entries for no watcher"
        );
        assert!(!self.watcher_waits || self.watcher);
        for lane in self.lanes.values() {
            assert!(lane.held.is_none() || matches!(lane.owner, Owner::Thread(_)));
            assert!(lane.out == 0 || lane.owner != Owner::Queued);
        }
    }
}

impl Pool {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            shared: Arc::new(Shared {
                unusable: config.unusable(),
                config,
                state: Mutex::new(State::default()),
                work: Condvar::new(),
                poller_work: Condvar::new(),
                counters: Counters::default(),
                watch_work: Condvar::new(),
                published: AtomicUsize::new(0),
                watcher_early: Early::default(),
                fork_generation: crate::os::watch_forks(),
                #[cfg(test)]
                plants: Default::default(),
            }),
        }
    }

    pub(crate) fn config(&self) -> &Config {
        &self.shared.config
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// Entries handed to the watcher so far.
    pub(super) fn published(&self) -> usize {
        self.shared.published.load(Ordering::Acquire)
    }

    /// How early the watcher wakes before an end it expects, as of `now`.
    pub(super) fn watcher_early(&self, now: Instant) -> Duration {
        self.shared.watcher_early.get(now)
    }

    pub(super) fn set_watcher_early(&self, early: Duration) {
        self.shared.watcher_early.set(early, Instant::now());
    }

    fn lock(&self) -> Checked<'_, State> {
        Checked::lock(&self.shared.state)
    }

    fn watching(&self) -> bool {
        self.shared.config.stuck_after.is_some()
    }

    pub(crate) fn generation(&self) -> u64 {
        self.shared.fork_generation
    }

    /// In a forked child, without the pool's threads (or its lock's holder).
    pub(crate) fn is_forked(&self) -> bool {
        self.shared.fork_generation != crate::os::fork_generation()
    }

    /// Leave `result` for `slot`'s future and wake it, counting it first;
    /// whether it was the first result left there.
    pub(super) fn deliver(&self, slot: &Slot, result: Result<(), ServerError>) -> bool {
        let counters = &self.shared.counters;
        slot.complete(result, |ok, since| counters.delivered(ok, since))
    }

    /// Hand `wait` to the pool: its place and what to do next. Refused in a
    /// forked child, with unusable settings, or after shutdown.
    pub(super) fn submit(&self, mut wait: Wait) -> Result<(Place, Action), ServerError> {
        if self.is_forked() {
            return Err(ServerError::WaiterForked);
        }
        if let Some(unusable) = &self.shared.unusable {
            return Err(unusable.clone());
        }
        let key = wait.lane;
        let mut state = self.lock();
        // Plant for loom model `loom_shutdown_races_a_submit`.
        if state.shutdown && !super::plant::planted("submit-after-shutdown-queued") {
            drop(state);
            contain::drop(wait);
            return Err(ServerError::WaiterGone);
        }
        wait.place.1 = state.next_ticket;
        state.next_ticket += 1;
        let place = wait.place;
        // Counted before any thread can take it, so its outcome comes after.
        self.shared.counters.handed_off();
        if !state.insert(wait) {
            return Ok((place, Action::default()));
        }
        let max_threads = self.shared.config.max_threads;
        Ok((place, state.place(key, max_threads, self.watching())))
    }

    /// The future of the wait at `place` in `key` was dropped: take it out
    /// (unless a thread holds it) for a waiter thread to drop.
    pub(super) fn withdraw(&self, key: LaneKey, place: Place) -> Action {
        if self.is_forked() {
            return Action::default();
        }
        let mut state = self.lock();
        let lane = state.lanes.get_mut(&key);
        let Some(wait) = lane.and_then(|lane| lane.waits.remove(&place)) else {
            return Action::default();
        };
        state.withdrawn.push(wait);
        state.dispose()
    }

    /// Fail every pending wait, held ones too, and let the threads exit.
    pub(crate) fn shutdown(&self) {
        if self.is_forked() {
            return;
        }
        let (lanes, withdrawn, watched) = {
            let mut state = self.lock();
            state.shutdown = true;
            state.for_threads.clear();
            state.for_poller.clear();
            let lanes = std::mem::take(&mut state.lanes);
            let withdrawn = std::mem::take(&mut state.withdrawn);
            // Plant for loom model `loom_shutdown_during_the_race`.
            if super::plant::planted("shutdown-leaves-the-watchers-list") {
                (lanes, withdrawn, Vec::new())
            } else {
                (lanes, withdrawn, state.unwatch_all())
            }
        };
        watched.into_iter().for_each(contain::drop);
        self.shared.work.notify_all();
        self.shared.poller_work.notify_all();
        self.shared.watch_work.notify_all();
        withdrawn.into_iter().for_each(contain::drop);
        for lane in lanes.into_values() {
            if let Some(slot) = lane.held {
                self.deliver(&slot, Err(ServerError::WaiterGone));
            }
            self.fail(lane.waits.into_values(), &ServerError::WaiterGone);
        }
    }

    /// Fail `waits` with `err`, then drop them.
    fn fail(&self, waits: impl IntoIterator<Item = Wait>, err: &ServerError) {
        for wait in waits {
            self.deliver(&wait.slot, Err(err.clone()));
            contain::drop(wait);
        }
    }

    /// Lane thread `owner` takes `key`'s oldest wait out to block on.
    pub(super) fn take_oldest(&self, key: LaneKey, owner: Owner) -> Option<Wait> {
        self.lock().take_oldest(key, owner)
    }

    /// Lane thread `owner`'s held wait, `slot`'s, ended with `result`: unless
    /// shutdown (or the watcher) resolved it meanwhile, it is delivered after
    /// the lock, and, where it `took` a known time (watchers are on), that
    /// goes into its lane's history. Its watcher's entry, if any, goes. With
    /// `next`, the next oldest is taken out in the same hold. The next wait,
    /// and how long the lane's history now predicts it takes.
    pub(super) fn end_held(
        &self,
        (key, owner): (LaneKey, Owner),
        slot: &Arc<Slot>,
        result: Result<(), ServerError>,
        took: Option<Duration>,
        next: bool,
    ) -> (Option<Wait>, Option<Duration>) {
        let watching = self.watching();
        let mut state = self.lock();
        let lane = state.lane_of(key, owner);
        let ours = lane.is_some_and(|lane| lane.end_hold(slot, watching));
        let (mut entry, mut predicted) = (None, None);
        if let Some(took) = took {
            entry = state.unwatch(slot);
            let history = state.history(key);
            if ours {
                history.ended(took);
            }
            predicted = history.predicted();
        }
        let next = next.then(|| state.take_oldest(key, owner)).flatten();
        drop(state);
        if ours {
            self.deliver(slot, result);
        }
        // Its fence may be the last copy left (a cancelled wait's).
        contain::drop(entry);
        (next, predicted)
    }

    /// The watcher saw `entry`'s wait end with `result`, `took` after its
    /// hold began (`late`: at its first look after a sleep): unless its lane
    /// thread or shutdown resolved it meanwhile, it is held no more (its lane
    /// thread, still in the driver, takes the next once it wakes), its lane's
    /// history learns `took`, and it is delivered after the lock. Its entry
    /// leaves the list. Whether this delivered it.
    pub(super) fn end_watched(
        &self,
        entry: &Watched,
        result: Result<(), ServerError>,
        took: Duration,
        late: bool,
    ) -> bool {
        let watching = self.watching();
        let mut state = self.lock();
        let lane = state.lanes.get_mut(&entry.lane);
        let ours = lane.is_some_and(|lane| lane.end_hold(&entry.slot, watching));
        if ours {
            state.history(entry.lane).seen(entry, took, late);
        }
        let removed = state.unwatch(&entry.slot);
        drop(state);
        // Plant for loom model `loom_the_watcher_and_the_driver_race_to_resolve_a_wait_once`.
        let ours = ours && !super::plant::planted("watcher-takes-the-hold-delivers-nothing");
        let delivered = ours && self.deliver(&entry.slot, result);
        // Its fence may be the last copy left (its lane thread done with it).
        contain::drop(removed);
        delivered
    }

    /// The watcher leaves `entry` to its lane thread, which blocks on it in
    /// the driver: its window ended, or its word ran ahead of its event.
    pub(super) fn unwatch(&self, entry: &Watched) {
        let removed = self.lock().unwatch(&entry.slot);
        contain::drop(removed);
    }

    /// A lane thread, about to block in the driver on its held wait, puts it
    /// on the watcher's list too (to race the driver), unless the lane's
    /// waits are too short to watch or the pool is shut down. What to do
    /// then, if it did.
    pub(super) fn watch(&self, held: Held<'_>) -> Option<Action> {
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
    pub(super) fn watch_round(&self, entries: &mut Vec<Watched>) -> Option<usize> {
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
    pub(super) fn watcher_nap(&self, until: Instant, published: usize) -> Option<Duration> {
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

    /// Move up to `limit` of `key`'s oldest waits into `batch`, if `owner`
    /// serves it; false if none (an idle lane of the poller's is removed).
    pub(super) fn take_batch(
        &self,
        key: LaneKey,
        owner: Owner,
        limit: usize,
        batch: &mut Vec<Wait>,
    ) -> bool {
        let mut state = self.lock();
        let Some(lane) = state.lane_of(key, owner) else {
            return false;
        };
        if lane.waits.is_empty() {
            if owner == Owner::Poller && lane.is_idle() {
                state.lanes.remove(&key);
            }
            return false;
        }
        while batch.len() < limit {
            let Some((_, wait)) = lane.waits.pop_first() else {
                break;
            };
            batch.push(wait);
        }
        lane.out += batch.len();
        true
    }

    /// A batch of `key`'s is back: `resolved` reached (the caller delivers
    /// them), `rest` not, put back (or dropped, if their futures were;
    /// failed, after shutdown).
    pub(super) fn settle(&self, key: LaneKey, rest: Vec<Wait>, resolved: usize) {
        let watching = self.watching();
        let mut state = self.lock();
        let Some(lane) = state.lanes.get_mut(&key) else {
            drop(state);
            return self.fail(rest, &ServerError::WaiterGone);
        };
        lane.out = lane.out.saturating_sub(resolved + rest.len());
        lane.progressed(watching && resolved > 0);
        let (cancelled, back): (Vec<Wait>, Vec<Wait>) =
            rest.into_iter().partition(|wait| wait.slot.is_cancelled());
        for wait in back {
            lane.waits.insert(wait.place, wait);
        }
        drop(state);
        cancelled.into_iter().for_each(contain::drop);
    }

    /// The next lane for lane thread `owner`, which `finished` one (or
    /// none): that one again if it has waits, else [`State::claim`], else it
    /// sleeps for work, dropping withdrawn waits. `None` (and uncounted) when
    /// it should exit: idle past its keep-alive, or shut down.
    pub(super) fn next_lane(&self, owner: Owner, finished: Option<LaneKey>) -> Option<LaneKey> {
        let mut state = self.lock();
        if finished.is_some_and(|key| state.release(key, owner)) {
            return finished;
        }
        let mut timed_out = false;
        loop {
            if !state.withdrawn.is_empty() {
                let withdrawn = std::mem::take(&mut state.withdrawn);
                drop(state);
                withdrawn.into_iter().for_each(contain::drop);
                state = self.lock();
            } else if let Some(key) = state.claim(owner) {
                return Some(key);
            } else if state.shutdown || timed_out {
                state.leave(owner);
                return None;
            } else {
                state.idle += 1;
                let keep_alive = self.shared.config.keep_alive;
                let (woken, timeout) = state.wait_timeout(&self.shared.work, keep_alive);
                state = woken;
                state.woke();
                timed_out = timeout;
                // Plant for loom model `loom_an_idle_thread_timing_out_races_a_submit`.
                if timeout && super::plant::planted("idle-thread-leaves-without-looking") {
                    state.leave(owner);
                    return None;
                }
            }
        }
    }

    /// A poller's round: adopt the lanes queued for it into `lanes`, take
    /// the withdrawn waits, wake an idle lane thread if it has lanes. `None`
    /// (and uncounted) when it should exit: idle `linger` rounds, or shut down.
    pub(super) fn poller_round(
        &self,
        lanes: &mut Vec<LaneKey>,
        idle_rounds: &mut u32,
        linger: u32,
    ) -> Option<Vec<Wait>> {
        let mut state = self.lock();
        let withdrawn = std::mem::take(&mut state.withdrawn);
        let adopted = !state.for_poller.is_empty();
        while let Some(key) = state.for_poller.pop_front() {
            state.lanes.get_mut(&key).expect("a queued lane").owner = Owner::Poller;
            if !lanes.contains(&key) {
                lanes.push(key);
            }
        }
        let idle = lanes.is_empty() && !adopted && withdrawn.is_empty();
        let watching = self.watching() && !state.lanes.is_empty();
        if idle && !watching && (*idle_rounds >= linger || state.shutdown) {
            state.leave(Owner::Poller);
            return None;
        }
        *idle_rounds = if idle { *idle_rounds + 1 } else { 0 };
        if !lanes.is_empty() && state.wake_idle() {
            drop(state);
            self.shared.work.notify_one();
        }
        Some(withdrawn)
    }

    /// The poller sleeps up to `pause` between rounds, unless work came.
    pub(super) fn poller_pause(&self, pause: Duration) {
        let state = self.lock();
        if state.for_poller.is_empty() && state.withdrawn.is_empty() && !state.shutdown {
            // Under loom a zero timeout is a yield: the model explores both.
            #[cfg(device_events_loom)]
            let pause = pause.min(Duration::ZERO);
            drop(state.wait_timeout(&self.shared.poller_work, pause));
        }
    }

    /// The streams stalled past `stuck_after` (none when it is off).
    pub(crate) fn stuck(&self) -> Vec<StuckWait> {
        self.collect_stuck(false)
    }

    /// Warn once about each stall not warned about yet, with no lock held.
    pub(super) fn warn_stuck(&self) {
        if let Some(after) = self.shared.config.stuck_after {
            for wait in self.collect_stuck(true) {
                stuck::warn(&self.shared.config.thread_name, after, &wait);
            }
        }
    }

    /// The stalled streams; with `mark`, those not reported yet, now marked.
    fn collect_stuck(&self, mark: bool) -> Vec<StuckWait> {
        let Some(after) = self.shared.config.stuck_after else {
            return Vec::new();
        };
        if self.is_forked() {
            return Vec::new();
        }
        let now = Instant::now();
        let mut state = self.lock();
        let mut found = Vec::new();
        for (key, lane) in &mut state.lanes {
            let held = lane.held.as_ref();
            let stall = stuck::Stall {
                since: lane.since,
                queued: lane.waits.len() + lane.out,
                held: held.is_some(),
                given_up: held.is_some_and(|slot| slot.is_cancelled()),
            };
            let name = lane.name.as_deref();
            let Some(wait) = stall.stuck(now, after, name, key.stream_id()) else {
                continue;
            };
            if !(mark && std::mem::replace(&mut lane.reported, true)) {
                found.push(wait);
            }
        }
        found
    }

    /// Thread `owner` could not be started: uncount it. A lane thread's lanes
    /// go to the poller; a poller's fail (no lane thread may ever be free).
    pub(super) fn spawn_failed(&self, owner: Owner, err: std::io::Error) -> Action {
        crate::panics::log(|| log::error!("a waiter thread could not be started: {err}"));
        let mut state = self.lock();
        state.leave(owner);
        if owner == Owner::Watcher {
            // Its entries' lane threads block in the driver: they end there.
            let entries = state.unwatch_all();
            drop(state);
            entries.into_iter().for_each(contain::drop);
            return Action::default();
        }
        if owner != Owner::Poller {
            let lanes = std::mem::take(&mut state.for_threads);
            // Plant for loom model `loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller`.
            if super::plant::planted("refused-lane-left-for-threads") {
                state.for_threads.extend(lanes);
            } else {
                state.for_poller.extend(lanes);
            }
            if !state.poller && !state.shutdown {
                return state.poller_for_work();
            }
        }
        if state.poller {
            // It may be asleep for a while (watching): the lanes are its now.
            return state.poller_for_work();
        }
        let mut failed = Vec::new();
        while let Some(key) = state.for_poller.pop_front() {
            let lane = state.lanes.remove(&key);
            failed.extend(lane.into_iter().flat_map(|lane| lane.waits.into_values()));
        }
        let withdrawn = std::mem::take(&mut state.withdrawn);
        drop(state);
        withdrawn.into_iter().for_each(contain::drop);
        let failure = ServerError::ThreadSpawn {
            component: "Waiter",
            reason: format!("no waiter thread could be started to serve it: {err}"),
            source: Some(crate::ErrorSource::new(err)),
        };
        self.fail(failed, &failure);
        Action::default()
    }

    /// Give back what a thread that unwound held: fail its `batch` (out of
    /// `batch_lane`) and held wait, uncount it, queue its `lanes` again.
    pub(super) fn recover(
        &self,
        owner: Owner,
        lanes: &[LaneKey],
        batch_lane: Option<LaneKey>,
        batch: &mut Vec<Wait>,
    ) -> Vec<Action> {
        let (max_threads, watching) = (self.shared.config.max_threads, self.watching());
        let mut held = Vec::new();
        let mut state = self.lock();
        if let Some(lane) = batch_lane.and_then(|key| state.lanes.get_mut(&key)) {
            lane.out = lane.out.saturating_sub(batch.len());
        }
        state.leave(owner);
        // Placed again: one of them may have counted on this thread.
        let mut placed = std::mem::take(&mut state.for_threads);
        for &key in lanes {
            let Some(lane) = state.lane_of(key, owner) else {
                continue;
            };
            held.extend(lane.held.take());
            lane.owner = Owner::Queued;
            if lane.is_idle() {
                state.lanes.remove(&key);
            } else {
                placed.push_back(key);
            }
        }
        let mut actions: Vec<Action> = placed
            .into_iter()
            .map(|key| state.place(key, max_threads, watching))
            .collect();
        // A watcher lost with entries left is started again.
        if owner == Owner::Watcher && !state.watched.is_empty() && !state.shutdown {
            actions.push(state.watcher_for_work(None));
        }
        // The poller watches while a lane is left, even if it was the one lost.
        if watching && !state.poller && !state.shutdown && !state.lanes.is_empty() {
            actions.push(state.poller_for_work());
        }
        drop(state);
        let failure = ServerError::WaiterPanicked {
            message: "a waiter thread unwound while it held this wait".to_owned(),
        };
        // A no-op for those of the batch it had already resolved.
        self.fail(batch.drain(..), &failure);
        for slot in held {
            self.deliver(&slot, Err(failure.clone()));
        }
        actions
    }

    /// Wake what `action` says to wake; the caller starts the rest.
    pub(super) fn notify(&self, action: &Action) {
        // Plant for loom model `loom_two_idle_lane_threads_are_woken_for_new_lanes`.
        if action.wake_thread && !super::plant::planted("idle-thread-wake-never-sent") {
            self.shared.work.notify_one();
        }
        if action.wake_poller {
            self.shared.poller_work.notify_one();
        }
        if action.wake_watcher {
            self.shared.watch_work.notify_one();
        }
    }

    /// [`WaiterStats`]' threads and pending waits (none in a forked child).
    pub(crate) fn gauges(&self) -> WaiterStats {
        let mut gauges = WaiterStats::default();
        if self.is_forked() {
            return gauges;
        }
        let state = self.lock();
        (gauges.threads, gauges.peak_threads) = (state.threads(), state.peak_threads);
        for lane in state.lanes.values() {
            let held = lane.held.as_ref();
            gauges.pending += lane.waits.len() + lane.out + usize::from(held.is_some());
            gauges.cancelled_held += usize::from(held.is_some_and(|slot| slot.is_cancelled()));
        }
        gauges
    }

    /// A spawn a test refused, if it planted one.
    pub(super) fn refused_spawn(&self) -> Option<std::io::Error> {
        #[cfg(test)]
        if super::plants::Plants::take(&self.shared.plants.refused_spawns) {
            return Some(std::io::Error::other("a spawn refused by a test"));
        }
        None
    }

    /// Panic if a test planted one for `owner`, outside any contained call.
    pub(super) fn planted_escape(&self, owner: Owner) {
        #[cfg(test)]
        if super::plants::Plants::take(match owner {
            Owner::Watcher => &self.shared.plants.watcher_escapes,
            _ => &self.shared.plants.escapes,
        }) {
            panic!("a panic planted by a test, outside any contained call");
        }
        let _ = owner;
    }

    #[cfg(test)]
    pub(super) fn plants(&self) -> &super::plants::Plants {
        &self.shared.plants
    }

    /// The watcher's entries, for tests.
    #[cfg(test)]
    pub(super) fn watched_entries(&self) -> usize {
        self.lock().watched.len()
    }

    /// Give `key`'s history a wait that took `took`, for tests.
    #[cfg(all(test, not(device_events_loom)))]
    pub(super) fn seed_history(&self, key: LaneKey, took: Duration) {
        self.lock().history(key).ended(took);
    }

    /// How many waits `key`'s history has learnt, for tests.
    #[cfg(all(test, not(device_events_loom)))]
    pub(super) fn history_len(&self, key: LaneKey) -> usize {
        self.lock().histories.get(&key).map_or(0, LaneHistory::len)
    }

    /// Whether the watcher sleeps on its condvar now, for tests.
    #[cfg(all(test, not(device_events_loom)))]
    pub(super) fn watcher_waits(&self) -> bool {
        self.lock().watcher_waits
    }

    /// Lane threads asleep for work now, for tests that need one idle.
    #[cfg(all(test, not(device_events_loom)))]
    pub(super) fn idle_threads(&self) -> usize {
        self.lock().idle
    }
}
