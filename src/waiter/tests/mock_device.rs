//! A stand-in device for the waiter's unit tests and loom models: work that
//! ends when the test says, and fences on it that count the threads
//! blocked on them and their drops (their events destroyed), and plant the
//! faults a test arms in the waiter thread that calls them. Built on the
//! crate's loom shim, so it serves both.

use std::sync::atomic::Ordering;

use crate::api::WordMemory;
use crate::sync::{thread, Arc, AtomicUsize, Condvar, Mutex};
use crate::waiter::waitable::{LaneKey, Waitable};
use crate::ServerError;

/// The "device": a flag its work sets when done.
#[derive(Default)]
pub(super) struct Device {
    reached: Mutex<bool>,
    changed: Condvar,
    /// Blocks on its fences begun so far.
    pub(super) blocked: AtomicUsize,
    /// Queries of its fences so far.
    pub(super) queried: AtomicUsize,
    /// Fences on it dropped so far.
    pub(super) fences_dropped: AtomicUsize,
    /// The threads the fences were dropped on.
    pub(super) dropped_on: Mutex<Vec<thread::ThreadId>>,
    /// Its stream's progress word, if it keeps one ([`Device::with_word`]).
    word: Option<std::sync::Arc<MockWord>>,
    /// A driver slow to wake: blocks end only once the work has ended and
    /// this is set ([`Device::with_slow_driver`]).
    slow_driver: Option<Mutex<bool>>,
    /// Faults it plants in the next waiter thread that calls it (std's
    /// atomics: no model sees them).
    faults: Faults,
}

/// Faults a [`Device`] plants, through the sync shim's test faults
/// ([`crate::sync::test_faults`]), in the thread that makes one of its calls:
/// each is armed for the next such call, and used up by it.
#[derive(Default)]
struct Faults {
    /// At its next query, its thread's next lock panics.
    escape_at_query: std::sync::atomic::AtomicBool,
    /// Its next block returns at once, and its thread's next lock panics.
    escape_at_block: std::sync::atomic::AtomicBool,
    /// At the next read of its word, its thread's next spawn is refused.
    refuse_at_progress: std::sync::atomic::AtomicBool,
}

impl Faults {
    /// Whether `fault` was armed; it is used up.
    fn take(fault: &std::sync::atomic::AtomicBool) -> bool {
        fault.swap(false, Ordering::SeqCst)
    }
}

/// A progress word the device moves past every fence as its work ends.
#[derive(Default)]
struct MockWord(AtomicUsize);

impl WordMemory for MockWord {
    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst) as u64
    }
}

impl Device {
    /// A device whose work is already done.
    #[cfg_attr(device_events_loom, allow(dead_code))]
    pub(super) fn reached() -> Arc<Self> {
        let device = Arc::new(Self::default());
        device.finish();
        device
    }

    /// A device whose stream keeps a progress word.
    pub(super) fn with_word() -> Arc<Self> {
        Arc::new(Self {
            word: Some(Default::default()),
            ..Self::default()
        })
    }

    /// A device whose stream keeps a progress word, and whose driver wakes
    /// the threads blocked on its fences only once told to
    /// ([`Device::wake_driver`]), however long after the work's end.
    pub(super) fn with_slow_driver() -> Arc<Self> {
        Arc::new(Self {
            word: Some(Default::default()),
            slow_driver: Some(Mutex::new(false)),
            ..Self::default()
        })
    }

    /// The slow driver wakes the threads blocked on its fences (once its
    /// work has ended).
    pub(super) fn wake_driver(&self) {
        if let Some(woken) = &self.slow_driver {
            *woken.lock() = true;
        }
        let _reached = self.reached.lock();
        self.changed.notify_all();
    }

    /// Its work ends: every fence on it is reached, and then its word moves
    /// past them (a CUDA stream writes its word after the fence's record).
    pub(super) fn finish(&self) {
        self.reach();
        self.move_word();
    }

