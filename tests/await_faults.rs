//! Awaits under faults: cancellation, panicking backend calls, faulted and
//! dropped streams, and shutdown. No future is left pending forever.

mod common;

use std::time::Duration;

use common::faulty::{self, inject, Faulty, Plan};
use common::{eventually, faultable_stream, Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{EventFence, ServerError, Waiter};
use futures::FutureExt;

const LIMIT: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap()
}

#[test]
fn dropped_futures_behind_a_held_wait_release_their_events_promptly_on_waiter_threads() {
    let waiter = Waiter::builder()
        .max_threads(1)
        .watchers(0)
        .thread_name("cancel-test")
        .build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    // The lane's thread blocks on this one until the gate opens.
    let mut held = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    assert!((&mut held).now_or_never().is_none());

    // A service retrying with short timeouts on the stuck stream: each
    // future is handed off, then dropped. Its wait leaves the waiter at once
    // and a waiter thread destroys its event, while the held wait still
    // blocks: nothing piles up behind it.
    for round in 1..=100 {
        let fence = EventFence::<Faulty>::new(stream.handle());
        assert!(waiter.wait(fence).now_or_never().is_none(), "round {round}");
        assert_eq!(waiter.pending(), 1, "round {round}: only the held wait");
        eventually(LIMIT, "the dropped future's event is destroyed", || {
            faulty::destroyed(stream.handle()) == round
        });
    }
    let names = faulty::destroyed_on(stream.handle());
    let elsewhere: Vec<_> = names
        .iter()
        .filter(|name| !name.starts_with("cancel-test"))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "destroyed on waiter threads only, but {} of {} on {:?}",
        elsewhere.len(),
        names.len(),
        elsewhere.first()
    );
    // One thread blocks on the held wait; one more (the poller, as
    // max_threads is 1) destroys the rest.
    assert!(waiter.peak_threads() <= 2, "{}", waiter.peak_threads());

    gate.open();
    futures::executor::block_on(held).unwrap();
    assert_eq!(waiter.pending(), 0);
    eventually(LIMIT, "the held fence's event is destroyed too", || {
        faulty::destroyed(stream.handle()) == 101
    });
}

#[test]
fn a_timeout_cancels_a_long_wait_and_the_stream_and_waiter_still_serve() {
    let waiter = Waiter::builder().max_threads(2).build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    progress.step_on(&stream);
    let fence = EventFence::<Host>::new(stream.handle());
    let cancelled = runtime().block_on(async {
        tokio::time::timeout(Duration::from_millis(20), waiter.wait(fence)).await
    });
    // The timeout fired and dropping the future did not wait for the gate.
    assert!(cancelled.is_err());
    assert_eq!(progress.get(), 0, "the stream is still held");

    // Later work and awaits on the same stream and waiter still resolve.
    progress.step_on(&stream);
    let later = EventFence::<Host>::new(stream.handle());
    gate.open();
    futures::executor::block_on(waiter.wait(later)).unwrap();
    assert_eq!(progress.get(), 2);
    // The cancelled wait's event was released by the waiter, and the
    // markers of both are behind the worker: none of this stream's events
    // is left. (Counted per stream: other tests' events do not disturb it.)
    eventually(LIMIT, "cancelled waits released", || {
        waiter.pending() == 0 && stream.live_events().count() == 0
    });
}

#[test]
fn dropping_a_pending_future_never_blocks_and_releases_its_event() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut futures: Vec<_> = (0..100)
        .map(|_| waiter.wait(EventFence::<Host>::new(stream.handle())))
        .collect();
    for future in &mut futures {
        assert!(future.now_or_never().is_none(), "held by the gate");
    }
    assert_eq!(waiter.pending(), 100);
    drop(futures); // returns at once: the gate is still closed
    gate.open();
    let last = EventFence::<Host>::new(stream.handle());
    futures::executor::block_on(waiter.wait(last)).unwrap();
    eventually(LIMIT, "dropped waits released", || {
        waiter.pending() == 0 && stream.live_events().count() == 0
    });
}

