//! `AnyStream` and `AnyFence::wait_async`: a pipeline written once, run on
//! host streams and on CUDA (the fake driver in `scripts/fake-cuda.sh`, or a
//! GPU; without a driver the CUDA half says why it skips).

mod common;

use std::time::Duration;

use common::Gate;
use device_events::host::HostStream;
use device_events::{AnyFence, AnyProfiler, AnyStream, ServerError, DEFAULT_PROFILER_CAPACITY};

/// What a run of [`pipeline`] saw.
struct Seen {
    /// Stage two was done right after its fence was recorded.
    second_done_at_once: bool,
    /// Stage one was done when stage two's await returned.
    first_done_before_second: bool,
    results: (Result<(), ServerError>, Result<(), ServerError>),
}

/// Two stages: stage one on `one`, stage two on `two` made to wait for it
/// on the device, each stage's fence awaited, stage two's first. Written
/// once for either backend: `launch` (the per-backend part) queues a
/// stage's work; `release` lets stage one finish, where a test holds it
/// (given stage two's fence, to check meanwhile).
async fn pipeline(
    one: &AnyStream,
    two: &AnyStream,
    launch: impl Fn(&AnyStream) -> Result<(), ServerError>,
    release: impl FnOnce(&AnyFence),
) -> Seen {
    launch(one).expect("stage one launched");
    let first: AnyFence = one.fence();
    first
        .wait_async(two)
        .expect("stage two waits on the device");
    launch(two).expect("stage two launched");
    let second = two.fence();
    let second_done_at_once = second.is_complete().expect("a query");
    release(&second);
    let second = second.await;
    let first_done_before_second = first.is_complete().expect("a query");
    Seen {
        second_done_at_once,
        first_done_before_second,
        results: (first.await, second),
    }
}

/// Times `rounds` stages of `length` on `stream` with one profiler, each
/// read as the other is (by `.await`, then `wait_sync`): the device times,
/// and the events the profiler made in all (both back in its pool).
/// Written once for either backend: `launch` queues a stage of a given
/// length.
fn time_stages(
    stream: &AnyStream,
    rounds: usize,
    length: Duration,
    launch: impl Fn(&AnyStream, Duration) -> Result<(), ServerError>,
) -> (Vec<Duration>, usize) {
    let backend = stream.backend();
    // Each `Debug` is its backend's own.
    let shown = format!("{stream:?}");
    assert!(shown.starts_with(&format!("{backend}(")), "{shown}");
    let profiler = AnyProfiler::new();
    let times: Vec<Duration> = (0..rounds)
        .map(|round| {
            let start = profiler.start(stream).expect("start recorded");
            assert_eq!(start.backend(), backend);
            assert_eq!(format!("{start:?}"), format!("{backend}ProfileStart"));
            launch(stream, length).expect("stage launched");
            let profile = profiler.stop(start, stream).expect("stop recorded");
            assert_eq!(profile.backend(), backend);
            assert_eq!(format!("{profile:?}"), format!("{backend}Profile"));
            if round % 2 == 0 {
                futures::executor::block_on(profile.wait())
            } else {
                profile.wait_sync()
            }
            .expect("a device time")
        })
        .collect();
    // Counted with the other backend's pool (empty), as `pooled` promises.
    assert_eq!(profiler.pooled(), 2, "{backend}: both events pooled");
    (times, profiler.created())
}

/// What [`time_stages`] must see: every stage timed at no less than its
/// length (device time includes the whole stage), two events made for all
/// rounds (each read gives its two back before the next round).
fn check_stage_times(times: &[Duration], created: usize, length: Duration) {
    for time in times {
        assert!(*time >= length, "a {length:?} stage timed at {time:?}");
    }
    assert_eq!(created, 2, "the profiler reuses its two events every round");
}

#[test]
fn a_profiler_written_once_times_host_stages() {
    let stream = AnyStream::from(HostStream::new().unwrap());
    let length = Duration::from_millis(2);
    let (times, created) = time_stages(&stream, 4, length, |stream, length| match stream {
        AnyStream::Host(host) => host.launch(move || std::thread::sleep(length)),
        _ => unreachable!("a host stream here"),
    });
    check_stage_times(&times, created, length);
    // An event out with a start is made, not pooled.
    let profiler = AnyProfiler::new();
    let start = profiler.start(&stream).unwrap();
    assert_eq!((profiler.created(), profiler.pooled()), (1, 0));
    profiler.stop(start, &stream).unwrap().wait_sync().unwrap();
    assert_eq!((profiler.created(), profiler.pooled()), (2, 2));
}

