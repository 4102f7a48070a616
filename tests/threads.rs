//! The threads a service of four streams takes, counted in `/proc/self/task`
//! against the formula of docs/service.md ("Threads"): a tokio runtime, a
//! waiter of its own (`stuck_after` and a watcher on), four streams, a drop
//! queue per stream and a profiler, with a wait pending on every stream. On
//! host streams, then (where there is a CUDA driver) on four CUDA streams of
//! one context, whose driver's own threads are counted apart.
//!
//! One test in a binary of its own: it counts the process's threads, which
//! any other test running beside it would change. Run with `--nocapture` to
//! see the counts.
#![cfg(target_os = "linux")]

mod common;

use std::time::Duration;

use device_events::drop_queue::DropQueue;
use device_events::host::{Host, HostStream};
use device_events::{EventFence, EventProfiler, Waiter};

// Threads counted by name, so a thread of an earlier part that is still
// leaving, or a driver's own, is not miscounted.
use common::{eventually, threads_named as named, Gate};

const STREAMS: usize = 4;
const RUNTIME_WORKERS: usize = 2;
/// Far beyond what a correct run needs: turns a hang into a failure.
const LIMIT: Duration = Duration::from_secs(20);

/// The process's threads now.
fn process_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

/// Until `count` threads are named `prefix`, failing after `LIMIT`: a new
/// thread names itself once it runs.
fn expect_named(prefix: &str, count: usize, what: &str) {
    eventually(LIMIT, what, || named(prefix) == count);
}

/// The service waiter's threads by name: its poller, its first lane thread,
/// and `watchers` watcher threads.
fn expect_waiter_names(watchers: usize) {
    for (name, count) in [("svc-poller", 1), ("svc-watcher", watchers), ("svc-1", 1)] {
        expect_named(name, count, "the waiter's threads, by name");
    }
}

const HOST_STREAM: &str = "host-stream-";
const DROP_QUEUE: &str = "device-events-d";
/// Short, so the kernel keeps the whole of each thread's name.
const WAITER: &str = "svc";

/// A waiter as a service builds it: `stuck_after` on (so its poller runs
/// while a wait is pending), the watcher as asked.
fn service_waiter(watchers: usize) -> Waiter {
    Waiter::builder()
        .thread_name(WAITER)
        .stuck_after(Duration::from_secs(60))
        .watchers(watchers)
        .build()
}

#[test]
fn a_four_stream_service_takes_the_threads_the_formula_says() {
    let before = process_threads();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKERS)
        .enable_all()
        .build()
        .unwrap();
    let runtime_threads = process_threads() - before;
    assert_eq!(runtime_threads, RUNTIME_WORKERS, "the runtime's workers");

    // Host streams: a worker thread each, a drop queue thread each.
    let start = process_threads();
    let waiter = service_waiter(1);
    let streams: Vec<HostStream> = (0..STREAMS).map(|_| HostStream::new().unwrap()).collect();
    let queues: Vec<DropQueue<EventFence<Host>, Vec<u8>>> =
        (0..STREAMS).map(|_| DropQueue::new(16).unwrap()).collect();
    let profiler = EventProfiler::<Host>::new();
    let idle = process_threads() - start;
    expect_named(HOST_STREAM, STREAMS, "a worker per stream");
    expect_named(DROP_QUEUE, STREAMS, "a drop queue per stream");
    expect_named(WAITER, 0, "no waiter thread yet");

    let gates: Vec<Gate> = streams.iter().map(Gate::hold).collect();
    let mut waits = Vec::new();
    for (stream, queue) in streams.iter().zip(&queues) {
        let profile = profiler
            .stop(profiler.start(stream.handle()).unwrap(), stream.handle())
            .unwrap();
        queue.push(stream.fence(), vec![0u8; 64]).unwrap();
        let fence = stream.fence();
        let waiter = waiter.clone();
        waits.push(runtime.spawn(async move {
            waiter.wait(fence).await?;
            waiter.wait(profile).await.map(|_| ())
        }));
    }
    // A lane thread per stream, the poller, the watcher.
    let waiter_threads = STREAMS + 2;
    eventually(LIMIT, "a wait pending on every stream", || {
        waiter.pending() == STREAMS && waiter.threads() == waiter_threads
    });
    // `threads()` counts a thread from just before the OS starts it: count
    // the process's threads once the waiter's have started and named
    // themselves.
    expect_named(WAITER, waiter_threads, "the waiter's threads");
    expect_waiter_names(1);
    let busy = process_threads() - start;
    eprintln!(
        "host: {} threads before; the runtime {runtime_threads}; streams and drop queues {idle}; \
         with a wait pending on every stream {busy} (the waiter's {}); {} in all",
        before,
        waiter.threads(),
        process_threads()
    );
    assert_eq!(busy, 2 * STREAMS + waiter_threads, "and no other thread");

    gates.into_iter().for_each(Gate::open);
    for wait in waits {
        runtime.block_on(wait).unwrap().unwrap();
    }
    for queue in queues {
        runtime.block_on(queue.shutdown_async());
    }
    waiter.shutdown();
    drop((streams, profiler));

    #[cfg(feature = "cuda")]
    cuda_streams(&runtime);
}

