//! `HostStream` and `HostContext`: in-order work, faults of a whole context
//! (and of a stream made with `HostStream::new` alone), drop, and dangling
//! handles, each as CUDA has them.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::faulty::{self, Faulty};
use common::{eventually, faultable_stream, Gate, Progress};
use device_events::host::{Host, HostContext, HostStream};
use device_events::{status, EventApi, EventFence, EventFlags, ServerError};

const LIMIT: Duration = Duration::from_secs(20);

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

    // Work queued while a synchronize waits is not waited for. The count
    // says the thread is in the call, maybe not yet past its start (then it
    // rightly waits for the later work too): a few tries, each bounded.
    let synchronized_alone = (0..5).any(|_| {
        let before = Gate::hold(&stream);
        let (waiting, returned) = synchronizing(&stream);
        let after = Gate::hold(&stream);
        before.open();
        let result = returned.recv_timeout(Duration::from_secs(2));
        after.open();
        waiting.join().unwrap();
        stream.synchronize().unwrap();
        result.is_ok_and(|result| result.is_ok())
    });
    assert!(synchronized_alone, "a synchronize waited for later work");
}

/// A thread in `stream`'s synchronize (through the counting backend, so the
/// test knows it is in the call), and where its result comes.
fn synchronizing(
    stream: &HostStream,
) -> (
    std::thread::JoinHandle<()>,
    std::sync::mpsc::Receiver<Result<(), ServerError>>,
) {
    let (done, returned) = std::sync::mpsc::channel();
    let handle = stream.handle();
    let thread = std::thread::spawn(move || {
        // The test may have stopped listening: it failed already.
        let _ = done.send(Faulty::stream_synchronize(handle));
    });
    eventually(LIMIT, "the thread is in the synchronize", || {
        faulty::stream_synchronizing(handle) == 1
    });
    (thread, returned)
}

/// A synchronize blocked on a stream whose context faults returns the fault
/// at once: it does not wait for the stream's current work to end.
#[test]
fn a_fault_wakes_a_synchronize_blocked_on_a_sibling_stream() {
    let context = HostContext::new();
    let (faulting, sibling) = (context.new_stream().unwrap(), context.new_stream().unwrap());
    let held = Gate::hold(&sibling);
    let (waiting, returned) = synchronizing(&sibling);
    faulting.launch(|| panic!("out of bounds")).unwrap();
    let result = returned.recv_timeout(LIMIT);
    held.open();
    waiting.join().unwrap();
    let err = result.expect("the synchronize returned").unwrap_err();
    assert!(err.is_faulted(), "{err}");
}

/// A stream of another context waiting on a record that passed before the
/// fault carries on: only a record the fault lost faults it.
#[test]
fn a_wait_on_a_record_passed_before_a_fault_elsewhere_carries_on() {
    let (producer, consumer) = (faultable_stream(), faultable_stream());
    let event = Host::event_create(producer.handle(), EventFlags::FENCE).unwrap();
    Host::event_record(&event, producer.handle()).unwrap();
    Host::event_synchronize(&event).unwrap();
    let held = Gate::hold(&consumer);
    Host::stream_wait_event(consumer.handle(), &event).unwrap();
    producer.launch(|| panic!("out of bounds")).unwrap();
    assert!(producer.synchronize().unwrap_err().is_faulted());
    held.open(); // the wait runs now, after the fault
    consumer.synchronize().unwrap();
    assert!(!consumer.is_faulted());
}

/// A stream keeps up to 64 idle fence events: more are destroyed, and the
/// next fences take the kept ones first.
#[test]
fn a_stream_keeps_up_to_64_idle_fence_events() {
    let stream = HostStream::new().unwrap();
    let live = stream.live_events();
    for _ in 0..2 {
        let fences: Vec<_> = (0..100).map(|_| stream.fence()).collect();
        drop(fences);
    }
    assert_eq!(live.created(), 100 + 36);
}

