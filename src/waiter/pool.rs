//! [`Pool`]: the waiter's threads, its lanes, and how waits move between
//! them: the lane algorithm described in the [waiter's docs](super), here
//! in code.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use super::permits::Permits;
use super::slot::Slot;
use super::waitable::{LaneKey, Waitable};
use crate::loom::{thread, Arc, Condvar, Mutex, MutexGuard};
use crate::ServerError;

/// The most waits a thread takes out of a lane to query in one round.
const BATCH: usize = 256;

/// The poller's first pause after a round without progress.
const POLL_BACKOFF_MIN: Duration = Duration::from_micros(50);
/// The poller's longest pause: the most latency an overflow lane can add.
const POLL_BACKOFF_MAX: Duration = Duration::from_millis(1);
/// How many rounds without work the poller waits out before it exits: from
/// [`POLL_BACKOFF_MIN`] doubling to [`POLL_BACKOFF_MAX`], about 2.5 ms. None
/// under loom, whose models would otherwise explore every round.
const POLLER_LINGER_ROUNDS: u32 = if cfg!(device_events_loom) { 0 } else { 6 };

/// The waiter's settings; see [`WaiterBuilder`](super::WaiterBuilder).
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) max_threads: usize,
    pub(crate) keep_alive: Duration,
    pub(crate) thread_name: String,
    pub(crate) spin_budget: Duration,
    /// How many lane threads may resolve waits at once (see [`Permits`]):
    /// the machine's cores.
    pub(crate) resolvers: usize,
}

impl Config {
    /// Why no thread could be started with these settings, if so.
    pub(crate) fn invalid(&self) -> Option<ServerError> {
        self.thread_name
            .contains('\0')
            .then(|| ServerError::InvalidArgument {
                what: "Waiter thread_name",
                reason: format!(
                    "{:?} contains a NUL byte, which no thread name may",
                    self.thread_name
                ),
            })
    }
}

/// The shared state of a waiter: owned by its threads and its handles.
pub(crate) struct Pool {
    pub(crate) config: Config,
    state: Mutex<State>,
    /// Idle lane threads wait here for a lane.
    work: Condvar,
    /// Lane threads resolving what they found reached, at most one per core.
    resolving: Permits,
}

/// Everything under the pool's lock. It changes only through the
/// transitions below, each a method that keeps these invariants:
///
/// - **pending**: `pending` counts the waits handed to the pool and not yet
///   resolved, withdrawn or failed: those in lanes, plus those a thread has
///   taken out to block on or to query. [`State::wait_added`] adds one,
///   [`State::waits_finished`] takes finished ones off.
/// - **ownership**: a lane is in `queued` exactly when its owner is
///   [`Owner::Queued`] ([`State::queue_lane`]); a thread or the poller takes
///   it from there ([`State::take_lane_for_thread`],
///   [`State::adopt_queued_lanes`]); an emptied lane is removed by whoever
///   serves it.
/// - **threads**: `lane_threads` and `poller` count the threads started (or
///   about to be): [`State::add_lane_thread`] / [`State::lane_thread_left`],
///   [`State::add_poller`] / [`State::poller_left`]. `idle` counts lane
///   threads asleep for work, `notified` the wake-ups sent to them and not
///   yet taken ([`State::go_idle`], [`State::woke`]).
#[derive(Default)]
struct State {
    /// Ordered, so iteration (and a loom model) is deterministic.
    lanes: BTreeMap<LaneKey, Lane>,
    /// Lanes with waits and no thread, oldest first.
    queued: VecDeque<LaneKey>,
    lane_threads: usize,
    idle: usize,
    /// Wake-ups sent to idle threads and not yet taken.
    notified: usize,
    poller: bool,
    /// Waits whose futures were dropped, taken out of their lanes. A waiter
    /// thread drops them (destroying their events), never the thread that
    /// dropped the future.
    withdrawn: Vec<Wait>,
    peak_threads: usize,
    pending: usize,
    shutdown: bool,
    next_thread: usize,
}

