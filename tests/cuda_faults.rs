//! The CUDA fault suite: a kernel writes to an illegal address and poisons
//! the context; every pending and later fence, by `wait_sync` and by
//! `.await`, returns a faulted `ServerError`, and none hangs.
//!
//! Its own test binary, with one test: the fault kills the context for the
//! whole process. Skips without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails.
#![cfg(feature = "cuda")]

mod common;

use std::sync::mpsc;
use std::time::Duration;

use device_events::cuda::{self, Cuda, CudaStreamHandle, FaultKernel, SleepKernel};
use device_events::{Event, EventApi, EventFence, EventFlags, EventProfiler, ServerError, Waiter};

fn assert_faulted(what: &str, result: Result<(), ServerError>) {
    match result {
        Err(err) => assert!(err.is_faulted(), "{what}: expected a fault, got {err}"),
        Ok(()) => panic!("{what}: resolved Ok on a poisoned context"),
    }
}

#[test]
fn an_illegal_address_faults_every_pending_and_later_wait() {
    let setup = cuda::context(0).and_then(|ctx| {
        let sleep = SleepKernel::new(&ctx)?;
        let fault = FaultKernel::new(&ctx)?;
        Ok((ctx, sleep, fault))
    });
    let (ctx, sleep, fault) = match setup {
        Ok(setup) => setup,
        Err(err) if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}")
        }
        Err(err) => {
            common::skipped::skip(
                "an_illegal_address_faults_every_pending_and_later_wait",
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return;
        }
    };
    let stream = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let waiter = Waiter::builder().build();
    // Recorded before anything faults: its event stays valid.
    let earlier = Event::<Cuda>::new(CudaStreamHandle::new(&other), EventFlags::FENCE).unwrap();
    earlier.record(CudaStreamHandle::new(&other)).unwrap();
    // A user's thread with the context bound by cudarc, not by this crate,
    // before the fault: it drops `earlier` after it.
    let (bound, is_bound) = mpsc::channel();
    let (hand_over, handed) = mpsc::channel::<Event<Cuda>>();
    let users = ctx.clone();
    let user = std::thread::spawn(move || {
        users.bind_to_thread().unwrap();
        bound.send(()).unwrap();
        drop(handed.recv());
    });
    is_bound.recv().unwrap();

    // Pending: recorded behind the faulting kernel, itself behind 200 ms of
    // work, so every wait below starts before the fault happens.
    sleep.launch(&stream, Duration::from_millis(200)).unwrap();
    fault.launch(&stream).unwrap();
    let pending_sync = cuda::fence(&stream);
    let pending_await = waiter.wait(cuda::fence(&stream));
    let pending_global_await = cuda::fence(&stream).wait();
    let profiler = EventProfiler::<Cuda>::new();
    let start = profiler.start(CudaStreamHandle::new(&stream)).unwrap();
    let profile = profiler
        .stop(start, CudaStreamHandle::new(&stream))
        .unwrap();
    // A device-side dependency on the faulting stream.
    cuda::fence(&stream)
        .wait_async(CudaStreamHandle::new(&other))
        .unwrap();
    let dependent = cuda::fence(&other);

    let result = common::resolves("pending wait_sync", move || pending_sync.wait_sync());
    assert_faulted("pending wait_sync", result);
    let result = common::resolves("pending await (own waiter)", move || {
        futures::executor::block_on(pending_await)
    });
    assert_faulted("pending await (own waiter)", result);
    let result = common::resolves("pending await (global waiter)", move || {
        futures::executor::block_on(pending_global_await)
    });
    assert_faulted("pending await (global waiter)", result);
    let result = common::resolves("pending profile", move || profile.wait_sync().map(|_| ()));
    assert_faulted("pending profile", result);
    let result = common::resolves("stream behind a device-side wait", move || {
        dependent.wait_sync()
    });
    assert_faulted("stream behind a device-side wait", result);

    // Later: the context is poisoned, so recording fails, the synchronize
    // fallback fails too, and the fence holds the fault.
    let later = cuda::fence(&stream);
    assert!(later.is_resolved_at_creation());
    // The same through `AnyStream::fence`, which falls back as `EventFence::new` does.
    let any = device_events::AnyStream::from(stream.clone()).fence();
    assert!(any.is_resolved_at_creation());
    let result = common::resolves("later wait_sync", move || later.wait_sync());
    assert_faulted("later wait_sync", result);
    let later = cuda::fence(&other);
    let result = common::resolves("later await", move || {
        futures::executor::block_on(later.wait())
    });
    assert_faulted("later await", result);
    let later = cuda::fence(&stream);
    let target = CudaStreamHandle::new(&other);
    let result = common::resolves("later wait_async", move || later.wait_async(target));
    assert_faulted("later wait_async", result);
    // A fault found while checking for a capture names the call made.
    let err = earlier
        .wait_async(CudaStreamHandle::new(&other))
        .unwrap_err();
    assert!(
        err.is_faulted() && err.to_string().contains("(cuStreamWaitEvent)"),
        "{err}"
    );
    let err = Cuda::stream_synchronize(CudaStreamHandle::new(&stream)).unwrap_err();
    assert!(
        err.is_faulted() && err.to_string().contains("(cuStreamSynchronize)"),
        "{err}"
    );
    let handle = CudaStreamHandle::new(&stream);
    let result = common::resolves("a new fence on the poisoned stream", move || {
        EventFence::<Cuda>::new(handle).wait_sync()
    });
    assert_faulted("a new fence on the poisoned stream", result);
    assert!(waiter.pending() == 0);

    // An event dropped on the poisoned context is destroyed all the same,
    // though this crate can no longer bind the context (fake driver only: its
    // count of live events; other drops may lower it too, never raise it).
    let before = common::fake_driver::call(c"fakeCudaLiveEvents", 0);
    hand_over.send(earlier).unwrap();
    user.join().unwrap();
    if let Some(before) = before {
        let after = common::fake_driver::call(c"fakeCudaLiveEvents", 0).unwrap();
        assert!(
            after < before,
            "{before} live events before the drop, {after} after"
        );
    }
}
