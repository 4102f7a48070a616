//! Contexts opened from several places, dropped and opened again: a
//! thread's binding to a context torn down and made again under the same
//! handle is not trusted, the crate dropping the last handle of a context
//! leaves the thread's current context as found, fence events are shared by
//! every object of one driver context (not piled up per object), and
//! handles of two contexts in one call are refused as the driver refuses
//! them.
//!
//! One test, its steps in sequence, in its own binary: the steps tear
//! device 0's context down and count its events, which any other test
//! sharing the process would change. Skips without a GPU;
//! `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead. `scripts/fake-cuda.sh`
//! runs it against the fake driver in both of its rebinding modes.
// The fake driver's hooks through `common::fake_driver`; raw driver calls
// through cudarc, each with a SAFETY note.
#![allow(unsafe_code)]
#![cfg(feature = "cuda")]

mod common;

use std::ffi::c_int;
use std::sync::Arc;

use device_events::cuda::cudarc::driver::result;
use device_events::cuda::cudarc::driver::{sys, CudaContext, CudaStream};
use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
use device_events::{status, Event, EventFlags};

use common::fake_driver;

fn required() -> bool {
    std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1")
}

/// The fake driver's count of live events on `device`, or `None` on a real
/// driver (checked to be there when `DEVICE_EVENTS_FAKE_CUDA=1`).
fn live_events(device: c_int) -> Option<c_int> {
    fake_driver::call(c"fakeCudaLiveEvents", device)
}

fn primary_retains(device: c_int) -> Option<c_int> {
    fake_driver::call(c"fakeCudaPrimaryRetains", device)
}

/// The context current on the calling thread, as a number.
fn current() -> Option<usize> {
    result::ctx::get_current()
        .expect("cuCtxGetCurrent")
        .map(|ctx| ctx as usize)
}

/// Make the context with handle `ctx` current on the calling thread.
fn set_current(ctx: usize) {
    // SAFETY: the caller keeps an object of that context alive.
    unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.expect("cuCtxSetCurrent");
}

#[test]
fn contexts_opened_dropped_and_opened_again() {
    // Probed on a thread of its own: cudarc binds the thread that makes a
    // context.
    let probe = std::thread::spawn(|| cuda::context(0).map(drop))
        .join()
        .unwrap();
    match probe {
        Ok(()) => {}
        Err(err) if required() => panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}"),
        Err(err) => {
            common::skipped::skip(
                "contexts_opened_dropped_and_opened_again",
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return;
        }
    }
    // First, while nothing holds device 0's context.
    a_context_opened_again_on_the_same_thread_works_there();
    if cuda::device_count().unwrap() < 2 {
        eprintln!("one device: the two-device checks need a second GPU (the fake driver has two)");
    } else {
        the_last_handle_dropped_by_the_crate_leaves_the_thread_as_found();
        handles_of_two_contexts_are_refused_as_invalid_handles();
    }
    fence_events_do_not_pile_up_per_context_object();
}

/// A user probes with `cuda::context(0)` on a thread, drops it (the
/// context is torn down, and stays bound there), and opens device 0 again
/// on the same thread: the driver makes it again under the same handle.
/// The crate's calls there bind it afresh instead of trusting the stale
/// binding, which the fake driver's strict mode (`FAKE_CUDA_STRICT_REBIND=1`)
/// refuses with `CUDA_ERROR_CONTEXT_IS_DESTROYED`; the real driver (and the
/// fake by default) lets calls through it succeed again.
fn a_context_opened_again_on_the_same_thread_works_there() {
    std::thread::spawn(|| {
        let probe = cuda::context(0).unwrap();
        let first = probe.cu_ctx() as usize;
        drop(probe);
        if primary_retains(0).is_some() {
            assert_eq!(primary_retains(0), Some(0), "device 0's context torn down");
        }
        assert_eq!(current(), Some(first), "cudarc leaves the context bound");
        let ctx = cuda::context(0).unwrap();
        // Made on a thread of its own: cudarc's calls trust a stale binding
        // (cudarc's business, not this crate's).
        let stream =
            std::thread::scope(|scope| scope.spawn(|| ctx.new_stream().unwrap()).join().unwrap());
        let handle = CudaStreamHandle::new(&stream);
        let event = Event::<Cuda>::new(handle, EventFlags::FENCE)
            .unwrap_or_else(|err| panic!("an event in the context opened again: {err}"));
        event.record(handle).unwrap();
        event.wait_sync().unwrap();
        drop(event);
        cuda::fence(&stream).wait_sync().unwrap();
        assert_eq!(
            current(),
            Some(ctx.cu_ctx() as usize),
            "the thread keeps the context's handle current"
        );
    })
    .join()
    .unwrap();
}