#[derive(Default)]
struct Lane {
    waits: BTreeMap<u64, Wait>,
    owner: Owner,
    /// The slot of the wait this lane's thread is blocked on, so shutdown
    /// can resolve it without waiting for the block to end.
    blocked_on: Option<Arc<Slot>>,
}

#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// Just created: nobody serves it yet.
    #[default]
    Nobody,
    /// In `State::queued`, waiting for a thread.
    Queued,
    /// Served by a lane thread.
    Thread,
    /// Served by the poller.
    Poller,
}

/// One pending wait: what to wait on and where its result goes.
pub(crate) struct Wait {
    pub(crate) waitable: Box<dyn Waitable>,
    pub(crate) slot: Arc<Slot>,
}

/// What [`Pool::resolve_reached`] did.
struct Resolved {
    /// How many waits it resolved.
    resolved: usize,
    /// Whether the lane still has waits (the first not reached, and after).
    more: bool,
}

/// What `submit` must do once it has dropped the lock.
enum Spawn {
    Nothing,
    LaneThread(usize),
    Poller,
}

impl Pool {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            resolving: Permits::new(config.resolvers),
            config,
            state: Mutex::new(State::default()),
            work: Condvar::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Hand a wait to the pool. Returns its lane and sequence: where it
    /// sits, for [`Pool::withdraw`].
    ///
    /// # Errors
    ///
    /// [`ServerError::WaiterGone`] after [`Pool::shutdown`]; the wait is
    /// dropped.
    pub(crate) fn submit(pool: &Arc<Self>, wait: Wait) -> Result<(LaneKey, u64), ServerError> {
        let key = wait.waitable.lane();
        let sequence = wait.waitable.sequence();
        if let Some(invalid) = pool.config.invalid() {
            return Err(invalid);
        }
        let mut state = pool.state();
        if state.shutdown {
            drop(state);
            drop(wait);
            return Err(ServerError::WaiterGone);
        }
        state.wait_added();
        let (sequence, spawn) = pool.insert(&mut state, key, sequence, wait);
        drop(state);
        Self::spawn(pool, spawn);
        Ok((key, sequence))
    }

    /// Put `wait` in its lane, at `sequence` or, if that place is taken, the
    /// next free one (sequences are unique per stream, but two streams may
    /// share a lane whose keys collide: no wait may overwrite another). A
    /// lane nobody serves is queued for a server. Returns where it went.
    fn insert(&self, state: &mut State, key: LaneKey, sequence: u64, wait: Wait) -> (u64, Spawn) {
        let lane = state.lanes.entry(key).or_default();
        let mut sequence = sequence;
        while lane.waits.contains_key(&sequence) {
            sequence = sequence.wrapping_add(1);
        }
        lane.waits.insert(sequence, wait);
        if lane.owner != Owner::Nobody {
            return (sequence, Spawn::Nothing);
        }
        state.queue_lane(key);
        (sequence, self.wake_or_spawn_server(state))
    }

    /// A lane was queued: wake an idle thread, or decide what to spawn.
    ///
    /// A new lane thread starts only while there are fewer lane threads than
    /// lanes. Each thread serves at most one lane, so otherwise some thread
    /// is free: idle and already woken, or between lanes, and it takes the
    /// queued lane before it sleeps. This keeps threads at one per busy
    /// stream even when lanes drain and refill faster than threads wake.
    fn wake_or_spawn_server(&self, state: &mut State) -> Spawn {
        if self.wake_idle(state) || state.lane_threads >= state.lanes.len() {
            Spawn::Nothing
        } else if state.lane_threads < self.config.max_threads {
            state.add_lane_thread()
        } else if !state.poller {
            state.add_poller()
        } else {
            Spawn::Nothing
        }
    }

