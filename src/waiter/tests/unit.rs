//! The waiter's unit tests that need its internals: a slot's one result,
//! the stats' counters and histogram, what serving a lane costs (one block
//! and one query per wait for work that ends item after item; batches for a
//! burst), what counts as a stall's progress, and the poller's pauses and
//! leaving.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use super::mock_device::support::{eventually, result_of, submit, submit_fence, submit_placed};
use super::mock_device::Device;
use crate::waiter::slot::Slot;
use crate::waiter::state::{Action, State};
use crate::waiter::stats::{Counters, WaiterStats};
use crate::waiter::wait::Wait;
use crate::waiter::waitable::LaneKey;
use crate::ServerError;

struct Counting(AtomicUsize);

impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting() -> (Waker, Arc<Counting>) {
    let counter = Arc::new(Counting(AtomicUsize::new(0)));
    (Waker::from(counter.clone()), counter)
}

#[test]
fn the_first_result_stands() {
    let (waker, wakes) = counting();
    let slot = Slot::new(waker.clone());
    slot.complete(Ok(()), |_, _| {});
    slot.complete(Err(ServerError::WaiterGone), |_, _| {});
    assert_eq!(wakes.0.load(Ordering::SeqCst), 1, "woken once");
    let mut cx = Context::from_waker(&waker);
    assert_eq!(slot.poll(&mut cx), Poll::Ready(Ok(())));
}

#[test]
fn a_cancelled_slot_is_never_completed_or_woken() {
    let (waker, wakes) = counting();
    let slot = Slot::new(waker.clone());
    assert!(!slot.is_cancelled());
    assert!(slot.cancel());
    assert!(slot.is_cancelled());
    slot.complete(Ok(()), |_, _| {});
    assert_eq!(
        wakes.0.load(Ordering::SeqCst),
        0,
        "a cancelled wait wakes nobody"
    );
    let mut cx = Context::from_waker(&waker);
    assert!(slot.poll(&mut cx).is_pending(), "nor keeps a result");
}

#[test]
fn a_panicking_waker_costs_only_its_wake() {
    struct Panicking;
    impl Wake for Panicking {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }
    let slot = Slot::new(Waker::from(Arc::new(Panicking)));
    slot.complete(Ok(()), |_, _| {}); // does not unwind
    let (waker, _) = counting();
    assert_eq!(
        slot.poll(&mut Context::from_waker(&waker)),
        Poll::Ready(Ok(()))
    );
}

#[test]
fn each_wait_counts_one_outcome_whichever_comes_first() {
    let counters = Counters::default();
    let count = |ok: bool, since| counters.delivered(ok, since);
    let (waker, _) = counting();
    // Its result came, then its future was dropped unpolled: resolved.
    let delivered = Slot::new(waker.clone());
    delivered.complete(Ok(()), count);
    assert!(!delivered.cancel(), "not cancelled: its result came");
    // Dropped first, then the device got there: cancelled, once.
    let dropped = Slot::new(waker.clone());
    assert!(dropped.cancel());
    dropped.complete(Ok(()), count);
    assert!(!dropped.cancel());
    // Failed, then failed again (shutdown after a fault): one failure.
    let failed = Slot::new(waker);
    failed.complete(Err(ServerError::WaiterGone), count);
    failed.complete(Err(ServerError::WaiterGone), count);
    let counts = counters.read(Default::default());
    assert_eq!((counts.resolved, counts.failed), (1, 1));
    assert_eq!(counts.wake_latency.count(), 2);
}

#[test]
fn counts_from_many_threads_all_add_up() {
    let counters = Counters::default();
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(|| {
                for round in 0..1000 {
                    counters.handed_off();
                    counters.delivered(round % 10 != 0, Instant::now());
                    counters.ready_at_first_poll();
                }
            });
        }
    });
    let counts = counters.read(Default::default());
    assert_eq!(counts.handed_off, 8000);
    assert_eq!(counts.resolved, 7200);
    assert_eq!(counts.failed, 800);
    assert_eq!(counts.ready_at_first_poll, 8000);
    assert_eq!(counts.wake_latency.count(), 8000);
}

#[test]
fn a_snapshot_taken_while_waits_end_never_shows_more_than_has_happened() {
    let counters = Counters::default();
    let writing = std::sync::atomic::AtomicUsize::new(4);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                for round in 0..20_000 {
                    counters.handed_off();
                    counters.delivered(round % 3 != 0, Instant::now());
                }
                writing.fetch_sub(1, Ordering::SeqCst);
            });
        }
        let mut snapshots = 0u64;
        while writing.load(Ordering::SeqCst) > 0 || snapshots == 0 {
            let counts = counters.read(Default::default());
            let outcomes = counts.resolved + counts.failed;
            assert!(
                counts.wake_latency.count() <= outcomes,
                "{} latencies, {outcomes} outcomes",
                counts.wake_latency.count()
            );
            assert!(outcomes <= counts.handed_off, "{outcomes} outcomes");
            snapshots += 1;
        }
    });
    let counts = counters.read(Default::default());
    assert_eq!(counts.wake_latency.count(), counts.resolved + counts.failed);
}

