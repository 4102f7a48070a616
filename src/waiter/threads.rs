//! The waiter's threads: how they start and serve lanes, and the guard that gives back what one
//! held if it unwinds (its `Drop` is in `recovery.rs`).

use std::time::Duration;

use super::contain;
use super::pool::{AfterHold, Ended, Pool};
use super::state::{Action, Role, Server};
use super::wait::Wait;
use super::waitable::LaneKey;
use crate::sync::thread;
use crate::ServerError;

/// The most waits a thread takes out of a lane to query in one round.
const BATCH: usize = 256;

/// Wake and start what `action` says, with no lock held (a thread name std would panic on never
/// gets here: the pool refuses it).
pub(super) fn act(pool: &Pool, action: Action) {
    pool.notify(&action);
    let lane = action.spawn_thread.map(Role::Lane);
    let poller = action.spawn_poller.then_some(Role::Poller);
    let watcher = action.spawn_watcher.then_some(Role::Watcher);
    let prefix = &pool.config().thread_name;
    for role in lane.into_iter().chain(poller).chain(watcher) {
        let name = match role {
            Role::Lane(n) => format!("{prefix}-{n}"),
            Role::Poller => format!("{prefix}-poller"),
            Role::Watcher => format!("{prefix}-watcher"),
        };
        let worker = pool.clone();
        let spawned = thread::Builder::new()
            .name(name)
            .spawn(move || WaiterThread::run(worker, role));
        if let Err(err) = spawned {
            for next in pool.recover(role, Lost::NotStarted(err)) {
                act(pool, next);
            }
        }
    }
}

/// How a waiter thread was lost; recovery (`recovery.rs`) gives back what it held.
pub(super) enum Lost<'a> {
    /// The OS would not start it.
    NotStarted(std::io::Error),
    /// It unwound (a bug in the waiter), with the lanes and batch it held.
    Unwound(&'a mut WaiterThread),
}

/// A waiter thread's lanes and batch, which [`Pool::recover`] gives back if it unwinds.
pub(super) struct WaiterThread {
    pub(super) pool: Pool,
    pub(super) role: Role,
    /// At most one for a lane thread; the poller's list.
    pub(super) lanes: Vec<LaneKey>,
    pub(super) batch: Vec<Wait>,
    /// The lane the batch was taken from, while it is out.
    pub(super) batch_lane: Option<LaneKey>,
}

impl WaiterThread {
    fn run(pool: Pool, role: Role) {
        crate::os::mark_own_thread();
        let mut this = WaiterThread {
            pool,
            role,
            lanes: Vec::new(),
            // Sized now, not mid-burst: a large allocation then made the allocator consolidate,
            // which measurably slowed a first batch.
            batch: Vec::with_capacity(BATCH),
            batch_lane: None,
        };
        match role {
            Role::Lane(n) => this.run_lane_thread(n),
            Role::Poller => this.run_poller(),
            Role::Watcher => this.run_watcher(),
        }
    }

    /// Lane thread `n`: take a lane, serve it until it is idle, take the next.
    fn run_lane_thread(&mut self, n: usize) {
        let mut finished = None;
        while let Some(key) = self.pool.next_lane(n, finished.take()) {
            self.lanes.clear();
            self.lanes.push(key);
            self.serve_lane(key, Server::Thread(n));
            finished = Some(key);
        }
    }

    /// Serve lane `key` as `by` until it is empty or another's (step 3 of [`crate::waiter`]).
    fn serve_lane(&mut self, key: LaneKey, by: Server) {
        // Whether the lane's history, as its last wait ended, says to offer the next to a watcher.
        let mut watch = true;
        let mut wait = self.pool.lock().take_oldest(key, by);
        while let Some(held) = wait.take() {
            let (result, took) = self.wait_out(&held, watch);
            let ended = Ended::Driver {
                result,
                took,
                take_next: Some(by),
            };
            let after: AfterHold = self.pool.end_hold(key, &held.slot, ended);
            watch = after.watch_next;
            // Its future is woken first; then its fence (its event) goes.
            contain::drop(held);
            let Some(next) = after.next else {
                return;
            };
            let result = match contain::backend(|| next.waitable.query()) {
                Ok(false) => {
                    wait = Some(next);
                    continue;
                }
                reached => reached.map(drop),
            };
            let ended = Ended::Driver {
                result,
                took: None,
                take_next: None,
            };
            let _ = self.pool.end_hold(key, &next.slot, ended);
            contain::drop(next);
            if self.resolve_reached(key, by).more {
                wait = self.pool.lock().take_oldest(key, by);
            }
        }
    }

    /// Block in the driver on `wait`, first offered to the watcher if `watch` (step 3 of
    /// [`crate::waiter`]): its result, and, where watchers are on, how long it took.
    fn wait_out(&self, wait: &Wait, watch: bool) -> (Result<(), ServerError>, Option<Duration>) {
        if self.pool.config().watchers == 0 {
            return (contain::backend(|| wait.waitable.block()), None);
        }
        let started = self.pool.now();
        let word = watch.then(|| contain::backend(|| Ok(wait.waitable.progress())));
        let word = word.and_then(|word| word.ok().flatten());
        if let Some(action) = word.and_then(|word| self.pool.watch(wait, &word, started)) {
            act(&self.pool, action);
        }
        let result = contain::backend(|| wait.waitable.block());
        let took = self.pool.now().saturating_duration_since(started);
        (result, Some(took))
    }

    /// Resolve `key`'s waits in order up to the first a query shows not reached, in batches asked
    /// outside the lock (steps 3 and 4 of [`crate::waiter`]).
    pub(super) fn resolve_reached(&mut self, key: LaneKey, by: Server) -> Resolved {
        let mut limit = if by == Server::Poller { 1 } else { 2 };
        let mut resolved = 0;
        let more = loop {
            if !self.pool.take_batch(key, by, limit, &mut self.batch) {
                break false;
            }
            self.batch_lane = Some(key);
            // Asked in order, up to the first not reached; those that failed, by index.
            let mut failed = Vec::new();
            let not_reached = self.batch.iter().enumerate().position(|(index, wait)| {
                match contain::backend(|| wait.waitable.query()) {
                    Ok(reached) => !reached,
                    Err(err) => {
                        failed.push((index, err));
                        false
                    }
                }
            });
            let reached = not_reached.unwrap_or(self.batch.len());
            let rest = self.batch.split_off(reached);
            let more = !rest.is_empty();
            resolved += reached;
            limit = (limit * 2).min(BATCH);
            self.pool.settle(key, reached, rest);
            // Settled: the batch is its lane's no more, whatever happens next.
            self.batch_lane = None;
            let mut failed = failed.into_iter().peekable();
            for (index, wait) in self.batch.iter().enumerate() {
                let failure = failed.next_if(|(at, _)| *at == index);
                self.pool
                    .deliver(&wait.slot, failure.map_or(Ok(()), |(_, err)| Err(err)));
            }
            self.batch.drain(..).for_each(contain::drop);
            if more {
                break true;
            }
        };
        Resolved { resolved, more }
    }
}

/// What [`WaiterThread::resolve_reached`] did.
pub(super) struct Resolved {
    /// How many waits it resolved.
    pub(super) resolved: usize,
    /// Whether the lane has more and is still this thread's.
    pub(super) more: bool,
}
