//! Recovery: a waiter thread lost (one the OS would not start, or one that unwound) gives back what
//! it held, so no count outlives the thread it counts and no future is left pending.

use super::contain;
use super::pool::Pool;
use super::state::{take, Action, Role, Server};
use super::threads::{act, Lost, WaiterThread};
use crate::ServerError;

impl Pool {
    /// Give back what thread `role` held (step 6 of [`crate::waiter`]), and the lanes queued for
    /// lane threads too (one may have counted on it); the poller runs while it has lanes or stalls
    /// to watch. What to do next.
    pub(super) fn recover(&self, role: Role, lost: Lost<'_>) -> Vec<Action> {
        let (max_threads, reports_stuck) = (self.shared.config.max_threads, self.reports_stuck());
        let (mut held, mut batch, mut queued) = (Vec::new(), Vec::new(), Vec::new());
        let mut state = self.lock();
        state.leave(role);
        let refused = match lost {
            Lost::NotStarted(err) => {
                crate::panics::log(|| log::error!("a waiter thread could not be started: {err}"));
                Some(err)
            }
            Lost::Unwound(thread) => {
                let batch_lane = thread.batch_lane.take();
                if let Some(lane) = batch_lane.and_then(|key| state.lanes.get_mut(&key)) {
                    // Exact: a batch is out of its lane until settled, then no more its lane's.
                    take(&mut lane.out, thread.batch.len(), "lane's batched waits");
                }
                batch.append(&mut thread.batch);
                for &key in &thread.lanes {
                    let server = role.server();
                    let Some(lane) = server.and_then(|server| state.lane_of(key, server)) else {
                        continue;
                    };
                    held.extend(lane.held.take());
                    lane.server = Server::Queued;
                    if lane.is_idle() {
                        state.lanes.remove(&key);
                    } else {
                        queued.push(key);
                    }
                }
                None
            }
        };
        if let Role::Lane(_) = role {
            queued.extend(state.for_threads.drain(..));
        }
        let entries = (role == Role::Watcher).then(|| std::mem::take(&mut state.watcher.list));
        let mut actions = Vec::new();
        if refused.is_some() && matches!(role, Role::Lane(_)) {
            state.for_poller.extend(queued);
        } else {
            let place = |key| state.place(key, max_threads, reports_stuck);
            actions.extend(queued.into_iter().map(place));
        }
        let poller_refused = refused.is_some() && role == Role::Poller;
        let for_poller = !state.for_poller.is_empty() || reports_stuck && !state.lanes.is_empty();
        if for_poller && !poller_refused && !state.shutdown {
            actions.push(state.poller_for_work());
        }
        let mut left = Vec::new();
        if poller_refused {
            while let Some(key) = state.for_poller.pop_front() {
                let lane = state.lanes.remove(&key);
                left.extend(lane.into_iter().flat_map(|lane| lane.waits.into_values()));
            }
            left.extend(std::mem::take(&mut state.withdrawn));
        }
        drop(state);
        entries.into_iter().flatten().for_each(contain::drop);
        let failure = match refused {
            Some(err) => ServerError::ThreadSpawn {
                component: "Waiter",
                reason: format!("no waiter thread could be started to serve it: {err}"),
                source: Some(crate::ErrorSource::new(err)),
            },
            None => ServerError::WaiterPanicked {
                message: "a waiter thread unwound while it held this wait".to_owned(),
            },
        };
        // Withdrawn waits are cancelled: failing them delivers nothing.
        self.fail(left.into_iter().chain(batch), &failure);
        for slot in held {
            self.deliver(&slot, Err(failure.clone()));
        }
        actions
    }
}

impl Drop for WaiterThread {
    /// Unwinding, give back what it held (a thread that returns has left the pool already).
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        crate::panics::log(|| {
            log::error!(
                "waiter thread {:?} ({:?}) unwound (a bug in the waiter); its lanes and waits go \
                 back to the pool",
                std::thread::current().name().unwrap_or("?"),
                self.role
            );
        });
        let pool = self.pool.clone();
        for action in pool.recover(self.role, Lost::Unwound(self)) {
            act(&pool, action);
        }
    }
}
