//! `EventProfiler` on the host backend: timing, pooling, errors, no leaks.

mod common;

use std::time::Duration;

use common::faulty::{self, Faulty, Plan};
use common::{eventually, faultable_stream, Gate};
use device_events::host::{Host, HostContext, HostStream};
use device_events::{EventProfiler, ServerError, Waiter, DEFAULT_PROFILER_CAPACITY};
use futures::FutureExt;

const WORK: Duration = Duration::from_millis(20);

#[test]
fn measures_the_work_between_start_and_stop_synchronously() {
    let stream = HostStream::new().unwrap();
    let profiler = EventProfiler::<Host>::new();
    let start = profiler.start(stream.handle()).unwrap();
    stream.launch(|| std::thread::sleep(WORK)).unwrap();
    let elapsed = profiler
        .stop(start, stream.handle())
        .unwrap()
        .wait_sync()
        .unwrap();
    assert!(elapsed >= WORK, "{elapsed:?}");
}

#[test]
fn measures_by_await_through_the_waiter() {
    let stream = HostStream::new().unwrap();
    let profiler = EventProfiler::<Host>::new();
    let start = profiler.start(stream.handle()).unwrap();
    stream.launch(|| std::thread::sleep(WORK)).unwrap();
    let profile = profiler.stop(start, stream.handle()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let elapsed = runtime.block_on(async { profile.await }).unwrap();
    assert!(elapsed >= WORK, "{elapsed:?}");
}

/// A start on a busy stream and a stop on an idle one: the stop is reached
/// first, and the profile says so (`StopBeforeStart`, not a zero that would
/// pass for a real time), but only once the start is reached too (the driver
/// says `CUDA_ERROR_NOT_READY` until then).
#[test]
fn a_profile_whose_start_is_on_a_busier_stream_waits_for_it_synchronously() {
    // One context: a profile's two events must be of one.
    let context = HostContext::new();
    let (busy, idle) = (context.new_stream().unwrap(), context.new_stream().unwrap());
    let gate = Gate::hold(&busy);
    let profiler = EventProfiler::<Faulty>::new();
    let start = profiler.start(busy.handle()).unwrap();
    let profile = profiler.stop(start, idle.handle()).unwrap();
    let (sender, result) = std::sync::mpsc::channel();
    let waiting = std::thread::spawn(move || sender.send(profile.wait_sync()).unwrap());
    // Open the gate only once the waiting thread blocks on the start (or has
    // returned without waiting for it, which is the defect).
    let busy_handle = busy.handle();
    eventually(
        Duration::from_secs(20),
        "wait_sync blocks on the start",
        || faulty::synchronizing(busy_handle) == 1 || waiting.is_finished(),
    );
    gate.open();
    let elapsed = result.recv().unwrap();
    waiting.join().unwrap();
    assert!(
        matches!(elapsed, Err(ServerError::StopBeforeStart { .. })),
        "{elapsed:?}"
    );
}

#[test]
fn a_profile_whose_start_is_on_a_busier_stream_waits_for_it_by_await() {
    let context = HostContext::new();
    let (busy, idle) = (context.new_stream().unwrap(), context.new_stream().unwrap());
    let gate = Gate::hold(&busy);
    let profiler = EventProfiler::<Host>::new();
    let waiter = Waiter::builder().build();
    let start = profiler.start(busy.handle()).unwrap();
    let mut future = waiter.wait(profiler.stop(start, idle.handle()).unwrap());
    let first = (&mut future).now_or_never();
    assert!(
        first.is_none(),
        "ready before the start was reached: {first:?}"
    );
    gate.open();
    let elapsed = futures::executor::block_on(future);
    assert!(
        matches!(
            elapsed,
            Err(ServerError::StopBeforeStart {
                backend: "Host",
                ..
            })
        ),
        "{elapsed:?}"
    );
}

#[test]
fn a_hot_loop_allocates_no_events_after_warm_up() {
    let stream = HostStream::new().unwrap();
    let profiler = EventProfiler::<Host>::new();
    let waiter = Waiter::builder().build();
    for round in 0..200 {
        let start = profiler.start(stream.handle()).unwrap();
        stream.launch(|| {}).unwrap();
        let profile = profiler.stop(start, stream.handle()).unwrap();
        if round % 2 == 0 {
            profile.wait_sync().unwrap();
        } else {
            futures::executor::block_on(waiter.wait(profile)).unwrap();
        }
    }
    // The waiter holds a profile's events only weakly: they are back in the
    // pool as soon as each wait returns, so no round needed a new one.
    assert_eq!(profiler.pooled(), 2);
    assert_eq!(profiler.created(), 2);
}

#[test]
fn dropped_starts_and_unread_profiles_return_their_events() {
    let stream = HostStream::new().unwrap();
    let profiler = EventProfiler::<Host>::new();
    drop(profiler.start(stream.handle()).unwrap());
    assert_eq!(profiler.pooled(), 1);
    let gate = Gate::hold(&stream);
    let start = profiler.start(stream.handle()).unwrap();
    let profile = profiler.stop(start, stream.handle()).unwrap();
    drop(profile); // unread, its stop still pending behind the gate
    assert_eq!(profiler.pooled(), 2);
    // A pending future dropped: the waiter gives the events back later.
    let start = profiler.start(stream.handle()).unwrap();
    let mut future = profiler.stop(start, stream.handle()).unwrap().wait();
    assert!((&mut future).now_or_never().is_none());
    drop(future);
    gate.open();
    common::eventually(
        Duration::from_secs(20),
        "the cancelled pair is back",
        || profiler.pooled() == 2,
    );
    assert_eq!(profiler.created(), 2);
}

/// A pool keeps up to its capacity of idle events (`new`:
/// `DEFAULT_PROFILER_CAPACITY`) and destroys the rest.
#[test]
fn the_pool_is_bounded() {
    let stream = HostStream::new().unwrap();
    let bounded = [
        (EventProfiler::<Host>::with_capacity(3), 3),
        (EventProfiler::<Host>::new(), DEFAULT_PROFILER_CAPACITY),
    ];
    for (profiler, capacity) in bounded {
        let starts: Vec<_> = (0..capacity + 7)
            .map(|_| profiler.start(stream.handle()).unwrap())
            .collect();
        assert_eq!(profiler.created(), capacity + 7);
        drop(starts);
        assert_eq!(profiler.pooled(), capacity, "the rest were destroyed");
    }
}

#[test]
fn a_faulted_stream_fails_the_measurement_and_nothing_leaks() {
    // Counted on this test's own streams: other tests' events do not count.
    let stream = faultable_stream();
    let other = HostStream::new().unwrap();
    let live = [stream.live_events(), other.live_events()];
    {
        let profiler = EventProfiler::<Host>::new();
        let gate = Gate::hold(&stream);
        let start = profiler.start(stream.handle()).unwrap();
        stream.launch(|| panic!("fault while profiling")).unwrap();
        let profile = profiler.stop(start, stream.handle()).unwrap();
        gate.open();
        let err = profile.wait_sync().unwrap_err();
        assert!(err.is_faulted(), "{err}");
        assert!(profiler.start(stream.handle()).unwrap_err().is_faulted());
        // `other`, of another context, is served from a pool of its own.
        let start = profiler.start(other.handle()).unwrap();
        let err = profiler.stop(start, stream.handle()).unwrap_err();
        assert!(err.is_faulted(), "{err}");
    } // the profiler and its pool are gone
      // The fault drops its markers' references just after it fails the waits.
    eventually(Duration::from_secs(20), "every event released", || {
        live.each_ref().map(|live| live.count()) == [0, 0]
    });
}

/// A start the driver refuses (a faulted stream) leaves the pool as it was:
/// its healthy events are neither destroyed nor replaced.
#[test]
fn a_refused_start_keeps_the_pooled_events() {
    let stream = faultable_stream();
    let profiler = EventProfiler::<Host>::new();
    let start = profiler.start(stream.handle()).unwrap();
    profiler
        .stop(start, stream.handle())
        .unwrap()
        .wait_sync()
        .unwrap();
    let (pooled, created) = (profiler.pooled(), profiler.created());
    assert_eq!((pooled, created), (2, 2));
    stream.launch(|| panic!("fault before profiling")).unwrap();
    assert!(stream.synchronize().unwrap_err().is_faulted());
    for _ in 0..10 {
        assert!(profiler.start(stream.handle()).unwrap_err().is_faulted());
    }
    assert_eq!((profiler.pooled(), profiler.created()), (pooled, created));
    // A stream of another context is served from a pool of its own, beside
    // the faulted context's events.
    let elsewhere = HostStream::new().unwrap();
    for _ in 0..3 {
        drop(profiler.start(elsewhere.handle()).unwrap());
    }
    assert_eq!(profiler.created(), created + 1);
    assert_eq!(profiler.pooled(), pooled + 1);
}

/// A start whose record alone is refused (its new event was made) keeps that
/// event in the pool rather than destroy it.
#[test]
fn a_start_whose_record_is_refused_keeps_its_new_event() {
    let stream = faultable_stream();
    let plan = Plan {
        label: "profiler-start-record-refused",
        refuse_record: true,
        ..Plan::default()
    };
    faulty::inject(stream.handle(), plan);
    let profiler = EventProfiler::<Faulty>::new();
    let err = profiler.start(stream.handle()).unwrap_err();
    assert!(
        err.to_string().contains("profiler-start-record-refused"),
        "{err}"
    );
    assert_eq!((profiler.created(), profiler.pooled()), (1, 1));
}

/// One profiler for every context it is given, as one service times work
/// on two devices with one profiler: each context's events are pooled for
/// it, so no round after the first makes an event.
#[test]
fn one_profiler_times_streams_of_several_contexts() {
    let (one, two) = (HostContext::new(), HostContext::new());
    let streams = [
        one.new_stream().unwrap(),
        one.new_stream().unwrap(),
        two.new_stream().unwrap(),
        HostStream::new().unwrap(), // a context of its own
    ];
    let profiler = EventProfiler::<Host>::new();
    let waiter = Waiter::builder().build();
    for round in 0..4 {
        for stream in &streams {
            let start = profiler.start(stream.handle()).unwrap();
            stream.launch(|| {}).unwrap();
            let profile = profiler.stop(start, stream.handle()).unwrap();
            if round % 2 == 0 {
                profile.wait_sync().unwrap();
            } else {
                futures::executor::block_on(waiter.wait(profile)).unwrap();
            }
        }
    }
    // Two events for each of the three contexts, made in the first round.
    assert_eq!(profiler.created(), 6);
    let stats = profiler.stats();
    assert_eq!((stats.created, stats.pooled), (6, 6));
}

/// A profile whose start and stop are on streams of two contexts: refused
/// when read, as the driver refuses to time events of two contexts, with
/// an error that says so; its events go back, each to its context's pool.
#[test]
fn a_profile_across_two_contexts_is_refused_when_read() {
    let (one, two) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let profiler = EventProfiler::<Host>::new();
    for by_await in [false, true] {
        let start = profiler.start(one.handle()).unwrap();
        let profile = profiler.stop(start, two.handle()).unwrap();
        let err = if by_await {
            futures::executor::block_on(profile.wait())
        } else {
            profile.wait_sync()
        }
        .unwrap_err();
        assert_eq!(
            err.code(),
            Some(device_events::status::INVALID_HANDLE),
            "{err}"
        );
        assert!(err.to_string().contains("different contexts"), "{err}");
    }
    assert_eq!((profiler.pooled(), profiler.created()), (2, 2));
    for stream in [&one, &two] {
        let start = profiler.start(stream.handle()).unwrap();
        profiler
            .stop(start, stream.handle())
            .unwrap()
            .wait_sync()
            .unwrap();
    }
}

/// The capacity counts every context's idle events; at it, a context no
/// longer used (say, of a dropped stream) gives way to the one in use.
#[test]
fn a_full_pool_makes_way_for_the_context_in_use() {
    let profiler = EventProfiler::<Host>::with_capacity(2);
    let round = |stream: &HostStream| {
        let start = profiler.start(stream.handle()).unwrap();
        profiler
            .stop(start, stream.handle())
            .unwrap()
            .wait_sync()
            .unwrap();
    };
    let old = HostStream::new().unwrap();
    round(&old);
    drop(old);
    let new = HostStream::new().unwrap();
    round(&new);
    assert_eq!((profiler.pooled(), profiler.created()), (2, 4));
    for _ in 0..3 {
        round(&new);
    }
    assert_eq!(profiler.created(), 4, "the new stream's events were kept");
}

/// At the capacity, the context used least recently (an idle event taken
/// from it, or given back to it) gives up an idle event. Each stream is on a
/// context of its own.
#[test]
fn a_full_pool_takes_from_the_context_used_least_recently() {
    let streams: [HostStream; 4] = std::array::from_fn(|_| HostStream::new().unwrap());
    let [a, b, c, d] = &streams;
    for take_first in [false, true] {
        let profiler = EventProfiler::<Host>::with_capacity(3);
        let mut held = Vec::new();
        // `n` starts on `stream` at once, then dropped: `n` events given back.
        let give_back = |stream: &HostStream, n| {
            let starts: Vec<_> = (0..n)
                .map(|_| profiler.start(stream.handle()).unwrap())
                .collect();
            drop(starts);
        };
        // Whether a start on `stream` took an idle event (the start is held).
        let mut takes_idle = |stream: &HostStream| {
            let created = profiler.created();
            held.push(profiler.start(stream.handle()).unwrap());
            profiler.created() == created
        };
        give_back(a, 2);
        if take_first {
            assert!(takes_idle(a));
            give_back(b, 1);
        } else {
            give_back(b, 1);
            assert!(takes_idle(a));
        }
        give_back(c, 1);
        // Full: `d`'s event takes the place of the older of `a`'s take and
        // `b`'s give-back.
        give_back(d, 1);
        let (gave_up, kept) = if take_first { (a, b) } else { (b, a) };
        assert!(!takes_idle(gave_up), "take first: {take_first}");
        assert!(takes_idle(kept) && takes_idle(c) && takes_idle(d));
    }
}

/// A backend that does not tell its contexts apart (the default
/// `EventApi::stream_context`, as the fault-injecting wrapper keeps) gets
/// one pool per profiler: used on a second context, the profiler says so
/// instead of swapping its events, and keeps them for its own.
#[test]
fn without_context_keys_a_profiler_on_a_second_context_says_so() {
    let here = faultable_stream();
    let elsewhere = faultable_stream();
    let profiler = EventProfiler::<Faulty>::new();
    let start = profiler.start(here.handle()).unwrap();
    let elapsed = profiler.stop(start, here.handle()).unwrap().wait_sync();
    assert!(elapsed.is_ok(), "{elapsed:?}");
    for _ in 0..3 {
        let err = profiler.start(elsewhere.handle()).unwrap_err();
        assert!(
            matches!(&err, ServerError::InvalidArgument { reason, .. } if reason.contains("context")),
            "{err}"
        );
    }
    let start = profiler.start(here.handle()).unwrap();
    let err = profiler.stop(start, elsewhere.handle()).unwrap_err();
    assert!(matches!(err, ServerError::InvalidArgument { .. }), "{err}");
    // Its two events are back, for its own context.
    assert_eq!(profiler.pooled(), 2);
}

#[test]
fn debug_names_the_backend() {
    let profiler = EventProfiler::<Host>::new();
    assert!(format!("{profiler:?}").starts_with("HostEventProfiler"));
}
