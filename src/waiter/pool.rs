//! [`Pool`]: the waiter's threads, its lanes, and how waits move between
//! them: the lane algorithm described in the [waiter's docs](super), here
//! in code.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::contain;
use super::permits::Permits;
use super::slot::Slot;
use super::waitable::{LaneKey, Waitable};
use crate::loom::{thread, Arc, AtomicUsize, Condvar, Mutex, MutexGuard};
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
///
/// # Locks
///
/// Work on different streams must not contend, so the state is split:
///
/// - **Shards** ([`SHARDS`] of them, a lane's shard picked by its key): each
///   lane's waits, owner, and the wait its thread is blocked on. Handing a
///   wait to a lane that is already served, resolving waits, and withdrawing
///   one take only their lane's shard.
/// - **The scheduler** ([`Sched`]): lanes waiting for a server, the threads,
///   idle threads' wake-ups, withdrawn waits to drop. Taken only when a lane
///   starts (it needs a server) or ends (its server looks for the next), and
///   on cancellation.
///
/// Lock order: a shard, then the scheduler; never two shards at once, and
/// no shard while holding the scheduler. A wait's [`Slot`] lock comes last
/// of all, and nothing is locked while it is held.
///
/// # Code it calls but does not own
///
/// A backend's query and block, a task's waker, a wait's drop (its fence's
/// event release): each goes through [`contain`], so a panic there costs only
/// the wait it concerns, and no lock is held across any of them. A waiter
/// thread that still unwinds (a bug in this file) gives back what it holds
/// through its [`ServerGuard`]: no count outlives the thread it counts, and
/// no wait is left pending.
pub(crate) struct Pool {
    pub(crate) config: Config,
    shards: Vec<Mutex<Shard>>,
    /// Lanes in all shards, changed under their shard's lock. Read under the
    /// scheduler's to decide whether a queued lane needs a new thread (see
    /// [`Pool::queue_lane`]); it is touched only when a lane starts or ends,
    /// never per wait of a busy lane.
    lanes: AtomicUsize,
    sched: Mutex<Sched>,
    /// Idle lane threads wait here (with the scheduler's lock) for a lane.
    work: Condvar,
    /// Lane threads querying their batches, at most one per core.
    resolving: Permits,
    /// The process generation this pool was made in ([`crate::fork`]). In a
    /// forked child its threads are gone (only the forking thread is
    /// copied), so it refuses waits there rather than queue them for
    /// threads that do not exist.
    fork_generation: u64,
    /// Faults a test plants: spawns refused, panics where no call is
    /// contained.
    #[cfg(test)]
    pub(crate) plants: Plants,
}

/// How many shards the lanes are spread over: a power of two. Two under
/// loom, whose models use lanes 0 and 1, one in each.
const SHARDS: usize = if cfg!(device_events_loom) { 2 } else { 16 };

/// One shard's lanes. Invariants, each kept under the shard's lock:
///
/// - **pending**: `pending` counts this shard's waits handed to the pool
///   and not yet resolved, withdrawn or failed: those in lanes, plus those a
///   thread has taken out to block on or to query. [`Shard::wait_added`]
///   adds one, [`Shard::waits_finished`] takes finished ones off;
///   [`Pool::pending`] sums the shards.
/// - **lanes**: a lane is created by the wait that finds none
///   ([`Pool::insert`]) and queued for a server in the same critical section
///   ([`Pool::queue_lane`]: a lane is never made and left unqueued), and
///   removed only by its server when it is empty ([`Pool::next_lane`],
///   [`Pool::take_waits`]) or by shutdown. `Pool::lanes` follows every
///   creation ([`Pool::lane_created`]) and removal ([`Pool::remove_lane`],
///   [`Pool::remove_all_lanes`], the only ways a lane leaves its shard).
/// - **shut**: set by shutdown when it drains the shard; no wait enters after.
#[derive(Default)]
struct Shard {
    /// Ordered, so iteration (and a loom model) is deterministic.
    lanes: BTreeMap<LaneKey, Lane>,
    pending: usize,
    shut: bool,
}

/// Everything under the scheduler's lock. It changes only through the
/// transitions below, each a method that keeps these invariants:
///
/// - **queued**: `for_threads` and `for_poller` hold the keys of lanes whose
///   owner is [`Owner::Queued`] and that no server has taken out yet; a
///   thread or the poller takes a key out and then claims the lane in its
///   shard ([`Pool::claim`]). A lane a thread was started or woken for is in
///   `for_threads`, which the poller never takes from.
/// - **threads**: `lane_threads` and `poller` count the threads started (or
///   about to be), and nothing else: [`Sched::add_lane_thread`] /
///   [`Sched::lane_thread_left`], [`Sched::add_poller`] /
///   [`Sched::poller_left`], the last called by every way a thread ends,
///   unwinding included ([`ServerGuard`]). `idle` counts lane threads asleep
///   for work, `notified` the wake-ups sent to them and not yet taken
///   ([`Sched::go_idle`], [`Sched::woke`]).
/// - **shutdown**: set once, before the shards are drained; nothing is
///   queued or withdrawn here after it.
#[derive(Default)]
struct Sched {
    /// Lanes queued for a lane thread, oldest first: one was started or woken
    /// for each, or a lane thread serving no lane looks here before it sleeps
    /// or leaves (see [`Pool::queue_lane`]).
    for_threads: VecDeque<LaneKey>,
    /// Lanes queued for the poller (every lane thread allowed is busy),
    /// oldest first. A lane thread that runs out of work takes one from here
    /// before the poller does.
    for_poller: VecDeque<LaneKey>,
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

/// Who serves a lane. A lane is created `Queued`; a thread or the poller
/// claims it; it is never handed from one server to another except when a
/// lane thread takes one back from the poller, or a server unwinds and its
/// guard queues it again.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// Waiting for a server: its key is in one of `Sched`'s queues, or was
    /// just taken out by a thread or the poller on its way to claim it.
    /// Someone will serve it either way, so a wait that finds it adds
    /// nothing.
    #[default]
    Queued,
    /// Served by the lane thread with this number (each has its own, so a
    /// thread's guard never takes a lane another thread serves).
    Thread(usize),
    /// Served by the poller (there is at most one).
    Poller,
}