const WAITS: usize = 32;

#[test]
fn waits_reached_one_after_another_cost_one_block_and_at_most_one_query_each() {
    let pool = super::mock_device::support::pool(4, Duration::from_secs(5), None);
    let devices: Vec<Arc<Device>> = (0..WAITS).map(|_| Arc::new(Device::default())).collect();
    let slots: Vec<Arc<Slot>> = (0..)
        .zip(&devices)
        .map(|(sequence, device)| submit(&pool, device, 0, sequence))
        .collect();
    for (index, (device, slot)) in devices.iter().zip(&slots).enumerate() {
        // The item ends only once the lane thread sleeps on its wait, as
        // when each item runs longer than the thread takes to get there.
        eventually(&format!("the lane thread blocks on wait {index}"), || {
            device.blocked.load(Ordering::SeqCst) == 1
        });
        device.finish();
        result_of(slot).expect("resolved");
    }
    for (index, device) in devices.iter().enumerate() {
        assert_eq!(
            device.blocked.load(Ordering::SeqCst),
            1,
            "blocks on wait {index}"
        );
        // Asked once as the thread takes it; a batch would ask again.
        assert!(
            device.queried.load(Ordering::SeqCst) <= 1,
            "queries of wait {index}"
        );
    }
}

#[test]
fn a_burst_is_resolved_in_batches_with_no_block_past_the_first() {
    let pool = super::mock_device::support::pool(4, Duration::from_secs(5), None);
    let held = Arc::new(Device::default());
    let first = submit(&pool, &held, 0, 0);
    eventually("the lane thread blocks on the first", || {
        held.blocked.load(Ordering::SeqCst) == 1
    });
    let burst = Device::reached();
    let slots: Vec<Arc<Slot>> = (1..=WAITS as u64)
        .map(|sequence| submit(&pool, &burst, 0, sequence))
        .collect();
    held.finish();
    result_of(&first).expect("resolved");
    for slot in &slots {
        result_of(slot).expect("resolved");
    }
    assert_eq!(
        burst.blocked.load(Ordering::SeqCst),
        0,
        "no block once reached"
    );
    assert_eq!(
        burst.queried.load(Ordering::SeqCst),
        WAITS,
        "each asked once"
    );
}

/// A wait on a reached fence of stream `lane` at `sequence`.
fn reached_wait(lane: u64, sequence: u64) -> Wait {
    let fence = super::mock_device::MockFence {
        device: Device::reached(),
        lane,
        sequence,
    };
    let slot = Arc::new(Slot::new(futures::task::noop_waker()));
    Wait::new(Arc::new(fence), slot, LaneKey::for_tests(lane), None)
}

/// A new lane in `state` for stream `lane`, placed with `max_threads`.
fn new_lane(state: &mut State, lane: u64, max_threads: usize) -> Action {
    assert!(state.insert(reached_wait(lane, 0)));
    state.place(LaneKey::for_tests(lane), max_threads, false)
}

#[test]
fn new_lanes_start_threads_up_to_max_threads_then_go_to_one_poller() {
    let mut state = State::default();
    assert_eq!(new_lane(&mut state, 0, 2).spawn_thread, Some(1));
    assert_eq!(new_lane(&mut state, 1, 2).spawn_thread, Some(2));
    let past = new_lane(&mut state, 2, 2);
    assert!(past.spawn_poller && past.spawn_thread.is_none(), "{past:?}");
    let next = new_lane(&mut state, 3, 2);
    assert!(
        next.wake_poller && !next.spawn_poller,
        "one poller: {next:?}"
    );
}

#[test]
fn withdrawn_waits_go_to_the_poller_never_to_a_new_lane_thread() {
    let mut state = State::default();
    assert!(state.dispose().spawn_poller);
    let again = state.dispose();
    assert!(
        again.wake_poller && again.spawn_thread.is_none(),
        "{again:?}"
    );
}

/// A lane is idle, and still there, between its last wait's end and its
/// thread's release: a wait handed to it then starts its stall at its own
/// hand-off, not at the lane's last mark.
#[test]
fn a_wait_handed_to_an_idle_lane_starts_its_stall_at_its_hand_off() {
    let mut state = State::default();
    assert_eq!(new_lane(&mut state, 0, 1).spawn_thread, Some(1));
    let key = LaneKey::for_tests(0);
    let lane = state.lanes.get_mut(&key).expect("made");
    lane.waits.clear();
    let a_second_ago = lane.since.checked_sub(Duration::from_secs(1));
    lane.since = a_second_ago.expect("a clock past its first second");
    let wait = reached_wait(0, 1);
    let handed_at = wait.slot.handed_at();
    assert!(!state.insert(wait));
    assert_eq!(state.lanes[&key].since, handed_at);
}

