//! `EventFence` on the host backend: host waits, device-side waits, ordering.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use common::{faultable_stream, Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{EventApi, EventFence};

#[test]
fn wait_sync_returns_after_all_earlier_work() {
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    for _ in 0..10 {
        progress.step_on(&stream);
    }
    let fence = EventFence::<Host>::new(stream.handle());
    assert!(!fence.is_complete().unwrap(), "the gate holds the stream");
    progress.step_on(&stream); // after the fence: not waited for
    gate.open();
    fence.wait_sync().unwrap();
    assert!(progress.get() >= 10);
    Host::stream_synchronize(stream.handle()).unwrap();
    assert_eq!(progress.get(), 11);
}

#[test]
fn wait_async_orders_another_streams_later_work_without_blocking_the_host() {
    let producer = HostStream::new().unwrap();
    let consumer = HostStream::new().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));

    let gate = Gate::hold(&producer);
    let entry = log.clone();
    producer
        .launch(move || entry.lock().unwrap().push("produced"))
        .unwrap();
    let producer_fence = EventFence::<Host>::new(producer.handle());
    let probe = EventFence::<Host>::new(producer.handle());

    // The producer is held by the gate, so a host wait here would never
    // return: returning at all proves the host did not block.
    EventFence::<Host>::new(producer.handle())
        .wait_async(consumer.handle())
        .unwrap();
    let entry = log.clone();
    consumer
        .launch(move || entry.lock().unwrap().push("consumed"))
        .unwrap();
    let consumer_fence = EventFence::<Host>::new(consumer.handle());

    assert!(!probe.is_complete().unwrap());
    assert!(
        !consumer_fence.is_complete().unwrap(),
        "the consumer waits on the device"
    );
    assert!(log.lock().unwrap().is_empty());

    gate.open();
    consumer_fence.wait_sync().unwrap();
    assert_eq!(*log.lock().unwrap(), ["produced", "consumed"]);
    producer_fence.wait_sync().unwrap();
}

#[test]
fn a_chain_of_device_waits_orders_many_streams() {
    let streams: Vec<HostStream> = (0..6).map(|_| HostStream::new().unwrap()).collect();
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = Gate::hold(&streams[0]);
    for (i, stream) in streams.iter().enumerate() {
        if i > 0 {
            EventFence::<Host>::new(streams[i - 1].handle())
                .wait_async(stream.handle())
                .unwrap();
        }
        let entry = log.clone();
        stream
            .launch(move || entry.lock().unwrap().push(i))
            .unwrap();
    }
    let last = EventFence::<Host>::new(streams[5].handle());
    assert!(!last.is_complete().unwrap());
    gate.open();
    last.wait_sync().unwrap();
    assert_eq!(*log.lock().unwrap(), [0, 1, 2, 3, 4, 5]);
}

#[test]
fn a_fence_on_an_idle_stream_is_complete_once_the_worker_passes_it() {
    let stream = HostStream::new().unwrap();
    let fence = EventFence::<Host>::new(stream.handle());
    assert!(!fence.is_resolved_at_creation());
    let again = EventFence::<Host>::new(stream.handle());
    again.wait_sync().unwrap();
    assert!(
        fence.is_complete().unwrap(),
        "an earlier fence passes first"
    );
}

#[test]
fn fences_are_send_and_debug_prints_the_backend() {
    fn assert_send<T: Send + 'static>(_: &T) {}
    let stream = HostStream::new().unwrap();
    let fence = EventFence::<Host>::new(stream.handle());
    assert_send(&fence);
    assert_eq!(format!("{fence:?}"), "HostFence");
    std::thread::spawn(move || fence.wait_sync())
        .join()
        .unwrap()
        .unwrap();
}

#[test]
fn sequence_numbers_grow_in_record_order_and_name_the_stream() {
    let stream = HostStream::new().unwrap();
    let first = EventFence::<Host>::new(stream.handle());
    let second = EventFence::<Host>::new(stream.handle());
    assert!(second.sequence() > first.sequence());
    assert_eq!(first.stream(), stream.handle());
}

#[test]
fn a_faulted_stream_fails_pending_and_later_fences() {
    let stream = faultable_stream();
    let gate = Gate::hold(&stream);
    stream.launch(|| panic!("illegal address")).unwrap();
    let pending = EventFence::<Host>::new(stream.handle());
    gate.open();
    let err = pending.wait_sync().unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert!(err.to_string().contains("illegal address"), "{err}");
    assert_eq!(err.code(), Some(device_events::status::LAUNCH_FAILED));

    // Later fences: the record is refused, the synchronize fallback fails too,
    // so the fence holds the fault.
    let later = EventFence::<Host>::new(stream.handle());
    assert!(later.wait_sync().unwrap_err().is_faulted());
    let consumer = HostStream::new().unwrap();
    let later = EventFence::<Host>::new(stream.handle());
    assert!(later
        .wait_async(consumer.handle())
        .unwrap_err()
        .is_faulted());
}