/// One pending wait: what to wait on, where its result goes, and where it
/// sits in its lane.
pub(crate) struct Wait {
    pub(crate) waitable: Box<dyn Waitable>,
    pub(crate) slot: Arc<Slot>,
    lane: LaneKey,
    /// Its key in its lane: its sequence, or the next free place after it
    /// when that was taken (two streams whose keys collide). A thread that
    /// takes it out and puts it back puts it here, where its future's
    /// withdraw looks for it.
    placed: u64,
}

impl Wait {
    /// A wait for `waitable` in lane `lane`, first placed at its sequence.
    pub(crate) fn new(waitable: Box<dyn Waitable>, slot: Arc<Slot>, lane: LaneKey) -> Self {
        let placed = waitable.sequence();
        Self {
            waitable,
            slot,
            lane,
            placed,
        }
    }
}

/// What [`Pool::resolve_reached`] did.
struct Resolved {
    /// How many waits it resolved.
    resolved: usize,
    /// Whether the lane still has waits (the first not reached, and after)
    /// and is still the caller's.
    more: bool,
}

/// What the scheduler decided, done by [`Pool::act`] once its lock is let
/// go.
enum Action {
    Nothing,
    /// Wake an idle lane thread (counted in `Sched::notified` already).
    WakeIdleThread,
    SpawnLaneThread(usize),
    SpawnPoller,
}

/// A batch of waits a server has taken out of a lane to query.
#[derive(Default)]
struct Batch {
    waits: Vec<Wait>,
    /// The lane they came from, while they are out.
    lane: Option<LaneKey>,
    /// Whether they still count as pending in their shard (until
    /// [`Pool::settle`] counts the reached ones finished and puts the rest
    /// back).
    pending: bool,
}

/// A waiter thread's hold on the pool: its place among the counted threads,
/// the lanes it serves and the batch it has out. Every lane thread and the
/// poller own one for their whole life.
///
/// **Invariant**: no count outlives the thread it counts. A thread that
/// leaves the normal way uncounts itself under the scheduler's lock and
/// clears `counted`; one that unwinds (a bug in this file: every call into
/// code the pool does not own is contained) has this guard do it on the way
/// out, after it has failed the batch it had out, failed the wait it was
/// blocked on, and queued its lanes for another server. No wait is lost.
struct ServerGuard {
    pool: Arc<Pool>,
    owner: Owner,
    /// The lanes this thread serves: at most one for a lane thread; the
    /// poller's list (a lane a thread took back, or that emptied, is
    /// forgotten when its round finds it no longer the poller's).
    lanes: Vec<LaneKey>,
    batch: Batch,
    /// Still counted among the pool's threads.
    counted: bool,
}

