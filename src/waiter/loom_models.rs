//! loom models of the waiter's hand-off: a polling task, a waiter thread, the
//! "device", and a cancelling drop. Run with
//! `RUSTFLAGS="--cfg device_events_loom" cargo test --release --lib loom`.

use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use loom::sync::atomic::{AtomicUsize, Ordering};

use super::handoff::{Handoff, PoolRef};
use super::line_queue::LineQueue;
use super::mock_device::{Device, MockFence};
use super::permits::Permits;
use super::pool::{Config, Pool};
use super::shard::Wait;
use super::slot::Slot;
use super::stats::Counters;
use super::waitable::LaneKey;
use crate::loom::{thread, Arc, Condvar, Mutex};
use crate::ServerError;

/// A waker that counts its wakes.
struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Waker, std::sync::Arc<CountingWaker>) {
    let counter = std::sync::Arc::new(CountingWaker(AtomicUsize::new(0)));
    (Waker::from(counter.clone()), counter)
}

/// A task that sleeps between polls until woken. Its wake-up is a flag under
/// a mutex with a condvar, not `thread::unpark`: loom lets an unpark make a
/// thread runnable while it is blocked on a mutex, and then fails the model
/// ("expected to be able to acquire lock") on a schedule that cannot happen.
struct Task {
    waker: Waker,
    signal: std::sync::Arc<Signal>,
}

#[derive(Default)]
struct Signal {
    woken: Mutex<bool>,
    changed: Condvar,
}

impl Wake for Signal {
    fn wake(self: std::sync::Arc<Self>) {
        *self.woken.lock() = true;
        self.changed.notify_one();
    }
}

impl Task {
    fn new() -> Self {
        let signal = std::sync::Arc::new(Signal::default());
        Self {
            waker: Waker::from(signal.clone()),
            signal,
        }
    }

    /// Poll `slot` as a task would, sleeping until woken, until it is ready.
    fn poll_until_ready(&self, slot: &Slot) -> Result<(), ServerError> {
        let mut cx = Context::from_waker(&self.waker);
        loop {
            if let Poll::Ready(result) = slot.poll(&mut cx) {
                return result;
            }
            let mut woken = self.signal.woken.lock();
            while !*woken {
                woken = self.signal.changed.wait(woken);
            }
            *woken = false;
        }
    }
}

/// The device's work ends on a thread of its own, racing the model.
fn finish_on_a_thread(device: &Arc<Device>) -> thread::JoinHandle<()> {
    let device = device.clone();
    thread::spawn(move || device.finish())
}

fn pool() -> Pool {
    pool_with(1)
}

fn pool_with(max_threads: usize) -> Pool {
    pool_keeping(max_threads, Duration::ZERO)
}

/// A pool whose idle threads stay `keep_alive`: zero makes every idle wait
/// a choice between a wake-up and a timeout; any other value makes idle
/// threads sleep until notified (see `crate::loom::Condvar::wait_timeout`).
fn pool_keeping(max_threads: usize, keep_alive: Duration) -> Pool {
    Pool::new(Config {
        max_threads,
        keep_alive,
        thread_name: "loom-waiter".to_owned(),
        spin_budget: Duration::ZERO,
        resolvers: 1,
        stuck_after: None,
    })
}

fn submit(pool: &Pool, reached: &Arc<Device>, sequence: u64, waker: &Waker) -> Arc<Slot> {
    submit_on(pool, reached, 0, sequence, waker)
}

fn submit_on(
    pool: &Pool,
    reached: &Arc<Device>,
    lane: u64,
    sequence: u64,
    waker: &Waker,
) -> Arc<Slot> {
    let slot = Arc::new(Slot::new(waker.clone()));
    let wait = Wait::new(
        Box::new(MockFence {
            device: reached.clone(),
            sequence,
            lane,
        }),
        slot.clone(),
        LaneKey::for_tests(lane),
    );
    assert!(pool.submit(wait).is_ok());
    slot
}

