//! [`Pool`]: the handle to a waiter's shared state, and the operations on
//! its lanes under their locks: submit, withdraw, settle a batch, shut down.
//! The lane algorithm is described once, in [`Waiter`](super::Waiter)'s
//! docs; the threads that serve lanes are in [`servers`](super::servers).

use std::collections::btree_map::Entry;
use std::ops::Deref;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::checked::Checked;
use super::contain;
use super::permits::Permits;
use super::sched::{Action, Sched};
use super::shard::{Lane, Owner, Shard, Wait, SHARDS};
use super::slot::Slot;
use super::stats::Counters;
use super::stuck::StuckReports;
use super::waitable::LaneKey;
use crate::loom::{Arc, AtomicUsize, Condvar, Mutex};
use crate::ServerError;

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
    /// How long a wait may be pending before it is reported stuck; `None`:
    /// never (see `stuck.rs`).
    pub(crate) stuck_after: Option<Duration>,
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

/// A handle to a waiter's shared state, held by the [`Waiter`](super::Waiter)
/// handles and by every waiter thread: cheap to clone (one `Arc`), and every
/// operation takes `&self`.
#[derive(Clone)]
pub(crate) struct Pool {
    shared: Arc<Shared>,
}

/// The shared state of a waiter.
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
/// no shard while holding the scheduler. A wait's [`Slot`] lock and the
/// queue of stuck-wait lines ([`StuckReports`]) come last of all, and
/// nothing is locked while either is held. Both kinds of lock are
/// taken through [`Checked`], which checks their invariants as they are let
/// go (debug and loom builds).
///
/// # Code it calls but does not own
///
/// A backend's query and block, a task's waker, a wait's drop (its fence's
/// event release): each goes through [`contain`], so a panic there costs only
/// the wait it concerns, and no lock is held across any of them. A waiter
/// thread that still unwinds (a bug in the waiter) gives back what it holds
/// through its guard: no count outlives the thread it counts, and no wait is
/// left pending.
pub(crate) struct Shared {
    pub(crate) config: Config,
    shards: Vec<Mutex<Shard>>,
    /// Lanes in all shards, changed under their shard's lock. Read under the
    /// scheduler's to decide whether a queued lane needs a new thread (see
    /// [`Sched::place`]); it is touched only when a lane starts or ends,
    /// never per wait of a busy lane.
    lanes: AtomicUsize,
    sched: Mutex<Sched>,
    /// Idle lane threads wait here (with the scheduler's lock) for a lane.
    pub(super) work: Condvar,
    /// Lane threads querying their batches, at most one per core.
    pub(super) resolving: Permits,
    /// What the waiter has done, for [`Waiter::stats`](super::Waiter::stats).
    pub(crate) counters: Counters,
    /// When stuck waits are next looked for on the busy paths, and the
    /// lines about them to log.
    pub(super) stuck: StuckReports,
    /// The process generation this pool was made in ([`crate::fork`]). In a
    /// forked child its threads are gone (only the forking thread is
    /// copied), so it refuses waits there rather than queue them for
    /// threads that do not exist.
    fork_generation: u64,
    /// Faults a test plants: spawns refused, panics where no call is
    /// contained.
    #[cfg(test)]
    pub(crate) plants: Plants,
    /// Waits taken out of their lane to query and put back unreached, for
    /// the tests of what serving a lane costs.
    #[cfg(test)]
    pub(crate) put_back: AtomicUsize,
}

impl Deref for Pool {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.shared
    }
}

impl Pool {
    pub(crate) fn new(config: Config) -> Self {
        let watching = config.stuck_after.is_some();
        Self {
            shared: Arc::new(Shared {
                resolving: Permits::new(config.resolvers),
                config,
                shards: (0..SHARDS)
                    .map(|_| Mutex::new(Shard::new(watching)))
                    .collect(),
                lanes: AtomicUsize::new(0),
                sched: Mutex::new(Sched::default()),
                work: Condvar::new(),
                fork_generation: crate::fork::generation(),
                counters: Counters::default(),
                stuck: StuckReports::new(),
                #[cfg(test)]
                plants: Plants::new(),
                #[cfg(test)]
                put_back: AtomicUsize::new(0),
            }),
        }
    }