#[test]
fn a_stream_waiting_on_a_faulted_stream_faults_too() {
    // Each on a context of its own: the consumer faults by waiting.
    let producer = faultable_stream();
    let consumer = faultable_stream();
    let gate = Gate::hold(&producer);
    producer.launch(|| panic!("bad kernel")).unwrap();
    EventFence::<Host>::new(producer.handle())
        .wait_async(consumer.handle())
        .unwrap();
    let progress = Progress::default();
    progress.step_on(&consumer);
    let consumer_fence = EventFence::<Host>::new(consumer.handle());
    gate.open();
    let err = consumer_fence.wait_sync().unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert_eq!(
        progress.get(),
        0,
        "work behind a failed dependency never runs"
    );
}

#[test]
fn a_fence_outlives_its_stream() {
    let stream = HostStream::new().unwrap();
    let progress = Progress::default();
    progress.step_on(&stream);
    let fence = EventFence::<Host>::new(stream.handle());
    drop(stream); // finishes queued work
    fence.wait_sync().unwrap();
    assert_eq!(progress.get(), 1);
}

#[test]
fn a_fence_on_a_dropped_stream_holds_an_invalid_handle_error() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    drop(stream);
    let fence = EventFence::<Host>::new(handle);
    // Both failures are kept: the refused event, and the synchronize that
    // could not stand in for it.
    let first = fence.fallback_cause().expect("the first failure").clone();
    assert!(
        matches!(
            first,
            device_events::ServerError::Call {
                call: "event_create",
                code: device_events::status::INVALID_HANDLE,
                ..
            }
        ),
        "{first}"
    );
    let err = fence.wait_sync().unwrap_err();
    assert_eq!(
        err.code(),
        Some(device_events::status::INVALID_HANDLE),
        "{err}"
    );
    assert!(
        matches!(
            err,
            device_events::ServerError::Call {
                call: "stream_synchronize",
                ..
            }
        ),
        "{err}"
    );
    // The synchronize's error has the refusal as its source.
    let source = std::error::Error::source(&err).expect("the refusal is the source");
    assert_eq!(source.to_string(), first.to_string());
    let cause = err
        .error_source()
        .and_then(|source| source.downcast_ref::<device_events::ServerError>());
    assert_eq!(cause, Some(&first));
}

#[test]
fn a_recorded_fence_has_no_fallback_cause() {
    let stream = HostStream::new().unwrap();
    assert!(stream.fence().fallback_cause().is_none());
}

/// Fence events are pooled per stream: a steady loop of fences and waits
/// creates a few events while it warms up, then none, however many rounds.
#[test]
fn a_steady_loop_of_fences_creates_no_events_after_warm_up() {
    let stream = HostStream::new().unwrap();
    let live = stream.live_events();
    let waiter = device_events::Waiter::builder().build();
    for round in 0..500 {
        stream.launch(|| {}).unwrap();
        let fence = stream.fence();
        match round % 3 {
            0 => fence.wait_sync().unwrap(),
            1 => futures::executor::block_on(waiter.wait(fence)).unwrap(),
            _ => futures::executor::block_on(fence.wait()).unwrap(),
        }
    }
    // At most one event in use by this loop, one being given back by a
    // waiter thread, and one the global waiter may still hold.
    assert!(live.created() <= 3, "created {} events", live.created());
    // Waiter threads give the last events back after waking their tasks.
    common::eventually(
        std::time::Duration::from_secs(20),
        "every event back in the pool",
        || live.count() == 0,
    );
}

/// `LiveEvents::count` counts pooled events while they are in use, however
/// often they have been to the pool and back, and not while they are idle
/// there.
#[test]
fn live_events_count_pooled_events_in_use_and_not_idle_ones() {
    let stream = HostStream::new().unwrap();
    let live = stream.live_events();
    for round in 0..10 {
        let held: Vec<_> = (0..=round % 3).map(|_| stream.fence()).collect();
        assert_eq!(live.count(), held.len(), "round {round}: fences alive");
        drop(held);
        assert_eq!(live.count(), 0, "round {round}: all back in the pool");
    }
    assert!(live.created() <= 3, "created {} events", live.created());
}

/// `LiveEvents`' `Debug` shows each count under its own name.
#[test]
fn live_events_debug_shows_the_count_and_the_created() {
    let stream = HostStream::new().unwrap();
    let live = stream.live_events();
    stream.fence().wait_sync().unwrap(); // its event back in the pool
    assert_eq!(format!("{live:?}"), "LiveEvents { count: 0, created: 1 }");
}

