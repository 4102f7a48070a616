//! The CUDA backend on a real GPU. Without a driver or device each test prints
//! why it skips and passes; with `DEVICE_EVENTS_REQUIRE_CUDA=1` it fails
//! instead.
#![cfg(feature = "cuda")]

mod common;

use std::time::{Duration, Instant};

use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
use device_events::{Event, EventApi, EventFence, EventFlags, ServerError};

use common::gpu::{gpu, required};

/// Long enough that a host call returning before it ends did not wait for it.
const LONG: Duration = Duration::from_millis(300);

#[test]
fn without_a_driver_the_backend_is_unavailable_not_a_panic() {
    match cuda::context(0) {
        Ok(_) => assert!(cuda::is_available()),
        Err(err) => {
            assert!(!required(), "DEVICE_EVENTS_REQUIRE_CUDA=1 but {err}");
            assert!(err.is_unavailable(), "{err}");
            assert!(!cuda::is_available());
            eprintln!("no CUDA here, as expected on this machine: {err}");
        }
    }
}

#[test]
fn wait_sync_waits_for_device_work() {
    let Some((ctx, sleep)) = gpu("wait_sync_waits_for_device_work") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let launched = Instant::now();
    sleep.launch(&stream, LONG).unwrap();
    let fence = cuda::fence(&stream);
    assert_eq!(format!("{fence:?}"), "CudaFence");
    assert!(!fence.is_resolved_at_creation());
    // Unless this thread was descheduled for the kernel's whole length.
    let complete = fence.is_complete().unwrap();
    assert!(
        !complete || launched.elapsed() >= LONG,
        "the kernel is still running"
    );
    let started = Instant::now();
    fence.wait_sync().unwrap();
    assert!(started.elapsed() > Duration::ZERO);
    let after = cuda::fence(&stream);
    assert!(
        after.is_complete().unwrap(),
        "nothing queued after the kernel"
    );
}

#[test]
fn wait_async_orders_streams_on_the_device_without_blocking_the_host() {
    let Some((ctx, sleep)) =
        gpu("wait_async_orders_streams_on_the_device_without_blocking_the_host")
    else {
        return;
    };
    let producer = ctx.new_stream().unwrap();
    let consumer = ctx.new_stream().unwrap();
    let launched = Instant::now();
    sleep.launch(&producer, LONG).unwrap();
    let producer_done = cuda::fence(&producer);
    cuda::fence(&producer)
        .wait_async(CudaStreamHandle::new(&consumer))
        .unwrap();
    let consumer_done = cuda::fence(&consumer);
    let (producer_complete, consumer_complete) = (
        producer_done.is_complete().unwrap(),
        consumer_done.is_complete().unwrap(),
    );
    // Unless this thread was descheduled for the kernel's whole length: returned while the
    // producer still runs (the host did not wait), and the consumer waits on the device.
    if launched.elapsed() < LONG {
        assert!(!producer_complete, "the host waited for the producer");
        assert!(
            !consumer_complete,
            "the consumer did not wait on the device"
        );
    }
    // The consumer never runs ahead of the producer, however late this thread ran.
    assert!(!consumer_complete || producer_done.is_complete().unwrap());
    consumer_done.wait_sync().unwrap();
    assert!(
        producer_done.is_complete().unwrap(),
        "the consumer ran after the producer"
    );
}

#[test]
fn a_fence_recorded_on_another_thread_orders_streams() {
    let Some((ctx, sleep)) = gpu("a_fence_recorded_on_another_thread_orders_streams") else {
        return;
    };
    // The fence is recorded on a fresh thread, which has no current context
    // until the backend binds the stream's.
    let producer = ctx.new_stream().unwrap();
    let consumer = ctx.new_stream().unwrap();
    sleep.launch(&producer, LONG).unwrap();
    let handle = CudaStreamHandle::new(&producer);
    let fence = std::thread::spawn(move || EventFence::<Cuda>::new(handle))
        .join()
        .unwrap();
    let producer_done = cuda::fence(&producer);
    fence.wait_async(CudaStreamHandle::new(&consumer)).unwrap();
    cuda::fence(&consumer).wait_sync().unwrap();
    assert!(producer_done.is_complete().unwrap());
}