    /// Its work ends, every fence on it reached, but its word stays behind
    /// (a CUDA stream's write after the record not landed yet).
    pub(super) fn reach(&self) {
        *self.reached.lock() = true;
        self.changed.notify_all();
    }

    /// Its word moves past every fence (before their events say so, if
    /// called before [`Device::finish`]: a reading the driver does not rule out).
    pub(super) fn move_word(&self) {
        if let Some(word) = &self.word {
            word.0.store(usize::MAX, Ordering::SeqCst);
        }
    }

    /// The waiter thread that next queries a fence on it panics at its next
    /// lock, outside any contained call (the query itself, contained,
    /// returns as usual).
    #[cfg_attr(device_events_loom, allow(dead_code))]
    pub(super) fn escape_after_query(&self) {
        self.faults.escape_at_query.store(true, Ordering::SeqCst);
    }

    /// The waiter thread that next blocks on a fence on it returns from
    /// the block at once, holding its wait, and panics at its next lock,
    /// outside any contained call.
    #[cfg_attr(device_events_loom, allow(dead_code))]
    pub(super) fn escape_after_block(&self) {
        self.faults.escape_at_block.store(true, Ordering::SeqCst);
    }

    /// The waiter thread that next reads its word (a lane thread about to
    /// hand its wait to the watcher) has its next thread spawn refused.
    #[cfg_attr(device_events_loom, allow(dead_code))]
    pub(super) fn refuse_spawn_after_progress(&self) {
        self.faults.refuse_at_progress.store(true, Ordering::SeqCst);
    }

    /// Whether its work has ended.
    #[cfg_attr(not(device_events_loom), allow(dead_code))]
    pub(super) fn is_reached(&self) -> bool {
        *self.reached.lock()
    }

    /// Sleep until its work ends.
    #[cfg(not(device_events_loom))]
    pub(super) fn wait_reached(&self) {
        let mut reached = self.reached.lock();
        while !*reached {
            reached = self.changed.wait(reached);
        }
    }

    /// Sleep until its work ends and its driver wakes the blocked threads.
    fn wait_woken(&self) {
        let mut reached = self.reached.lock();
        loop {
            let woken = self.slow_driver.as_ref().is_none_or(|woken| *woken.lock());
            if *reached && woken {
                return;
            }
            reached = self.changed.wait(reached);
        }
    }
}

/// A fence on a [`Device`], in lane `lane` at `sequence`.
pub(super) struct MockFence {
    pub(super) device: Arc<Device>,
    pub(super) lane: u64,
    pub(super) sequence: u64,
}

impl Waitable for MockFence {
    fn lane(&self) -> LaneKey {
        LaneKey::for_tests(self.lane)
    }

    fn sequence(&self) -> u64 {
        self.sequence
    }

    fn query(&self) -> Result<bool, ServerError> {
        self.device.queried.fetch_add(1, Ordering::SeqCst);
        if Faults::take(&self.device.faults.escape_at_query) {
            crate::sync::test_faults::panic_at_next_lock();
        }
        Ok(*self.device.reached.lock())
    }

    fn block(&self) -> Result<(), ServerError> {
        self.device.blocked.fetch_add(1, Ordering::SeqCst);
        if Faults::take(&self.device.faults.escape_at_block) {
            crate::sync::test_faults::panic_at_next_lock();
            return Ok(());
        }
        self.device.wait_woken();
        Ok(())
    }

    fn stream_name(&self) -> String {
        format!("mock stream {}", self.lane)
    }

    fn progress(&self) -> Option<crate::ProgressWord> {
        if Faults::take(&self.device.faults.refuse_at_progress) {
            crate::sync::test_faults::refuse_spawns(1);
        }
        let word = self.device.word.clone()?;
        Some(crate::ProgressWord::new(word))
    }
}

impl Drop for MockFence {
    fn drop(&mut self) {
        self.device.dropped_on.lock().push(thread::current().id());
        self.device.fences_dropped.fetch_add(1, Ordering::SeqCst);
    }
}

