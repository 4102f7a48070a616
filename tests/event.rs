//! `Event` on the host backend: three-outcome queries, records, timing, and
//! no leak on any path.

mod common;

use std::time::Duration;

use common::{eventually, faultable_stream, Gate, Progress};
use device_events::host::{Host, HostContext, HostStream};
use device_events::{status, Event, EventFlags};

#[test]
fn an_event_never_recorded_is_complete() {
    let stream = HostStream::new().unwrap();
    let _gate = Gate::hold(&stream);
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    assert!(event.is_complete().unwrap());
    event.wait_sync().unwrap();
}

#[test]
fn query_has_three_outcomes() {
    let stream = faultable_stream();
    let gate = Gate::hold(&stream);
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    event.record(stream.handle()).unwrap();
    assert!(!event.is_complete().unwrap(), "not yet");
    gate.open();
    event.wait_sync().unwrap();
    assert!(event.is_complete().unwrap(), "reached");

    let gate = Gate::hold(&stream);
    stream.launch(|| panic!("fault")).unwrap();
    event.record(stream.handle()).unwrap();
    gate.open();
    assert!(event.wait_sync().unwrap_err().is_faulted());
    assert!(
        event.is_complete().unwrap_err().is_faulted(),
        "an error, not `false`"
    );
}

#[test]
fn a_record_replaces_the_previous_one() {
    let stream = HostStream::new().unwrap();
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    event.record(stream.handle()).unwrap();
    event.wait_sync().unwrap();
    let gate = Gate::hold(&stream);
    event.record(stream.handle()).unwrap();
    assert!(!event.is_complete().unwrap(), "refers to the newest record");
    gate.open();
    event.wait_sync().unwrap();
}

#[test]
fn a_device_wait_captures_the_record_at_call_time() {
    let producer = HostStream::new().unwrap();
    let consumer = HostStream::new().unwrap();
    let event = Event::<Host>::new(producer.handle(), EventFlags::FENCE).unwrap();
    event.record(producer.handle()).unwrap();
    event.wait_async(consumer.handle()).unwrap();
    // Re-recorded behind a gate after the wait was queued: the consumer must
    // not wait for the new record.
    let gate = Gate::hold(&producer);
    event.record(producer.handle()).unwrap();
    let progress = Progress::default();
    progress.step_on(&consumer);
    let after = Event::<Host>::new(consumer.handle(), EventFlags::FENCE).unwrap();
    after.record(consumer.handle()).unwrap();
    after.wait_sync().unwrap();
    assert_eq!(progress.get(), 1);
    gate.open();
}

/// The other direction: a later record, reached first (on an idle stream),
/// must not release a wait on the earlier one (`cuEventRecord`: waits "use
/// the most recently captured state at the time of the API call, and are
/// not affected by later calls").
#[test]
fn a_device_wait_is_not_released_by_a_later_record_reached_first() {
    // One context: the event is recorded on two of its streams.
    let context = HostContext::new();
    let (busy, idle) = (context.new_stream().unwrap(), context.new_stream().unwrap());
    let consumer = HostStream::new().unwrap();
    let event = Event::<Host>::new(busy.handle(), EventFlags::FENCE).unwrap();
    let gate = Gate::hold(&busy);
    let produced = Progress::default();
    produced.step_on(&busy);
    event.record(busy.handle()).unwrap();
    event.wait_async(consumer.handle()).unwrap();
    event.record(idle.handle()).unwrap(); // reached at once
    assert!(
        event.is_complete().unwrap(),
        "a query sees the latest record"
    );
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (seen_by_work, produced_by_work) = (seen.clone(), produced.clone());
    consumer
        .launch(move || *seen_by_work.lock().unwrap() = Some(produced_by_work.get()))
        .unwrap();
    // Give a wrongly released consumer the time to run before the producer
    // does (a correct one cannot run until the gate opens).
    let deadline = std::time::Instant::now() + Duration::from_millis(200);
    while seen.lock().unwrap().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    gate.open();
    consumer.synchronize().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        Some(1),
        "the consumer ran before the work its wait was for"
    );
}

#[test]
fn elapsed_measures_the_work_between_two_timing_events() {
    let stream = HostStream::new().unwrap();
    let start = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    let end = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    start.record(stream.handle()).unwrap();
    stream
        .launch(|| std::thread::sleep(Duration::from_millis(30)))
        .unwrap();
    end.record(stream.handle()).unwrap();
    end.wait_sync().unwrap();
    let elapsed = end.elapsed_since(&start).unwrap();
    assert!(elapsed >= Duration::from_millis(30), "{elapsed:?}");
}