    /// Wake an idle lane thread not woken yet, if there is one.
    fn wake_idle(&self, state: &mut State) -> bool {
        if state.idle > state.notified {
            state.notified += 1;
            self.work.notify_one();
            true
        } else {
            false
        }
    }

    fn spawn(pool: &Arc<Self>, spawn: Spawn) {
        let (name, run): (String, fn(Arc<Self>)) = match spawn {
            Spawn::Nothing => return,
            Spawn::LaneThread(index) => (
                format!("{}-{index}", pool.config.thread_name),
                Self::run_lane_thread,
            ),
            Spawn::Poller => (
                format!("{}-poller", pool.config.thread_name),
                Self::run_poller,
            ),
        };
        let worker = pool.clone();
        // A spawn that panics (std does, for a name it cannot pass to the
        // OS) is a failed spawn like any other, never a panic in `poll`.
        let spawned = catch_unwind(AssertUnwindSafe(|| {
            thread::Builder::new().name(name).spawn(move || run(worker))
        }))
        .unwrap_or_else(|payload| {
            Err(std::io::Error::other(ServerError::panic_message(
                payload.as_ref(),
            )))
        });
        if let Err(err) = spawned {
            Self::spawn_failed(pool, matches!(spawn, Spawn::Poller), &err);
        }
    }

    /// Undo the counters of a thread that could not start, and keep serving
    /// with the threads that exist. With none at all, fail the queued waits
    /// rather than leave them pending forever.
    fn spawn_failed(pool: &Arc<Self>, poller: bool, err: &std::io::Error) {
        log::error!("a waiter thread could not be started: {err}");
        let mut state = pool.state();
        if poller {
            state.poller_left();
        } else {
            state.lane_thread_left();
            if !state.poller {
                let spawn = state.add_poller();
                drop(state);
                return Self::spawn(pool, spawn);
            }
        }
        if state.lane_threads > 0 || state.poller {
            return;
        }
        let reason = format!("no waiter thread could be started: {err}");
        let failed = state.take_queued_waits();
        // No thread will drop them: dropped here, as the last resort.
        let withdrawn = std::mem::take(&mut state.withdrawn);
        drop(state);
        drop(withdrawn);
        for wait in failed {
            wait.slot.complete(Err(ServerError::ThreadSpawn {
                component: "Waiter",
                reason: reason.clone(),
            }));
        }
    }

    /// A lane thread: take a lane, serve it until empty, take the next.
    fn run_lane_thread(pool: Arc<Self>) {
        let mut finished = None;
        let mut scratch = Vec::new();
        loop {
            let Some(key) = pool.next_lane(finished.take()) else {
                return;
            };
            while Self::serve_lane_once(&pool, key, &mut scratch) {}
            finished = Some(key);
        }
    }

    /// The next lane for a lane thread that just `finished` one (or none), or
    /// `None` when it should exit (idle past keep-alive, or shut down).
    ///
    /// Releasing the finished lane and looking for the next happen under the
    /// lock, and the lock is let go only to drop withdrawn waits, after which
    /// the thread looks again before it sleeps. A wait submitted meanwhile
    /// either finds the lane still served, or counts this thread among the
    /// lane threads (so it starts none) and is taken by it, or finds it idle
    /// and wakes it. So a stream whose lane empties and refills does not make
    /// the pool start another thread.
    fn next_lane(&self, finished: Option<LaneKey>) -> Option<LaneKey> {
        let mut state = self.state();
        if let Some(key) = finished {
            match state.lanes.get(&key) {
                Some(lane) if lane.owner == Owner::Thread && !lane.waits.is_empty() => {
                    return Some(key)
                }
                Some(lane) if lane.owner == Owner::Thread => {
                    state.lanes.remove(&key);
                }
                _ => {}
            }
        }
        let mut timed_out = false;
        loop {
            if !state.withdrawn.is_empty() {
                // Dropped outside the lock; then look again, as new work may
                // have come meanwhile.
                let withdrawn = std::mem::take(&mut state.withdrawn);
                drop(state);
                drop(withdrawn);
                state = self.state();
                continue;
            }
            if let Some(key) = state.take_lane_for_thread() {
                return Some(key);
            }
            if state.shutdown || timed_out {
                state.lane_thread_left();
                return None;
            }
            state.go_idle();
            let (guard, timeout) = self.work.wait_timeout(state, self.config.keep_alive);
            state = guard;
            state.woke();
            timed_out = timeout;
        }
    }

