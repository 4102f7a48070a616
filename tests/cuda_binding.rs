//! How the CUDA backend treats contexts and threads: cudarc's stored errors
//! stay cudarc's, the calling thread's current context is left as found, one
//! waiter serves two devices, per-thread default streams stay on their
//! thread, and `cuda::context` shares one context per device.
//!
//! One test, its steps in sequence, in its own binary: a step stores an error
//! in device 0's context, which any other test sharing the process's context
//! would see. Skips without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails
//! instead. The fake driver's hooks (`fakeCudaLiveEvents`,
//! `fakeCudaPrimaryRetains`) add leak and retain checks there; on a real
//! driver those checks are skipped.
// The fake driver's hooks through `common::fake_driver`; one raw driver call
// through cudarc (`cuCtxSetCurrent`), with a SAFETY note.
#![allow(unsafe_code)]
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_int;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use device_events::cuda::cudarc::driver::result::{self, DriverError};
use device_events::cuda::cudarc::driver::{sys, CudaContext};
use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
use device_events::{Event, EventApi, EventFence, EventFlags, Waiter};

use common::fake_driver;

const LONG: Duration = Duration::from_millis(200);

fn required() -> bool {
    std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1")
}

/// The fake driver's count of live events on `device`, or `None` on a real
/// driver. `scripts/fake-cuda.sh` sets `DEVICE_EVENTS_FAKE_CUDA=1`, so the
/// checks cannot silently skip there (`fake_driver::call` panics instead).
fn live_events(device: c_int) -> Option<c_int> {
    fake_driver::call(c"fakeCudaLiveEvents", device)
}

fn events_created(device: c_int) -> Option<c_int> {
    fake_driver::call(c"fakeCudaEventsCreated", device)
}

/// Make the fake driver's next `cuEventQuery` return `status`; false on a
/// real driver.
fn fail_next_query(status: c_int) -> bool {
    fake_driver::call(c"fakeCudaFailNextQuery", status) == Some(0)
}

fn context_switches(device: c_int) -> Option<c_int> {
    fake_driver::call(c"fakeCudaContextSwitches", device)
}

fn primary_retains(device: c_int) -> Option<c_int> {
    fake_driver::call(c"fakeCudaPrimaryRetains", device)
}

/// The context current on the calling thread, as the driver reports it.
fn current() -> Option<sys::CUcontext> {
    result::ctx::get_current().expect("cuCtxGetCurrent")
}

#[test]
fn contexts_threads_and_devices() {
    // Probed on a thread of its own: cudarc binds the thread that makes a
    // context, and this one must not keep a binding to a context torn down
    // (the first step below tears device 0's down).
    let probe = std::thread::spawn(|| cuda::context(0).map(drop))
        .join()
        .unwrap();
    match probe {
        Ok(()) => {}
        Err(err) if required() => panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}"),
        Err(err) => {
            common::skipped::skip(
                "contexts_threads_and_devices",
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return;
        }
    }
    // First, while nothing else holds device 0's context.
    a_context_made_again_is_bound_afresh_on_the_waiters_threads(0);
    let ctx = cuda::context(0).unwrap();
    cudarc_stored_errors_stay_with_cudarc(&ctx);
    the_calling_threads_context_is_left_as_found(&ctx);
    a_per_thread_stream_handle_stays_on_its_thread(&ctx);
    one_context_per_device_while_alive(&ctx);
    fence_events_are_pooled_per_context(&ctx);
    the_waiters_threads_keep_the_context_bound(&ctx);
    any_status_the_driver_returns_is_a_number(&ctx);
    match cuda::device_count().unwrap() {
        1 => eprintln!(
            "one device: the two-device checks need a second GPU (the fake driver has two)"
        ),
        _ => {
            a_context_made_by_the_crate_leaves_the_thread_as_found(&ctx);
            one_waiter_serves_two_devices(&ctx);
        }
    }
}