#[test]
fn elapsed_refuses_events_without_timing_or_not_reached() {
    let stream = HostStream::new().unwrap();
    let start = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    let end = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    start.record(stream.handle()).unwrap();
    end.record(stream.handle()).unwrap();
    end.wait_sync().unwrap();
    assert_eq!(
        end.elapsed_since(&start).unwrap_err().code(),
        Some(device_events::status::INVALID_HANDLE)
    );

    let start = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    start.record(stream.handle()).unwrap();
    let gate = Gate::hold(&stream);
    let end = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    end.record(stream.handle()).unwrap();
    assert_eq!(
        end.elapsed_since(&start).unwrap_err().code(),
        Some(device_events::status::NOT_READY)
    );
    gate.open();
}

/// The time is its latest record's: a record behind one already reached is
/// not reached, whether or not an earlier record of it has just passed.
#[test]
fn elapsed_is_not_ready_until_the_latest_record_is_reached() {
    let stream = HostStream::new().unwrap();
    let start = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    let end = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    start.record(stream.handle()).unwrap();
    end.record(stream.handle()).unwrap();
    end.wait_sync().unwrap();
    end.elapsed_since(&start).unwrap();
    let not_ready = || {
        let err = end.elapsed_since(&start).unwrap_err();
        assert_eq!(err.code(), Some(status::NOT_READY), "{err}");
    };
    // Recorded again behind a gate: the reached record no longer counts.
    let first = Gate::hold(&stream);
    end.record(stream.handle()).unwrap();
    not_ready();
    // Recorded twice behind it: the first passes, the second is held.
    let (passed, passed_here) = std::sync::mpsc::channel();
    stream.launch(move || passed.send(()).unwrap()).unwrap();
    let second = Gate::hold(&stream);
    end.record(stream.handle()).unwrap();
    first.open();
    passed_here.recv().unwrap();
    not_ready();
    second.open();
    end.wait_sync().unwrap();
    end.elapsed_since(&start).unwrap();
}

#[test]
fn elapsed_is_refused_for_a_start_never_recorded_and_after_a_fault() {
    let stream = faultable_stream();
    let start = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    let end = Event::<Host>::new(stream.handle(), EventFlags::TIMING).unwrap();
    end.record(stream.handle()).unwrap();
    end.wait_sync().unwrap();
    let err = end.elapsed_since(&start).unwrap_err();
    assert_eq!(err.code(), Some(status::INVALID_HANDLE), "{err}");
    // Both reached, then the context faults: sticky, as every later call.
    start.record(stream.handle()).unwrap();
    end.record(stream.handle()).unwrap();
    end.wait_sync().unwrap();
    end.elapsed_since(&start).unwrap();
    stream.launch(|| panic!("out of bounds")).unwrap();
    assert!(stream.synchronize().unwrap_err().is_faulted());
    let err = end.elapsed_since(&start).unwrap_err();
    assert!(err.is_faulted(), "{err}");
}

#[test]
fn events_are_released_on_every_path() {
    // Counted on this test's own stream: other tests' events do not count.
    let stream = faultable_stream();
    let live = stream.live_events();
    // Dropped unrecorded.
    drop(Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap());
    assert_eq!(live.count(), 0, "dropped unrecorded");
    // Dropped after a successful wait.
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    event.record(stream.handle()).unwrap();
    event.wait_sync().unwrap();
    drop(event);
    stream.synchronize().unwrap(); // the marker's reference is gone too
    assert_eq!(live.count(), 0, "dropped after a wait");
    // Dropped while its record is pending: released once passed.
    let gate = Gate::hold(&stream);
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    event.record(stream.handle()).unwrap();
    drop(event);
    assert_eq!(live.count(), 1, "the queued marker keeps it");
    gate.open();
    stream.synchronize().unwrap();
    assert_eq!(live.count(), 0, "released once its marker passed");
    // Dropped after a failed wait.
    let gate = Gate::hold(&stream);
    stream.launch(|| panic!("fault")).unwrap();
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    event.record(stream.handle()).unwrap();
    gate.open();
    assert!(event.wait_sync().is_err());
    drop(event);
    // The fault drops the marker's reference just after it fails the wait.
    eventually(
        Duration::from_secs(20),
        "dropped after a failed wait",
        || live.count() == 0,
    );
}

#[test]
fn debug_names_the_backend() {
    let stream = HostStream::new().unwrap();
    let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE).unwrap();
    assert_eq!(format!("{event:?}"), "HostEvent");
}
