//! `fence.await` under every executor, and composed with combinators.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::faulty::{inject, Faulty, Plan};
use common::{eventually, Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{EventFence, FenceFuture, ServerError, Waiter, MAX_SPIN_BUDGET};
use futures::future::{join_all, FusedFuture};
use futures::FutureExt;

fn assert_future_traits<F: std::future::Future + Send + Unpin + 'static + FusedFuture>(_: &F) {}

#[test]
fn the_future_is_send_static_unpin_and_fused() {
    let stream = HostStream::new().unwrap();
    let future: FenceFuture<Host> = EventFence::<Host>::new(stream.handle()).wait();
    assert_future_traits(&future);
    assert!(!future.is_terminated());
}

#[test]
fn awaits_on_a_tokio_multi_thread_runtime() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let stream = HostStream::new().unwrap();
    let progress = Progress::default();
    let gate = Gate::hold(&stream);
    progress.step_on(&stream);
    let fence = EventFence::<Host>::new(stream.handle());
    let task = runtime.spawn(async move { fence.await });
    gate.open();
    runtime.block_on(task).unwrap().unwrap();
    assert_eq!(progress.get(), 1);
}

#[test]
fn awaits_on_a_tokio_current_thread_runtime_without_blocking_it() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    progress.step_on(&stream);
    let fence = EventFence::<Host>::new(stream.handle());
    runtime.block_on(async {
        let waiting = tokio::spawn(async move { fence.await });
        // The only runtime thread keeps running other tasks while the fence
        // is pending: a blocking await would never let this task run.
        let other = tokio::spawn(async { 7 });
        assert_eq!(other.await.unwrap(), 7);
        assert!(!waiting.is_finished());
        gate.open();
        waiting.await.unwrap().unwrap();
    });
    assert_eq!(progress.get(), 1);
}

#[test]
fn awaits_under_futures_executor() {
    let stream = HostStream::new().unwrap();
    let progress = Progress::default();
    progress.step_on(&stream);
    let fence = EventFence::<Host>::new(stream.handle());
    futures::executor::block_on(async { fence.await }).unwrap();
    assert_eq!(progress.get(), 1);
}

#[test]
fn join_and_join_all_compose_fences_across_streams() {
    let streams: Vec<HostStream> = (0..8).map(|_| HostStream::new().unwrap()).collect();
    let gates: Vec<Gate> = streams.iter().map(Gate::hold).collect();
    let progress = Progress::default();
    for stream in &streams {
        progress.step_on(stream);
    }
    let (first, second) = (
        EventFence::<Host>::new(streams[0].handle()),
        EventFence::<Host>::new(streams[1].handle()),
    );
    let rest: Vec<_> = streams[2..]
        .iter()
        .map(|stream| EventFence::<Host>::new(stream.handle()).wait())
        .collect();
    let opener = std::thread::spawn(move || gates.into_iter().for_each(Gate::open));
    futures::executor::block_on(async {
        let (a, b) = futures::join!(first.wait(), second.wait());
        a.unwrap();
        b.unwrap();
        for result in join_all(rest).await {
            result.unwrap();
        }
    });
    opener.join().unwrap();
    assert_eq!(progress.get(), 8);
}

#[test]
fn a_device_side_dependency_and_an_await_compose() {
    let producer = HostStream::new().unwrap();
    let consumer = HostStream::new().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = Gate::hold(&producer);
    let entry = log.clone();
    producer
        .launch(move || entry.lock().unwrap().push("produce"))
        .unwrap();
    EventFence::<Host>::new(producer.handle())
        .wait_async(consumer.handle())
        .unwrap();
    let entry = log.clone();
    consumer
        .launch(move || entry.lock().unwrap().push("consume"))
        .unwrap();
    let done = EventFence::<Host>::new(consumer.handle());
    gate.open();
    futures::executor::block_on(done.wait()).unwrap();
    assert_eq!(*log.lock().unwrap(), ["produce", "consume"]);
}

#[test]
fn a_reached_fence_is_ready_on_first_poll_without_a_thread() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let fence = EventFence::<Host>::new(stream.handle());
    EventFence::<Host>::new(stream.handle())
        .wait_sync()
        .unwrap();
    let mut future = waiter.wait(fence);
    let polled = (&mut future).now_or_never();
    assert_eq!(polled, Some(Ok(())));
    assert!(future.is_terminated());
    assert_eq!(waiter.peak_threads(), 0, "no hand-off");
    assert_eq!(waiter.pending(), 0);
}

