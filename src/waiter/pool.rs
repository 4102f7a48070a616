//! [`Pool`]: the waiter's threads, its lanes, and how waits move between
//! them: the lane algorithm described in the [waiter's docs](super), here
//! in code.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Duration;

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
/// no shard while holding the scheduler. So a lane moves between the two in
/// steps, its [`Owner`] saying where it is in between.
pub(crate) struct Pool {
    pub(crate) config: Config,
    shards: Vec<Mutex<Shard>>,
    /// Lanes in all shards, changed under their shard's lock. Read under the
    /// scheduler's to decide whether a queued lane needs a new thread (see
    /// [`Pool::wake_or_spawn_server`]); it is touched only when a lane
    /// starts or ends, never per wait of a busy lane.
    lanes: AtomicUsize,
    sched: Mutex<Sched>,
    /// Idle lane threads wait here (with the scheduler's lock) for a lane.
    work: Condvar,
    /// Lane threads resolving what they found reached, at most one per core.
    resolving: Permits,
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
/// - **lanes**: a lane is created by the wait that finds none ([`Pool::insert`]),
///   queued for a server by that same caller once it has let go of the shard
///   ([`Pool::queue_lane`]), and removed only by its server when it is empty
///   ([`Pool::next_lane`], [`Pool::take_waits`]) or by shutdown. `Pool::lanes`
///   follows every creation ([`Pool::lane_created`]) and removal
///   ([`Pool::remove_lane`], [`Pool::remove_all_lanes`], the only ways a
///   lane leaves its shard).
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
/// - **queued**: holds the keys of lanes whose owner is [`Owner::Queued`]
///   and that no thread has taken out yet; a thread or the poller takes a
///   key out here and then claims the lane in its shard ([`Pool::claim`]).
/// - **threads**: `lane_threads` and `poller` count the threads started (or
///   about to be): [`Sched::add_lane_thread`] / [`Sched::lane_thread_left`],
///   [`Sched::add_poller`] / [`Sched::poller_left`]. `idle` counts lane
///   threads asleep for work, `notified` the wake-ups sent to them and not
///   yet taken ([`Sched::go_idle`], [`Sched::woke`]).
/// - **shutdown**: set once, before the shards are drained; nothing is
///   queued or withdrawn here after it.
#[derive(Default)]
struct Sched {
    /// Lanes waiting for a thread (or the poller), oldest first.
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
/// lane thread takes one back from the poller.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// Waiting for a server: its key is in `Sched::queued`, or is about to
    /// be (its creator is on the way to the scheduler), or was just taken
    /// out by a thread or the poller on its way to claim it. Someone will
    /// serve it either way, so a wait that finds it adds nothing.
    #[default]
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

impl Pool {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            resolving: Permits::new(config.resolvers),
            config,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            lanes: AtomicUsize::new(0),
            sched: Mutex::new(Sched::default()),
            work: Condvar::new(),
        }
    }

