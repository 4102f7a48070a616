//! What serving a lane costs, counted: a stream that ends its work item
//! after item (the common shape on a GPU) must cost its lane thread one
//! block and one query per wait, and no wait taken out of the lane only to
//! be put back; a burst must still be resolved in batches.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::mock_device::Device;
use super::pool::Pool;
use super::pool_tests_support::{eventually, result_of, submit};
use super::slot::Slot;

const WAITS: usize = 32;

fn pool() -> Pool {
    super::pool_tests_support::pool("lane-cost-test", 4, Duration::from_secs(5))
}

/// `WAITS` waits in lane 0, in order, the `i`th on `devices[i]`; their slots.
fn submit_all(pool: &Pool, devices: &[Arc<Device>]) -> Vec<Arc<Slot>> {
    (0..)
        .zip(devices)
        .map(|(sequence, device)| submit(pool, device, 0, sequence))
        .collect()
}

fn resolved(slot: &Slot) {
    result_of(slot).expect("resolved without error");
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
