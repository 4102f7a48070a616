//! [`Slot`]: where a waiter thread leaves a wait's result for its future (a mutex, touched twice
//! per wait, that loom checks whole).

use std::task::{Context, Poll, Waker};
use std::time::Instant;

use super::contain;
use crate::sync::Mutex;
use crate::ServerError;

pub(crate) struct Slot {
    state: Mutex<SlotState>,
    /// When the wait was handed off, for the wake latencies.
    handed_at: Instant,
}

struct SlotState {
    result: Option<Result<(), ServerError>>,
    /// A result was left here (and maybe taken since): the first stands.
    done: bool,
    waker: Option<Waker>,
    cancelled: bool,
}

impl Slot {
    pub(crate) fn new(waker: Waker) -> Self {
        Self {
            state: Mutex::new(SlotState {
                result: None,
                done: false,
                waker: Some(waker),
                cancelled: false,
            }),
            handed_at: Instant::now(),
        }
    }

    /// Leave `result` for the future and wake it, once, unless cancelled: whether it did.
    /// `delivered` (is it `Ok`; the hand-off's time) counts it first.
    pub(crate) fn complete(
        &self,
        result: Result<(), ServerError>,
        delivered: impl FnOnce(bool, Instant),
    ) -> bool {
        let waker = {
            let mut state = self.state.lock();
            if state.cancelled || state.done {
                return false;
            }
            delivered(result.is_ok(), self.handed_at);
            state.done = true;
            state.result = Some(result);
            state.waker.take()
        };
        // Woken outside the lock: a waker may run the task inline.
        if let Some(waker) = waker {
            contain::wake(waker);
        }
        true
    }

    /// The result if it is there; otherwise remember `cx`'s waker.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<(), ServerError>> {
        let mut state = self.state.lock();
        if let Some(result) = state.result.take() {
            return Poll::Ready(result);
        }
        match &mut state.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            waker => *waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// The future was dropped: whether it counts as cancelled (first).
    pub(crate) fn cancel(&self) -> bool {
        let (counts, waker) = {
            let mut state = self.state.lock();
            let counts = !state.done && !state.cancelled;
            state.cancelled = true;
            state.result = None;
            (counts, state.waker.take())
        };
        // Dropped outside the lock: a waker's drop is code we do not own.
        drop(waker);
        counts
    }

    pub(crate) fn handed_at(&self) -> Instant {
        self.handed_at
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }
}
