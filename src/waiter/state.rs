//! [`State`]: everything under the waiter's one lock, its invariants (checked as the lock is let
//! go, in debug and loom builds, by `sync::checked`), and the decisions made under it; what is left
//! to do after is an [`Action`]. See [`crate::waiter`].

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use super::slot::Slot;
use super::wait::{Place, Wait};
use super::waitable::LaneKey;
use super::watcher::WatcherState;
use crate::sync::checked::Invariants;
use crate::sync::Arc;

/// Who serves a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Server {
    /// Its key is in a queue, for a lane thread or the poller.
    Queued,
    /// Lane thread number `n`.
    Thread(usize),
    Poller,
}

/// What a waiter thread is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Lane thread number `n`.
    Lane(usize),
    Poller,
    Watcher,
}

impl Role {
    /// Who it is to the lanes it serves; the watcher serves none.
    pub(super) fn server(self) -> Option<Server> {
        match self {
            Role::Lane(n) => Some(Server::Thread(n)),
            Role::Poller => Some(Server::Poller),
            Role::Watcher => None,
        }
    }
}

/// A stream's lane.
pub(super) struct Lane {
    pub(super) waits: BTreeMap<Place, Wait>,
    pub(super) server: Server,
    /// The wait its lane thread has out, for shutdown to resolve.
    pub(super) held: Option<Arc<Slot>>,
    /// Its waits out in a batch.
    pub(super) out: usize,
    /// Since when it has ended no wait: the hand-off that found it idle, or its last wait's end
    /// (kept while `stuck_after` is on).
    pub(super) since: Instant,
    /// The stall since `since` was warned about.
    pub(super) reported: bool,
    pub(super) name: Option<std::sync::Arc<str>>,
}

impl Lane {
    /// Its waits not resolved yet: queued, out in a batch, and the one a lane thread holds, if any.
    pub(super) fn pending(&self) -> usize {
        self.waits.len() + self.out + usize::from(self.held.is_some())
    }

    /// Nothing queued, held or out: who serves it removes it.
    pub(super) fn is_idle(&self) -> bool {
        self.pending() == 0
    }

    /// The future of the wait its lane thread holds was dropped.
    pub(super) fn held_given_up(&self) -> bool {
        self.held.as_ref().is_some_and(|slot| slot.is_cancelled())
    }

    /// End the lane's hold of `slot`'s wait and mark the lane as progressed. Returns whether the
    /// lane still held that wait: false once a lost thread's recovery took the hold to fail it.
    pub(super) fn end_hold(&mut self, slot: &Arc<Slot>, reports_stuck: bool) -> bool {
        let ours = self.held.take_if(|held| Arc::ptr_eq(held, slot)).is_some();
        self.progressed(reports_stuck && ours);
        ours
    }

    pub(super) fn progressed(&mut self, reports_stuck: bool) {
        if reports_stuck {
            self.since = Instant::now();
            self.reported = false;
        }
    }
}

/// Everything under the lock. Invariants: a lane is `Queued` exactly while its key is in a queue;
/// `lane_threads`, `poller` and `watcher.running` count the threads started or about to be, until
/// they leave; `notified <= idle <= lane_threads`; entries on the watcher's list have a watcher;
/// after `shutdown` no lane is left.
#[derive(Default)]
pub(super) struct State {
    pub(super) lanes: BTreeMap<LaneKey, Lane>,
    /// Lanes for lane threads (one woken, started or between lanes each).
    pub(super) for_threads: VecDeque<LaneKey>,
    /// Lanes for the poller; a lane thread out of work takes them first.
    pub(super) for_poller: VecDeque<LaneKey>,
    pub(super) lane_threads: usize,
    /// Lane threads asleep for work, and the wake-ups sent them not taken.
    pub(super) idle: usize,
    pub(super) notified: usize,
    pub(super) poller: bool,
    pub(super) peak_threads: usize,
    pub(super) next_thread: usize,
    pub(super) next_ticket: u64,
    /// Waits whose futures were dropped, for a waiter thread to drop.
    pub(super) withdrawn: Vec<Wait>,
    pub(super) watcher: WatcherState,
    pub(super) shutdown: bool,
}