/// The poller's figures `WaiterBuilder` gives: `stuck_after`'s (a stall is
/// warned about within a quarter of `stuck_after` past it, with looks at most
/// once a millisecond) and `max_threads`' (its pauses back off from 50 µs to
/// 1 ms).
#[test]
fn the_poller_keeps_the_figures_the_builder_gives() {
    use crate::waiter::poller::{looks_every, POLL_BACKOFF_MAX, POLL_BACKOFF_MIN};
    assert_eq!(POLL_BACKOFF_MIN, Duration::from_micros(50));
    assert_eq!(POLL_BACKOFF_MAX, Duration::from_millis(1));
    assert_eq!(
        looks_every(Duration::from_secs(1)),
        Duration::from_millis(250)
    );
    assert_eq!(
        looks_every(Duration::from_millis(10)),
        Duration::from_micros(2_500)
    );
    assert_eq!(
        looks_every(Duration::from_micros(100)),
        Duration::from_millis(1)
    );
}

#[test]
fn nothing_is_placed_after_shutdown() {
    let mut state = State {
        shutdown: true,
        ..State::default()
    };
    assert_eq!(new_lane(&mut state, 0, 4), Action::default());
}

/// A pool whose one lane thread is blocked on lane 0's held wait and whose
/// second sleeps idle (its keep-alive far past the tests' limit): the pool
/// and the held device.
fn one_blocked_one_idle() -> (crate::waiter::pool::Pool, Arc<Device>, Arc<Slot>) {
    let pool = super::mock_device::support::pool(4, Duration::from_secs(600), None);
    let held = Arc::new(Device::default());
    let blocked = submit(&pool, &held, 0, 0);
    eventually("a lane thread blocks", || {
        held.blocked.load(Ordering::SeqCst) == 1
    });
    result_of(&submit(&pool, &Device::reached(), 1, 0)).expect("resolved");
    eventually("the other lane thread is idle", || pool.idle_threads() == 1);
    (pool, held, blocked)
}

#[test]
fn a_withdrawn_wait_wakes_the_idle_thread_that_drops_it() {
    let (pool, held, blocked) = one_blocked_one_idle();
    let (slot, place) = submit_placed(&pool, &held, 0, 1);
    assert!(slot.cancel());
    let key = crate::waiter::waitable::LaneKey::for_tests(0);
    crate::waiter::threads::act(&pool, pool.withdraw(key, place));
    // Dropped by the idle thread, woken for it: not after its keep-alive.
    eventually("the withdrawn fence is dropped", || {
        held.fences_dropped.load(Ordering::SeqCst) == 1
    });
    assert_eq!(pool.gauges().threads, 2, "no poller was started for it");
    held.finish();
    result_of(&blocked).expect("resolved");
}

#[test]
fn two_new_lanes_with_one_idle_thread_wake_it_once_and_start_another() {
    let (pool, held, blocked) = one_blocked_one_idle();
    // The idle thread is woken for lane 2 (held); lane 3 needs a thread of
    // its own, or it waits behind lane 2's work.
    let second = Arc::new(Device::default());
    let behind = submit(&pool, &second, 2, 0);
    let fast = submit(&pool, &Device::reached(), 3, 0);
    result_of(&fast).expect("lane 3 served while lane 2 is held");
    held.finish();
    second.finish();
    result_of(&blocked).expect("resolved");
    result_of(&behind).expect("resolved");
}

/// [`one_lane_thread_blocked`](super::mock_device::support::one_lane_thread_blocked),
/// its idle thread kept past any test's limit.
fn one_lane_thread_blocked(
    stuck_after: Option<Duration>,
) -> (crate::waiter::pool::Pool, Arc<Device>, Arc<Slot>) {
    super::mock_device::support::one_lane_thread_blocked(Duration::from_secs(600), stuck_after)
}

#[test]
fn new_waits_on_a_stalled_stream_do_not_hide_its_stall() {
    let after = Duration::from_millis(100);
    let (pool, held, blocked) = one_lane_thread_blocked(Some(after));
    let started = Instant::now();
    let mut behind = Vec::new();
    // A hand-off is not progress: waits keep coming, far more often than
    // `after`, and the stream still ends none.
    while pool.stuck().is_empty() {
        assert!(
            started.elapsed() < super::mock_device::support::LIMIT,
            "the stall was never reported"
        );
        std::thread::sleep(Duration::from_millis(5));
        behind.push(submit(&pool, &held, 0, behind.len() as u64 + 1));
    }
    assert_eq!(pool.stuck()[0].stream_id, 0);
    held.finish();
    result_of(&blocked).expect("resolved");
    for slot in &behind {
        result_of(slot).expect("resolved");
    }
}

