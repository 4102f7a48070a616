//! [`Handoff`]: the state machine behind every future the waiter serves: ask
//! once on the first poll, hand the wait to the pool if not reached, then
//! read the result from its slot.

use std::task::{Context, Poll};
use std::time::Instant;

use super::contain;
use super::pool::Pool;
use super::shard::Wait;
use super::slot::Slot;
use super::waitable::{LaneKey, Waitable};
use super::Waiter;
use crate::loom::Arc;
use crate::ServerError;

pub(crate) struct Handoff<W: Waitable> {
    state: State<W>,
    pool: PoolRef,
}

/// The pool a future's wait goes to: the global waiter's is looked up when
/// needed (it lives for the life of the process, and a forked child has its
/// own), so a future of `fence.await` does not touch the pool's shared
/// reference count (a cache line every executor thread would bounce);
/// another waiter's is shared.
pub(crate) enum PoolRef {
    Global,
    Owned(Pool),
}

impl PoolRef {
    fn get(&self) -> &Pool {
        match self {
            Self::Global => Waiter::global().pool(),
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

/// What a first poll came to.
enum FirstPoll {
    /// Ready at once: reached, failed, or refused by the pool.
    Resolved(Result<(), ServerError>),
    /// Handed to the pool, which will fill the slot.
    HandedOff(Handed),
}

/// A wait handed to the pool: where its result goes, where in the pool it
/// was placed (to take it out if the future is dropped), and the process
/// generation it was handed off in ([`crate::fork`]).
struct Handed {
    slot: Arc<Slot>,
    lane: LaneKey,
    placed: u64,
    generation: u64,
}

impl Handed {
    /// Whether it was handed off before this process forked: the thread that
    /// would resolve it is in the parent, and a lock on it may have been
    /// held there at the fork, so nothing of it is touched in the child.
    fn is_forked(&self) -> bool {
        self.generation != crate::fork::current()
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
            State::First(waitable) => match self.first_poll(waitable, cx) {
                FirstPoll::HandedOff(handed) => {
                    self.state = State::Waiting(handed);
                    Poll::Pending
                }
                FirstPoll::Resolved(result) => {
                    self.pool.get().counters.ready_at_first_poll();
                    Poll::Ready(result)
                }
            },
            State::Waiting(handed) if handed.is_forked() => {
                Poll::Ready(Err(ServerError::WaiterForked))
            }
            State::Waiting(handed) => match handed.slot.poll(cx) {
                Poll::Ready(result) => Poll::Ready(result),
                Poll::Pending => {
                    self.state = State::Waiting(handed);
                    Poll::Pending
                }
            },
            // A silent `Pending` would hang the caller for good (a combinator
            // handed a future it already polled to completion, say).
            State::Done => Poll::Ready(Err(ServerError::InvalidArgument {
                what: "poll",
                reason: "the future already completed and was polled again".into(),
            })),
        }
    }

    /// The first poll: ask (and spin, if the waiter allows) before handing
    /// off.
    fn first_poll(&self, waitable: W, cx: &mut Context<'_>) -> FirstPoll {
        let pool = self.pool.get();
        let budget = pool.config.spin_budget;
        // Read the clock only when spinning is allowed: a ready fence's await
        // costs one query.
        let started = (!budget.is_zero()).then(Instant::now);
        let mut first = true;
        loop {
            // Whether another query may follow this one, decided before it:
            // a thread preempted past the budget still makes the query it
            // was due, so a fence reached meanwhile is caught.
            let may_spin = started.is_some_and(|started| first || started.elapsed() < budget);
            first = false;
            match contain::backend(|| waitable.query()) {
                Ok(true) => return FirstPoll::Resolved(Ok(())),
                Err(err) => return FirstPoll::Resolved(Err(err)),
                Ok(false) if may_spin => std::hint::spin_loop(),
                Ok(false) => break,
            }
        }
        // The lane hashes the backend's stream handle: its code too.
        let lane = match contain::backend(|| Ok(waitable.lane())) {
            Ok(lane) => lane,
            Err(err) => return FirstPoll::Resolved(Err(err)),
        };
        let slot = Arc::new(Slot::new(cx.waker().clone()));
        let wait = Wait::new(Box::new(waitable), slot.clone(), lane);
        match pool.submit(wait) {
            Ok((lane, placed)) => FirstPoll::HandedOff(Handed {
                slot,
                lane,
                placed,
                generation: pool.generation(),
            }),
            Err(err) => FirstPoll::Resolved(Err(err)),
        }
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
    /// Cancel a handed-off wait and take it out of its lane, so a waiter
    /// thread destroys its event now rather than when the lane's thread
    /// reaches it. A wait a thread has already taken out stays with that
    /// thread, which drops it.
    fn drop(&mut self) {
        if let State::Waiting(handed) = &self.state {
            if handed.is_forked() {
                return;
            }
            let pool = self.pool.get();
            handed.slot.cancel(&pool.counters);
            pool.withdraw(handed.lane, handed.placed, &handed.slot);
        }
    }
}
