//! The waiter threads' guards, seen working: a panic where no call is
//! contained (the mock device's code, which the waiter contains, plants one
//! at its thread's next lock, taken while the thread holds waits out of
//! their lane) unwinds the thread, and its guard must fail what it held,
//! uncount it, and queue its lanes for another thread. Also refused spawns:
//! the next spawns made from the test's thread, whose submits start the
//! threads they need. A watcher that unwinds holds no wait: its entries go
//! (their lane threads block in the driver) and it is uncounted. Each test
//! fails (hangs until its limit) without the guard.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::mock_device::support::{eventually, one_lane_thread_blocked, result_of, submit};
use super::mock_device::Device;
use crate::sync::test_faults;
use crate::waiter::pool::Pool;
use crate::ServerError;

/// Idle threads leave soon, so each test can see every thread gone.
const KEEP_ALIVE: Duration = Duration::from_millis(20);

fn pool(max_threads: usize) -> Pool {
    super::mock_device::support::pool(max_threads, KEEP_ALIVE, None)
}

fn is_panicked(result: &Result<(), ServerError>) -> bool {
    matches!(result, Err(ServerError::WaiterPanicked { .. }))
}

/// The pool's counts of waits handed off, resolved and failed: each wait
/// counted once, whichever path ended it.
fn outcomes(pool: &Pool) -> (u64, u64, u64) {
    let counts = pool.counters().read(Default::default());
    (counts.handed_off, counts.resolved, counts.failed)
}

#[test]
fn a_lane_thread_that_unwinds_fails_its_wait_and_gives_back_its_lane() {
    let pool = pool(4);
    let device = Arc::new(Device::default());
    // The lane thread takes the first out to block on; the block returns at
    // once, and the thread unwinds at its next lock, holding the wait.
    device.escape_after_block();
    let first = submit(&pool, &device, 0, 1);
    let second = submit(&pool, &device, 0, 2);
    assert!(is_panicked(&result_of(&first)), "the held wait fails");
    // Its lane went back to the pool: another thread blocks on the second.
    eventually("another thread blocks on the lane", || {
        device.blocked.load(Ordering::SeqCst) == 2
    });
    device.finish();
    assert_eq!(result_of(&second), Ok(()));
    assert_eq!(result_of(&submit(&pool, &device, 0, 3)), Ok(()));
    assert_eq!(result_of(&submit(&pool, &device, 1, 1)), Ok(()));
    eventually("no thread counted and no wait pending", || {
        pool.gauges().threads == 0 && pool.gauges().pending == 0
    });
    assert_eq!(
        outcomes(&pool),
        (4, 3, 1),
        "the unwound thread's wait failed"
    );
}

#[test]
fn a_poller_that_unwinds_fails_its_batch_and_is_started_again() {
    // One lane thread, blocked on lane 0: lane 1 goes to the poller.
    let (pool, held, blocked) = one_lane_thread_blocked(KEEP_ALIVE, None);
    let reached = Device::reached();
    // The poller takes it out and queries it, and unwinds at its next lock,
    // with the batch out.
    reached.escape_after_query();
    assert!(is_panicked(&result_of(&submit(&pool, &reached, 1, 1))));
    // A poller is started again for the next: not left for dead.
    assert_eq!(result_of(&submit(&pool, &reached, 1, 2)), Ok(()));
    held.finish();
    assert_eq!(result_of(&blocked), Ok(()));
    eventually("no thread counted and no wait pending", || {
        pool.gauges().threads == 0 && pool.gauges().pending == 0
    });
    assert_eq!(outcomes(&pool), (3, 2, 1), "the poller's batch failed");
}