#[test]
fn a_polled_stream_that_ends_a_wait_is_no_longer_stuck() {
    // Long enough that the read after the resolve comes well inside it.
    let (pool, held, blocked) = one_lane_thread_blocked(Some(Duration::from_secs(1)));
    let (first, second) = (Arc::new(Device::default()), Arc::new(Device::default()));
    let polled = submit(&pool, &first, 1, 0);
    let behind = submit(&pool, &second, 1, 1);
    let stuck_on_1 =
        |pool: &crate::waiter::pool::Pool| pool.stuck().iter().any(|wait| wait.stream_id == 1);
    eventually("stream 1 is reported stuck", || stuck_on_1(&pool));
    let finished = Instant::now();
    first.finish();
    result_of(&polled).expect("resolved");
    // The poller resolved it in a batch: that is progress too. (Stuck again only if this read
    // comes a second after it, on a loaded host: a stall counted from then.)
    let stalls = pool.stuck();
    let since_finished = finished.elapsed();
    let stall = stalls.iter().find(|wait| wait.stream_id == 1);
    assert!(
        stall.is_none_or(|wait| wait.waited <= since_finished),
        "{stalls:?}"
    );
    second.finish();
    held.finish();
    result_of(&behind).expect("resolved");
    result_of(&blocked).expect("resolved");
}

/// A fence in lane 1 whose query waits for `gate`'s work (an outside
/// backend's slow query), counted in `gate.queried`, so a test can look at
/// the pool while its batch is out.
struct GatedFence {
    gate: Arc<Device>,
}

impl crate::waiter::waitable::Waitable for GatedFence {
    fn lane(&self) -> crate::waiter::waitable::LaneKey {
        crate::waiter::waitable::LaneKey::for_tests(1)
    }

    fn sequence(&self) -> u64 {
        0
    }

    fn query(&self) -> Result<bool, ServerError> {
        self.gate.queried.fetch_add(1, Ordering::SeqCst);
        self.gate.wait_reached();
        Ok(true)
    }

    fn block(&self) -> Result<(), ServerError> {
        self.gate.wait_reached();
        Ok(())
    }

    fn stream_name(&self) -> String {
        "gated stream".to_owned()
    }

    fn progress(&self) -> Option<crate::ProgressWord> {
        None
    }
}

#[test]
fn a_wait_out_in_a_batch_is_still_pending() {
    // Every stream with a pending wait counts as stuck at once.
    let (pool, held, blocked) = one_lane_thread_blocked(Some(Duration::ZERO));
    let gate = Arc::new(Device::default());
    let fence = GatedFence { gate: gate.clone() };
    let (slot, _) = submit_fence(&pool, Box::new(fence));
    eventually("the poller asks it", || {
        gate.queried.load(Ordering::SeqCst) == 1
    });
    assert_eq!(pool.gauges().pending, 2, "the held wait and the one out");
    let stuck = pool.stuck();
    let out = stuck.iter().find(|wait| wait.stream_id == 1);
    assert_eq!(out.map(|wait| wait.behind), Some(0), "{stuck:?}");
    gate.finish();
    result_of(&slot).expect("resolved");
    held.finish();
    result_of(&blocked).expect("resolved");
    eventually("none pending", || pool.gauges().pending == 0);
}

#[test]
fn the_poller_leaves_once_its_lanes_are_done_while_a_lane_thread_blocks() {
    let (pool, held, blocked) = one_lane_thread_blocked(None);
    result_of(&submit(&pool, &Device::reached(), 1, 0)).expect("resolved by the poller");
    eventually("only the lane thread is left", || {
        pool.gauges().threads == 1
    });
    held.finish();
    result_of(&blocked).expect("resolved");
}

#[test]
fn the_poller_backs_off_while_its_lane_does_not_move() {
    let (pool, held, blocked) = one_lane_thread_blocked(None);
    let stalled = Arc::new(Device::default());
    let polled = submit(&pool, &stalled, 1, 0);
    eventually("the poller asks", || {
        stalled.queried.load(Ordering::SeqCst) > 0
    });
    let window = Instant::now();
    std::thread::sleep(Duration::from_millis(200));
    let elapsed_ms = window.elapsed().as_millis() as usize;
    // Pauses double up to a millisecond: about one query a millisecond, far
    // fewer than a poller that never pauses makes.
    let queries = stalled.queried.load(Ordering::SeqCst);
    assert!(
        queries <= 10 * elapsed_ms + 100,
        "{queries} queries in {elapsed_ms} ms"
    );
    stalled.finish();
    held.finish();
    result_of(&polled).expect("resolved");
    result_of(&blocked).expect("resolved");
}

