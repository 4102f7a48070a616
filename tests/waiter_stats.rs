//! `Waiter::stats()`: each counter against known activity, the gauges, and
//! the wake-latency histogram against a controlled delay; `stuck_after` and
//! `Waiter::stuck()`. Every test uses a waiter of its own, so tests running
//! beside it move none of its counts, and looks only for log lines naming
//! its own waiter.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::logs::{capture, infos_containing, on_line, warnings_containing};
use common::{eventually, faultable_stream, Gate};
use device_events::host::{Host, HostStream};
use device_events::{EventApi, FenceFuture, ServerError, Waiter, WaiterBuilder, WaiterStats};
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
    assert_eq!(waiter.pending(), stats.pending, "the held wait is pending");
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
    // A future dropped once its result came, unpolled, was not cancelled.
    let gate = Gate::hold(&stream);
    let resolved = handed_off(&waiter, &stream, 2);
    gate.open();
    eventually(LIMIT, "the waits resolve", || waiter.stats().resolved == 2);
    drop(resolved);
    let stats = waiter.stats();
    assert_eq!((stats.cancelled, stats.resolved), (5, 2), "{stats:?}");
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
    // Refused at its first poll: answered there, not handed off.
    let refused = futures::executor::block_on(waiter.wait(stream.fence()));
    assert_eq!(refused, Err(ServerError::WaiterGone));
    let stats = waiter.stats();
    assert_eq!(
        (stats.ready_at_first_poll, stats.handed_off),
        (1, 4),
        "{stats:?}"
    );
    gate.open();
}