/// What the unit tests share (not the loom models): a pool of their own,
/// waits handed to it, and waiting with a limit (a failure, not a hang).
#[cfg(not(device_events_loom))]
pub(super) mod support {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    use std::thread::Thread;
    use std::time::{Duration, Instant};

    use super::{Device, MockFence};
    use crate::waiter::pool::{Config, Pool};
    use crate::waiter::slot::Slot;
    use crate::waiter::threads;
    use crate::waiter::wait::{Place, Wait};
    use crate::waiter::waitable::Waitable;
    use crate::ServerError;

    /// The longest any test here waits for anything.
    pub(crate) const LIMIT: Duration = Duration::from_secs(20);

    /// A pool with at most `max_threads` lane threads that stay `keep_alive`
    /// when idle, and stuck streams reported after `stuck_after`.
    pub(crate) fn pool(
        max_threads: usize,
        keep_alive: Duration,
        stuck_after: Option<Duration>,
    ) -> Pool {
        Pool::new(Config {
            max_threads,
            keep_alive,
            thread_name: "unit-test-waiter".to_owned(),
            spin_budget: Duration::ZERO,
            stuck_after,
            watchers: 0,
        })
    }

    /// A pool with at most `max_threads` lane threads and a watcher, whose
    /// threads stay `keep_alive` when idle.
    pub(crate) fn pool_watching(max_threads: usize, keep_alive: Duration) -> Pool {
        Pool::new(Config {
            watchers: 1,
            ..pool(max_threads, keep_alive, None).config().clone()
        })
    }

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
    pub(crate) fn submit(pool: &Pool, device: &Arc<Device>, lane: u64, sequence: u64) -> Arc<Slot> {
        submit_placed(pool, device, lane, sequence).0
    }

    /// [`submit`], and where the wait was placed (to withdraw it).
    pub(crate) fn submit_placed(
        pool: &Pool,
        device: &Arc<Device>,
        lane: u64,
        sequence: u64,
    ) -> (Arc<Slot>, Place) {
        let fence = MockFence {
            device: device.clone(),
            lane,
            sequence,
        };
        submit_fence(pool, Box::new(fence))
    }

    /// Hand a wait on `fence` to `pool`, as a first poll that found it not
    /// reached does: its slot, and where it was placed.
    pub(crate) fn submit_fence(pool: &Pool, fence: Box<dyn Waitable>) -> (Arc<Slot>, Place) {
        let slot = Arc::new(Slot::new(waker()));
        let name = pool
            .config()
            .stuck_after
            .map(|_| fence.stream_name().into());
        let lane = fence.lane();
        let wait = Wait::new(fence.into(), slot.clone(), lane, name);
        let (place, action) = pool.submit(wait).expect("submitted");
        threads::act(pool, action);
        (slot, place)
    }

    /// A pool with one lane thread (idle for up to `keep_alive`), blocked on
    /// a wait in lane 0, so that lane 1 goes to the poller: the pool, lane
    /// 0's device and that wait's slot.
    pub(crate) fn one_lane_thread_blocked(
        keep_alive: Duration,
        stuck_after: Option<Duration>,
    ) -> (Pool, Arc<Device>, Arc<Slot>) {
        let pool = pool(1, keep_alive, stuck_after);
        let held = Arc::new(Device::default());
        let blocked = submit(&pool, &held, 0, 0);
        eventually("the lane thread blocks", || {
            held.blocked.load(Ordering::SeqCst) == 1
        });
        (pool, held, blocked)
    }

    /// The slot's result, sleeping until it is woken; a failure (not a
    /// hang) if none comes within [`LIMIT`].
    pub(crate) fn result_of(slot: &Slot) -> Result<(), ServerError> {
        let waker = waker();
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Poll::Ready(result) = slot.poll(&mut Context::from_waker(&waker)) {
                return result;
            }
            let left = deadline.checked_duration_since(Instant::now());
            std::thread::park_timeout(left.expect("the wait resolved within the limit"));
        }
    }

    /// Poll `condition` every millisecond until it holds; a failure past
    /// [`LIMIT`].
    pub(crate) fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + LIMIT;
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting for: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