/// A fence with a progress word, its queries counted; `answer` gives each
/// query's answer from its number (from 1) and what the word says.
struct WordFence {
    word: Arc<crate::api::HostWord>,
    queries: Arc<AtomicUsize>,
    blocks: Arc<AtomicUsize>,
    /// A block ends once this device finishes (at once without one).
    release: Option<Arc<Device>>,
    answer: fn(usize, bool) -> Result<bool, ServerError>,
    /// Its stream's word went off: the backend hands it out no more.
    off: Arc<AtomicBool>,
}

impl crate::waiter::waitable::Waitable for WordFence {
    fn lane(&self) -> crate::waiter::waitable::LaneKey {
        crate::waiter::waitable::LaneKey::for_tests(7)
    }

    fn sequence(&self) -> u64 {
        3
    }

    fn query(&self) -> Result<bool, ServerError> {
        let number = self.queries.fetch_add(1, Ordering::SeqCst) + 1;
        (self.answer)(
            number,
            crate::ProgressWord::new(self.word.clone()).passed(3),
        )
    }

    fn block(&self) -> Result<(), ServerError> {
        self.blocks.fetch_add(1, Ordering::SeqCst);
        if let Some(release) = &self.release {
            release.wait_reached();
        }
        Ok(())
    }

    fn stream_name(&self) -> String {
        "word stream".to_owned()
    }

    fn progress(&self) -> Option<crate::ProgressWord> {
        let on = !self.off.load(Ordering::SeqCst);
        on.then(|| crate::ProgressWord::new(self.word.clone()))
    }
}

/// The first poll of `fence` in a pool that spins for the longest budget.
fn first_poll_spinning(fence: WordFence) -> Poll<Result<(), ServerError>> {
    let pool = crate::waiter::pool::Pool::new(crate::waiter::pool::Config {
        max_threads: 1,
        keep_alive: Duration::from_secs(1),
        thread_name: "unit-test-waiter".to_owned(),
        spin_budget: crate::waiter::MAX_SPIN_BUDGET,
        stuck_after: None,
        watchers: 0,
    });
    let mut handoff =
        crate::waiter::Handoff::new(fence, crate::waiter::handoff::PoolRef::Owned(pool.clone()));
    let waker = futures::task::noop_waker();
    let polled = handoff.poll(&mut Context::from_waker(&waker));
    drop(handoff);
    pool.shutdown();
    polled
}

#[test]
fn a_first_poll_spins_on_the_progress_word_not_on_queries() {
    let queries = Arc::new(AtomicUsize::new(0));
    let fence = WordFence {
        word: Arc::default(),
        queries: queries.clone(),
        blocks: Arc::default(),
        release: None,
        answer: |_, passed| Ok(passed),
        off: Arc::default(),
    };
    let started = Instant::now();
    assert!(first_poll_spinning(fence).is_pending(), "never reached");
    assert!(
        started.elapsed() >= crate::waiter::MAX_SPIN_BUDGET,
        "spun its budget"
    );
    // One query first, one as the budget ends; none while the word is read.
    assert_eq!(queries.load(Ordering::SeqCst), 2);
}

#[test]
fn a_word_that_says_passed_is_confirmed_by_a_query_that_can_fail() {
    let word = Arc::new(crate::api::HostWord::default());
    word.advance(3);
    let queries = Arc::new(AtomicUsize::new(0));
    // The first query says "not yet", the next one the stream's fault.
    let fence = WordFence {
        word,
        queries: queries.clone(),
        blocks: Arc::default(),
        release: None,
        answer: |number, _| match number {
            1 => Ok(false),
            _ => Err(ServerError::faulted("Mock", "query", 719, "faulted", "")),
        },
        off: Arc::default(),
    };
    let polled = first_poll_spinning(fence);
    assert!(
        matches!(&polled, Poll::Ready(Err(err)) if err.is_faulted()),
        "{polled:?}"
    );
    assert_eq!(queries.load(Ordering::SeqCst), 2);
}

/// A pool whose lane thread may hand its wait to a watcher (`watchers`),
/// and a wait on `fence` handed to it, whose block ends once `release`
/// finishes: the pool and the wait's slot.
fn watching_pool(watchers: usize, fence: WordFence) -> (crate::waiter::pool::Pool, Arc<Slot>) {
    let pool = crate::waiter::pool::Pool::new(crate::waiter::pool::Config {
        max_threads: 1,
        // Idle threads stay past any test's limit: a test that waits to see one idle sees it.
        keep_alive: Duration::from_secs(600),
        thread_name: "unit-test-waiter".to_owned(),
        spin_budget: Duration::ZERO,
        stuck_after: None,
        watchers,
    });
    let (slot, _) = submit_fence(&pool, Box::new(fence));
    (pool, slot)
}

/// A fence whose stream's word has passed it (`passed`), its queries
/// answered by `answer`, its block ended by the device it returns.
fn word_fence(
    passed: bool,
    answer: fn(usize, bool) -> Result<bool, ServerError>,
) -> (WordFence, Arc<Device>) {
    let word = Arc::new(crate::api::HostWord::default());
    if passed {
        word.advance(3);
    }
    let release = Arc::new(Device::default());
    let fence = WordFence {
        word,
        queries: Arc::default(),
        blocks: Arc::default(),
        release: Some(release.clone()),
        answer,
        off: Arc::default(),
    };
    (fence, release)
}

