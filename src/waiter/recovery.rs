//! Recovery: a thread that could not be started, or that unwound, gives back what it held, so
//! no count outlives the thread it counts and no future is left pending.

use super::contain;
use super::pool::Pool;
use super::state::{take, Action, Owner, Wait};
use super::threads::{act, WaiterThread};
use super::waitable::LaneKey;
use crate::ServerError;

impl Pool {
    /// Thread `owner` could not be started: uncount it. A lane thread's lanes
    /// go to the poller; a poller's fail (no lane thread may ever be free).
    pub(super) fn spawn_failed(&self, owner: Owner, err: std::io::Error) -> Action {
        crate::panics::log(|| log::error!("a waiter thread could not be started: {err}"));
        let mut state = self.lock();
        state.leave(owner);
        if owner == Owner::Watcher {
            // Its entries' lane threads block in the driver: they end there.
            let entries = state.unwatch_all();
            drop(state);
            entries.into_iter().for_each(contain::drop);
            return Action::default();
        }
        if owner != Owner::Poller {
            let lanes = std::mem::take(&mut state.for_threads);
            // Plant for loom model `loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller`.
            if super::plant::planted("refused-lane-left-for-threads") {
                state.for_threads.extend(lanes);
            } else {
                state.for_poller.extend(lanes);
            }
            if !state.poller && !state.shutdown {
                return state.poller_for_work();
            }
        }
        if state.poller {
            // It may be asleep for a while (between stall checks): the lanes are its now.
            return state.poller_for_work();
        }
        let mut failed = Vec::new();
        while let Some(key) = state.for_poller.pop_front() {
            let lane = state.lanes.remove(&key);
            failed.extend(lane.into_iter().flat_map(|lane| lane.waits.into_values()));
        }
        let withdrawn = std::mem::take(&mut state.withdrawn);
        drop(state);
        withdrawn.into_iter().for_each(contain::drop);
        let failure = ServerError::ThreadSpawn {
            component: "Waiter",
            reason: format!("no waiter thread could be started to serve it: {err}"),
            source: Some(crate::ErrorSource::new(err)),
        };
        self.fail(failed, &failure);
        Action::default()
    }

    /// Give back what a thread that unwound held: fail its `batch` (out of
    /// `batch_lane`) and held wait, uncount it, queue its `lanes` again.
    pub(super) fn recover(
        &self,
        owner: Owner,
        lanes: &[LaneKey],
        batch_lane: Option<LaneKey>,
        batch: &mut Vec<Wait>,
    ) -> Vec<Action> {
        let (max_threads, reports_stuck) = (self.shared.config.max_threads, self.reports_stuck());
        let mut held = Vec::new();
        let mut state = self.lock();
        if let Some(lane) = batch_lane.and_then(|key| state.lanes.get_mut(&key)) {
            // Exact: a batch is out of its lane until it is settled, and then no more its lane's.
            take(&mut lane.out, batch.len(), "lane's batched waits");
        }
        state.leave(owner);
        // Placed again: one of them may have counted on this thread.
        let mut placed = std::mem::take(&mut state.for_threads);
        for &key in lanes {
            let Some(lane) = state.lane_of(key, owner) else {
                continue;
            };
            held.extend(lane.held.take());
            lane.owner = Owner::Queued;
            if lane.is_idle() {
                state.lanes.remove(&key);
            } else {
                placed.push_back(key);
            }
        }
        let mut actions: Vec<Action> = placed
            .into_iter()
            .map(|key| state.place(key, max_threads, reports_stuck))
            .collect();
        // A watcher lost with entries left is started again.
        if owner == Owner::Watcher && !state.watched.is_empty() && !state.shutdown {
            actions.push(state.watcher_for_work(None));
        }
        // The poller watches while a lane is left, even if it was the one lost.
        if reports_stuck && !state.poller && !state.shutdown && !state.lanes.is_empty() {
            actions.push(state.poller_for_work());
        }
        drop(state);
        let failure = ServerError::WaiterPanicked {
            message: "a waiter thread unwound while it held this wait".to_owned(),
        };
        // A no-op for those of the batch it had already resolved.
        self.fail(batch.drain(..), &failure);
        for slot in held {
            self.deliver(&slot, Err(failure.clone()));
        }
        actions
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