#[test]
fn reached_fences_count_as_ready_at_first_poll() {
    // With a spin budget too: a fence reached at the first query is ready.
    let spinning = Waiter::builder()
        .spin_budget(Duration::from_secs(1))
        .build();
    for waiter in [Waiter::builder().build(), spinning] {
        let stream = HostStream::new().unwrap();
        stream.synchronize().unwrap();
        for _ in 0..3 {
            let ready = poll_once(&mut waiter.wait(stream.fence()));
            assert_eq!(ready, Poll::Ready(Ok(())));
        }
        let stats = waiter.stats();
        assert_eq!(
            (stats.ready_at_first_poll, stats.handed_off, stats.threads),
            (3, 0, 0),
            "{stats:?}"
        );
    }
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

/// A waiter of its own that reports waits stuck after `after`, named
/// `name`, and the needle that finds its log lines (and no other test's).
fn stuck_waiter(name: &str, after: Duration) -> (Waiter, String) {
    stuck_waiter_from(Waiter::builder(), name, after)
}

/// A waiter with one lane thread: with it blocked on one stream, the
/// poller serves the others.
fn one_thread_stuck_waiter(name: &str) -> (Waiter, String) {
    stuck_waiter_from(
        Waiter::builder().max_threads(1).watchers(0),
        name,
        STUCK_AFTER,
    )
}

fn stuck_waiter_from(builder: WaiterBuilder, name: &str, after: Duration) -> (Waiter, String) {
    capture();
    let waiter = builder.thread_name(name).stuck_after(after).build();
    (waiter, format!("waiter {name:?}"))
}

/// How the waiter names `stream` in its lines and in `stuck()`.
fn stream_name(stream: &HostStream) -> String {
    format!("Host stream {:?}", stream.handle())
}

/// New streams, each held by a gate, with waits on them handed off to a
/// waiter.
struct HeldStreams {
    /// Kept alive while their waits are out.
    _streams: Vec<HostStream>,
    gates: Vec<Gate>,
    futures: Vec<FenceFuture<Host>>,
}

/// `streams` streams held, with `each` waits on each handed off to
/// `waiter`.
fn held_streams(waiter: &Waiter, streams: usize, each: usize) -> HeldStreams {
    let streams: Vec<HostStream> = (0..streams).map(|_| HostStream::new().unwrap()).collect();
    let gates = streams.iter().map(Gate::hold).collect();
    let futures = streams
        .iter()
        .flat_map(|stream| handed_off(waiter, stream, each))
        .collect();
    HeldStreams {
        _streams: streams,
        gates,
        futures,
    }
}

/// The lines `of_kind` naming `needle` (a waiter) that are about `stream`.
fn lines_about(of_kind: fn(&str) -> Vec<String>, needle: &str, stream: &HostStream) -> Vec<String> {
    let name = stream_name(stream);
    let lines = of_kind(needle);
    lines
        .into_iter()
        .filter(|line| line.contains(&name))
        .collect()
}

/// Shut `waiter` down and wait for its threads to leave: no line about its
/// stalls can come after, so counting them then shows any made twice.
fn settle(waiter: &Waiter) {
    waiter.shutdown();
    eventually(LIMIT, "the waiter's threads leave", || {
        waiter.stats().threads == 0
    });
    assert!(waiter.peak_threads() >= 1, "its threads are remembered");
}

/// The lines `of_kind` naming `needle`, once there are at least `count`:
/// the waiter logs a line with no lock held, by whichever thread is logging
/// its lines then, so it may come just after the call that made it.
fn logged(of_kind: fn(&str) -> Vec<String>, needle: &str, count: usize) -> Vec<String> {
    eventually(LIMIT, "the waiter's lines are logged", || {
        of_kind(needle).len() >= count
    });
    of_kind(needle)
}

/// As each line containing `needle` is logged, the logging thread waits
/// (up to `LIMIT`) for another thread to read `waiter`'s stats, which takes
/// its lock: set to 1 if it could (no lock of the waiter's was held while
/// logging: a slow logger holds up no wait), 2 if not.
fn logged_with_no_lock_held(waiter: &Waiter, needle: &str) -> Arc<AtomicU8> {
    let seen = Arc::new(AtomicU8::new(0));
    let (waiter, outcome) = (waiter.clone(), seen.clone());
    on_line(needle, move |_| {
        let reader = {
            let waiter = waiter.clone();
            std::thread::spawn(move || waiter.stats())
        };
        let until = std::time::Instant::now() + LIMIT;
        while !reader.is_finished() && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
        outcome.store(if reader.is_finished() { 1 } else { 2 }, Ordering::SeqCst);
    });
    seen
}

/// The time a stall's warning says its wait has waited, read back from the
/// `Debug` of a `Duration` ("pending for 250.3ms").
fn warned_waited(line: &str) -> Duration {
    let after = line.split("pending for ").nth(1).expect("a waited time");
    let figure = after.split(' ').next().unwrap_or_default();
    let unit_at = figure.find(|c: char| !c.is_ascii_digit() && c != '.');
    let (number, unit) = figure.split_at(unit_at.expect("a unit"));
    let nanos_per = match unit {
        "s" => 1e9,
        "ms" => 1e6,
        "µs" => 1e3,
        "ns" => 1.0,
        _ => panic!("no unit in {line:?}"),
    };
    Duration::from_nanos((number.parse::<f64>().unwrap() * nanos_per) as u64)
}

// Long enough that the test's own steps (a few hand-offs in a row) never
// take it, even on a loaded machine; a stall is then only what a test holds.
const STUCK_AFTER: Duration = Duration::from_millis(250);

#[test]
fn a_stream_held_past_stuck_after_is_listed_and_warned_once_by_the_poller() {
    let (waiter, needle) = stuck_waiter("stuck-listed-waiter", STUCK_AFTER);
    let logged_freely = logged_with_no_lock_held(&waiter, "[stuck-listed-waiter-poller]");
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
        assert!(stuck[0].waited >= STUCK_AFTER, "{stuck:?}");
        assert_eq!(stuck[0].behind, 2, "two waits behind the oldest: {stuck:?}");
        assert!(!stuck[0].given_up, "{stuck:?}");
        assert_eq!(stuck[0].stream, stream_name(&stream), "{stuck:?}");
        assert_eq!(stuck[0].stream_id, Host::stream_id(stream.handle()));
    }
    assert_eq!(waiter.stats().stuck, 1);
    // A stream that is not held is never listed (nor warned about, unless
    // its wait took `stuck_after` on a loaded host).
    let handed = std::time::Instant::now();
    futures::executor::block_on(waiter.wait(other.fence())).unwrap();
    let other_stalled = handed.elapsed() >= STUCK_AFTER;
    assert_eq!(waiter.stuck().len(), 1);
    let about = |stream| lines_about(warnings_containing, &needle, stream);
    eventually(LIMIT, "the held stream is warned about", || {
        !about(&stream).is_empty()
    });
    // Stuck for twice as long again: the poller has looked at it four times
    // more since (each quarter of `stuck_after`), and warned no more.
    eventually(LIMIT, "the stream is stuck twice as long", || {
        waiter.stuck()[0].waited >= STUCK_AFTER * 2
    });
    let warned = about(&stream);
    assert_eq!(warned.len(), 1, "one warning while stuck: {warned:?}");
    assert!(warned[0].contains("2 more queued behind it"), "{warned:?}");
    // How long the wait had waited: past `stuck_after` (not that setting
    // itself), and no longer than it has now.
    let waited = warned_waited(&warned[0]);
    assert!(waited > STUCK_AFTER, "{warned:?}");
    assert!(waited <= waiter.stuck()[0].waited, "{warned:?}");
    // From the poller: never from a read of `stuck()` or a task's poll.
    assert!(
        warned[0].starts_with("[stuck-listed-waiter-poller]"),
        "{warned:?}"
    );
    eventually(LIMIT, "the logger's call returns", || {
        logged_freely.load(Ordering::SeqCst) != 0
    });
    assert_eq!(
        logged_freely.load(Ordering::SeqCst),
        1,
        "the waiter was read while its warning was logged"
    );
    gate.open();
    let results = futures::executor::block_on(futures::future::join_all(futures));
    assert!(results.iter().all(Result::is_ok));
    assert!(waiter.stuck().is_empty());
    assert_eq!(waiter.stats().stuck, 0);
    settle(&waiter);
    assert_eq!(about(&stream).len(), 1, "and no more warnings");
    let others = about(&other);
    assert!(others.is_empty() || other_stalled, "{others:?}");
    assert!(infos_containing(&needle).is_empty(), "no other line");
}

