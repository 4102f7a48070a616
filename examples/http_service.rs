//! An HTTP service as tokio users build one (axum, multi-thread runtime), in the shape the crate
//! recommends: a `Waiter` of its own, a `DropQueue` per stream, a profiler per context, stats
//! published with the `metrics` feature, shutdown in order. CUDA streams (`SleepKernel`) on a
//! GPU, host streams otherwise; only `launch` names a backend.
//!
//! ```sh
//! cargo run --release --example http_service -- [PORT] [--spawn-blocking]   # port 3000
//! curl -s -X POST localhost:3000/jobs -d '{"work_us": 2000, "stream": "any", "timeout_ms": 50}'
//! curl -s localhost:3000/stats; curl -s localhost:3000/metrics
//! ```
//!
//! A job is `work_us` of device work (at most 10 s) on stream `stream` (or round robin), waited
//! for up to `timeout_ms` (then 504); `"fault": true` panics in a host stream's work, as an
//! illegal address would (500; that stream stays faulted, the others serve). Its answer times the
//! work (`device_us`, profiled), the rest (`queued_us`) and the whole (`total_us`). The body
//! stands for a staging buffer the work reads: its stream's drop queue keeps it until the work's
//! fence passes. `/stats` answers JSON, `/metrics` the `device_events_*` series in the
//! Prometheus text format. `--spawn-blocking` waits by `spawn_blocking(|| fence.wait_sync())`.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use axum::{body::Bytes, extract::State, http::StatusCode, routing::get, routing::post};
use axum::{Json, Router};
use device_events::drop_queue::{DropQueue, DropQueueStats};
use device_events::host::HostContext;
use device_events::metrics::{self as published, DropQueueMetrics, ProfilerMetrics};
use device_events::metrics::{WaiterMetrics, LATENCY_BUCKETS_SECONDS, WAKE_LATENCY_SECONDS};
use device_events::{AnyFence, AnyProfile, AnyProfiler, AnyStream, ServerError, Waiter};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};
use serde_json::{json, Value};

const DEFAULT_PORT: u16 = 3000;
const STREAMS: usize = 4; // streams jobs run on
const MAX_WORK: Duration = Duration::from_secs(10); // the longest job accepted
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10); // for requests in flight
const STUCK_AFTER: Duration = Duration::from_secs(30); // a wait stuck: past the longest job
const STAGING_BUFFERS: usize = 256; // buffers waiting for their fences at once, per stream

// ---- The state: streams with their drop queues, a profiler per context, the waiter.

/// How a request waits for its fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitBy {
    /// `fence.await`, on this service's waiter.
    Await,
    /// `spawn_blocking(move || fence.wait_sync())`.
    SpawnBlocking,
}

/// Launching a job's work: a closure on a host stream, the sleep kernel on a CUDA stream.
enum Launcher {
    Host,
    #[cfg(feature = "cuda")]
    Cuda(device_events::cuda::SleepKernel),
}

/// A stream jobs run on, with the drop queue of the buffers its work reads.
pub struct JobStream {
    stream: AnyStream,
    /// Keeps each job's staging buffer until its work is done.
    pub staging: DropQueue<AnyFence, Bytes>,
    /// Which of the profilers times its work: its context's.
    context: usize,
    staging_metrics: DropQueueMetrics,
}

/// What every request shares.
pub struct AppState {
    /// Where jobs run, either backend.
    pub streams: Vec<JobStream>,
    /// A profiler per context (its events belong to one), with its publisher.
    profilers: Vec<(AnyProfiler, ProfilerMetrics)>,
    launcher: Launcher,
    /// Serves this service's awaits; shut down with the service.
    pub waiter: Waiter,
    waiter_metrics: WaiterMetrics,
    /// Where `/metrics` publishes: the service's own, not the process's global recorder.
    recorder: PrometheusRecorder,
    wait_by: WaitBy,
    /// The next stream for `"stream": "any"`.
    next: AtomicUsize,
}

impl AppState {
    /// Host streams, each on a context of its own (as if each were a device: a fault injected on
    /// one leaves the others serving).
    ///
    /// # Errors
    /// A stream's (or a drop queue's) thread could not start.
    pub fn host(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        let stream = |at| {
            HostContext::new()
                .new_stream()
                .map(|stream| (stream.into(), at))
        };
        let streams = (0..streams).map(stream).collect::<Result<_, _>>()?;
        Self::with(streams, Launcher::Host, wait_by)
    }