/// A future for a fence at sequence 1 of `lane` on `device`, polled once
/// with `waker`: handed off to `pool` (its device has not finished).
fn handed_off(pool: &Pool, device: &Arc<Device>, lane: u64, waker: &Waker) -> Handoff<MockFence> {
    let mut handoff = Handoff::new(
        MockFence {
            device: device.clone(),
            sequence: 1,
            lane,
        },
        PoolRef::Owned(pool.clone()),
    );
    assert!(handoff.poll(&mut Context::from_waker(waker)).is_pending());
    handoff
}

#[test]
fn loom_slot_completion_is_never_lost() {
    loom::model(|| {
        let (waker, wakes) = counting_waker();
        let slot = Arc::new(Slot::new(waker.clone()));
        let completer = {
            let slot = slot.clone();
            thread::spawn(move || slot.complete(Ok(()), &Counters::default()))
        };
        let mut cx = Context::from_waker(&waker);
        let first = slot.poll(&mut cx);
        completer.join().unwrap();
        match first {
            Poll::Ready(result) => assert!(result.is_ok()),
            Poll::Pending => {
                // Pending means the result came later, so its waker fired.
                assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
                assert!(matches!(slot.poll(&mut cx), Poll::Ready(Ok(()))));
            }
        }
    });
}

#[test]
fn loom_slot_cancel_races_completion() {
    loom::model(|| {
        let (waker, wakes) = counting_waker();
        let slot = Arc::new(Slot::new(waker));
        let counters = Arc::new(Counters::default());
        let completer = {
            let (slot, counters) = (slot.clone(), counters.clone());
            thread::spawn(move || slot.complete(Err(ServerError::WaiterGone), &counters))
        };
        slot.cancel(&counters);
        completer.join().unwrap();
        assert!(slot.is_cancelled());
        // Whichever came first is counted, and only it.
        let counts = counters.read();
        assert_eq!(
            (counts.failed + counts.cancelled, counts.resolved),
            (1, 0),
            "one outcome counted"
        );
        assert_eq!(counts.wake_latency.count(), counts.failed);
        assert!(wakes.0.load(Ordering::SeqCst) <= 1);
        let (noop, _) = counting_waker();
        let mut cx = Context::from_waker(&noop);
        assert!(
            slot.poll(&mut cx).is_pending(),
            "a cancelled slot keeps no result"
        );
    });
}

#[test]
fn loom_queued_lines_are_each_logged_once_in_order() {
    // Two threads each make two lines under a lock (as the waiter makes
    // stuck-wait lines under a shard's), numbered in the order made, and
    // log once they let go of it: whoever logs, every line comes out once,
    // and all of them in the order they were made.
    loom::model(|| {
        let queue = Arc::new(LineQueue::new());
        let made = Arc::new(Mutex::new(0));
        let logged = Arc::new(Mutex::new(Vec::new()));
        let makers: Vec<_> = (0..2)
            .map(|_| {
                let (queue, made, logged) = (queue.clone(), made.clone(), logged.clone());
                thread::spawn(move || {
                    for _ in 0..2 {
                        {
                            let mut made = made.lock();
                            queue.push(*made);
                            *made += 1;
                        }
                        queue.log(|line| logged.lock().push(line));
                    }
                })
            })
            .collect();
        makers.into_iter().for_each(|maker| maker.join().unwrap());
        let logged = logged.lock();
        assert_eq!(*logged, [0, 1, 2, 3], "each line once, in order");
    });
}

#[test]
fn loom_pool_hands_off_and_resolves() {
    loom::model(|| {
        let pool = pool();
        let reached = Arc::new(Device::default());
        let task = Task::new();
        let slot = submit(&pool, &reached, 1, &task.waker);
        let device = finish_on_a_thread(&reached);
        assert!(task.poll_until_ready(&slot).is_ok());
        device.join().unwrap();
        assert_eq!(pool.pending(), 0);
        pool.shutdown();
    });
}