#[test]
fn a_fence_is_waited_on_from_a_thread_with_no_current_context() {
    let Some((ctx, sleep)) = gpu("a_fence_is_waited_on_from_a_thread_with_no_current_context")
    else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    sleep.launch(&stream, LONG).unwrap();
    let fence = cuda::fence(&stream);
    let probe = cuda::fence(&stream);
    std::thread::spawn(move || fence.wait_sync())
        .join()
        .unwrap()
        .unwrap();
    assert!(probe.is_complete().unwrap());
}

#[test]
fn events_query_wait_and_time_device_work() {
    let Some((ctx, sleep)) = gpu("events_query_wait_and_time_device_work") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let start = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
    let end = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
    assert!(end.is_complete().unwrap(), "never recorded: complete");
    start.record(handle).unwrap();
    let launched = Instant::now();
    sleep.launch(&stream, Duration::from_millis(50)).unwrap();
    end.record(handle).unwrap();
    // Unless this thread was descheduled for the kernel's whole length.
    let complete = end.is_complete().unwrap();
    assert!(!complete || launched.elapsed() >= Duration::from_millis(50));
    end.wait_sync().unwrap();
    assert!(end.is_complete().unwrap());
    let elapsed = end.elapsed_since(&start).unwrap();
    assert!(elapsed >= Duration::from_millis(49), "{elapsed:?}");

    let untimed = Event::<Cuda>::new(handle, EventFlags::FENCE).unwrap();
    untimed.record(handle).unwrap();
    untimed.wait_sync().unwrap();
    assert!(
        untimed.elapsed_since(&start).is_err(),
        "fence events carry no timing"
    );
}

