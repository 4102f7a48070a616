//! [`Slot`]: where a waiter thread leaves a wait's result for its future.
//!
//! A mutex-guarded state rather than a lock-free cell: it is touched twice
//! per wait (hand-off and completion), and a lock keeps it small enough for
//! loom to check every interleaving. Owners: the future owns the waker it
//! stores and the result once taken; the waiter owns the entry until it calls
//! [`Slot::complete`]; `cancelled` is set only by the future's drop;
//! `moved_to` is set under the wait's shard lock by whoever puts the wait
//! back in its lane somewhere else than where it was first placed.

use std::task::{Context, Poll, Waker};
use std::time::Instant;

use super::contain;
use super::stats::Counters;
use crate::loom::Mutex;
use crate::ServerError;

pub(crate) struct Slot {
    state: Mutex<SlotState>,
    /// When the wait was handed off, for the waiter's wake latencies.
    handed_at: Instant,
}

struct SlotState {
    result: Option<Result<(), ServerError>>,
    /// A result was left here (and maybe taken since): the first stands.
    done: bool,
    waker: Option<Waker>,
    cancelled: bool,
    /// Where in its lane the wait sits, when that is no longer the place
    /// its submit returned: it was taken out and its place was taken by
    /// another wait meanwhile (two streams whose keys collide). `None`
    /// otherwise, which is always.
    moved_to: Option<u64>,
}

impl Slot {
    pub(crate) fn new(waker: Waker) -> Self {
        Self {
            state: Mutex::new(SlotState {
                result: None,
                done: false,
                waker: Some(waker),
                cancelled: false,
                moved_to: None,
            }),
            handed_at: Instant::now(),
        }
    }

    /// Leave `result` for the future and wake it, counting it in
    /// `counters`; a no-op once cancelled or completed (the first result
    /// stands). A waker that panics costs only its own wake-up: the panic is
    /// logged and goes no further.
    pub(crate) fn complete(&self, result: Result<(), ServerError>, counters: &Counters) {
        let waker = {
            let mut state = self.state.lock();
            if state.cancelled || state.done {
                return;
            }
            counters.delivered(result.is_ok(), self.handed_at);
            state.done = true;
            state.result = Some(result);
            state.waker.take()
        };
        // Woken outside the lock: a waker may run the task inline.
        if let Some(waker) = waker {
            contain::wake(waker);
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

    /// The future was dropped: nobody wants the result any more. Counted in
    /// `counters` unless its result had come.
    pub(crate) fn cancel(&self, counters: &Counters) {
        let waker = {
            let mut state = self.state.lock();
            let done = state.done && !crate::plant::planted("cancel-counts-a-delivered-wait");
            if !done && !state.cancelled {
                counters.cancelled();
            }
            state.cancelled = true;
            state.result = None;
            state.waker.take()
        };
        // Dropped outside the lock: a waker's drop is code we do not own.
        drop(waker);
    }

    /// When the wait was handed off.
    pub(crate) fn handed_at(&self) -> Instant {
        self.handed_at
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.state.lock().cancelled
    }

    /// The wait was put back in its lane at `place`, not where its submit
    /// placed it. Called under the wait's shard lock.
    pub(crate) fn moved_to(&self, place: u64) {
        self.state.lock().moved_to = Some(place);
    }

    /// Where the wait sits in its lane, given where its submit placed it.
    /// Read under the wait's shard lock.
    pub(crate) fn place(&self, placed: u64) -> u64 {
        self.state.lock().moved_to.unwrap_or(placed)
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc as StdArc;
    use std::task::{Context, Poll, Wake, Waker};

    use super::Slot;
    use crate::waiter::stats::Counters;
    use crate::ServerError;

    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: StdArc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counting() -> (Waker, StdArc<Counting>) {
        let counter = StdArc::new(Counting(AtomicUsize::new(0)));
        (Waker::from(counter.clone()), counter)
    }

    #[test]
    fn the_first_result_stands() {
        let (waker, wakes) = counting();
        let slot = Slot::new(waker.clone());
        slot.complete(Ok(()), &Counters::default());
        slot.complete(Err(ServerError::WaiterGone), &Counters::default());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "woken once");
        let mut cx = Context::from_waker(&waker);
        assert_eq!(slot.poll(&mut cx), Poll::Ready(Ok(())));
    }

    #[test]
    fn a_cancelled_slot_is_never_completed_or_woken() {
        let (waker, wakes) = counting();
        let slot = Slot::new(waker.clone());
        assert!(!slot.is_cancelled());
        slot.cancel(&Counters::default());
        assert!(slot.is_cancelled());
        slot.complete(Ok(()), &Counters::default());
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            0,
            "a cancelled wait wakes nobody"
        );
        let mut cx = Context::from_waker(&waker);
        assert!(slot.poll(&mut cx).is_pending(), "nor keeps a result");
    }

    #[test]
    fn a_panicking_waker_costs_only_its_wake() {
        struct Panicking;
        impl Wake for Panicking {
            fn wake(self: StdArc<Self>) {
                panic!("a waker that panics");
            }
        }
        let slot = Slot::new(Waker::from(StdArc::new(Panicking)));
        slot.complete(Ok(()), &Counters::default()); // does not unwind
        let (waker, _) = counting();
        assert_eq!(
            slot.poll(&mut Context::from_waker(&waker)),
            Poll::Ready(Ok(()))
        );
    }

    #[test]
    fn each_wait_counts_one_outcome_whichever_comes_first() {
        let counters = Counters::default();
        let (waker, _) = counting();
        // Its result came, then its future was dropped unpolled: resolved.
        let delivered = Slot::new(waker.clone());
        delivered.complete(Ok(()), &counters);
        delivered.cancel(&counters);
        // Dropped first, then the device got there: cancelled.
        let dropped = Slot::new(waker.clone());
        dropped.cancel(&counters);
        dropped.complete(Ok(()), &counters);
        dropped.cancel(&counters);
        // Failed, then failed again (shutdown after a fault): one failure.
        let failed = Slot::new(waker);
        failed.complete(Err(ServerError::WaiterGone), &counters);
        failed.complete(Err(ServerError::WaiterGone), &counters);
        let counts = counters.read();
        assert_eq!(
            (counts.resolved, counts.cancelled, counts.failed),
            (1, 1, 1)
        );
        assert_eq!(counts.wake_latency.count(), 2);
    }

    #[test]
    fn a_moved_wait_is_found_where_it_went() {
        let (waker, _) = counting();
        let slot = Slot::new(waker);
        assert_eq!(slot.place(7), 7);
        slot.moved_to(9);
        assert_eq!(slot.place(7), 9);
    }
}
