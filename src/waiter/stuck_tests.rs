//! Stuck-wait reports across the lane algorithm's rarer steps, seen in the
//! lines a pool makes (counted per pool, so tests beside these move none):
//! a lane taken back from the poller while its only wait is out in the
//! poller's batch is removed and made again, and its stall must go on,
//! neither ended nor reported twice.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::mock_device::Device;
use super::pool::{Config, Pool};
use super::pool_tests_support::{eventually, result_of, submit};
use super::shard::Wait;
use super::slot::Slot;
use super::waitable::{LaneKey, Waitable};
use crate::ServerError;

const STUCK_AFTER: Duration = Duration::from_millis(20);

/// A fence whose queries a test can hold inside the call (keeping the
/// poller's batch out), and which is reached when the test says.
#[derive(Default)]
struct Held {
    reached: AtomicBool,
    /// Queries wait while this is set; `entered` counts those that did.
    hold: AtomicBool,
    entered: AtomicUsize,
}

struct HeldFence(Arc<Held>);

impl Waitable for HeldFence {
    fn lane(&self) -> LaneKey {
        LaneKey::for_tests(1)
    }

    fn sequence(&self) -> u64 {
        1
    }

    fn query(&self) -> Result<bool, ServerError> {
        if self.0.hold.load(Ordering::SeqCst) {
            self.0.entered.fetch_add(1, Ordering::SeqCst);
            while self.0.hold.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Ok(self.0.reached.load(Ordering::SeqCst))
    }

    fn block(&self) -> Result<(), ServerError> {
        while !self.0.reached.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    fn stream_name(&self) -> String {
        "the held stream".to_owned()
    }
}

/// Lines made so far: (stuck, ended, left).
fn lines(pool: &Pool) -> (usize, usize, usize) {
    let [stuck, ended, left] = &pool.stuck.made;
    let read = |count: &AtomicUsize| count.load(Ordering::SeqCst);
    (read(stuck), read(ended), read(left))
}

#[test]
fn a_stall_goes_on_through_a_lane_made_again_after_a_take_back() {
    let pool = Pool::new(Config {
        max_threads: 1,
        keep_alive: Duration::from_secs(5),
        thread_name: "stuck-take-back-test".to_owned(),
        spin_budget: Duration::ZERO,
        resolvers: 1,
        stuck_after: Some(STUCK_AFTER),
    });
    // The one lane thread blocks on lane 0; lane 1 goes to the poller.
    let device = Arc::new(Device::default());
    let blocked = submit(&pool, &device, 0, 1);
    eventually("the lane thread blocks", || {
        device.blocked.load(Ordering::SeqCst) == 1
    });
    let held = Arc::new(Held::default());
    let slot = Arc::new(Slot::new(futures::task::noop_waker()));
    let handed_at = Instant::now();
    let wait = Wait::new(
        Box::new(HeldFence(held.clone())),
        slot.clone(),
        LaneKey::for_tests(1),
    );
    pool.submit(wait).expect("submitted");
    eventually("both streams are reported", || {
        pool.check_stuck().len() == 2
    });
    assert_eq!(lines(&pool), (2, 0, 0));
    // The poller takes lane 1's wait out, and is held inside its query.
    held.hold.store(true, Ordering::SeqCst);
    eventually("the poller's query is held", || {
        held.entered.load(Ordering::SeqCst) == 1
    });
    // Lane 0 ends: the thread takes lane 1 back from the poller, finds it
    // empty (its wait is out), and removes it.
    device.finish();
    assert_eq!(result_of(&blocked), Ok(()));
    eventually("both lanes are gone", || pool.lanes() == 0);
    assert_eq!(lines(&pool), (2, 1, 0), "lane 0's end; lane 1 goes on");
    // Still listed while its wait is out.
    let stuck = pool.check_stuck();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    // The query answers "not yet": the wait goes back, to a lane made again.
    held.hold.store(false, Ordering::SeqCst);
    eventually("the wait is back in a lane", || pool.lanes() == 1);
    // Its slot (and so its stall) dates from before `handed_at`.
    let since_handed = handed_at.elapsed();
    let stuck = pool.check_stuck();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(stuck[0].stream, "the held stream");
    assert!(
        stuck[0].waited >= since_handed,
        "timed from its hand-off still ({since_handed:?} ago), not from the lane made \
         again: {stuck:?}"
    );
    assert_eq!(lines(&pool), (2, 1, 0), "neither ended nor reported again");
    held.reached.store(true, Ordering::SeqCst);
    assert_eq!(result_of(&slot), Ok(()));
    eventually("its end is logged", || lines(&pool) == (2, 2, 0));
    assert!(pool.check_stuck().is_empty());
}

#[test]
fn a_lane_made_while_an_old_batch_is_out_counts_both_batches_back() {
    use super::checked::Invariants;
    use super::shard::Shard;

    let key = LaneKey::for_tests(1);
    let wait = || {
        let fence = HeldFence(Arc::new(Held::default()));
        let slot = Arc::new(Slot::new(futures::task::noop_waker()));
        let mut wait = Wait::new(Box::new(fence), slot, key);
        wait.stream_name = Some("the held stream".into());
        wait
    };
    let mut shard = Shard::new(true);
    // The poller's batch of one is out; its lane is removed meanwhile (a
    // thread took it back and found it empty): its stall is parked.
    shard.wait_added();
    shard.insert(wait());
    let mut first = Vec::new();
    shard.take_batch(key, 1, &mut first);
    let lane = shard.lanes.remove(&key).expect("the lane");
    let watch = lane.watch.expect("watched");
    assert!(shard.lane_removed(key, watch, lane.out).is_none(), "parked");
    shard.check_invariants();
    // Two new waits make the lane again, which takes the parked stall over,
    // and a lane thread takes both out in a batch of its own.
    for _ in 0..2 {
        shard.wait_added();
        shard.insert(wait());
    }
    assert!(shard.parked.is_empty());
    let mut second = Vec::new();
    shard.take_batch(key, 2, &mut second);
    shard.check_invariants();
    // The second batch comes back first, then the first: each counted back
    // by the lane, and no stall ends while the lane holds it.
    for batch in [second, first] {
        shard.batch_settled(batch.len());
        assert!(shard.batch_returned(key, batch.len()).is_none());
        shard.waits_finished(batch.len());
        shard.check_invariants();
    }
    assert_eq!(shard.lanes[&key].out, 0);
}