    /// Block on the oldest wait of `key`, then resolve every later one
    /// already reached. Returns whether the lane still has waits (and is
    /// still this thread's).
    fn serve_lane_once(pool: &Arc<Self>, key: LaneKey, scratch: &mut Vec<Wait>) -> bool {
        let Some(wait) = pool.pop_oldest(key) else {
            return false;
        };
        let Wait { waitable, slot } = wait;
        let result = contain(|| waitable.block());
        let _permit = pool.resolving.acquire();
        pool.resolve_blocked(key, &slot, result);
        Self::resolve_reached(pool, key, Owner::Thread, scratch).more
    }

    /// Resolve, in order, the waits of `key` that a query shows reached; stop
    /// at the first that is not.
    ///
    /// Works in batches: the lane's waits are taken in one lock, queried
    /// outside it, and the rest put back in one more, so a burst of thousands
    /// of reached waits costs two lock round-trips, not three per wait. Each
    /// batch's futures are all woken before any of its waits (and their
    /// events) is dropped, so the tasks run while this thread cleans up; the
    /// batch lives in `scratch`, the calling thread's buffer, so a burst
    /// allocates nothing per batch.
    fn resolve_reached(
        pool: &Arc<Self>,
        key: LaneKey,
        owner: Owner,
        scratch: &mut Vec<Wait>,
    ) -> Resolved {
        let mut resolved = 0;
        // The poller asks each of its lanes every round, mostly to hear "not
        // yet": it takes just the oldest wait first, and a batch only once
        // that one is reached. A lane thread has just seen its oldest reached.
        let mut limit = if owner == Owner::Poller { 1 } else { BATCH };
        loop {
            if !pool.take_waits(key, owner, limit, scratch) {
                return Resolved {
                    resolved,
                    more: false,
                };
            }
            let (reached, failed) = reached_prefix(scratch);
            let rest = scratch.split_off(reached);
            let more = !rest.is_empty();
            resolved += reached;
            limit = BATCH;
            Self::settle(pool, key, rest, reached);
            // Woken outside the lock, oldest first; then each wait (and its
            // event) is dropped here, on this thread.
            let mut failed = failed.into_iter().peekable();
            for (index, wait) in scratch.iter().enumerate() {
                match failed.next_if(|(at, _)| *at == index) {
                    Some((_, err)) => wait.slot.complete(Err(err)),
                    None => wait.slot.complete(Ok(())),
                }
            }
            scratch.clear();
            if more {
                return Resolved {
                    resolved,
                    more: true,
                };
            }
        }
    }

    /// The lane thread serving `key` takes its oldest wait to block on (and
    /// notes it in `blocked_on`). `None` when the lane is empty or no longer
    /// this thread's; a lane thread releases its emptied lane in `next_lane`.
    fn pop_oldest(&self, key: LaneKey) -> Option<Wait> {
        let mut state = self.state();
        let lane = state
            .lanes
            .get_mut(&key)
            .filter(|lane| lane.owner == Owner::Thread)?;
        let (_, wait) = lane.waits.pop_first()?;
        lane.blocked_on = Some(wait.slot.clone());
        Some(wait)
    }

