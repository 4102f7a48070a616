//! What the pool's unit tests share: a pool of their own, waits on a
//! [`Device`] handed to it, and waiting for results and conditions with a
//! limit (a test failure, not a hang).

use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::mock_device::{Device, MockFence};
use super::pool::{Config, Pool};
use super::shard::Wait;
use super::slot::Slot;
use super::waitable::LaneKey;
use crate::ServerError;

/// The longest any test here waits for anything.
pub(super) const LIMIT: Duration = Duration::from_secs(20);

/// A pool named `name`, with at most `max_threads` lane threads that stay
/// `keep_alive` when idle, and one resolve permit.
pub(super) fn pool(name: &str, max_threads: usize, keep_alive: Duration) -> Pool {
    Pool::new(Config {
        max_threads,
        keep_alive,
        thread_name: name.to_owned(),
        spin_budget: Duration::ZERO,
        resolvers: 1,
        stuck_after: None,
    })
}

/// Wakes the test's thread.
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

fn waker() -> Waker {
    Waker::from(Arc::new(Unpark(std::thread::current())))
}

/// Hand a wait on `device` in `lane` at `sequence` to `pool`; its slot.
pub(super) fn submit(pool: &Pool, device: &Arc<Device>, lane: u64, sequence: u64) -> Arc<Slot> {
    let slot = Arc::new(Slot::new(waker()));
    let fence = MockFence {
        device: device.clone(),
        lane,
        sequence,
    };
    let wait = Wait::new(Box::new(fence), slot.clone(), LaneKey::for_tests(lane));
    pool.submit(wait).expect("submitted");
    slot
}

/// The slot's result, sleeping until it is woken; a test failure (not a
/// hang) if none comes within [`LIMIT`].
pub(super) fn result_of(slot: &Slot) -> Result<(), ServerError> {
    let waker = waker();
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Poll::Ready(result) = slot.poll(&mut Context::from_waker(&waker)) {
            return result;
        }
        let left = deadline.checked_duration_since(Instant::now());
        let left = left.expect("the wait resolved within the limit");
        std::thread::park_timeout(left);
    }
}

/// Poll `condition` every millisecond until it holds; a test failure past
/// [`LIMIT`].
pub(super) fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
