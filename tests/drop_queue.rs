//! `DropQueue`: no value dropped before its fence passes, none lost, bounded,
//! failed fences leak rather than free.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use common::faulty::{self, inject, Faulty, Plan};
use common::{faultable_stream, logs, Gate, Progress};
use device_events::drop_queue::{DropQueue, Fence, HandedBack, Rejected};
use device_events::host::{Host, HostStream};
use device_events::EventFence;
use futures::FutureExt;

/// A value that checks, when dropped, that the work it stood for is done,
/// and that it is dropped off the test's thread.
struct Staging {
    needs: usize,
    progress: Progress,
    test_thread: std::thread::ThreadId,
    early: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.progress.get() < self.needs || std::thread::current().id() == self.test_thread {
            self.early.fetch_add(1, Ordering::SeqCst);
        }
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct Counters {
    early: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

impl Counters {
    fn staging(&self, needs: usize, progress: &Progress) -> Staging {
        Staging {
            needs,
            progress: progress.clone(),
            test_thread: std::thread::current().id(),
            early: self.early.clone(),
            dropped: self.dropped.clone(),
        }
    }
}

/// `future`'s output once it resolves: the test fails, rather than hangs, if
/// it does not within 20 s.
fn resolved<F: Future + Unpin>(what: &str, mut future: F) -> F::Output {
    let mut output = None;
    common::eventually(Duration::from_secs(20), what, || {
        output = (&mut future).now_or_never();
        output.is_some()
    });
    output.expect("resolved")
}

/// `future`, polled once on a thread of its own and found pending: the test
/// fails, rather than hangs, if that poll blocks for 20 s (a shutdown's
/// future joins the queue's thread in `poll` once it resolves).
fn held<F>(what: &str, mut future: F) -> F
where
    F: Future + Unpin + Send + 'static,
{
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ready = (&mut future).now_or_never().is_some();
        let _ = sender.send((ready, future));
    });
    match receiver.recv_timeout(Duration::from_secs(20)) {
        Ok((false, future)) => future,
        Ok((true, _)) => panic!("{what}: resolved, not held"),
        Err(_) => panic!("{what}: its poll blocked for 20 s"),
    }
}

/// What `thread` returned: the test fails, rather than hangs, if it does not
/// return within 20 s.
fn joined<T>(what: &str, thread: std::thread::JoinHandle<T>) -> T {
    common::eventually(Duration::from_secs(20), what, || thread.is_finished());
    thread.join().expect("the thread panicked")
}

#[test]
fn no_value_is_dropped_before_its_fence_and_none_is_lost() {
    let streams: Vec<HostStream> = (0..4).map(|_| HostStream::new().unwrap()).collect();
    let progress: Vec<Progress> = streams.iter().map(|_| Progress::default()).collect();
    let gates: Vec<Gate> = streams.iter().map(Gate::hold).collect();
    let queue = DropQueue::new(10_000).unwrap();
    let counters = Counters::default();
    let mut pushed = 0;
    for step in 1..=200 {
        for (stream, progress) in streams.iter().zip(&progress) {
            progress.step_on(stream);
            let fence = EventFence::<Host>::new(stream.handle());
            assert!(queue.push(fence, counters.staging(step, progress)).is_ok());
            pushed += 1;
        }
    }
    // Every push returned while every stream was held: push never blocks.
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 0);
    for gate in gates {
        gate.open();
    }
    queue.flush();
    assert_eq!(counters.dropped.load(Ordering::SeqCst), pushed);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
    let stats = queue.shutdown();
    assert_eq!(
        (stats.pushed, stats.dropped, stats.leaked, stats.pending),
        (800, 800, 0, 0)
    );
}

#[test]
fn a_full_queue_hands_the_value_back() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(2).unwrap();
    let gate = Gate::hold(&stream);
    for value in 0..2 {
        assert!(queue
            .push(EventFence::<Host>::new(stream.handle()), value)
            .is_ok());
    }
    match queue.push(EventFence::<Host>::new(stream.handle()), 7) {
        Err(Rejected::Full(refused)) => {
            let (fence, value) = refused.into_inner();
            assert_eq!(value, 7);
            gate.open();
            fence.wait_sync().unwrap();
        }
        other => panic!("expected Full, got {other:?}"),
    }
    queue.flush();
    assert!(queue
        .push(EventFence::<Host>::new(stream.handle()), 8)
        .is_ok());
    assert_eq!(queue.shutdown().dropped, 3);
}

#[test]
fn a_failed_fence_leaks_its_value_with_an_error_logged() {
    logs::capture();
    let stream = faultable_stream();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(8).unwrap();
    let gate = Gate::hold(&stream);
    stream
        .launch(|| panic!("illegal address during the copy"))
        .unwrap();
    let counters = Counters::default();
    let progress = Progress::default();
    assert!(queue
        .push(
            EventFence::<Host>::new(stream.handle()),
            counters.staging(0, &progress)
        )
        .is_ok());
    gate.open();
    queue.flush();
    let stats = queue.shutdown();
    assert_eq!((stats.dropped, stats.leaked), (0, 1));
    assert_eq!(
        counters.dropped.load(Ordering::SeqCst),
        0,
        "leaked, not dropped"
    );
    let errors = logs::errors_containing("illegal address during the copy");
    assert!(
        errors.iter().any(|line| line.contains("leaking")),
        "{errors:?}"
    );
}

#[test]
fn a_refused_fence_wait_drops_its_value_once_the_stream_is_idle() {
    logs::capture();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "refused-fence-wait",
            refuse_synchronize: true,
            ..Plan::default()
        },
    );
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(8).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    progress.step_on(&stream); // the copy that still reads the value
    let counters = Counters::default();
    assert!(queue
        .push(
            EventFence::<Faulty>::new(stream.handle()),
            counters.staging(1, &progress)
        )
        .is_ok());
    gate.open();
    queue.flush();
    let stats = queue.shutdown();
    assert_eq!((stats.dropped, stats.leaked), (1, 0), "dropped, not leaked");
    assert_eq!(
        counters.early.load(Ordering::SeqCst),
        0,
        "dropped only after the copy, off the test's thread"
    );
    let warnings = logs::warnings_containing("refused-fence-wait");
    assert!(
        warnings
            .iter()
            .any(|line| line.contains("stream synchronized")),
        "{warnings:?}"
    );
}

#[test]
fn a_fence_whose_stream_cannot_be_synchronized_either_leaks_its_value() {
    logs::capture();
    let stream = HostStream::new().unwrap();
    inject(
        stream.handle(),
        Plan {
            label: "refused-fence-and-stream",
            refuse_synchronize: true,
            refuse_stream_synchronize: true,
            ..Plan::default()
        },
    );
    let progress = Progress::default();
    let counters = Counters::default();
    let queue = DropQueue::new(8).unwrap();
    assert!(queue
        .push(
            EventFence::<Faulty>::new(stream.handle()),
            counters.staging(0, &progress)
        )
        .is_ok());
    queue.flush();
    let stats = queue.shutdown();
    assert_eq!((stats.dropped, stats.leaked), (0, 1));
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 0, "leaked");
    let errors = logs::errors_containing("refused-fence-and-stream");
    assert!(
        errors.iter().any(|line| line.contains("leaking")),
        "{errors:?}"
    );
}