#[test]
fn a_panic_in_a_waiter_threads_synchronize_resolves_with_an_error() {
    let waiter = Waiter::builder().max_threads(1).build();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "panic-sync",
            panic_in_synchronize: true,
            ..Plan::default()
        },
    );
    let gate = Gate::hold(&stream);
    let fence = EventFence::<Faulty>::new(stream.handle());
    let mut future = waiter.wait(fence);
    // Handed off while the gate holds the stream, so only the waiter
    // thread's synchronize (which panics) can resolve it.
    assert!((&mut future).now_or_never().is_none());
    let err = futures::executor::block_on(future).unwrap_err();
    assert!(
        matches!(&err, ServerError::WaiterPanicked { message } if message.contains("panic-sync")),
        "{err}"
    );
    gate.open();
    // The pool keeps serving, on the same thread.
    let other = HostStream::new().unwrap();
    let progress = Progress::default();
    progress.step_on(&other);
    futures::executor::block_on(waiter.wait(EventFence::<Host>::new(other.handle()))).unwrap();
    assert_eq!(progress.get(), 1);
}

#[test]
fn a_panic_in_a_waiter_threads_query_resolves_with_an_error() {
    let waiter = Waiter::builder().max_threads(1).build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let first = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    let mut second = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    let mut first = Box::pin(first);
    assert!((&mut first).now_or_never().is_none());
    assert!((&mut second).now_or_never().is_none());
    // Both are handed off; now queries of this stream's events panic. The
    // thread blocks on the first, then queries the second.
    inject(
        stream.handle(),
        Plan {
            label: "panic-query",
            panic_in_query: true,
            ..Plan::default()
        },
    );
    gate.open();
    futures::executor::block_on(first).unwrap();
    let err = futures::executor::block_on(second).unwrap_err();
    assert!(matches!(err, ServerError::WaiterPanicked { .. }), "{err}");
}

#[test]
fn a_panic_in_the_first_polls_query_resolves_with_an_error() {
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "panic-first-query",
            panic_in_query: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    let err = fence.wait().now_or_never().expect("ready").unwrap_err();
    assert!(matches!(err, ServerError::WaiterPanicked { .. }), "{err}");
}

#[test]
fn a_faulted_stream_resolves_every_pending_await_with_the_fault() {
    let waiter = Waiter::builder().build();
    let stream = faultable_stream();
    let gate = Gate::hold(&stream);
    stream.launch(|| panic!("illegal address")).unwrap();
    let waits: Vec<_> = (0..50)
        .map(|_| waiter.wait(EventFence::<Host>::new(stream.handle())))
        .collect();
    gate.open();
    let results = futures::executor::block_on(futures::future::join_all(waits));
    for result in results {
        let err = result.unwrap_err();
        assert!(err.is_faulted(), "{err}");
    }
    // And later awaits on it fail at once.
    let later = EventFence::<Host>::new(stream.handle());
    assert!(futures::executor::block_on(waiter.wait(later))
        .unwrap_err()
        .is_faulted());
}

#[test]
fn a_dropped_streams_pending_awaits_resolve() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    progress.step_on(&stream);
    let mut waits: Vec<_> = (0..20)
        .map(|_| waiter.wait(EventFence::<Host>::new(stream.handle())))
        .collect();
    for wait in &mut waits {
        assert!(wait.now_or_never().is_none());
    }
    let opener = std::thread::spawn(move || gate.open());
    drop(stream); // returns at once; its worker still runs the queued work
    opener.join().unwrap();
    for result in futures::executor::block_on(futures::future::join_all(waits)) {
        result.unwrap();
    }
    assert_eq!(progress.get(), 1);
}

