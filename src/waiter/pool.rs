//! [`Pool`]: a waiter's settings and shared state, the one lock over [`State`], and the operations
//! on lanes that hand-offs and lane threads call. The poller's, the watcher's and recovery's
//! operations are in their own files. See [`crate::waiter`].

use std::time::{Duration, Instant};

use super::contain;
use super::slot::Slot;
use super::state::{take, Action, Role, Server, State};
use super::stats::{Counters, WaiterStats};
use super::stuck::{self, StuckWait};
use super::wait::{Place, Wait};
use super::waitable::LaneKey;
use crate::sync::checked::Checked;
use crate::sync::{Arc, AtomicUsize, Clock, Condvar, Mutex};
use crate::ServerError;

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
    pub(super) shared: Arc<Shared>,
}

pub(super) struct Shared {
    pub(super) config: Config,
    /// [`Config::unusable`], worked out once: every hand-off's error.
    pub(super) unusable: Option<ServerError>,
    pub(super) state: Mutex<State>,
    /// Idle lane threads wait here for a lane.
    pub(super) work: Condvar,
    /// The poller waits here between rounds.
    pub(super) poller_work: Condvar,
    pub(super) counters: Counters,
    /// The watcher waits here for entries, and sleeps here toward the next one due.
    pub(super) watch_work: Condvar,
    /// Entries handed to the watcher so far: one that looks at others re-plans when it moves.
    pub(super) published: AtomicUsize,
    pub(super) clock: Clock,
    /// The process generation the pool was made in ([`crate::os`]).
    pub(super) fork_generation: u64,
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
                clock: Clock::default(),
                fork_generation: crate::os::track_forks(),
            }),
        }
    }

    pub(crate) fn config(&self) -> &Config {
        &self.shared.config
    }

    /// The watcher's clock, and its lane threads' (std's; under loom, one only a nap's end moves).
    pub(crate) fn now(&self) -> Instant {
        self.shared.clock.now()
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    pub(super) fn lock(&self) -> Checked<'_, State> {
        Checked::lock(&self.shared.state)
    }

    pub(super) fn reports_stuck(&self) -> bool {
        self.shared.config.stuck_after.is_some()
    }

    /// In a forked child, without the pool's threads (or its lock's holder).
    pub(crate) fn is_forked(&self) -> bool {
        self.shared.fork_generation != crate::os::fork_generation()
    }

    /// [`Slot::complete`], counted in the waiter's stats.
    pub(super) fn deliver(&self, slot: &Slot, result: Result<(), ServerError>) -> bool {
        let counters = &self.shared.counters;
        slot.complete(result, |ok, since| counters.delivered(ok, since))
    }

    /// Hand `wait` over: its place and what to do next; refused if forked, unusable or shut down.
    pub(super) fn submit(&self, mut wait: Wait) -> Result<(Place, Action), ServerError> {
        if self.is_forked() {
            return Err(ServerError::WaiterForked);
        }
        if let Some(unusable) = &self.shared.unusable {
            return Err(unusable.clone());
        }
        let key = wait.lane;
        let mut state = self.lock();
        if state.shutdown {
            drop(state);
            contain::drop(wait);
            return Err(ServerError::WaiterGone);
        }
        wait.place.ticket = state.next_ticket;
        state.next_ticket += 1;
        let place = wait.place;
        // Counted before any thread can take it, so its outcome comes after.
        self.shared.counters.handed_off();
        let max_threads = self.shared.config.max_threads;
        let made = state.insert(wait);
        let action = made.then(|| state.place(key, max_threads, self.reports_stuck()));
        Ok((place, action.unwrap_or_default()))
    }

    /// `key`'s wait at `place` was dropped: take it out, unless a thread holds it, for one to drop.
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
        let mut state = self.lock();
        state.shutdown = true;
        state.for_threads.clear();
        state.for_poller.clear();
        let lanes = std::mem::take(&mut state.lanes);
        let withdrawn = std::mem::take(&mut state.withdrawn);
        let watched = std::mem::take(&mut state.watcher.list);
        drop(state);
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
    pub(super) fn fail(&self, waits: impl IntoIterator<Item = Wait>, err: &ServerError) {
        for wait in waits {
            self.deliver(&wait.slot, Err(err.clone()));
            contain::drop(wait);
        }
    }

    /// The one way `slot`'s hold in lane `key` ends, or its entry leaves the watcher's list (step 3
    /// of [`crate::waiter`]); none once shutdown or recovery took it. Teaches the lane's history;
    /// delivers after the lock, and drops the entry there (its fence may be the last copy left).
    pub(super) fn end_hold(&self, key: LaneKey, slot: &Arc<Slot>, ended: Ended) -> AfterHold {
        let mut after = AfterHold::default();
        // Read before the lock, where the next wait's watch is decided.
        let now = matches!(ended, Ended::Driver { took: Some(_), .. }).then(|| self.now());
        let mut state = self.lock();
        // A wait its lane thread did not time was never offered to the watcher.
        let offered = !matches!(ended, Ended::Driver { took: None, .. });
        let entry = offered.then(|| state.watcher.unwatch(slot)).flatten();
        let ends = !matches!(ended, Ended::Unwatched { .. });
        let lane = state.lanes.get_mut(&key).filter(|_| ends);
        let ours = lane.is_some_and(|lane| lane.end_hold(slot, self.reports_stuck()));
        let result = match ended {
            Ended::Driver {
                result,
                took,
                take_next,
            } => {
                if let (Some(took), Some(now)) = (took, now) {
                    let early = state.watcher.early(now);
                    let history = state.watcher.history(key);
                    if ours {
                        history.ended(took);
                        // The watcher had it, yet the driver came first: a watch that did not pay.
                        if entry.is_some() {
                            history.missed();
                        }
                    }
                    after.watch_next = history.worth_watching(early);
                }
                if let Some(by) = take_next {
                    after.next = state.take_oldest(key, by);
                }
                ours.then_some(result)
            }
            Ended::Seen { result, took, late } => {
                if let (true, Some(entry)) = (ours, &entry) {
                    state.watcher.history(key).seen(entry, took, late);
                }
                ours.then_some(result)
            }
            Ended::Unwatched { missed } => {
                if missed && entry.is_some() {
                    state.watcher.history(key).missed();
                }
                None
            }
        };
        drop(state);
        after.delivered = result.is_some_and(|result| self.deliver(slot, result));
        contain::drop(entry);
        after
    }

    /// Move up to `limit` of `key`'s oldest waits into `batch`, if `server` serves it; false if
    /// none (an idle lane of the poller's is removed).
    pub(super) fn take_batch(
        &self,
        key: LaneKey,
        server: Server,
        limit: usize,
        batch: &mut Vec<Wait>,
    ) -> bool {
        let mut state = self.lock();
        let Some(lane) = state.lane_of(key, server) else {
            return false;
        };
        if lane.waits.is_empty() {
            if server == Server::Poller && lane.is_idle() {
                state.lanes.remove(&key);
            }
            return false;
        }
        let oldest = std::iter::from_fn(|| lane.waits.pop_first().map(|(_, wait)| wait));
        batch.extend(oldest.take(limit.saturating_sub(batch.len())));
        lane.out += batch.len();
        true
    }

    /// A batch of `key`'s is back: `resolved` reached (the caller delivers them), `rest` not, put
    /// back (or dropped, if their futures were; failed, after shutdown).
    pub(super) fn settle(&self, key: LaneKey, resolved: usize, rest: Vec<Wait>) {
        let mut state = self.lock();
        let Some(lane) = state.lanes.get_mut(&key) else {
            drop(state);
            return self.fail(rest, &ServerError::WaiterGone);
        };
        let out = resolved + rest.len();
        lane.progressed(self.reports_stuck() && resolved > 0);
        let (cancelled, back): (Vec<Wait>, Vec<Wait>) =
            rest.into_iter().partition(|wait| wait.slot.is_cancelled());
        lane.waits
            .extend(back.into_iter().map(|wait| (wait.place, wait)));
        // Exact: the batch was counted out whole. Checked once the waits are back, so a failed
        // check loses none (the thread's recovery fails those it resolved).
        take(&mut lane.out, out, "lane's batched waits");
        drop(state);
        cancelled.into_iter().for_each(contain::drop);
    }

    /// The next lane for lane thread `n`, which `finished` one (or none): that one again if it has
    /// waits, else [`State::claim`], else it sleeps for work, dropping withdrawn waits. `None` (and
    /// uncounted) when it should exit: idle past its keep-alive, or shut down.
    pub(super) fn next_lane(&self, n: usize, finished: Option<LaneKey>) -> Option<LaneKey> {
        let server = Server::Thread(n);
        let mut state = self.lock();
        if finished.is_some_and(|key| state.release(key, server)) {
            return finished;
        }
        let mut timed_out = false;
        loop {
            if !state.withdrawn.is_empty() {
                let withdrawn = std::mem::take(&mut state.withdrawn);
                drop(state);
                withdrawn.into_iter().for_each(contain::drop);
                state = self.lock();
            } else if let Some(key) = state.claim(server) {
                return Some(key);
            } else if state.shutdown || timed_out {
                state.leave(Role::Lane(n));
                return None;
            } else {
                state.idle += 1;
                let keep_alive = self.shared.config.keep_alive;
                (state, timed_out) = state.wait_timeout(&self.shared.work, keep_alive);
                state.woke();
            }
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

    /// [`stuck::stalled`], under the lock.
    fn collect_stuck(&self, mark: bool) -> Vec<StuckWait> {
        let Some(after) = self.shared.config.stuck_after.filter(|_| !self.is_forked()) else {
            return Vec::new();
        };
        stuck::stalled(&mut self.lock().lanes, Instant::now(), after, mark)
    }

    /// Wake what `action` says to wake; the caller starts the rest.
    pub(super) fn notify(&self, action: &Action) {
        if action.wake_thread {
            self.shared.work.notify_one();
        }
        if action.wake_poller {
            self.shared.poller_work.notify_one();
        }
        if action.wake_watcher {
            self.shared.watch_work.notify_one();
        }
    }

    /// [`WaiterStats`]' threads and pending waits, read under the lock (none in a forked child).
    pub(crate) fn gauges(&self) -> WaiterStats {
        let mut gauges = WaiterStats::default();
        if self.is_forked() {
            return gauges;
        }
        let state = self.lock();
        (gauges.threads, gauges.peak_threads) = (state.threads(), state.peak_threads);
        for lane in state.lanes.values() {
            gauges.pending += lane.pending();
            gauges.cancelled_held += usize::from(lane.held_given_up());
        }
        gauges
    }
}

/// How a held wait's hold ends ([`Pool::end_hold`]).
pub(super) enum Ended {
    /// Its lane thread blocked on it or asked it: `result`, `took` after its hold began (known
    /// where watchers are on); lane thread `take_next`, if any, takes its lane's next wait out.
    Driver {
        result: Result<(), ServerError>,
        took: Option<Duration>,
        take_next: Option<Server>,
    },
    /// The watcher saw its word pass and a query said `result`, `took` after its hold began
    /// (`late`: at its first look after a nap).
    Seen {
        result: Result<(), ServerError>,
        took: Duration,
        late: bool,
    },
    /// The watcher leaves it to its lane thread's block (the hold goes on); a `missed` watch counts
    /// (`LaneHistory::missed`).
    Unwatched { missed: bool },
}

/// What comes after [`Pool::end_hold`].
#[derive(Default)]
#[must_use]
pub(super) struct AfterHold {
    /// This call delivered the wait's result: no other path had.
    pub(super) delivered: bool,
    /// The lane's next wait, taken out for its lane thread.
    pub(super) next: Option<Wait>,
    /// The lane's history says its next wait is worth offering to the watcher.
    pub(super) watch_next: bool,
}
