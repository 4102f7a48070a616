//! Fences and CUDA graph capture: a fence recorded while its stream captures
//! fails its waits at once (it marks a place in the graph, not work that
//! runs), a capturing stream waits only on fences of its own capture, and
//! nothing the crate does (its waiter threads included) invalidates a
//! capture. Runs against the fake driver (`scripts/fake-cuda.sh`, which
//! models capture as an H200 showed it) and on a GPU; without a driver each
//! test says why it skips.
#![cfg(feature = "cuda")]

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use device_events::cuda::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus,
};
use device_events::cuda::cudarc::driver::CudaStream;
use device_events::cuda::{self, Cuda, CudaStreamHandle};
use device_events::{status, EventApi, ServerError, Waiter};

use common::gpu::gpu;

const GLOBAL: CUstreamCaptureMode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;

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
    // On another user thread, in its default (global) mode.
    let other = std::thread::spawn(move || blocked.wait_sync());
    assert_eq!(other.join().unwrap(), Ok(()));
    // On the capturing thread itself.
    assert_eq!(queried.is_complete(), Ok(true));
    end(&capturing).expect("no wait of the crate invalidated the capture");
}

#[test]
fn a_capturing_stream_waits_only_on_fences_of_its_own_capture() {
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