#[test]
fn a_panic_faults_every_stream_of_its_context_for_good() {
    let context = HostContext::new();
    let (faulting, sibling) = (context.new_stream().unwrap(), context.new_stream().unwrap());
    let elsewhere = HostContext::new().new_stream().unwrap();
    let alone = HostStream::new().unwrap();
    let shown = format!("{context:?}");
    assert!(shown.contains("faulted: false"), "{shown}");
    let event = Host::event_create(sibling.handle(), EventFlags::FENCE).unwrap();
    let passed = Host::event_create(sibling.handle(), EventFlags::FENCE).unwrap();
    let never_recorded = Host::event_create(sibling.handle(), EventFlags::FENCE).unwrap();
    Host::event_record(&passed, sibling.handle()).unwrap();
    Host::event_synchronize(&passed).unwrap(); // passed before the fault
    let gate = Gate::hold(&faulting);
    let sibling_gate = Gate::hold(&sibling);
    Host::event_record(&event, sibling.handle()).unwrap(); // pending behind the gate
    let progress = Progress::default();
    progress.step_on(&sibling); // queued on the sibling: never runs
    faulting.launch(|| panic!("out of bounds")).unwrap();
    progress.step_on(&faulting); // queued behind the panic: never runs
    gate.open();
    let err = Host::stream_synchronize(faulting.handle()).unwrap_err();
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
    assert!(faulting.is_faulted() && sibling.is_faulted() && context.is_faulted());
    let shown = format!("{context:?}");
    assert!(shown.contains("faulted: true"), "{shown}");
    // The sibling's pending record failed, and its own calls fail; a record
    // passed before the fault reports it too (sticky).
    assert!(Host::event_synchronize(&event).unwrap_err().is_faulted());
    assert!(Host::event_query(&passed).unwrap_err().is_faulted());
    assert!(Host::event_synchronize(&passed).unwrap_err().is_faulted());
    sibling_gate.open();
    assert!(sibling.synchronize().unwrap_err().is_faulted());
    assert_eq!(progress.get(), 0);

    // Sticky, on every stream of the context: every later call fails the
    // same way, new events and new streams included.
    for stream in [&faulting, &sibling] {
        assert!(stream.launch(|| {}).unwrap_err().is_faulted());
        assert!(Host::event_create(stream.handle(), EventFlags::FENCE)
            .unwrap_err()
            .is_faulted());
        assert!(Host::event_record(&event, stream.handle())
            .unwrap_err()
            .is_faulted());
        for event in [&event, &never_recorded] {
            assert!(Host::stream_wait_event(stream.handle(), event)
                .unwrap_err()
                .is_faulted());
        }
        assert!(Host::stream_synchronize(stream.handle())
            .unwrap_err()
            .is_faulted());
    }
    assert!(context.new_stream().unwrap_err().is_faulted());

    // Other contexts carry on.
    for stream in [&elsewhere, &alone] {
        assert!(!stream.is_faulted());
        progress.step_on(stream);
        stream.synchronize().unwrap();
    }
    assert_eq!(progress.get(), 2);
}

/// A host stream is not a device the process shares: a panic in work on a
/// stream made with `HostStream::new` faults that stream, not the streams
/// made with `new` before it or after it.
#[test]
fn a_panic_on_a_stream_made_with_new_faults_that_stream_only() {
    let before = HostStream::new().unwrap();
    let faulting = HostStream::new().unwrap();
    faulting.launch(|| panic!("illegal address")).unwrap();
    assert!(faulting.synchronize().unwrap_err().is_faulted());
    assert!(faulting.is_faulted());
    assert!(faulting.launch(|| {}).unwrap_err().is_faulted());
    let after = HostStream::new().expect("a stream made after a fault elsewhere");
    for stream in [&before, &after] {
        assert!(!stream.is_faulted());
        let progress = Progress::default();
        progress.step_on(stream);
        stream.fence().wait_sync().unwrap();
        assert_eq!(progress.get(), 1);
        let event = Host::event_create(stream.handle(), EventFlags::FENCE).unwrap();
        Host::event_record(&event, stream.handle()).unwrap();
        Host::event_synchronize(&event).unwrap();
    }
}

#[test]
fn each_stream_made_with_new_has_a_context_of_its_own() {
    let (a, b) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    assert_ne!(a.context(), b.context());
    assert_ne!(a.context(), HostContext::primary());
    let own = HostContext::new();
    assert_eq!(own.new_stream().unwrap().context(), own);
    // The primary context is one context, for code that asks for it.
    let primary = HostContext::primary();
    assert_eq!(primary, HostContext::primary());
    assert_eq!(primary.new_stream().unwrap().context(), primary);
}

