//! Code the waiter calls but does not own panics: a task's waker, a
//! backend's event release. Each panic costs only that one call: the thread
//! that made it finishes its batch and goes on, later waits on the same
//! stream and on others resolve, and the waiter's counts return to zero.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use common::faulty::{inject, Faulty, Plan};
use common::{eventually, logs, Gate};
use device_events::host::{Host, HostStream};
use device_events::{EventApi, EventFence, FenceFuture, Waiter};

const LIMIT: Duration = Duration::from_secs(20);
const KEEP_ALIVE: Duration = Duration::from_millis(20);

/// A waker that counts its wakes, then panics with `label` in the message.
struct Panicking {
    label: &'static str,
    wakes: AtomicUsize,
}

impl Wake for Panicking {
    fn wake(self: Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        panic!("a waker that panics ({})", self.label);
    }
}

fn panicking_waker(label: &'static str) -> (Waker, Arc<Panicking>) {
    let waker = Arc::new(Panicking {
        label,
        wakes: AtomicUsize::new(0),
    });
    (Waker::from(waker.clone()), waker)
}

/// Poll `future` once with `waker`: it must be handed off (pending).
fn hand_off<A: EventApi>(future: &mut FenceFuture<A>, waker: &Waker) {
    let polled = Pin::new(future).poll(&mut Context::from_waker(waker));
    assert!(polled.is_pending(), "handed off: its stream is held");
}

/// A wait on `stream` handed to `waiter` while its stream is held, then let
/// go: it must resolve through the waiter's threads, in time.
fn assert_served(waiter: &Waiter, stream: &HostStream) {
    let gate = Gate::hold(stream);
    let mut future = waiter.wait(EventFence::<Host>::new(stream.handle()));
    hand_off(&mut future, futures::task::noop_waker_ref());
    gate.open();
    assert_eq!(future.wait_sync_timeout(LIMIT), Some(Ok(())));
}

/// The waiter's threads all left, with no wait pending, and none of them
/// by unwinding (its guard would have logged it): every panic was contained
/// where it happened. `name` is the waiter's unique thread name.
fn assert_back_to_zero(waiter: &Waiter, name: &str) {
    eventually(LIMIT, "no thread and no wait left", || {
        waiter.threads() == 0 && waiter.pending() == 0
    });
    let unwound = logs::errors_containing(&format!("waiter thread \"{name}-"));
    assert!(unwound.is_empty(), "{unwound:?}");
}

#[test]
fn a_panicking_waker_on_a_lane_thread_costs_only_its_wake() {
    logs::capture();
    let waiter = Waiter::builder()
        .keep_alive(KEEP_ALIVE)
        .thread_name("lane-waker-test")
        .build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let (waker, panicking) = panicking_waker("lane-thread-waker");
    // The lane thread blocks on the first, then resolves the second and the
    // third in one batch: three wakes that panic.
    let mut futures: Vec<_> = (0..3)
        .map(|_| waiter.wait(EventFence::<Host>::new(stream.handle())))
        .collect();
    for future in &mut futures {
        hand_off(future, &waker);
    }
    gate.open();
    eventually(LIMIT, "every wake made, panics and all", || {
        panicking.wakes.load(Ordering::SeqCst) == 3
    });
    for future in &mut futures {
        assert_eq!(future.wait_sync_timeout(LIMIT), Some(Ok(())));
    }
    // Logged just after each wake returns (by unwinding).
    eventually(LIMIT, "the panics logged", || {
        logs::errors_containing("lane-thread-waker").len() >= 3
    });
    // The lane's thread lives on: the same stream, and another, are served.
    assert_served(&waiter, &stream);
    assert_served(&waiter, &HostStream::new().unwrap());
    assert_back_to_zero(&waiter, "lane-waker-test");
    assert_eq!(
        logs::errors_containing("lane-thread-waker").len(),
        3,
        "each panic logged once"
    );
}

#[test]
fn a_panicking_waker_on_the_poller_costs_only_its_wake() {
    // One lane thread, held on one stream: every other stream's wait goes to
    // the poller.
    logs::capture();
    let waiter = Waiter::builder()
        .max_threads(1)
        .watchers(0)
        .keep_alive(KEEP_ALIVE)
        .thread_name("poller-waker-test")
        .build();
    let held = HostStream::new().unwrap();
    let held_gate = Gate::hold(&held);
    let mut blocked = waiter.wait(EventFence::<Host>::new(held.handle()));
    hand_off(&mut blocked, futures::task::noop_waker_ref());

    let polled = HostStream::new().unwrap();
    let gate = Gate::hold(&polled);
    let (waker, panicking) = panicking_waker("poller-waker");
    let mut futures: Vec<_> = (0..2)
        .map(|_| waiter.wait(EventFence::<Host>::new(polled.handle())))
        .collect();
    for future in &mut futures {
        hand_off(future, &waker);
    }
    gate.open();
    eventually(LIMIT, "the poller's wakes made, panics and all", || {
        panicking.wakes.load(Ordering::SeqCst) == 2
    });
    for future in &mut futures {
        assert_eq!(future.wait_sync_timeout(LIMIT), Some(Ok(())));
    }
    // The poller goes on: other streams beyond max_threads are polled.
    assert_served(&waiter, &polled);
    assert_served(&waiter, &HostStream::new().unwrap());
    held_gate.open();
    assert_eq!(blocked.wait_sync_timeout(LIMIT), Some(Ok(())));
    assert_eq!(waiter.peak_threads(), 2, "the lane thread and the poller");
    assert_back_to_zero(&waiter, "poller-waker-test");
}

#[test]
fn a_backend_whose_event_release_panics_costs_only_that_release() {
    logs::capture();
    let waiter = Waiter::builder()
        .keep_alive(KEEP_ALIVE)
        .thread_name("release-test")
        .build();
    let stream = HostStream::new().unwrap();
    // Every event of this stream panics when destroyed, so each of its
    // fences must be dropped by a waiter thread: handed off while held.
    inject(
        stream.handle(),
        Plan {
            label: "panicking-release",
            panic_in_destroy: true,
            ..Plan::default()
        },
    );
    let gate = Gate::hold(&stream);
    let noop = futures::task::noop_waker_ref();
    let mut futures: Vec<_> = (0..3)
        .map(|_| waiter.wait(EventFence::<Faulty>::new(stream.handle())))
        .collect();
    for future in &mut futures {
        hand_off(future, noop);
    }
    // Withdrawn, and dropped by a waiter thread (the release panics there).
    let withdrawn = futures.pop().unwrap();
    drop(withdrawn);
    eventually(LIMIT, "the withdrawn wait is dropped", || {
        !logs::errors_containing("panicking-release").is_empty()
    });
    gate.open();
    // The first is blocked on, the second resolved by a query; each event
    // release panics after its future is woken, and neither passes for a
    // failed wait.
    for future in &mut futures {
        assert_eq!(future.wait_sync_timeout(LIMIT), Some(Ok(())));
    }
    eventually(LIMIT, "all three releases logged", || {
        logs::errors_containing("panicking-release").len() == 3
    });
    // The threads that dropped them live on.
    let gate = Gate::hold(&stream);
    let mut later = waiter.wait(EventFence::<Faulty>::new(stream.handle()));
    hand_off(&mut later, noop);
    gate.open();
    assert_eq!(later.wait_sync_timeout(LIMIT), Some(Ok(())));
    assert_served(&waiter, &HostStream::new().unwrap());
    assert_back_to_zero(&waiter, "release-test");
}