#[test]
fn a_fence_resolved_at_creation_is_ready_on_first_poll() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    drop(stream);
    // Record refused and synchronize failed: the fence holds the error.
    let fence = EventFence::<Host>::new(handle);
    assert!(fence.is_resolved_at_creation());
    let result = waiter.wait(fence).now_or_never().expect("ready at once");
    assert_eq!(
        result.unwrap_err().code(),
        Some(device_events::status::INVALID_HANDLE)
    );
    assert_eq!(waiter.peak_threads(), 0);
}

#[test]
fn a_spin_budget_catches_a_fence_that_passes_while_spinning() {
    let waiter = Waiter::builder().spin_budget(MAX_SPIN_BUDGET).build();
    let stream = HostStream::new().unwrap();
    // The fence passes between the first query and the second: exactly
    // while the first poll spins, however loaded the machine.
    inject(
        stream.handle(),
        Plan {
            label: "passes-while-spinning",
            unreached_queries: 1,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    stream.synchronize().unwrap(); // the worker passed the fence's marker
    let result = waiter
        .wait(fence)
        .now_or_never()
        .expect("spun until reached");
    result.unwrap();
    assert_eq!(waiter.peak_threads(), 0, "no hand-off within the budget");
}

/// With a budget, a first poll asks again and again until it is spent: a
/// fence that passes after several "not yet" answers is ready at once. Only a
/// first poll preempted past its whole budget may hand off instead, and
/// then it must have spent it.
#[test]
fn a_spin_budget_asks_again_until_it_is_spent() {
    let waiter = Waiter::builder().spin_budget(MAX_SPIN_BUDGET).build();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "passes-after-three-queries",
            unreached_queries: 3,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    stream.synchronize().unwrap(); // the worker passed the fence's marker
    let started = std::time::Instant::now();
    let first = waiter.wait(fence).now_or_never();
    let spent = started.elapsed();
    match first {
        Some(result) => result.unwrap(),
        None => assert!(
            spent >= MAX_SPIN_BUDGET,
            "handed off after {spent:?}, inside its budget of {MAX_SPIN_BUDGET:?}"
        ),
    }
}

#[test]
fn without_a_spin_budget_the_first_poll_asks_once_and_hands_off() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "passes-after-one-query",
            unreached_queries: 1,
            ..Plan::default()
        },
    );
    let mut future = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    assert!((&mut future).now_or_never().is_none(), "handed off");
    futures::executor::block_on(future).unwrap();
}

/// A first poll runs on the executor's thread: however long the budget
/// asked, it spins at most `MAX_SPIN_BUDGET`, then hands off.
#[test]
fn the_spin_budget_is_bounded() {
    let waiter = Waiter::builder().spin_budget(Duration::MAX).build();
    assert_eq!(waiter.spin_budget(), MAX_SPIN_BUDGET);
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let fence = EventFence::<Host>::new(stream.handle());
    let polling = std::thread::spawn(move || waiter.wait(fence).now_or_never().is_none());
    eventually(Duration::from_secs(20), "the first poll returns", || {
        polling.is_finished()
    });
    assert!(polling.join().unwrap(), "pending: handed off, stream held");
    gate.open();
}

#[test]
fn debug_names_the_backend_and_state() {
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut future = EventFence::<Host>::new(stream.handle()).wait();
    assert_eq!(format!("{future:?}"), "HostFenceFuture(first poll)");
    assert!((&mut future).now_or_never().is_none(), "handed off");
    assert_eq!(format!("{future:?}"), "HostFenceFuture(waiting)");
    gate.open();
    assert_eq!(future.wait_sync_timeout(Duration::MAX), Some(Ok(())));
    assert_eq!(format!("{future:?}"), "HostFenceFuture(done)");
}

/// The global waiter's promise: never shut down, whoever asks.
#[test]
fn the_global_waiter_cannot_be_shut_down() {
    Waiter::global().shutdown();
    Waiter::global().clone().shutdown();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut future = EventFence::<Host>::new(stream.handle()).wait();
    assert!((&mut future).now_or_never().is_none(), "handed off");
    gate.open();
    futures::executor::block_on(future).unwrap();
}