    /// Move up to `limit` (at most [`BATCH`]) waits of `key` into `batch`,
    /// oldest first, if `owner` serves it. False when there are none (a lane
    /// the poller emptied is removed).
    ///
    /// Bounded, so a lane of thousands that is only partly reached costs a
    /// batch per round, not the whole lane taken out and put back.
    fn take_waits(&self, key: LaneKey, owner: Owner, limit: usize, batch: &mut Vec<Wait>) -> bool {
        let mut state = self.state();
        let Some(lane) = state.lanes.get_mut(&key).filter(|lane| lane.owner == owner) else {
            return false;
        };
        if lane.waits.is_empty() {
            if owner == Owner::Poller {
                state.lanes.remove(&key);
            }
            return false;
        }
        let rest = match lane.waits.keys().nth(limit) {
            Some(&first_left) => lane.waits.split_off(&first_left),
            None => BTreeMap::new(),
        };
        let taken = std::mem::replace(&mut lane.waits, rest);
        batch.extend(taken.into_values());
        true
    }

    /// Return waits not reached yet to their lane and count `resolved` ones
    /// as done, in one lock. If the lane was emptied and removed meanwhile (a
    /// thread took it over from the poller and found it empty), it is queued
    /// afresh, so someone serves it.
    ///
    /// A wait whose future was dropped while it was out of its lane (so
    /// `withdraw` did not find it) is dropped here instead of put back. This
    /// is the only way a cancelled wait could enter a lane: the future's drop
    /// marks the slot cancelled before it takes the pool lock to withdraw, so
    /// under this lock a wait is either seen cancelled or withdrawn later.
    fn settle(pool: &Arc<Self>, key: LaneKey, rest: Vec<Wait>, resolved: usize) {
        let mut state = pool.state();
        let (cancelled, rest): (Vec<Wait>, Vec<Wait>) =
            rest.into_iter().partition(|wait| wait.slot.is_cancelled());
        state.waits_finished(resolved + cancelled.len());
        let mut gone = Vec::new();
        let mut spawn = Spawn::Nothing;
        if state.shutdown {
            state.waits_finished(rest.len());
            gone = rest;
        } else {
            for wait in rest {
                let sequence = wait.waitable.sequence();
                if let (_, found @ (Spawn::LaneThread(_) | Spawn::Poller)) =
                    pool.insert(&mut state, key, sequence, wait)
                {
                    spawn = found;
                }
            }
        }
        drop(state);
        // Dropped (destroying their events) and woken outside the lock.
        drop(cancelled);
        for wait in gone {
            wait.slot.complete(Err(ServerError::WaiterGone));
        }
        Self::spawn(pool, spawn);
    }

    /// The future of the wait at `sequence` of lane `key` was dropped: take
    /// the wait out of its lane, if it is still there and still `slot`'s, and
    /// have a waiter thread drop it (destroying its event) soon. A wait a
    /// thread has taken out is not there; that thread drops it when done.
    pub(crate) fn withdraw(pool: &Arc<Self>, key: LaneKey, sequence: u64, slot: &Arc<Slot>) {
        let mut state = pool.state();
        let Some(lane) = state.lanes.get_mut(&key) else {
            return;
        };
        let wait = match lane.waits.entry(sequence) {
            Entry::Occupied(entry) if Arc::ptr_eq(&entry.get().slot, slot) => entry.remove(),
            _ => return,
        };
        state.waits_finished(1);
        state.withdrawn.push(wait);
        let spawn = pool.wake_or_spawn_disposer(&mut state);
        drop(state);
        Self::spawn(pool, spawn);
    }

    /// Withdrawn waits are there to drop: leave them to the poller if it
    /// runs, else wake an idle thread, else start the poller. Never a new
    /// lane thread: a burst of drops (a client hanging up on many requests)
    /// would find no thread idle each time and start one per drop, up to
    /// `max_threads`; there is only ever one poller, and it lingers a few
    /// milliseconds for more before it exits.
    fn wake_or_spawn_disposer(&self, state: &mut State) -> Spawn {
        if state.poller || self.wake_idle(state) {
            Spawn::Nothing
        } else {
            state.add_poller()
        }
    }

