//! [`Handoff`]: the state machine behind every future the waiter serves.

use std::task::{Context, Poll};
use std::time::Instant;

use super::contain;
use super::pool::Pool;
use super::slot::Slot;
use super::threads;
use super::wait::{Place, Wait};
use super::waitable::{LaneKey, Waitable};
use crate::sync::Arc;
use crate::ServerError;

pub(crate) struct Handoff<W: Waitable> {
    state: State<W>,
    pool: PoolRef,
}

/// The global waiter's pool is looked up when needed (a forked child has its own), so a
/// `fence.await` touches no shared reference count.
pub(crate) enum PoolRef {
    Global(fn() -> &'static Pool),
    Owned(Pool),
}

impl PoolRef {
    fn get(&self) -> &Pool {
        match self {
            Self::Global(global) => global(),
            Self::Owned(pool) => pool,
        }
    }
}

enum State<W> {
    /// Not polled yet: the waitable is still here.
    First(W),
    /// Handed to the waiter.
    Waiting(Handed),
    Done,
}

/// A wait handed to the pool, and the process generation ([`crate::os`]).
struct Handed {
    slot: Arc<Slot>,
    lane: LaneKey,
    place: Place,
    generation: u64,
}

impl Handed {
    /// Handed off before this process forked: its thread is in the parent.
    fn is_forked(&self) -> bool {
        self.generation != crate::os::fork_generation()
    }
}

impl<W: Waitable> Handoff<W> {
    pub(crate) fn new(waitable: W, pool: PoolRef) -> Self {
        Self {
            state: State::First(waitable),
            pool,
        }
    }

    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ServerError>> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::First(waitable) => {
                let poll = self.first_poll(waitable, cx);
                if poll.is_ready() {
                    self.pool.get().counters().ready_at_first_poll();
                }
                poll
            }
            State::Waiting(handed) if handed.is_forked() => {
                Poll::Ready(Err(ServerError::WaiterForked))
            }
            State::Waiting(handed) => {
                let result = handed.slot.poll(cx);
                if result.is_pending() {
                    self.state = State::Waiting(handed);
                }
                result
            }
            // A silent `Pending` would hang the caller for good.
            State::Done => Poll::Ready(Err(ServerError::InvalidArgument {
                what: "poll",
                reason: "the future already completed and was polled again".into(),
            })),
        }
    }

    /// Ask (and spin, if allowed): ready if reached, failed or refused, else handed off, `Waiting`.
    fn first_poll(&mut self, waitable: W, cx: &mut Context<'_>) -> Poll<Result<(), ServerError>> {
        let pool = self.pool.get();
        let budget = pool.config().spin_budget;
        // The clock is read only when spinning: a ready await is one query.
        let started = (!budget.is_zero()).then(Instant::now);
        let in_budget = || started.is_some_and(|started| started.elapsed() < budget);
        let sequence = waitable.sequence();
        let mut first = true;
        let mut word = None;
        loop {
            // Decided before the query, which one preempted past it still makes.
            let may_spin = started.is_some() && (first || in_budget());
            match contain::backend(|| waitable.query())? {
                true => return Poll::Ready(Ok(())),
                false if may_spin => {}
                false => break,
            }
            if std::mem::take(&mut first) {
                word = contain::backend(|| Ok(waitable.progress())).ok().flatten();
            }
            // With a progress word, spin on it (a load, not a driver call) and ask once it says
            // passed, or once the budget is spent.
            while word.as_ref().is_some_and(|word| !word.passed(sequence)) && in_budget() {
                std::hint::spin_loop();
            }
            std::hint::spin_loop();
        }
        // The lane and the name come from the backend's handle: its code.
        let lane = contain::backend(|| Ok(waitable.lane()))?;
        let name = pool.config().stuck_after.map(|_| {
            let name = contain::backend(|| Ok(waitable.stream_name()));
            std::sync::Arc::from(name.unwrap_or_else(|err| format!("a stream ({err})")))
        });
        let slot = Arc::new(Slot::new(cx.waker().clone()));
        let wait = Wait::new(std::sync::Arc::new(waitable), slot.clone(), lane, name);
        let (place, action) = pool.submit(wait)?;
        threads::act(pool, action);
        self.state = State::Waiting(Handed {
            slot,
            lane,
            place,
            generation: pool.shared.fork_generation,
        });
        Poll::Pending
    }

    pub(crate) fn is_terminated(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// For `Debug`: where the future is.
    pub(crate) fn phase(&self) -> &'static str {
        match self.state {
            State::First(_) => "first poll",
            State::Waiting(_) => "waiting",
            State::Done => "done",
        }
    }
}

impl<W: Waitable> Drop for Handoff<W> {
    /// Cancel and withdraw a handed-off wait: its event goes now.
    fn drop(&mut self) {
        let State::Waiting(handed) = &self.state else {
            return;
        };
        if !handed.is_forked() {
            let pool = self.pool.get();
            if handed.slot.cancel() {
                pool.counters().cancelled();
            }
            threads::act(pool, pool.withdraw(handed.lane, handed.place));
        }
    }
}
