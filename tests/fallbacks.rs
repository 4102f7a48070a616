//! Every fallback of `EventFence`, reached through the fault-injecting backend.

mod common;

use std::time::Duration;

use common::faulty::{self, inject, Faulty, Plan};
use common::{eventually, faultable_stream, logs, Gate, Progress};
use device_events::host::HostStream;
use device_events::{EventFence, ServerError};

/// A stream with one step of work held behind a gate, so a fallback that
/// synchronizes is seen to wait for it.
fn busy_stream() -> (HostStream, Gate, Progress) {
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    progress.step_on(&stream);
    (stream, gate, progress)
}

/// Open `gate` from another thread once `blocked` holds: once the test
/// thread is inside the synchronize that the fallback makes. So the held work
/// can only have run if the fallback waited for it.
fn open_when(
    gate: Gate,
    what: &'static str,
    blocked: impl FnMut() -> bool + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        eventually(Duration::from_secs(20), what, blocked);
        gate.open();
    })
}

#[test]
fn a_refused_create_synchronizes_the_stream_and_warns() {
    logs::capture();
    let (stream, gate, progress) = busy_stream();
    inject(
        stream.handle(),
        Plan {
            label: "refuse-create",
            refuse_create: true,
            ..Plan::default()
        },
    );
    let handle = stream.handle();
    let opener = open_when(gate, "new() synchronizes the stream", move || {
        faulty::stream_synchronizing(handle) == 1
    });
    let fence = EventFence::<Faulty>::new(stream.handle());
    // The fallback synchronized: the held work is done before `new` returned.
    assert_eq!(progress.get(), 1);
    assert!(fence.is_resolved_at_creation());
    assert!(fence.is_complete().unwrap());
    fence.wait_sync().unwrap();
    opener.join().unwrap();
    let warnings = logs::warnings_containing("refuse-create");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("synchronizing its stream instead"));
}

#[test]
fn a_refused_record_synchronizes_the_stream_and_warns() {
    logs::capture();
    let (stream, gate, progress) = busy_stream();
    inject(
        stream.handle(),
        Plan {
            label: "refuse-record",
            refuse_record: true,
            ..Plan::default()
        },
    );
    let handle = stream.handle();
    let opener = open_when(gate, "new() synchronizes the stream", move || {
        faulty::stream_synchronizing(handle) == 1
    });
    let fence = EventFence::<Faulty>::new(stream.handle());
    assert_eq!(progress.get(), 1);
    assert!(fence.is_resolved_at_creation());
    fence.wait_sync().unwrap();
    opener.join().unwrap();
    assert_eq!(logs::warnings_containing("refuse-record").len(), 1);
}

#[test]
fn a_fence_holds_the_error_when_the_synchronize_fails_too() {
    logs::capture();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "refuse-all",
            refuse_create: true,
            refuse_stream_synchronize: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    assert!(fence.is_resolved_at_creation());
    let held = fence.is_complete().unwrap_err();
    assert!(
        matches!(
            held,
            ServerError::Call {
                call: "stream_synchronize",
                ..
            }
        ),
        "{held}"
    );
    let first = fence.fallback_cause().expect("the refusal is kept").clone();
    assert!(
        matches!(
            first,
            ServerError::Call {
                call: "event_create",
                ..
            }
        ),
        "{first}"
    );
    assert_eq!(fence.wait_sync().unwrap_err(), held);

    let fence = EventFence::<Faulty>::new(stream.handle());
    let other = HostStream::new().unwrap();
    assert_eq!(fence.wait_async(other.handle()).unwrap_err(), held);
    assert_eq!(logs::warnings_containing("refuse-all").len(), 2);
}

#[test]
fn a_failed_synchronize_keeps_the_source_its_backend_gave_it() {
    logs::capture();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "own-sync-source",
            refuse_create: true,
            refuse_stream_synchronize: true,
            stream_synchronize_source: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    let held = fence.is_complete().unwrap_err();
    let source = held.error_source().expect("the backend's source");
    assert_eq!(source.to_string(), "the backend's own cause");
    // The refusal that led to it is still the fence's fallback cause.
    assert!(matches!(
        fence.fallback_cause(),
        Some(ServerError::Call {
            call: "event_create",
            ..
        })
    ));
}