#[test]
fn loom_pool_resolves_a_lane_in_order() {
    loom::model(|| {
        let pool = pool();
        let reached = Arc::new(Device::default());
        let task = Task::new();
        let first = submit(&pool, &reached, 1, &task.waker);
        let second = submit(&pool, &reached, 2, &task.waker);
        reached.finish();
        assert!(task.poll_until_ready(&second).is_ok());
        assert!(task.poll_until_ready(&first).is_ok());
        pool.shutdown();
    });
}

#[test]
fn loom_pool_cancelled_wait_is_dropped_and_counted() {
    loom::model(|| {
        let pool = pool();
        let reached = Arc::new(Device::default());
        let task = Task::new();
        let slot = submit(&pool, &reached, 1, &task.waker);
        let device = finish_on_a_thread(&reached);
        slot.cancel(&Counters::default()); // the future was dropped
        device.join().unwrap();
        while pool.pending() != 0 {
            thread::yield_now();
        }
        assert!(slot.is_cancelled());
        pool.shutdown();
    });
}

#[test]
fn loom_shutdown_races_a_submit() {
    loom::model(|| {
        let pool = pool();
        let reached = Arc::new(Device::default());
        let task = Task::new();
        let slot = submit(&pool, &reached, 1, &task.waker);
        let stopper = {
            let pool = pool.clone();
            thread::spawn(move || pool.shutdown())
        };
        reached.finish();
        // Either the thread resolved it, or shutdown did: never pending forever.
        let result = task.poll_until_ready(&slot);
        assert!(matches!(result, Ok(()) | Err(ServerError::WaiterGone)));
        stopper.join().unwrap();
    });
}

#[test]
fn loom_a_second_lane_beyond_max_threads_is_polled_not_held_back() {
    loom::model(|| {
        // One lane thread may exist: it blocks on the slow lane, and the
        // fast lane goes to the poller, which must resolve it while the slow
        // one is still pending.
        let pool = pool();
        let slow = Arc::new(Device::default());
        let fast = Arc::new(Device::default());
        let task = Task::new();
        let slow_slot = submit_on(&pool, &slow, 0, 1, &task.waker);
        let fast_slot = submit_on(&pool, &fast, 1, 2, &task.waker);
        fast.finish();
        assert!(task.poll_until_ready(&fast_slot).is_ok());
        slow.finish();
        assert!(task.poll_until_ready(&slow_slot).is_ok());
        pool.shutdown();
    });
}

#[test]
fn loom_a_dropped_future_withdraws_its_wait_or_leaves_it_to_the_thread() {
    loom::model(|| {
        // The future's drop races the lane thread taking the wait out: either
        // the drop withdraws it and a waiter thread drops it, or the lane
        // thread has it and drops it when done. Either way it leaves the
        // pool, and its fence is dropped once, off the dropping thread.
        let pool = pool();
        let reached = Arc::new(Device::default());
        let (waker, wakes) = counting_waker();
        let handoff = handed_off(&pool, &reached, 0, &waker);
        let device = finish_on_a_thread(&reached);
        drop(handoff);
        device.join().unwrap();
        // A thread that took the wait drops the fence, then counts it done.
        while reached.fences_dropped.load(Ordering::SeqCst) == 0 || pool.pending() != 0 {
            thread::yield_now();
        }
        assert_eq!(reached.fences_dropped.load(Ordering::SeqCst), 1);
        assert_ne!(
            reached.dropped_on.lock()[0],
            thread::current().id(),
            "a waiter thread drops the fence, not the one that dropped the future"
        );
        // Woken at most once: only if the wait resolved before the drop.
        assert!(wakes.0.load(Ordering::SeqCst) <= 1);
        pool.shutdown();
    });
}

#[test]
fn loom_shutdown_resolves_a_wait_a_thread_is_blocked_on() {
    loom::model(|| {
        // The device does not finish until the future has resolved: whether
        // or not the lane thread is already blocked on the wait, shutdown
        // must resolve it without waiting for the device.
        let pool = pool();
        let reached = Arc::new(Device::default());
        let task = Task::new();
        let slot = submit(&pool, &reached, 1, &task.waker);
        pool.shutdown();
        assert_eq!(task.poll_until_ready(&slot), Err(ServerError::WaiterGone));
        assert_eq!(pool.pending(), 0);
        reached.finish(); // lets the thread's block end, so it can exit
    });
}