#[test]
fn an_event_is_recorded_on_its_own_contexts_streams_only_but_waited_on_from_any() {
    let (home, away) = (faultable_stream(), faultable_stream());
    let event = Host::event_create(home.handle(), EventFlags::FENCE).unwrap();
    let err = Host::event_record(&event, away.handle()).unwrap_err();
    assert_eq!(
        err.code(),
        Some(device_events::status::INVALID_HANDLE),
        "{err}"
    );
    let gate = Gate::hold(&home);
    let produced = Progress::default();
    produced.step_on(&home);
    Host::event_record(&event, home.handle()).unwrap();
    Host::stream_wait_event(away.handle(), &event).unwrap();
    let seen = Arc::new(Mutex::new(None));
    let (seen_by_work, produced_by_work) = (seen.clone(), produced.clone());
    away.launch(move || *seen_by_work.lock().unwrap() = Some(produced_by_work.get()))
        .unwrap();
    gate.open();
    away.synchronize().unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        Some(1),
        "the wait held the work back"
    );
}

/// `cuStreamDestroy` returns at once and queued work still runs: code that
/// frees what the work reads as soon as the stream is dropped is wrong on a
/// GPU, and must look wrong here too.
#[test]
fn dropping_a_stream_returns_at_once_and_its_queued_work_still_runs() {
    let progress = Progress::default();
    let stream = HostStream::new().unwrap();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let (finished, done) = std::sync::mpsc::channel::<bool>();
    stream
        .launch(move || {
            // Held until the test has dropped the stream: a drop that waited
            // for this work would time this out instead.
            let _ = finished.send(released.recv_timeout(Duration::from_secs(30)).is_ok());
        })
        .unwrap();
    for _ in 0..100 {
        progress.step_on(&stream);
    }
    let handle = stream.handle();
    drop(stream);
    release.send(()).unwrap();
    assert!(
        done.recv().unwrap(),
        "the drop waited for the stream's queued work"
    );
    eventually(Duration::from_secs(20), "the queued work ran", || {
        progress.get() == 100
    });
    assert_eq!(
        Host::stream_synchronize(handle).unwrap_err().code(),
        Some(device_events::status::INVALID_HANDLE)
    );
}

/// A dropped stream's worker thread exits once its queued work is done, an
/// idle one at once.
#[cfg(target_os = "linux")]
#[test]
fn a_dropped_streams_worker_exits_after_its_queued_work() {
    // The worker's own task: `/proc/<pid>/task/<tid>`, gone once it exits.
    let worker_task = |stream: &HostStream| {
        let (send, task) = std::sync::mpsc::channel();
        stream
            .launch(move || {
                // The link reads `<pid>/task/<tid>`, relative to `/proc`.
                let task = std::fs::read_link("/proc/thread-self").unwrap();
                send.send(std::path::Path::new("/proc").join(task)).unwrap();
            })
            .unwrap();
        task.recv().unwrap()
    };
    let idle = HostStream::new().unwrap();
    let busy = HostStream::new().unwrap();
    let tasks = [worker_task(&idle), worker_task(&busy)];
    assert!(tasks.iter().all(|task| task.exists()), "{tasks:?}");
    let gate = Gate::hold(&busy);
    let progress = Progress::default();
    progress.step_on(&busy);
    drop((idle, busy));
    eventually(LIMIT, "the idle stream's worker exits", || {
        !tasks[0].exists()
    });
    assert!(tasks[1].exists(), "the busy stream's worker runs its work");
    gate.open();
    eventually(LIMIT, "the busy stream's worker exits", || {
        !tasks[1].exists()
    });
    assert_eq!(progress.get(), 1);
}

/// A payload whose own drop panics.
struct PanickyPayload;

impl Drop for PanickyPayload {
    fn drop(&mut self) {
        panic!("the payload's drop panicked too");
    }
}

#[test]
fn a_panic_whose_payload_panics_when_dropped_still_faults_the_stream() {
    let stream = faultable_stream();
    let sibling = stream.context().new_stream().unwrap();
    stream
        .launch(|| std::panic::panic_any(PanickyPayload))
        .unwrap();
    let handle = stream.handle();
    let synchronized = std::thread::spawn(move || Host::stream_synchronize(handle));
    eventually(Duration::from_secs(20), "the synchronize returns", || {
        synchronized.is_finished()
    });
    assert!(synchronized.join().unwrap().unwrap_err().is_faulted());
    assert!(sibling.is_faulted());
}

