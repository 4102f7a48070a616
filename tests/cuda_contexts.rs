//! Contexts opened from several places: handles of two contexts in one call
//! are refused as the driver refuses them.
//!
//! One test, its steps in sequence, in its own binary: the steps change
//! which context is current on the test's threads. Skips without a GPU;
//! `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead. `scripts/fake-cuda.sh`
//! runs it against the fake driver.
// Raw driver calls through cudarc, each with a SAFETY note.
#![allow(unsafe_code)]
#![cfg(feature = "cuda")]

use device_events::cuda::cudarc::driver::result;
use device_events::cuda::cudarc::driver::sys;
use device_events::cuda::{self, Cuda, CudaStreamHandle};
use device_events::{status, Event, EventFlags};

fn required() -> bool {
    std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1")
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
            eprintln!("skipping the CUDA context checks: no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead");
            return;
        }
    }
    if cuda::device_count().unwrap() < 2 {
        eprintln!("one device: the two-device checks need a second GPU (the fake driver has two)");
    } else {
        handles_of_two_contexts_are_refused_as_invalid_handles();
    }
}

/// The driver (an H200, driver 13000, measured) refuses `cuEventRecord` of
/// one context's event on another's stream, and `cuEventElapsedTime` of two
/// contexts' events, with `CUDA_ERROR_INVALID_HANDLE` whichever context is
/// current; `cuStreamWaitEvent` across contexts succeeds. The crate's own
/// refusal of such a record has the driver's status.
fn handles_of_two_contexts_are_refused_as_invalid_handles() {
    let contexts = [cuda::context(0).unwrap(), cuda::context(1).unwrap()];
    let streams = contexts.each_ref().map(|ctx| ctx.new_stream().unwrap());
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