#[test]
fn a_stream_held_on_a_given_up_wait_is_still_reported_with_the_waits_behind_it() {
    // As a service whose timeouts are shorter than `stuck_after` does: the
    // first wait is given up at once, and later ones queue behind it.
    let (waiter, needle) = stuck_waiter("stuck-given-up-waiter", STUCK_AFTER);
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    // Given up on before a lane thread took it, a wait just leaves; given
    // up on while one is blocked on it, it holds the stream's lane.
    eventually(LIMIT, "a lane thread is blocked on a given-up wait", || {
        drop(handed_off(&waiter, &stream, 1));
        waiter.stats().cancelled_held == 1
    });
    let behind = handed_off(&waiter, &stream, 2);
    eventually(LIMIT, "the held stream is listed", || {
        !waiter.stuck().is_empty()
    });
    let stuck = waiter.stuck();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert!(stuck[0].given_up, "{stuck:?}");
    assert_eq!(stuck[0].behind, 2, "{stuck:?}");
    let warned = logged(warnings_containing, &needle, 1);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("future was dropped"), "{warned:?}");
    assert!(warned[0].contains("2 more queued behind it"), "{warned:?}");
    // Every future given up: the stream is held still, and listed.
    drop(behind);
    let stuck = waiter.stuck();
    assert_eq!((stuck.len(), stuck[0].behind), (1, 0), "{stuck:?}");
    gate.open();
    eventually(LIMIT, "the held wait is let go", || {
        waiter.stats().pending == 0
    });
    assert!(waiter.stuck().is_empty());
    settle(&waiter);
    assert_eq!(warnings_containing(&needle).len(), 1);
}