    /// CUDA streams on device 0: one context.
    ///
    /// # Errors
    /// No CUDA driver or device, or the driver refused a stream or the kernel.
    #[cfg(feature = "cuda")]
    pub fn cuda(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        let ctx = device_events::cuda::context(0)?;
        let sleep = device_events::cuda::SleepKernel::new(&ctx)?;
        let streams = (0..streams).map(|_| Ok((ctx.new_stream()?.into(), 0)));
        let streams = streams.collect::<Result<_, ServerError>>()?;
        Self::with(streams, Launcher::Cuda(sleep), wait_by)
    }

    /// `streams`, each with its context's index.
    fn with(
        streams: Vec<(AnyStream, usize)>,
        launcher: Launcher,
        wait_by: WaitBy,
    ) -> Result<Self, ServerError> {
        let backend = streams[0].0.backend();
        // Bounded labels only: a backend, a device, a stream of a fixed set.
        let labels = |key, at: usize| [("backend", backend.to_owned()), (key, at.to_string())];
        let contexts = streams
            .iter()
            .map(|(_, context)| context + 1)
            .max()
            .unwrap_or(0);
        let profiler_metrics = |at| ProfilerMetrics::new(&labels("device", at));
        let profilers = (0..contexts)
            .map(|at| (AnyProfiler::new(), profiler_metrics(at)))
            .collect();
        let mut job_streams = Vec::new();
        for (index, (stream, context)) in streams.into_iter().enumerate() {
            let staging = DropQueue::new(STAGING_BUFFERS)?;
            let staging_metrics = DropQueueMetrics::new(&labels("stream", index));
            job_streams.push(JobStream {
                stream,
                staging,
                context,
                staging_metrics,
            });
        }
        // An exporter renders a histogram as a summary unless given its buckets.
        let buckets = Matcher::Full(WAKE_LATENCY_SECONDS.into());
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(buckets, &LATENCY_BUCKETS_SECONDS)
            .expect("the buckets are not empty")
            .build_recorder();
        metrics::with_local_recorder(&recorder, published::describe);
        Ok(Self {
            streams: job_streams,
            profilers,
            launcher,
            waiter: Waiter::builder()
                .thread_name("gpu-w")
                .stuck_after(STUCK_AFTER)
                .build(),
            waiter_metrics: WaiterMetrics::new(&[("waiter", "http-waiter"), ("backend", backend)]),
            recorder,
            wait_by,
            next: AtomicUsize::new(0),
        })
    }

    /// `"Cuda"` or `"Host"`.
    pub fn backend(&self) -> &'static str {
        self.streams[0].stream.backend()
    }
}

// ---- Serving, and shutting down in order.

/// Serve on `listener` until `shutdown` resolves; then stop the server, letting requests in
/// flight finish (up to [`SHUTDOWN_DEADLINE`]), then shut each drop queue down (its buffers'
/// work done), then the waiter.
///
/// # Errors
/// Accepting connections failed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = Router::new()
        .route("/jobs", post(job))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .with_state(state.clone());
    let server = axum::serve(listener, router).with_graceful_shutdown(async move {
        shutdown.await;
        let _ = stopping.send(());
    });
    let deadline = async move {
        let _ = stopped.await;
        tokio::time::sleep(SHUTDOWN_DEADLINE).await;
    };
    let result = tokio::select! {
        result = server => result,
        () = deadline => {
            eprintln!("requests still in flight after {SHUTDOWN_DEADLINE:?}: stopping anyway");
            Ok(())
        }
    };
    for on in &state.streams {
        on.staging.shutdown_async().await;
    }
    state.waiter.shutdown();
    result
}

// ---- Jobs: checked input, launch, the staging buffer, the wait.

/// A 4xx or 5xx with a JSON body naming the reason.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// A stream's refusal: 500 if it is faulted (and stays so), else 503.
fn refused(err: ServerError) -> Response {
    let status = match err.is_faulted() {
        true => StatusCode::INTERNAL_SERVER_ERROR,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, err.to_string())
}

