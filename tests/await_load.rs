//! Many awaits with few threads; a one-thread waiter that a slow stream does
//! not hold back; threads that leave after their keep-alive.

mod common;

use std::time::Duration;

use common::{eventually, Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{EventFence, Waiter};
use futures::FutureExt;

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn ten_thousand_awaits_on_sixteen_streams_need_about_sixteen_threads() {
    const STREAMS: usize = 16;
    const PER_STREAM: usize = 625;
    let waiter = Waiter::builder().build();
    let streams: Vec<HostStream> = (0..STREAMS).map(|_| HostStream::new().unwrap()).collect();
    let gates: Vec<Gate> = streams.iter().map(Gate::hold).collect();
    let progress = Progress::default();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let mut tasks = Vec::with_capacity(STREAMS * PER_STREAM);
    for _ in 0..PER_STREAM {
        for stream in &streams {
            progress.step_on(stream);
            let fence = EventFence::<Host>::new(stream.handle());
            tasks.push(runtime.spawn(waiter.wait(fence)));
        }
    }
    eventually(LIMIT, "every wait handed off", || {
        waiter.pending() == STREAMS * PER_STREAM
    });
    // A lane thread per busy stream, and the watcher of their words.
    let threads = waiter.threads();
    assert!(
        threads <= STREAMS + 1,
        "{threads} threads for {STREAMS} busy streams"
    );
    for gate in gates {
        gate.open();
    }
    runtime.block_on(async {
        for task in tasks {
            task.await.unwrap().unwrap();
        }
    });
    assert_eq!(progress.get(), STREAMS * PER_STREAM);
    assert!(
        waiter.peak_threads() <= STREAMS + 2,
        "peak {} threads (the poller and the watcher beside the lane threads)",
        waiter.peak_threads()
    );
}

#[test]
fn more_busy_streams_than_threads_stay_bounded() {
    const STREAMS: usize = 32;
    let waiter = Waiter::builder().max_threads(4).watchers(0).build();
    let streams: Vec<HostStream> = (0..STREAMS).map(|_| HostStream::new().unwrap()).collect();
    let gates: Vec<Gate> = streams.iter().map(Gate::hold).collect();
    let mut waits: Vec<_> = streams
        .iter()
        .flat_map(|stream| (0..10).map(|_| waiter.wait(EventFence::<Host>::new(stream.handle()))))
        .collect();
    for wait in &mut waits {
        assert!(wait.now_or_never().is_none());
    }
    assert!(waiter.threads() <= 5, "{} threads", waiter.threads());
    for gate in gates {
        gate.open();
    }
    for result in futures::executor::block_on(futures::future::join_all(waits)) {
        result.unwrap();
    }
    assert!(waiter.peak_threads() <= 5, "peak {}", waiter.peak_threads());
}

#[test]
fn a_one_thread_waiter_does_not_hold_fast_streams_behind_a_slow_one() {
    let waiter = Waiter::builder().max_threads(1).watchers(0).build();
    let slow = HostStream::new().unwrap();
    let slow_gate = Gate::hold(&slow);
    let mut slow_wait = waiter.wait(EventFence::<Host>::new(slow.handle()));
    assert!((&mut slow_wait).now_or_never().is_none());
    // The one lane thread is now blocked on the slow stream.
    eventually(LIMIT, "the lane thread started", || waiter.threads() >= 1);

    let fast: Vec<HostStream> = (0..4).map(|_| HostStream::new().unwrap()).collect();
    let progress = Progress::default();
    for round in 0..20 {
        let waits: Vec<_> = fast
            .iter()
            .map(|stream| {
                progress.step_on(stream);
                waiter.wait(EventFence::<Host>::new(stream.handle()))
            })
            .collect();
        // Resolves while the slow stream is still held: nothing waits on it.
        for result in futures::executor::block_on(futures::future::join_all(waits)) {
            result.unwrap();
        }
        assert_eq!(progress.get(), (round + 1) * fast.len());
    }
    assert!(
        slow_wait.now_or_never().is_none(),
        "the slow stream is still held"
    );
    assert!(waiter.peak_threads() <= 2, "one lane thread and the poller");
    slow_gate.open();
    futures::executor::block_on(waiter.wait(EventFence::<Host>::new(slow.handle()))).unwrap();
}

#[test]
fn idle_threads_leave_after_their_keep_alive() {
    // With the watcher on, a held wait's lane thread may start it (it is
    // counted too) at any time after the hand-off; it leaves after its
    // keep-alive as well.
    for watchers in [0, 1] {
        let waiter = Waiter::builder()
            .keep_alive(Duration::from_millis(20))
            .watchers(watchers)
            .thread_name("keep-alive-test")
            .build();
        let stream = HostStream::new().unwrap();
        // The second round shows that a new wait starts a thread again.
        for _ in 0..2 {
            let gate = Gate::hold(&stream);
            let mut wait = waiter.wait(EventFence::<Host>::new(stream.handle()));
            assert!((&mut wait).now_or_never().is_none());
            let threads = waiter.threads();
            assert!(
                (1..=1 + watchers).contains(&threads),
                "{threads} threads for one held wait, {watchers} watchers"
            );
            gate.open();
            futures::executor::block_on(wait).unwrap();
            eventually(LIMIT, "the idle threads left", || waiter.threads() == 0);
        }
        assert!(waiter.peak_threads() <= 1 + watchers);
    }
}
