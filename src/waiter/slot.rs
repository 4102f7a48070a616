//! [`Slot`]: where a waiter thread leaves a wait's result for its future.
//!
//! A mutex-guarded state rather than a lock-free cell: it is touched twice
//! per wait (hand-off and completion), and a lock keeps it small enough for
//! loom to check every interleaving. Owners: the future owns the waker it
//! stores and the result once taken; the waiter owns the entry until it calls
//! [`Slot::complete`]; `cancelled` is set only by the future's drop.

use std::task::{Context, Poll, Waker};

use crate::loom::Mutex;
use crate::ServerError;

pub(crate) struct Slot {
    state: Mutex<SlotState>,
}

struct SlotState {
    result: Option<Result<(), ServerError>>,
    waker: Option<Waker>,
    cancelled: bool,
}

impl Slot {
    pub(crate) fn new(waker: Waker) -> Self {
        Self {
            state: Mutex::new(SlotState {
                result: None,
                waker: Some(waker),
                cancelled: false,
            }),
        }
    }

    /// Leave `result` for the future and wake it; a no-op once cancelled.
    pub(crate) fn complete(&self, result: Result<(), ServerError>) {
        let waker = {
            let mut state = self.state.lock();
            if state.cancelled || state.result.is_some() {
                return;
            }
            state.result = Some(result);
            state.waker.take()
        };
        // Woken outside the lock: a waker may run the task inline.
        if let Some(waker) = waker {
            waker.wake();
        }
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

    /// The future was dropped: nobody wants the result any more.
    pub(crate) fn cancel(&self) {
        let waker = {
            let mut state = self.state.lock();
            state.cancelled = true;
            state.result = None;
            state.waker.take()
        };
        drop(waker);
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }
}