/// cudarc's `Drop` of a context's last handle makes that context current
/// and releases it, without restoring: when the crate holds the last handle
/// (a fence's event, an `Event`, a `SleepKernel`), the calling thread's
/// current context (device 1's here) is made current again.
fn the_last_handle_dropped_by_the_crate_leaves_the_thread_as_found() {
    type Last = Box<dyn FnOnce()>;
    let other = cuda::context(1).unwrap();
    let other_handle = other.cu_ctx() as usize;
    let check =
        |what: &str, make: &(dyn Fn(&Arc<CudaContext>, &Arc<CudaStream>) -> Last + Sync)| {
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    let ctx = CudaContext::new(0).unwrap();
                    let stream = ctx.new_stream().unwrap();
                    let last = make(&ctx, &stream);
                    let weak = Arc::downgrade(&ctx);
                    drop(stream);
                    drop(ctx);
                    set_current(other_handle);
                    last();
                    assert_eq!(
                        weak.strong_count(),
                        0,
                        "{what}: the crate held the last handle"
                    );
                    assert_eq!(
                        current(),
                        Some(other_handle),
                        "{what}: the thread's context (device 1's) is not current again"
                    );
                });
            });
        };
    check("a fence's wait_sync", &|_, stream| {
        let fence = cuda::fence(stream);
        Box::new(move || fence.wait_sync().unwrap())
    });
    check("an Event dropped", &|_, stream| {
        let handle = CudaStreamHandle::new(stream);
        let event = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
        event.record(handle).unwrap();
        Box::new(move || drop(event))
    });
    check("a SleepKernel dropped", &|ctx, _| {
        let kernel = SleepKernel::new(ctx).unwrap();
        Box::new(move || drop(kernel))
    });
}

/// The driver (an H200, driver 13000, measured) refuses `cuEventRecord` of
/// one context's event on another's stream, and `cuEventElapsedTime` of two
/// contexts' events, with `CUDA_ERROR_INVALID_HANDLE` whichever context is
/// current; `cuStreamWaitEvent` across contexts succeeds. The crate's own
/// refusal of such a record has the driver's status. A kernel launched on
/// another context's stream is refused by the crate itself, before the
/// driver (which checks that for some calls only), with
/// `CUDA_ERROR_INVALID_CONTEXT`.
fn handles_of_two_contexts_are_refused_as_invalid_handles() {
    let contexts = [cuda::context(0).unwrap(), cuda::context(1).unwrap()];
    let streams = contexts.each_ref().map(|ctx| ctx.new_stream().unwrap());
    let sleep = SleepKernel::new(&contexts[0]).unwrap();
    let refused = sleep
        .launch(&streams[1], std::time::Duration::from_millis(1))
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Some(sys::CUresult::CUDA_ERROR_INVALID_CONTEXT as i32),
        "{refused}"
    );
    drop(sleep);
    // Shared kernels are per context: device 1's is its own, and launches there.
    let shared = contexts
        .each_ref()
        .map(|ctx| SleepKernel::shared(ctx).unwrap());
    assert!(
        !Arc::ptr_eq(&shared[0], &shared[1]),
        "device 1 was given device 0's shared kernel"
    );
    shared[1]
        .launch(&streams[1], std::time::Duration::from_millis(1))
        .unwrap();
    drop(shared);
    let events = contexts.each_ref().map(|ctx| {
        ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap()
    });

    let event = Event::<Cuda>::new(CudaStreamHandle::new(&streams[0]), EventFlags::TIMING).unwrap();
    let refused = event
        .record(CudaStreamHandle::new(&streams[1]))
        .unwrap_err();
    assert_eq!(refused.code(), Some(status::INVALID_HANDLE), "{refused}");

    let invalid_handle = Err(result::DriverError(
        sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
    ));
    for ctx in &contexts {
        set_current(ctx.cu_ctx() as usize);
        // SAFETY: both handles are live (their owners are held above).
        let record = unsafe { result::event::record(events[0].cu_event(), streams[1].cu_stream()) };
        assert_eq!(record, invalid_handle, "cuEventRecord across contexts");
        // SAFETY: as above.
        let elapsed = unsafe { result::event::elapsed(events[0].cu_event(), events[1].cu_event()) };
        assert_eq!(
            elapsed.map(drop),
            invalid_handle,
            "cuEventElapsedTime across contexts"
        );
    }
    set_current(contexts[1].cu_ctx() as usize);
    // SAFETY: as above; the default flag.
    unsafe {
        result::stream::wait_event(
            streams[1].cu_stream(),
            events[0].cu_event(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .expect("cuStreamWaitEvent across contexts");
}

/// Rounds of "a new `CudaContext` object for device 0 while another keeps
/// the context alive, four fences, drop it" reuse one pool of the driver
/// context's fence events: the live events do not grow with the rounds.
/// Fake driver only (it counts live events).
fn fence_events_do_not_pile_up_per_context_object() {
    let keep = CudaContext::new(0).unwrap();
    let Some(before) = live_events(0) else {
        eprintln!("a real driver: the live-event count needs the fake driver");
        return;
    };
    for _ in 0..5 {
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let fences: Vec<_> = (0..4).map(|_| cuda::fence(&stream)).collect();
        for fence in fences {
            fence.wait_sync().unwrap();
        }
    }
    let grown = live_events(0).unwrap() - before;
    assert!(
        grown <= 4,
        "{grown} events alive after five rounds of four fences on objects of one context"
    );
    drop(keep);
}