#[test]
fn a_long_backlog_on_a_stream_that_keeps_finishing_work_is_never_reported() {
    // Each of 12 items takes a twelfth of the time all take: every wait is
    // handed off at once, so the later ones are pending far longer than
    // `stuck_after`, while the stream ends one about every 100 ms.
    let after = Duration::from_millis(500);
    let (waiter, needle) = stuck_waiter("stuck-backlog-waiter", after);
    let stream = HostStream::new().unwrap();
    let mut opened = std::time::Instant::now();
    let steps: Vec<(Gate, FenceFuture<Host>)> = (0..12)
        .map(|_| {
            let gate = Gate::hold(&stream);
            let mut future = waiter.wait(stream.fence());
            assert!(poll_once(&mut future).is_pending());
            (gate, future)
        })
        .collect();
    let started = std::time::Instant::now();
    // The longest the stream went without ending a wait, at most (from its
    // first hand-off, or the previous gate's opening, to the read after the
    // next end): a loaded host that kept this thread off its core for
    // `after` stalls the stream rightly.
    let mut longest = Duration::ZERO;
    for (gate, future) in steps {
        std::thread::sleep(after / 5);
        let opening = std::time::Instant::now();
        gate.open();
        futures::executor::block_on(future).unwrap();
        let stuck = waiter.stuck();
        longest = longest.max(opened.elapsed());
        assert!(stuck.is_empty() || longest >= after, "{stuck:?}");
        opened = opening;
    }
    assert!(
        started.elapsed() > after * 2,
        "the backlog outlived stuck_after"
    );
    let warned = warnings_containing(&needle);
    assert!(warned.is_empty() || longest >= after, "{warned:?}");
}

#[test]
fn without_stuck_after_nothing_is_listed() {
    let off = Waiter::builder().build();
    let zero = Waiter::builder().stuck_after(Duration::ZERO).build();
    let on = Waiter::builder()
        .stuck_after(Duration::from_millis(10))
        .build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let futures: Vec<_> = [&off, &zero, &on]
        .into_iter()
        .flat_map(|waiter| handed_off(waiter, &stream, 1))
        .collect();
    // Held long enough that the waiter watching it lists it.
    eventually(LIMIT, "the watching waiter lists the stream", || {
        !on.stuck().is_empty()
    });
    for waiter in [&off, &zero] {
        assert!(waiter.stuck().is_empty());
        assert_eq!(waiter.stats().stuck, 0);
    }
    assert_eq!(on.stats().stuck, 1);
    gate.open();
    futures::executor::block_on(futures::future::join_all(futures));
}

#[test]
fn a_stuck_stream_is_warned_about_with_no_idle_thread_and_no_read() {
    // No keep-alive: a lane thread leaves as soon as it is idle; the
    // poller watches while any wait is pending.
    let builder = Waiter::builder().keep_alive(Duration::ZERO);
    let (waiter, needle) =
        stuck_waiter_from(builder, "stuck-busy-waiter", Duration::from_millis(10));
    let stuck = HostStream::new().unwrap();
    let busy = HostStream::new().unwrap();
    let gate = Gate::hold(&stuck);
    let futures = handed_off(&waiter, &stuck, 1);
    // Only the held stream's lines: a test thread stalled 10 ms between a
    // hand-off on `busy` and its end gets `busy` reported too.
    let about_stuck = || lines_about(warnings_containing, &needle, &stuck).len();
    // Nobody reads `stuck()` or the stats, while another stream's work
    // comes and goes.
    eventually(LIMIT, "the poller reports the stuck stream", || {
        let busy_gate = Gate::hold(&busy);
        let more = handed_off(&waiter, &busy, 1);
        busy_gate.open();
        futures::executor::block_on(futures::future::join_all(more));
        about_stuck() > 0
    });
    assert_eq!(about_stuck(), 1);
    gate.open();
    futures::executor::block_on(futures::future::join_all(futures));
}

#[test]
fn streams_past_max_threads_are_reported() {
    // One lane thread, blocked on the first stream: the second is polled.
    let (waiter, needle) = one_thread_stuck_waiter("stuck-polled-waiter");
    let HeldStreams {
        _streams,
        gates,
        futures,
    } = held_streams(&waiter, 2, 2);
    eventually(LIMIT, "both streams are listed", || {
        waiter.stuck().len() == 2
    });
    let stuck = waiter.stuck();
    assert!(stuck.iter().all(|wait| wait.behind == 1), "{stuck:?}");
    // Each entry is its own stream's, by name and by number.
    for stream in &_streams {
        let id = Host::stream_id(stream.handle());
        let entry = stuck.iter().find(|wait| wait.stream_id == id);
        let entry = entry.unwrap_or_else(|| panic!("stream {id} listed: {stuck:?}"));
        assert_eq!(entry.stream, stream_name(stream));
    }
    let stats = waiter.stats();
    assert_eq!(
        (stats.threads, stats.stuck),
        (2, 2),
        "a lane thread and the poller"
    );
    assert_eq!(logged(warnings_containing, &needle, 2).len(), 2);
    gates.into_iter().for_each(Gate::open);
    let results = futures::executor::block_on(futures::future::join_all(futures));
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let stats = waiter.stats();
    assert_eq!((stats.resolved, stats.stuck), (4, 0), "{stats:?}");
    check_accounts(&stats);
    settle(&waiter);
    assert_eq!(warnings_containing(&needle).len(), 2);
}