#[test]
fn a_pipeline_written_once_runs_on_host_streams() {
    let one = AnyStream::from(HostStream::new().unwrap());
    let two = AnyStream::from(HostStream::new().unwrap());
    assert_eq!((one.backend(), two.backend()), ("Host", "Host"));
    let AnyStream::Host(host_one) = &one else {
        unreachable!("made from a host stream")
    };
    // Stage one is held until the pipeline has recorded stage two's fence:
    // stage two waits for it on the "device", not on the host.
    let gate = Gate::hold(host_one);
    let launch = |stream: &AnyStream| match stream {
        AnyStream::Host(host) => host.launch(|| {}),
        _ => unreachable!("host streams here"),
    };
    // Held, stage two must stay not done however long stream two's worker
    // has had (without the device-side wait it is done within
    // microseconds); then stage one is released.
    let release = |second: &AnyFence| {
        let until = std::time::Instant::now() + Duration::from_millis(50);
        while std::time::Instant::now() < until {
            assert!(
                !second.is_complete().unwrap(),
                "stage two ran before stage one was released"
            );
            std::thread::yield_now();
        }
        gate.open();
    };
    let seen = futures::executor::block_on(pipeline(&one, &two, launch, release));
    assert!(
        !seen.second_done_at_once,
        "stage two ran before stage one was released"
    );
    assert!(seen.first_done_before_second);
    assert_eq!(seen.results, (Ok(()), Ok(())));
    two.synchronize().unwrap();
    // Cheap to clone: the same stream.
    let again = one.clone();
    futures::executor::block_on(again.fence().wait()).unwrap();
}

/// The `try_` forms hand a refusal back: a faulted stream's record, and a
/// device-side wait onto it, where `fence` and `wait_async` work around it.
#[test]
fn try_fence_and_try_wait_async_return_the_refusal() {
    let host = common::faultable_stream();
    host.launch(|| panic!("a fault before the fences")).unwrap();
    let _ = host.synchronize();
    let faulted = AnyStream::from(host);
    let err = faulted.try_fence().unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert!(faulted.fence().is_resolved_at_creation());
    // That fence holds the fault: a query is an error, never `Ok(false)`.
    let err = faulted.fence().is_complete().unwrap_err();
    assert!(err.is_faulted(), "{err}");

    let good = AnyStream::from(HostStream::new().unwrap());
    let fence = good.try_fence().unwrap();
    let err = fence.try_wait_async(&faulted).unwrap_err();
    assert!(err.is_faulted(), "{err}");
    // The fallback waits on the host instead.
    fence.wait_async(&faulted).unwrap();
}

/// `AnyStream::synchronize` and `AnyFence::wait_sync` block until the work
/// before them is done, written once for either backend: `launch_long`
/// queues a stage long enough (tens of milliseconds) that a call returning
/// early sees it unfinished. A fence recorded earlier on the stream is
/// passed first, so it is complete once a later one is.
fn host_waits_block_until_the_work_is_done(
    stream: &AnyStream,
    launch_long: impl Fn(&AnyStream) -> Result<(), ServerError>,
) {
    let backend = stream.backend();
    launch_long(stream).expect("a long stage launched");
    let behind = stream.fence();
    let synchronized = stream.clone();
    common::resolves("synchronize", move || synchronized.synchronize()).expect("synchronized");
    assert!(
        behind.is_complete().unwrap(),
        "{backend}: synchronize returned before the stage was done"
    );
    launch_long(stream).expect("a long stage launched");
    let (earlier, waited) = (stream.fence(), stream.fence());
    common::resolves("wait_sync", move || waited.wait_sync()).expect("waited");
    assert!(
        earlier.is_complete().unwrap(),
        "{backend}: wait_sync returned before the stage was done"
    );
}

#[test]
fn synchronize_and_wait_sync_block_until_host_work_is_done() {
    let stream = AnyStream::from(HostStream::new().unwrap());
    host_waits_block_until_the_work_is_done(&stream, |stream| match stream {
        AnyStream::Host(host) => host.launch(|| std::thread::sleep(Duration::from_millis(50))),
        _ => unreachable!("a host stream here"),
    });
}

