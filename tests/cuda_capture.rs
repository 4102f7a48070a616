//! Fences and CUDA graph capture: a fence recorded while its stream captures
//! fails its waits at once (it marks a place in the graph, not work that
//! runs), a capturing stream waits only on fences of its own capture, and
//! nothing the crate does (its waiter threads included) invalidates a
//! capture. Runs against the fake driver (`scripts/fake-cuda.sh`, which
//! models capture as an H200 showed it) and on a GPU; without a driver each
//! test says why it skips.
#![cfg(feature = "cuda")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use device_events::cuda::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUresult, CUstreamCaptureMode, CUstreamCaptureStatus,
};
use device_events::cuda::cudarc::driver::CudaStream;
use device_events::cuda::{self, Cuda, CudaStreamHandle};
use device_events::drop_queue::{DropQueue, DropQueueStats};
use device_events::{status, Event, EventApi, EventFlags, ServerError, Waiter};

use common::fake_driver;
use common::gpu::gpu;

const GLOBAL: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
const RELAXED: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;

/// A capture begun in the default global mode is broken by a potentially
/// unsafe call from any other thread in that mode (the driver's rule for
/// `CU_STREAM_CAPTURE_MODE_GLOBAL`). These tests hold global captures open
/// and one synchronizes a capturing stream on purpose, which a driver may
/// count as such a call as well as breaking its own capture: one test at a
/// time, so that no test breaks another's capture.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// End the capture on `stream`: the graph's instantiation, or the driver's
/// error (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` for a broken capture).
fn end(stream: &Arc<CudaStream>) -> Result<(), String> {
    match stream.end_capture(CUgraphInstantiate_flags(0)) {
        Ok(Some(graph)) => graph.launch().map_err(|err| format!("launch: {err:?}")),
        Ok(None) => Err("no graph".to_owned()),
        Err(err) => Err(format!("{err:?}")),
    }
}

/// `future` on its own thread, or `None` if it has not finished within a
/// generous bound: a wait that hangs fails the test instead of hanging it.
fn finish<T: Send + 'static>(
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> Option<T> {
    let (sent, received) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = sent.send(futures::executor::block_on(future));
    });
    received.recv_timeout(Duration::from_secs(20)).ok()
}

#[test]
fn a_fence_recorded_during_capture_fails_its_waits_at_once_and_leaves_the_capture_intact() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_fence_recorded_during_capture_fails_its_waits_at_once") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    stream.begin_capture(GLOBAL).unwrap();
    sleep.launch(&stream, Duration::from_millis(5)).unwrap();
    let fence = cuda::fence(&stream);
    assert!(
        !fence.is_resolved_at_creation(),
        "recording is legal under capture"
    );
    let captured = |err: ServerError| {
        assert_eq!(err.code(), Some(status::CAPTURED_EVENT), "{err}");
        assert!(err.is_stream_capture());
        assert!(err.to_string().contains("capturing a CUDA graph"), "{err}");
    };
    captured(fence.is_complete().unwrap_err());
    captured(cuda::fence(&stream).wait_sync().unwrap_err());
    let waiter = Waiter::builder().build();
    let awaited = finish(waiter.wait(cuda::fence(&stream))).expect("the await did not hang");
    captured(awaited.unwrap_err());
    drop(fence);
    end(&stream).expect("the capture is intact");
    // The graph ran the captured sleep; a fence recorded now waits for it.
    cuda::fence(&stream).wait_sync().unwrap();
}

#[test]
fn waits_on_other_streams_during_a_global_capture_leave_it_intact() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("waits_on_other_streams_during_a_global_capture_leave_it_intact")
    else {
        return;
    };
    let capturing = ctx.new_stream().unwrap();
    let busy = ctx.new_stream().unwrap();
    sleep.launch(&busy, Duration::from_millis(50)).unwrap();
    let awaited = cuda::fence(&busy);
    let blocked = cuda::fence(&busy);
    let queried = cuda::fence(&busy);
    let waiter = Waiter::builder().build();
    // This thread captures in the global mode, the default: the driver then
    // prohibits queries and waits on every thread in the global mode.
    capturing.begin_capture(GLOBAL).unwrap();
    // Polled first on a user thread, then waited on by the waiter's own.
    let resolved = finish(waiter.wait(awaited)).expect("the await did not hang");
    assert_eq!(resolved, Ok(()));
    // On another user thread, in its default (global) mode; its stream's
    // synchronize too.
    let busy_handle = CudaStreamHandle::new(&busy);
    let other = std::thread::spawn(move || {
        blocked
            .wait_sync()
            .and(Cuda::stream_synchronize(busy_handle))
    });
    assert_eq!(other.join().unwrap(), Ok(()));
    // On the capturing thread itself.
    assert_eq!(queried.is_complete(), Ok(true));
    end(&capturing).expect("no wait of the crate invalidated the capture");
}