/// `cuda::context` making a device's context (cudarc binds the context it
/// makes to the calling thread) leaves the thread's own current context, or
/// none, current.
fn a_context_made_by_the_crate_leaves_the_thread_as_found(ctx: &Arc<CudaContext>) {
    let theirs = ctx.cu_ctx() as usize;
    let ctx = ctx.clone();
    std::thread::spawn(move || {
        for bound in [false, true] {
            if bound {
                ctx.bind_to_thread().unwrap();
            }
            if let Some(retains) = primary_retains(1) {
                assert_eq!(retains, 0, "device 1's context is made anew");
            }
            let other = cuda::context(1).unwrap();
            assert_eq!(
                current().map(|current| current as usize),
                bound.then_some(theirs),
                "the thread's current context is as it was"
            );
            drop(other);
        }
    })
    .join()
    .unwrap();
}

/// cudarc's drops store failures in the context for the user's next cudarc
/// call; this crate's calls must neither take them nor fail because of them.
fn cudarc_stored_errors_stay_with_cudarc(ctx: &Arc<CudaContext>) {
    let stream = ctx.new_stream().unwrap();
    let stored = DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE);
    ctx.record_err::<()>(Err(stored));

    let fence = cuda::fence(&stream);
    assert!(
        !fence.is_resolved_at_creation(),
        "a stored cudarc error made the fence fall back to a stream synchronize"
    );
    assert!(fence.is_complete().unwrap());
    fence.wait_sync().unwrap(); // its event goes back to the context's pool
                                // A plain event is destroyed when dropped, stored error or not.
    let events_before = live_events(0);
    let handle = CudaStreamHandle::new(&stream);
    let never_recorded = Event::<Cuda>::new(handle, EventFlags::FENCE).unwrap();
    assert!(never_recorded.is_complete().unwrap());
    drop(never_recorded);
    if let Some(before) = events_before {
        assert_eq!(live_events(0), Some(before), "every event was destroyed");
    }

    assert_eq!(
        ctx.check_err(),
        Err(stored),
        "the stored error is still there for cudarc's next call"
    );
}

/// Executor threads keep whatever context they had: none, or another one.
fn the_calling_threads_context_is_left_as_found(ctx: &Arc<CudaContext>) {
    let stream = ctx.new_stream().unwrap();
    let sleep = SleepKernel::new(ctx).unwrap();
    sleep.launch(&stream, Duration::from_millis(5)).unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let on_a_fresh_thread = std::thread::spawn(move || {
        assert_eq!(current(), None, "a new thread has no context");
        let fence = EventFence::<Cuda>::new(handle);
        let _ = fence.is_complete().unwrap();
        assert_eq!(
            current(),
            None,
            "left bound by creating or querying a fence"
        );
        fence.wait_sync().unwrap();
        let event = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
        event.record(handle).unwrap();
        event.wait_sync().unwrap();
        drop(event);
        Cuda::stream_synchronize(handle).unwrap();
        assert_eq!(current(), None, "left bound by a wait, record or destroy");
    });
    on_a_fresh_thread.join().unwrap();

    if cuda::device_count().unwrap() > 1 {
        let other = cuda::context(1).unwrap();
        let theirs = other.cu_ctx() as usize;
        let with_device_1 = std::thread::spawn(move || {
            other.bind_to_thread().unwrap();
            let fence = EventFence::<Cuda>::new(handle); // device 0's stream
            fence.wait_sync().unwrap();
            assert_eq!(
                current().map(|ctx| ctx as usize),
                Some(theirs),
                "device 1's context is current again"
            );
        });
        with_device_1.join().unwrap();
    }
}

/// `CU_STREAM_PER_THREAD` names the calling thread's stream: a handle made on
/// one thread is refused on another rather than reaching a different stream.
fn a_per_thread_stream_handle_stays_on_its_thread(ctx: &Arc<CudaContext>) {
    let stream = ctx.per_thread_stream();
    let handle = CudaStreamHandle::new(&stream);
    assert!(format!("{handle:?}").contains("per-thread"));
    let fence = EventFence::<Cuda>::new(handle);
    assert!(!fence.is_resolved_at_creation());
    fence.wait_sync().unwrap();
    Cuda::stream_synchronize(handle).unwrap();

    let elsewhere = std::thread::spawn(move || {
        let err = Cuda::stream_synchronize(handle).unwrap_err();
        assert_eq!(
            err.code(),
            Some(device_events::status::INVALID_HANDLE),
            "{err}"
        );
        assert!(err.to_string().contains("per-thread"), "{err}");
        let fence = EventFence::<Cuda>::new(handle);
        assert!(
            fence.is_resolved_at_creation(),
            "refused, not recorded elsewhere"
        );
        assert!(fence.wait_sync().is_err());
    });
    elsewhere.join().unwrap();
    drop(stream);
    default_streams_keep_their_semantics(ctx);
}