/// A value that may open a gate when dropped.
struct Item {
    name: &'static str,
    opens: Option<Gate>,
}

impl Drop for Item {
    fn drop(&mut self) {
        if let Some(gate) = self.opens.take() {
            gate.open();
        }
    }
}

#[test]
fn shutdown_now_drops_what_passed_and_hands_back_the_rest() {
    let done = HostStream::new().unwrap();
    let first = HostStream::new().unwrap();
    let held = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(8).unwrap();
    let first_gate = Gate::hold(&first);
    let held_gate = Gate::hold(&held);
    // The queue's thread waits on "first" (held by its gate) ...
    let item = |name| Item { name, opens: None };
    assert!(queue
        .push(EventFence::<Host>::new(first.handle()), item("first"))
        .is_ok());
    common::until_taken(&queue);
    // ... while "passed" (already reached) and "held" wait behind it.
    let passed = EventFence::<Host>::new(done.handle());
    EventFence::<Host>::new(done.handle()).wait_sync().unwrap();
    let passed_item = Item {
        name: "passed",
        // Dropping "passed" lets "first" finish, so shutdown_now can join.
        opens: Some(first_gate),
    };
    assert!(queue.push(passed, passed_item).is_ok());
    assert!(queue
        .push(EventFence::<Host>::new(held.handle()), item("held"))
        .is_ok());
    let flushed = queue.flush_async(); // to read the final stats
    let handed_back = queue.shutdown_now();
    let names: Vec<&str> = handed_back.iter().map(|(_, item)| item.name).collect();
    assert_eq!(names, ["held"]);
    let stats = flushed
        .now_or_never()
        .expect("resolved once shutdown_now returned");
    // "first" by the queue's thread, "passed" by shutdown_now.
    assert_eq!((stats.dropped, stats.handed_back, stats.leaked), (2, 1, 0));
    held_gate.open();
    for (fence, item) in handed_back {
        fence.wait_sync().unwrap();
        drop(item);
    }
}

#[test]
fn dropping_the_queue_waits_for_its_fences() {
    let stream = HostStream::new().unwrap();
    let counters = Counters::default();
    let progress = Progress::default();
    {
        let queue = DropQueue::new(8).unwrap();
        progress.step_on(&stream);
        let fence = EventFence::<Host>::new(stream.handle());
        assert!(queue.push(fence, counters.staging(1, &progress)).is_ok());
    } // dropped: waits for the fence, drops the value
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 1);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

#[test]
fn a_refused_push_is_an_error_that_question_mark_carries() {
    fn push_twice(
        queue: &DropQueue<EventFence<Host>, u32>,
        stream: &HostStream,
    ) -> Result<(), Box<dyn std::error::Error>> {
        queue.push(stream.fence(), 1)?;
        queue.push(stream.fence(), 2)?;
        Ok(())
    }
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    assert_eq!(queue.capacity(), 1);
    let err = push_twice(&queue, &stream).unwrap_err();
    assert!(err.to_string().contains("full"), "{err}");
    let rejected = queue.push(stream.fence(), 3).unwrap_err();
    assert!(matches!(rejected, Rejected::Full(..)));
    let (fence, value) = rejected.into_inner();
    assert_eq!(value, 3);
    gate.open();
    fence.wait_sync().unwrap();
}

#[test]
fn a_zero_capacity_is_refused() {
    let err = DropQueue::<EventFence<Host>, ()>::new(0).unwrap_err();
    assert!(
        matches!(&err, device_events::ServerError::InvalidArgument { what, .. } if what.contains("capacity")),
        "{err}"
    );
}

/// `flush_async` and `shutdown_async` wait for the device without blocking
/// a thread: they stay pending while the stream is held, and resolve once it
/// is released.
#[test]
fn flush_and_shutdown_can_be_awaited() {
    let stream = HostStream::new().unwrap();
    let counters = Counters::default();
    let progress = Progress::default();
    let queue = DropQueue::new(8).unwrap();
    let gate = Gate::hold(&stream);
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    let mut flushed = Box::pin(queue.flush_async());
    assert!(
        futures::FutureExt::now_or_never(&mut flushed).is_none(),
        "held"
    );
    gate.open();
    let stats = resolved("the flush", flushed);
    assert_eq!((stats.dropped, stats.leaked), (1, 0));

    let gate = Gate::hold(&stream);
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(2, &progress))
        .is_ok());
    let shutdown = held("the shutdown", Box::pin(queue.shutdown_async()));
    gate.open();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let stats = runtime.block_on(shutdown);
    assert_eq!((stats.pushed, stats.dropped, stats.pending), (2, 2, 0));
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// `push_blocking` waits for room instead of handing the value back: the
/// caller never holds a refused value it could drop too early.
#[test]
fn push_blocking_waits_for_room_and_drops_nothing_early() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = Arc::new(DropQueue::new(2).unwrap());
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Arc::new(Counters::default());
    progress.step_on(&stream); // before any fence the pusher records
    let pusher = {
        let (queue, counters, progress) = (queue.clone(), counters.clone(), progress.clone());
        let stream_handle = stream.handle();
        let test_thread = std::thread::current().id();
        std::thread::spawn(move || {
            for _ in 0..20 {
                let mut staging = counters.staging(1, &progress);
                staging.test_thread = test_thread;
                queue
                    .push_blocking(EventFence::<Host>::new(stream_handle), staging)
                    .unwrap_or_else(|_| panic!("refused while open"));
            }
        })
    };
    common::eventually(Duration::from_secs(20), "two values queued", || {
        queue.stats().pushed == 2
    });
    // Nothing can leave the queue while the stream is held, so the pusher
    // is still waiting for room.
    assert!(!pusher.is_finished(), "a push went past the capacity");
    assert_eq!(queue.stats().pending, 2);
    gate.open();
    joined("the blocked push", pusher);
    queue.flush();
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 20);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// `push_async` waits for room without blocking a thread, and a push future
/// dropped before it resolved queues its value all the same.
#[test]
fn push_async_waits_for_room_and_a_dropped_push_still_keeps_its_value() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    let first = queue.push_async(stream.fence(), counters.staging(1, &progress));
    assert!(resolved("the first push", first).is_ok());
    let mut second = queue.push_async(stream.fence(), counters.staging(1, &progress));
    assert!((&mut second).now_or_never().is_none(), "no room yet");
    let abandoned = queue.push_async(stream.fence(), counters.staging(1, &progress));
    drop(abandoned); // queued past the capacity, not dropped
    assert_eq!(queue.stats().pushed, 2);
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 0);
    gate.open();
    assert!(resolved("the second push", second).is_ok());
    queue.flush();
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 3);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
    let closed = queue.shutdown_async();
    resolved("the shutdown", Box::pin(closed));
}

