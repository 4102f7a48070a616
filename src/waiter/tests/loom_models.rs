//! loom models of the waiter: a task's future, the lane threads and poller
//! that `threads::act` starts, the "device", and the races between them. Run
//! with `RUSTFLAGS="--cfg device_events_loom" LOOM_MAX_PREEMPTIONS=3 cargo
//! test --release --lib loom`. A zero keep-alive is a choice of the schedule
//! (woken, or timed out); a long one never runs out, so a lost wake-up
//! deadlocks. The watcher's nap is a choice of the schedule too, and the
//! clock it goes by stands still but where a nap runs out (to the nap's
//! end): a nap that runs out checks that no entry on the list was due to be
//! looked at before then, unless a wake-up was sent it. The pool's
//! invariants are checked each time its lock is let go. A model that catches
//! a planted defect (`scripts/plant-defects.sh`) names it.

use std::sync::atomic::Ordering::SeqCst;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use super::mock_device::{Device, MockFence};
use crate::sync::{thread, Arc, AtomicUsize, Condvar, Mutex};
use crate::waiter::handoff::{Handoff, PoolRef};
use crate::waiter::pool::{Config, Pool};
use crate::waiter::slot::Slot;
use crate::waiter::threads;
use crate::waiter::wait::Wait;
use crate::waiter::waitable::LaneKey;
use crate::ServerError;

/// A task that sleeps between polls until woken, and counts its wake-ups.
/// Woken by a flag under a mutex with a condvar, not `thread::unpark`: loom
/// lets an unpark make a thread runnable while it is blocked on a mutex, and
/// then fails the model on a schedule that cannot happen.
struct Task {
    waker: Waker,
    signal: std::sync::Arc<Signal>,
}

#[derive(Default)]
struct Signal {
    woken: Mutex<bool>,
    changed: Condvar,
    wakes: AtomicUsize,
}

impl Wake for Signal {
    fn wake(self: std::sync::Arc<Self>) {
        self.wakes.fetch_add(1, SeqCst);
        *self.woken.lock() = true;
        self.changed.notify_one();
    }
}

type Outcome = Result<(), ServerError>;

impl Task {
    fn new() -> Self {
        let signal = std::sync::Arc::new(Signal::default());
        let waker = Waker::from(signal.clone());
        Self { waker, signal }
    }