/// The two default streams, as the driver defines them: the legacy one is
/// one stream of the context, whichever thread uses it; the per-thread one
/// is each thread's own. Fences (recorded on the caller's thread) see that.
fn default_streams_keep_their_semantics(ctx: &Arc<CudaContext>) {
    let sleep = SleepKernel::new(ctx).unwrap();

    // Legacy: work queued from this thread holds a fence made on another.
    let legacy = ctx.default_stream();
    let launched = Instant::now();
    sleep.launch(&legacy, LONG).unwrap();
    let legacy_handle = CudaStreamHandle::new(&legacy);
    let from_elsewhere = std::thread::spawn(move || {
        let fence = EventFence::<Cuda>::new(legacy_handle);
        // Unless the threads were descheduled for the kernel's whole length.
        let behind = !fence.is_complete().unwrap() || launched.elapsed() >= LONG;
        fence.wait_sync().unwrap();
        behind
    });
    assert!(
        from_elsewhere.join().unwrap(),
        "the legacy default stream is one stream for every thread"
    );

    // Per-thread: this thread's long work does not hold another thread's
    // per-thread stream.
    let mine = ctx.per_thread_stream();
    let launched = Instant::now();
    sleep.launch(&mine, LONG).unwrap();
    let context = ctx.clone();
    let theirs = std::thread::spawn(move || {
        let stream = context.per_thread_stream();
        let fence = EventFence::<Cuda>::new(CudaStreamHandle::new(&stream));
        fence.is_complete().unwrap()
    });
    assert!(
        theirs.join().unwrap(),
        "another thread's per-thread stream waited for this thread's work"
    );
    let fence = EventFence::<Cuda>::new(CudaStreamHandle::new(&mine));
    let complete = fence.is_complete().unwrap();
    assert!(
        !complete || launched.elapsed() >= LONG,
        "this thread's work is still queued"
    );
    fence.wait_sync().unwrap();
}

/// `cuda::context(0)` twice is one context, retained once; a device past
/// the driver's count is unavailable.
fn one_context_per_device_while_alive(ctx: &Arc<CudaContext>) {
    let retains = primary_retains(0);
    let again = cuda::context(0).unwrap();
    assert!(
        Arc::ptr_eq(ctx, &again),
        "a second CudaContext for device 0"
    );
    assert_eq!(primary_retains(0), retains);
    let past = cuda::context(cuda::device_count().unwrap()).unwrap_err();
    assert!(past.is_unavailable(), "{past}");
}

/// A steady loop of fences on several streams of one context creates a few
/// events while warming up, then none: they come from the context's pool.
fn fence_events_are_pooled_per_context(ctx: &Arc<CudaContext>) {
    let streams: Vec<_> = (0..4).map(|_| ctx.new_stream().unwrap()).collect();
    let waiter = Waiter::builder().build();
    let mut created_after_warm_up = None;
    for round in 0..400 {
        let stream = &streams[round % streams.len()];
        let fence = cuda::fence(stream);
        if round % 2 == 0 {
            fence.wait_sync().unwrap();
        } else {
            futures::executor::block_on(waiter.wait(fence)).unwrap();
        }
        if round == 99 {
            created_after_warm_up = events_created(0);
        }
    }
    if let Some(warm) = created_after_warm_up {
        let created = events_created(0).unwrap();
        assert!(
            created - warm <= 2,
            "{} events created after warm-up",
            created - warm
        );
    }
    fence_events_are_pooled_across_threads(ctx, &waiter);
}

