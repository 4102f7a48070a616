//! `HostStream`: in-order work, faults, drop, and dangling handles.

mod common;

use std::sync::{Arc, Mutex};

use common::{Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{EventApi, EventFlags, ServerError};

#[test]
fn work_runs_in_launch_order_on_one_thread() {
    let stream = HostStream::new().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    for i in 0..1000 {
        let seen = seen.clone();
        stream
            .launch(move || seen.lock().unwrap().push((i, std::thread::current().id())))
            .unwrap();
    }
    Host::stream_synchronize(stream.handle()).unwrap();
    let seen = seen.lock().unwrap();
    assert!(seen.iter().map(|(i, _)| *i).eq(0..1000));
    assert!(seen.iter().all(|(_, thread)| *thread == seen[0].1));
    assert_ne!(seen[0].1, std::thread::current().id());
}

#[test]
fn synchronize_waits_for_work_queued_before_it_only() {
    let stream = HostStream::new().unwrap();
    let progress = Progress::default();
    progress.step_on(&stream);
    Host::stream_synchronize(stream.handle()).unwrap();
    assert_eq!(progress.get(), 1);
}

#[test]
fn a_panic_faults_the_stream_for_good() {
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    stream.launch(|| panic!("out of bounds")).unwrap();
    let progress = Progress::default();
    progress.step_on(&stream); // queued behind the panic: never runs
    gate.open();
    let err = Host::stream_synchronize(stream.handle()).unwrap_err();
    assert!(
        matches!(
            err,
            ServerError::Faulted {
                backend: "Host",
                ..
            }
        ),
        "{err}"
    );
    assert!(stream.is_faulted());
    assert_eq!(progress.get(), 0);

    // Sticky: every later call fails the same way.
    assert!(stream.launch(|| {}).unwrap_err().is_faulted());
    let event = Host::event_create(stream.handle(), EventFlags::FENCE).unwrap();
    assert!(Host::event_record(&event, stream.handle())
        .unwrap_err()
        .is_faulted());
    assert!(Host::stream_wait_event(stream.handle(), &event)
        .unwrap_err()
        .is_faulted());
    assert!(Host::stream_synchronize(stream.handle())
        .unwrap_err()
        .is_faulted());
}

#[test]
fn dropping_a_stream_finishes_its_queued_work() {
    let progress = Progress::default();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    for _ in 0..100 {
        progress.step_on(&stream);
    }
    let opener = std::thread::spawn(move || gate.open());
    drop(stream);
    assert_eq!(progress.get(), 100);
    opener.join().unwrap();
}

#[test]
fn a_handle_to_a_dropped_stream_is_an_error_not_a_panic() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    let event = Host::event_create(handle, EventFlags::FENCE).unwrap();
    drop(stream);
    let invalid = |err: ServerError| assert_eq!(err.code(), Some(400), "{err}");
    invalid(Host::stream_synchronize(handle).unwrap_err());
    invalid(Host::event_record(&event, handle).unwrap_err());
    invalid(Host::stream_wait_event(handle, &event).unwrap_err());
    invalid(Host::event_create(handle, EventFlags::FENCE).unwrap_err());
}

#[test]
fn a_stream_dropped_by_its_own_work_does_not_deadlock() {
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let holder = Arc::new(Mutex::new(None::<HostStream>));
    let (done, finished) = std::sync::mpsc::channel();
    let inner = holder.clone();
    stream
        .launch(move || {
            // The last owner of the stream is dropped on its own worker.
            let own = inner.lock().unwrap().take();
            assert!(own.is_some());
            drop(own);
            done.send(()).unwrap();
        })
        .unwrap();
    *holder.lock().unwrap() = Some(stream);
    drop(holder);
    gate.open();
    // A self-join would hang here.
    finished.recv().unwrap();
}