impl Pool {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            resolving: Permits::new(config.resolvers),
            config,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            lanes: AtomicUsize::new(0),
            sched: Mutex::new(Sched::default()),
            work: Condvar::new(),
            fork_generation: crate::fork::generation(),
            #[cfg(test)]
            plants: Plants::new(),
        }
    }

    fn shard(&self, key: LaneKey) -> MutexGuard<'_, Shard> {
        self.shards[key.shard(SHARDS)].lock()
    }

    fn sched(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock()
    }

    /// Whether this is a forked child of the process that made the pool:
    /// its threads, and whoever held its locks at the fork, are not here.
    pub(crate) fn is_forked(&self) -> bool {
        self.fork_generation != crate::fork::current()
    }

    /// The process generation the pool was made in.
    pub(crate) fn generation(&self) -> u64 {
        self.fork_generation
    }

    /// Hand a wait to the pool. Returns its lane and the place it went:
    /// where it sits, for [`Pool::withdraw`]. A wait for a lane already
    /// served takes its shard's lock and nothing else.
    ///
    /// # Errors
    ///
    /// [`ServerError::WaiterGone`] after [`Pool::shutdown`];
    /// [`ServerError::WaiterForked`] in a forked child. The wait is dropped.
    pub(crate) fn submit(pool: &Arc<Self>, wait: Wait) -> Result<(LaneKey, u64), ServerError> {
        if pool.is_forked() {
            return Err(ServerError::WaiterForked);
        }
        if let Some(invalid) = pool.config.invalid() {
            return Err(invalid);
        }
        let key = wait.lane;
        let mut shard = pool.shard(key);
        if shard.shut && !crate::plant::planted("submit-enters-drained-shard") {
            drop(shard);
            drop(wait);
            return Err(ServerError::WaiterGone);
        }
        shard.wait_added();
        let (placed, new_lane) = pool.insert(&mut shard, wait);
        let action = if new_lane {
            pool.queue_lane(key)
        } else {
            Action::Nothing
        };
        drop(shard);
        Self::act(pool, action);
        Ok((key, placed))
    }

    /// Put `wait` in its lane at its place or, if that is taken, the next
    /// free one (sequences are unique per stream, but two streams may share
    /// a lane whose keys collide: no wait may overwrite another). A wait
    /// that had to move is told so in its slot, where its withdraw looks.
    /// Returns where it went, and whether it made a new lane, which the
    /// caller must [queue](Self::queue_lane) before it lets go of the shard.
    fn insert(&self, shard: &mut Shard, mut wait: Wait) -> (u64, bool) {
        let mut new_lane = false;
        let lane = shard.lanes.entry(wait.lane).or_insert_with(|| {
            new_lane = true;
            self.lane_created();
            Lane::default()
        });
        let mut place = wait.placed;
        if crate::plant::planted("wait-put-back-at-its-sequence") {
            place = wait.waitable.sequence();
        }
        while lane.waits.contains_key(&place) {
            place = place.wrapping_add(1);
        }
        if crate::plant::planted("wait-put-back-at-its-sequence") {
            wait.placed = place;
        } else if place != wait.placed {
            wait.placed = place;
            wait.slot.moved_to(place);
        }
        lane.waits.insert(place, wait);
        (place, new_lane)
    }

    /// A new lane needs a server: queue it and decide who serves it, under
    /// its shard's lock (taken by the caller; the scheduler's comes second),
    /// so no lane is ever made and not queued. After shutdown it is left
    /// alone: shutdown drains its shard.
    ///
    /// **The scheduler's invariant**, kept here: when it decides to do
    /// nothing, live servers cover every queued and polled lane. A lane
    /// queued for the poller has the poller running (it adopts the lane on
    /// its next round). A lane queued for threads has a thread coming: one
    /// woken or started for it, or, when there are at least as many lane
    /// threads as lanes, one serving no lane (each thread serves at most
    /// one, and this lane has none), which looks at `for_threads` under
    /// this lock before it sleeps or leaves. This keeps threads at one per
    /// busy stream even when lanes drain and refill faster than threads
    /// wake.
    fn queue_lane(&self, key: LaneKey) -> Action {
        let mut sched = self.sched();
        let action = self.place_queued(&mut sched, key);
        sched.check_invariants();
        action
    }

    /// Queue `key`'s lane in `sched` and decide who serves it: the one place
    /// the scheduler's invariant (see [`Pool::queue_lane`]) is kept.
    fn place_queued(&self, sched: &mut Sched, key: LaneKey) -> Action {
        if sched.shutdown {
            return Action::Nothing;
        }
        if sched.wake_idle() {
            sched.for_threads.push_back(key);
            Action::WakeIdleThread
        } else if sched.lane_threads >= self.lanes.load(Ordering::SeqCst) {
            sched.for_threads.push_back(key);
            Action::Nothing
        } else if sched.lane_threads < self.config.max_threads {
            sched.for_threads.push_back(key);
            sched.add_lane_thread()
        } else {
            sched.for_poller.push_back(key);
            if sched.poller {
                Action::Nothing
            } else {
                sched.add_poller()
            }
        }
    }

    /// Act on what the scheduler decided, once its lock is let go: a woken
    /// thread then finds the lock free, rather than wake only to wait for
    /// it.
    fn act(pool: &Arc<Self>, action: Action) {
        let (name, owner) = match action {
            Action::Nothing => return,
            Action::WakeIdleThread => {
                if !crate::plant::planted("idle-thread-wake-never-sent") {
                    pool.work.notify_one();
                }
                return;
            }
            Action::SpawnLaneThread(index) => (
                format!("{}-{index}", pool.config.thread_name),
                Owner::Thread(index),
            ),
            Action::SpawnPoller => (format!("{}-poller", pool.config.thread_name), Owner::Poller),
        };
        let worker = pool.clone();
        let spawned = match pool.refused_spawn() {
            Some(refused) => Err(refused),
            // A spawn that panics (std does, for a name it cannot pass to
            // the OS) is a failed spawn like any other, never a panic in
            // `poll`.
            None => catch_unwind(AssertUnwindSafe(|| {
                thread::Builder::new()
                    .name(name)
                    .spawn(move || Self::run_server(worker, owner))
            }))
            .unwrap_or_else(|payload| {
                Err(std::io::Error::other(ServerError::panic_message(
                    payload.as_ref(),
                )))
            }),
        };
        if let Err(err) = spawned {
            Self::spawn_failed(pool, owner, &err);
        }
    }

    /// Undo the counters of a thread that could not start, and keep serving
    /// with the threads that exist: the lanes queued for lane threads go to
    /// the poller (which a free lane thread takes them from first), started
    /// if it is not running. Lanes left for a poller that could not start
    /// are failed, rather than left to a lane thread that may never run out
    /// of work.
    fn spawn_failed(pool: &Arc<Self>, owner: Owner, err: &std::io::Error) {
        contain::log(|| log::error!("a waiter thread could not be started: {err}"));
        let mut sched = pool.sched();
        if owner == Owner::Poller {
            sched.poller_left();
        } else {
            sched.lane_thread_left();
            let lanes = std::mem::take(&mut sched.for_threads);
            if crate::plant::planted("refused-lane-left-for-threads") {
                sched.for_threads.extend(lanes);
            } else {
                sched.for_poller.extend(lanes);
            }
            if !sched.poller && !sched.shutdown {
                let action = sched.add_poller();
                drop(sched);
                return Self::act(pool, action);
            }
        }
        if sched.poller {
            sched.check_invariants();
            return;
        }
        // Lanes queued for threads have one coming (with no lane thread at
        // all there are none: the invariant), so only the poller's are
        // failed.
        let keys: Vec<LaneKey> = sched.for_poller.drain(..).collect();
        // No poller will drop them: dropped here, as the last resort.
        let withdrawn = std::mem::take(&mut sched.withdrawn);
        sched.check_invariants();
        drop(sched);
        withdrawn.into_iter().for_each(contain::drop);
        let reason = format!("no waiter thread could be started to serve it: {err}");
        for key in keys {
            for wait in pool.remove_queued_lane(key) {
                wait.slot.complete(Err(ServerError::ThreadSpawn {
                    component: "Waiter",
                    reason: reason.clone(),
                    source: None,
                }));
                contain::drop(wait);
            }
        }
    }

    /// Remove a lane taken out of a queue that no thread will serve, and
    /// return its waits (counted finished).
    fn remove_queued_lane(&self, key: LaneKey) -> Vec<Wait> {
        let mut shard = self.shard(key);
        if shard
            .lanes
            .get(&key)
            .is_none_or(|lane| lane.owner != Owner::Queued)
        {
            return Vec::new();
        }
        let waits: Vec<Wait> = self
            .remove_lane(&mut shard, key)
            .map(|lane| lane.waits.into_values().collect())
            .unwrap_or_default();
        shard.waits_finished(waits.len());
        waits
    }

    /// A thread or the poller took `key` out of a queue: make the lane
    /// `owner`'s. False if it is gone (shutdown drained it).
    fn claim(&self, key: LaneKey, owner: Owner) -> bool {
        let mut shard = self.shard(key);
        match shard.lanes.get_mut(&key) {
            Some(lane) if lane.owner == Owner::Queued => {
                lane.owner = owner;
                true
            }
            _ => false,
        }
    }

    /// A lane the poller serves, made this lane thread's (`owner`), if there
    /// is one. Looks through every shard: only while the poller runs, when a
    /// thread runs out of lanes.
    fn take_back_from_poller(&self, owner: Owner) -> Option<LaneKey> {
        self.shards.iter().find_map(|shard| {
            let mut shard = shard.lock();
            let (key, lane) = shard
                .lanes
                .iter_mut()
                .find(|(_, lane)| lane.owner == Owner::Poller)?;
            lane.owner = owner;
            Some(*key)
        })
    }

    /// The body of every waiter thread.
    fn run_server(pool: Arc<Self>, owner: Owner) {
        crate::own_threads::enter();
        let guard = ServerGuard::new(pool, owner);
        match owner {
            Owner::Poller => Self::run_poller(guard),
            _ => Self::run_lane_thread(guard),
        }
    }

    /// A lane thread: take a lane, serve it until empty, take the next.
    fn run_lane_thread(mut guard: ServerGuard) {
        let owner = guard.owner;
        let mut finished = None;
        loop {
            let next = guard.pool.next_lane(owner, finished.take());
            guard.lanes.clear();
            let Some(key) = next else {
                // Uncounted by `next_lane`, under the scheduler's lock.
                guard.counted = false;
                return;
            };
            guard.lanes.push(key);
            while Self::serve_lane_once(&guard.pool, key, owner, &mut guard.batch) {}
            finished = Some(key);
        }
    }

    /// The next lane for lane thread `owner` that just `finished` one (or
    /// none), or `None` when it should exit (idle past keep-alive, or shut
    /// down); it is then no longer counted.
    ///
    /// The finished lane is released (removed, if still empty) under its
    /// shard's lock; then the thread looks for the next under the
    /// scheduler's, and goes idle under that same lock if there is none. A
    /// wait submitted meanwhile for the released lane makes a new lane and
    /// queues it under the scheduler's lock: either before this thread looks
    /// (which finds it), or after it went idle (and the queuing wakes it).
    /// While this thread is between lanes it counts among the lane threads,
    /// so the queuing starts no other. So a stream whose lane empties and
    /// refills does not make the pool start another thread.
    fn next_lane(&self, owner: Owner, finished: Option<LaneKey>) -> Option<LaneKey> {
        if let Some(key) = finished {
            let mut shard = self.shard(key);
            match shard.lanes.get(&key) {
                Some(lane) if lane.owner == owner && !lane.waits.is_empty() => return Some(key),
                Some(lane) if lane.owner == owner => {
                    self.remove_lane(&mut shard, key);
                }
                _ => {}
            }
        }
        let mut timed_out = false;
        // Whether this thread has looked for a lane to take back from the
        // poller since it last slept: once per wake-up is enough, as the
        // poller wakes an idle thread each round it has lanes.
        let mut looked_at_poller = false;
        let mut sched = self.sched();
        loop {
            if !sched.withdrawn.is_empty() {
                // Dropped outside the lock; then look again, as new work may
                // have come meanwhile.
                let withdrawn = std::mem::take(&mut sched.withdrawn);
                drop(sched);
                withdrawn.into_iter().for_each(contain::drop);
                sched = self.sched();
                continue;
            }
            // A lane queued for threads first, then one queued for the
            // poller and not adopted yet: better blocked on than polled.
            let queued = sched.for_threads.pop_front();
            if let Some(key) = queued.or_else(|| sched.for_poller.pop_front()) {
                drop(sched);
                if self.claim(key, owner) {
                    return Some(key);
                }
                sched = self.sched();
                continue;
            }
            if sched.poller && !looked_at_poller && !sched.shutdown {
                looked_at_poller = true;
                drop(sched);
                if let Some(key) = self.take_back_from_poller(owner) {
                    return Some(key);
                }
                sched = self.sched();
                continue;
            }
            if sched.shutdown || timed_out {
                sched.check_invariants();
                sched.lane_thread_left();
                return None;
            }
            sched.go_idle();
            let (guard, timeout) = self.work.wait_timeout(sched, self.config.keep_alive);
            sched = guard;
            sched.woke();
            timed_out = timeout;
            if timed_out && crate::plant::planted("idle-thread-leaves-without-looking") {
                sched.lane_thread_left();
                return None;
            }
            looked_at_poller = false;
        }
    }

    /// Block on the oldest wait of `key`, then resolve every later one
    /// already reached. Returns whether the lane still has waits (and is
    /// still this thread's).
    fn serve_lane_once(pool: &Arc<Self>, key: LaneKey, owner: Owner, batch: &mut Batch) -> bool {
        let Some(wait) = pool.pop_oldest(key, owner) else {
            return false;
        };
        pool.planted_escape();
        let result = contain::backend(|| wait.waitable.block());
        pool.resolve_blocked(key, &wait.slot, result);
        // Its future is woken first; then its fence (its event) goes.
        contain::drop(wait);
        Self::resolve_reached(pool, key, owner, batch).more
    }

    /// Resolve, in order, the waits of `key` that a query shows reached; stop
    /// at the first that is not.
    ///
    /// Works in batches: the lane's waits are taken in one lock, queried
    /// outside it, and the rest put back in one more, so a burst of thousands
    /// of reached waits costs two lock round-trips, not three per wait. A
    /// lane thread queries with a resolve permit (at most one per core at
    /// once: see [`Permits`]); the wakes come after, with no permit held, as
    /// a waker may run its task inline, and that task may block. Each
    /// batch's futures are all woken before any of its waits (and their
    /// events) is dropped, so the tasks run while this thread cleans up; the
    /// batch lives in the thread's own buffer, so a burst allocates nothing
    /// per batch.
    fn resolve_reached(
        pool: &Arc<Self>,
        key: LaneKey,
        owner: Owner,
        batch: &mut Batch,
    ) -> Resolved {
        let mut resolved = 0;
        // The poller asks each of its lanes every round, mostly to hear "not
        // yet": it takes just the oldest wait first, and a batch only once
        // that one is reached. A lane thread has just seen its oldest reached.
        let mut limit = if owner == Owner::Poller { 1 } else { BATCH };
        loop {
            if !pool.take_waits(key, owner, limit, &mut batch.waits) {
                return Resolved {
                    resolved,
                    more: false,
                };
            }
            batch.lane = Some(key);
            batch.pending = true;
            pool.planted_escape();
            let (reached, failed) = {
                // The poller is one thread, and takes no permit.
                let _permit = (owner != Owner::Poller).then(|| pool.resolving.acquire());
                reached_prefix(&batch.waits)
            };
            let rest = batch.waits.split_off(reached);
            let more = !rest.is_empty();
            resolved += reached;
            limit = BATCH;
            let action = Self::settle(pool, key, rest, reached);
            batch.pending = false;
            Self::act(pool, action);
            // Woken outside the lock, oldest first; then each wait (and its
            // event) is dropped here, on this thread.
            let mut failed = failed.into_iter().peekable();
            for (index, wait) in batch.waits.iter().enumerate() {
                match failed.next_if(|(at, _)| *at == index) {
                    Some((_, err)) => wait.slot.complete(Err(err)),
                    None => wait.slot.complete(Ok(())),
                }
            }
            batch.waits.drain(..).for_each(contain::drop);
            batch.lane = None;
            if more {
                return Resolved {
                    resolved,
                    more: true,
                };
            }
        }
    }

    /// Lane thread `owner`, serving `key`, takes its oldest wait to block on
    /// (and notes it in `blocked_on`). `None` when the lane is empty or no
    /// longer this thread's; a lane thread releases its emptied lane in
    /// `next_lane`.
    fn pop_oldest(&self, key: LaneKey, owner: Owner) -> Option<Wait> {
        let mut shard = self.shard(key);
        let lane = shard
            .lanes
            .get_mut(&key)
            .filter(|lane| lane.owner == owner)?;
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
        let mut shard = self.shard(key);
        let Some(lane) = shard.lanes.get_mut(&key).filter(|lane| lane.owner == owner) else {
            return false;
        };
        if lane.waits.is_empty() {
            if owner == Owner::Poller {
                self.remove_lane(&mut shard, key);
            }
            return false;
        }
        // One at a time from the front, not `split_off`: that allocates a
        // new tree for the rest on every batch, in the middle of a burst.
        debug_assert!(batch.is_empty(), "the caller's buffer is cleared");
        while batch.len() < limit {
            let Some((_, wait)) = lane.waits.pop_first() else {
                break;
            };
            batch.push(wait);
        }
        true
    }

    /// Return waits not reached yet to their lane, each at the place it was
    /// taken from, and count `resolved` ones as done, in one lock. If the
    /// lane was emptied and removed meanwhile (a thread took it over from
    /// the poller and found it empty), it is made and queued afresh, so
    /// someone serves it: the caller acts on the returned decision once it
    /// has noted the batch settled.
    ///
    /// A wait whose future was dropped while it was out of its lane (so
    /// `withdraw` did not find it) is dropped here instead of put back. This
    /// is the only way a cancelled wait could enter a lane: the future's drop
    /// marks the slot cancelled before it takes the shard lock to withdraw,
    /// so under this lock a wait is either seen cancelled or withdrawn later
    /// (at its place, which is where it goes back).
    fn settle(pool: &Arc<Self>, key: LaneKey, rest: Vec<Wait>, resolved: usize) -> Action {
        let mut shard = pool.shard(key);
        let (cancelled, rest): (Vec<Wait>, Vec<Wait>) =
            rest.into_iter().partition(|wait| wait.slot.is_cancelled());
        if crate::plant::planted("settle-miscounts-cancelled") {
            shard.waits_finished(resolved - cancelled.len());
        } else {
            shard.waits_finished(resolved + cancelled.len());
        }
        let mut gone = Vec::new();
        let mut action = Action::Nothing;
        if shard.shut {
            shard.waits_finished(rest.len());
            gone = rest;
        } else {
            let mut new_lane = false;
            for wait in rest {
                new_lane |= pool.insert(&mut shard, wait).1;
            }
            if new_lane && !crate::plant::planted("lane-made-in-settle-not-queued") {
                action = pool.queue_lane(key);
            }
        }
        drop(shard);
        // Dropped (destroying their events) and woken outside the lock.
        cancelled.into_iter().for_each(contain::drop);
        for wait in gone {
            wait.slot.complete(Err(ServerError::WaiterGone));
            contain::drop(wait);
        }
        action
    }

    /// The future of the wait placed at `placed` in lane `key` was dropped:
    /// take the wait out of its lane, if it is still there, and have a
    /// waiter thread drop it (destroying its event) soon. A wait a thread has
    /// taken out is not there; that thread drops it when done. In a forked
    /// child nothing is touched: the parent's threads may have held these
    /// locks at the fork.
    pub(crate) fn withdraw(pool: &Arc<Self>, key: LaneKey, placed: u64, slot: &Arc<Slot>) {
        if pool.is_forked() {
            return;
        }
        let mut shard = pool.shard(key);
        let place = slot.place(placed);
        let Some(lane) = shard.lanes.get_mut(&key) else {
            return;
        };
        let wait = match lane.waits.entry(place) {
            Entry::Occupied(entry) if Arc::ptr_eq(&entry.get().slot, slot) => entry.remove(),
            _ => return,
        };
        shard.waits_finished(1);
        drop(shard);
        let mut sched = pool.sched();
        if sched.shutdown {
            // No waiter thread is left to drop it: dropped here.
            drop(sched);
            contain::drop(wait);
            return;
        }
        sched.withdrawn.push(wait);
        let action = sched.wake_or_spawn_disposer();
        drop(sched);
        Self::act(pool, action);
    }

    /// A lane thread's block on `slot`'s wait ended with `result`. Unless
    /// shutdown has resolved it meanwhile, count it done and wake its future.
    fn resolve_blocked(&self, key: LaneKey, slot: &Arc<Slot>, result: Result<(), ServerError>) {
        let mut shard = self.shard(key);
        let ours = shard
            .lanes
            .get_mut(&key)
            .and_then(|lane| {
                lane.blocked_on
                    .take_if(|blocked| Arc::ptr_eq(blocked, slot))
            })
            .is_some();
        if ours {
            shard.waits_finished(1);
            drop(shard);
            slot.complete(result);
        }
    }

    /// The poller: serve every lane queued for it, with queries and a
    /// bounded backoff, and drop withdrawn waits. With nothing to do it
    /// lingers a few backoff rounds (about 2.5 ms) before it exits, so a
    /// burst of dropped futures while every lane thread is busy does not
    /// start a thread per drop. While it serves lanes and a lane thread is
    /// idle, it wakes that thread each round, which takes a lane back and
    /// blocks on it rather than have it polled.
    fn run_poller(mut guard: ServerGuard) {
        let mut backoff = POLL_BACKOFF_MIN;
        let mut idle_rounds = 0;
        loop {
            let (adopted, withdrawn, wake) = {
                let mut sched = guard.pool.sched();
                let withdrawn = std::mem::take(&mut sched.withdrawn);
                let adopted: Vec<LaneKey> = sched.for_poller.drain(..).collect();
                let idle = guard.lanes.is_empty() && adopted.is_empty() && withdrawn.is_empty();
                // `+ 1 >`, not `>=`: under loom the linger is 0 rounds.
                if idle && (idle_rounds + 1 > POLLER_LINGER_ROUNDS || sched.shutdown) {
                    sched.check_invariants();
                    sched.poller_left();
                    guard.counted = false;
                    return;
                }
                idle_rounds = if idle { idle_rounds + 1 } else { 0 };
                let wake = (!guard.lanes.is_empty() || !adopted.is_empty()) && sched.wake_idle();
                (adopted, withdrawn, wake)
            };
            if wake {
                guard.pool.work.notify_one();
            }
            // Claimed first, so that its guard knows them.
            for key in adopted {
                // A lane this poller still lists may have been taken back,
                // emptied, made afresh and queued again: listed once.
                if guard.pool.claim(key, Owner::Poller) && !guard.lanes.contains(&key) {
                    guard.lanes.push(key);
                }
            }
            // Dropped here, outside the lock.
            let mut progressed = !withdrawn.is_empty();
            withdrawn.into_iter().for_each(contain::drop);
            let ServerGuard {
                pool, lanes, batch, ..
            } = &mut guard;
            lanes.retain(|&key| {
                let round = Self::resolve_reached(pool, key, Owner::Poller, batch);
                progressed |= round.resolved > 0;
                round.more
            });
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
    ///
    /// The scheduler is shut first (nothing is queued or withdrawn there
    /// after), then each shard is drained and shut in turn: a submit that
    /// got into a shard before it was drained is drained with it, and one
    /// after finds it shut. In a forked child it does nothing: the pool's
    /// threads and waits are the parent's.
    pub(crate) fn shutdown(&self) {
        if self.is_forked() {
            return;
        }
        let withdrawn = {
            let mut sched = self.sched();
            sched.shutdown = true;
            sched.for_threads.clear();
            sched.for_poller.clear();
            std::mem::take(&mut sched.withdrawn)
        };
        self.work.notify_all();
        // Withdrawn waits are dropped here, with the rest.
        withdrawn.into_iter().for_each(contain::drop);
        let mut gone = Vec::new();
        let mut blocked = Vec::new();
        for shard in &self.shards {
            let mut shard = shard.lock();
            shard.shut = true;
            let before = gone.len() + blocked.len();
            for lane in self.remove_all_lanes(&mut shard) {
                gone.extend(lane.waits.into_values());
                blocked.extend(lane.blocked_on);
            }
            shard.waits_finished(gone.len() + blocked.len() - before);
        }
        let slots = gone.iter().map(|wait| &wait.slot).chain(&blocked);
        for slot in slots {
            slot.complete(Err(ServerError::WaiterGone));
        }
        gone.into_iter().for_each(contain::drop);
    }

    /// Threads alive now; none in a forked child (the parent's are not
    /// there).
    pub(crate) fn threads(&self) -> usize {
        if self.is_forked() {
            return 0;
        }
        let sched = self.sched();
        sched.lane_threads + usize::from(sched.poller)
    }

    /// The most threads alive at once; none in a forked child.
    pub(crate) fn peak_threads(&self) -> usize {
        if self.is_forked() {
            return 0;
        }
        self.sched().peak_threads
    }

    /// Waits handed to the pool and not finished, summed over the shards;
    /// none in a forked child.
    pub(crate) fn pending(&self) -> usize {
        if self.is_forked() {
            return 0;
        }
        self.shards.iter().map(|shard| shard.lock().pending).sum()
    }

    /// Give back what a server that unwound held (see [`ServerGuard`]): fail
    /// the batch it had out and the wait it was blocked on, uncount it, and
    /// queue its lanes for another server.
    fn recover(pool: &Arc<Self>, owner: Owner, lanes: &[LaneKey], batch: &mut Batch) {
        let failure = || ServerError::WaiterPanicked {
            message: "a waiter thread unwound while it held this wait".to_owned(),
        };
        if let Some(key) = batch.lane.take() {
            if batch.pending {
                pool.shard(key).waits_finished(batch.waits.len());
            }
            for wait in batch.waits.drain(..) {
                // A no-op for waits it had already resolved.
                wait.slot.complete(Err(failure()));
                contain::drop(wait);
            }
        }
        // Uncounted first, so that queuing its lanes does not count on it;
        // and the lanes queued for threads are placed again, as one of them
        // may have counted on this thread taking it.
        let actions: Vec<Action> = {
            let mut sched = pool.sched();
            match owner {
                Owner::Poller => sched.poller_left(),
                _ => sched.lane_thread_left(),
            }
            let queued = std::mem::take(&mut sched.for_threads);
            queued
                .into_iter()
                .map(|key| pool.place_queued(&mut sched, key))
                .collect()
        };
        for action in actions {
            Self::act(pool, action);
        }
        let mut blocked = Vec::new();
        for &key in lanes {
            let mut shard = pool.shard(key);
            let Some(lane) = shard.lanes.get_mut(&key).filter(|lane| lane.owner == owner) else {
                continue;
            };
            let slot = lane.blocked_on.take();
            let empty = lane.waits.is_empty();
            lane.owner = Owner::Queued;
            if slot.is_some() {
                shard.waits_finished(1);
            }
            blocked.extend(slot);
            let action = if empty {
                pool.remove_lane(&mut shard, key);
                Action::Nothing
            } else {
                pool.queue_lane(key)
            };
            drop(shard);
            Self::act(pool, action);
        }
        for slot in blocked {
            slot.complete(Err(failure()));
        }
    }

    /// A spawn a test refused, if it planted one.
    fn refused_spawn(&self) -> Option<std::io::Error> {
        #[cfg(test)]
        if Plants::take(&self.plants.refused_spawns) {
            return Some(std::io::Error::other("a spawn refused by a test"));
        }
        None
    }

    /// Panic here if a test planted one: a point where a thread holds waits
    /// out of their lane and no call is contained, so only its guard can
    /// give them back.
    fn planted_escape(&self) {
        #[cfg(test)]
        if Plants::take(&self.plants.escapes) {
            panic!("a panic planted by a test, outside any contained call");
        }
    }
}

impl Pool {
    /// A lane was made in a shard (under its lock).
    fn lane_created(&self) {
        self.lanes.fetch_add(1, Ordering::SeqCst);
    }

    /// Remove `key`'s lane from `shard` (its lock held), keeping the count
    /// of lanes.
    fn remove_lane(&self, shard: &mut Shard, key: LaneKey) -> Option<Lane> {
        let lane = shard.lanes.remove(&key)?;
        let before = self.lanes.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "the count of lanes underflowed");
        Some(lane)
    }

    /// Remove every lane of `shard` (its lock held; shutdown), keeping the
    /// count of lanes.
    fn remove_all_lanes(&self, shard: &mut Shard) -> impl Iterator<Item = Lane> {
        let lanes = std::mem::take(&mut shard.lanes);
        let before = self.lanes.fetch_sub(lanes.len(), Ordering::SeqCst);
        assert!(before >= lanes.len(), "the count of lanes underflowed");
        lanes.into_values()
    }
}

