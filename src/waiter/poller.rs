//! The poller: serves the lanes past `max_threads` by asking them in rounds, drops withdrawn waits,
//! and warns of stalls. See [`crate::waiter`], step 4.

use std::time::{Duration, Instant};

use super::contain;
use super::state::{Role, Server};
use super::threads::{Resolved, WaiterThread};
use super::wait::Wait;

/// The poller's first pause after a round without progress.
pub(super) const POLL_BACKOFF_MIN: Duration = Duration::from_micros(50);
/// The poller's longest pause: the most latency a polled lane can add.
pub(super) const POLL_BACKOFF_MAX: Duration = Duration::from_millis(1);
/// Idle rounds before the poller exits (none under loom: fewer states).
const POLLER_LINGER_ROUNDS: u32 = if cfg!(device_events_loom) { 0 } else { 6 };

/// How often the poller looks for stalls past `stuck_after`.
pub(super) fn looks_every(stuck_after: Duration) -> Duration {
    (stuck_after / 4).max(Duration::from_millis(1))
}

impl WaiterThread {
    /// The poller's loop: rounds as this file's doc says, backing off while nothing moves.
    pub(super) fn run_poller(&mut self) {
        let check_every = self.pool.config().stuck_after.map(looks_every);
        let mut next_check = Instant::now();
        let mut backoff = POLL_BACKOFF_MIN;
        let mut idle_rounds = 0;
        loop {
            let Some(withdrawn) = self.poller_round(&mut idle_rounds) else {
                return;
            };
            let mut progressed = !withdrawn.is_empty();
            withdrawn.into_iter().for_each(contain::drop);
            let mut index = 0;
            while let Some(&key) = self.lanes.get(index) {
                let Resolved { resolved, more } = self.resolve_reached(key, Server::Poller);
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
                self.poller_pause(pause);
                backoff = (backoff * 2).min(POLL_BACKOFF_MAX);
            }
        }
    }

    /// A round: adopt its queued lanes, take the withdrawn waits, wake an idle lane thread if it
    /// has lanes. `None` (and uncounted) to exit: idle `POLLER_LINGER_ROUNDS` rounds, or shut down.
    #[cfg_attr(device_events_loom, allow(clippy::absurd_extreme_comparisons))]
    fn poller_round(&mut self, idle_rounds: &mut u32) -> Option<Vec<Wait>> {
        let mut state = self.pool.lock();
        let withdrawn = std::mem::take(&mut state.withdrawn);
        let adopted = !state.for_poller.is_empty();
        while let Some(key) = state.for_poller.pop_front() {
            state.lanes.get_mut(&key).expect("a queued lane").server = Server::Poller;
            if !self.lanes.contains(&key) {
                self.lanes.push(key);
            }
        }
        let idle = self.lanes.is_empty() && !adopted && withdrawn.is_empty();
        let reports_stuck = self.pool.reports_stuck() && !state.lanes.is_empty();
        if idle && !reports_stuck && (*idle_rounds >= POLLER_LINGER_ROUNDS || state.shutdown) {
            state.leave(Role::Poller);
            return None;
        }
        *idle_rounds = if idle { *idle_rounds + 1 } else { 0 };
        if !self.lanes.is_empty() && state.wake_idle() {
            drop(state);
            self.pool.shared.work.notify_one();
        }
        Some(withdrawn)
    }

    /// Sleep up to `pause` between rounds, unless work came.
    fn poller_pause(&self, pause: Duration) {
        let state = self.pool.lock();
        if state.for_poller.is_empty() && state.withdrawn.is_empty() && !state.shutdown {
            // Under loom a zero timeout is a yield: the model explores both.
            #[cfg(device_events_loom)]
            let pause = pause.min(Duration::ZERO);
            drop(state.wait_timeout(&self.pool.shared.poller_work, pause));
        }
    }
}