/// What is left to do once the lock is let go; threads to start are counted in already.
#[derive(Debug, Default, PartialEq, Eq)]
#[must_use]
pub(crate) struct Action {
    pub(super) wake_thread: bool,
    pub(super) spawn_thread: Option<usize>,
    pub(super) wake_poller: bool,
    pub(super) spawn_poller: bool,
    pub(super) wake_watcher: bool,
    pub(super) spawn_watcher: bool,
}

impl State {
    /// Queue new lane `key` and decide who serves it (step 2 of [`crate::waiter`]); while stalls
    /// are reported (`stuck`) the poller runs too.
    pub(super) fn place(&mut self, key: LaneKey, max_threads: usize, stuck: bool) -> Action {
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
        action.spawn_poller = stuck && self.add_poller();
        action
    }

    /// The poller has work: wake it, or start it.
    pub(super) fn poller_for_work(&mut self) -> Action {
        let spawn_poller = self.add_poller();
        Action {
            wake_poller: !spawn_poller,
            spawn_poller,
            ..Action::default()
        }
    }

    /// Withdrawn waits to drop: by the poller if it runs, else an idle thread, else the poller
    /// started; never a new lane thread.
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
    pub(super) fn wake_idle(&mut self) -> bool {
        let idle = self.idle > self.notified;
        self.notified += usize::from(idle);
        idle
    }

    /// A lane thread woke (notified, spuriously, or timed out).
    pub(super) fn woke(&mut self) {
        take(&mut self.idle, 1, "idle lane threads");
        // It takes a wake-up sent for an idle thread, if one is pending: a thread that timed out or
        // woke spuriously may find none (the one sent then wakes another idle thread).
        self.notified -= usize::from(self.notified > 0);
    }

    /// Count in a new lane thread: its number.
    pub(super) fn add_lane_thread(&mut self) -> usize {
        self.lane_threads += 1;
        self.next_thread += 1;
        self.peak_threads = self.peak_threads.max(self.threads());
        self.next_thread
    }

    /// Count the poller's thread in, unless it runs (at most one does): whether to start it.
    pub(super) fn add_poller(&mut self) -> bool {
        let start = !std::mem::replace(&mut self.poller, true);
        self.peak_threads = self.peak_threads.max(self.threads());
        start
    }

    pub(super) fn threads(&self) -> usize {
        self.lane_threads + usize::from(self.poller) + usize::from(self.watcher.running)
    }

    /// Uncount a thread that leaves.
    pub(super) fn leave(&mut self, role: Role) {
        match role {
            Role::Lane(_) => take(&mut self.lane_threads, 1, "lane threads"),
            Role::Poller => self.poller = false,
            // The next watcher learns its own timing.
            Role::Watcher => (self.watcher.running, self.watcher.early) = (false, None),
        }
    }

    /// The watcher has entries, the new one to be looked at from `looks_from` at the earliest
    /// (none: at once): wake it if it waits and would not wake by then anyway, or start it.
    pub(super) fn watcher_for_work(&mut self, looks_from: Option<Instant>) -> Action {
        let watcher = &mut self.watcher;
        let spawn_watcher = !std::mem::replace(&mut watcher.running, true);
        let wakes_in_time = matches!(
            (looks_from, watcher.nap_until),
            (Some(looks_from), Some(until)) if until <= looks_from
        );
        let wake_watcher = watcher.waits && !wakes_in_time;
        watcher.waits &= !wake_watcher;
        self.peak_threads = self.peak_threads.max(self.threads());
        Action {
            wake_watcher,
            spawn_watcher,
            ..Action::default()
        }
    }

    pub(super) fn lane_of(&mut self, key: LaneKey, server: Server) -> Option<&mut Lane> {
        self.lanes
            .get_mut(&key)
            .filter(|lane| lane.server == server)
    }