impl ServerGuard {
    fn new(pool: Arc<Pool>, owner: Owner) -> Self {
        Self {
            pool,
            owner,
            lanes: Vec::new(),
            // Sized now, when the thread starts, not in the middle of a
            // burst: a large allocation makes the allocator consolidate every
            // small block freed before it, which measurably slowed the first
            // batch of each thread in a burst of 100,000 waits.
            batch: Batch {
                waits: Vec::with_capacity(BATCH),
                ..Batch::default()
            },
            counted: true,
        }
    }
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        contain::log(|| {
            log::error!(
                "waiter thread {:?} ({:?}) unwound (a bug in the waiter); its lanes and waits go \
                 back to the pool",
                std::thread::current().name().unwrap_or("?"),
                self.owner
            );
        });
        if !crate::plant::planted("unwinding-thread-not-given-back") {
            Pool::recover(&self.pool, self.owner, &self.lanes, &mut self.batch);
        }
    }
}

impl Shard {
    /// A wait was handed to this shard.
    fn wait_added(&mut self) {
        self.pending += 1;
    }

    /// `count` of this shard's waits left the pool: resolved, withdrawn, or
    /// failed.
    fn waits_finished(&mut self, count: usize) {
        assert!(
            count <= self.pending,
            "a shard's pending count underflowed ({count} finished of {})",
            self.pending
        );
        self.pending -= count;
    }
}

