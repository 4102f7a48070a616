//! Timing on CUDA: `cuEventElapsedTime_v2` is preferred where the driver
//! exports it (the legacy name can return unrelated asynchronous errors),
//! the legacy name is the fallback; two events of different contexts are
//! refused by the crate before the driver sees them; the driver's
//! milliseconds are read exactly; one profiler times work on two devices.
//!
//! Against the fake driver, which counts the calls to each name
//! (`fakeCudaElapsedCalls`) and gives a time a test sets
//! (`fakeCudaNextElapsed`); the fallback runs this binary again as a child
//! process with the fake built without `_v2` first on `LD_LIBRARY_PATH`
//! (needs `cc`). On a real driver the measurements run without the counts.
//! Skips without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead.
// The fake driver's hooks through `common::fake_driver`.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod common;

use std::ffi::c_int;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use device_events::cuda::cudarc::driver::CudaContext;
use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
use device_events::{status, Event, EventFlags, EventProfiler, ServerError};

use common::fake_driver::{self, is_fake};

/// The fake's calls so far to `[cuEventElapsedTime, cuEventElapsedTime_v2]`,
/// or `None` on a real driver.
fn elapsed_calls() -> Option<[c_int; 2]> {
    let legacy = fake_driver::call(c"fakeCudaElapsedCalls", 0)?;
    let v2 = fake_driver::call(c"fakeCudaElapsedCalls", 1)?;
    Some([legacy, v2])
}

/// Device `ordinal`'s context and a sleep kernel, or `None` (skipping).
fn gpu(test: &str, ordinal: usize) -> Option<(Arc<CudaContext>, SleepKernel)> {
    let found =
        cuda::context(ordinal).and_then(|ctx| SleepKernel::new(&ctx).map(|kernel| (ctx, kernel)));
    match found {
        Ok(found) => Some(found),
        Err(err) if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("{test}: DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}")
        }
        Err(err) => {
            common::skipped::skip(
                test,
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            None
        }
    }
}

/// Time 5 ms of device work with a profiler; the calls it made to each name.
fn profile_once(ctx: &Arc<CudaContext>, sleep: &SleepKernel) -> Option<[c_int; 2]> {
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let profiler = EventProfiler::<Cuda>::new();
    let start = profiler.start(handle).unwrap();
    sleep.launch(&stream, Duration::from_millis(5)).unwrap();
    let profile = profiler.stop(start, handle).unwrap();
    let before = elapsed_calls();
    let elapsed = profile.wait_sync().unwrap();
    assert!(elapsed >= Duration::from_millis(4), "{elapsed:?}");
    let after = elapsed_calls();
    before.zip(after).map(|(b, a)| [a[0] - b[0], a[1] - b[1]])
}

#[test]
fn the_v2_entry_point_is_preferred() {
    if std::env::var("DEVICE_EVENTS_ELAPSED_CHILD").is_ok() {
        return;
    }
    let Some((ctx, sleep)) = gpu("the_v2_entry_point_is_preferred", 0) else {
        return;
    };
    if let Some(calls) = profile_once(&ctx, &sleep) {
        assert_eq!(calls, [0, 1], "calls to [legacy, _v2]");
    }
}

/// A driver without `_v2` (before CUDA 12.8): the legacy name times.
#[test]
fn without_v2_the_legacy_entry_point_times() {
    if std::env::var("DEVICE_EVENTS_ELAPSED_CHILD").is_ok() || !is_fake() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-elapsed-legacy");
    std::fs::create_dir_all(&dir).unwrap();
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/libcuda.c");
    let built = Command::new("cc")
        .args(["-DFAKE_CUDA_NO_ELAPSED_V2", "-shared", "-fPIC", "-O2", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&source)
        .arg("-lpthread")
        .status();
    if !built.is_ok_and(|status| status.success()) {
        common::skipped::skip(
            "without_v2_the_legacy_entry_point_times",
            "no C compiler (cc) to build the fake driver",
        );
        return;
    }
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", &dir)
        .env("DEVICE_EVENTS_ELAPSED_CHILD", "legacy")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "child did not run:\n{stdout}");
}

/// The child side of the fallback: the fake without `_v2` is the driver.
#[test]
fn child() {
    if std::env::var("DEVICE_EVENTS_ELAPSED_CHILD").is_err() {
        return;
    }
    let (ctx, sleep) = gpu("child", 0).expect("the fake driver");
    let calls = profile_once(&ctx, &sleep).expect("the fake driver's hooks");
    assert_eq!(calls, [1, 0], "calls to [legacy, _v2]");
}

