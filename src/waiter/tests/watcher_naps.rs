//! The watcher's naps, against the mock device: what it holds across one, and how early it says
//! it wakes (the figure lane threads weigh their waits against) after naps that ended late.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::mock_device::support::{eventually, pool_watching, result_of, submit};
use super::mock_device::Device;
use crate::waiter::stats::WaiterStats;
use crate::waiter::waitable::LaneKey;
use crate::waiter::watcher::timing::EARLY_HALF_LIFE;

/// Waits the watcher has seen end, so far.
fn watched(pool: &crate::waiter::pool::Pool) -> u64 {
    pool.counters().read(WaiterStats::default()).watched
}

#[test]
fn how_early_the_watcher_wakes_ages_from_the_nap_that_measured_it_not_from_later_rounds() {
    // A spell of late naps (timer slack on a loaded host), then new lanes: each one's first wait
    // is due at once, so the watcher looks at it with no nap, and measures nothing. The figure
    // must age from the last nap that measured it, or new lanes keep it fresh and the watcher
    // off every steady lane it calls too short, for good.
    let pool = pool_watching(2, Duration::from_secs(600));
    for _ in 0..4 {
        pool.seed_history(LaneKey::for_tests(0), Duration::from_millis(150));
    }
    // A wait the watcher naps toward, 20 ms at a time; the lock keeps each nap 5 ms past its
    // end. Its work has ended and its word passed before it is handed over (however late a
    // loaded host runs this test, the watcher's look finds it), but the driver wakes its lane
    // thread only once told: the watcher sees it once it is due.
    let long = Device::with_slow_driver();
    long.finish();
    let slot = submit(&pool, &long, 0, 1);
    eventually("it blocks in the driver", || {
        long.blocked.load(Ordering::SeqCst) == 1
    });
    let mut naps = Vec::new();
    eventually("the watcher sees it, after late naps", || {
        if let Some(until) = pool.hold_past_nap(Duration::from_millis(5)) {
            if naps.last() != Some(&until) {
                naps.push(until);
            }
        }
        watched(&pool) == 1
    });
    result_of(&slot).expect("seen by the watcher");
    // Some 6 naps of 20 ms; one the test's thread missed (a loaded host) ended in time.
    assert!(!naps.is_empty(), "no nap kept late");
    long.wake_driver();
    eventually("its lane thread is done", || pool.gauges().pending == 0);
    // The watcher said how early it wakes as it woke from its last nap, before it looked.
    let spell = Instant::now();
    let figure = pool.watcher_early(spell);
    assert!(figure > Duration::ZERO, "measured by the naps");

    // New lanes, one after another, each seen by the watcher at its first look.
    for lane in 1..=3 {
        let device = Device::with_slow_driver();
        device.finish();
        let slot = submit(&pool, &device, lane, 1);
        result_of(&slot).expect("seen by the watcher");
        // Its round is over once the watcher waits for entries again.
        eventually("the watcher waits for entries", || {
            pool.watcher_waits() && pool.watched_entries() == 0
        });
        device.wake_driver();
        eventually("its lane thread is done", || pool.gauges().pending == 0);
    }
    // Each new lane made a round with no nap; on a loaded host one may be ended otherwise, but
    // the watcher saw at least one of them.
    assert!(watched(&pool) >= 2, "no new lane seen by the watcher");

    // Four half-lives after the spell the figure is a sixteenth of what it was: the rounds since
    // (no nap in any) did not make it new again.
    let aged = pool.watcher_early(spell + EARLY_HALF_LIFE * 4);
    assert_eq!(aged, figure / 16, "from {figure:?} at the spell's end");
}

#[test]
fn the_watcher_holds_no_copy_of_a_wait_while_it_naps() {
    // While the watcher naps toward a wait, the wait's fence is its lane thread's and the list's
    // alone: a wait the driver ends meanwhile is dropped by its lane thread (its event back to
    // its pool, its context free to go), not kept until the nap ends, nor dropped on the
    // watcher's thread.
    let pool = pool_watching(1, Duration::from_secs(600));
    for _ in 0..4 {
        pool.seed_history(LaneKey::for_tests(0), Duration::from_secs(3600));
    }
    let device = Device::with_word();
    let slot = submit(&pool, &device, 0, 1);
    let mut holders = None;
    eventually("the watcher naps toward it", || {
        holders = pool.fence_holders_in_nap();
        holders.is_some()
    });
    assert_eq!(holders, Some(2), "its lane thread and the list");
    device.finish();
    result_of(&slot).expect("ended by the driver's wake");
    eventually("its fence is dropped", || {
        device.fences_dropped.load(Ordering::SeqCst) == 1
    });
    pool.shutdown();
}