/// A thread name no thread can have is refused where the waiter is built,
/// and a waiter built with one anyway fails its waits; nothing panics and
/// nothing is left behind.
#[test]
fn a_thread_name_with_a_nul_byte_is_an_error_never_a_panic() {
    let err = Waiter::builder()
        .thread_name("bad\0name")
        .try_build()
        .unwrap_err();
    assert!(
        matches!(&err, ServerError::InvalidArgument { what, .. } if what.contains("thread_name")),
        "{err}"
    );
    let waiter = Waiter::builder().thread_name("bad\0name").build();
    let stream = HostStream::new().unwrap();
    let live = stream.live_events();
    for _ in 0..2 {
        let gate = Gate::hold(&stream);
        let future = waiter.wait(EventFence::<Host>::new(stream.handle()));
        let result = future.now_or_never().expect("refused at once");
        assert_eq!(result.unwrap_err(), err);
        gate.open();
    }
    assert_eq!((waiter.threads(), waiter.pending()), (0, 0));
    stream.synchronize().unwrap(); // the worker passed (and let go of) the markers
    drop(stream);
    assert_eq!(live.count(), 0, "every event destroyed");
}

/// One fence type for either backend: held, awaited, waited on, and queued.
#[test]
fn any_fence_serves_host_fences_like_event_fences() {
    use device_events::drop_queue::DropQueue;
    use device_events::AnyFence;
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let fence: AnyFence = stream.fence().into();
    assert_eq!(fence.backend(), "Host");
    assert_eq!(format!("{fence:?}"), "HostFence");
    assert!(!fence.is_complete().unwrap());
    assert!(!fence.is_resolved_at_creation());
    let waiter = Waiter::default();
    let mut future = waiter.wait(fence);
    assert!((&mut future).now_or_never().is_none(), "held");
    let queue = DropQueue::<AnyFence, u32>::new(4).unwrap();
    assert!(queue.push(AnyFence::from(stream.fence()), 7).is_ok());
    gate.open();
    futures::executor::block_on(&mut future).unwrap();
    assert!(future.is_terminated());
    assert_eq!(queue.shutdown().dropped, 1);
    let later: AnyFence = stream.fence().into();
    futures::executor::block_on(async { later.await }).unwrap();
    AnyFence::from(stream.fence()).wait_sync().unwrap();
}

/// A synchronous wait with a deadline: on a held stream it gives up (the
/// future stays pending, to wait on again), and once the stream is released
/// the same future resolves; dropping it instead cancels the wait.
#[test]
fn wait_sync_timeout_gives_up_on_a_held_stream_and_can_wait_again() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let progress = Progress::default();
    let gate = Gate::hold(&stream);
    progress.step_on(&stream);
    let wait = waiter.wait(stream.fence());
    // On its own thread, so a wait that ignored its deadline fails this test
    // (below) instead of hanging it.
    let timed = std::thread::spawn(move || {
        let mut wait = wait;
        let started = std::time::Instant::now();
        let result = wait.wait_sync_timeout(Duration::from_millis(20));
        // Never sooner than asked.
        assert!(started.elapsed() >= Duration::from_millis(20));
        (result, wait)
    });
    eventually(Duration::from_secs(20), "the deadline passes", || {
        timed.is_finished()
    });
    let (result, mut wait) = timed.join().unwrap();
    assert_eq!(result, None);
    assert_eq!(waiter.pending(), 1, "still handed off");
    assert_eq!(progress.get(), 0, "the stream's work is untouched");
    gate.open();
    let result = wait.wait_sync_timeout(Duration::from_secs(20));
    assert_eq!(result, Some(Ok(())));
    assert_eq!(progress.get(), 1);

    // Given up for good: dropping the future cancels the wait.
    let gate = Gate::hold(&stream);
    let mut wait = waiter.wait(stream.fence());
    assert_eq!(wait.wait_sync_timeout(Duration::ZERO), None);
    drop(wait);
    gate.open();
    // Withdrawn at once, or (if the lane's thread was already blocked on
    // it) let go when that block ends.
    eventually(Duration::from_secs(20), "the cancelled wait leaves", || {
        waiter.pending() == 0
    });
    // A reached fence needs no deadline and no hand-off.
    stream.synchronize().unwrap();
    let mut ready = waiter.wait(stream.fence());
    assert_eq!(ready.wait_sync_timeout(Duration::ZERO), Some(Ok(())));
}