/// A profiler keeps up to its capacity of idle events per backend:
/// `with_capacity(0)` none, `new()` `DEFAULT_PROFILER_CAPACITY`, however many
/// more come back.
#[test]
fn a_profiler_keeps_up_to_its_capacity_of_idle_events() {
    let stream = AnyStream::from(HostStream::new().unwrap());
    // `at_once` measurements in flight together, then all read.
    let measure = |profiler: &AnyProfiler, at_once: usize| {
        let profiles: Vec<_> = (0..at_once)
            .map(|_| {
                let start = profiler.start(&stream).unwrap();
                profiler.stop(start, &stream).unwrap()
            })
            .collect();
        for profile in profiles {
            profile.wait_sync().unwrap();
        }
    };
    let none = AnyProfiler::with_capacity(0);
    measure(&none, 1);
    assert_eq!((none.created(), none.pooled()), (2, 0), "capacity 0");
    let shown = format!("{none:?}");
    assert_eq!(shown, "AnyProfiler { pooled: 0, created: 2 }");
    let default = AnyProfiler::new();
    measure(&default, DEFAULT_PROFILER_CAPACITY);
    assert_eq!(default.created(), 2 * DEFAULT_PROFILER_CAPACITY);
    assert_eq!(
        default.pooled(),
        DEFAULT_PROFILER_CAPACITY,
        "the default capacity"
    );
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::Arc;

    use super::common::gpu::gpu;
    use super::*;

    #[test]
    fn the_same_pipeline_runs_on_cuda_streams() {
        let Some((ctx, sleep)) = gpu("the_same_pipeline_runs_on_cuda_streams") else {
            return;
        };
        let one = AnyStream::from(ctx.new_stream().unwrap());
        let two = AnyStream::from(ctx.new_stream().unwrap());
        assert_eq!((one.backend(), two.backend()), ("Cuda", "Cuda"));
        // Stage one sleeps long enough that stage two, behind it on the
        // device, cannot be done when its fence is first asked.
        let launch = |stream: &AnyStream| match stream {
            AnyStream::Cuda(cuda) => {
                let length = if Arc::ptr_eq(cuda, one_stream(&one)) {
                    Duration::from_millis(200)
                } else {
                    Duration::from_micros(1)
                };
                sleep.launch(cuda, length)
            }
            _ => unreachable!("CUDA streams here"),
        };
        // When stage two was asked, from before stage one's launch.
        let asked = std::cell::Cell::new(Duration::MAX);
        let launched = std::time::Instant::now();
        let release = |_: &AnyFence| asked.set(launched.elapsed());
        let seen = futures::executor::block_on(pipeline(&one, &two, launch, release));
        // Unless the test thread was off its core for all of stage one.
        assert!(
            !seen.second_done_at_once || asked.get() >= Duration::from_millis(200),
            "stage two ran before stage one"
        );
        // Stage two's own work is 1 µs; only the device-side wait kept it
        // behind stage one's 200 ms.
        assert!(
            seen.first_done_before_second,
            "stage two ran before stage one"
        );
        assert_eq!(seen.results, (Ok(()), Ok(())));
        two.synchronize().unwrap();
    }

    #[test]
    fn synchronize_and_wait_sync_block_until_cuda_work_is_done() {
        let Some((ctx, sleep)) = gpu("synchronize_and_wait_sync_block_until_cuda_work_is_done")
        else {
            return;
        };
        let stream = AnyStream::from(ctx.new_stream().unwrap());
        host_waits_block_until_the_work_is_done(&stream, |stream| match stream {
            AnyStream::Cuda(cuda) => sleep.launch(cuda, Duration::from_millis(100)),
            _ => unreachable!("a CUDA stream here"),
        });
    }

    #[test]
    fn the_same_profiler_code_times_cuda_stages() {
        let Some((ctx, sleep)) = gpu("the_same_profiler_code_times_cuda_stages") else {
            return;
        };
        let stream = AnyStream::from(ctx.new_stream().unwrap());
        let length = Duration::from_millis(2);
        let (times, created) = time_stages(&stream, 4, length, |stream, length| match stream {
            AnyStream::Cuda(cuda) => sleep.launch(cuda, length),
            _ => unreachable!("a CUDA stream here"),
        });
        check_stage_times(&times, created, length);
    }

    #[test]
    fn a_profile_cannot_stop_on_a_stream_of_the_other_backend() {
        let Some((ctx, _)) = gpu("a_profile_cannot_stop_on_a_stream_of_the_other_backend") else {
            return;
        };
        let cuda_stream = AnyStream::from(ctx.new_stream().unwrap());
        let host_stream = AnyStream::from(HostStream::new().unwrap());
        let profiler = AnyProfiler::new();
        for (from, to) in [(&cuda_stream, &host_stream), (&host_stream, &cuda_stream)] {
            let before = profiler.created();
            let start = profiler.start(from).unwrap();
            let err = profiler.stop(start, to).unwrap_err();
            check_names_both_backends(&err);
            // Nothing was recorded on `to`, and the start's event is back
            // in its pool, so a good measurement after makes one event more
            // (its stop) at most.
            let start = profiler.start(from).unwrap();
            profiler.stop(start, from).unwrap().wait_sync().unwrap();
            assert!(
                profiler.created() <= before + 2,
                "the refused start's event went back to the pool"
            );
        }
    }

    /// A refusal to mix the backends: an `InvalidArgument` naming both.
    fn check_names_both_backends(err: &ServerError) {
        assert!(
            matches!(err, ServerError::InvalidArgument { .. }),
            "{err:?}"
        );
        let message = err.to_string();
        assert!(
            message.contains("Cuda") && message.contains("Host"),
            "the error names both backends: {message}"
        );
    }

    fn one_stream(stream: &AnyStream) -> &Arc<device_events::cuda::cudarc::driver::CudaStream> {
        match stream {
            AnyStream::Cuda(cuda) => cuda,
            _ => unreachable!("a CUDA stream"),
        }
    }

    #[test]
    fn a_fence_cannot_make_a_stream_of_the_other_backend_wait() {
        let Some((ctx, _)) = gpu("a_fence_cannot_make_a_stream_of_the_other_backend_wait") else {
            return;
        };
        let cuda_stream = AnyStream::from(ctx.new_stream().unwrap());
        let host_stream = AnyStream::from(HostStream::new().unwrap());
        for (fence, on) in [
            (cuda_stream.fence(), &host_stream),
            (host_stream.fence(), &cuda_stream),
        ] {
            let err = fence.wait_async(on).unwrap_err();
            check_names_both_backends(&err);
            check_names_both_backends(&fence.try_wait_async(on).unwrap_err());
            // The fence is still good for everything else.
            futures::executor::block_on(fence.wait()).unwrap();
        }
    }
}

