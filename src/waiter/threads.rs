//! The waiter's threads: how they start and serve lanes, and the guard that
//! gives back what one held if it unwinds (its `Drop` is in `recovery.rs`).

use std::time::Duration;

use super::contain;
use super::pool::Pool;
use super::state::{Action, Owner, Wait};
use super::waitable::LaneKey;
use super::watcher::Held;
use crate::sync::thread;
use crate::ServerError;

/// The most waits a thread takes out of a lane to query in one round.
const BATCH: usize = 256;

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
pub(super) struct WaiterThread {
    pub(super) pool: Pool,
    pub(super) owner: Owner,
    /// At most one for a lane thread; the poller's list.
    pub(super) lanes: Vec<LaneKey>,
    pub(super) batch: Vec<Wait>,
    /// The lane the batch was taken from, while it is out.
    pub(super) batch_lane: Option<LaneKey>,
    /// Cleared once the pool has uncounted it as it left.
    pub(super) counted: bool,
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
            if !self.resolve_reached(key).more {
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
        let started = self.pool.now();
        // Decided without the lock where the lane's last wait says so.
        if !super::watcher::too_short(predicted, self.pool.watcher_early(started)) {
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
        let took = self.pool.now().saturating_duration_since(started);
        (result, Some(took))
    }

    /// Resolve, in order, the waits of `key` a query shows reached, up to
    /// the first that is not, in batches: taken out in one hold of the lock,
    /// asked outside it, the rest put back in one more. Each batch all
    /// reached doubles the next, from 2 (1 for the poller, which mostly hears
    /// "not yet") up to [`BATCH`].
    pub(super) fn resolve_reached(&mut self, key: LaneKey) -> Resolved {
        let poller = self.owner == Owner::Poller;
        let mut limit = if poller { 1 } else { 2 };
        let mut resolved = 0;
        loop {
            if !self
                .pool
                .take_batch(key, self.owner, limit, &mut self.batch)
            {
                return Resolved {
                    resolved,
                    more: false,
                };
            }
            self.batch_lane = Some(key);
            self.pool.planted_escape(self.owner);
            let (reached, failed) = reached_prefix(&self.batch);
            let rest = self.batch.split_off(reached);
            let more = !rest.is_empty();
            resolved += reached;
            limit = (limit * 2).min(BATCH);
            self.pool.settle(key, rest, reached);
            // Settled: the batch is its lane's no more, whatever happens next.
            self.batch_lane = None;
            let mut failed = failed.into_iter().peekable();
            for (index, wait) in self.batch.iter().enumerate() {
                let result = match failed.next_if(|(at, _)| *at == index) {
                    Some((_, err)) => Err(err),
                    None => Ok(()),
                };
                self.pool.deliver(&wait.slot, result);
            }
            self.batch.drain(..).for_each(contain::drop);
            if more {
                return Resolved {
                    resolved,
                    more: true,
                };
            }
        }
    }
}

/// What [`WaiterThread::resolve_reached`] did.
pub(super) struct Resolved {
    /// How many waits it resolved.
    pub(super) resolved: usize,
    /// Whether the lane has more and is still this thread's.
    pub(super) more: bool,
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