/// Four CUDA streams of one context: no thread of their own; the driver's
/// threads counted apart; the waiter's as on host streams, less the watcher
/// (with it, a stream's first wait starts the progress-word thread, which
/// leaves once idle: counted or not depending on the moment).
#[cfg(feature = "cuda")]
fn cuda_streams(runtime: &tokio::runtime::Runtime) {
    use device_events::cuda::{self, Cuda, CudaStreamHandle};

    if !cuda::is_available() && !common::gpu::required() {
        eprintln!("no CUDA driver here: the CUDA streams are not counted");
        return;
    }
    eventually(LIMIT, "the host streams' threads have left", || {
        named(HOST_STREAM) + named(DROP_QUEUE) + named(WAITER) == 0
    });
    let start = process_threads();
    let Some((ctx, sleep)) = common::gpu::gpu("threads: CUDA streams") else {
        return;
    };
    let streams: Vec<_> = (0..STREAMS).map(|_| ctx.new_stream().unwrap()).collect();
    let driver = process_threads() - start;

    let start = process_threads();
    let waiter = service_waiter(0);
    let queues: Vec<DropQueue<EventFence<Cuda>, Vec<u8>>> =
        (0..STREAMS).map(|_| DropQueue::new(16).unwrap()).collect();
    let profiler = EventProfiler::<Cuda>::new();
    let idle = process_threads() - start;
    expect_named(DROP_QUEUE, STREAMS, "a drop queue per stream");
    expect_named(WAITER, 0, "no waiter thread yet");

    let mut waits = Vec::new();
    for (stream, queue) in streams.iter().zip(&queues) {
        let handle = CudaStreamHandle::new(stream);
        let start = profiler.start(handle).unwrap();
        sleep.launch(stream, Duration::from_secs(2)).unwrap();
        let profile = profiler.stop(start, handle).unwrap();
        queue.push(cuda::fence(stream), vec![0u8; 64]).unwrap();
        let fence = cuda::fence(stream);
        let waiter = waiter.clone();
        waits.push(runtime.spawn(async move {
            waiter.wait(fence).await?;
            waiter.wait(profile).await.map(|_| ())
        }));
    }
    // A lane thread per stream and the poller.
    let waiter_threads = STREAMS + 1;
    eventually(LIMIT, "a wait pending on every stream", || {
        waiter.pending() == STREAMS && waiter.threads() == waiter_threads
    });
    expect_named(DROP_QUEUE, STREAMS, "a drop queue per stream");
    expect_named(WAITER, waiter_threads, "the waiter's threads");
    expect_waiter_names(0);
    let busy = process_threads() - start;
    eprintln!(
        "CUDA: the driver's threads {driver}; drop queues {idle}; with a wait pending on every \
         stream {busy} (the waiter's {}); {} in all",
        waiter.threads(),
        process_threads()
    );

    for wait in waits {
        runtime.block_on(wait).unwrap().unwrap();
    }
    for queue in queues {
        runtime.block_on(queue.shutdown_async());
    }
    waiter.shutdown();
}