#[test]
fn shutdown_resolves_a_wait_a_thread_is_blocked_on_without_the_device() {
    let waiter = Waiter::builder().max_threads(1).build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut blocked = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    assert!((&mut blocked).now_or_never().is_none());
    eventually(LIMIT, "the waiter thread blocks on the wait", || {
        faulty::synchronizing(stream.handle()) == 1
    });

    waiter.shutdown();
    // The stream is still held: only shutdown can resolve the wait now.
    let mut result = None;
    eventually(LIMIT, "the blocked wait resolves", || {
        result = (&mut blocked).now_or_never();
        result.is_some()
    });
    assert_eq!(result.unwrap().unwrap_err(), ServerError::WaiterGone);
    assert_eq!(waiter.pending(), 0);
    assert_eq!(faulty::synchronizing(stream.handle()), 1, "still blocked");

    gate.open();
    eventually(LIMIT, "the thread lets go and exits", || {
        faulty::synchronizing(stream.handle()) == 0 && waiter.threads() == 0
    });
    assert_eq!(faulty::destroyed(stream.handle()), 1);
}

#[test]
fn shutdown_resolves_pending_waits_and_refuses_new_ones() {
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut waits: Vec<_> = (0..10)
        .map(|_| waiter.wait(EventFence::<Host>::new(stream.handle())))
        .collect();
    for wait in &mut waits {
        assert!(wait.now_or_never().is_none());
    }
    waiter.shutdown();
    waiter.shutdown(); // twice is fine

    // Bounded, so a shutdown that resolves nothing fails here, not hangs.
    for wait in &mut waits {
        assert_eq!(
            wait.wait_sync_timeout(LIMIT),
            Some(Err(ServerError::WaiterGone))
        );
    }
    let mut late = waiter.wait(EventFence::<Host>::new(stream.handle()));
    assert_eq!(
        late.wait_sync_timeout(LIMIT),
        Some(Err(ServerError::WaiterGone))
    );
    gate.open();
    eventually(LIMIT, "threads exit after shutdown", || {
        waiter.threads() == 0
    });
    // A fence already reached needs no thread: its first poll answers.
    stream.synchronize().unwrap();
    let reached = waiter.wait(EventFence::<Host>::new(stream.handle()));
    assert_eq!(reached.now_or_never(), Some(Ok(())));
}

/// A burst of cancelled waits (a client hanging up on many requests at once)
/// is disposed of by one extra thread, however many waits and however high
/// `max_threads`: not a new thread per dropped future.
#[test]
fn a_burst_of_dropped_futures_starts_at_most_one_extra_thread() {
    let waiter = Waiter::builder().max_threads(64).watchers(0).build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut futures: Vec<_> = (0..200)
        .map(|_| waiter.wait(EventFence::<Host>::new(stream.handle())))
        .collect();
    for future in &mut futures {
        assert!(future.now_or_never().is_none(), "held by the gate");
    }
    drop(futures);
    gate.open();
    eventually(LIMIT, "the dropped waits are disposed of", || {
        waiter.pending() == 0 && stream.live_events().count() == 0
    });
    // The stream's lane thread, and one thread to dispose of the rest.
    assert!(
        waiter.peak_threads() <= 2,
        "peak {} threads",
        waiter.peak_threads()
    );
}