impl Sched {
    /// A lane thread is about to sleep, waiting for a lane.
    fn go_idle(&mut self) {
        self.idle += 1;
    }

    /// Count a wake-up for an idle lane thread not woken yet, if there is
    /// one; the caller then notifies `Pool::work` once it has let go of
    /// this lock. A thread that wakes on its own before the notification
    /// (a timeout) still looks at the queues under this lock, so the work
    /// it was woken for is found either way.
    fn wake_idle(&mut self) -> bool {
        if self.idle > self.notified {
            self.notified += 1;
            true
        } else {
            false
        }
    }

    /// A lane thread woke (notified, spuriously, or timed out). It takes a
    /// wake-up if one is outstanding, whether or not it was the one woken:
    /// a thread that timed out as a notification came takes that
    /// notification's work too, as it looks at the queues before it leaves.
    /// None may be outstanding (a timeout with none sent), so the count of
    /// wake-ups stops at zero; the idle count may not.
    fn woke(&mut self) {
        assert!(self.idle > 0, "a lane thread woke that was not idle");
        self.idle -= 1;
        self.notified = self.notified.saturating_sub(1);
    }

    /// A lane thread exits (idle past keep-alive, shut down, unwound), or
    /// never started.
    fn lane_thread_left(&mut self) {
        assert!(
            self.lane_threads > 0,
            "the count of lane threads underflowed"
        );
        self.lane_threads -= 1;
    }