/// What a job asks for, checked.
struct Job {
    work: Duration,
    stream: usize,
    fault: bool,
    timeout: Option<Duration>, // then 504
}

/// The job in `body`, or why it is a bad request (400).
fn parse_job(state: &AppState, body: &[u8]) -> Result<Job, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|err| format!("malformed JSON: {err}"))?;
    let work_us = value.get("work_us").ok_or("missing \"work_us\"")?;
    let work = match work_us.as_i64() {
        Some(us) if us < 0 => return Err(format!("\"work_us\" must not be negative, got {us}")),
        Some(us) => Duration::from_micros(us.unsigned_abs()),
        None => return Err(format!("\"work_us\" must be a whole number, got {work_us}")),
    };
    if work > MAX_WORK {
        return Err(format!("\"work_us\" {work_us}: more than the most"));
    }
    let (count, last) = (state.streams.len(), state.streams.len() - 1);
    let stream = match value.get("stream") {
        None => None,
        Some(Value::String(any)) if any == "any" => None,
        Some(choice) => match choice.as_u64().filter(|&index| (index as usize) < count) {
            Some(index) => Some(index as usize),
            None => return Err(format!("unknown stream {choice}: \"any\" or 0 to {last}")),
        },
    };
    let stream = stream.unwrap_or_else(|| state.next.fetch_add(1, Ordering::Relaxed) % count);
    let fault = match value.get("fault") {
        None => false,
        Some(Value::Bool(fault)) => *fault,
        Some(other) => return Err(format!("\"fault\" must be true or false, got {other}")),
    };
    let timeout = match value.get("timeout_ms").map(|ms| (ms, ms.as_u64())) {
        None => None,
        Some((_, Some(ms))) => Some(Duration::from_millis(ms)),
        Some((ms, None)) => return Err(format!("\"timeout_ms\" must be a whole number, got {ms}")),
    };
    Ok(Job {
        work,
        stream,
        fault,
        timeout,
    })
}