/// Two fences of one stream with the same sequence (as two streams whose
/// lane keys collide would have) share a lane: the second is placed after
/// the first. When a thread takes it out and puts it back, it goes back to
/// that place, so a dropped future still finds and withdraws it: its event
/// is destroyed at once, not when the stream reaches it.
///
/// The lane is the poller's (the one lane thread is busy on another
/// stream): each round it takes the oldest wait out, and once one is
/// reached a batch of the next two, putting back those not reached.
#[test]
fn a_wait_placed_after_a_collision_is_withdrawn_from_where_it_was_put_back() {
    let waiter = Waiter::builder().max_threads(1).build();
    let held = HostStream::new().unwrap();
    inject(
        held.handle(),
        Plan {
            label: "collision-holder",
            ..Plan::default()
        },
    );
    let held_gate = Gate::hold(&held);
    let mut busy = waiter.wait(EventFence::<Faulty>::new(held.handle()));
    assert!((&mut busy).now_or_never().is_none(), "held by its gate");
    eventually(LIMIT, "the lane thread blocks on the held stream", || {
        faulty::synchronizing(held.handle()) == 1
    });
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "same-sequence",
            same_sequence: true,
            ..Plan::default()
        },
    );
    let first_gate = Gate::hold(&stream);
    let mut first = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    let second_gate = Gate::hold(&stream);
    let mut second = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    let third = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    let mut third = Some(third);
    for future in [&mut first, &mut second, third.as_mut().unwrap()] {
        assert!(future.now_or_never().is_none(), "held by the gates");
    }
    // The poller resolves the first, then takes the second and third out
    // together and puts both back (the second gate holds them).
    first_gate.open();
    assert_eq!(first.wait_sync_timeout(LIMIT), Some(Ok(())));
    // Two more queries: a round of the poller's after that batch was put
    // back (its rounds run one after another).
    let asked = faulty::queries(stream.handle());
    eventually(LIMIT, "two more rounds of the poller", || {
        faulty::queries(stream.handle()) >= asked + 2
    });
    assert_eq!(faulty::destroyed(stream.handle()), 1, "the first's event");
    drop(third.take());
    eventually(LIMIT, "the withdrawn third's event is destroyed", || {
        faulty::destroyed(stream.handle()) == 2
    });
    assert_eq!(
        waiter.pending(),
        2,
        "the second, and the held stream's wait"
    );
    second_gate.open();
    assert_eq!(second.wait_sync_timeout(LIMIT), Some(Ok(())));
    held_gate.open();
    assert_eq!(busy.wait_sync_timeout(LIMIT), Some(Ok(())));
}

/// A lane beyond `max_threads` is polled only while every lane thread is
/// busy: a lane thread that runs out of work takes it back from the poller
/// and blocks on it (sleeping in the driver) instead.
#[test]
fn a_lane_thread_out_of_work_takes_a_polled_lane_back_and_blocks_on_it() {
    let waiter = Waiter::builder().max_threads(1).build();
    let held = HostStream::new().unwrap();
    let polled = HostStream::new().unwrap();
    // Counts the polled stream's queries: the first poll's, then the
    // poller's (both told "not yet").
    inject(
        polled.handle(),
        Plan {
            label: "taken-back",
            unreached_queries: 2,
            ..Plan::default()
        },
    );
    let held_gate = Gate::hold(&held);
    let polled_gate = Gate::hold(&polled);
    let mut first = waiter.wait(EventFence::<Faulty>::new(held.handle()));
    assert!((&mut first).now_or_never().is_none());
    eventually(LIMIT, "the lane thread blocks on the first stream", || {
        faulty::synchronizing(held.handle()) == 1
    });
    // The only lane thread is busy: the second stream is polled.
    let mut second = waiter.wait(EventFence::<Faulty>::new(polled.handle()));
    assert!((&mut second).now_or_never().is_none());
    eventually(LIMIT, "the poller has the second stream's lane", || {
        faulty::queries(polled.handle()) >= 2
    });
    assert_eq!(
        faulty::synchronizing(polled.handle()),
        0,
        "polled, not blocked on"
    );
    held_gate.open();
    assert_eq!(first.wait_sync_timeout(LIMIT), Some(Ok(())));
    eventually(
        LIMIT,
        "the freed lane thread blocks on the polled stream",
        || faulty::synchronizing(polled.handle()) == 1,
    );
    polled_gate.open();
    assert_eq!(second.wait_sync_timeout(LIMIT), Some(Ok(())));
}

/// A dropped future withdraws its own wait only. While a thread holds the
/// first wait of a stream out of its lane (blocked on it), a colliding wait
/// (same sequence) takes its place; dropping the first future must leave the
/// second in place, to resolve.
#[test]
fn a_dropped_future_withdraws_only_its_own_wait_where_another_took_its_place() {
    let waiter = Waiter::builder().max_threads(1).build();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "place-taken",
            same_sequence: true,
            ..Plan::default()
        },
    );
    let gate = Gate::hold(&stream);
    let mut first = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    assert!((&mut first).now_or_never().is_none());
    eventually(LIMIT, "the lane thread blocks on the first", || {
        faulty::synchronizing(stream.handle()) == 1
    });
    // Out of its lane: the second takes the place it was given.
    let mut second = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    assert!((&mut second).now_or_never().is_none());
    drop(first);
    gate.open();
    assert_eq!(second.wait_sync_timeout(LIMIT), Some(Ok(())));
    eventually(LIMIT, "both events destroyed", || {
        faulty::destroyed(stream.handle()) == 2
    });
}