    /// Poll with `poll` until it is ready, sleeping until woken in between.
    fn wait(&self, mut poll: impl FnMut(&mut Context<'_>) -> Poll<Outcome>) -> Outcome {
        let mut cx = Context::from_waker(&self.waker);
        loop {
            if let Poll::Ready(result) = poll(&mut cx) {
                return result;
            }
            let mut woken = self.signal.woken.lock();
            while !*woken {
                woken = self.signal.changed.wait(woken);
            }
            *woken = false;
        }
    }

    fn wait_for(&self, slot: &Slot) -> Outcome {
        self.wait(|cx| slot.poll(cx))
    }

    fn wakes(&self) -> usize {
        self.signal.wakes.load(SeqCst)
    }
}

/// A pool of at most `max_threads` lane threads (and the poller) that stay
/// `keep_alive` when idle, a device whose work has not ended, and a task.
fn fixture(max_threads: usize, keep_alive: Duration) -> (Pool, Arc<Device>, Task) {
    (
        pool(max_threads, keep_alive, 0),
        Arc::default(),
        Task::new(),
    )
}

fn pool(max_threads: usize, keep_alive: Duration, watchers: usize) -> Pool {
    Pool::new(Config {
        max_threads,
        keep_alive,
        thread_name: "loom-waiter".to_owned(),
        spin_budget: Duration::ZERO,
        stuck_after: None,
        watchers,
    })
}

/// [`fixture`] with one lane thread that may watch, and a device whose
/// stream keeps a progress word.
fn watching_fixture() -> (Pool, Arc<Device>, Task) {
    (pool(1, Duration::ZERO, 1), Device::with_word(), Task::new())
}

/// A long keep-alive: idle threads sleep until woken (it never runs out).
const FOREVER: Duration = Duration::from_secs(3600);

fn fence(device: &Arc<Device>, lane: u64, sequence: u64) -> Box<MockFence> {
    let device = device.clone();
    Box::new(MockFence {
        device,
        lane,
        sequence,
    })
}

type Submitted = Result<Arc<Slot>, ServerError>;

/// Hand `pool` `task`'s wait on `device` in `lane` at `seq`, as a first poll
/// that found it not reached does, and act on what the pool decided.
fn try_submit(pool: &Pool, device: &Arc<Device>, lane: u64, seq: u64, task: &Task) -> Submitted {
    let slot = Arc::new(Slot::new(task.waker.clone()));
    let key = LaneKey::for_tests(lane);
    let fence: std::sync::Arc<MockFence> = fence(device, lane, seq).into();
    let wait = Wait::new(fence, slot.clone(), key, None);
    let (_, action) = pool.submit(wait)?;
    threads::act(pool, action);
    Ok(slot)
}

fn submit(pool: &Pool, device: &Arc<Device>, lane: u64, seq: u64, task: &Task) -> Arc<Slot> {
    try_submit(pool, device, lane, seq, task).expect("submitted")
}

/// `task`'s future for a fence at sequence 1 of `lane` on `device`, polled
/// once: handed off to `pool` (the device has not finished).
fn handed_off(pool: &Pool, device: &Arc<Device>, lane: u64, task: &Task) -> Handoff<MockFence> {
    let mut future = Handoff::new(*fence(device, lane, 1), PoolRef::Owned(pool.clone()));
    let polled = future.poll(&mut Context::from_waker(&task.waker));
    assert!(polled.is_pending(), "handed off");
    future
}

/// The device's work ends on a thread of its own, racing the model.
fn finish_on_a_thread(device: &Arc<Device>) -> thread::JoinHandle<()> {
    let device = device.clone();
    thread::spawn(move || device.finish())
}

/// Yield until `fences` of `device`'s fences are dropped and `pool` holds
/// `pending` waits.
fn settle_down(pool: &Pool, device: &Device, fences: usize, pending: usize) {
    while device.fences_dropped.load(SeqCst) < fences || pool.gauges().pending != pending {
        thread::yield_now();
    }
}

#[test]
fn loom_slot_completion_is_never_lost() {
    loom::model(|| {
        let task = Task::new();
        let slot = Arc::new(Slot::new(task.waker.clone()));
        let completer = {
            let slot = slot.clone();
            thread::spawn(move || slot.complete(Ok(()), |_, _| {}))
        };
        let mut cx = Context::from_waker(&task.waker);
        let first = slot.poll(&mut cx);
        completer.join().unwrap();
        if first.is_pending() {
            // Pending: the result came after the poll, and woke the task.
            assert_eq!(task.wakes(), 1);
            assert_eq!(slot.poll(&mut cx), Poll::Ready(Ok(())));
        } else {
            assert_eq!(first, Poll::Ready(Ok(())));
        }
    });
}

#[test]
fn loom_slot_cancel_races_completion() {
    loom::model(|| {
        // Whichever comes first counts, and only it: the result (counted as
        // it is left) or the cancel.
        let task = Task::new();
        let slot = Arc::new(Slot::new(task.waker.clone()));
        let delivered = Arc::new(AtomicUsize::new(0));
        let completer = {
            let (slot, delivered) = (slot.clone(), delivered.clone());
            let count = move |_, _| _ = delivered.fetch_add(1, SeqCst);
            thread::spawn(move || slot.complete(Err(ServerError::WaiterGone), count))
        };
        let cancelled = slot.cancel();
        completer.join().unwrap();
        assert_eq!(usize::from(cancelled) + delivered.load(SeqCst), 1);
        assert!(task.wakes() <= 1 && slot.is_cancelled());
        let polled = slot.poll(&mut Context::from_waker(&task.waker));
        assert!(polled.is_pending(), "a cancelled slot keeps no result");
    });
}

#[test]
fn loom_a_future_is_handed_off_and_resolved() {
    loom::model(|| {
        let (pool, device, task) = fixture(1, Duration::ZERO);
        let mut future = handed_off(&pool, &device, 0, &task);
        let finisher = finish_on_a_thread(&device);
        assert_eq!(task.wait(|cx| future.poll(cx)), Ok(()));
        finisher.join().unwrap();
        assert_eq!(pool.gauges().pending, 0, "left the pool before its result");
        pool.shutdown();
    });
}

#[test]
fn loom_a_lane_is_resolved_in_order() {
    loom::model(|| {
        let (pool, device, task) = fixture(1, Duration::ZERO);
        let first = submit(&pool, &device, 0, 1, &task);
        let second = submit(&pool, &device, 0, 2, &task);
        device.finish();
        assert_eq!(task.wait_for(&second), Ok(()));
        let first = first.poll(&mut Context::from_waker(&task.waker));
        assert_eq!(first, Poll::Ready(Ok(())), "the older wait resolved first");
        pool.shutdown();
    });
}

#[test]
fn loom_a_cancelled_wait_is_dropped_and_counted_once() {
    loom::model(|| {
        // The future of a wait left to its lane's thread is dropped (its slot
        // cancelled) as the device finishes: the thread drops its fence, and
        // it counts once, cancelled or delivered.
        let (pool, device, task) = fixture(1, Duration::ZERO);
        let slot = submit(&pool, &device, 0, 1, &task);
        let finisher = finish_on_a_thread(&device);
        let cancelled = slot.cancel();
        finisher.join().unwrap();
        settle_down(&pool, &device, 1, 0);
        let counts = pool.counters().read(Default::default());
        assert_eq!(u64::from(cancelled) + counts.resolved + counts.failed, 1);
        assert_eq!(device.fences_dropped.load(SeqCst), 1);
        pool.shutdown();
    });
}

#[test]
fn loom_shutdown_races_a_submit() {
    // Catches plant `submit-after-shutdown-queued`: a wait queued after
    // shutdown is in a lane nobody serves (the invariants fail).
    loom::model(|| {
        // One wait is handed off, then a second races the shutdown: it is
        // refused, or both resolve (reached, or failed by shutdown). None is
        // left pending.
        let (pool, device, task) = fixture(1, Duration::ZERO);
        let first = submit(&pool, &device, 0, 1, &task);
        let stopper = {
            let pool = pool.clone();
            thread::spawn(move || pool.shutdown())
        };
        let second = try_submit(&pool, &device, 0, 2, &task);
        device.finish();
        assert!(matches!(second, Ok(_) | Err(ServerError::WaiterGone)));
        for slot in std::iter::once(first).chain(second.ok()) {
            let result = task.wait_for(&slot);
            assert!(matches!(result, Ok(()) | Err(ServerError::WaiterGone)));
        }
        stopper.join().unwrap();
        assert_eq!(pool.gauges().pending, 0);
    });
}

#[test]
fn loom_a_second_lane_beyond_max_threads_is_polled_not_held_back() {
    loom::model(|| {
        // The one lane thread allowed blocks on the slow lane; the fast lane
        // goes to the poller, which resolves it while the slow one waits.
        let (pool, slow, task) = fixture(1, Duration::ZERO);
        let fast = Arc::<Device>::default();
        let slow_slot = submit(&pool, &slow, 0, 1, &task);
        let fast_slot = submit(&pool, &fast, 1, 1, &task);
        fast.finish();
        assert_eq!(task.wait_for(&fast_slot), Ok(()));
        slow.finish();
        assert_eq!(task.wait_for(&slow_slot), Ok(()));
        pool.shutdown();
    });
}

#[test]
fn loom_a_dropped_future_withdraws_its_wait_or_leaves_it_to_the_thread() {
    loom::model(|| {
        // The future's drop races the lane thread taking its wait: the drop
        // withdraws it and a waiter thread drops it, or the lane thread has
        // it and drops it when done. Either way it leaves the pool, counted
        // once, and its fence is dropped once, off the dropping thread.
        let (pool, device, task) = fixture(1, Duration::ZERO);
        let future = handed_off(&pool, &device, 0, &task);
        let finisher = finish_on_a_thread(&device);
        drop(future);
        finisher.join().unwrap();
        settle_down(&pool, &device, 1, 0);
        assert_eq!(device.fences_dropped.load(SeqCst), 1);
        let dropped_on = device.dropped_on.lock()[0];
        assert_ne!(dropped_on, thread::current().id(), "on a waiter thread");
        assert!(task.wakes() <= 1, "woken only if resolved before the drop");
        let counts = pool.counters().read(Default::default());
        assert_eq!(counts.cancelled + counts.resolved + counts.failed, 1);
        pool.shutdown();
    });
}

#[test]
fn loom_shutdown_resolves_a_wait_a_thread_is_blocked_on() {
    loom::model(|| {
        // The device finishes only after the future resolved: blocked on yet
        // or not, the wait is resolved by shutdown.
        let (pool, device, task) = fixture(1, Duration::ZERO);
        let slot = submit(&pool, &device, 0, 1, &task);
        pool.shutdown();
        assert_eq!(task.wait_for(&slot), Err(ServerError::WaiterGone));
        assert_eq!(pool.gauges().pending, 0);
        device.finish(); // lets the thread's block end, so it can exit
    });
}

#[test]
fn loom_a_lane_its_thread_releases_races_a_submit_to_it() {
    loom::model(|| {
        // The lane thread finishes lane 0 as a new wait comes for it: the
        // wait finds the lane still the thread's, which serves it again
        // rather than remove it, or makes it again and wakes the thread, idle
        // by then (or starts one, if it timed out and left). Room for two
        // lane threads, yet never two at once.
        let (pool, device, task) = fixture(2, Duration::ZERO);
        device.finish();
        let first = submit(&pool, &device, 0, 1, &task);
        let second = submit(&pool, &device, 0, 2, &task);
        assert_eq!(task.wait_for(&first), Ok(()));
        assert_eq!(task.wait_for(&second), Ok(()));
        assert_eq!(pool.gauges().peak_threads, 1, "peak threads");
        pool.shutdown();
    });
}

#[test]
fn loom_an_idle_thread_timing_out_races_a_submit() {
    // Catches plants `idle-thread-leaves-without-looking` (lane 1 is left
    // queued for no thread) and `woke-keeps-idle-count` (the thread leaves
    // still counted idle): the invariants fail.
    loom::model(|| {
        // The lane thread serves lane 0 and goes idle with keep_alive(0) as
        // another task hands off a wait on lane 1: the thread is woken for
        // it, or times out just after lane 1 was queued for it (and must look
        // at the queues before it leaves), or has left (and one is started).
        let (pool, device, task) = fixture(1, Duration::ZERO);
        device.finish();
        assert_eq!(task.wait_for(&submit(&pool, &device, 0, 1, &task)), Ok(()));
        let other = {
            let (pool, device) = (pool.clone(), device.clone());
            thread::spawn(move || {
                let task = Task::new();
                task.wait_for(&submit(&pool, &device, 1, 1, &task))
            })
        };
        assert_eq!(other.join().unwrap(), Ok(()));
        assert!(
            pool.gauges().peak_threads <= 2,
            "peak threads: {}",
            pool.gauges().peak_threads
        );
        pool.shutdown();
    });
}

#[test]
fn loom_two_idle_lane_threads_are_woken_for_new_lanes() {
    // Catches plant `idle-thread-wake-never-sent`: a thread counted woken
    // sleeps on, and its lane is never served (the model deadlocks).
    loom::model(|| {
        // Two lane threads serve two lanes, then sleep (never timing out: only
        // a notification wakes them). Two new waits, one per lane: each finds
        // its lane still its thread's, or wakes an idle thread.
        let (pool, device, task) = fixture(2, FOREVER);
        device.finish();
        for sequence in 1..=2 {
            let first = submit(&pool, &device, 0, sequence, &task);
            let second = submit(&pool, &device, 1, sequence, &task);
            assert_eq!(task.wait_for(&first), Ok(()));
            assert_eq!(task.wait_for(&second), Ok(()));
        }
        assert!(
            pool.gauges().peak_threads <= 2,
            "peak threads: {}",
            pool.gauges().peak_threads
        );
        pool.shutdown();
    });
}

#[test]
fn loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller() {
    // Catches plant `refused-lane-left-for-threads`: the lane stays queued
    // for the thread that never came (the invariants fail).
    loom::model(|| {
        // The lane thread a wait needs cannot be started: its count is
        // undone, and the poller serves the lane.
        let (pool, device, task) = fixture(1, Duration::ZERO);
        // Set in each iteration: the model's threads share one OS thread, and
        // so its count of refusals. The first spawn is the submit's.
        crate::sync::test_faults::refuse_spawns(1);
        let slot = submit(&pool, &device, 0, 1, &task);
        let finisher = finish_on_a_thread(&device);
        assert_eq!(task.wait_for(&slot), Ok(()));
        finisher.join().unwrap();
        settle_down(&pool, &device, 1, 0);
        assert_eq!(device.blocked.load(SeqCst), 0, "no lane thread blocked");
        pool.shutdown();
    });
}

#[test]
fn loom_a_future_dropped_while_the_poller_has_its_wait_out() {
    loom::model(|| {
        // The one lane thread blocks on lane 0; lane 1's wait goes to the
        // poller, which takes it out to query it. Its future is dropped
        // meanwhile: the wait is withdrawn from its lane, or found cancelled
        // as the poller puts it back. Either way its fence is dropped once,
        // and it counts once, as cancelled.
        let (pool, slow, task) = fixture(1, Duration::ZERO);
        let never = Arc::<Device>::default();
        let blocked = submit(&pool, &slow, 0, 1, &task);
        drop(handed_off(&pool, &never, 1, &task));
        settle_down(&pool, &never, 1, 1);
        assert_eq!(never.fences_dropped.load(SeqCst), 1);
        slow.finish();
        assert_eq!(task.wait_for(&blocked), Ok(()));
        assert_eq!(pool.gauges().pending, 0);
        let counts = pool.counters().read(Default::default());
        let outcomes = (counts.resolved, counts.failed, counts.cancelled);
        assert_eq!(outcomes, (1, 0, 1));
        pool.shutdown();
    });
}

#[test]
fn loom_the_watcher_and_the_driver_race_to_resolve_a_wait_once() {
    // Catches plant `watcher-takes-the-hold-delivers-nothing`: a watcher that
    // takes the held wait and never delivers it leaves its task asleep
    // (deadlock).
    loom::model(|| {
        // The lane thread puts its wait on the watcher's list and blocks in
        // the driver; the device finishes (its event, then its word) as the
        // watcher looks. The watcher sees the word pass (the query confirms
        // it) and resolves the wait, or the block ends first, or the
        // watcher's window ends: whoever is first resolves it, exactly once,
        // the task is woken, and the entry goes.
        let (pool, device, task) = watching_fixture();
        let slot = submit(&pool, &device, 0, 1, &task);
        let finisher = finish_on_a_thread(&device);
        assert_eq!(task.wait_for(&slot), Ok(()));
        finisher.join().unwrap();
        settle_down(&pool, &device, 1, 0);
        let counts = pool.counters().read(Default::default());
        assert_eq!(
            (counts.resolved, counts.failed),
            (1, 0),
            "resolved once, by the watcher or the block"
        );
        assert!(counts.watched <= 1);
        assert_eq!(
            device.blocked.load(SeqCst),
            1,
            "the lane thread blocked in the driver all the same"
        );
        assert_eq!(pool.watched_entries(), 0, "its entry left with it");
        pool.shutdown();
    });
}

#[test]
fn loom_a_word_ahead_of_its_event_is_confirmed_before_it_resolves() {
    loom::model(|| {
        // The word moves before the event says reached: a watcher that sees
        // it asks the event, and if it is not reached yet, leaves the wait to
        // the driver. The wait never resolves before its event does.
        let (pool, device, task) = watching_fixture();
        let slot = submit(&pool, &device, 0, 1, &task);
        let finisher = {
            let device = device.clone();
            thread::spawn(move || {
                device.move_word();
                device.finish();
            })
        };
        assert_eq!(task.wait_for(&slot), Ok(()));
        assert!(device.is_reached(), "resolved only once its event was");
        finisher.join().unwrap();
        settle_down(&pool, &device, 1, 0);
        assert_eq!(pool.watched_entries(), 0, "its entry left with it");
        pool.shutdown();
    });
}

#[test]
fn loom_a_wait_cancelled_while_watched() {
    loom::model(|| {
        // The future is dropped during the race (the wait on the watcher's
        // list, or before it got there, or after it left): the wait counts
        // once, its fence is dropped once on a waiter thread, and its entry
        // goes.
        let (pool, device, task) = watching_fixture();
        let future = handed_off(&pool, &device, 0, &task);
        let finisher = finish_on_a_thread(&device);
        drop(future);
        finisher.join().unwrap();
        settle_down(&pool, &device, 1, 0);
        let counts = pool.counters().read(Default::default());
        assert_eq!(counts.cancelled + counts.resolved + counts.failed, 1);
        assert_ne!(device.dropped_on.lock()[0], thread::current().id());
        assert_eq!(pool.watched_entries(), 0, "its entry left with it");
        pool.shutdown();
    });
}

#[test]
fn loom_shutdown_during_the_race() {
    // Catches plant `shutdown-leaves-the-watchers-list`: entries left on the
    // list of a watcher that exits fail the pool's invariants.
    loom::model(|| {
        // Shutdown comes while the wait may be on the watcher's list (or
        // before it got there, or after it left): the wait resolves with the
        // shutdown, the list empties, and the lane thread, blocked in the
        // driver, leaves once the device finishes.
        let (pool, device, task) = watching_fixture();
        let slot = submit(&pool, &device, 0, 1, &task);
        pool.shutdown();
        assert_eq!(task.wait_for(&slot), Err(ServerError::WaiterGone));
        assert_eq!(pool.watched_entries(), 0);
        device.finish();
    });
}

#[test]
fn loom_waits_handed_to_the_watcher_in_turn_lose_no_wake_up() {
    loom::model(|| {
        // Two waits of one lane, one after the other, with threads that never
        // time out: the second entry must wake the watcher that waits for
        // entries (or find it still looking), else the model deadlocks.
        let pool = pool(1, FOREVER, 1);
        let (device, task) = (Device::with_word(), Task::new());
        device.finish();
        for sequence in 1..=2 {
            let slot = submit(&pool, &device, 0, sequence, &task);
            assert_eq!(task.wait_for(&slot), Ok(()));
        }
        settle_down(&pool, &device, 2, 0);
        assert_eq!(pool.watched_entries(), 0);
        pool.shutdown();
    });
}

/// A pool with two lane threads and a watcher, whose threads wait for work until woken, and lane
/// 0's waits said to take 1 ms; a task; and a wait of lane 0 handed to the pool, which its
/// lane thread puts on the watcher's list (the watcher naps toward it) and blocks on in a
/// driver that wakes it only once told: the pool, the task, the wait's device and its slot.
fn napping_fixture() -> (Pool, Task, Arc<Device>, Arc<Slot>) {
    let pool = pool(2, FOREVER, 1);
    for _ in 0..2 {
        pool.seed_history(LaneKey::for_tests(0), Duration::from_millis(1));
    }
    let task = Task::new();
    let device = Device::with_slow_driver();
    let slot = submit(&pool, &device, 0, 1, &task);
    (pool, task, device, slot)
}

/// The end of a [`napping_fixture`] model: shutdown fails lane 0's wait, whose word never
/// passed, and the lane threads' drivers wake them, so that they leave.
fn end_napping(pool: &Pool, task: &Task, napped_on: (&Device, &Slot), other: &Device) {
    let (device, slot) = napped_on;
    pool.shutdown();
    assert_eq!(task.wait_for(slot), Err(ServerError::WaiterGone));
    for device in [device, other] {
        device.finish();
        device.wake_driver();
    }
}

#[test]
fn loom_an_entry_due_before_the_watchers_nap_ends_wakes_it() {
    // Catches plant `napping-watcher-never-woken`: a watcher napping toward lane 0's wait is not
    // woken for lane 1's, due at once, and its nap runs out past it (the nap's check fails).
    loom::model(|| {
        // Lane 1's wait, with no history, is due at once; its word has passed, and only the
        // watcher can end it before its driver is told. It comes before the watcher's nap
        // toward lane 0's wait (which it then plans for), during it (and must wake it), or after
        // it ran out; whichever, the watcher sees it.
        let (pool, task, napped_on, held) = napping_fixture();
        let due_now = Device::with_slow_driver();
        due_now.finish();
        let seen = submit(&pool, &due_now, 1, 1, &task);
        assert_eq!(task.wait_for(&seen), Ok(()));
        end_napping(&pool, &task, (&napped_on, &held), &due_now);
    });
}

#[test]
fn loom_an_entry_due_after_the_watchers_nap_ends_leaves_it_asleep() {
    loom::model(|| {
        // Lane 1's waits are said to take 2 ms: its wait is due to be looked at after the end
        // of the watcher's nap toward lane 0's (due in 1 ms), and does not wake it. Its word has
        // passed, and only the watcher can end it before its driver is told: the watcher's nap
        // runs out, lane 0's wait is looked at for its window and left to the driver, and the
        // watcher naps on toward lane 1's, and sees it.
        let (pool, task, napped_on, held) = napping_fixture();
        for _ in 0..2 {
            pool.seed_history(LaneKey::for_tests(1), Duration::from_millis(2));
        }
        let later = Device::with_slow_driver();
        later.finish();
        let seen = submit(&pool, &later, 1, 1, &task);
        assert_eq!(task.wait_for(&seen), Ok(()));
        end_napping(&pool, &task, (&napped_on, &held), &later);
    });
}
