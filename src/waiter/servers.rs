//! The waiter's threads: lane threads, each serving one lane at a time, and
//! the poller, serving lanes past `max_threads`; how they are started, how
//! they resolve a lane's waits in batches, and the guard that gives back
//! what a thread held if it unwinds. Steps 3 to 7 of the lane algorithm in
//! [`Waiter`](super::Waiter)'s docs.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use super::contain;
use super::pool::Pool;
use super::sched::Action;
use super::shard::{Owner, Wait};
use super::stuck::check_interval;
use super::waitable::LaneKey;
use crate::loom::thread;
use crate::{ErrorSource, ServerError};

/// The most waits a thread takes out of a lane to query in one round.
const BATCH: usize = 256;

/// The poller's first pause after a round without progress.
const POLL_BACKOFF_MIN: Duration = Duration::from_micros(50);
/// The poller's longest pause: the most latency an overflow lane can add.
const POLL_BACKOFF_MAX: Duration = Duration::from_millis(1);
/// How many rounds without work the poller waits out before it exits, its
/// pause doubling from [`POLL_BACKOFF_MIN`] to [`POLL_BACKOFF_MAX`]. None
/// under loom, whose models would otherwise explore every round.
const POLLER_LINGER_ROUNDS: u32 = if cfg!(device_events_loom) { 0 } else { 6 };

/// What [`Pool::resolve_reached`] did.
struct Resolved {
    /// How many waits it resolved.
    resolved: usize,
    /// Whether the lane still has waits (the first not reached, and after)
    /// and is still the caller's.
    more: bool,
}

/// How long an idle lane thread waits ([`Pool::idle_wait`]), whether its
/// keep-alive is over when that wait times out, and whether it holds the
/// idle watch for stuck streams meanwhile.
struct IdleWait {
    wait: Duration,
    is_last: bool,
    watching: bool,
}

/// A batch of waits a server has taken out of a lane to query.
#[derive(Default)]
struct Batch {
    waits: Vec<Wait>,
    /// The lane they came from, while they are out.
    lane: Option<LaneKey>,
    /// Whether they are still counted out of their shard (until
    /// [`Pool::settle`] counts the reached ones finished and puts the rest
    /// back).
    out: bool,
}

/// A waiter thread's hold on the pool: its place among the counted threads,
/// the lanes it serves and the batch it has out. Every lane thread and the
/// poller own one for their whole life.
///
/// **Invariant**: no count outlives the thread it counts. A thread that
/// leaves the normal way uncounts itself under the scheduler's lock and
/// clears `counted`; one that unwinds (a bug in the waiter: every call into
/// code the pool does not own is contained) has this guard do it on the way
/// out, after it has failed the batch it had out, failed the wait it was
/// blocked on, and queued its lanes for another server. No wait is lost.
struct ServerGuard {
    pool: Pool,
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
    /// Carry out what the scheduler decided, once its lock is let go.
    pub(super) fn act(&self, action: Action) {
        let (name, owner) = match action {
            Action::Nothing => return,
            Action::WakeIdleThread => {
                if !crate::plant::planted("idle-thread-wake-never-sent") {
                    self.work.notify_one();
                }
                return;
            }
            Action::SpawnLaneThread(index) => (
                format!("{}-{index}", self.config.thread_name),
                Owner::Thread(index),
            ),
            Action::SpawnPoller => (format!("{}-poller", self.config.thread_name), Owner::Poller),
        };
        let worker = self.clone();
        let spawned = match self.refused_spawn() {
            Some(refused) => Err(refused),
            // A spawn that panics (std does, for a name it cannot pass to
            // the OS) is a failed spawn like any other, never a panic in
            // `poll`.
            None => catch_unwind(AssertUnwindSafe(|| {
                thread::Builder::new()
                    .name(name)
                    .spawn(move || worker.run_server(owner))
            }))
            .unwrap_or_else(|payload| {
                Err(std::io::Error::other(ServerError::panic_message(
                    payload.as_ref(),
                )))
            }),
        };
        if let Err(err) = spawned {
            self.spawn_failed(owner, err);
        }
    }