    /// A lane thread's block on `slot`'s wait ended with `result`. Unless
    /// shutdown has resolved it meanwhile, count it done and wake its future.
    fn resolve_blocked(&self, key: LaneKey, slot: &Arc<Slot>, result: Result<(), ServerError>) {
        let mut state = self.state();
        let ours = state
            .lanes
            .get_mut(&key)
            .and_then(|lane| {
                lane.blocked_on
                    .take_if(|blocked| Arc::ptr_eq(blocked, slot))
            })
            .is_some();
        if ours {
            state.waits_finished(1);
            drop(state);
            slot.complete(result);
        }
    }

    /// The poller: serve every lane no lane thread has, with queries and a
    /// bounded backoff, and drop withdrawn waits. With nothing to do it
    /// lingers a few backoff rounds (about 2.5 ms) before it exits, so a
    /// burst of dropped futures while every lane thread is busy does not
    /// start a thread per drop.
    fn run_poller(pool: Arc<Self>) {
        let mut backoff = POLL_BACKOFF_MIN;
        let mut idle_rounds = 0;
        let mut scratch = Vec::new();
        loop {
            let (keys, withdrawn) = {
                let mut state = pool.state();
                let withdrawn = std::mem::take(&mut state.withdrawn);
                let keys = state.adopt_queued_lanes();
                let idle = keys.is_empty() && withdrawn.is_empty();
                // `+ 1 >`, not `>=`: under loom the linger is 0 rounds.
                if idle && (idle_rounds + 1 > POLLER_LINGER_ROUNDS || state.shutdown) {
                    state.poller_left();
                    return;
                }
                idle_rounds = if idle { idle_rounds + 1 } else { 0 };
                (keys, withdrawn)
            };
            // Dropped here, outside the lock.
            let mut progressed = !withdrawn.is_empty();
            drop(withdrawn);
            for key in keys {
                progressed |=
                    Self::resolve_reached(&pool, key, Owner::Poller, &mut scratch).resolved > 0;
            }
            if progressed {
                backoff = POLL_BACKOFF_MIN;
            } else {
                crate::loom::sleep(backoff);
                backoff = (backoff * 2).min(POLL_BACKOFF_MAX);
            }
        }
    }

    /// Resolve every pending wait with [`ServerError::WaiterGone`] and let the
    /// threads exit. A wait a thread is blocked on resolves now too; the
    /// thread drops it (its event) when the block ends, then exits.
    pub(crate) fn shutdown(&self) {
        let mut state = self.state();
        state.shutdown = true;
        let mut gone = Vec::new();
        let mut blocked = Vec::new();
        // Withdrawn waits are dropped here, with the rest.
        let withdrawn = std::mem::take(&mut state.withdrawn);
        for lane in std::mem::take(&mut state.lanes).into_values() {
            gone.extend(lane.waits.into_values());
            blocked.extend(lane.blocked_on);
        }
        state.queued.clear();
        state.waits_finished(gone.len() + blocked.len());
        drop(state);
        drop(withdrawn);
        self.work.notify_all();
        let slots = gone.iter().map(|wait| &wait.slot).chain(&blocked);
        for slot in slots {
            slot.complete(Err(ServerError::WaiterGone));
        }
    }

    pub(crate) fn threads(&self) -> usize {
        let state = self.state();
        state.lane_threads + usize::from(state.poller)
    }

    pub(crate) fn peak_threads(&self) -> usize {
        self.state().peak_threads
    }

    pub(crate) fn pending(&self) -> usize {
        self.state().pending
    }
}

impl State {
    /// A wait was handed to the pool.
    fn wait_added(&mut self) {
        self.pending += 1;
    }

    /// `count` waits left the pool: resolved, withdrawn, or failed.
    fn waits_finished(&mut self, count: usize) {
        self.pending -= count;
    }