/// The context's pool is split by thread, so threads making fences on one
/// context do not share a lock: a steady loop on four threads creates a few
/// events per thread while warming up, then none; and a thread that holds
/// 48 fences at once, lets them go and makes 48 more creates no new ones.
fn fence_events_are_pooled_across_threads(ctx: &Arc<CudaContext>, waiter: &Waiter) {
    let run = |rounds: usize| {
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let stream = ctx.new_stream().unwrap();
                scope.spawn(move || {
                    for round in 0..rounds {
                        let fence = cuda::fence(&stream);
                        if round % 2 == 0 {
                            fence.wait_sync().unwrap();
                        } else {
                            futures::executor::block_on(waiter.wait(fence)).unwrap();
                        }
                    }
                });
            }
        });
    };
    if let Some(created) = created_the_second_time(|| run(200)) {
        assert!(
            created <= 8,
            "{created} events created after warm-up on 4 threads"
        );
    }
    let stream = ctx.new_stream().unwrap();
    let hold = || {
        let fences: Vec<_> = (0..48).map(|_| cuda::fence(&stream)).collect();
        for fence in fences {
            fence.wait_sync().unwrap();
        }
    };
    if let Some(created) = created_the_second_time(hold) {
        assert_eq!(
            created, 0,
            "events created for 48 fences held a second time"
        );
    }
}

/// How many events (device 0) `work` creates when run a second time, after
/// a first run that warms the pool up; `None` on a real driver.
fn created_the_second_time(work: impl Fn()) -> Option<c_int> {
    work();
    let warm = events_created(0)?;
    work();
    Some(events_created(0)? - warm)
}

/// The waiter's threads are the crate's own: the context stays bound there
/// between calls, so resolving a hundred waits of one context switches
/// contexts once (a new waiter thread's first call), not twice per query.
/// The calling thread, which already had the context (bound by the test,
/// not the crate), switches once, to bind it afresh.
/// Fake driver only (it counts the switches).
fn the_waiters_threads_keep_the_context_bound(ctx: &Arc<CudaContext>) {
    let stream = ctx.new_stream().unwrap();
    let sleep = SleepKernel::new(ctx).unwrap();
    let waiter = Waiter::builder().max_threads(1).build();
    let cu_ctx = ctx.cu_ctx() as usize;
    let switched = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: the context is live: `ctx` holds its retain.
                unsafe { result::ctx::set_current(cu_ctx as sys::CUcontext) }.unwrap();
                let before = context_switches(0)?;
                sleep.launch(&stream, Duration::from_millis(20)).unwrap();
                let waits: Vec<_> = (0..100)
                    .map(|_| waiter.wait(cuda::fence(&stream)))
                    .collect();
                for result in futures::executor::block_on(futures::future::join_all(waits)) {
                    result.unwrap();
                }
                Some(context_switches(0)? - before)
            })
            .join()
            .unwrap()
    });
    if let Some(switched) = switched {
        assert!(
            switched <= 2,
            "{switched} context switches to resolve 100 waits on one context"
        );
    }
}