/// Waits on one stream are served in the stream's order, not in the order
/// they were handed off: an earlier fence handed off after a later one does
/// not wait behind it.
#[test]
fn an_earlier_fence_handed_off_later_is_not_served_behind_a_later_one() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let first_gate = Gate::hold(&stream);
    let mut first = waiter.wait(stream.fence());
    let mut earlier = waiter.wait(stream.fence());
    let last_gate = Gate::hold(&stream);
    let mut later = waiter.wait(stream.fence());
    // Handed off in this order: the lane's thread takes `first`, and
    // `later` and then `earlier` queue behind it.
    assert_eq!(first.wait_sync_timeout(Duration::ZERO), None);
    assert_eq!(later.wait_sync_timeout(Duration::ZERO), None);
    assert_eq!(earlier.wait_sync_timeout(Duration::ZERO), None);
    first_gate.open();
    let limit = Duration::from_secs(20);
    assert_eq!(first.wait_sync_timeout(limit), Some(Ok(())));
    // Reached while `later`'s gate is still shut.
    assert_eq!(earlier.wait_sync_timeout(limit), Some(Ok(())));
    last_gate.open();
    assert_eq!(later.wait_sync_timeout(limit), Some(Ok(())));
}

/// A waiter's `Debug` shows its counts and the settings it was built with.
#[test]
fn a_waiters_debug_shows_its_counts_and_settings() {
    let waiter = Waiter::builder()
        .max_threads(3)
        .keep_alive(Duration::from_millis(1234))
        .thread_name("debug-shown")
        .watchers(0)
        .build();
    let shows = |waiter: &Waiter, parts: &[&str]| {
        let shown = format!("{waiter:?}");
        for part in parts {
            assert!(shown.contains(part), "{part:?} not in {shown}");
        }
    };
    shows(
        &waiter,
        &[
            "Waiter {",
            "threads: 0",
            "pending: 0",
            "max_threads: 3",
            "keep_alive: 1.234s",
            "\"debug-shown\"",
        ],
    );
    // Counts as they are: one lane thread blocked, with two waits.
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut futures: Vec<_> = (0..2).map(|_| waiter.wait(stream.fence())).collect();
    assert!(futures.iter_mut().all(|f| f.now_or_never().is_none()));
    shows(&waiter, &["threads: 1", "pending: 2"]);
    gate.open();
    let results = futures::executor::block_on(join_all(futures));
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // The defaults, and settings clamped to their range.
    let defaults = Waiter::builder().build();
    shows(
        &defaults,
        &[
            "max_threads: 64",
            "keep_alive: 10s",
            "\"device-events-waiter\"",
            "spin_budget: 0ns",
            "stuck_after: None",
        ],
    );
    shows(
        &Waiter::builder().max_threads(0).build(),
        &["max_threads: 1,"],
    );
    let most = format!("max_threads: {},", device_events::MAX_THREADS_LIMIT);
    shows(&Waiter::builder().max_threads(usize::MAX).build(), &[&most]);
}

/// A timeout too long to add to the clock (`Duration::MAX`) waits as long
/// as it takes, and returns the result.
#[test]
fn a_deadline_beyond_the_clock_waits_until_reached() {
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut future = EventFence::<Host>::new(stream.handle()).wait();
    assert!((&mut future).now_or_never().is_none(), "handed off");
    gate.open();
    assert_eq!(future.wait_sync_timeout(Duration::MAX), Some(Ok(())));
}

/// Idle threads, the watcher's too, leave after their `keep_alive` (not the
/// default's 10 s, nor ten times theirs), and at once when the waiter shuts
/// down, however long theirs.
#[test]
fn idle_threads_leave_after_their_keep_alive_and_at_shutdown() {
    let short = Duration::from_millis(250);
    for (keep_alive, watchers) in [(short, 0), (short, 1), (Duration::from_secs(600), 1)] {
        let waiter = Waiter::builder()
            .keep_alive(keep_alive)
            .watchers(watchers)
            .build();
        let stream = HostStream::new().unwrap();
        let gate = Gate::hold(&stream);
        let mut future = waiter.wait(stream.fence());
        assert!((&mut future).now_or_never().is_none(), "handed off");
        // No thread is idle before this.
        let opened = std::time::Instant::now();
        gate.open();
        futures::executor::block_on(future).unwrap();
        // A lane thread, and the watcher its first wait started.
        assert_eq!(waiter.peak_threads(), 1 + watchers);
        let threads = waiter.threads();
        assert!(
            threads >= 1 || opened.elapsed() >= keep_alive,
            "left at once"
        );
        if keep_alive == short {
            eventually(short * 8, "the idle threads leave", || {
                waiter.threads() == 0
            });
        } else {
            waiter.shutdown();
            eventually(Duration::from_secs(20), "the threads leave", || {
                waiter.threads() == 0
            });
        }
    }
}