#[test]
fn a_refused_device_wait_waits_on_the_host_and_warns() {
    logs::capture();
    let (producer, gate, progress) = busy_stream();
    let consumer = HostStream::new().unwrap();
    inject(
        consumer.handle(),
        Plan {
            label: "refuse-stream-wait",
            refuse_stream_wait: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(producer.handle());
    assert!(!fence.is_resolved_at_creation());
    let handle = producer.handle();
    let opener = open_when(gate, "the host waits on the fence", move || {
        faulty::synchronizing(handle) == 1
    });
    fence.wait_async(consumer.handle()).unwrap();
    // The host waited for the producer's work instead.
    assert_eq!(progress.get(), 1);
    opener.join().unwrap();
    let warnings = logs::warnings_containing("refuse-stream-wait");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("waiting on the host"));
}

#[test]
fn a_fence_resolved_at_creation_needs_no_device_wait() {
    logs::capture();
    let stream = HostStream::new().unwrap();
    let consumer = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "resolved-then-wait-producer",
            refuse_create: true,
            ..Plan::default()
        },
    );
    inject(
        consumer.handle(),
        Plan {
            label: "resolved-then-wait-consumer",
            refuse_stream_wait: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    fence.wait_async(consumer.handle()).unwrap();
    // No device wait was attempted, so the consumer's refusal never warned.
    assert!(logs::warnings_containing("resolved-then-wait-consumer").is_empty());
}

#[test]
fn a_refused_device_wait_reports_the_fenced_streams_fault() {
    logs::capture();
    let producer = faultable_stream();
    let consumer = HostStream::new().unwrap();
    inject(
        consumer.handle(),
        Plan {
            label: "refuse-wait-faulted",
            refuse_stream_wait: true,
            ..Plan::default()
        },
    );
    let gate = Gate::hold(&producer);
    producer.launch(|| panic!("device fault")).unwrap();
    let fence = EventFence::<Faulty>::new(producer.handle());
    gate.open();
    let err = fence.wait_async(consumer.handle()).unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert_eq!(logs::warnings_containing("refuse-wait-faulted").len(), 1);
}

#[test]
fn debug_names_the_backend() {
    let stream = HostStream::new().unwrap();
    let fence = EventFence::<Faulty>::new(stream.handle());
    assert_eq!(format!("{fence:?}"), "FaultyFence");
}

/// A dropped target stream is the caller's bug, not a driver's refusal: the
/// error comes back at once and the host never waits for the fence.
#[test]
fn wait_async_onto_a_dropped_stream_is_an_error_without_a_host_wait() {
    let (producer, gate, progress) = busy_stream();
    let gone = HostStream::new().unwrap();
    let gone_handle = gone.handle();
    drop(gone);
    let fence = EventFence::<Faulty>::new(producer.handle());
    let waiting = std::thread::spawn(move || fence.wait_async(gone_handle));
    eventually(Duration::from_secs(20), "wait_async returns", || {
        waiting.is_finished()
    });
    let err = waiting.join().unwrap().unwrap_err();
    assert_eq!(
        err.code(),
        Some(device_events::status::INVALID_HANDLE),
        "{err}"
    );
    assert_eq!(progress.get(), 0, "the host did not wait for the producer");
    gate.open();
}

/// A faulted stream stays faulted: the first fence on it warns, later ones
/// do not repeat the warning (they log at debug level), and every one still
/// holds the fault.
#[test]
fn fences_on_a_faulted_stream_warn_once() {
    logs::capture();
    let stream = faultable_stream();
    stream.launch(|| panic!("warn-once-fault")).unwrap();
    let _ = stream.synchronize();
    for _ in 0..5 {
        let fence = EventFence::<Faulty>::new(stream.handle());
        assert!(fence.wait_sync().unwrap_err().is_faulted());
    }
    let warnings = logs::warnings_containing("warn-once-fault");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
}

/// A faulted stream refuses every device-side wait the same way: the first
/// `wait_async` onto it warns, later ones do not repeat the warning (they log
/// at debug level) whichever stream their fence is on, and every one still
/// waits on the host.
#[test]
fn device_waits_refused_by_a_faulted_stream_warn_once() {
    logs::capture();
    let producers = [HostStream::new().unwrap(), HostStream::new().unwrap()];
    let consumer = faultable_stream();
    consumer
        .launch(|| panic!("faulted-consumer-panic"))
        .unwrap();
    let _ = consumer.synchronize();
    for round in 0..5 {
        let fence = EventFence::<Faulty>::new(producers[round % 2].handle());
        let refused = fence.try_wait_async(consumer.handle()).unwrap_err();
        assert!(refused.is_faulted(), "{refused}");
        fence.wait_async(consumer.handle()).unwrap();
    }
    let host_waits = producers
        .each_ref()
        .map(|p| faulty::synchronizes(p.handle()));
    assert_eq!(host_waits, [3, 2], "host waits");
    let warnings = logs::warnings_containing("faulted-consumer-panic");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("waiting on the host"), "{warnings:?}");
    let repeats = logs::debugs_containing("faulted-consumer-panic");
    assert_eq!(repeats.len(), 4, "{repeats:?}");
}