#[test]
fn a_rejected_value_is_dropped_only_after_its_fence() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    let rejected = queue
        .push(stream.fence(), counters.staging(1, &progress))
        .unwrap_err();
    assert!(matches!(rejected, Rejected::Full(..)));
    // The caller keeps the promise on a thread of its own.
    let caller = std::thread::spawn(move || rejected.wait_then_drop());
    gate.open();
    joined("wait_then_drop", caller).unwrap();
    queue.flush();
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 2);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

#[test]
fn a_refused_value_taken_out_of_its_rejection_is_dropped_only_after_its_fence() {
    let stream = HostStream::new().unwrap();
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    let Err(Rejected::Full(refused)) = queue.push(stream.fence(), counters.staging(1, &progress))
    else {
        panic!("a full queue took the push");
    };
    let caller = std::thread::spawn(move || refused.wait_then_drop());
    gate.open();
    joined("wait_then_drop", caller).unwrap();
    queue.flush();
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 2);
    // Dropped by the caller, not queued past the capacity: only the first was the queue's.
    assert_eq!(queue.stats().dropped, 1);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// A fence that counts the calls of `is_passed` (and is never passed).
struct CountedQuery(EventFence<Host>, Arc<AtomicUsize>);

impl Fence for CountedQuery {
    fn wait_blocking(self) -> Result<(), device_events::ServerError> {
        self.0.wait_sync()
    }

    fn is_passed(&self) -> Result<bool, device_events::ServerError> {
        self.1.fetch_add(1, Ordering::SeqCst);
        Ok(false)
    }
}

/// What `shutdown_now` hands back keeps its values alive: dropping it waits
/// for each fence, rather than freeing what the device may still read. And
/// a flush made before `shutdown_now` learns that its values left.
#[test]
fn dropping_what_shutdown_now_handed_back_waits_for_the_fences() {
    let (blocking, stream) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(4).unwrap();
    let (blocking_gate, gate) = (Gate::hold(&blocking), Gate::hold(&stream));
    let progress = Progress::default();
    let counters = Counters::default();
    let queries = Arc::new(AtomicUsize::new(0));
    progress.step_on(&stream);
    // The queue's thread waits on the first value, so the second stays
    // queued for shutdown_now to hand back.
    let first = CountedQuery(blocking.fence(), queries.clone());
    assert!(queue.push(first, counters.staging(0, &progress)).is_ok());
    common::until_taken(&queue);
    let mut staging = counters.staging(1, &progress);
    staging.test_thread = std::thread::current().id();
    let second = CountedQuery(stream.fence(), queries.clone());
    assert!(queue.push(second, staging).is_ok());
    let mut flushed = queue.flush_async();
    assert!((&mut flushed).now_or_never().is_none());
    let shutting = std::thread::spawn(move || queue.shutdown_now());
    common::eventually(Duration::from_secs(20), "shutdown_now checked", || {
        queries.load(Ordering::SeqCst) == 1
    });
    blocking_gate.open(); // shutdown_now waits for the first value
    let handed_back = joined("shutdown_now", shutting);
    let kept = handed_back.len();
    let stats = flushed
        .now_or_never()
        .expect("resolved once shutdown_now returned");
    // Dropped on another thread, while this one opens the gate (asserting
    // first would leave the drop waiting on a gate no one opens).
    let dropper = std::thread::spawn(move || drop(handed_back));
    gate.open();
    joined("the drop", dropper);
    assert_eq!(kept, 1);
    assert_eq!((stats.handed_back, stats.dropped, stats.leaked), (1, 1, 0));
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 2);
    // `early` counts a drop on the test thread too; the dropper is another.
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// A user `Fence` whose `is_passed` panics (after counting the call).
struct PanickyQuery(EventFence<Host>, Arc<AtomicUsize>);

impl Fence for PanickyQuery {
    fn wait_blocking(self) -> Result<(), device_events::ServerError> {
        self.0.wait_sync()
    }

    fn is_passed(&self) -> Result<bool, device_events::ServerError> {
        self.1.fetch_add(1, Ordering::SeqCst);
        panic!("is_passed panicked");
    }
}

#[test]
fn a_panic_in_is_passed_during_shutdown_now_hands_the_value_back() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(4).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    let queries = Arc::new(AtomicUsize::new(0));
    progress.step_on(&stream);
    for _ in 0..3 {
        let fence = PanickyQuery(stream.fence(), queries.clone());
        assert!(queue.push(fence, counters.staging(1, &progress)).is_ok());
    }
    // The queue's thread takes the first up; shutdown_now checks the other
    // two, then waits for the first, so the gate opens once both are checked.
    common::eventually(Duration::from_secs(20), "the thread took one", || {
        queue.stats().queued == 2
    });
    let shutting = std::thread::spawn(move || queue.shutdown_now().into_vec());
    common::eventually(Duration::from_secs(20), "both checked", || {
        queries.load(Ordering::SeqCst) == 2
    });
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 0, "dropped early");
    gate.open();
    let handed_back = joined("shutdown_now", shutting);
    assert_eq!(handed_back.len(), 2);
    // Kept alive by the caller, then dropped off the test thread.
    let waits = std::thread::spawn(move || {
        for (fence, value) in handed_back {
            fence.wait_blocking().unwrap();
            drop(value);
        }
    });
    joined("the waits", waits);
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 3);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// A fence for `shutdown_now` to check: one the queue's thread waits on, one
/// that has passed, or one whose `is_passed` says it was entered, waits for
/// its release, then fails.
enum Checked {
    Waited(EventFence<Host>),
    Passed,
    Held {
        entered: std::sync::mpsc::Sender<()>,
        release: std::sync::mpsc::Receiver<()>,
    },
}

impl Fence for Checked {
    fn wait_blocking(self) -> Result<(), device_events::ServerError> {
        match self {
            Self::Waited(fence) => fence.wait_sync(),
            Self::Passed | Self::Held { .. } => Ok(()),
        }
    }

    fn is_passed(&self) -> Result<bool, device_events::ServerError> {
        match self {
            Self::Waited(fence) => fence.is_complete(),
            Self::Passed => Ok(true),
            Self::Held { entered, release } => {
                let _ = entered.send(());
                let _ = release.recv(); // or the test failed, dropping the sender
                let err = "fails once released";
                Err(device_events::ServerError::call(
                    "Test",
                    "is_passed",
                    1,
                    "HELD",
                    err,
                ))
            }
        }
    }
}