async fn job(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let received = Instant::now();
    let job = match parse_job(&state, &body) {
        Ok(job) => job,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let on = &state.streams[job.stream];
    let (fence, profile) = match launch(&state, on, &job) {
        Ok(launched) => launched,
        Err(response) => return response,
    };
    // The body stands for a staging buffer the work reads: it must live until the work is done,
    // and its stream's drop queue keeps it so, off this handler. A refused push (full, or
    // closing) is dropped: that queues the buffer past the capacity, never freed early.
    drop(on.staging.push(on.stream.fence(), body));
    let waited = async {
        match state.wait_by {
            WaitBy::Await => state.waiter.wait(fence).await,
            WaitBy::SpawnBlocking => {
                match tokio::task::spawn_blocking(|| fence.wait_sync()).await {
                    Ok(waited) => waited,
                    Err(err) => Err(ServerError::WaiterPanicked {
                        message: err.to_string(),
                    }),
                }
            }
        }
    };
    // Given up on at the timeout: the wait's future is dropped, which the waiter counts as
    // cancelled (the work itself runs on).
    let waited = match job.timeout {
        None => waited.await,
        Some(timeout) => match tokio::time::timeout(timeout, waited).await {
            Ok(waited) => waited,
            Err(_) => {
                let why = format!("the work did not finish within {timeout:?}");
                return error(StatusCode::GATEWAY_TIMEOUT, why);
            }
        },
    };
    // The profile's stop is before the fence on the same stream: reached by now, so this await
    // is answered at once.
    let device = match waited {
        Ok(()) => state.waiter.wait(profile).await,
        Err(err) => Err(err),
    };
    let total = received.elapsed();
    let device = match device {
        Ok(device) => device,
        Err(err) => return error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
    };
    let micros = |time: Duration| u64::try_from(time.as_micros()).unwrap_or(u64::MAX);
    let (device_us, total_us) = (micros(device), micros(total));
    let queued_us = total_us.saturating_sub(device_us);
    Json(
        json!({ "stream": job.stream, "device_us": device_us, "queued_us": queued_us,
                 "total_us": total_us, "backend": state.backend() }),
    )
    .into_response()
}

/// Queue the job's work on `on` between the two points of a profile, and a fence after it: the
/// only code of the service that names a backend (a closure on a host stream, a kernel on CUDA).
#[allow(clippy::result_large_err)] // the error is the response, sent as it is
fn launch(state: &AppState, on: &JobStream, job: &Job) -> Result<(AnyFence, AnyProfile), Response> {
    let profiler = &state.profilers[on.context].0;
    let start = profiler.start(&on.stream).map_err(refused)?;
    let launched = match (&state.launcher, &on.stream) {
        (Launcher::Host, AnyStream::Host(host)) => {
            let (work, fault) = (job.work, job.fault);
            host.launch(move || {
                assert!(!fault, "a fault injected by the request");
                if !work.is_zero() {
                    std::thread::sleep(work);
                }
            })
        }
        #[cfg(feature = "cuda")]
        (Launcher::Cuda(..), AnyStream::Cuda(_)) if job.fault => {
            let why = "\"fault\" is for host streams only: on CUDA it would fault every stream";
            return Err(error(StatusCode::BAD_REQUEST, why));
        }
        #[cfg(feature = "cuda")]
        (Launcher::Cuda(sleep), AnyStream::Cuda(cuda)) => sleep.launch(cuda, job.work),
        _ => unreachable!("the streams were made for their launcher's backend"),
    };
    launched.map_err(refused)?;
    let profile = profiler.stop(start, &on.stream).map_err(refused)?;
    Ok((on.stream.fence(), profile))
}

// ---- Stats and metrics.

async fn stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    let waiter = state.waiter.stats();
    let profilers = || state.profilers.iter().map(|(profiler, _)| profiler.stats());
    let staging = |of: fn(DropQueueStats) -> u64| -> u64 {
        state.streams.iter().map(|on| of(on.staging.stats())).sum()
    };
    Json(json!({
        "backend": state.backend(),
        "wait_by": format!("{:?}", state.wait_by),
        "waiter": { "threads": waiter.threads, "peak_threads": waiter.peak_threads,
                    "pending": waiter.pending },
        "profiler": {
            "created": profilers().map(|stats| stats.created).sum::<u64>(),
            "pooled": profilers().map(|stats| stats.pooled).sum::<usize>(),
        },
        "staging": { "pushed": staging(|stats| stats.pushed),
                     "dropped": staging(|stats| stats.dropped),
                     "leaked": staging(|stats| stats.leaked),
                     "pending": staging(|stats| stats.pending as u64) },
        "process_threads": process_threads(),
    }))
}

/// `GET /metrics`: each source's stats published to the service's recorder, then rendered
/// (Prometheus text format 0.0.4). Publishing reads the stats; nothing is kept up to date
/// between scrapes.
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    metrics::with_local_recorder(&state.recorder, || {
        state.waiter_metrics.publish(&state.waiter.stats());
        for on in &state.streams {
            on.staging_metrics.publish(&on.staging.stats());
        }
        for (profiler, published) in &state.profilers {
            published.publish(&profiler.stats());
        }
    });
    let text = state.recorder.handle().render();
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// The process's thread count, from `/proc` (0 where there is none).
pub fn process_threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let count = status.lines().find_map(|at| at.strip_prefix("Threads:"));
    count.map_or(0, |count| count.trim().parse().unwrap_or(0))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut port, mut wait_by) = (DEFAULT_PORT, WaitBy::Await);
    let usage = |arg| format!("usage: http_service [PORT] [--spawn-blocking]; {arg:?}?");
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--spawn-blocking" => wait_by = WaitBy::SpawnBlocking,
            number => port = number.parse().map_err(|_| usage(number.to_owned()))?,
        }
    }
    #[cfg(feature = "cuda")]
    let state = AppState::cuda(STREAMS, wait_by).or_else(|why| {
        eprintln!("no CUDA GPU ({why}): host streams");
        AppState::host(STREAMS, wait_by)
    });
    #[cfg(not(feature = "cuda"))]
    let state = AppState::host(STREAMS, wait_by);
    let state = Arc::new(state?);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let (address, backend) = (listener.local_addr()?, state.backend());
    println!("listening on http://{address} ({backend} streams, {wait_by:?})");
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("Ctrl-C: finishing requests in flight");
    };
    Ok(serve(listener, state, ctrl_c).await?)
}
