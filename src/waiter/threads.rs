//! The waiter's threads: how they start and serve lanes, and the guard that
//! gives back what one held if it unwinds.

use std::time::{Duration, Instant};

use super::contain;
use super::pool::{Action, Owner, Pool, Wait};
use super::waitable::LaneKey;
use super::watch::{self, CpuBudget, Held, Timing, Watched, MAX_NAP, MIN_NAP};
use crate::sync::thread;
use crate::ServerError;

/// The most waits a thread takes out of a lane to query in one round.
const BATCH: usize = 256;
/// The poller's first pause after a round without progress.
const POLL_BACKOFF_MIN: Duration = Duration::from_micros(50);
/// The poller's longest pause: the most latency a polled lane can add.
const POLL_BACKOFF_MAX: Duration = Duration::from_millis(1);
/// Idle rounds before the poller exits (none under loom: fewer states).
const POLLER_LINGER_ROUNDS: u32 = if cfg!(device_events_loom) { 0 } else { 6 };

/// Wake and start what `action` says, with no lock held (a thread name std
/// would panic on never gets here: the pool refuses it).
pub(super) fn act(pool: &Pool, action: Action) {
    pool.notify(&action);
    let name = &pool.config().thread_name;
    let threads = action
        .spawn_thread
        .map(|n| (format!("{name}-{n}"), Owner::Thread(n)));
    let poller = action
        .spawn_poller
        .then(|| (format!("{name}-poller"), Owner::Poller));
    let watcher = action
        .spawn_watcher
        .then(|| (format!("{name}-watcher"), Owner::Watcher));
    for (name, owner) in threads.into_iter().chain(poller).chain(watcher) {
        let worker = pool.clone();
        let spawned = match pool.refused_spawn() {
            Some(refused) => Err(refused),
            None => thread::Builder::new()
                .name(name)
                .spawn(move || WaiterThread::run(worker, owner)),
        };
        if let Err(err) = spawned {
            let next = pool.spawn_failed(owner, err);
            act(pool, next);
        }
    }
}

/// A waiter thread's lanes and batch. One that unwinds (a bug in the
/// waiter) has this guard give them back ([`Pool::recover`]).
struct WaiterThread {
    pool: Pool,
    owner: Owner,
    /// At most one for a lane thread; the poller's list.
    lanes: Vec<LaneKey>,
    batch: Vec<Wait>,
    /// The lane the batch was taken from, while it is out.
    batch_lane: Option<LaneKey>,
    /// Cleared once the pool has uncounted it as it left.
    counted: bool,
}

impl WaiterThread {
    fn run(pool: Pool, owner: Owner) {
        crate::os::mark_own_thread();
        let mut this = WaiterThread {
            pool,
            owner,
            lanes: Vec::new(),
            // Sized now, not mid-burst: a large allocation then made the
            // allocator consolidate, which measurably slowed a first batch.
            batch: Vec::with_capacity(BATCH),
            batch_lane: None,
            counted: true,
        };
        match owner {
            Owner::Poller => this.run_poller(),
            Owner::Watcher => this.run_watcher(),
            Owner::Thread(_) | Owner::Queued => this.run_lane_thread(),
        }
        this.counted = false;
    }

    /// Take a lane, serve it until it is idle, take the next.
    fn run_lane_thread(&mut self) {
        let mut finished = None;
        while let Some(key) = self.pool.next_lane(self.owner, finished.take()) {
            self.lanes.clear();
            self.lanes.push(key);
            self.serve_lane(key);
            finished = Some(key);
        }
    }

    /// Serve lane `key` until it is empty or no longer this thread's (the
    /// steps: [`crate::waiter`]'s docs).
    fn serve_lane(&mut self, key: LaneKey) {
        let owner = self.owner;
        let Some(mut wait) = self.pool.take_oldest(key, owner) else {
            return;
        };
        // The lane's prediction, as its history said at the last wait's end.
        let mut predicted = None;
        loop {
            self.pool.planted_escape(self.owner);
            let (result, took) = self.wait_out(key, &wait, predicted);
            let next;
            (next, predicted) = self
                .pool
                .end_held((key, owner), &wait.slot, result, took, true);
            // Its future is woken first; then its fence (its event) goes.
            contain::drop(wait);
            let Some(next) = next else {
                return;
            };
            wait = next;
            match contain::backend(|| wait.waitable.query()) {
                Ok(false) => continue,
                reached => {
                    let result = reached.map(drop);
                    let _ = self
                        .pool
                        .end_held((key, owner), &wait.slot, result, None, false);
                    contain::drop(wait);
                }
            }
            if !self.resolve_reached(key).1 {
                return;
            }
            let Some(next) = self.pool.take_oldest(key, owner) else {
                return;
            };
            wait = next;
        }
    }