/// A waiter thread leaves the context it last used bound. When that context
/// is torn down and the device's context made again (with the same handle,
/// in the fake driver), the thread binds the new one rather than trust its
/// stale binding, which the fake driver refuses with
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED`. Run before anything else holds
/// `device`'s context, so that dropping it tears it down.
fn a_context_made_again_is_bound_afresh_on_the_waiters_threads(device: usize) {
    let waiter = Waiter::builder().max_threads(1).build();
    // Each round on a fresh thread: cudarc binds the thread that makes a
    // context and never unbinds it, so only the waiter's one thread carries
    // a binding from the first context to the second.
    let round = || {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let ctx = cuda::context(device).unwrap();
                    let stream = ctx.new_stream().unwrap();
                    let sleep = SleepKernel::new(&ctx).unwrap();
                    // Long enough that the first poll hands the wait off.
                    sleep.launch(&stream, Duration::from_millis(5)).unwrap();
                    let result = futures::executor::block_on(waiter.wait(cuda::fence(&stream)));
                    (Arc::downgrade(&ctx), ctx.cu_ctx() as usize, result)
                })
                .join()
                .unwrap()
        })
    };
    let (first, first_handle, result) = round();
    result.unwrap();
    torn_down(&first, device);
    let (_, handle, result) = round();
    if let Err(err) = result {
        panic!("a waiter thread kept a torn-down context's binding: {err}");
    }
    if primary_retains(device as c_int).is_some() {
        assert_eq!(
            handle, first_handle,
            "the fake reuses the primary context's handle"
        );
    }
}

/// Wait until the context behind `ctx` is gone (the waiter's thread may
/// still be dropping the last event that holds it) and, in the fake driver,
/// torn down.
fn torn_down(ctx: &Weak<CudaContext>, device: usize) {
    common::eventually(Duration::from_secs(10), "the context released", || {
        ctx.strong_count() == 0
            && primary_retains(device as c_int).is_none_or(|retains| retains == 0)
    });
}

/// A driver newer than the bindings the crate was built with can return a
/// status they do not list: this crate calls the driver with the status as
/// an integer, so it is reported (and classified) by number, never turned
/// into an enum value that does not exist. Fake driver only.
fn any_status_the_driver_returns_is_a_number(ctx: &Arc<CudaContext>) {
    let stream = ctx.new_stream().unwrap();
    let sleep = SleepKernel::new(ctx).unwrap();
    sleep.launch(&stream, LONG).unwrap();
    let fence = cuda::fence(&stream);
    if !fail_next_query(12_345) {
        eprintln!("a real driver: the injected-status checks need the fake driver");
        fence.wait_sync().unwrap();
        return;
    }
    let unknown = fence.is_complete().unwrap_err();
    assert_eq!(unknown.code(), Some(12_345), "{unknown}");
    assert!(!unknown.is_faulted(), "{unknown}");
    // Every status the driver docs say leaves the process to restart is
    // sticky, by its number: CUDA_ERROR_CONTAINED (226) and
    // CUDA_ERROR_TENSOR_MEMORY_LEAK (721) too, which cudarc's 12.0-12.6
    // bindings lack.
    let sticky = [214, 700, 702, 710, 714, 715, 716, 717, 718, 719, 810, 911];
    for status in sticky.into_iter().chain([226, 721]) {
        assert!(fail_next_query(status));
        let err = fence.is_complete().unwrap_err();
        assert!(err.is_faulted(), "{status}: {err}");
        assert_eq!(err.code(), Some(status));
    }
    fence.wait_sync().unwrap();
}

/// One waiter, streams on two devices, and a device-side wait from one device
/// to the other.
fn one_waiter_serves_two_devices(ctx: &Arc<CudaContext>) {
    let other = cuda::context(1).unwrap();
    let sleeps = [
        SleepKernel::new(ctx).unwrap(),
        SleepKernel::new(&other).unwrap(),
    ];
    let streams = [ctx.new_stream().unwrap(), other.new_stream().unwrap()];
    let waiter = Waiter::builder().max_threads(2).build();
    let mut waits = Vec::new();
    for _ in 0..20 {
        for (stream, sleep) in streams.iter().zip(&sleeps) {
            sleep.launch(stream, Duration::from_micros(500)).unwrap();
            waits.push(waiter.wait(cuda::fence(stream)));
        }
    }
    for result in futures::executor::block_on(futures::future::join_all(waits)) {
        result.unwrap();
    }

    // Device 1's stream waits, on the device, for device 0's long work.
    let launched = Instant::now();
    sleeps[0].launch(&streams[0], LONG).unwrap();
    cuda::fence(&streams[0])
        .wait_async(CudaStreamHandle::new(&streams[1]))
        .unwrap();
    let behind = cuda::fence(&streams[1]);
    // Unless this thread was descheduled for the kernel's whole length.
    let complete = behind.is_complete().unwrap();
    assert!(
        !complete || launched.elapsed() >= LONG,
        "device 1's stream does not wait for device 0's work"
    );
    futures::executor::block_on(waiter.wait(behind)).unwrap();
    assert!(cuda::fence(&streams[0]).is_complete().unwrap());
}