    /// Put `wait` in its lane; whether that made the lane.
    pub(super) fn insert(&mut self, wait: Wait) -> bool {
        let made = !self.lanes.contains_key(&wait.lane);
        let lane = self.lanes.entry(wait.lane).or_insert_with(|| Lane {
            waits: BTreeMap::new(),
            server: Server::Queued,
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

    /// Lane thread `server` is done with `key`: whether it has waits again.
    pub(super) fn release(&mut self, key: LaneKey, server: Server) -> bool {
        let lane = self.lane_of(key, server);
        let has_waits = lane.as_ref().is_some_and(|lane| !lane.waits.is_empty());
        if lane.is_some_and(|lane| lane.is_idle()) {
            self.lanes.remove(&key);
        }
        has_waits
    }

    /// Lane thread `server` takes `key`'s oldest wait out to block on or ask.
    pub(super) fn take_oldest(&mut self, key: LaneKey, server: Server) -> Option<Wait> {
        let lane = self.lane_of(key, server)?;
        let (_, wait) = lane.waits.pop_first()?;
        lane.held = Some(wait.slot.clone());
        Some(wait)
    }

    /// For lane thread `server`: a lane queued for threads, else for the poller, else one of the
    /// poller's with nothing out.
    pub(super) fn claim(&mut self, server: Server) -> Option<LaneKey> {
        let queued = self.for_threads.pop_front();
        let key = match queued.or_else(|| self.for_poller.pop_front()) {
            Some(key) => key,
            None if self.poller => self.lanes.iter().find_map(|(&key, lane)| {
                (lane.server == Server::Poller && lane.out == 0).then_some(key)
            })?,
            None => return None,
        };
        self.lanes.get_mut(&key).expect("a queued lane").server = server;
        Some(key)
    }
}

/// `*count -= n`, for a count the waiter keeps exact: checked in every build, as one that wrapped
/// would hang waits or keep threads, silently.
#[track_caller]
pub(super) fn take(count: &mut usize, n: usize, what: &'static str) {
    *count = match count.checked_sub(n) {
        Some(left) => left,
        None => below_zero(*count, n, what),
    };
}

/// Out of line, with its arguments by value, so the hot path is one compare and branch: a panic,
/// which the thread's recovery contains as any other; logged instead on a thread already unwinding
/// (recovery itself), where a second panic would abort.
#[cold]
#[inline(never)]
#[track_caller]
fn below_zero(count: usize, n: usize, what: &'static str) -> usize {
    let what = format!("{what} count below zero ({count} - {n})");
    if !std::thread::panicking() {
        panic!("a bug in the waiter: {what}");
    }
    crate::panics::log(|| log::error!("a bug in the waiter, found in a thread's recovery: {what}"));
    0
}

impl Invariants for State {
    fn check_invariants(&self) {
        let queued = self.lanes.values().filter(|l| l.server == Server::Queued);
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
        let watcher = &self.watcher;
        assert!(
            watcher.list.is_empty() || watcher.running,
            "entries for no watcher"
        );
        assert!(!watcher.waits || watcher.running);
        for lane in self.lanes.values() {
            assert!(lane.held.is_none() || matches!(lane.server, Server::Thread(_)));
            assert!(lane.out == 0 || lane.server != Server::Queued);
        }
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "a bug in the waiter: lane threads count below zero (0 - 1)")]
    fn a_count_below_zero_panics_with_its_name() {
        State::default().leave(Role::Lane(1));
    }

    /// A thread's recovery runs as it unwinds: a second panic there would abort the process.
    #[test]
    fn a_count_below_zero_in_recovery_is_logged_not_a_second_panic() {
        struct Recovery(State);
        impl Drop for Recovery {
            fn drop(&mut self) {
                self.0.leave(Role::Lane(1));
                assert_eq!(self.0.lane_threads, 0);
            }
        }
        let unwound = std::panic::catch_unwind(|| {
            let _recovery = Recovery(State::default());
            panic!("a lane thread's bug");
        });
        assert!(unwound.is_err());
    }
}