fn is_pending(slot: &Slot) -> bool {
    let waker = futures::task::noop_waker();
    slot.poll(&mut Context::from_waker(&waker)).is_pending()
}

#[test]
fn the_watcher_resolves_a_wait_whose_word_passed_while_its_lane_thread_blocks_in_the_driver() {
    // The driver has not woken the lane thread (it never does, here, until released): the
    // watcher, racing it, resolves the wait.
    let (fence, release) = word_fence(true, |_, passed| Ok(passed));
    let (queries, blocks) = (fence.queries.clone(), fence.blocks.clone());
    let (pool, slot) = watching_pool(1, fence);
    result_of(&slot).expect("resolved by the watcher");
    assert_eq!(queries.load(Ordering::SeqCst), 1, "confirmed by one query");
    assert_eq!(pool.gauges().pending, 0, "no longer pending once resolved");
    assert_eq!(pool.watched_entries(), 0, "its entry left as it resolved");
    eventually("the lane thread blocks in the driver all the same", || {
        blocks.load(Ordering::SeqCst) == 1
    });
    // Counted just after it is delivered.
    eventually("counted as watched", || {
        pool.counters().read(WaiterStats::default()).watched == 1
    });
    release.finish();
    eventually("the lane thread is done with it", || {
        pool.gauges().pending == 0 && pool.idle_threads() == 1
    });
    let counts = pool.counters().read(WaiterStats::default());
    assert_eq!(
        (counts.watched, counts.resolved, counts.failed),
        (1, 1, 0),
        "delivered and counted once"
    );
    pool.shutdown();
}

#[test]
fn the_watcher_confirms_a_passed_word_with_a_query_that_can_fail() {
    let (fence, release) = word_fence(true, |_, _| {
        Err(ServerError::faulted("Mock", "query", 719, "faulted", ""))
    });
    let (pool, slot) = watching_pool(1, fence);
    let result = result_of(&slot);
    assert!(
        matches!(&result, Err(err) if err.is_faulted()),
        "{result:?}"
    );
    release.finish();
    eventually("the lane thread is done with it", || {
        pool.gauges().pending == 0 && pool.idle_threads() == 1
    });
    let counts = pool.counters().read(WaiterStats::default());
    assert_eq!((counts.watched, counts.failed, counts.resolved), (0, 1, 0));
    pool.shutdown();
}

#[test]
fn a_wait_the_watcher_expects_much_later_ends_as_soon_as_the_driver_wakes() {
    // The lane's waits took an hour each: the watcher expects this one in an hour, and its
    // word never moves. The driver's wake ends it, as with no watcher.
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    for _ in 0..4 {
        pool.seed_history(LaneKey::for_tests(0), Duration::from_secs(3600));
    }
    let worded = Device::with_word();
    let slot = submit(&pool, &worded, 0, 1);
    eventually("on the watcher's list, and blocked in the driver", || {
        pool.watched_entries() == 1 && worded.blocked.load(Ordering::SeqCst) == 1
    });
    worded.reach();
    result_of(&slot).expect("ended by the driver's wake");
    eventually("its entry leaves the list", || pool.watched_entries() == 0);
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 0);
    pool.shutdown();
}

#[test]
fn a_lane_keeps_its_history_when_it_goes_idle_and_comes_back() {
    // A request/response stream: its lane goes between requests, its history stays.
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    for sequence in 1..=3 {
        let device = Device::with_word();
        let slot = submit(&pool, &device, 5, sequence);
        eventually("blocked", || device.blocked.load(Ordering::SeqCst) == 1);
        device.finish();
        result_of(&slot).expect("reached");
        eventually("the lane is gone", || pool.gauges().pending == 0);
    }
    eventually("three waits learnt", || {
        pool.history_len(LaneKey::for_tests(5)) == 3
    });
    pool.shutdown();
}

#[test]
fn a_lane_whose_word_went_off_is_not_watched() {
    // Its stream stopped writing its word (a refused write, a capture): the backend no longer
    // hands it out, and the next wait is not put on the watcher's list.
    let (fence, release) = word_fence(false, |_, passed| Ok(passed));
    let off = fence.off.clone();
    let (word, queries) = (fence.word.clone(), fence.queries.clone());
    let (pool, first) = watching_pool(1, fence);
    eventually("the first is on the list", || pool.published() == 1);
    release.finish();
    result_of(&first).expect("reached");
    off.store(true, Ordering::SeqCst);
    let second = WordFence {
        word,
        queries,
        blocks: Arc::default(),
        release: None,
        answer: |_, passed| Ok(passed),
        off: off.clone(),
    };
    let (slot, _) = submit_fence(&pool, Box::new(second));
    result_of(&slot).expect("reached");
    assert_eq!(pool.published(), 1, "the dead word was not watched");
    pool.shutdown();
}