    /// The poller exits (or unwound), or never started.
    fn poller_left(&mut self) {
        self.poller = false;
    }

    /// Count in a lane thread the caller is about to spawn.
    fn add_lane_thread(&mut self) -> Action {
        self.lane_threads += 1;
        self.next_thread += 1;
        self.note_threads();
        Action::SpawnLaneThread(self.next_thread)
    }

    /// Count in the poller the caller is about to spawn.
    fn add_poller(&mut self) -> Action {
        debug_assert!(!self.poller, "there is one poller at most");
        self.poller = true;
        self.note_threads();
        Action::SpawnPoller
    }

    /// Withdrawn waits are there to drop: leave them to the poller if it
    /// runs, else wake an idle thread, else start the poller. Never a new
    /// lane thread: a burst of drops (a client hanging up on many requests)
    /// would find no thread idle each time and start one per drop, up to
    /// `max_threads`; there is only ever one poller, and it lingers a few
    /// milliseconds for more before it exits.
    fn wake_or_spawn_disposer(&mut self) -> Action {
        if self.poller {
            Action::Nothing
        } else if self.wake_idle() {
            Action::WakeIdleThread
        } else {
            self.add_poller()
        }
    }

    fn note_threads(&mut self) {
        self.peak_threads = self
            .peak_threads
            .max(self.lane_threads + usize::from(self.poller));
    }