    /// Undo the counters of a thread that could not start, and keep serving
    /// with the threads that exist: the lanes queued for lane threads go to
    /// the poller (which a free lane thread takes them from first), started
    /// if it is not running. Lanes left for a poller that could not start
    /// are failed, rather than left to a lane thread that may never run out
    /// of work.
    fn spawn_failed(&self, owner: Owner, err: std::io::Error) {
        contain::log(|| log::error!("a waiter thread could not be started: {err}"));
        let mut sched = self.sched();
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
                return self.act(action);
            }
        }
        if sched.poller {
            return;
        }
        // Lanes queued for threads have one coming (with no lane thread at
        // all there are none: the invariant), so only the poller's are
        // failed.
        let keys: Vec<LaneKey> = sched.for_poller.drain(..).collect();
        // No poller will drop them: dropped here, as the last resort.
        let withdrawn = std::mem::take(&mut sched.withdrawn);
        drop(sched);
        withdrawn.into_iter().for_each(contain::drop);
        let failure = ServerError::ThreadSpawn {
            component: "Waiter",
            reason: format!("no waiter thread could be started to serve it: {err}"),
            source: Some(ErrorSource::new(err)),
        };
        for key in keys {
            for wait in self.remove_queued_lane(key) {
                wait.slot.complete(Err(failure.clone()), &self.counters);
                contain::drop(wait);
            }
        }
    }

    /// The body of every waiter thread.
    fn run_server(self, owner: Owner) {
        crate::own_threads::enter();
        let guard = ServerGuard::new(self, owner);
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
            guard.pool.serve_lane(key, owner, &mut guard.batch);
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
            if self.release_lane(key, owner) {
                return Some(key);
            }
        }
        let mut timed_out = false;
        // Whether this thread has looked for a lane to take back from the
        // poller since it last slept: once per wake-up is enough, as the
        // poller wakes an idle thread each round it has lanes.
        let mut looked_at_poller = false;
        // While stuck streams are looked for: since when this thread has
        // been idle with no wake-up but its own timeouts, and whether it
        // woke from one as the idle watch, to look for them before it
        // sleeps again.
        let mut idle_since = None;
        let mut look_for_stuck = false;
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
                sched.lane_thread_left();
                return None;
            }
            if std::mem::take(&mut look_for_stuck) {
                // The queues first (above): no work waits on this look. Then
                // stuck streams (one may hang with nothing else handed off),
                // with no lock held; then the queues again, and idle for the
                // rest of the keep-alive.
                drop(sched);
                if !crate::plant::planted("idle-thread-does-not-look-for-stuck") {
                    self.check_stuck_if_due(Instant::now());
                }
                sched = self.sched();
                looked_at_poller = false;
                continue;
            }
            sched.go_idle();
            let idle_for = self.idle_wait(&mut idle_since);
            let (guard, timeout) = sched.wait_timeout(&self.work, idle_for.wait);
            sched = guard;
            sched.woke();
            if idle_for.watching {
                self.stuck.end_idle_watch();
                if !timeout && sched.wake_idle() {
                    // Woken, likely for work: another idle thread takes the
                    // watch over, or it would sleep its whole keep-alive.
                    drop(sched);
                    self.act(Action::WakeIdleThread);
                    sched = self.sched();
                }
            }
            timed_out = timeout && idle_for.is_last;
            look_for_stuck = timeout && !timed_out;
            if !timeout {
                idle_since = None;
            }
            if timed_out && crate::plant::planted("idle-thread-leaves-without-looking") {
                sched.lane_thread_left();
                return None;
            }
            looked_at_poller = false;
        }
    }

    /// How long an idle lane thread waits for work before it wakes on its
    /// own: its keep-alive. While stuck streams are looked for, the idle
    /// thread that takes the idle watch (one at a time, so that many idle
    /// threads do not all wake) waits no longer than [`check_interval`] at
    /// a time, and each wait is counted from `idle_since` (set at the first
    /// of them), so that its whole keep-alive is the same.
    fn idle_wait(&self, idle_since: &mut Option<Instant>) -> IdleWait {
        let keep_alive = self.config.keep_alive;
        let whole = IdleWait {
            wait: keep_alive,
            is_last: true,
            watching: false,
        };
        let Some(after) = self.config.stuck_after else {
            return whole;
        };
        let since = *idle_since.get_or_insert_with(Instant::now);
        let left = keep_alive.saturating_sub(since.elapsed());
        if !self.stuck.take_idle_watch() {
            return IdleWait {
                wait: left,
                ..whole
            };
        }
        let interval = check_interval(after);
        IdleWait {
            wait: left.min(interval),
            is_last: left <= interval,
            watching: true,
        }
    }

    /// Serve lane `key` until it is empty or no longer this thread's.
    ///
    /// Block on the oldest wait; once it is resolved, take the next oldest
    /// out, to block on next, and ask it once. Work on a stream mostly ends
    /// item after item, so it is mostly not reached yet, and the thread
    /// blocks on it at once: one take from the lane per wait, and nothing
    /// put back. Only when it is reached (a burst: work that ended while the
    /// thread was busy) does the thread resolve it and the later waits
    /// reached, in batches ([`Pool::resolve_reached`]).
    fn serve_lane(&self, key: LaneKey, owner: Owner, batch: &mut Batch) {
        let Some(mut wait) = self.take_oldest(key, owner) else {
            return;
        };
        loop {
            self.planted_escape();
            let result = contain::backend(|| wait.waitable.block());
            let next = self.resolve_blocked_and_take_next(key, owner, &wait.slot, result);
            // Its future is woken first; then its fence (its event) goes.
            contain::drop(wait);
            let Some(next) = next else {
                return;
            };
            wait = next;
            // One query, with no permit: a batch's queries take one, a
            // single look does not need to.
            let reached = match contain::backend(|| wait.waitable.query()) {
                Ok(false) if !crate::plant::planted("lane-thread-resolves-unreached-wait") => {
                    continue
                }
                Ok(_) => Ok(()),
                Err(err) => Err(err),
            };
            self.resolve_blocked(key, &wait.slot, reached);
            contain::drop(wait);
            if !self.resolve_reached(key, owner, batch).more {
                return;
            }
            let Some(next) = self.take_oldest(key, owner) else {
                return;
            };
            wait = next;
        }
    }

    /// Resolve, in order, the waits of `key` that a query shows reached; stop
    /// at the first that is not.
    ///
    /// Works in batches: the lane's waits are taken in one lock, queried
    /// outside it, and the rest put back in one more, so a burst of thousands
    /// of reached waits costs two lock round-trips, not three per wait. A
    /// lane thread queries with a resolve permit (at most one per core at
    /// once: see [`Permits`](super::permits::Permits)); the wakes come after,
    /// with no permit held, as a waker may run its task inline, and that task
    /// may block. Each batch's futures are all woken before any of its waits
    /// (and their events) is dropped, so the tasks run while this thread
    /// cleans up; the batch lives in the thread's own buffer, so a burst
    /// allocates nothing per batch.
    fn resolve_reached(&self, key: LaneKey, owner: Owner, batch: &mut Batch) -> Resolved {
        let mut resolved = 0;
        // The poller asks each of its lanes every round, mostly to hear "not
        // yet": it takes just the oldest wait first. A lane thread has just
        // seen one reached. Each batch all reached doubles the next, up to
        // `BATCH`: a burst of thousands still costs a few lock round-trips
        // per `BATCH` waits, and a short run of reached waits (items ending
        // faster than the thread wakes) takes out, and puts back, at most as
        // many unreached waits as it resolved, not a whole `BATCH`.
        let mut limit = if owner == Owner::Poller { 1 } else { 2 };
        loop {
            if !self.take_waits(key, owner, limit, &mut batch.waits) {
                return Resolved {
                    resolved,
                    more: false,
                };
            }
            batch.lane = Some(key);
            batch.out = true;
            self.planted_escape();
            let (reached, failed) = {
                // The poller is one thread, and takes no permit.
                let _permit = (owner != Owner::Poller).then(|| self.resolving.acquire());
                reached_prefix(&batch.waits)
            };
            let rest = batch.waits.split_off(reached);
            let more = !rest.is_empty();
            resolved += reached;
            limit = (limit * 2).min(BATCH);
            let first = match failed.first() {
                Some((0, err)) => Some(err),
                _ => None,
            };
            let action = self.settle(key, rest, reached, first);
            batch.out = false;
            self.act(action);
            // Woken outside the lock, oldest first; then each wait (and its
            // event) is dropped here, on this thread.
            let mut failed = failed.into_iter().peekable();
            for (index, wait) in batch.waits.iter().enumerate() {
                match failed.next_if(|(at, _)| *at == index) {
                    Some((_, err)) => wait.slot.complete(Err(err), &self.counters),
                    None => wait.slot.complete(Ok(()), &self.counters),
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

    /// The poller: serve every lane queued for it, with queries and a
    /// bounded backoff, and drop withdrawn waits. With nothing to do it
    /// lingers [`POLLER_LINGER_ROUNDS`] backoff rounds before it exits, so a
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
                let round = pool.resolve_reached(key, Owner::Poller, batch);
                progressed |= round.resolved > 0;
                round.more
            });
            if guard.pool.config.stuck_after.is_some() {
                guard.pool.check_stuck_if_due(std::time::Instant::now());
            }
            if progressed {
                backoff = POLL_BACKOFF_MIN;
            } else {
                crate::loom::sleep(backoff);
                backoff = (backoff * 2).min(POLL_BACKOFF_MAX);
            }
        }
    }

    /// Give back what a server that unwound held (see [`ServerGuard`]): fail
    /// the batch it had out and the wait it was blocked on, uncount it, and
    /// queue its lanes for another server.
    fn recover(&self, owner: Owner, lanes: &[LaneKey], batch: &mut Batch) {
        let failure = || ServerError::WaiterPanicked {
            message: "a waiter thread unwound while it held this wait".to_owned(),
        };
        if let Some(key) = batch.lane.take() {
            if batch.out {
                let mut shard = self.shard(key);
                shard.batch_settled(batch.waits.len());
                shard.waits_finished(batch.waits.len());
                // Failed below: a parked watch's stall ends with them.
                if let Some(parked) = shard.batch_returned(key, batch.waits.len()) {
                    parked.removed(&self.stuck);
                }
            }
            for wait in batch.waits.drain(..) {
                // A no-op for waits it had already resolved.
                wait.slot.complete(Err(failure()), &self.counters);
                contain::drop(wait);
            }
        }
        // Uncounted first, so that queuing its lanes does not count on it;
        // and the lanes queued for threads are placed again, as one of them
        // may have counted on this thread taking it.
        let actions: Vec<Action> = {
            let mut sched = self.sched();
            match owner {
                Owner::Poller => sched.poller_left(),
                _ => sched.lane_thread_left(),
            }
            let queued = std::mem::take(&mut sched.for_threads);
            let lanes = self.lanes();
            queued
                .into_iter()
                .map(|key| sched.place(key, lanes, self.config.max_threads))
                .collect()
        };
        for action in actions {
            self.act(action);
        }
        let mut blocked = Vec::new();
        for &key in lanes {
            let mut shard = self.shard(key);
            let Some(lane) = shard.lane_of(key, owner) else {
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
                self.remove_lane(&mut shard, key);
                Action::Nothing
            } else {
                self.queue_lane(key)
            };
            drop(shard);
            self.act(action);
        }
        self.log_stuck_lines();
        for slot in blocked {
            slot.complete(Err(failure()), &self.counters);
        }
    }
}

impl ServerGuard {
    fn new(pool: Pool, owner: Owner) -> Self {
        Self {
            pool,
            owner,
            lanes: Vec::new(),
            // Sized now, when the thread starts, not in the middle of a
            // burst: a large allocation makes the allocator consolidate every
            // small block freed before it, which measurably slowed the first
            // batch of each thread in a burst.
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
            self.pool.recover(self.owner, &self.lanes, &mut self.batch);
        }
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
