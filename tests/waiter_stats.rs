//! `Waiter::stats()`: each counter against known activity, the gauges, and
//! the wake-latency histogram against a controlled delay; `stuck_after` and
//! `Waiter::stuck()`. Every test uses a waiter of its own, so tests running
//! beside it move none of its counts, and looks only for log lines naming
//! its own waiter.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use common::logs::{capture, infos_containing, warnings_containing};
use common::{eventually, faultable_stream, Gate};
use device_events::host::{Host, HostStream};
use device_events::{FenceFuture, ServerError, Waiter, WaiterStats};
use futures::task::noop_waker_ref;

const LIMIT: Duration = Duration::from_secs(30);

/// Poll `future` once: pending (handed off) or not.
fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(noop_waker_ref()))
}

/// `count` fences on `stream`, each awaited on `waiter` and polled once:
/// handed off, as the stream is held.
fn handed_off(waiter: &Waiter, stream: &HostStream, count: usize) -> Vec<FenceFuture<Host>> {
    (0..count)
        .map(|_| {
            let mut future = waiter.wait(stream.fence());
            assert!(poll_once(&mut future).is_pending(), "the stream is held");
            future
        })
        .collect()
}

/// What must hold in every snapshot.
fn check_accounts(stats: &WaiterStats) {
    assert!(
        stats.handed_off >= stats.resolved + stats.failed + stats.cancelled,
        "{stats:?}"
    );
    assert_eq!(
        stats.wake_latency.count(),
        stats.resolved + stats.failed,
        "{stats:?}"
    );
    assert!(stats.cancelled_held <= stats.pending, "{stats:?}");
}

#[test]
fn handed_off_waits_that_resolve_move_resolved_by_as_many() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    assert_eq!(waiter.stats(), WaiterStats::default());
    let gate = Gate::hold(&stream);
    let futures = handed_off(&waiter, &stream, 7);
    let stats = waiter.stats();
    check_accounts(&stats);
    assert_eq!((stats.handed_off, stats.pending), (7, 7), "{stats:?}");
    assert_eq!(stats.resolved, 0, "{stats:?}");
    gate.open();
    let results = futures::executor::block_on(futures::future::join_all(futures));
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let stats = waiter.stats();
    check_accounts(&stats);
    assert_eq!(
        (
            stats.handed_off,
            stats.resolved,
            stats.failed,
            stats.cancelled
        ),
        (7, 7, 0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.ready_at_first_poll, 0, "{stats:?}");
    assert!(stats.threads >= 1 && stats.peak_threads >= 1, "{stats:?}");
}

#[test]
fn dropped_futures_move_cancelled_by_as_many() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let futures = handed_off(&waiter, &stream, 5);
    drop(futures);
    let stats = waiter.stats();
    check_accounts(&stats);
    assert_eq!((stats.handed_off, stats.cancelled), (5, 5), "{stats:?}");
    // The wait a lane thread is blocked on stays with it, cancelled, until
    // the device reaches it; the others left at once.
    assert!(stats.pending <= 1, "{stats:?}");
    assert_eq!(stats.cancelled_held, stats.pending, "{stats:?}");
    gate.open();
    eventually(LIMIT, "the held wait is let go", || {
        waiter.stats().pending == 0
    });
    let stats = waiter.stats();
    check_accounts(&stats);
    assert_eq!(
        (
            stats.cancelled,
            stats.resolved,
            stats.failed,
            stats.cancelled_held
        ),
        (5, 0, 0, 0),
        "a dropped future is counted once, as cancelled: {stats:?}"
    );
}

#[test]
fn waits_on_a_faulted_stream_move_failed() {
    let waiter = Waiter::builder().build();
    let stream = faultable_stream();
    let gate = Gate::hold(&stream);
    stream
        .launch(|| panic!("a fault planted by the test"))
        .unwrap();
    let futures = handed_off(&waiter, &stream, 3);
    gate.open();
    let results = futures::executor::block_on(futures::future::join_all(futures));
    assert!(
        results
            .iter()
            .all(|result| result.as_ref().is_err_and(ServerError::is_faulted)),
        "{results:?}"
    );
    let stats = waiter.stats();
    check_accounts(&stats);
    assert_eq!(
        (stats.handed_off, stats.failed, stats.resolved),
        (3, 3, 0),
        "{stats:?}"
    );
    // A fence on the faulted stream fails at its first poll: no hand-off.
    let late = futures::executor::block_on(waiter.wait(stream.fence()));
    assert!(late.is_err());
    let stats = waiter.stats();
    assert_eq!(
        (stats.ready_at_first_poll, stats.handed_off),
        (1, 3),
        "{stats:?}"
    );
}

#[test]
fn shutdown_fails_what_is_pending() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let futures = handed_off(&waiter, &stream, 4);
    waiter.shutdown();
    let results = futures::executor::block_on(futures::future::join_all(futures));
    assert!(
        results
            .iter()
            .all(|result| *result == Err(ServerError::WaiterGone)),
        "{results:?}"
    );
    let stats = waiter.stats();
    check_accounts(&stats);
    assert_eq!((stats.failed, stats.resolved), (4, 0), "{stats:?}");
    gate.open();
}

#[test]
fn reached_fences_count_as_ready_at_first_poll() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    stream.synchronize().unwrap();
    for _ in 0..3 {
        futures::executor::block_on(waiter.wait(stream.fence())).unwrap();
    }
    let stats = waiter.stats();
    assert_eq!(
        (stats.ready_at_first_poll, stats.handed_off, stats.threads),
        (3, 0, 0),
        "{stats:?}"
    );
}