/// The driver's milliseconds are read as a `Duration`, exactly: a time the
/// fake gives (in microseconds) comes back as it was, and a negative one is
/// `StopBeforeStart` by as much. Fake driver only.
#[test]
fn the_drivers_milliseconds_are_read_exactly() {
    if std::env::var("DEVICE_EVENTS_ELAPSED_CHILD").is_ok() || !is_fake() {
        return;
    }
    let Some((ctx, _)) = gpu("the_drivers_milliseconds_are_read_exactly", 0) else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    let [start, stop] = [(); 2].map(|()| Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap());
    start.record(handle).unwrap();
    stop.record(handle).unwrap();
    stop.wait_sync().unwrap();
    for micros in [1_500, 250_000, -2_500] {
        fake_driver::call(c"fakeCudaNextElapsed", micros).expect("the fake's hook");
        let time = Duration::from_micros(micros.unsigned_abs().into());
        match stop.elapsed_since(&start) {
            Ok(read) if micros > 0 => assert_eq!(read, time),
            Err(ServerError::StopBeforeStart { by, .. }) if micros < 0 => assert_eq!(by, time),
            other => panic!("{micros} µs read as {other:?}"),
        }
    }
}

/// Two timing events of different contexts: refused by the crate, without a
/// driver call (the driver answers CUDA_ERROR_INVALID_HANDLE, and the legacy
/// entry point may add an unrelated error of its own).
#[test]
fn events_of_two_contexts_are_refused_before_the_driver() {
    if std::env::var("DEVICE_EVENTS_ELAPSED_CHILD").is_ok() {
        return;
    }
    let test = "events_of_two_contexts_are_refused_before_the_driver";
    let Some((ctx0, _)) = gpu(test, 0) else {
        return;
    };
    if cuda::device_count().unwrap() < 2 {
        common::skipped::skip(test, "this check needs two CUDA devices");
        return;
    }
    let ctx1 = cuda::context(1).unwrap();
    let (stream0, stream1) = (ctx0.new_stream().unwrap(), ctx1.new_stream().unwrap());
    let (handle0, handle1) = (
        CudaStreamHandle::new(&stream0),
        CudaStreamHandle::new(&stream1),
    );
    let start = Event::<Cuda>::new(handle0, EventFlags::TIMING).unwrap();
    let stop = Event::<Cuda>::new(handle1, EventFlags::TIMING).unwrap();
    start.record(handle0).unwrap();
    stop.record(handle1).unwrap();
    start.wait_sync().unwrap();
    stop.wait_sync().unwrap();
    let before = elapsed_calls();
    let err = stop.elapsed_since(&start).unwrap_err();
    assert_eq!(err.code(), Some(status::INVALID_HANDLE), "{err}");
    assert!(err.to_string().contains("different contexts"), "{err}");
    assert_eq!(before, elapsed_calls(), "the driver was asked: {err}");

    // A profile started on device 0 and stopped on device 1: refused when
    // read, the same way; its events go back, each to its device's pool.
    let profiler = EventProfiler::<Cuda>::new();
    let start = profiler.start(handle0).unwrap();
    let profile = profiler.stop(start, handle1).unwrap();
    let before = elapsed_calls();
    let err = profile.wait_sync().unwrap_err();
    assert_eq!(err.code(), Some(status::INVALID_HANDLE), "{err}");
    assert!(err.to_string().contains("different contexts"), "{err}");
    assert_eq!(before, elapsed_calls(), "the driver was asked: {err}");
    assert_eq!((profiler.pooled(), profiler.created()), (2, 2));
}

/// One profiler timing work on two devices, as a service does: each
/// device's events are pooled for it, so no round after the first makes
/// one, and a start on one device with a stop on the other is still
/// refused when read.
#[test]
fn one_profiler_times_work_on_two_devices() {
    if std::env::var("DEVICE_EVENTS_ELAPSED_CHILD").is_ok() {
        return;
    }
    let test = "one_profiler_times_work_on_two_devices";
    let Some((ctx0, sleep0)) = gpu(test, 0) else {
        return;
    };
    if cuda::device_count().unwrap() < 2 {
        common::skipped::skip(test, "this check needs two CUDA devices");
        return;
    }
    let (ctx1, sleep1) = gpu(test, 1).expect("device 1");
    let streams = [ctx0.new_stream().unwrap(), ctx1.new_stream().unwrap()];
    let kernels = [&sleep0, &sleep1];
    let profiler = EventProfiler::<Cuda>::new();
    for _round in 0..3 {
        for (stream, sleep) in streams.iter().zip(kernels) {
            let handle = CudaStreamHandle::new(stream);
            let start = profiler.start(handle).unwrap();
            sleep.launch(stream, Duration::from_millis(2)).unwrap();
            profiler.stop(start, handle).unwrap().wait_sync().unwrap();
        }
    }
    assert_eq!((profiler.pooled(), profiler.created()), (4, 4));
}