/// A user's thread is relaxed only for the crate's own calls: it gets its
/// mode back, so its own potentially unsafe calls are still prohibited while
/// another thread captures in the global mode, as the driver rules.
#[test]
fn a_users_thread_gets_its_capture_mode_back() {
    let _serial = serial();
    let Some((ctx, _)) = gpu("a_users_thread_gets_its_capture_mode_back") else {
        return;
    };
    let capturing = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let fence = cuda::fence(&other);
    capturing.begin_capture(GLOBAL).unwrap();
    let user = std::thread::spawn(move || {
        fence.wait_sync().unwrap(); // relaxed for the crate's call
        other.synchronize() // the user's own, in the thread's global mode
    });
    let err = user.join().unwrap().unwrap_err();
    assert_eq!(err.0, CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert!(
        end(&capturing).is_err(),
        "the user's call broke the capture"
    );
}

#[test]
fn a_capturing_stream_waits_only_on_fences_of_its_own_capture() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_capturing_stream_waits_only_on_fences_of_its_own_capture")
    else {
        return;
    };
    let capturing = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let (capturing_handle, other_handle) = (
        CudaStreamHandle::new(&capturing),
        CudaStreamHandle::new(&other),
    );
    sleep.launch(&other, Duration::from_millis(5)).unwrap();
    let outside = cuda::fence(&other);
    capturing.begin_capture(GLOBAL).unwrap();
    // Recorded outside the capture: refused, with no host wait and no call
    // that would break the capture.
    let err = outside.wait_async(capturing_handle).unwrap_err();
    assert_eq!(err.code(), Some(status::STREAM_CAPTURE_ISOLATION), "{err}");
    assert!(err.to_string().contains("recorded outside"), "{err}");
    // Recorded inside: the other stream joins the capture (fork), and the
    // capturing stream waits on the other's work in the graph (join).
    sleep.launch(&capturing, Duration::from_millis(1)).unwrap();
    cuda::fence(&capturing).wait_async(other_handle).unwrap();
    sleep.launch(&other, Duration::from_millis(1)).unwrap();
    cuda::fence(&other).wait_async(capturing_handle).unwrap();
    end(&capturing).expect("the capture is intact");
    cuda::fence(&capturing).wait_sync().unwrap();
}

#[test]
fn a_capturing_stream_is_not_synchronized_and_a_refused_record_does_not_fall_back() {
    let _serial = serial();
    let Some((ctx, _)) = gpu("a_capturing_stream_is_not_synchronized") else {
        return;
    };
    let capturing = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&capturing);
    capturing.begin_capture(GLOBAL).unwrap();
    let err = Cuda::stream_synchronize(handle).unwrap_err();
    assert_eq!(
        err.code(),
        Some(status::STREAM_CAPTURE_UNSUPPORTED),
        "{err}"
    );
    assert!(err.is_stream_capture());
    assert_eq!(
        capturing.capture_status().unwrap(),
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE,
        "refused before the driver, which would have invalidated the capture"
    );
    // Break the capture as a user can: synchronizing it through cudarc.
    assert!(capturing.synchronize().is_err());
    // The record is refused (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) or marks
    // a dead capture's graph: either way the fence fails with a capture
    // status, and never synchronizes the stream instead.
    let fence = cuda::fence(&capturing);
    assert!(
        fence.fallback_cause().is_none(),
        "{:?}",
        fence.fallback_cause()
    );
    let err = fence.wait_sync().unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    let ended = capturing.end_capture(CUgraphInstantiate_flags(0));
    assert!(ended.is_err(), "the capture was invalidated on purpose");
}

