//! What serving a lane costs, counted: a stream that ends its work item
//! after item (the common shape on a GPU) must cost its lane thread one
//! block and one query per wait, and no wait taken out of the lane only to
//! be put back; a burst must still be resolved in batches.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::mock_device::{Device, MockFence};
use super::pool::{Config, Pool};
use super::shard::Wait;
use super::slot::Slot;
use super::waitable::LaneKey;

const LIMIT: Duration = Duration::from_secs(20);
const WAITS: usize = 32;

fn pool() -> Pool {
    Pool::new(Config {
        max_threads: 4,
        keep_alive: Duration::from_secs(5),
        thread_name: "lane-cost-test".to_owned(),
        spin_budget: Duration::ZERO,
        resolvers: 1,
    })
}

struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// `WAITS` waits in lane 0, in order, the `i`th on `devices[i]`; their slots.
fn submit_all(pool: &Pool, devices: &[Arc<Device>]) -> Vec<Arc<Slot>> {
    devices
        .iter()
        .enumerate()
        .map(|(sequence, device)| {
            let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
            let slot = Arc::new(Slot::new(waker));
            let fence = MockFence {
                device: device.clone(),
                lane: 0,
                sequence: sequence as u64,
            };
            let wait = Wait::new(Box::new(fence), slot.clone(), LaneKey::for_tests(0));
            pool.submit(wait).expect("submitted");
            slot
        })
        .collect()
}

/// Sleep until `slot` is resolved; a failure (not a hang) past `LIMIT`.
fn resolved(slot: &Slot) {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Poll::Ready(result) = slot.poll(&mut Context::from_waker(&waker)) {
            result.expect("resolved without error");
            return;
        }
        let left = deadline.checked_duration_since(Instant::now());
        std::thread::park_timeout(left.expect("the wait resolved within the limit"));
    }
}

fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn devices() -> Vec<Arc<Device>> {
    (0..WAITS).map(|_| Arc::new(Device::default())).collect()
}

#[test]
fn waits_reached_one_after_another_cost_one_block_and_one_query_each_and_none_put_back() {
    let pool = pool();
    let devices = devices();
    let slots = submit_all(&pool, &devices);
    for (index, (device, slot)) in devices.iter().zip(&slots).enumerate() {
        // The item ends only once the lane thread sleeps on its wait, as
        // when each item runs longer than the thread takes to get there.
        eventually(&format!("the lane thread blocks on wait {index}"), || {
            device.blocked.load(Ordering::SeqCst) == 1
        });
        device.finish();
        resolved(slot);
    }
    assert_eq!(
        pool.put_back.load(Ordering::SeqCst),
        0,
        "waits taken out of the lane and put back, though none was reached"
    );
    for (index, device) in devices.iter().enumerate() {
        assert_eq!(
            device.blocked.load(Ordering::SeqCst),
            1,
            "blocks on wait {index}"
        );
        // The first wait is asked once by nobody here (the pool's caller
        // asks on a first poll, not the pool); each later one once, when
        // the thread takes it out after the one before.
        let queries = device.queried.load(Ordering::SeqCst);
        assert!(queries <= 1, "wait {index} was asked {queries} times");
    }
    pool.shutdown();
}

#[test]
fn a_burst_is_resolved_in_batches_with_no_block_past_the_first() {
    let pool = pool();
    let devices = devices();
    let slots = submit_all(&pool, &devices);
    eventually("the lane thread blocks on the oldest wait", || {
        devices[0].blocked.load(Ordering::SeqCst) == 1
    });
    // Everything ends at once: later devices first, so the thread, woken by
    // the first, finds every other one reached.
    for device in devices.iter().rev() {
        device.finish();
    }
    for slot in &slots {
        resolved(slot);
    }
    let blocks: usize = devices
        .iter()
        .map(|device| device.blocked.load(Ordering::SeqCst))
        .sum();
    assert_eq!(
        blocks, 1,
        "a burst already reached is queried, not blocked on"
    );
    assert_eq!(
        pool.put_back.load(Ordering::SeqCst),
        0,
        "nothing unreached to put back"
    );
    pool.shutdown();
}