/// A value `shutdown_now` is still checking is neither queued nor waited on,
/// and the queue's thread may have exited meanwhile: a flush made before must
/// still wait for it. A value whose `is_passed` fails is handed back, one
/// whose fence has passed dropped and counted.
#[test]
fn a_flush_waits_for_a_value_shutdown_now_is_still_checking() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(4).unwrap();
    let gate = Gate::hold(&stream);
    let drops = Arc::new(AtomicUsize::new(0));
    let (entered, entries) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel();
    let waited = Checked::Waited(stream.fence());
    assert!(queue.push(waited, Counted(drops.clone())).is_ok());
    common::until_taken(&queue);
    let held = Checked::Held {
        entered,
        release: released,
    };
    assert!(queue.push(held, Counted(drops.clone())).is_ok());
    assert!(queue.push(Checked::Passed, Counted(drops.clone())).is_ok());
    let mut flushed = queue.flush_async();
    let exited = queue.shutdown_async(); // resolves once the thread exits
    let shutting = std::thread::spawn(move || queue.shutdown_now().into_vec());
    entries
        .recv_timeout(Duration::from_secs(20))
        .expect("shutdown_now checks the held value");
    gate.open(); // the thread drops the first value, then exits
    let stats = resolved("the queue's thread exits", Box::pin(exited));
    assert_eq!((stats.dropped, stats.handed_back), (1, 0));
    assert!(
        (&mut flushed).now_or_never().is_none(),
        "the flush resolved while shutdown_now still checked its value"
    );
    release.send(()).unwrap();
    let handed_back = joined("shutdown_now", shutting);
    assert_eq!(handed_back.len(), 1);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        2,
        "the failed check's value was dropped"
    );
    let stats = flushed
        .now_or_never()
        .expect("resolved once shutdown_now returned");
    assert_eq!((stats.dropped, stats.handed_back, stats.leaked), (2, 1, 0));
}

/// A waker that counts its clones: its `Arc`'s strong count.
struct CountedWaker;

impl std::task::Wake for CountedWaker {
    fn wake(self: Arc<Self>) {}
}

/// A flush future or a push future waiting for room, dropped unresolved,
/// takes its waker out of the queue.
#[test]
fn dropped_flush_and_push_futures_leave_no_wakers_behind() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    assert!(queue.push(stream.fence(), 1u32).is_ok());
    let wakers: Vec<Arc<CountedWaker>> = (0..1000).map(|_| Arc::new(CountedWaker)).collect();
    for counted in &wakers {
        let waker = std::task::Waker::from(counted.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut flushed = Box::pin(queue.flush_async());
        assert!(flushed.as_mut().poll(&mut cx).is_pending());
        let mut pushed = queue.push_async(stream.fence(), 2u32);
        assert!(Pin::new(&mut pushed).poll(&mut cx).is_pending(), "full");
        drop((flushed, pushed));
    }
    let kept = wakers.iter().filter(|w| Arc::strong_count(w) > 1).count();
    assert_eq!(kept, 0, "wakers kept for futures that were dropped");
    gate.open();
    queue.flush();
}

/// Where a value finds its own queue.
type QueueSlot = Arc<std::sync::Mutex<Option<Arc<DropQueue<EventFence<Host>, UsesItsQueue>>>>>;

/// A value whose drop uses its own queue, on the queue's own thread.
struct UsesItsQueue {
    queue: QueueSlot,
    /// Whether the drop awaits `shutdown_async` before it drops the queue.
    shuts_down: bool,
    flushed: Arc<AtomicUsize>,
    panicked: Arc<AtomicUsize>,
}