#[test]
fn a_drop_queue_leaks_a_value_whose_fence_was_recorded_during_capture() {
    let _serial = serial();
    let Some((ctx, sleep)) =
        gpu("a_drop_queue_leaks_a_value_whose_fence_was_recorded_during_capture")
    else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    stream.begin_capture(GLOBAL).unwrap();
    sleep.launch(&stream, Duration::from_millis(1)).unwrap();
    let fence = cuda::fence(&stream);
    end(&stream).expect("the capture is intact");
    // The graph may be launched again at any time: a buffer its captured work
    // reads is never known to be free, so it is leaked, not dropped (the
    // stream is no longer capturing, so a synchronize would succeed).
    let dropped = Arc::new(());
    let queue = device_events::drop_queue::DropQueue::new(4).unwrap();
    queue.push(fence, dropped.clone()).unwrap();
    queue.flush();
    let stats = queue.stats();
    assert_eq!((stats.dropped, stats.leaked), (0, 1), "{stats:?}");
    assert_eq!(Arc::strong_count(&dropped), 2, "the value was not dropped");
}

/// A value that counts its drop in `dropped`.
struct Staged(Arc<AtomicUsize>);

impl Drop for Staged {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Push a value behind `fence` into a drop queue and settle it: how many
/// values the queue dropped (the rest it kept, leaked).
fn dropped_behind(fence: device_events::cuda::CudaFence) -> (usize, DropQueueStats) {
    let dropped = Arc::new(AtomicUsize::new(0));
    let queue = DropQueue::new(4).unwrap();
    assert!(queue.push(fence, Staged(dropped.clone())).is_ok());
    queue.flush();
    let stats = queue.stats();
    (dropped.load(Ordering::SeqCst), stats)
}

/// A capture another thread ends right after the record took the fence
/// into it (the fake driver makes that race in the call): the fence knows
/// it may be in the graph, and its value is kept, never freed.
#[test]
fn a_capture_ended_during_the_record_never_frees_the_fences_value() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_capture_ended_during_the_record_never_frees_the_fences_value")
    else {
        return;
    };
    if !fake_driver::is_fake() {
        eprintln!("a real driver: the race inside cuEventRecord needs the fake driver's hook");
        return;
    }
    let stream = ctx.new_stream().unwrap();
    stream.begin_capture(RELAXED).unwrap();
    sleep.launch(&stream, Duration::from_millis(1)).unwrap();
    fake_driver::call(c"fakeCudaCaptureInNextRecord", 1);
    let fence = cuda::fence(&stream);
    assert_ne!(fake_driver::call(c"fakeCudaLastRecordCapture", 0), Some(0));
    assert_eq!(
        stream.capture_status().unwrap(),
        CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        "the capture ended inside the record"
    );
    let err = fence.is_complete().unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    // Known from the two questions around the record, not left to the
    // driver's answer once the capture has ended.
    assert!(err.to_string().contains("began or ended"), "{err}");
    let (dropped, stats) = dropped_behind(fence);
    assert_eq!(
        (dropped, stats.dropped, stats.leaked),
        (0, 0, 1),
        "{stats:?}"
    );
}

/// A whole capture begun and ended (on another thread) inside the record:
/// nothing before or after the call shows it, and the driver's answer for
/// the event (`CUDA_ERROR_INVALID_VALUE`) is read as "may be captured".
#[test]
fn a_whole_capture_inside_the_record_never_frees_the_fences_value() {
    let _serial = serial();
    let Some((ctx, _)) = gpu("a_whole_capture_inside_the_record_never_frees_the_fences_value")
    else {
        return;
    };
    if !fake_driver::is_fake() {
        eprintln!("a real driver: the race inside cuEventRecord needs the fake driver's hook");
        return;
    }
    let stream = ctx.new_stream().unwrap();
    fake_driver::call(c"fakeCudaCaptureInNextRecord", 2);
    let fence = cuda::fence(&stream);
    assert_ne!(fake_driver::call(c"fakeCudaLastRecordCapture", 0), Some(0));
    let err = fence.is_complete().unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_VALUE"),
        "{err}"
    );
    let (dropped, stats) = dropped_behind(fence);
    assert_eq!(
        (dropped, stats.dropped, stats.leaked),
        (0, 0, 1),
        "{stats:?}"
    );
}