#[test]
fn a_dropped_stream_handle_is_an_error_and_a_fence_outlives_its_stream() {
    let Some((ctx, sleep)) =
        gpu("a_dropped_stream_handle_is_an_error_and_a_fence_outlives_its_stream")
    else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    sleep.launch(&stream, Duration::from_millis(20)).unwrap();
    let fence = cuda::fence(&stream);
    drop(stream);
    assert!(handle.stream().is_none());
    let err = Cuda::stream_synchronize(handle).unwrap_err();
    assert_eq!(
        err.code(),
        Some(device_events::status::INVALID_HANDLE),
        "{err}"
    );
    fence.wait_sync().unwrap();
    let err = EventFence::<Cuda>::new(handle).wait_sync().unwrap_err();
    assert!(
        matches!(
            err,
            ServerError::Call {
                code: device_events::status::INVALID_HANDLE,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn awaited_fences_on_real_streams_resolve_in_a_join() {
    let Some((ctx, sleep)) = gpu("awaited_fences_on_real_streams_resolve_in_a_join") else {
        return;
    };
    let streams: Vec<_> = (0..4).map(|_| ctx.new_stream().unwrap()).collect();
    for (i, stream) in streams.iter().enumerate() {
        sleep
            .launch(stream, Duration::from_millis(20 * (i as u64 + 1)))
            .unwrap();
    }
    let probes: Vec<_> = streams.iter().map(cuda::fence).collect();
    let waits: Vec<_> = streams
        .iter()
        .map(|stream| cuda::fence(stream).wait())
        .collect();
    let results = futures::executor::block_on(futures::future::join_all(waits));
    for result in results {
        result.unwrap();
    }
    for probe in probes {
        assert!(probe.is_complete().unwrap());
    }
}

#[test]
fn an_await_on_tokio_does_not_block_the_runtime_and_can_be_cancelled() {
    let Some((ctx, sleep)) =
        gpu("an_await_on_tokio_does_not_block_the_runtime_and_can_be_cancelled")
    else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let waiter = device_events::Waiter::builder().build();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let launched = Instant::now();
    sleep.launch(&stream, LONG).unwrap();
    let fence = cuda::fence(&stream);
    let probe = cuda::fence(&stream);
    let timed_out = runtime.block_on(async {
        tokio::time::timeout(Duration::from_millis(10), waiter.wait(fence)).await
    });
    let complete = probe.is_complete().unwrap();
    // Unless this thread was descheduled for the kernel's whole length.
    if launched.elapsed() < LONG {
        assert!(timed_out.is_err(), "cancelled before the kernel ended");
        assert!(!complete, "dropping the future did not wait");
    }
    // The stream and the waiter still serve.
    let after = cuda::fence(&stream);
    runtime.block_on(waiter.wait(after)).unwrap();
    assert!(probe.is_complete().unwrap());
}

#[test]
fn many_awaits_on_few_streams_use_few_threads() {
    let Some((ctx, sleep)) = gpu("many_awaits_on_few_streams_use_few_threads") else {
        return;
    };
    let waiter = device_events::Waiter::builder().build();
    let streams: Vec<_> = (0..8).map(|_| ctx.new_stream().unwrap()).collect();
    let mut waits = Vec::new();
    for _ in 0..250 {
        for stream in &streams {
            sleep.launch(stream, Duration::from_micros(200)).unwrap();
            waits.push(waiter.wait(cuda::fence(stream)));
        }
    }
    for result in futures::executor::block_on(futures::future::join_all(waits)) {
        result.unwrap();
    }
    // One lane thread per busy stream; a few more when streams empty and
    // refill faster than notified idle threads wake (never past max_threads).
    // And the watcher of their progress words, where the device keeps them.
    assert!(
        waiter.peak_threads() <= 17,
        "peak {}",
        waiter.peak_threads()
    );
}

#[test]
fn the_profiler_times_device_work_sync_and_by_await() {
    let Some((ctx, sleep)) = gpu("the_profiler_times_device_work_sync_and_by_await") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let profiler = device_events::EventProfiler::<Cuda>::new();
    for round in 0..20 {
        let start = profiler.start(handle).unwrap();
        sleep.launch(&stream, Duration::from_millis(2)).unwrap();
        let profile = profiler.stop(start, handle).unwrap();
        let elapsed = if round % 2 == 0 {
            profile.wait_sync().unwrap()
        } else {
            futures::executor::block_on(profile.wait()).unwrap()
        };
        assert!(elapsed >= Duration::from_micros(1_900), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(1), "{elapsed:?}");
    }
    assert!(profiler.created() <= 4, "created {}", profiler.created());
}

#[test]
fn a_profile_started_on_a_busy_stream_and_stopped_on_an_idle_one_waits_for_both() {
    let Some((ctx, sleep)) =
        gpu("a_profile_started_on_a_busy_stream_and_stopped_on_an_idle_one_waits_for_both")
    else {
        return;
    };
    let busy = ctx.new_stream().unwrap();
    let idle = ctx.new_stream().unwrap();
    let (busy, idle) = (CudaStreamHandle::new(&busy), CudaStreamHandle::new(&idle));
    let profiler = device_events::EventProfiler::<Cuda>::new();
    let waiter = device_events::Waiter::builder().build();
    for by_await in [false, true] {
        let launched = Instant::now();
        sleep.launch(&busy.stream().unwrap(), LONG).unwrap();
        let start = profiler.start(busy).unwrap();
        let profile = profiler.stop(start, idle).unwrap();
        // A test thread kept off its core for the whole kernel stopped after it.
        let stopped_behind = launched.elapsed() >= LONG;
        // cuEventElapsedTime is CUDA_ERROR_NOT_READY until both are complete;
        // once they are, its time is negative (the stop was reached first),
        // which the profile reports as StopBeforeStart, not as a zero.
        let elapsed = if by_await {
            futures::executor::block_on(waiter.wait(profile))
        } else {
            profile.wait_sync()
        };
        let before_start = matches!(
            elapsed,
            Err(device_events::ServerError::StopBeforeStart {
                backend: "Cuda",
                ..
            })
        );
        assert!(
            before_start || stopped_behind && elapsed.is_ok(),
            "by await: {by_await}: {elapsed:?}"
        );
    }
}

/// Fence and timing events are made with `CU_EVENT_BLOCKING_SYNC`, so a
/// thread waiting on one sleeps in the driver ("the calling CPU thread will
/// block"; without it `cuEventSynchronize` busy-waits), and fence events
/// without timing. Fake driver only: it reports the flags.
#[test]
fn events_are_made_to_sleep_not_spin() {
    const BLOCKING_SYNC: i32 = 0x1;
    const DISABLE_TIMING: i32 = 0x2;
    let Some((ctx, _)) = gpu("events_are_made_to_sleep_not_spin") else {
        return;
    };
    let last_flags = || common::fake_driver::call(c"fakeCudaLastEventFlags", 0);
    if last_flags().is_none() {
        eprintln!("a real driver: the event flags need the fake driver");
        return;
    }
    let stream = ctx.new_stream().unwrap();
    // More than the context's pool keeps idle: some are made on this thread.
    let fences: Vec<_> = (0..600).map(|_| cuda::fence(&stream)).collect();
    assert_eq!(last_flags(), Some(BLOCKING_SYNC | DISABLE_TIMING));
    drop(fences);
    let _timing = Event::<Cuda>::new(CudaStreamHandle::new(&stream), EventFlags::TIMING).unwrap();
    assert_eq!(last_flags(), Some(BLOCKING_SYNC));
}

/// A refused record leaves the event as its last record left it: reached,
/// and answered so; a fence's refused record synchronizes its stream instead,
/// and its event is not left in use (fake driver only: it refuses a record
/// on demand).
#[test]
fn a_refused_record_leaves_the_events_last_record() {
    let Some((ctx, _)) = gpu("a_refused_record_leaves_the_events_last_record") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let event = Event::<Cuda>::new(handle, EventFlags::FENCE).unwrap();
    event.record(handle).unwrap();
    event.wait_sync().unwrap();
    // CUDA_ERROR_UNKNOWN, which the crate reads as nothing in particular.
    if common::fake_driver::call(c"fakeCudaFailNextRecord", 999) != Some(0) {
        eprintln!("a real driver: refusing a record needs the fake driver");
        return;
    }
    let err = event.record(handle).unwrap_err();
    assert_eq!(err.code(), Some(999), "{err}");
    assert_eq!(event.is_complete(), Ok(true));
    event.wait_sync().unwrap();
    // A fence whose record is refused synchronizes its stream instead.
    common::fake_driver::call(c"fakeCudaFailNextRecord", 999);
    let fence = cuda::fence(&stream);
    assert_eq!(
        fence.fallback_cause().and_then(ServerError::code),
        Some(999)
    );
    assert!(fence.is_resolved_at_creation());
    fence.wait_sync().unwrap();
    // Its event is not left in use: only `event` is. (Given back or
    // destroyed: the context's pool is shared with other tests, so which is
    // not this test's to see.)
    assert_eq!(cuda::live_events(&stream).count(), 1);
}

/// cudarc's error-name lookup loads the driver library (and panics without
/// one): converting its error must not, with or without a driver.
#[test]
fn a_cudarc_error_converts_without_a_driver_and_without_a_panic() {
    use device_events::cuda::cudarc::driver::{result::DriverError, sys};
    let err = ServerError::from(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
    assert_eq!(err.code(), Some(device_events::status::INVALID_VALUE));
    assert!(
        err.to_string().contains("CUDA_ERROR_INVALID_VALUE"),
        "{err}"
    );
    let sticky = ServerError::from(DriverError(sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
    assert!(sticky.is_faulted(), "{sticky}");
    // With a driver loaded, cudarc's error is the source; without one it is
    // left out (its `Display` would ask the missing driver). Either way the
    // whole chain prints without a panic.
    let loaded = cuda::is_available();
    let err = ServerError::from(DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE));
    let source = std::error::Error::source(&err);
    assert_eq!(source.is_some(), loaded, "{err:?}");
    if let Some(source) = source {
        assert!(!source.to_string().is_empty());
        let driver = err
            .error_source()
            .and_then(|s| s.downcast_ref::<DriverError>());
        assert_eq!(
            driver,
            Some(&DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE))
        );
    }
}

#[test]
fn any_fence_holds_and_awaits_a_cuda_fence() {
    let Some((ctx, sleep)) = gpu("any_fence_holds_and_awaits_a_cuda_fence") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let launched = Instant::now();
    sleep.launch(&stream, Duration::from_millis(20)).unwrap();
    let fence = device_events::AnyFence::from(cuda::fence(&stream));
    assert_eq!(fence.backend(), "Cuda");
    let running = !fence.is_complete().unwrap();
    // Unless this thread was descheduled for the kernel's whole length.
    assert!(
        running || launched.elapsed() >= Duration::from_millis(20),
        "complete before the kernel could have ended"
    );
    futures::executor::block_on(fence.wait()).unwrap();
    assert!(cuda::fence(&stream).is_complete().unwrap());
}

#[test]
fn a_cudarc_stream_makes_its_own_fence() {
    use device_events::cuda::CudaStreamExt;
    let Some((ctx, sleep)) = gpu("a_cudarc_stream_makes_its_own_fence") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let launched = Instant::now();
    sleep.launch(&stream, Duration::from_millis(20)).unwrap();
    let fence = stream.fence();
    let running = !fence.is_complete().unwrap();
    // Unless this thread was descheduled for the kernel's whole length.
    assert!(
        running || launched.elapsed() >= Duration::from_millis(20),
        "complete before the kernel could have ended"
    );
    futures::executor::block_on(async { stream.fence().await }).unwrap();
    assert!(fence.is_complete().unwrap());
}

/// The binary's kernel (`common::gpu`) is the context's shared one: asked
/// for again, on any thread, it is not loaded again (a load would stall the
/// other tests' work).
#[test]
fn a_shared_sleep_kernel_is_loaded_once_per_context() {
    let Some((ctx, loaded)) = gpu("a_shared_sleep_kernel_is_loaded_once_per_context") else {
        return;
    };
    let again = std::thread::spawn({
        let ctx = ctx.clone();
        move || SleepKernel::shared(&ctx).unwrap()
    })
    .join()
    .unwrap();
    assert!(std::ptr::eq(loaded, &*again), "one kernel for the context");
    let stream = ctx.new_stream().unwrap();
    again.launch(&stream, Duration::from_millis(1)).unwrap();
    cuda::fence(&stream).wait_sync().unwrap();
}

#[test]
fn a_dropped_streams_sequence_sorts_last_and_live_streams_have_their_own_ids() {
    let Some((ctx, _)) =
        gpu("a_dropped_streams_sequence_sorts_last_and_live_streams_have_their_own_ids")
    else {
        return;
    };
    let (stream, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let handle = CudaStreamHandle::new(&stream);
    let other_handle = CudaStreamHandle::new(&other);
    assert_ne!(Cuda::stream_id(handle), Cuda::stream_id(other_handle));
    assert_eq!(
        Cuda::stream_id(handle),
        Cuda::stream_id(CudaStreamHandle::new(&stream))
    );
    // One per-thread default stream, named on two threads: two streams.
    let per_thread = ctx.per_thread_stream();
    let here = CudaStreamHandle::new(&per_thread);
    let there = std::thread::scope(|scope| {
        scope
            .spawn(|| CudaStreamHandle::new(&per_thread))
            .join()
            .unwrap()
    });
    assert_ne!(Cuda::stream_id(here), Cuda::stream_id(there));
    let given: Vec<u64> = (0..3)
        .map(|_| EventFence::<Cuda>::new(handle).sequence())
        .collect();
    assert!(given.windows(2).all(|pair| pair[0] < pair[1]), "{given:?}");
    drop(stream);
    let after = Cuda::stream_sequence(handle);
    assert!(
        given.iter().all(|&sequence| sequence < after),
        "{given:?} then {after}"
    );
    assert_eq!(after, u64::MAX);
}