impl Drop for UsesItsQueue {
    fn drop(&mut self) {
        let queue = self.queue.lock().unwrap().take();
        let (flushed, panicked) = (self.flushed.clone(), self.panicked.clone());
        let shuts_down = self.shuts_down;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            if let Some(queue) = queue {
                queue.flush(); // would wait for itself
                futures::executor::block_on(queue.flush_async()); // likewise
                if shuts_down {
                    futures::executor::block_on(queue.shutdown_async()); // would join itself
                }
                flushed.fetch_add(1, Ordering::SeqCst);
                drop(queue); // the last handle: would join itself
            }
        }));
        if outcome.is_err() {
            panicked.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A value's drop that flushes its own queue, awaits its `shutdown_async` or
/// drops its last handle, on the queue's own thread, returns at once: it
/// neither waits for itself nor joins itself.
#[test]
fn a_value_whose_drop_flushes_shuts_down_or_drops_its_own_queue_neither_hangs_nor_panics() {
    for shuts_down in [false, true] {
        let stream = HostStream::new().unwrap();
        let holder = Arc::new(std::sync::Mutex::new(None));
        let (flushed, panicked) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let queue = Arc::new(DropQueue::new(4).unwrap());
        *holder.lock().unwrap() = Some(queue.clone());
        let value = UsesItsQueue {
            queue: holder.clone(),
            shuts_down,
            flushed: flushed.clone(),
            panicked: panicked.clone(),
        };
        assert!(queue.push(stream.fence(), value).is_ok());
        drop(queue); // the value now holds the last handle
        let what = format!("the value's drop finished (shutdown_async: {shuts_down})");
        common::eventually(Duration::from_secs(20), &what, || {
            flushed.load(Ordering::SeqCst) + panicked.load(Ordering::SeqCst) == 1
        });
        let panicked = panicked.load(Ordering::SeqCst);
        assert_eq!(
            panicked, 0,
            "a self-join panicked (shutdown_async: {shuts_down})"
        );
    }
}

/// A panic payload whose own drop panics.
struct PanickyPayload;

impl Drop for PanickyPayload {
    fn drop(&mut self) {
        panic!("the payload's drop panicked too");
    }
}

/// A value whose drop panics with that payload.
struct PanicsWithPanickyPayload;

impl Drop for PanicsWithPanickyPayload {
    fn drop(&mut self) {
        std::panic::panic_any(PanickyPayload);
    }
}

#[test]
fn a_drop_panicking_with_a_payload_that_panics_does_not_stop_the_queue() {
    let stream = HostStream::new().unwrap();
    let queue = Arc::new(DropQueue::new(4).unwrap());
    assert!(queue
        .push(stream.fence(), Some(PanicsWithPanickyPayload))
        .is_ok());
    assert!(queue.push(stream.fence(), None).is_ok());
    let flushing = {
        let queue = queue.clone();
        std::thread::spawn(move || queue.flush())
    };
    common::eventually(Duration::from_secs(20), "the flush returns", || {
        flushing.is_finished()
    });
    let stats = queue.stats();
    assert_eq!((stats.dropped, stats.pending), (2, 0));
}

/// A waker that records that it was woken.
#[derive(Default)]
struct FlagWaker(std::sync::atomic::AtomicBool);

impl std::task::Wake for FlagWaker {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// `shutdown_now` hands back a later value while an earlier one is still
/// waited on: a flush made for the earlier one must still wait for it.
#[test]
fn a_flush_waits_for_its_values_even_when_later_ones_are_handed_back() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(4).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    common::until_taken(&queue);
    let mut flushed = Box::pin(queue.flush_async());
    let flag = Arc::new(FlagWaker::default());
    let waker = std::task::Waker::from(flag.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(flushed.as_mut().poll(&mut cx).is_pending());
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    let shutting = std::thread::spawn(move || queue.shutdown_now().into_vec());
    // shutdown_now wakes the flush once it has handed the later value back.
    common::eventually(Duration::from_secs(20), "the flush was woken", || {
        flag.0.load(Ordering::SeqCst)
    });
    assert!(
        flushed.as_mut().poll(&mut cx).is_pending(),
        "resolved while its value still waited on its fence"
    );
    gate.open();
    let handed_back = joined("shutdown_now", shutting);
    let stats = flushed
        .now_or_never()
        .expect("resolved once shutdown_now returned");
    assert_eq!((stats.dropped, stats.handed_back), (1, 1));
    joined("the drop", std::thread::spawn(move || drop(handed_back)));
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// Closing the queue wakes a push future waiting for room: it learns at
/// once that the queue refuses it, not when a value is next dropped.
#[test]
fn closing_wakes_a_push_waiting_for_room() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    let mut push = queue.push_async(stream.fence(), counters.staging(1, &progress));
    let flag = Arc::new(FlagWaker::default());
    let waker = std::task::Waker::from(flag.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(Pin::new(&mut push).poll(&mut cx).is_pending());
    let shutdown = queue.shutdown_async(); // closes now, resolves later
    assert!(flag.0.load(Ordering::SeqCst), "the push was not woken");
    let Poll::Ready(Err(refused @ Rejected::Closed(_))) = Pin::new(&mut push).poll(&mut cx) else {
        panic!("a closed queue took the push");
    };
    let keeper = std::thread::spawn(move || refused.wait_then_drop());
    gate.open();
    joined("wait_then_drop", keeper).unwrap();
    resolved("the shutdown", Box::pin(shutdown));
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 2);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// A fence held behind a gate, or one whose wait panics.
enum GatedOrPanicky {
    Gated(EventFence<Host>),
    Panicky,
}

impl Fence for GatedOrPanicky {
    fn wait_blocking(self) -> Result<(), device_events::ServerError> {
        match self {
            Self::Gated(fence) => fence.wait_sync(),
            Self::Panicky => panic!("the fence's wait panicked"),
        }
    }
}

#[test]
fn a_fence_whose_wait_panics_is_a_drop_queue_panic_and_its_value_leaks() {
    let stream = HostStream::new().unwrap();
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    assert!(queue
        .push(GatedOrPanicky::Gated(stream.fence()), 0u32)
        .is_ok());
    let rejected = match queue.push(GatedOrPanicky::Panicky, 1u32) {
        Err(rejected @ Rejected::Full(..)) => rejected,
        other => panic!("expected Full, got {other:?}"),
    };
    let err = rejected.wait_then_drop().unwrap_err();
    assert!(
        matches!(&err, device_events::ServerError::DropQueuePanicked { message } if message.contains("wait panicked")),
        "{err}"
    );
    gate.open();
    queue.flush();
}

#[test]
fn close_refuses_later_pushes_and_still_drops_what_was_queued_after_its_fence() {
    let stream = HostStream::new().unwrap();
    let counters = Counters::default();
    let progress = Progress::default();
    let queue = DropQueue::new(8).unwrap();
    let gate = Gate::hold(&stream);
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    queue.close();
    queue.close(); // twice is fine
    for refused in [
        queue.push(stream.fence(), counters.staging(1, &progress)),
        queue.push_blocking(stream.fence(), counters.staging(1, &progress)),
        resolved(
            "the push",
            queue.push_async(stream.fence(), counters.staging(1, &progress)),
        ),
    ] {
        let Err(Rejected::Closed(refused)) = refused else {
            panic!("a push after close is refused as closed");
        };
        let (fence, value) = refused.into_inner();
        drop(fence);
        std::mem::forget(value); // its work is held: not ours to drop here
    }
    assert_eq!(
        counters.dropped.load(Ordering::SeqCst),
        0,
        "held by the gate"
    );
    gate.open();
    queue.flush();
    let stats = queue.stats();
    assert_eq!((stats.pushed, stats.dropped), (1, 1));
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

#[test]
fn a_shared_queue_shuts_down_through_any_handle_and_every_call_resolves() {
    let stream = HostStream::new().unwrap();
    let counters = Counters::default();
    let progress = Progress::default();
    let queue = Arc::new(DropQueue::new(8).unwrap());
    let handler = queue.clone();
    let gate = Gate::hold(&stream);
    progress.step_on(&stream);
    assert!(handler
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    // Two handles shut it down at once: both futures resolve, with the
    // same final stats, once the thread has dropped the value and exited.
    let first = held("the first shutdown", Box::pin(queue.shutdown_async()));
    let second = held("the second shutdown", Box::pin(handler.shutdown_async()));
    let Err(Rejected::Closed(refused)) =
        handler.push(stream.fence(), counters.staging(1, &progress))
    else {
        panic!("closed from the moment shutdown_async was called");
    };
    std::mem::forget(refused.into_inner().1); // its work is held: not ours to drop here
    gate.open();
    let (first, second) = resolved("both shutdowns", futures::future::join(first, second));
    assert_eq!((first.pushed, first.dropped, first.pending), (1, 1, 0));
    assert_eq!((second.pushed, second.dropped), (1, 1));
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
    drop(handler);
    drop(queue); // the thread is gone: returns at once
}

/// A value that counts its drops.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A full queue's refusal, ignored any way a caller can (`.ok()`, `let _ =`,
/// `?`), keeps its value: queued past the capacity, and dropped on the
/// queue's thread once its fence passes.
#[test]
fn an_ignored_full_refusal_keeps_its_value_until_its_fence() {
    fn carried(
        queue: &DropQueue<EventFence<Host>, Staging>,
        stream: &HostStream,
        value: Staging,
    ) -> Result<(), Box<dyn std::error::Error>> {
        queue.push(stream.fence(), value)?;
        Ok(())
    }
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(1).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    let refused = queue.push(stream.fence(), counters.staging(1, &progress));
    assert!(matches!(refused, Err(Rejected::Full(..))));
    refused.ok();
    let _ = queue.push(stream.fence(), counters.staging(1, &progress));
    assert!(carried(&queue, &stream, counters.staging(1, &progress)).is_err());
    assert_eq!(
        counters.dropped.load(Ordering::SeqCst),
        0,
        "dropped before its fence"
    );
    let stats = queue.stats();
    assert_eq!((stats.pushed, stats.pending), (4, 4), "past the capacity");
    gate.open();
    queue.flush();
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 4);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
    let stats = queue.shutdown();
    assert_eq!(
        (stats.pushed, stats.dropped, stats.leaked, stats.pending),
        (4, 4, 0, 0)
    );
}

/// A closed queue's refusal, ignored, keeps its value too while the
/// queue's thread still drains what it holds.
#[test]
fn an_ignored_closed_refusal_keeps_its_value_until_its_fence() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let queue = DropQueue::new(8).unwrap();
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    let counters = Counters::default();
    progress.step_on(&stream);
    // The queue's thread waits on this one, so it cannot exit yet.
    assert!(queue
        .push(stream.fence(), counters.staging(1, &progress))
        .is_ok());
    queue.close();
    let refused = queue.push(stream.fence(), counters.staging(1, &progress));
    assert!(matches!(refused, Err(Rejected::Closed(..))));
    refused.ok();
    let _ = queue.push_blocking(stream.fence(), counters.staging(1, &progress));
    let _ = resolved(
        "the push",
        queue.push_async(stream.fence(), counters.staging(1, &progress)),
    );
    assert_eq!(
        counters.dropped.load(Ordering::SeqCst),
        0,
        "dropped before its fence"
    );
    assert_eq!(queue.stats().pending, 4);
    gate.open();
    let stats = resolved("the shutdown", Box::pin(queue.shutdown_async()));
    assert_eq!(
        (stats.pushed, stats.dropped, stats.leaked, stats.pending),
        (4, 4, 0, 0)
    );
    assert_eq!(counters.dropped.load(Ordering::SeqCst), 4);
    assert_eq!(counters.early.load(Ordering::SeqCst), 0);
}

/// Once the queue's thread has exited, nothing will wait for a refused
/// value's fence: a value whose fence has not passed is leaked (and
/// counted), one whose fence has passed is dropped, and the fence is dropped
/// either way. A fence that cannot tell (`is_passed`'s default) has not
/// passed.
#[test]
fn an_ignored_refusal_of_a_finished_queue_leaks_an_unpassed_value() {
    /// Gives a finished queue a refused value before `fence(stream)` passes,
    /// then one after; the drops of the values.
    fn refused_twice<F: Fence>(stream: &HostStream, fence: impl Fn(&HostStream) -> F) -> usize {
        let kind = std::any::type_name::<F>();
        let queue = DropQueue::new(8).unwrap();
        resolved("the shutdown", Box::pin(queue.shutdown_async()));
        let drops = Arc::new(AtomicUsize::new(0));
        let gate = Gate::hold(stream);
        queue.push(fence(stream), Counted(drops.clone())).ok();
        assert_eq!(
            drops.load(Ordering::SeqCst),
            0,
            "{kind}: freed before its fence"
        );
        let stats = queue.stats();
        let counts = (stats.pushed, stats.dropped, stats.leaked, stats.pending);
        assert_eq!(counts, (1, 0, 1, 0), "{kind}");
        gate.open();
        let passed = fence(stream);
        stream.fence().wait_sync().unwrap();
        queue.push(passed, Counted(drops.clone())).ok();
        let drops = drops.load(Ordering::SeqCst);
        let stats = queue.stats();
        let counts = (stats.pushed, stats.dropped, stats.leaked);
        assert_eq!(counts, (2, drops as u64, 2 - drops as u64), "{kind}");
        drops
    }
    let stream = HostStream::new().unwrap();
    let event = |stream: &HostStream| EventFence::<Faulty>::new(stream.handle());
    assert_eq!(refused_twice(&stream, event), 1);
    assert_eq!(faulty::destroyed(stream.handle()), 2, "fences dropped");
    let any = |stream: &HostStream| device_events::AnyFence::from(stream.fence());
    assert_eq!(refused_twice(&stream, any), 1);
    let cannot_tell = |stream: &HostStream| GatedOrPanicky::Gated(stream.fence());
    assert_eq!(refused_twice(&stream, cannot_tell), 0);
}

/// Dropping a refusal in a task, on the executor's thread, returns while
/// its fence is pending, and frees nothing.
#[test]
fn dropping_a_refusal_blocks_no_thread_while_its_fence_is_pending() {
    let stream = HostStream::new().unwrap();
    // Before the gate: a failing assertion unwinds the gate (opening it)
    // before the queue, whose drop waits for the fences behind it.
    let full = DropQueue::new(1).unwrap();
    let finished = DropQueue::new(1).unwrap();
    resolved("the shutdown", Box::pin(finished.shutdown_async()));
    let gate = Gate::hold(&stream);
    let drops = Arc::new(AtomicUsize::new(0));
    assert!(full.push(stream.fence(), Counted(drops.clone())).is_ok());
    let refusals = [
        full.push(stream.fence(), Counted(drops.clone()))
            .unwrap_err(),
        finished
            .push(stream.fence(), Counted(drops.clone()))
            .unwrap_err(),
    ];
    let dropper =
        std::thread::spawn(move || futures::executor::block_on(async move { drop(refusals) }));
    common::eventually(Duration::from_secs(20), "the drops returned", || {
        dropper.is_finished()
    });
    dropper.join().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 0, "freed before its fence");
    assert_eq!(full.stats().pending, 2);
    assert_eq!(finished.stats().leaked, 1);
    gate.open();
    full.flush();
    assert_eq!(drops.load(Ordering::SeqCst), 2);
}

/// A push future abandoned after the queue's thread exited does not wait
/// for its fence where it is dropped either: its value is leaked, counted.
#[test]
fn dropping_a_push_to_a_finished_queue_blocks_no_thread() {
    let stream = HostStream::new().unwrap();
    let queue = DropQueue::new(1).unwrap();
    resolved("the shutdown", Box::pin(queue.shutdown_async()));
    let gate = Gate::hold(&stream);
    let drops = Arc::new(AtomicUsize::new(0));
    let abandoned = queue.push_async(stream.fence(), Counted(drops.clone()));
    let dropper =
        std::thread::spawn(move || futures::executor::block_on(async move { drop(abandoned) }));
    common::eventually(Duration::from_secs(20), "the drop returned", || {
        dropper.is_finished()
    });
    dropper.join().unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 0, "freed before its fence");
    let stats = queue.stats();
    assert_eq!((stats.pushed, stats.leaked), (1, 1));
    gate.open();
}

/// A panic in a user's fence or value, met when a finished queue takes a
/// refused value, goes no further than that value.
#[test]
fn a_refusal_given_to_a_finished_queue_contains_panics() {
    let stream = HostStream::new().unwrap();
    let passed = stream.fence();
    stream.fence().wait_sync().unwrap();
    let queries = Arc::new(AtomicUsize::new(0));
    let drops = Arc::new(AtomicUsize::new(0));
    let panicky_fences = DropQueue::new(1).unwrap();
    resolved("the shutdown", Box::pin(panicky_fences.shutdown_async()));
    let fence = PanickyQuery(stream.fence(), queries.clone());
    panicky_fences.push(fence, Counted(drops.clone())).ok();
    assert_eq!(queries.load(Ordering::SeqCst), 1);
    assert_eq!(drops.load(Ordering::SeqCst), 0, "leaked, not dropped");
    assert_eq!(panicky_fences.stats().leaked, 1);

    let panicky_values = DropQueue::new(1).unwrap();
    resolved("the shutdown", Box::pin(panicky_values.shutdown_async()));
    let value = Some(PanicsWithPanickyPayload);
    panicky_values.push(passed, value).ok();
    let stats = panicky_values.stats();
    assert_eq!((stats.dropped, stats.leaked), (1, 0));
}

/// A value that reports its drop: whether the stream's step it stood for had
/// run by then, and on which thread it was dropped.
struct Reported {
    needs: usize,
    progress: Progress,
    report: std::sync::mpsc::Sender<(bool, Option<String>)>,
}

impl Drop for Reported {
    fn drop(&mut self) {
        let thread = std::thread::current().name().map(str::to_owned);
        let _ = self
            .report
            .send((self.progress.get() >= self.needs, thread));
    }
}

/// A test that fails while it holds a queue over work it holds back itself
/// (a gate dropped only after the queue) must fail, not hang: the queue's
/// drop during the unwind does not wait for the fences. The values still
/// wait for them, the one in flight and the one queued, and are dropped on
/// the queue's thread once the gate opens.
#[test]
fn a_queue_dropped_while_its_thread_panics_does_not_wait_for_its_fences() {
    use std::sync::mpsc;
    const LIMIT: Duration = Duration::from_secs(30);

    let stream = HostStream::new().unwrap();
    // Outlives the queue, as a gate declared before it does: opened only
    // once the panicking thread has let go of the queue.
    let gate = Gate::hold(&stream);
    let progress = Progress::default();
    progress.step_on(&stream);
    let (report, reports) = mpsc::channel();
    let (unwound, unwinds) = mpsc::channel();
    let handle = stream.handle();
    let step = progress.clone();
    std::thread::spawn(move || {
        let caught = std::panic::catch_unwind(move || {
            let queue = DropQueue::new(4).unwrap();
            // One waited on by the queue's thread, one queued behind it.
            for taken in [true, false] {
                let value = Reported {
                    needs: 1,
                    progress: step.clone(),
                    report: report.clone(),
                };
                assert!(queue.push(EventFence::<Host>::new(handle), value).is_ok());
                if taken {
                    common::until_taken(&queue);
                }
            }
            panic!("a failing test holding a drop queue");
        });
        let message = caught
            .err()
            .and_then(|payload| payload.downcast_ref::<&str>().map(|text| text.to_string()));
        let _ = unwound.send(message);
    });
    // A hang (the queue's drop joining its thread) fails here, and the gate
    // then opens as this thread unwinds.
    let message = unwinds
        .recv_timeout(LIMIT)
        .expect("the queue's drop during the unwind returned without waiting for the fence");
    assert_eq!(
        message.as_deref(),
        Some("a failing test holding a drop queue")
    );
    assert!(
        matches!(reports.try_recv(), Err(mpsc::TryRecvError::Empty)),
        "the value was dropped while its fence was held"
    );
    gate.open();
    for _ in 0..2 {
        let (passed, thread) = reports
            .recv_timeout(LIMIT)
            .expect("the detached queue thread drops each value once its fence passes");
        assert!(passed, "dropped before its fence passed");
        assert_eq!(thread.as_deref(), Some("device-events-drop-queue"));
    }
}

/// A value that sets a flag its test owns when dropped, and may open a gate.
struct Flagged {
    dropped: Arc<std::sync::atomic::AtomicBool>,
    opens: Option<Gate>,
    /// Work that must have run before the drop, and the flag set if not.
    after: Option<(Progress, Arc<std::sync::atomic::AtomicBool>)>,
}

impl Flagged {
    fn new(dropped: &Arc<std::sync::atomic::AtomicBool>) -> Self {
        Self {
            dropped: dropped.clone(),
            opens: None,
            after: None,
        }
    }
}

impl Drop for Flagged {
    fn drop(&mut self) {
        if let Some((progress, early)) = &self.after {
            early.fetch_or(progress.get() == 0, Ordering::SeqCst);
        }
        self.dropped.store(true, Ordering::SeqCst);
        if let Some(gate) = self.opens.take() {
            gate.open();
        }
    }
}

/// What `shutdown_now` hands back of `entries`, whose fences must not pass
/// before it checks them: they wait behind a first value whose fence is held
/// until `shutdown_now` has taken them out of the queue, so the queue's
/// thread waits on none of them.
fn hand_back(entries: Vec<(EventFence<Host>, Flagged)>) -> HandedBack<EventFence<Host>, Flagged> {
    hand_back_as(|fence| fence, entries)
}

/// [`hand_back`], for fences of another type: `wrap` makes the queue's own.
fn hand_back_as<F: Fence>(
    wrap: impl Fn(EventFence<Host>) -> F,
    entries: Vec<(F, Flagged)>,
) -> HandedBack<F, Flagged> {
    let (first, done) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let queue = DropQueue::new(entries.len() + 2).unwrap();
    let first_gate = Gate::hold(&first);
    let unused = Arc::default();
    assert!(queue
        .push(wrap(first.fence()), Flagged::new(&unused))
        .is_ok());
    common::until_taken(&queue);
    // Passed: shutdown_now drops it, which lets the first finish.
    let passed = done.fence();
    done.fence().wait_sync().unwrap();
    let mut opener = Flagged::new(&unused);
    opener.opens = Some(first_gate);
    assert!(queue.push(wrap(passed), opener).is_ok());
    let count = entries.len();
    for (fence, value) in entries {
        assert!(queue.push(fence, value).is_ok());
    }
    let handed_back = queue.shutdown_now();
    assert_eq!(handed_back.len(), count, "a fence passed too soon");
    handed_back
}

/// How long a panicking thread's drop may take before the test calls it a hang.
const UNWIND_LIMIT: Duration = Duration::from_secs(10);

/// Drop `kept` on a thread of its own while that thread panics; whether it
/// unwound within [`UNWIND_LIMIT`].
fn dropped_by_a_panic(kept: HandedBack<EventFence<Host>, Flagged>) -> bool {
    let (unwound, unwinds) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _kept = kept;
            panic!("a failing test holding values handed back");
        }));
        let _ = unwound.send(caught.is_err());
    });
    unwinds.recv_timeout(UNWIND_LIMIT).unwrap_or(false)
}