/// One thread begins and ends relaxed captures of a stream while another
/// records fences on it and queues a value behind each: no value whose
/// fence's record a capture took is ever dropped. On the fake driver each
/// record's capture is known (`fakeCudaLastRecordCapture`); on a GPU the
/// race runs and must neither hang nor panic.
#[test]
fn fences_recorded_beside_captures_begun_and_ended_never_free_a_captured_value() {
    let _serial = serial();
    let Some((ctx, _)) = gpu("fences_recorded_beside_captures_never_free_a_captured_value") else {
        return;
    };
    const FENCES: usize = 3000;
    let stream = ctx.new_stream().unwrap();
    let queue = Arc::new(DropQueue::new(FENCES).unwrap());
    let recording = Arc::new(AtomicBool::new(true));
    let captured_dropped = Arc::new(AtomicUsize::new(0));
    let other_dropped = Arc::new(AtomicUsize::new(0));
    let recorder = {
        let (stream, queue, recording) = (stream.clone(), queue.clone(), recording.clone());
        let (captured_dropped, other_dropped) = (captured_dropped.clone(), other_dropped.clone());
        std::thread::spawn(move || {
            let mut captured = 0usize;
            for _ in 0..FENCES {
                let fence = cuda::fence(&stream);
                let in_capture =
                    fake_driver::call(c"fakeCudaLastRecordCapture", 0).is_some_and(|id| id != 0);
                captured += usize::from(in_capture);
                let counter = if in_capture {
                    captured_dropped.clone()
                } else {
                    other_dropped.clone()
                };
                assert!(queue.push(fence, Staged(counter)).is_ok());
            }
            recording.store(false, Ordering::SeqCst);
            captured
        })
    };
    let mut captures = 0usize;
    while recording.load(Ordering::SeqCst) {
        stream.begin_capture(RELAXED).unwrap();
        std::thread::yield_now();
        // Ended by this thread, which began it; the graph is never launched.
        let _ = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
        captures += 1;
        // Outside a capture as long as inside, so that records land on both
        // sides of a capture's begin and end.
        std::thread::yield_now();
    }
    let captured = recorder.join().unwrap();
    queue.flush();
    let stats = queue.stats();
    eprintln!("{FENCES} fences beside {captures} captures, {captured} taken by one: {stats:?}");
    assert_eq!(
        captured_dropped.load(Ordering::SeqCst),
        0,
        "values behind fences a capture took were dropped: {stats:?}"
    );
    assert_eq!(stats.dropped + stats.leaked, FENCES as u64, "{stats:?}");
    if fake_driver::is_fake() {
        assert!(
            captured > 0,
            "no record raced a capture: the test proves nothing"
        );
    }
    // With no capture racing, a fence passes and its value is dropped. (In
    // the race, a loaded machine may see a capture begin or end around every
    // record, and keep every value: correct, if conservative.)
    let (dropped, stats) = dropped_behind(cuda::fence(&stream));
    assert_eq!(dropped, 1, "a fence outside any capture passes: {stats:?}");
}

/// Two captures going on at once: a fence of one is refused to the other's
/// stream before the driver, which would merge and invalidate both.
#[test]
fn a_fence_of_another_capture_is_refused_and_both_captures_stay_intact() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_fence_of_another_capture_is_refused") else {
        return;
    };
    let first = ctx.new_stream().unwrap();
    let second = ctx.new_stream().unwrap();
    first.begin_capture(GLOBAL).unwrap();
    second.begin_capture(GLOBAL).unwrap();
    sleep.launch(&first, Duration::from_millis(1)).unwrap();
    let fence = cuda::fence(&first);
    let err = fence
        .wait_async(CudaStreamHandle::new(&second))
        .unwrap_err();
    assert_eq!(err.code(), Some(status::STREAM_CAPTURE_MERGE), "{err}");
    assert!(err.to_string().contains("another capture"), "{err}");
    drop(fence);
    end(&second).expect("the waiting stream's capture is intact");
    end(&first).expect("the fence's capture is intact");
}