    /// The invariants above that one look can check, in debug and loom
    /// builds, where the lock is about to be let go.
    fn check_invariants(&self) {
        debug_assert!(
            self.notified <= self.idle,
            "more wake-ups than idle threads"
        );
        debug_assert!(
            self.idle <= self.lane_threads,
            "more idle threads than threads"
        );
        debug_assert!(
            self.for_threads.is_empty() || self.lane_threads > 0 || self.shutdown,
            "lanes queued for lane threads, and none to take them"
        );
        debug_assert!(
            self.for_poller.is_empty() || self.poller || self.lane_threads > 0 || self.shutdown,
            "lanes queued for the poller, and no server to take them"
        );
    }
}

/// Faults a test plants in one pool (never process-wide): the next
/// `escapes` times a thread holds waits out of their lane it panics there,
/// outside any contained call; the next `refused_spawns` spawns fail.
#[cfg(test)]
pub(crate) struct Plants {
    pub(crate) escapes: AtomicUsize,
    pub(crate) refused_spawns: AtomicUsize,
}

#[cfg(test)]
impl Plants {
    fn new() -> Self {
        Self {
            escapes: AtomicUsize::new(0),
            refused_spawns: AtomicUsize::new(0),
        }
    }

    /// Take one planted fault from `counter`, if any is left.
    fn take(counter: &AtomicUsize) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok()
    }
}

/// How many of `batch`'s waits, from the oldest, a query shows reached (or
/// failed), stopping at the first not reached; and the failures among them,
/// by index. Failures are rare, so the common burst allocates nothing here.
fn reached_prefix(batch: &[Wait]) -> (usize, Vec<(usize, ServerError)>) {
    let mut failed = Vec::new();
    for (index, wait) in batch.iter().enumerate() {
        match contain::backend(|| wait.waitable.query()) {
            Ok(true) => {}
            Ok(false) => return (index, failed),
            Err(err) => failed.push((index, err)),
        }
    }
    (batch.len(), failed)
}