/// A test that fails while it holds values `shutdown_now` handed back, over
/// work it holds back itself (a gate opened only later), must fail, not hang:
/// their drop during the unwind does not wait for the fences, and frees
/// nothing whose fence has not passed.
#[test]
fn values_handed_back_to_a_panicking_thread_do_not_wait_for_their_fences() {
    let held = HostStream::new().unwrap();
    // Opened once the panicking thread is done, or dropped (so opened) as a
    // failed assertion unwinds this thread.
    let gate = Gate::hold(&held);
    let dropped = Arc::default();
    let kept = hand_back(vec![(held.fence(), Flagged::new(&dropped))]);
    assert!(
        dropped_by_a_panic(kept),
        "the handed-back values' drop during the unwind waited for a fence the test holds"
    );
    assert!(!dropped.load(Ordering::SeqCst), "freed before its fence");
    gate.open();
}

/// During a panic, a handed-back value whose fence has passed is dropped; one
/// whose fence has not is leaked: not dropped then, nor once its fence passes.
#[test]
fn a_panicking_thread_drops_the_handed_back_values_that_passed_and_leaks_the_rest() {
    let (later, held) = (HostStream::new().unwrap(), HostStream::new().unwrap());
    let (later_gate, held_gate) = (Gate::hold(&later), Gate::hold(&held));
    let (passed, leaked) = (Arc::default(), Arc::default());
    let kept = hand_back(vec![
        (later.fence(), Flagged::new(&passed)),
        (held.fence(), Flagged::new(&leaked)),
    ]);
    later_gate.open();
    common::eventually(Duration::from_secs(20), "the first fence passed", || {
        kept[0].0.is_passed().unwrap()
    });
    assert!(
        dropped_by_a_panic(kept),
        "the handed-back values' drop during the unwind waited for a fence the test holds"
    );
    assert!(
        passed.load(Ordering::SeqCst),
        "a passed value was not dropped"
    );
    assert!(!leaked.load(Ordering::SeqCst), "freed before its fence");
    held_gate.open();
    held.fence().wait_sync().unwrap();
    assert!(!leaked.load(Ordering::SeqCst), "a leaked value was dropped");
}