/// A fence recorded in a capture that has ended marks a place in a graph:
/// a stream that is not capturing is refused a wait on it, with no host
/// wait in its place.
#[test]
fn a_wait_on_a_fence_of_an_ended_capture_is_refused() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_wait_on_a_fence_of_an_ended_capture_is_refused") else {
        return;
    };
    let capturing = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    capturing.begin_capture(GLOBAL).unwrap();
    sleep.launch(&capturing, Duration::from_millis(1)).unwrap();
    let fence = cuda::fence(&capturing);
    end(&capturing).expect("the capture is intact");
    let err = fence.wait_async(CudaStreamHandle::new(&other)).unwrap_err();
    assert_eq!(err.code(), Some(status::CAPTURED_EVENT), "{err}");
    assert!(err.to_string().contains("capture that has ended"), "{err}");
    // While the capture goes on, a stream that is not capturing may wait on
    // it: it joins the capture (a fork), as the driver allows.
    capturing.begin_capture(GLOBAL).unwrap();
    let fence = cuda::fence(&capturing);
    fence.wait_async(CudaStreamHandle::new(&other)).unwrap();
    cuda::fence(&other)
        .wait_async(CudaStreamHandle::new(&capturing))
        .unwrap();
    end(&capturing).expect("the joined capture is intact");
    // Refused as ended to a stream in another capture too (not as a merge of
    // two captures), and once the capturing stream is gone.
    let ended = {
        let gone = ctx.new_stream().unwrap();
        gone.begin_capture(GLOBAL).unwrap();
        sleep.launch(&gone, Duration::from_millis(1)).unwrap();
        let fence = cuda::fence(&gone);
        end(&gone).expect("the capture is intact");
        fence
    };
    for capturing_too in [false, true] {
        if capturing_too {
            other.begin_capture(GLOBAL).unwrap();
        }
        let err = ended.wait_async(CudaStreamHandle::new(&other)).unwrap_err();
        assert_eq!(err.code(), Some(status::CAPTURED_EVENT), "{err}");
    }
    end(&other).expect("the refused wait left the capture intact");
}

/// Timing events recorded in a capture mark places in a graph: their elapsed
/// time is refused, during the capture (which the driver's answer would
/// invalidate) and after it.
#[test]
fn elapsed_time_between_captured_events_is_refused_and_the_capture_left_intact() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("elapsed_time_between_captured_events_is_refused") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let start = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
    let stop = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
    stream.begin_capture(GLOBAL).unwrap();
    start.record(handle).unwrap();
    sleep.launch(&stream, Duration::from_millis(1)).unwrap();
    stop.record(handle).unwrap();
    let during = stop.elapsed_since(&start).unwrap_err();
    assert!(during.is_stream_capture(), "{during}");
    end(&stream).expect("the capture is intact");
    let after = stop.elapsed_since(&start).unwrap_err();
    assert_eq!(after.code(), Some(status::CAPTURED_EVENT), "{after}");
}

/// While an event's record is in the driver, whether it lands in a capture
/// (another thread's, begun meanwhile) is not known: a query from another
/// thread is refused, not answered for the previous record.
#[test]
fn a_query_while_a_record_is_in_the_driver_is_refused() {
    let _serial = serial();
    let Some((ctx, _)) = gpu("a_query_while_a_record_is_in_the_driver_is_refused") else {
        return;
    };
    if !fake_driver::is_fake() {
        eprintln!("a real driver: holding a record in the driver needs the fake driver's hook");
        return;
    }
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let event = Arc::new(Event::<Cuda>::new(handle, EventFlags::FENCE).unwrap());
    event.record(handle).unwrap();
    event.wait_sync().unwrap();
    fake_driver::call(c"fakeCudaHoldNextRecord", 1);
    let recording = {
        let event = event.clone();
        std::thread::spawn(move || event.record(handle))
    };
    common::eventually(Duration::from_secs(20), "the record is held", || {
        fake_driver::call(c"fakeCudaRecordHeld", 0) == Some(1)
    });
    let during = event.is_complete();
    fake_driver::call(c"fakeCudaHoldNextRecord", 0);
    recording.join().unwrap().unwrap();
    let err = during.unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    event.wait_sync().unwrap();
}

/// The legacy default stream orders with every blocking stream of its
/// context, so a fence, a wait or a synchronize on it while one of them
/// captures would be an implicit dependency on the capture: refused, and the
/// capture left intact.
#[test]
fn the_legacy_stream_is_refused_fences_and_waits_while_a_blocking_stream_captures() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("the_legacy_stream_is_refused_fences_and_waits") else {
        return;
    };
    let legacy = ctx.default_stream();
    let before = cuda::fence(&ctx.new_stream().unwrap());
    // The per-thread default stream is a blocking one.
    let blocking = ctx.per_thread_stream();
    blocking.begin_capture(GLOBAL).unwrap();
    sleep.launch(&blocking, Duration::from_millis(1)).unwrap();
    let fence = cuda::fence(&legacy);
    let err = fence.wait_sync().unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    let err = before
        .wait_async(CudaStreamHandle::new(&legacy))
        .unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    // The driver's answer to the capture query: a synchronize would break the capture.
    let err = Cuda::stream_synchronize(CudaStreamHandle::new(&legacy)).unwrap_err();
    assert!(err.is_stream_capture(), "{err}");
    end(&blocking).expect("the blocking stream's capture is intact");
    cuda::fence(&legacy).wait_sync().unwrap();
}
