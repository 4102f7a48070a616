//! A suite written the way users write one: each test makes its own streams
//! with `HostStream::new()`, and one checks that a panicking job faults its
//! stream. `cargo test` runs them in any order, on parallel threads by
//! default: the fault stays on its stream, whichever tests run beside it or
//! after it.
//!
//! So that no order or thread count can hide a fault that spreads, every
//! other test also makes a stream, then has a job panic on a stream of the
//! process's (once, for the whole binary: [`faulted_elsewhere`]), then uses
//! the stream it made before and streams it makes after.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use device_events::host::{Host, HostStream};
use device_events::{Event, EventFence, EventFlags, EventProfiler};

/// A stream of this binary's faulted by a panicking job: the first caller
/// faults it, and every caller returns once it is faulted.
fn faulted_elsewhere() -> &'static HostStream {
    static FAULTED: OnceLock<HostStream> = OnceLock::new();
    FAULTED.get_or_init(|| {
        let stream = HostStream::new().unwrap();
        stream
            .launch(|| panic!("a bug in another test's job"))
            .unwrap();
        assert!(stream.synchronize().unwrap_err().is_faulted());
        stream
    })
}

#[test]
fn a_faulting_job_faults_its_stream() {
    let stream = HostStream::new().unwrap();
    stream.launch(|| panic!("a bug in a job")).unwrap();
    let err = stream.fence().wait_sync().unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert!(stream.launch(|| {}).unwrap_err().is_faulted());
    assert!(faulted_elsewhere().is_faulted());
}

#[test]
fn a_fence_is_awaited() {
    let before = HostStream::new().unwrap();
    faulted_elsewhere();
    for stream in [&before, &HostStream::new().unwrap()] {
        let ran = Arc::new(AtomicUsize::new(0));
        let counter = ran.clone();
        stream
            .launch(move || {
                counter.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        futures::executor::block_on(stream.fence().wait()).unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}

#[test]
fn a_profiler_times_a_stage() {
    let before = HostStream::new().unwrap();
    faulted_elsewhere();
    let profiler = EventProfiler::<Host>::new();
    for stream in [&before, &HostStream::new().unwrap()] {
        for _ in 0..3 {
            let start = profiler.start(stream.handle()).unwrap();
            stream.launch(|| {}).unwrap();
            profiler
                .stop(start, stream.handle())
                .unwrap()
                .wait_sync()
                .unwrap();
        }
    }
    assert_eq!(profiler.created(), 4, "two events for each stream");
}

#[test]
fn a_stream_waits_for_another_on_the_device() {
    let producer = HostStream::new().unwrap();
    faulted_elsewhere();
    let consumer = HostStream::new().unwrap();
    let produced = Arc::new(AtomicUsize::new(0));
    let counter = produced.clone();
    producer
        .launch(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    EventFence::<Host>::new(producer.handle())
        .wait_async(consumer.handle())
        .unwrap();
    let seen = Arc::new(AtomicUsize::new(usize::MAX));
    let (seen_by_work, produced_by_work) = (seen.clone(), produced.clone());
    consumer
        .launch(move || {
            seen_by_work.store(produced_by_work.load(Ordering::SeqCst), Ordering::SeqCst)
        })
        .unwrap();
    consumer.synchronize().unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1);
}

#[test]
fn an_event_is_recorded_and_synchronized() {
    let before = HostStream::new().unwrap();
    faulted_elsewhere();
    for stream in [&before, &HostStream::new().unwrap()] {
        let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
        stream.launch(|| {}).unwrap();
        event.record(stream.handle()).unwrap();
        event.wait_sync().unwrap();
        assert!(event.is_complete().unwrap());
    }
}

#[test]
fn launched_work_runs_in_order() {
    let before = HostStream::new().unwrap();
    faulted_elsewhere();
    for stream in [&before, &HostStream::new().unwrap()] {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        for i in 0..100 {
            let seen = seen.clone();
            stream.launch(move || seen.lock().unwrap().push(i)).unwrap();
        }
        stream.synchronize().unwrap();
        assert!(seen.lock().unwrap().iter().copied().eq(0..100));
    }
}
