//! Watching progress words (`WaiterBuilder::watchers`) on host streams: the
//! budget's setting, waits on items that end one after another, faults, and
//! watching turned off. Each test has a waiter and streams of its own.

mod common;

use std::time::Duration;

use common::{faultable_stream, Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{default_watchers, EventFence, Waiter, WATCHER_MIN_CORES};

/// `items` items of `item` on `stream`, each with a fence, awaited by
/// `waiter` all at once, the stream held until every wait is handed off:
/// each result, and what had run when it came.
fn items_awaited(
    waiter: &Waiter,
    stream: &HostStream,
    items: usize,
    item: Duration,
) -> Vec<(Result<(), device_events::ServerError>, usize)> {
    let gate = Gate::hold(stream);
    let progress = Progress::default();
    let mut waits = Vec::new();
    for _ in 0..items {
        stream
            .launch(move || std::thread::sleep(item))
            .expect("launch an item");
        progress.step_on(stream);
        waits.push(waiter.wait(EventFence::<Host>::new(stream.handle())));
    }
    let mut polled: Vec<_> = waits
        .into_iter()
        .map(|mut wait| {
            let first = futures::executor::block_on(futures::future::poll_immediate(&mut wait));
            assert!(first.is_none(), "the stream is held");
            wait
        })
        .collect();
    gate.open();
    polled
        .iter_mut()
        .map(|wait| {
            let result = futures::executor::block_on(wait);
            (result, progress.get())
        })
        .collect()
}

#[test]
fn the_watcher_is_on_by_default_from_eight_cores_and_the_setting_reads_back() {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    assert_eq!(WATCHER_MIN_CORES, 8);
    assert_eq!(default_watchers(), usize::from(cores >= WATCHER_MIN_CORES));
    assert_eq!(Waiter::builder().build().watchers(), default_watchers());
    assert_eq!(Waiter::builder().watchers(0).build().watchers(), 0);
    assert_eq!(Waiter::builder().watchers(3).build().watchers(), 3);
}

#[test]
fn items_ending_one_after_another_are_watched_and_resolve_in_order_after_their_work() {
    // A watcher sees at least some of forty items end (a wait found ended
    // when the thread comes to it counts too). On a loaded machine one
    // waiter's may see none: one late wake makes it wake early enough to
    // cut these items off until it idles out, and the driver's wake may come
    // first each time. So waiters in turn: at least five, for up to 30 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut watched = Vec::new();
    while watched.len() < 5 || std::time::Instant::now() < deadline {
        let waiter = Waiter::builder().watchers(1).build();
        let stream = HostStream::new().unwrap();
        let items = 40;
        let results = items_awaited(&waiter, &stream, items, Duration::from_micros(500));
        for (index, (result, ran)) in results.into_iter().enumerate() {
            result.expect("reached");
            assert!(
                ran > index,
                "wait {index} resolved after {ran} steps had run"
            );
        }
        // Every wait a lane thread held ended on the word or in the driver.
        let stats = waiter.stats();
        assert_eq!(stats.resolved, items as u64);
        assert!(stats.watched <= stats.resolved);
        watched.push(stats.watched);
        if stats.watched > 0 {
            // The watcher's CPU is counted as each of its rounds ends.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while waiter.stats().watcher_cpu.is_zero() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a watcher that saw waits end reports no CPU time"
                );
                std::thread::yield_now();
            }
            return;
        }
    }
    panic!(
        "none of {} waiters' watchers saw a wait end in 30 s",
        watched.len()
    );
}

#[test]
fn the_watchers_cpu_stays_within_a_quarter_of_a_core_and_a_burst() {
    // Eight streams of 1 ms items: watching every one of them would take more than a quarter of
    // a core on a machine whose sleeps end late. The budget bounds the watcher's thread: a
    // quarter of the time that passed, a 10 ms burst, one round over.
    let waiter = Waiter::builder().watchers(1).build();
    let streams: Vec<HostStream> = (0..8).map(|_| HostStream::new().unwrap()).collect();
    let started = std::time::Instant::now();
    let mut waits = Vec::new();
    for _ in 0..200 {
        for stream in &streams {
            let work = || std::thread::sleep(Duration::from_millis(1));
            stream.launch(work).unwrap();
            waits.push(waiter.wait(EventFence::<Host>::new(stream.handle())));
        }
    }
    for result in futures::executor::block_on(futures::future::join_all(waits)) {
        result.expect("reached");
    }
    // Its CPU is counted as each round ends; read once it is shut down, a round may be left
    // uncounted, which only lowers what is read.
    waiter.shutdown();
    let passed = started.elapsed();
    let bound = passed / 4 + Duration::from_millis(10) + Duration::from_millis(5);
    let used = waiter.stats().watcher_cpu;
    assert!(used <= bound, "the watcher used {used:?} in {passed:?}");
}

#[test]
fn with_no_watchers_no_wait_is_watched() {
    let waiter = Waiter::builder().watchers(0).build();
    let stream = HostStream::new().unwrap();
    let results = items_awaited(&waiter, &stream, 20, Duration::from_micros(200));
    for (index, (result, ran)) in results.into_iter().enumerate() {
        result.expect("reached");
        assert!(ran > index);
    }
    assert_eq!(waiter.stats().watched, 0);
    assert_eq!(waiter.stats().watcher_cpu, Duration::ZERO, "no watcher");
    assert_eq!(waiter.peak_threads(), 1, "one lane thread, no watcher");
}

#[test]
fn a_stream_that_faults_while_watched_fails_its_later_waits() {
    let waiter = Waiter::builder().watchers(1).build();
    let stream = faultable_stream();
    let gate = Gate::hold(&stream);
    let mut waits = Vec::new();
    for item in 0..20 {
        if item == 10 {
            stream.launch(|| panic!("illegal address")).unwrap();
        } else {
            let work = || std::thread::sleep(Duration::from_micros(300));
            stream.launch(work).unwrap();
        }
        waits.push(waiter.wait(EventFence::<Host>::new(stream.handle())));
    }
    gate.open();
    let results = futures::executor::block_on(futures::future::join_all(waits));
    // Waits before the fault may see it too (it is sticky, as on CUDA);
    // none after it resolves.
    for (item, result) in results.into_iter().enumerate() {
        match result {
            Ok(()) => assert!(item < 10, "wait {item} resolved after the fault"),
            Err(err) => assert!(err.is_faulted(), "wait {item}: {err}"),
        }
    }
}