    /// Block in the driver until `wait`'s fence is reached; where watchers are on and its
    /// stream keeps a word, first put it on the watcher's list, to race the block, unless the
    /// lane's waits, `predicted` to take so long, are too short to watch. Its result, and, where
    /// watchers are on, how long it took (for its lane's history).
    fn wait_out(
        &self,
        lane: LaneKey,
        wait: &Wait,
        predicted: Option<Duration>,
    ) -> (Result<(), ServerError>, Option<Duration>) {
        if self.pool.config().watchers == 0 {
            return (contain::backend(|| wait.waitable.block()), None);
        }
        let started = Instant::now();
        // Decided without the lock where the lane's last wait says so.
        if !watch::too_short(predicted, self.pool.watcher_early(started)) {
            let word = contain::backend(|| Ok(wait.waitable.progress()));
            if let Some(word) = word.ok().flatten() {
                let held = Held {
                    lane,
                    sequence: wait.sequence(),
                    slot: &wait.slot,
                    waitable: &wait.waitable,
                    word,
                    started,
                };
                if let Some(action) = self.pool.watch(held) {
                    act(&self.pool, action);
                }
            }
        }
        let result = contain::backend(|| wait.waitable.block());
        (result, Some(started.elapsed()))
    }

    /// The watcher: sleep until the first entry is nearly due (at most [`MAX_NAP`]), look at
    /// the words of those due until each passed (confirmed by a query, then resolved) or its
    /// window ended, within its CPU budget, and again. Its CPU time is counted as it goes.
    fn run_watcher(&mut self) {
        crate::os::lower_timer_slack();
        let mut timing = Timing::default();
        let mut budget = CpuBudget::new(Instant::now());
        let mut cpu = crate::os::thread_cpu_time();
        let mut entries = Vec::new();
        while let Some(published) = self.pool.watch_round(&mut entries) {
            self.pool.planted_escape(self.owner);
            let first = entries.iter().map(|entry| timing.look_from(entry)).min();
            let first = first.expect("a round has entries");
            let now = Instant::now();
            let mut napped = false;
            if first.saturating_duration_since(now) >= MIN_NAP && !cfg!(device_events_loom) {
                let until = first.min(now + MAX_NAP);
                if let Some(late) = self.pool.watcher_nap(until, published) {
                    timing.overslept(late);
                    napped = until == first;
                }
            }
            let mut looked = Duration::ZERO;
            if self.pool.published() == published {
                let started = Instant::now();
                if budget.earn(started) {
                    self.look(&mut timing, &entries, published, napped);
                    looked = started.elapsed();
                } else {
                    self.leave_due(&timing, &entries, started);
                }
                self.pool.set_watcher_early(timing.early());
            }
            // Its copies of the entries go here, each maybe a fence's last.
            entries.drain(..).for_each(contain::drop);
            // The round's CPU, all of it (its looks, wake-ups, naps), is spent from the budget:
            // the watcher's own CPU clock, where there is one; else the time it looked.
            let now = crate::os::thread_cpu_time();
            match (cpu, now) {
                (Some(before), Some(now)) => {
                    let used = now.saturating_sub(before);
                    self.pool.counters().watcher_cpu(used);
                    budget.spend(used);
                }
                _ => budget.spend(looked),
            }
            cpu = now;
        }
    }

    /// With its CPU budget spent, the watcher leaves the entries due by `now` to the driver.
    fn leave_due(&self, timing: &Timing, entries: &[Watched], now: Instant) {
        for entry in entries {
            if timing.look_from(entry) <= now {
                self.pool.unwatch(entry);
            }
        }
    }

    /// Look at the words of `entries` due until each has passed or its window ended, taking
    /// each off the list as it is decided; return when none is due (to sleep until the next
    /// is), or when entries came after the `published`th.
    fn look(&self, timing: &mut Timing, entries: &[Watched], published: usize, napped: bool) {
        let mut open: Vec<&Watched> = entries.iter().collect();
        let mut looks = 0u32;
        loop {
            let now = Instant::now();
            let mut due = false;
            open.retain(|entry| {
                if timing.look_from(entry) > now {
                    return true;
                }
                due = true;
                if entry.passed() {
                    self.resolve_watched(entry, napped && looks == 0);
                } else if watch::past(timing.look_until(entry), looks) {
                    self.pool.unwatch(entry);
                } else {
                    return true;
                }
                false
            });
            // New entries are taken in each 32 looks, not at each: a round copies them all.
            let replan = looks.is_multiple_of(32) && self.pool.published() != published;
            if !due || open.is_empty() || replan {
                return;
            }
            looks = looks.wrapping_add(1);
            watch::pause(looks);
        }
    }