    fn shard(&self, key: LaneKey) -> MutexGuard<'_, Shard> {
        self.shards[key.shard(SHARDS)].lock()
    }

    fn sched(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock()
    }

    /// Hand a wait to the pool. Returns its lane and sequence: where it
    /// sits, for [`Pool::withdraw`]. A wait for a lane already served takes
    /// its shard's lock and nothing else.
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
        let mut shard = pool.shard(key);
        if shard.shut {
            drop(shard);
            drop(wait);
            return Err(ServerError::WaiterGone);
        }
        shard.wait_added();
        let (sequence, new_lane) = pool.insert(&mut shard, key, sequence, wait);
        drop(shard);
        if new_lane {
            Self::queue_lane(pool, key);
        }
        Ok((key, sequence))
    }

    /// Put `wait` in its lane, at `sequence` or, if that place is taken, the
    /// next free one (sequences are unique per stream, but two streams may
    /// share a lane whose keys collide: no wait may overwrite another).
    /// Returns where it went, and whether it made a new lane, which the
    /// caller must then [queue](Self::queue_lane) once it has let go of the
    /// shard.
    fn insert(&self, shard: &mut Shard, key: LaneKey, sequence: u64, wait: Wait) -> (u64, bool) {
        let mut new_lane = false;
        let lane = shard.lanes.entry(key).or_insert_with(|| {
            new_lane = true;
            self.lane_created();
            Lane::default()
        });
        let mut sequence = sequence;
        while lane.waits.contains_key(&sequence) {
            sequence = sequence.wrapping_add(1);
        }
        lane.waits.insert(sequence, wait);
        (sequence, new_lane)
    }

    /// A new lane needs a server: queue it, and wake an idle thread or start
    /// one. After shutdown it is left alone: shutdown drains its shard.
    fn queue_lane(pool: &Arc<Self>, key: LaneKey) {
        let mut sched = pool.sched();
        if sched.shutdown {
            return;
        }
        sched.queued.push_back(key);
        let action = pool.wake_or_spawn_server(&mut sched);
        drop(sched);
        Self::act(pool, action);
    }

    /// A lane was queued: wake an idle thread, or decide what to spawn.
    ///
    /// A new lane thread starts only while there are fewer lane threads than
    /// lanes. Each thread serves at most one lane, so otherwise some thread
    /// is free: idle and already woken, or between lanes, and it takes the
    /// queued lane before it sleeps (it looks at `queued` under this lock).
    /// This keeps threads at one per busy stream even when lanes drain and
    /// refill faster than threads wake.
    fn wake_or_spawn_server(&self, sched: &mut Sched) -> Action {
        if sched.wake_idle() {
            Action::WakeIdleThread
        } else if sched.lane_threads >= self.lanes.load(Ordering::SeqCst) {
            Action::Nothing
        } else if sched.lane_threads < self.config.max_threads {
            sched.add_lane_thread()
        } else if !sched.poller {
            sched.add_poller()
        } else {
            Action::Nothing
        }
    }

    /// Act on what the scheduler decided, once its lock is let go: a woken
    /// thread then finds the lock free, rather than wake only to wait for
    /// it.
    fn act(pool: &Arc<Self>, action: Action) {
        let (name, run): (String, fn(Arc<Self>)) = match action {
            Action::Nothing => return,
            Action::WakeIdleThread => {
                pool.work.notify_one();
                return;
            }
            Action::SpawnLaneThread(index) => (
                format!("{}-{index}", pool.config.thread_name),
                Self::run_lane_thread,
            ),
            Action::SpawnPoller => (
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
            Self::spawn_failed(pool, matches!(action, Action::SpawnPoller), &err);
        }
    }

    /// Undo the counters of a thread that could not start, and keep serving
    /// with the threads that exist. With none at all, fail the queued waits
    /// rather than leave them pending forever.
    fn spawn_failed(pool: &Arc<Self>, poller: bool, err: &std::io::Error) {
        log::error!("a waiter thread could not be started: {err}");
        let mut sched = pool.sched();
        if poller {
            sched.poller_left();
        } else {
            sched.lane_thread_left();
            if !sched.poller {
                let action = sched.add_poller();
                drop(sched);
                return Self::act(pool, action);
            }
        }
        if sched.lane_threads > 0 || sched.poller {
            return;
        }
        let keys: Vec<LaneKey> = sched.queued.drain(..).collect();
        // No thread will drop them: dropped here, as the last resort.
        let withdrawn = std::mem::take(&mut sched.withdrawn);
        drop(sched);
        drop(withdrawn);
        let reason = format!("no waiter thread could be started: {err}");
        for key in keys {
            for wait in pool.remove_queued_lane(key) {
                wait.slot.complete(Err(ServerError::ThreadSpawn {
                    component: "Waiter",
                    reason: reason.clone(),
                }));
            }
        }
    }

    /// Remove a lane taken out of `queued` that no thread will serve, and
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

    /// A thread or the poller took `key` out of `queued`: make the lane
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

    /// A lane the poller serves, made this lane thread's, if there is one.
    /// Looks through every shard: only while the poller runs, when a thread
    /// runs out of lanes.
    fn take_back_from_poller(&self) -> Option<LaneKey> {
        self.shards.iter().find_map(|shard| {
            let mut shard = shard.lock();
            let (key, lane) = shard
                .lanes
                .iter_mut()
                .find(|(_, lane)| lane.owner == Owner::Poller)?;
            lane.owner = Owner::Thread;
            Some(*key)
        })
    }

    /// A lane thread: take a lane, serve it until empty, take the next.
    fn run_lane_thread(pool: Arc<Self>) {
        crate::own_threads::enter();
        let mut finished = None;
        // Sized now, when the thread starts, not in the middle of a burst:
        // a large allocation makes the allocator consolidate every small
        // block freed before it, which measurably slowed the first batch of
        // each thread in a burst of 100,000 waits.
        let mut scratch = Vec::with_capacity(BATCH);
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
    /// The finished lane is released (removed, if still empty) under its
    /// shard's lock; then the thread looks for the next under the
    /// scheduler's, and goes idle under that same lock if there is none. A
    /// wait submitted meanwhile for the released lane makes a new lane and
    /// queues it under the scheduler's lock: either before this thread looks
    /// (which finds it), or after it went idle (and the queuing wakes it).
    /// While this thread is between lanes it counts among the lane threads,
    /// so the queuing starts no other. So a stream whose lane empties and
    /// refills does not make the pool start another thread.
    fn next_lane(&self, finished: Option<LaneKey>) -> Option<LaneKey> {
        if let Some(key) = finished {
            let mut shard = self.shard(key);
            match shard.lanes.get(&key) {
                Some(lane) if lane.owner == Owner::Thread && !lane.waits.is_empty() => {
                    return Some(key)
                }
                Some(lane) if lane.owner == Owner::Thread => {
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
                drop(withdrawn);
                sched = self.sched();
                continue;
            }
            if let Some(key) = sched.queued.pop_front() {
                drop(sched);
                if self.claim(key, Owner::Thread) {
                    return Some(key);
                }
                sched = self.sched();
                continue;
            }
            if sched.poller && !looked_at_poller && !sched.shutdown {
                looked_at_poller = true;
                drop(sched);
                if let Some(key) = self.take_back_from_poller() {
                    return Some(key);
                }
                sched = self.sched();
                continue;
            }
            if sched.shutdown || timed_out {
                sched.lane_thread_left();
                return None;
            }
            sched.go_idle();
            let (guard, timeout) = self.work.wait_timeout(sched, self.config.keep_alive);
            sched = guard;
            sched.woke();
            timed_out = timeout;
            looked_at_poller = false;
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
        let mut shard = self.shard(key);
        let lane = shard
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

    /// Return waits not reached yet to their lane and count `resolved` ones
    /// as done, in one lock. If the lane was emptied and removed meanwhile (a
    /// thread took it over from the poller and found it empty), it is made
    /// and queued afresh, so someone serves it.
    ///
    /// A wait whose future was dropped while it was out of its lane (so
    /// `withdraw` did not find it) is dropped here instead of put back. This
    /// is the only way a cancelled wait could enter a lane: the future's drop
    /// marks the slot cancelled before it takes the shard lock to withdraw,
    /// so under this lock a wait is either seen cancelled or withdrawn later.
    fn settle(pool: &Arc<Self>, key: LaneKey, rest: Vec<Wait>, resolved: usize) {
        let mut shard = pool.shard(key);
        let (cancelled, rest): (Vec<Wait>, Vec<Wait>) =
            rest.into_iter().partition(|wait| wait.slot.is_cancelled());
        shard.waits_finished(resolved + cancelled.len());
        let mut gone = Vec::new();
        let mut new_lane = false;
        if shard.shut {
            shard.waits_finished(rest.len());
            gone = rest;
        } else {
            for wait in rest {
                let sequence = wait.waitable.sequence();
                new_lane |= pool.insert(&mut shard, key, sequence, wait).1;
            }
        }
        drop(shard);
        // Dropped (destroying their events) and woken outside the lock.
        drop(cancelled);
        for wait in gone {
            wait.slot.complete(Err(ServerError::WaiterGone));
        }
        if new_lane {
            Self::queue_lane(pool, key);
        }
    }

    /// The future of the wait at `sequence` of lane `key` was dropped: take
    /// the wait out of its lane, if it is still there and still `slot`'s, and
    /// have a waiter thread drop it (destroying its event) soon. A wait a
    /// thread has taken out is not there; that thread drops it when done.
    pub(crate) fn withdraw(pool: &Arc<Self>, key: LaneKey, sequence: u64, slot: &Arc<Slot>) {
        let mut shard = pool.shard(key);
        let Some(lane) = shard.lanes.get_mut(&key) else {
            return;
        };
        let wait = match lane.waits.entry(sequence) {
            Entry::Occupied(entry) if Arc::ptr_eq(&entry.get().slot, slot) => entry.remove(),
            _ => return,
        };
        shard.waits_finished(1);
        drop(shard);
        let mut sched = pool.sched();
        if sched.shutdown {
            // No waiter thread is left to drop it: dropped here.
            drop(sched);
            drop(wait);
            return;
        }
        sched.withdrawn.push(wait);
        let action = pool.wake_or_spawn_disposer(&mut sched);
        drop(sched);
        Self::act(pool, action);
    }

    /// Withdrawn waits are there to drop: leave them to the poller if it
    /// runs, else wake an idle thread, else start the poller. Never a new
    /// lane thread: a burst of drops (a client hanging up on many requests)
    /// would find no thread idle each time and start one per drop, up to
    /// `max_threads`; there is only ever one poller, and it lingers a few
    /// milliseconds for more before it exits.
    fn wake_or_spawn_disposer(&self, sched: &mut Sched) -> Action {
        if sched.poller {
            Action::Nothing
        } else if sched.wake_idle() {
            Action::WakeIdleThread
        } else {
            sched.add_poller()
        }
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

    /// The poller: serve every lane no lane thread has, with queries and a
    /// bounded backoff, and drop withdrawn waits. With nothing to do it
    /// lingers a few backoff rounds (about 2.5 ms) before it exits, so a
    /// burst of dropped futures while every lane thread is busy does not
    /// start a thread per drop. While it serves lanes and a lane thread is
    /// idle, it wakes that thread each round, which takes a lane back and
    /// blocks on it rather than have it polled.
    fn run_poller(pool: Arc<Self>) {
        crate::own_threads::enter();
        let mut backoff = POLL_BACKOFF_MIN;
        let mut idle_rounds = 0;
        let mut scratch = Vec::with_capacity(BATCH);
        // The lanes this poller serves; a lane a thread took back, or that
        // emptied, is forgotten when its round finds it no longer ours.
        let mut lanes: Vec<LaneKey> = Vec::new();
        loop {
            let (adopted, withdrawn, wake) = {
                let mut sched = pool.sched();
                let withdrawn = std::mem::take(&mut sched.withdrawn);
                let adopted: Vec<LaneKey> = sched.queued.drain(..).collect();
                let idle = lanes.is_empty() && adopted.is_empty() && withdrawn.is_empty();
                // `+ 1 >`, not `>=`: under loom the linger is 0 rounds.
                if idle && (idle_rounds + 1 > POLLER_LINGER_ROUNDS || sched.shutdown) {
                    sched.poller_left();
                    return;
                }
                idle_rounds = if idle { idle_rounds + 1 } else { 0 };
                let wake = (!lanes.is_empty() || !adopted.is_empty()) && sched.wake_idle();
                (adopted, withdrawn, wake)
            };
            if wake {
                pool.work.notify_one();
            }
            // Dropped here, outside the lock.
            let mut progressed = !withdrawn.is_empty();
            drop(withdrawn);
            for key in adopted {
                // A lane this poller still lists may have been taken back,
                // emptied, made afresh and queued again: listed once.
                if pool.claim(key, Owner::Poller) && !lanes.contains(&key) {
                    lanes.push(key);
                }
            }
            lanes.retain(|&key| {
                let round = Self::resolve_reached(&pool, key, Owner::Poller, &mut scratch);
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
    /// after finds it shut.
    pub(crate) fn shutdown(&self) {
        let withdrawn = {
            let mut sched = self.sched();
            sched.shutdown = true;
            sched.queued.clear();
            std::mem::take(&mut sched.withdrawn)
        };
        self.work.notify_all();
        // Withdrawn waits are dropped here, with the rest.
        drop(withdrawn);
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
    }

    pub(crate) fn threads(&self) -> usize {
        let sched = self.sched();
        sched.lane_threads + usize::from(sched.poller)
    }

    pub(crate) fn peak_threads(&self) -> usize {
        self.sched().peak_threads
    }

    /// Waits handed to the pool and not finished, summed over the shards.
    pub(crate) fn pending(&self) -> usize {
        self.shards.iter().map(|shard| shard.lock().pending).sum()
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
        self.lanes.fetch_sub(1, Ordering::SeqCst);
        Some(lane)
    }

    /// Remove every lane of `shard` (its lock held; shutdown), keeping the
    /// count of lanes.
    fn remove_all_lanes(&self, shard: &mut Shard) -> impl Iterator<Item = Lane> {
        let lanes = std::mem::take(&mut shard.lanes);
        self.lanes.fetch_sub(lanes.len(), Ordering::SeqCst);
        lanes.into_values()
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
    /// (a timeout) still looks at `queued` under this lock, so the work it
    /// was woken for is found either way.
    fn wake_idle(&mut self) -> bool {
        if self.idle > self.notified {
            self.notified += 1;
            true
        } else {
            false
        }
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
    fn add_lane_thread(&mut self) -> Action {
        self.lane_threads += 1;
        self.next_thread += 1;
        self.note_threads();
        Action::SpawnLaneThread(self.next_thread)
    }

    /// Count in the poller the caller is about to spawn.
    fn add_poller(&mut self) -> Action {
        self.poller = true;
        self.note_threads();
        Action::SpawnPoller
    }

    fn note_threads(&mut self) {
        self.peak_threads = self
            .peak_threads
            .max(self.lane_threads + usize::from(self.poller));
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