#[test]
fn a_handle_to_a_dropped_stream_is_an_error_not_a_panic() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    let event = Host::event_create(handle, EventFlags::FENCE).unwrap();
    drop(stream);
    let invalid = |err: ServerError| {
        assert_eq!(
            err.code(),
            Some(device_events::status::INVALID_HANDLE),
            "{err}"
        )
    };
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

#[test]
fn a_dropped_streams_sequence_sorts_after_every_number_it_gave() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    let fences: Vec<_> = (0..3).map(|_| EventFence::<Host>::new(handle)).collect();
    let given: Vec<u64> = fences.iter().map(EventFence::sequence).collect();
    assert!(given.windows(2).all(|pair| pair[0] < pair[1]), "{given:?}");
    drop(stream);
    let after = Host::stream_sequence(handle);
    assert!(
        given.iter().all(|&sequence| sequence < after),
        "{given:?} then {after}"
    );
    assert_eq!(after, u64::MAX);
    for fence in fences {
        fence.wait_sync().unwrap();
    }
}

#[test]
fn live_streams_have_distinct_ids_and_a_handle_keeps_its_own() {
    let (first, second) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    assert_ne!(
        Host::stream_id(first.handle()),
        Host::stream_id(second.handle())
    );
    assert_eq!(
        Host::stream_id(first.handle()),
        Host::stream_id(first.handle())
    );
}

#[test]
fn a_streams_progress_word_passes_each_fence_as_the_worker_passes_it_in_order() {
    let stream = HostStream::new().unwrap();
    let word = Host::stream_progress(stream.handle()).expect("a live stream has a word");
    let idle = EventFence::<Host>::new(stream.handle());
    assert!(
        word.passed(idle.sequence()),
        "a record on an idle stream is passed at once"
    );
    let first_gate = Gate::hold(&stream);
    let first = EventFence::<Host>::new(stream.handle());
    let (started, second_started) = std::sync::mpsc::channel();
    stream
        .launch(move || started.send(()).unwrap())
        .expect("launch");
    let second_gate = Gate::hold(&stream);
    let second = EventFence::<Host>::new(stream.handle());
    assert!(!word.passed(first.sequence()) && !word.passed(second.sequence()));
    first_gate.open();
    // The work after the first marker runs only once the worker passed it.
    second_started.recv().unwrap();
    assert!(word.passed(first.sequence()));
    assert!(!word.passed(second.sequence()), "not past work still held");
    second_gate.open();
    Host::stream_synchronize(stream.handle()).unwrap();
    assert!(word.passed(second.sequence()));
    first.wait_sync().unwrap();
    second.wait_sync().unwrap();
}

#[test]
fn a_faulted_streams_word_stops_before_the_markers_the_fault_dropped() {
    let stream = HostStream::new().unwrap();
    let word = Host::stream_progress(stream.handle()).unwrap();
    let (open, opened) = std::sync::mpsc::channel::<()>();
    stream
        .launch(move || {
            let _ = opened.recv();
            panic!("the kernel faults");
        })
        .unwrap();
    let lost = EventFence::<Host>::new(stream.handle());
    open.send(()).unwrap();
    assert!(Host::stream_synchronize(stream.handle())
        .unwrap_err()
        .is_faulted());
    assert!(
        !word.passed(lost.sequence()),
        "a dropped marker is never passed"
    );
    assert!(lost.wait_sync().unwrap_err().is_faulted());
}

#[test]
fn a_dropped_stream_has_no_progress_word_and_a_word_held_outlives_it() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    let word = Host::stream_progress(handle).unwrap();
    let fence = EventFence::<Host>::new(handle);
    drop(stream);
    assert!(Host::stream_progress(handle).is_none());
    assert!(word.passed(fence.sequence()));
}