/// A leak check written once for either backend: fences, a device-side
/// wait, an await and a profile on an `AnyStream`, then none of its events
/// is left in use, and a second round creates only its new profiler's two.
fn no_event_left_in_use(stream: &AnyStream) {
    let live = stream.live_events();
    let round = || {
        let profiler = AnyProfiler::new();
        let fence = stream.fence();
        assert_eq!(live.count(), 1, "{}: the fence's event", stream.backend());
        fence.wait_async(stream).unwrap();
        futures::executor::block_on(stream.fence().wait()).unwrap();
        let start = profiler.start(stream).unwrap();
        profiler.stop(start, stream).unwrap().wait_sync().unwrap();
        fence.wait_sync().unwrap();
    };
    // The waiter's thread lets the awaited fence go just after it wakes
    // the task.
    let none_in_use = || {
        common::eventually(Duration::from_secs(20), "no event left in use", || {
            live.count() == 0
        })
    };
    round();
    none_in_use();
    let created = live.created();
    round();
    none_in_use();
    assert_eq!(
        live.created(),
        created + 2,
        "{}: fence events are reused",
        stream.backend()
    );
}

#[test]
fn a_leak_check_on_live_events_runs_the_same_on_either_backend() {
    no_event_left_in_use(&AnyStream::from(HostStream::new().unwrap()));
    #[cfg(feature = "cuda")]
    if let Some((ctx, _)) = common::gpu::gpu("a_leak_check_on_live_events_runs_the_same") {
        no_event_left_in_use(&AnyStream::from(ctx.new_stream().unwrap()));
    }
}