/// The types and calls of a test backend that are the host backend's, all
/// but `event_destroy`.
macro_rules! host_calls {
    () => {
        type Stream = <Host as EventApi>::Stream;
        type Event = <Host as EventApi>::Event;

        fn event_create(
            stream: Self::Stream,
            flags: device_events::EventFlags,
        ) -> Result<Self::Event, device_events::ServerError> {
            Host::event_create(stream, flags)
        }
        fn event_record(
            event: &Self::Event,
            stream: Self::Stream,
        ) -> Result<(), device_events::ServerError> {
            Host::event_record(event, stream)
        }
        fn event_query(event: &Self::Event) -> Result<bool, device_events::ServerError> {
            Host::event_query(event)
        }
        fn event_synchronize(event: &Self::Event) -> Result<(), device_events::ServerError> {
            Host::event_synchronize(event)
        }
        fn stream_wait_event(
            stream: Self::Stream,
            event: &Self::Event,
        ) -> Result<(), device_events::ServerError> {
            Host::stream_wait_event(stream, event)
        }
        fn stream_synchronize(stream: Self::Stream) -> Result<(), device_events::ServerError> {
            Host::stream_synchronize(stream)
        }
        fn event_elapsed(
            start: &Self::Event,
            end: &Self::Event,
        ) -> Result<std::time::Duration, device_events::ServerError> {
            Host::event_elapsed(start, end)
        }
    };
}

/// A backend outside the crate that gives no `stream_sequence` of its own:
/// the host backend's calls, and the trait's defaults for the rest.
struct Plain;

impl EventApi for Plain {
    const BACKEND: &'static str = "Plain";
    host_calls!();
    fn event_destroy(event: Self::Event) -> Result<(), device_events::ServerError> {
        Host::event_destroy(event)
    }
}

/// Without a `stream_sequence` of the backend's own, fences still order by
/// record: the default takes a process-wide counter, so later fences have
/// larger sequences, on one stream and across streams.
#[test]
fn a_backend_without_stream_sequences_still_orders_its_fences() {
    let (a, b) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let first = EventFence::<Plain>::new(a.handle());
    let second = EventFence::<Plain>::new(b.handle());
    let third = EventFence::<Plain>::new(a.handle());
    assert!(first.sequence() < second.sequence(), "{first:?} {second:?}");
    assert!(second.sequence() < third.sequence());
    for fence in [first, second, third] {
        fence.wait_sync().unwrap();
    }
}