/// A fence that, asked to wait, first opens the gate its work is held by.
struct OpensWhenWaited(EventFence<Host>, Arc<std::sync::Mutex<Option<Gate>>>);

impl Fence for OpensWhenWaited {
    fn wait_blocking(self) -> Result<(), device_events::ServerError> {
        if let Some(gate) = self.1.lock().unwrap().take() {
            gate.open();
        }
        self.0.wait_sync()
    }

    fn is_passed(&self) -> Result<bool, device_events::ServerError> {
        self.0.is_complete()
    }
}

/// `HandedBack::wait_then_drop` drops a value only once its fence has
/// passed: here the work behind the fence runs only once it is waited on.
#[test]
fn waiting_on_what_shutdown_now_handed_back_drops_each_value_after_its_fence() {
    let held = HostStream::new().unwrap();
    let gate = Arc::new(std::sync::Mutex::new(Some(Gate::hold(&held))));
    let progress = Progress::default();
    progress.step_on(&held);
    let dropped = Arc::default();
    let early = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut checked = Flagged::new(&dropped);
    checked.after = Some((progress, early.clone()));
    let unused = Arc::default();
    let wrap = |fence| OpensWhenWaited(fence, Arc::clone(&unused));
    let fence = OpensWhenWaited(held.fence(), gate.clone());
    let kept = hand_back_as(wrap, vec![(fence, checked)]);
    assert_eq!(kept.wait_then_drop(), Ok(()));
    assert!(dropped.load(Ordering::SeqCst));
    assert!(!early.load(Ordering::SeqCst), "dropped before its fence");
}