    /// Hand a wait to the pool. Returns its lane and the place it went:
    /// where it sits, for [`Pool::withdraw`]. A wait for a lane already
    /// served takes its shard's lock and nothing else.
    ///
    /// # Errors
    ///
    /// [`ServerError::WaiterGone`] after [`Pool::shutdown`];
    /// [`ServerError::WaiterForked`] in a forked child. The wait is dropped.
    pub(crate) fn submit(&self, mut wait: Wait) -> Result<(LaneKey, u64), ServerError> {
        if self.is_forked() {
            return Err(ServerError::WaiterForked);
        }
        if let Some(invalid) = self.config.invalid() {
            return Err(invalid);
        }
        let key = wait.lane;
        let handed_at = wait.slot.handed_at();
        let mut shard = self.shard(key);
        if self.config.stuck_after.is_some() && shard.stream_name(key).is_none() {
            // The wait makes a lane for a stream the shard has no name for:
            // the backend's `Debug`, called with no lock held.
            drop(shard);
            let name = contain::backend(|| Ok(wait.waitable.stream_name()));
            let name = name.unwrap_or_else(|err| format!("a stream ({err})"));
            wait.stream_name = Some(name.into());
            shard = self.shard(key);
        }
        if shard.shut && !crate::plant::planted("submit-enters-drained-shard") {
            drop(shard);
            drop(wait);
            return Err(ServerError::WaiterGone);
        }
        shard.wait_added();
        // Counted before any thread can take it, so its outcome is counted
        // after.
        self.counters.handed_off();
        let (placed, new_lane) = self.insert(&mut shard, wait);
        let action = if new_lane {
            self.queue_lane(key)
        } else {
            Action::Nothing
        };
        drop(shard);
        self.act(action);
        if !crate::plant::planted("hand-off-does-not-look-for-stuck") {
            self.check_stuck_if_due(handed_at);
        }
        Ok((key, placed))
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
    ///
    /// When `resolved` is not 0, the lane's stream made progress; `first`
    /// is how the oldest of them ended (`None`: reached).
    pub(super) fn settle(
        &self,
        key: LaneKey,
        rest: Vec<Wait>,
        resolved: usize,
        first: Option<&ServerError>,
    ) -> Action {
        let mut shard = self.shard(key);
        let count = resolved + rest.len();
        shard.batch_settled(count);
        let (cancelled, rest): (Vec<Wait>, Vec<Wait>) =
            rest.into_iter().partition(|wait| wait.slot.is_cancelled());
        if crate::plant::planted("settle-miscounts-cancelled") {
            shard.waits_finished(resolved - cancelled.len());
        } else if crate::plant::planted("settle-forgets-cancelled") {
            shard.waits_finished(resolved);
        } else {
            shard.waits_finished(resolved + cancelled.len());
        }
        let mut gone = Vec::new();
        let mut action = Action::Nothing;
        if shard.shut {
            shard.waits_finished(rest.len());
            gone = rest;
        } else {
            #[cfg(test)]
            self.put_back.fetch_add(rest.len(), Ordering::SeqCst);
            let mut new_lane = false;
            for wait in rest {
                new_lane |= self.insert(&mut shard, wait).1;
            }
            if new_lane && !crate::plant::planted("lane-made-in-settle-not-queued") {
                action = self.queue_lane(key);
            }
        }
        // Counted back after any put back are in their lane again: a stall
        // parked meanwhile goes on in it, or ends here.
        let mut ended = shard.batch_returned(key, count);
        if resolved > 0 && self.config.stuck_after.is_some() {
            let lane = shard.lanes.get_mut(&key);
            let watch = lane.and_then(|lane| lane.watch.as_mut());
            if let Some(watch) = watch.or(ended.as_mut()) {
                watch.progressed(first, || false, &self.stuck);
            }
        }
        if let Some(ended) = ended {
            ended.removed(&self.stuck);
        }
        drop(shard);
        self.log_stuck_lines();
        // Dropped (destroying their events) and woken outside the lock.
        cancelled.into_iter().for_each(contain::drop);
        for wait in gone {
            wait.slot
                .complete(Err(ServerError::WaiterGone), &self.counters);
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
    pub(crate) fn withdraw(&self, key: LaneKey, placed: u64, slot: &Arc<Slot>) {
        if self.is_forked() {
            return;
        }
        let mut shard = self.shard(key);
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
        let mut sched = self.sched();
        if sched.shutdown {
            // No waiter thread is left to drop it: dropped here.
            drop(sched);
            contain::drop(wait);
            return;
        }
        sched.withdrawn.push(wait);
        let action = sched.wake_or_spawn_disposer();
        drop(sched);
        self.act(action);
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
            let mut shard = Checked::lock(shard);
            shard.shut = true;
            let before = gone.len() + blocked.len();
            for lane in self.remove_all_lanes(&mut shard) {
                gone.extend(lane.waits.into_values());
                blocked.extend(lane.blocked_on);
            }
            shard.waits_finished(gone.len() + blocked.len() - before);
        }
        self.log_stuck_lines();
        let slots = gone.iter().map(|wait| &wait.slot).chain(&blocked);
        for slot in slots {
            slot.complete(Err(ServerError::WaiterGone), &self.counters);
        }
        gone.into_iter().for_each(contain::drop);
    }
}

impl Shared {
    pub(super) fn shard(&self, key: LaneKey) -> Checked<'_, Shard> {
        Checked::lock(&self.shards[key.shard(SHARDS)])
    }

    pub(super) fn sched(&self) -> Checked<'_, Sched> {
        Checked::lock(&self.sched)
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

    /// [`Shard::insert`], counting the lane it makes, if it makes one.
    fn insert(&self, shard: &mut Shard, wait: Wait) -> (u64, bool) {
        let (placed, new_lane) = shard.insert(wait);
        if new_lane {
            self.lanes.fetch_add(1, Ordering::SeqCst);
        }
        (placed, new_lane)
    }

    /// Every shard, for a look over all lanes.
    pub(super) fn shards(&self) -> &[Mutex<Shard>] {
        &self.shards
    }

    /// A new lane needs a server: queue it and decide who serves it
    /// ([`Sched::place`]), under its shard's lock (taken by the caller; the
    /// scheduler's comes second), so no lane is ever made and not queued.
    ///
    /// The count of lanes is read under the scheduler's lock: every lane is
    /// counted before it is queued, so this count includes every lane queued
    /// before this one. Read before the lock, it could miss a lane queued
    /// meanwhile, and decide that a thread busy with that lane serves this
    /// one too.
    pub(super) fn queue_lane(&self, key: LaneKey) -> Action {
        if crate::plant::planted("lane-count-read-before-scheduler-lock") {
            let lanes = self.lanes();
            return self.sched().place(key, lanes, self.config.max_threads);
        }
        let mut sched = self.sched();
        let lanes = self.lanes();
        sched.place(key, lanes, self.config.max_threads)
    }

    /// Remove a lane taken out of a queue that no thread will serve, and
    /// return its waits (counted finished).
    pub(super) fn remove_queued_lane(&self, key: LaneKey) -> Vec<Wait> {
        let mut shard = self.shard(key);
        if shard.lane_of(key, Owner::Queued).is_none() {
            return Vec::new();
        }
        let waits: Vec<Wait> = self
            .remove_lane(&mut shard, key)
            .map(|lane| lane.waits.into_values().collect())
            .unwrap_or_default();
        shard.waits_finished(waits.len());
        drop(shard);
        self.log_stuck_lines();
        waits
    }

    /// A thread or the poller took `key` out of a queue: make the lane
    /// `owner`'s. False if it is gone (shutdown drained it).
    pub(super) fn claim(&self, key: LaneKey, owner: Owner) -> bool {
        let mut shard = self.shard(key);
        match shard.lane_of(key, Owner::Queued) {
            Some(lane) => {
                lane.owner = owner;
                true
            }
            None => false,
        }
    }

    /// A lane the poller serves, made this lane thread's (`owner`), if there
    /// is one. Looks through every shard: only while the poller runs, when a
    /// thread runs out of lanes.
    pub(super) fn take_back_from_poller(&self, owner: Owner) -> Option<LaneKey> {
        self.shards.iter().find_map(|shard| {
            let mut shard = Checked::lock(shard);
            let (key, lane) = shard
                .lanes
                .iter_mut()
                .find(|(_, lane)| lane.owner == Owner::Poller)?;
            lane.owner = owner;
            Some(*key)
        })
    }

    /// Lane thread `owner` finished serving `key`: whether the lane has
    /// waits again (and is still its own); if it is its own and empty, it is
    /// removed.
    pub(super) fn release_lane(&self, key: LaneKey, owner: Owner) -> bool {
        let mut shard = self.shard(key);
        match shard.lane_of(key, owner) {
            Some(lane) if !lane.waits.is_empty() => true,
            Some(_) => {
                self.remove_lane(&mut shard, key);
                drop(shard);
                self.log_stuck_lines();
                false
            }
            None => false,
        }
    }

    /// Lane thread `owner`, serving `key`, takes its oldest wait to block on
    /// ([`Shard::take_oldest`]).
    pub(super) fn take_oldest(&self, key: LaneKey, owner: Owner) -> Option<Wait> {
        self.shard(key).take_oldest(key, owner)
    }

    /// Move up to `limit` waits of `key` into `batch`, oldest first, if
    /// `owner` serves it. False when there are none (a lane the poller
    /// emptied is removed).
    ///
    /// Bounded, so a lane of thousands that is only partly reached costs a
    /// batch per round, not the whole lane taken out and put back.
    pub(super) fn take_waits(
        &self,
        key: LaneKey,
        owner: Owner,
        limit: usize,
        batch: &mut Vec<Wait>,
    ) -> bool {
        let mut shard = self.shard(key);
        let Some(lane) = shard.lane_of(key, owner) else {
            return false;
        };
        if lane.waits.is_empty() {
            if owner == Owner::Poller {
                self.remove_lane(&mut shard, key);
                drop(shard);
                self.log_stuck_lines();
            }
            return false;
        }
        shard.take_batch(key, limit, batch);
        true
    }

    /// A lane thread's block on `slot`'s wait ended with `result`. Unless
    /// shutdown has resolved it meanwhile, count it done and wake its future.
    pub(super) fn resolve_blocked(
        &self,
        key: LaneKey,
        slot: &Arc<Slot>,
        result: Result<(), ServerError>,
    ) {
        let mut shard = self.shard(key);
        if shard.finish_blocked(key, slot, &result, &self.stuck) {
            drop(shard);
            slot.complete(result, &self.counters);
            self.log_stuck_lines();
        }
    }

    /// [`Shared::resolve_blocked`], and then, in the same hold of the shard's
    /// lock, [`Shared::take_oldest`]: a lane thread's step from one wait to
    /// the next, one lock round-trip per wait. The future is woken once the
    /// lock is let go.
    pub(super) fn resolve_blocked_and_take_next(
        &self,
        key: LaneKey,
        owner: Owner,
        slot: &Arc<Slot>,
        result: Result<(), ServerError>,
    ) -> Option<Wait> {
        let mut shard = self.shard(key);
        let ours = shard.finish_blocked(key, slot, &result, &self.stuck);
        let next = shard.take_oldest(key, owner);
        drop(shard);
        if ours {
            slot.complete(result, &self.counters);
        }
        // Logged once the future is woken: a logger may be slow.
        self.log_stuck_lines();
        next
    }

    /// Lanes in all shards now.
    pub(super) fn lanes(&self) -> usize {
        self.lanes.load(Ordering::SeqCst)
    }

    /// Remove `key`'s lane from `shard` (its lock held), keeping the count
    /// of lanes.
    pub(super) fn remove_lane(&self, shard: &mut Shard, key: LaneKey) -> Option<Lane> {
        let mut lane = shard.lanes.remove(&key)?;
        let before = self.lanes.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "the count of lanes underflowed");
        if let Some(watch) = lane.watch.take() {
            // Parked if waits of it out in a batch may come back.
            if let Some(ended) = shard.lane_removed(key, watch, lane.out) {
                ended.removed(&self.stuck);
            }
        }
        Some(lane)
    }