#[test]
fn loom_permits_admit_at_most_their_count_and_wake_a_waiter_on_release() {
    loom::model(|| {
        // Three lane threads want to resolve; one permit: never two inside
        // at once, and every thread gets in (a lost wake-up would deadlock).
        let permits = Arc::new(Permits::new(1));
        let inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (permits, inside) = (permits.clone(), inside.clone());
                thread::spawn(move || {
                    let _permit = permits.acquire();
                    assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                    inside.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        {
            let _permit = permits.acquire();
            assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
            inside.fetch_sub(1, Ordering::SeqCst);
        }
        for thread in threads {
            thread.join().unwrap();
        }
    });
}

#[test]
fn loom_submits_to_lanes_in_two_shards_race_and_both_resolve() {
    loom::model(|| {
        // Two tasks hand waits to lanes in different shards at once, with
        // room for one lane thread: each submit takes only its own shard,
        // then the scheduler to queue its new lane. One lane gets the
        // thread, the other the thread after it or the poller; neither is
        // lost, and the pool never has more than the thread and the poller.
        let pool = pool();
        let device = Arc::new(Device::default());
        device.finish();
        let other = {
            let (pool, device) = (pool.clone(), device.clone());
            thread::spawn(move || {
                let task = Task::new();
                let slot = submit_on(&pool, &device, 1, 1, &task.waker);
                task.poll_until_ready(&slot)
            })
        };
        let task = Task::new();
        let slot = submit_on(&pool, &device, 0, 1, &task.waker);
        assert!(task.poll_until_ready(&slot).is_ok());
        assert!(other.join().unwrap().is_ok());
        assert!(pool.peak_threads() <= 2, "{}", pool.peak_threads());
        while pool.pending() != 0 {
            thread::yield_now();
        }
        pool.shutdown();
    });
}

#[test]
fn loom_a_lane_its_thread_releases_races_a_submit_to_it() {
    loom::model(|| {
        // The lane thread finishes lane 0 (and removes it, under its shard's
        // lock) while a new wait arrives for lane 0: the new wait finds the
        // lane still served, or makes it afresh and queues it, and the
        // thread between lanes (or idle, and woken) takes it. Room for two
        // lane threads, yet none is started for it.
        let pool = pool_with(2);
        let device = Arc::new(Device::default());
        device.finish();
        let task = Task::new();
        let first = submit(&pool, &device, 1, &task.waker);
        let second = submit(&pool, &device, 2, &task.waker);
        assert!(task.poll_until_ready(&first).is_ok());
        assert!(task.poll_until_ready(&second).is_ok());
        assert_eq!(pool.peak_threads(), 1);
        pool.shutdown();
    });
}

#[test]
fn loom_a_withdraw_racing_shutdown_drops_the_fence_once() {
    loom::model(|| {
        // A future is dropped while the pool shuts down: its wait is
        // withdrawn before shutdown (and dropped by it), drained by it (and
        // the withdraw finds nothing), withdrawn between shutdown's two
        // steps (scheduler shut, shards not yet drained: the withdrawing
        // thread drops it, as the lane thread may have exited), or held by
        // the lane thread (which drops it when its block ends). Always
        // exactly once, and nothing stays pending. (Leaving a wait withdrawn
        // after shutdown to threads that have exited fails this model.)
        let pool = pool();
        let device = Arc::new(Device::default());
        let (waker, _) = counting_waker();
        let handoff = handed_off(&pool, &device, 0, &waker);
        let stopper = {
            let pool = pool.clone();
            thread::spawn(move || pool.shutdown())
        };
        drop(handoff);
        stopper.join().unwrap();
        device.finish(); // lets a blocked lane thread go
        while device.fences_dropped.load(Ordering::SeqCst) == 0 {
            thread::yield_now();
        }
        assert_eq!(device.fences_dropped.load(Ordering::SeqCst), 1);
        assert_eq!(pool.pending(), 0);
    });
}

#[test]
fn loom_an_idle_thread_timing_out_races_a_submit() {
    loom::model(|| {
        // The lane thread serves lane 0 and goes idle with keep_alive(0):
        // it times out and leaves, or is woken for lane 1, whose wait comes
        // from another task meanwhile; or it is still between lanes and
        // finds lane 1 queued. Whichever, the wait resolves. (A thread that
        // leaves on a timeout without looking at the queues first strands
        // lane 1: this model deadlocks.)
        let pool = pool();
        let device = Arc::new(Device::default());
        device.finish();
        let task = Task::new();
        let first = submit_on(&pool, &device, 0, 1, &task.waker);
        assert!(task.poll_until_ready(&first).is_ok());
        let other = {
            let (pool, device) = (pool.clone(), device.clone());
            thread::spawn(move || {
                let task = Task::new();
                let slot = submit_on(&pool, &device, 1, 1, &task.waker);
                task.poll_until_ready(&slot)
            })
        };
        assert!(other.join().unwrap().is_ok());
        assert!(pool.peak_threads() <= 2, "{}", pool.peak_threads());
        pool.shutdown();
    });
}

#[test]
fn loom_a_lane_taken_back_from_the_poller_mid_batch_is_made_again() {
    loom::model(|| {
        // One lane thread, blocked on lane 0; lane 1 goes to the poller. The
        // poller may have lane 1's wait out to query it when the lane thread,
        // done with lane 0, takes lane 1 back, finds it empty and removes
        // it: the poller's settle then makes the lane afresh and queues it.
        // The wait resolves either way. (A settle that makes the lane but
        // does not queue it strands the wait: this model deadlocks.)
        let pool = pool();
        let slow = Arc::new(Device::default());
        let fast = Arc::new(Device::default());
        let task = Task::new();
        let slow_slot = submit_on(&pool, &slow, 0, 1, &task.waker);
        let fast_slot = submit_on(&pool, &fast, 1, 1, &task.waker);
        slow.finish();
        fast.finish();
        assert!(task.poll_until_ready(&slow_slot).is_ok());
        assert!(task.poll_until_ready(&fast_slot).is_ok());
        while pool.pending() != 0 {
            thread::yield_now();
        }
        pool.shutdown();
    });
}

#[test]
fn loom_shutdown_races_a_submit_from_another_task() {
    loom::model(|| {
        // A task hands off a wait while another thread shuts the pool down:
        // the submit is refused, or the wait resolves (reached, or failed by
        // shutdown). Never left pending. (A submit that skips a shard shut
        // meanwhile puts its wait where nobody serves it: this model
        // deadlocks.)
        let pool = pool();
        let device = Arc::new(Device::default());
        let stopper = {
            let pool = pool.clone();
            thread::spawn(move || pool.shutdown())
        };
        let task = Task::new();
        let slot = Arc::new(Slot::new(task.waker.clone()));
        let wait = Wait::new(
            Box::new(MockFence {
                device: device.clone(),
                sequence: 1,
                lane: 0,
            }),
            slot.clone(),
            LaneKey::for_tests(0),
        );
        let submitted = pool.submit(wait);
        device.finish();
        match submitted {
            Ok(_) => {
                let result = task.poll_until_ready(&slot);
                assert!(matches!(result, Ok(()) | Err(ServerError::WaiterGone)));
            }
            Err(err) => assert_eq!(err, ServerError::WaiterGone),
        }
        stopper.join().unwrap();
        assert_eq!(pool.pending(), 0);
    });
}

#[test]
fn loom_two_idle_lane_threads_are_woken_for_new_lanes() {
    loom::model(|| {
        // Two lane threads serve two lanes, then sleep (a long keep-alive:
        // they never time out, so only a notification wakes them). Two new
        // waits, one per lane: each finds a thread woken for it, or one
        // still between lanes. (A wake-up decided but never sent leaves a
        // thread asleep and its lane unserved: this model deadlocks.)
        let pool = pool_keeping(2, Duration::from_secs(3600));
        let device = Arc::new(Device::default());
        device.finish();
        let task = Task::new();
        let first = submit_on(&pool, &device, 0, 1, &task.waker);
        let second = submit_on(&pool, &device, 1, 1, &task.waker);
        assert!(task.poll_until_ready(&first).is_ok());
        assert!(task.poll_until_ready(&second).is_ok());
        let third = submit_on(&pool, &device, 0, 2, &task.waker);
        let fourth = submit_on(&pool, &device, 1, 2, &task.waker);
        assert!(task.poll_until_ready(&third).is_ok());
        assert!(task.poll_until_ready(&fourth).is_ok());
        assert!(pool.peak_threads() <= 2, "{}", pool.peak_threads());
        pool.shutdown();
    });
}

#[test]
fn loom_a_new_lane_never_waits_behind_a_lane_queued_just_before_it() {
    loom::model(|| {
        // One lane thread, idle after a first wait (a long keep-alive), and
        // room for two. Waits on two new lanes race; lane 1's work is held
        // until lane 0's wait resolves. Whichever lane queues second counts
        // the first (the count is read under the scheduler's lock), so it
        // gets a thread of its own rather than wait behind the thread that
        // blocks on lane 1. (A count read before that lock can miss lane 1,
        // leave lane 0 to the thread blocked on it: this model deadlocks.)
        let pool = pool_keeping(2, Duration::from_secs(3600));
        let reached = Arc::new(Device::default());
        reached.finish();
        let task = Task::new();
        let warm = submit_on(&pool, &reached, 0, 1, &task.waker);
        assert!(task.poll_until_ready(&warm).is_ok());
        let held = Arc::new(Device::default());
        let other = {
            let (pool, held) = (pool.clone(), held.clone());
            thread::spawn(move || {
                let task = Task::new();
                let slot = submit_on(&pool, &held, 1, 1, &task.waker);
                task.poll_until_ready(&slot)
            })
        };
        let first = submit_on(&pool, &reached, 0, 2, &task.waker);
        assert!(task.poll_until_ready(&first).is_ok());
        held.finish();
        assert!(other.join().unwrap().is_ok());
        pool.shutdown();
    });
}

#[test]
fn loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller() {
    loom::model(|| {
        // The lane thread a wait needs cannot be started: its counts are
        // undone and the poller serves the lane. (A failed spawn that leaves
        // the lane queued for the thread that never came strands it: this
        // model deadlocks.)
        let pool = pool();
        pool.plants.refused_spawns.store(1, Ordering::SeqCst);
        let device = Arc::new(Device::default());
        let task = Task::new();
        let slot = submit(&pool, &device, 1, &task.waker);
        let finisher = finish_on_a_thread(&device);
        assert!(task.poll_until_ready(&slot).is_ok());
        finisher.join().unwrap();
        while pool.pending() != 0 {
            thread::yield_now();
        }
        pool.shutdown();
    });
}

#[test]
fn loom_a_future_dropped_while_the_poller_has_its_wait_out() {
    loom::model(|| {
        // One lane thread, blocked on lane 0: lane 1's wait goes to the
        // poller, which takes it out of its lane to query it. Its future is
        // dropped meanwhile: the wait is withdrawn from the lane, or found
        // cancelled when the poller puts it back. Either way its fence is
        // dropped once, and it is counted finished once. (A settle that
        // miscounts a cancelled wait fails here.)
        let pool = pool();
        let slow = Arc::new(Device::default());
        let never = Arc::new(Device::default());
        let task = Task::new();
        let blocked = submit_on(&pool, &slow, 0, 1, &task.waker);
        let handoff = handed_off(&pool, &never, 1, &task.waker);
        drop(handoff);
        while never.fences_dropped.load(Ordering::SeqCst) == 0 || pool.pending() != 1 {
            thread::yield_now();
        }
        assert_eq!(never.fences_dropped.load(Ordering::SeqCst), 1);
        slow.finish();
        assert!(task.poll_until_ready(&blocked).is_ok());
        assert_eq!(pool.pending(), 0);
        pool.shutdown();
    });
}