/// `try_new` hands a refused create or record back: no synchronize stands
/// in, and nothing is logged; `new` on the same stream still falls back.
#[test]
fn try_new_returns_the_refusal_without_synchronizing() {
    logs::capture();
    for (label, refused) in [
        ("try-new-no-event", "event_create"),
        ("try-new-no-record", "event_record"),
    ] {
        let stream = HostStream::new().unwrap();
        inject(
            stream.handle(),
            Plan {
                label,
                refuse_create: refused == "event_create",
                refuse_record: refused == "event_record",
                ..Plan::default()
            },
        );
        let err = EventFence::<Faulty>::try_new(stream.handle()).unwrap_err();
        assert!(
            matches!(err, ServerError::Call { call, .. } if call == refused),
            "{err}"
        );
        assert_eq!(faulty::stream_synchronizes(stream.handle()), 0);
        assert!(logs::warnings_containing(label).is_empty());

        let fence = EventFence::<Faulty>::new(stream.handle());
        assert!(fence.is_resolved_at_creation());
        assert_eq!(faulty::stream_synchronizes(stream.handle()), 1);
    }
}

/// `try_wait_async` hands a refused device-side wait back: the host does
/// not wait for the fence (its stream is held, so a host wait would not
/// return), and nothing is logged.
#[test]
fn try_wait_async_returns_the_refusal_without_a_host_wait() {
    logs::capture();
    let (producer, gate, progress) = busy_stream();
    let consumer = HostStream::new().unwrap();
    inject(
        consumer.handle(),
        Plan {
            label: "try-wait-no-dependency",
            refuse_stream_wait: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(producer.handle());
    let (sent, returned) = std::sync::mpsc::channel();
    let target = consumer.handle();
    std::thread::spawn(move || {
        let _ = sent.send((fence.try_wait_async(target), fence));
    });
    let (result, fence) = returned
        .recv_timeout(Duration::from_secs(20))
        .expect("try_wait_async returns while the fenced stream is held");
    let err = result.unwrap_err();
    assert!(
        matches!(
            err,
            ServerError::Call {
                call: "stream_wait_event",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(faulty::synchronizes(producer.handle()), 0, "no host wait");
    assert_eq!(progress.get(), 0);
    assert!(logs::warnings_containing("try-wait-no-dependency").is_empty());
    gate.open();
    fence.wait_sync().unwrap();
}

/// A record refused by a shut-down driver is not worked around: no
/// synchronize (which the driver would refuse too), and the fence holds the
/// shutdown.
#[test]
fn a_record_refused_at_shutdown_is_held_without_a_synchronize() {
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "shut-down-record",
            refuse_record: true,
            shut_down: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(stream.handle());
    assert_eq!(faulty::stream_synchronizes(stream.handle()), 0);
    assert!(fence.fallback_cause().is_none());
    let err = fence.wait_sync().unwrap_err();
    assert!(err.is_shut_down(), "{err}");
}

/// A device-side wait refused by a shut-down driver comes back at once: no
/// host wait.
#[test]
fn a_device_wait_refused_at_shutdown_returns_without_a_host_wait() {
    let producer = HostStream::new().unwrap();
    let consumer = HostStream::new().unwrap();
    inject(
        consumer.handle(),
        Plan {
            label: "shut-down-stream-wait",
            refuse_stream_wait: true,
            shut_down: true,
            ..Plan::default()
        },
    );
    let fence = EventFence::<Faulty>::new(producer.handle());
    let err = fence.wait_async(consumer.handle()).unwrap_err();
    assert!(err.is_shut_down(), "{err}");
    assert_eq!(faulty::synchronizes(producer.handle()), 0, "no host wait");
}
