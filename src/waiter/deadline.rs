//! Blocking on a waiter's future with a deadline, without spinning: for
//! synchronous callers (a watchdog thread, say) that must be able to give up
//! on a wait that a hung kernel would make last forever.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Instant;

use crate::loom::{Condvar, Mutex};

/// Wakes the blocked caller: a flag and a condition variable, so a wake-up
/// that comes before the caller sleeps is not lost.
#[derive(Default)]
struct Signal {
    woken: Mutex<bool>,
    changed: Condvar,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        *self.woken.lock() = true;
        self.changed.notify_one();
    }
}

/// Poll `future` on this thread, sleeping between polls until its waker
/// fires, until it is ready or `deadline` passes: `None` then, and the future
/// is left as it was, to be waited on again or dropped.
pub(super) fn block_until<F: Future + Unpin>(
    future: &mut F,
    deadline: Instant,
) -> Option<F::Output> {
    let signal = Arc::new(Signal::default());
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(output) = Pin::new(&mut *future).poll(&mut cx) {
            return Some(output);
        }
        let mut woken = signal.woken.lock();
        while !*woken {
            let left = deadline.checked_duration_since(Instant::now())?;
            if left.is_zero() {
                return None;
            }
            woken = signal.changed.wait_timeout(woken, left).0;
        }
        *woken = false;
    }
}