    /// A lane nobody serves waits for a thread (or the poller).
    fn queue_lane(&mut self, key: LaneKey) {
        if let Some(lane) = self.lanes.get_mut(&key) {
            lane.owner = Owner::Queued;
            self.queued.push_back(key);
        }
    }

    /// A lane thread is about to sleep, waiting for a lane.
    fn go_idle(&mut self) {
        self.idle += 1;
    }

    /// A lane thread woke (notified, spuriously, or timed out).
    fn woke(&mut self) {
        self.idle -= 1;
        self.notified = self.notified.saturating_sub(1);
    }

    /// A lane thread exits (idle past keep-alive, shut down), or never
    /// started.
    fn lane_thread_left(&mut self) {
        self.lane_threads -= 1;
    }

    /// The poller exits, or never started.
    fn poller_left(&mut self) {
        self.poller = false;
    }

    /// Count in a lane thread the caller is about to spawn.
    fn add_lane_thread(&mut self) -> Spawn {
        self.lane_threads += 1;
        self.next_thread += 1;
        self.note_threads();
        Spawn::LaneThread(self.next_thread)
    }

    /// Count in the poller the caller is about to spawn.
    fn add_poller(&mut self) -> Spawn {
        self.poller = true;
        self.note_threads();
        Spawn::Poller
    }

    fn note_threads(&mut self) {
        self.peak_threads = self
            .peak_threads
            .max(self.lane_threads + usize::from(self.poller));
    }

    /// A queued lane, or else one taken back from the poller.
    fn take_lane_for_thread(&mut self) -> Option<LaneKey> {
        while let Some(key) = self.queued.pop_front() {
            if let Some(lane) = self.lanes.get_mut(&key) {
                lane.owner = Owner::Thread;
                return Some(key);
            }
        }
        let (key, lane) = self
            .lanes
            .iter_mut()
            .find(|(_, lane)| lane.owner == Owner::Poller)?;
        lane.owner = Owner::Thread;
        Some(*key)
    }

    /// Give the poller every queued lane; return all lanes it serves.
    fn adopt_queued_lanes(&mut self) -> Vec<LaneKey> {
        while let Some(key) = self.queued.pop_front() {
            if let Some(lane) = self.lanes.get_mut(&key) {
                lane.owner = Owner::Poller;
            }
        }
        self.lanes
            .iter()
            .filter(|(_, lane)| lane.owner == Owner::Poller)
            .map(|(key, _)| *key)
            .collect()
    }

    /// Remove the waits of every queued lane (no thread will serve them).
    fn take_queued_waits(&mut self) -> Vec<Wait> {
        let mut waits = Vec::new();
        while let Some(key) = self.queued.pop_front() {
            if let Some(lane) = self.lanes.remove(&key) {
                waits.extend(lane.waits.into_values());
            }
        }
        self.waits_finished(waits.len());
        waits
    }
}

/// How many of `batch`'s waits, from the oldest, a query shows reached (or
/// failed), stopping at the first not reached; and the failures among them,
/// by index. Failures are rare, so the common burst allocates nothing here.
fn reached_prefix(batch: &[Wait]) -> (usize, Vec<(usize, ServerError)>) {
    let mut failed = Vec::new();
    for (index, wait) in batch.iter().enumerate() {
        match contain(|| wait.waitable.query()) {
            Ok(true) => {}
            Ok(false) => return (index, failed),
            Err(err) => failed.push((index, err)),
        }
    }
    (batch.len(), failed)
}

/// Run a backend call, turning a panic into an error: the pool keeps serving.
fn contain<T>(call: impl FnOnce() -> Result<T, ServerError>) -> Result<T, ServerError> {
    catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|payload| {
        Err(ServerError::WaiterPanicked {
            message: ServerError::panic_message(payload.as_ref()),
        })
    })
}