#[test]
fn a_word_ahead_of_its_event_is_left_to_the_driver() {
    // The word says passed, the event not yet: the wait ends in the driver.
    let (fence, release) = word_fence(true, |_, _| Ok(false));
    let (queries, blocks) = (fence.queries.clone(), fence.blocks.clone());
    let (pool, slot) = watching_pool(1, fence);
    // On the list before the block: once both, the list empty means the watcher is done.
    eventually("blocked, and the watcher done with it", || {
        blocks.load(Ordering::SeqCst) == 1 && pool.watched_entries() == 0
    });
    assert_eq!(queries.load(Ordering::SeqCst), 1, "the watcher asked");
    assert!(is_pending(&slot), "not resolved by the watcher");
    release.finish();
    result_of(&slot).expect("resolved by the block");
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 0);
    pool.shutdown();
}

#[test]
fn a_word_that_never_moves_is_watched_for_a_window_then_left_to_the_driver() {
    let (fence, release) = word_fence(false, |_, passed| Ok(passed));
    let (queries, blocks) = (fence.queries.clone(), fence.blocks.clone());
    let started = Instant::now();
    let (pool, slot) = watching_pool(1, fence);
    // On the list before the block: once both, the list empty means the watcher is done.
    eventually("blocked, and the watcher done with it", || {
        blocks.load(Ordering::SeqCst) == 1 && pool.watched_entries() == 0
    });
    assert!(
        started.elapsed() >= crate::waiter::watcher::timing::FIRST_WINDOW,
        "watched for its window first"
    );
    assert_eq!(queries.load(Ordering::SeqCst), 0, "no query while watching");
    assert!(is_pending(&slot));
    release.finish();
    result_of(&slot).expect("the block ends it");
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 0);
    pool.shutdown();
}

#[test]
fn a_lane_whose_watches_miss_in_a_row_leaves_its_next_waits_to_the_driver() {
    // Each wait's item ends 2 ms after its lane thread blocks on it (so its lane's waits are
    // long enough to watch), and its word never moves: the watcher looks for a window, misses,
    // and leaves it to the driver. After two misses in a row the lane's next wait is not
    // watched at all; the one after it is again.
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    let mut published = Vec::new();
    for sequence in 1..=4 {
        let device = Device::with_word();
        let slot = submit(&pool, &device, 9, sequence);
        eventually("blocked, and the watcher done with it", || {
            device.blocked.load(Ordering::SeqCst) == 1 && pool.watched_entries() == 0
        });
        published.push(pool.published());
        std::thread::sleep(Duration::from_millis(2));
        device.reach();
        result_of(&slot).expect("the block ends it");
        eventually("the lane is gone", || pool.gauges().pending == 0);
    }
    assert_eq!(published, [1, 2, 2, 3], "entries handed to the watcher");
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 0);
    pool.shutdown();
}

#[test]
fn a_lane_whose_watched_waits_the_driver_wakes_first_leaves_its_next_waits_to_the_driver() {
    // Before each wait the lane's history says its waits take an hour, so each is watchable and
    // the watcher sleeps toward its end; the driver wakes the lane thread first, while the wait
    // is still on the list (its word never moves). Those are watches that did not pay: after
    // two in a row the lane's next wait is not watched at all; the one after it is again.
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    let lane = LaneKey::for_tests(11);
    let mut published = Vec::new();
    for sequence in 1..=4 {
        for _ in 0..4 {
            pool.seed_history(lane, Duration::from_secs(3600));
        }
        let device = Device::with_word();
        let slot = submit(&pool, &device, 11, sequence);
        // A lane thread puts a wait on the list before it blocks on it.
        eventually("blocked", || device.blocked.load(Ordering::SeqCst) == 1);
        published.push(pool.published());
        device.reach();
        result_of(&slot).expect("the driver's wake ends it");
        eventually("the lane is gone, and its entry", || {
            pool.gauges().pending == 0 && pool.watched_entries() == 0
        });
    }
    assert_eq!(published, [1, 2, 2, 3], "entries handed to the watcher");
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 0);
    pool.shutdown();
}