/// The trait's other defaults, as `Plain` gets them: fence events made with
/// `EventFlags::FENCE` (no timestamps: an elapsed time between two is
/// refused), and no progress word.
#[test]
fn a_backends_default_fence_events_keep_no_time_and_it_has_no_progress_word() {
    let stream = HostStream::new().unwrap();
    let [start, end] = [(); 2].map(|()| Plain::fence_event_acquire(stream.handle()).unwrap());
    for event in [&start, &end] {
        Plain::event_record(event, stream.handle()).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(
        Plain::event_elapsed(&start, &end).is_err(),
        "timed fence events"
    );
    for event in [start, end] {
        Plain::fence_event_release(event).unwrap();
    }
    assert!(Plain::stream_progress(stream.handle()).is_none());
}

/// A backend with fence-event hooks of its own (acquire, release, the
/// sequenced record) and the trait's default `fence_event_record`, as a
/// backend outside the crate that pools its events has. Only the test below
/// uses it, so its counters are that test's alone.
struct Hooked;

static HOOKED_CALLS: Mutex<[usize; 3]> = Mutex::new([0; 3]);
static HOOKED_REFUSES: AtomicBool = AtomicBool::new(false);
/// Set in every number `Hooked::event_record_sequenced` gives.
const HOOKED_MARK: u64 = 1 << 48;
const ACQUIRED: usize = 0;
const RELEASED: usize = 1;
const DESTROYED: usize = 2;

fn hooked_call(which: usize) {
    HOOKED_CALLS.lock().unwrap()[which] += 1;
}

impl EventApi for Hooked {
    const BACKEND: &'static str = "Hooked";
    host_calls!();
    fn event_destroy(event: Self::Event) -> Result<(), device_events::ServerError> {
        hooked_call(DESTROYED);
        Host::event_destroy(event)
    }
    fn fence_event_acquire(
        stream: Self::Stream,
    ) -> Result<Self::Event, device_events::ServerError> {
        hooked_call(ACQUIRED);
        Host::fence_event_acquire(stream)
    }
    fn fence_event_release(event: Self::Event) -> Result<(), device_events::ServerError> {
        hooked_call(RELEASED);
        Host::fence_event_release(event)
    }
    fn event_record_sequenced(
        event: &Self::Event,
        stream: Self::Stream,
    ) -> Result<u64, device_events::ServerError> {
        if HOOKED_REFUSES.load(Ordering::SeqCst) {
            return Err(device_events::ServerError::InvalidArgument {
                what: "Hooked record",
                reason: "refused by the test".into(),
            });
        }
        Host::event_record_sequenced(event, stream).map(|sequence| sequence | HOOKED_MARK)
    }
}

/// The default `fence_event_record` goes through the backend's own hooks:
/// its acquire, its sequenced record, and its release for an event whose
/// record was refused (never a bare destroy).
#[test]
fn the_default_fence_record_uses_the_backends_own_hooks() {
    let stream = HostStream::new().unwrap();
    let fence = EventFence::<Hooked>::new(stream.handle());
    assert!(fence.sequence() & HOOKED_MARK != 0, "{fence:?}");
    fence.wait_sync().unwrap();
    assert_eq!(
        *HOOKED_CALLS.lock().unwrap(),
        [1, 1, 0],
        "acquired, released, destroyed"
    );
    HOOKED_REFUSES.store(true, Ordering::SeqCst);
    let refused = EventFence::<Hooked>::new(stream.handle());
    HOOKED_REFUSES.store(false, Ordering::SeqCst);
    refused.wait_sync().unwrap(); // synchronized instead
    assert_eq!(
        *HOOKED_CALLS.lock().unwrap(),
        [2, 2, 0],
        "acquired, released, destroyed"
    );
}

#[test]
fn one_fence_makes_two_streams_wait_and_is_then_awaited_with_one_event() {
    let producer = HostStream::new().unwrap();
    let first = HostStream::new().unwrap();
    let second = HostStream::new().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let gate = Gate::hold(&producer);
    let entry = log.clone();
    producer
        .launch(move || entry.lock().unwrap().push("produced"))
        .unwrap();
    let fence = producer.fence();
    // Both waits take the fence's state at the call; the fence stays.
    fence.wait_async(first.handle()).unwrap();
    fence.wait_async(second.handle()).unwrap();
    for (stream, name) in [(&first, "first"), (&second, "second")] {
        let entry = log.clone();
        stream
            .launch(move || entry.lock().unwrap().push(name))
            .unwrap();
    }
    let behind = [first.fence(), second.fence()];
    assert!(!fence.is_complete().unwrap(), "the gate holds the producer");
    assert!(behind.iter().all(|f| !f.is_complete().unwrap()));
    gate.open();
    futures::executor::block_on(fence.wait()).unwrap();
    for fence in behind {
        fence.wait_sync().unwrap();
    }
    let log = log.lock().unwrap();
    assert_eq!(log[0], "produced", "both streams ran after the producer");
    assert_eq!(log.len(), 3);
    assert_eq!(
        producer.live_events().created(),
        1,
        "one event served the two waits and the await"
    );
}

#[test]
fn a_fault_before_a_fence_reaches_the_stream_made_to_wait_on_it() {
    // Two contexts, so only the wait can carry the fault across.
    let faulting = faultable_stream();
    let waiting = faultable_stream();
    let gate = Gate::hold(&faulting);
    faulting
        .launch(|| panic!("a fault in the first stage"))
        .unwrap();
    let stage_one = faulting.fence();
    stage_one.wait_async(waiting.handle()).unwrap();
    let ran = Arc::new(Mutex::new(false));
    let flag = ran.clone();
    waiting
        .launch(move || *flag.lock().unwrap() = true)
        .unwrap();
    let stage_two = waiting.fence();
    gate.open();
    assert!(stage_one.wait_sync().unwrap_err().is_faulted());
    let err = stage_two.wait_sync().unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert!(
        err.to_string().contains("waited on"),
        "the error names the wait it came through: {err}"
    );
    assert!(!*ran.lock().unwrap(), "the second stage's work never ran");
    assert!(waiting.is_faulted());
}

/// A waiter moves each fence it is handed into an allocation of its own, beside two counts
/// (16 bytes). Within glibc's fast bins (requests of at most 120 bytes), the thread that ends
/// the wait frees it cheaply: at 136 bytes (an unboxed error in the fence), 100,000 fences
/// resolved in one burst took about 10% longer (the bench's scenario 2b).
#[test]
fn a_host_fence_fits_a_small_allocation() {
    let size = std::mem::size_of::<EventFence<Host>>();
    assert!(size + 16 <= 120, "EventFence<Host> is {size} bytes");
}