    /// `entry`'s word passed (seen `late`, at the first look after a sleep): confirm with a
    /// query, and resolve its wait (with a fault too), unless its lane thread did first; a word
    /// ahead of its event leaves the wait to the driver.
    fn resolve_watched(&self, entry: &Watched, late: bool) {
        let took = entry.started.elapsed();
        let result = match contain::backend(|| entry.waitable.query()) {
            Ok(false) => return self.pool.unwatch(entry),
            reached => reached.map(drop),
        };
        let ok = result.is_ok();
        if self.pool.end_watched(entry, result, took, late) && ok {
            self.pool.counters().watched();
        }
    }

    /// Resolve, in order, the waits of `key` a query shows reached, up to
    /// the first that is not, in batches: taken out in one hold of the lock,
    /// asked outside it, the rest put back in one more. Each batch all
    /// reached doubles the next, from 2 (1 for the poller, which mostly hears
    /// "not yet") up to [`BATCH`]. How many it resolved, and whether the lane
    /// has more and is still this thread's.
    fn resolve_reached(&mut self, key: LaneKey) -> (usize, bool) {
        let poller = self.owner == Owner::Poller;
        let mut limit = if poller { 1 } else { 2 };
        let mut resolved = 0;
        loop {
            if !self
                .pool
                .take_batch(key, self.owner, limit, &mut self.batch)
            {
                return (resolved, false);
            }
            self.batch_lane = Some(key);
            self.pool.planted_escape(self.owner);
            let (reached, failed) = reached_prefix(&self.batch);
            let rest = self.batch.split_off(reached);
            let more = !rest.is_empty();
            resolved += reached;
            limit = (limit * 2).min(BATCH);
            self.pool.settle(key, rest, reached);
            let mut failed = failed.into_iter().peekable();
            for (index, wait) in self.batch.iter().enumerate() {
                let result = match failed.next_if(|(at, _)| *at == index) {
                    Some((_, err)) => Err(err),
                    None => Ok(()),
                };
                self.pool.deliver(&wait.slot, result);
            }
            self.batch.drain(..).for_each(contain::drop);
            self.batch_lane = None;
            if more {
                return (resolved, true);
            }
        }
    }

    /// The poller: each round, adopt lanes, drop withdrawn waits, ask its
    /// lanes, warn of stalls, and pause (backing off while nothing moves).
    fn run_poller(&mut self) {
        // Four looks per `stuck_after`, at most one a millisecond.
        let check_every =
            (self.pool.config().stuck_after).map(|after| (after / 4).max(Duration::from_millis(1)));
        let mut next_check = Instant::now();
        let mut backoff = POLL_BACKOFF_MIN;
        let mut idle_rounds = 0;
        loop {
            let round =
                self.pool
                    .poller_round(&mut self.lanes, &mut idle_rounds, POLLER_LINGER_ROUNDS);
            let Some(withdrawn) = round else {
                return;
            };
            let mut progressed = !withdrawn.is_empty();
            withdrawn.into_iter().for_each(contain::drop);
            let mut index = 0;
            while let Some(&key) = self.lanes.get(index) {
                let (resolved, more) = self.resolve_reached(key);
                progressed |= resolved > 0;
                if more {
                    index += 1;
                } else {
                    self.lanes.remove(index);
                }
            }
            let mut pause = backoff;
            if let Some(every) = check_every {
                let now = Instant::now();
                if now >= next_check {
                    self.pool.warn_stuck();
                    next_check = now + every;
                }
                if self.lanes.is_empty() {
                    pause = next_check.saturating_duration_since(now);
                }
            }
            if progressed {
                backoff = POLL_BACKOFF_MIN;
            } else {
                self.pool.poller_pause(pause);
                backoff = (backoff * 2).min(POLL_BACKOFF_MAX);
            }
        }
    }
}

impl Drop for WaiterThread {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        crate::panics::log(|| {
            log::error!(
                "waiter thread {:?} ({:?}) unwound (a bug in the waiter); its lanes and waits go \
                 back to the pool",
                std::thread::current().name().unwrap_or("?"),
                self.owner
            );
        });
        let batch_lane = self.batch_lane.take();
        let actions = self
            .pool
            .recover(self.owner, &self.lanes, batch_lane, &mut self.batch);
        for action in actions {
            act(&self.pool, action);
        }
    }
}

/// How many of `batch`'s waits a query shows reached (or failed) before the
/// first not reached, and the failures by index.
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