/// `HandedBack::wait_then_drop` settles every value, a failed fence's leaked
/// and the others dropped, and returns the first failure.
#[test]
fn waiting_on_what_shutdown_now_handed_back_settles_every_value_and_returns_the_first_failure() {
    let faulted = ["first-handed-back-fault", "second-handed-back-fault"].map(|message| {
        let stream = faultable_stream();
        stream.launch(move || panic!("{message}")).unwrap();
        let _ = stream.synchronize();
        stream
    });
    let good = HostStream::new().unwrap();
    let gate = Gate::hold(&good);
    let dropped: [Arc<std::sync::atomic::AtomicBool>; 3] = Default::default();
    let kept = hand_back(vec![
        (faulted[0].fence(), Flagged::new(&dropped[0])),
        (good.fence(), Flagged::new(&dropped[1])),
        (faulted[1].fence(), Flagged::new(&dropped[2])),
    ]);
    gate.open();
    let err = kept.wait_then_drop().unwrap_err();
    assert!(err.to_string().contains("first-handed-back-fault"), "{err}");
    let dropped = dropped.each_ref().map(|flag| flag.load(Ordering::SeqCst));
    assert_eq!(
        dropped,
        [false, true, false],
        "only the passed value dropped"
    );
}

/// Values are dropped in push order.
#[test]
fn values_are_dropped_in_push_order() {
    struct Logs(usize, Arc<std::sync::Mutex<Vec<usize>>>);
    impl Drop for Logs {
        fn drop(&mut self) {
            self.1.lock().unwrap().push(self.0);
        }
    }
    let stream = HostStream::new().unwrap();
    let queue = DropQueue::new(8).unwrap();
    let order = Arc::default();
    let gate = Gate::hold(&stream);
    for id in 1..=4 {
        assert!(queue
            .push(stream.fence(), Logs(id, Arc::clone(&order)))
            .is_ok());
    }
    gate.open();
    queue.flush();
    assert_eq!(*order.lock().unwrap(), [1, 2, 3, 4]);
}

/// How [`PushesOnItsQueue`] pushes.
#[derive(Debug, Clone, Copy)]
enum PushWith {
    Blocking,
    Async,
}

/// A value whose drop pushes another value onto its own queue, with
/// `push_blocking` or `push_async`.
struct PushesOnItsQueue {
    /// The queue, and the fence to push the next value with.
    then: Option<(PushingQueue, EventFence<Host>, PushWith)>,
    pushed: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
}

type PushingQueue = Arc<DropQueue<EventFence<Host>, PushesOnItsQueue>>;

impl Drop for PushesOnItsQueue {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::SeqCst);
        if let Some((queue, fence, with)) = self.then.take() {
            let next = PushesOnItsQueue {
                then: None,
                pushed: self.pushed.clone(),
                dropped: self.dropped.clone(),
            };
            let queued = match with {
                PushWith::Blocking => queue.push_blocking(fence, next),
                PushWith::Async => futures::executor::block_on(queue.push_async(fence, next)),
            };
            if queued.is_ok() {
                self.pushed.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// On the queue's own thread `push_blocking` and `push_async` queue past the
/// capacity (only that thread makes room: waiting there would wait for good),
/// even while the queue is closing (the thread drains the queue before it
/// exits).
#[test]
fn pushes_on_the_queues_own_thread_queue_past_the_capacity_and_while_closing() {
    for with in [PushWith::Blocking, PushWith::Async] {
        for closing in [false, true] {
            let case = format!("{with:?}, closing: {closing}");
            let stream = HostStream::new().unwrap();
            let queue = Arc::new(DropQueue::new(1).unwrap());
            let (pushed, dropped) = (Arc::default(), Arc::<AtomicUsize>::default());
            let value = |then| PushesOnItsQueue {
                then,
                pushed: Arc::clone(&pushed),
                dropped: Arc::clone(&dropped),
            };
            let gate = Gate::hold(&stream);
            let first = value(Some((queue.clone(), stream.fence(), with)));
            assert!(queue.push(stream.fence(), first).is_ok());
            if closing {
                queue.close();
            }
            // The value in flight fills the queue until its drop has returned.
            gate.open();
            common::eventually(Duration::from_secs(20), &format!("{case}: pushed"), || {
                pushed.load(Ordering::SeqCst) == 1
            });
            common::eventually(Duration::from_secs(20), &format!("{case}: dropped"), || {
                dropped.load(Ordering::SeqCst) == 2
            });
        }
    }
}