#[test]
fn a_word_ahead_of_its_event_is_not_a_miss() {
    // Each wait's word has passed but its event says not yet (a reading the driver does not
    // rule out): the watcher leaves it to the driver, as with a miss, but that says nothing of
    // how well it predicts the lane. Each item ends 20 ms after its lane thread blocks on it,
    // so the lane's waits are long enough to watch: every one of them is watched. Two misses in
    // a row would leave the third to the driver. (Three waits, not more: the watcher naps
    // toward the third, and naps a loaded host ends late could call a fourth too short.)
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    let (mut published, mut asked) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (fence, release) = word_fence(true, |_, _| Ok(false));
        let (queries, blocks) = (fence.queries.clone(), fence.blocks.clone());
        let (slot, _) = submit_fence(&pool, Box::new(fence));
        // On the list before the block: once both, the list empty means the watcher is done.
        eventually("blocked, and the watcher done with it", || {
            blocks.load(Ordering::SeqCst) == 1 && pool.watched_entries() == 0
        });
        published.push(pool.published());
        asked.push(queries.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(20));
        release.finish();
        result_of(&slot).expect("the block ends it");
        eventually("the lane is gone", || pool.gauges().pending == 0);
    }
    assert_eq!(published, [1, 2, 3], "entries handed to the watcher");
    assert_eq!(
        asked,
        [1, 1, 1],
        "each confirmed by a query, which said not yet"
    );
    pool.shutdown();
}

#[test]
fn with_no_watchers_a_lane_thread_only_blocks_even_on_a_passed_word() {
    let (fence, release) = word_fence(true, |_, passed| Ok(passed));
    let (queries, blocks) = (fence.queries.clone(), fence.blocks.clone());
    let (pool, slot) = watching_pool(0, fence);
    eventually("the lane thread blocks", || {
        blocks.load(Ordering::SeqCst) == 1
    });
    assert_eq!(pool.gauges().threads, 1, "no watcher");
    assert!(is_pending(&slot));
    release.finish();
    result_of(&slot).expect("reached");
    assert_eq!(queries.load(Ordering::SeqCst), 0);
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 0);
    pool.shutdown();
}

#[test]
fn a_watcher_that_cannot_be_started_hands_its_wait_back_to_the_driver() {
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    // A lane thread serves a stream with no word, then waits idle.
    let plain = Arc::new(Device::default());
    let first = submit(&pool, &plain, 0, 1);
    plain.finish();
    result_of(&first).expect("reached");
    eventually("the lane thread is idle", || pool.idle_threads() == 1);
    // The next stream has a word: the watcher's spawn, made by the lane
    // thread that reads it, is refused.
    let worded = Device::with_word();
    worded.refuse_spawn_after_progress();
    let second = submit(&pool, &worded, 1, 1);
    eventually("it blocks in the driver", || {
        worded.blocked.load(Ordering::SeqCst) == 1
    });
    assert_eq!(pool.watched_entries(), 0);
    assert_eq!(pool.gauges().threads, 1, "no watcher");
    worded.finish();
    result_of(&second).expect("reached");
    pool.shutdown();
}

#[test]
fn a_watcher_waiting_for_work_is_woken_by_the_next_wait_handed_to_it() {
    // Idle threads stay 600 s: a watcher left asleep outlasts the test's limit. The driver
    // never wakes the lane threads until told: only the watcher can end the waits. Each wait's
    // work has ended before it is handed over, so the watcher's first look sees it, however late
    // a loaded host runs the test (its window for a new lane is microseconds).
    let pool = super::mock_device::support::pool_watching(2, Duration::from_secs(600));
    let first = Device::with_slow_driver();
    first.finish();
    let slot = submit(&pool, &first, 0, 1);
    result_of(&slot).expect("seen by the watcher");
    eventually("the watcher waits for work", || {
        pool.watcher_waits() && pool.watched_entries() == 0
    });
    let second = Device::with_slow_driver();
    second.finish();
    let slot = submit(&pool, &second, 1, 1);
    result_of(&slot).expect("seen by the watcher");
    eventually("both counted", || {
        pool.counters().read(WaiterStats::default()).watched == 2
    });
    first.wake_driver();
    second.wake_driver();
    pool.shutdown();
}

#[test]
fn a_lane_thread_watches_the_word_of_the_lane_it_serves_now() {
    let pool = super::mock_device::support::pool_watching(1, Duration::from_secs(600));
    // Ended before it is handed over: the watcher's first look sees it, however late it runs.
    let first = Device::with_slow_driver();
    first.finish();
    let slot = submit(&pool, &first, 0, 1);
    result_of(&slot).expect("seen by the watcher");
    // Counted just after it is delivered.
    eventually("counted as watched", || {
        pool.counters().read(WaiterStats::default()).watched == 1
    });
    first.wake_driver();
    eventually("the lane thread waits for work", || {
        pool.idle_threads() == 1 && pool.watched_entries() == 0
    });
    // The same thread serves the next lane, whose word stays behind its
    // event: watched for its window (lane 0's word has passed everything),
    // then ended in the driver.
    let second = Device::with_word();
    second.reach();
    result_of(&submit(&pool, &second, 1, 1)).expect("reached");
    assert_eq!(
        second.blocked.load(Ordering::SeqCst),
        1,
        "ended in the driver"
    );
    assert_eq!(pool.counters().read(WaiterStats::default()).watched, 1);
    pool.shutdown();
}