    /// Remove every lane of `shard` (its lock held; shutdown), keeping the
    /// count of lanes.
    fn remove_all_lanes(&self, shard: &mut Shard) -> Vec<Lane> {
        let lanes = std::mem::take(&mut shard.lanes);
        let before = self.lanes.fetch_sub(lanes.len(), Ordering::SeqCst);
        assert!(before >= lanes.len(), "the count of lanes underflowed");
        lanes
            .into_iter()
            .map(|(key, mut lane)| {
                if let Some(watch) = lane.watch.take() {
                    // Parked if waits of it out in a batch will come back.
                    if let Some(ended) = shard.lane_removed(key, watch, lane.out) {
                        ended.removed(&self.stuck);
                    }
                }
                lane
            })
            .collect()
    }

    /// Threads alive now; none in a forked child (the parent's are not
    /// there).
    pub(crate) fn threads(&self) -> usize {
        if self.is_forked() {
            return 0;
        }
        self.sched().threads()
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
        self.pending_and_cancelled_held().0
    }

    /// [`Shared::pending`], and those of its waits whose future was dropped
    /// while a lane thread is blocked on them, read shard by shard.
    pub(crate) fn pending_and_cancelled_held(&self) -> (usize, usize) {
        if self.is_forked() {
            return (0, 0);
        }
        self.shards.iter().fold((0, 0), |(pending, held), shard| {
            let shard = Checked::lock(shard);
            (pending + shard.pending(), held + shard.cancelled_held())
        })
    }

    /// A spawn a test refused, if it planted one.
    pub(super) fn refused_spawn(&self) -> Option<std::io::Error> {
        #[cfg(test)]
        if Plants::take(&self.plants.refused_spawns) {
            return Some(std::io::Error::other("a spawn refused by a test"));
        }
        None
    }

    /// Panic here if a test planted one: a point where a thread holds waits
    /// out of their lane and no call is contained, so only its guard can
    /// give them back.
    pub(super) fn planted_escape(&self) {
        #[cfg(test)]
        if Plants::take(&self.plants.escapes) {
            panic!("a panic planted by a test, outside any contained call");
        }
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