/// Each lane thread has a name of its own: `{thread_name}-{n}`.
#[test]
fn lane_threads_are_numbered_apart() {
    let waiter = Waiter::builder().thread_name("numbered").build();
    let streams = [HostStream::new().unwrap(), HostStream::new().unwrap()];
    let gates: Vec<Gate> = streams.iter().map(Gate::hold).collect();
    let mut waits: Vec<_> = streams
        .iter()
        .map(|stream| waiter.wait(EventFence::<Faulty>::new(stream.handle())))
        .collect();
    for wait in &mut waits {
        assert!(wait.now_or_never().is_none(), "held by its gate");
    }
    // Each held stream has a lane thread of its own, blocked on it.
    for stream in &streams {
        eventually(LIMIT, "a thread blocks on each stream", || {
            faulty::synchronizing(stream.handle()) == 1
        });
    }
    gates.into_iter().for_each(Gate::open);
    for wait in &mut waits {
        assert_eq!(wait.wait_sync_timeout(LIMIT), Some(Ok(())));
    }
    let names: Vec<Vec<String>> = streams
        .iter()
        .map(|stream| {
            eventually(LIMIT, "the event destroyed", || {
                faulty::destroyed(stream.handle()) == 1
            });
            faulty::destroyed_on(stream.handle())
        })
        .collect();
    assert!(names
        .iter()
        .flatten()
        .all(|name| name.starts_with("numbered-")));
    assert_ne!(names[0], names[1], "two threads, two names");
}

/// A future polled again after it completed is an error, not a hang: a
/// combinator handed futures that were polled once, one of them to its end,
/// still finishes.
#[test]
fn a_future_polled_again_after_it_completed_is_an_error_not_a_hang() {
    use futures::future::FusedFuture;

    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    let reached = stream.fence();
    stream.synchronize().unwrap();
    let gate = Gate::hold(&stream);
    let mut futures: Vec<_> = std::iter::once(reached)
        .chain((1..400).map(|_| stream.fence()))
        .map(|fence| waiter.wait(fence))
        .collect();
    let polled: Vec<_> = futures.iter_mut().map(|f| f.now_or_never()).collect();
    assert_eq!(polled[0], Some(Ok(())));
    assert!(polled[1..].iter().all(Option::is_none), "held by the gate");
    assert!(futures[0].is_terminated());
    assert!(!futures[1].is_terminated(), "a pending future is not done");

    let again = (&mut futures[0]).now_or_never();
    assert!(
        matches!(
            &again,
            Some(Err(ServerError::InvalidArgument { reason, .. })) if reason.contains("polled again")
        ),
        "{again:?}"
    );
    assert!(futures[0].is_terminated());

    gate.open();
    let joined =
        std::thread::spawn(move || futures::executor::block_on(futures::future::join_all(futures)));
    eventually(LIMIT, "join_all finishes", || joined.is_finished());
    let results = joined.join().unwrap();
    assert!(results[0].is_err(), "{:?}", results[0]);
    assert!(results[1..].iter().all(Result::is_ok));
}

/// A profile's future shares the fence future's hand-off, and its answer to
/// a poll after completion: an error, not a hang.
#[test]
fn a_profile_future_polled_again_after_it_completed_is_an_error_not_a_hang() {
    let stream = HostStream::new().unwrap();
    let profiler = device_events::EventProfiler::<device_events::host::Host>::new();
    let start = profiler.start(stream.handle()).unwrap();
    let profile = profiler.stop(start, stream.handle()).unwrap();
    stream.synchronize().unwrap();
    let mut future = profile.wait();
    assert!(matches!((&mut future).now_or_never(), Some(Ok(_))));
    let again = (&mut future).now_or_never();
    assert!(
        matches!(
            &again,
            Some(Err(ServerError::InvalidArgument { reason, .. })) if reason.contains("polled again")
        ),
        "{again:?}"
    );
}