#[test]
fn wake_latency_percentiles_follow_a_controlled_delay() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let delay = Duration::from_millis(20);
    for _ in 0..5 {
        let gate = Gate::hold(&stream);
        let mut future = waiter.wait(stream.fence());
        assert!(poll_once(&mut future).is_pending());
        // Held at least `delay` after its hand-off.
        std::thread::sleep(delay);
        gate.open();
        futures::executor::block_on(future).unwrap();
    }
    let stats = waiter.stats();
    assert_eq!(stats.wake_latency.count(), 5, "{stats:?}");
    // 20 ms lies in the bucket from 16,384 µs to 32,768 µs; a loaded
    // machine may wake later, never earlier.
    for percentile in [0.0, 50.0, 99.0] {
        let bound = stats.wake_latency.percentile(percentile).unwrap();
        assert!(
            bound >= Duration::from_micros(32_768),
            "p{percentile} = {bound:?} for waits held {delay:?}"
        );
    }
    let below: u64 = stats
        .wake_latency
        .buckets()
        .filter(|(bound, _)| bound.is_some_and(|bound| bound <= Duration::from_micros(16_384)))
        .map(|(_, count)| count)
        .sum();
    assert_eq!(below, 0, "no wait woke before its delay: {stats:?}");
    assert!(stats.wake_latency.sum() >= delay * 5, "{stats:?}");
}

#[test]
fn a_stream_held_past_stuck_after_is_listed_and_logged_once_and_its_end_once() {
    capture();
    let name = "stuck-listed-waiter";
    let after = Duration::from_millis(30);
    let waiter = Waiter::builder()
        .thread_name(name)
        .stuck_after(after)
        .build();
    let stream = HostStream::new().unwrap();
    let other = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let futures = handed_off(&waiter, &stream, 3);
    // Held well past `stuck_after`: listed once per look, as one stream.
    eventually(LIMIT, "the held stream is listed", || {
        !waiter.stuck().is_empty()
    });
    for _ in 0..3 {
        let stuck = waiter.stuck();
        assert_eq!(stuck.len(), 1, "{stuck:?}");
        assert!(stuck[0].waited >= after, "{stuck:?}");
        assert_eq!(stuck[0].behind, 2, "two waits behind the oldest: {stuck:?}");
        assert!(stuck[0].stream.starts_with("Host stream"), "{stuck:?}");
    }
    assert_eq!(waiter.stats().stuck, 1);
    // A stream that is not held is never listed.
    futures::executor::block_on(waiter.wait(other.fence())).unwrap();
    assert_eq!(waiter.stuck().len(), 1);
    let needle = format!("waiter {name:?}");
    let warned = warnings_containing(&needle);
    assert_eq!(warned.len(), 1, "one warning while stuck: {warned:?}");
    assert!(warned[0].contains("2 more queued behind it"), "{warned:?}");
    gate.open();
    let results = futures::executor::block_on(futures::future::join_all(futures));
    assert!(results.iter().all(Result::is_ok));
    assert!(waiter.stuck().is_empty());
    assert_eq!(waiter.stats().stuck, 0);
    let ended = infos_containing(&needle);
    assert_eq!(ended.len(), 1, "one line when it ends: {ended:?}");
    assert!(ended[0].contains("ended (Ok(()))"), "{ended:?}");
    assert_eq!(
        warnings_containing(&needle).len(),
        1,
        "and no more warnings"
    );
}

#[test]
fn a_stuck_wait_given_up_logs_its_end_once() {
    capture();
    let name = "stuck-dropped-waiter";
    let waiter = Waiter::builder()
        .thread_name(name)
        .stuck_after(Duration::from_millis(10))
        .build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let futures = handed_off(&waiter, &stream, 1);
    eventually(LIMIT, "the held stream is listed", || {
        !waiter.stuck().is_empty()
    });
    drop(futures);
    let needle = format!("waiter {name:?}");
    let ended = infos_containing(&needle);
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert!(ended[0].contains("given up"), "{ended:?}");
    gate.open();
    eventually(LIMIT, "the held wait is let go", || {
        waiter.stats().pending == 0
    });
    assert_eq!(infos_containing(&needle).len(), 1, "logged once: {ended:?}");
    assert_eq!(warnings_containing(&needle).len(), 1);
}

#[test]
fn without_stuck_after_nothing_is_listed() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let futures = handed_off(&waiter, &stream, 1);
    assert!(waiter.stuck().is_empty());
    assert_eq!(waiter.stats().stuck, 0);
    gate.open();
    futures::executor::block_on(futures::future::join_all(futures));
    // Zero turns it off too.
    let off = Waiter::builder().stuck_after(Duration::ZERO).build();
    assert!(off.stuck().is_empty());
}

#[test]
fn hand_offs_on_other_streams_report_a_stuck_one_without_being_asked() {
    capture();
    let name = "stuck-busy-waiter";
    let waiter = Waiter::builder()
        .thread_name(name)
        .stuck_after(Duration::from_millis(10))
        .build();
    let stuck = HostStream::new().unwrap();
    let busy = HostStream::new().unwrap();
    let gate = Gate::hold(&stuck);
    let futures = handed_off(&waiter, &stuck, 1);
    let needle = format!("waiter {name:?}");
    // Nobody reads `stuck()` or the stats: the hand-offs of another
    // stream's work find it.
    eventually(LIMIT, "a hand-off reports the stuck stream", || {
        let busy_gate = Gate::hold(&busy);
        let more = handed_off(&waiter, &busy, 1);
        busy_gate.open();
        futures::executor::block_on(futures::future::join_all(more));
        !warnings_containing(&needle).is_empty()
    });
    assert_eq!(warnings_containing(&needle).len(), 1);
    gate.open();
    futures::executor::block_on(futures::future::join_all(futures));
}