#[test]
fn a_refused_lane_thread_leaves_its_lane_to_the_poller() {
    let pool = pool(4);
    // The lane thread's spawn, made here by the submit, is refused; the
    // poller's, made here too as its lane is left to the poller, is not.
    test_faults::refuse_spawns(1);
    let device = Arc::new(Device::default());
    let slot = submit(&pool, &device, 0, 1);
    device.finish();
    assert_eq!(result_of(&slot), Ok(()));
    assert_eq!(device.blocked.load(Ordering::SeqCst), 0, "no lane thread");
    eventually("no thread counted and no wait pending", || {
        pool.gauges().threads == 0 && pool.gauges().pending == 0
    });
    assert_eq!(outcomes(&pool), (1, 1, 0), "resolved by the poller");
}

#[test]
fn with_no_thread_at_all_the_waits_fail_instead_of_hanging() {
    let pool = pool(4);
    // The lane thread's spawn, made here by the submit, and the poller's,
    // made here as its lane is left to the poller, are refused.
    test_faults::refuse_spawns(2);
    let device = Arc::new(Device::default());
    let slot = submit(&pool, &device, 0, 1);
    assert!(matches!(
        result_of(&slot),
        Err(ServerError::ThreadSpawn { .. })
    ));
    assert_eq!(pool.gauges().pending, 0);
    assert_eq!(pool.gauges().threads, 0);
    assert_eq!(outcomes(&pool), (1, 0, 1), "failed for want of a thread");
    // The next wait starts a thread again.
    let device = Device::reached();
    assert_eq!(result_of(&submit(&pool, &device, 0, 2)), Ok(()));
    assert_eq!(outcomes(&pool), (2, 1, 1));
}

#[test]
fn a_poller_that_unwinds_while_reporting_stalls_is_started_again_and_reports_on() {
    // One lane thread, blocked on lane 0; the poller polls lane 1 and
    // reports stuck streams.
    let (pool, held, blocked) = one_lane_thread_blocked(KEEP_ALIVE, Some(Duration::from_millis(1)));
    assert_eq!(
        pool.gauges().threads,
        2,
        "a lane thread and the poller reporting stalls"
    );
    // Reached, so the poller's guard still holds the batch when its lock
    // panics in `settle` (waits a query says are not reached are handed to
    // `settle` first, out of the guard's sight).
    let polled = Device::reached();
    // The poller takes its wait out and queries it, and unwinds at its next
    // lock, with the batch out.
    polled.escape_after_query();
    assert!(is_panicked(&result_of(&submit(&pool, &polled, 1, 1))));
    // Lane 1 is gone with its wait; lane 0 is still held, so the poller is
    // started again to watch it, and lists it.
    eventually("the poller reports stalls again", || {
        pool.gauges().threads == 2
    });
    eventually("the held stream is listed", || pool.stuck().len() == 1);
    assert_eq!(pool.stuck()[0].stream, "mock stream 0");
    held.finish();
    assert_eq!(result_of(&blocked), Ok(()));
    eventually("no thread counted and no wait pending", || {
        pool.gauges().threads == 0 && pool.gauges().pending == 0
    });
}

#[test]
fn a_watcher_that_unwinds_leaves_its_entries_to_the_driver_and_is_uncounted() {
    let pool = super::mock_device::support::pool_watching(1, KEEP_ALIVE);
    let device = Device::with_word();
    // Its word passes before its work ends (a reading the driver does not
    // rule out), so the watcher queries the wait; it unwinds at its next lock.
    device.move_word();
    device.escape_after_query();
    // The lane thread puts the wait on the watcher's list and blocks in the
    // driver; the watcher queries it and unwinds, and its entry goes.
    let slot = submit(&pool, &device, 0, 1);
    eventually(
        "the watcher unwound, uncounted, and its entry is gone",
        || {
            device.queried.load(Ordering::SeqCst) == 1
                && pool.watched_entries() == 0
                && pool.gauges().threads == 1
                && device.blocked.load(Ordering::SeqCst) == 1
        },
    );
    device.finish();
    assert_eq!(result_of(&slot), Ok(()));
    eventually("no thread counted and no wait pending", || {
        pool.gauges().threads == 0 && pool.gauges().pending == 0
    });
    assert_eq!(
        outcomes(&pool),
        (1, 1, 0),
        "the watcher held no wait to fail"
    );
}