#[test]
fn a_polled_stream_whose_waits_are_all_given_up_stops_being_watched() {
    // One lane thread, blocked on the first stream: the second is polled,
    // so a wait given up on it leaves its queue.
    let (waiter, needle) = one_thread_stuck_waiter("stuck-polled-given-up-waiter");
    let (first, polled) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let gates = [Gate::hold(&first), Gate::hold(&polled)];
    let blocked = handed_off(&waiter, &first, 1);
    // Handed off apart, so a stall timed from the hand-off of the wait at
    // its head would shrink when the first is given up.
    let mut queued = handed_off(&waiter, &polled, 1);
    std::thread::sleep(STUCK_AFTER / 5);
    queued.extend(handed_off(&waiter, &polled, 1));
    eventually(LIMIT, "both streams are listed", || {
        waiter.stuck().len() == 2
    });
    // The polled stream's entry: two waits, one behind the oldest.
    let polled_entry = |waiter: &Waiter, name: &str| {
        let stuck = waiter.stuck();
        stuck.into_iter().find(|wait| wait.stream == name)
    };
    let before = waiter.stuck();
    let entry = before.iter().find(|wait| wait.behind == 1);
    let before = entry.expect("the polled stream, one wait behind").clone();
    // The oldest given up: the stall goes on for the one behind it, from
    // the same start, and is not reported again.
    drop(queued.remove(0));
    // The poller may have it out in a batch when its future is dropped:
    // then it leaves at the end of that round.
    eventually(LIMIT, "the given-up wait leaves the queue", || {
        polled_entry(&waiter, &before.stream).is_some_and(|entry| entry.behind == 0)
    });
    let after = polled_entry(&waiter, &before.stream).expect("still listed");
    assert!(after.waited >= before.waited, "{before:?} then {after:?}");
    assert_eq!(logged(warnings_containing, &needle, 2).len(), 2);
    // The last given up: nothing waits on the stream, which is no longer
    // listed.
    drop(queued);
    eventually(LIMIT, "the polled stream is no longer listed", || {
        polled_entry(&waiter, &before.stream).is_none()
    });
    assert_eq!(waiter.stuck().len(), 1, "the first stream is still held");
    gates.into_iter().for_each(Gate::open);
    futures::executor::block_on(futures::future::join_all(blocked));
    settle(&waiter);
    assert_eq!(warnings_containing(&needle).len(), 2);
}

#[test]
fn the_poller_reports_a_stream_held_with_nothing_else_handed_off() {
    // No hand-off and no read of `stuck()` or the stats while the stream is
    // held: the poller's own rounds find it.
    let (waiter, needle) = stuck_waiter("stuck-idle-thread-waiter", STUCK_AFTER);
    // Two lane threads, left idle: one takes the held stream, one stays.
    let HeldStreams {
        _streams,
        gates,
        futures,
    } = held_streams(&waiter, 2, 1);
    gates.into_iter().for_each(Gate::open);
    futures::executor::block_on(futures::future::join_all(futures));
    let held = HostStream::new().unwrap();
    let gate = Gate::hold(&held);
    let future = handed_off(&waiter, &held, 1);
    let about_held = || lines_about(warnings_containing, &needle, &held).len();
    eventually(LIMIT, "an idle thread reports the held stream", || {
        about_held() > 0
    });
    gate.open();
    futures::executor::block_on(futures::future::join_all(future))
        .remove(0)
        .unwrap();
    settle(&waiter);
    assert_eq!(about_held(), 1, "{:?}", warnings_containing(&needle));
}