/// What `work`, launched on `stream` and handed `input` once it runs, returned; the test fails,
/// rather than hangs, if the work has not returned after 20 s.
fn from_work<I, T>(
    stream: &HostStream,
    work: impl FnOnce(I) -> T + Send + 'static,
) -> (std::sync::mpsc::Sender<I>, impl FnOnce() -> T)
where
    I: Send + 'static,
    T: Send + 'static,
{
    let (input, inputs) = std::sync::mpsc::channel::<I>();
    let (output, outputs) = std::sync::mpsc::channel();
    stream
        .launch(move || {
            if let Ok(input) = inputs.recv() {
                let _ = output.send(work(input));
            }
        })
        .unwrap();
    let result = move || {
        outputs
            .recv_timeout(Duration::from_secs(20))
            .expect("the work returned (a wait for its own stream's later work hangs)")
    };
    (input, result)
}

fn not_permitted(result: Result<(), ServerError>) {
    let err = result.expect_err("a wait for the stream's own later work");
    assert_eq!(err.code(), Some(status::NOT_PERMITTED), "{err}");
}

#[test]
fn work_that_waits_for_its_own_streams_later_work_is_refused_not_hung() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    let (input, result) = from_work(&stream, move |fences: [EventFence<Host>; 3]| {
        let [awaited, waited, asked] = fences;
        [
            Host::stream_synchronize(handle),
            futures::executor::block_on(awaited.wait()),
            waited.wait_sync(),
            asked.is_complete().map(drop),
        ]
    });
    // Recorded behind the work, which runs until it has them.
    input
        .send([stream.fence(), stream.fence(), stream.fence()])
        .unwrap();
    result().into_iter().for_each(not_permitted);
    // Refused, not faulted: the stream goes on.
    assert!(!stream.is_faulted());
    stream.fence().wait_sync().unwrap();
}

#[test]
fn work_may_wait_for_what_its_stream_ran_before_it_and_for_other_streams() {
    let context = HostContext::new();
    let (stream, other) = (context.new_stream().unwrap(), context.new_stream().unwrap());
    // Behind work, so a marker the stream passes before the work below.
    let gate = Gate::hold(&stream);
    let before = stream.fence();
    gate.open();
    let gate = Gate::hold(&other);
    let others = other.fence();
    // Recorded on this stream behind the work, then again on the other: a wait is for the latest.
    let event = Host::event_create(stream.handle(), EventFlags::FENCE).unwrap();
    let (input, result) = from_work(&stream, move |(event, other, gate): (_, _, Gate)| {
        // Asked while the other stream is held: not reached, and no error.
        let asked = (Host::event_query(&event), others.is_complete());
        gate.open();
        let waited = [
            before.wait_sync(),
            others.wait_sync(),
            Host::stream_synchronize(other),
            Host::event_synchronize(&event),
        ];
        (asked, waited)
    });
    Host::event_record(&event, stream.handle()).unwrap();
    Host::event_record(&event, other.handle()).unwrap();
    input.send((event, other.handle(), gate)).unwrap();
    let ((event_asked, fence_asked), waited) = result();
    assert!(
        !event_asked.unwrap(),
        "the latest record is the other stream's, held"
    );
    assert!(!fence_asked.unwrap(), "the other stream is held");
    waited.into_iter().for_each(Result::unwrap);
}

/// A thread-local whose drop waits on a fence, as a staging buffer that
/// waits for its work before it is freed.
struct WaitsWhenDropped(Option<EventFence<Host>>);

impl Drop for WaitsWhenDropped {
    fn drop(&mut self) {
        if let Some(fence) = self.0.take() {
            fence.wait_sync().unwrap();
        }
    }
}

thread_local! {
    static STAGING: std::cell::RefCell<WaitsWhenDropped> =
        const { std::cell::RefCell::new(WaitsWhenDropped(None)) };
}

/// The crate's own thread-local state (which stream a worker serves) is
/// read by every wait: it must still be there as other thread-locals are
/// dropped, or the process aborts.
#[test]
fn a_wait_in_a_thread_locals_drop_works() {
    let stream = HostStream::new().unwrap();
    let handle = stream.handle();
    let waited = std::thread::spawn(move || {
        // Made first, so dropped after anything the waits below make.
        STAGING.with(|staging| staging.borrow_mut().0 = Some(EventFence::new(handle)));
        EventFence::<Host>::new(handle).wait_sync().unwrap();
    });
    waited.join().expect("the thread exited cleanly");
}
