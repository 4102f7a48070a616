//! An HTTP service as tokio users build one (axum on a multi-thread runtime):
//! `POST /jobs` launches work on one of a set of streams, times it with a
//! profiler and awaits its fence; `GET /stats` reports the waiter, the
//! profiler, the drop queue and the process's threads, and `GET /metrics`
//! the same in the Prometheus text format. CUDA streams (with
//! `SleepKernel`) when a GPU is present, host streams otherwise: the service
//! holds `AnyStream`s, and only launching a job's work is written per
//! backend (`Launcher::launch`).
//!
//! ```sh
//! cargo run --release --example http_service                    # port 3000
//! cargo run --release --example http_service -- 8080            # another port
//! cargo run --release --example http_service -- 3000 --spawn-blocking
//! curl -s -X POST localhost:3000/jobs -H 'content-type: application/json' \
//!      -d '{"work_us": 2000, "stream": "any"}'
//! curl -s localhost:3000/stats
//! curl -s localhost:3000/metrics
//! ```
//!
//! A job is `{"work_us": N, "stream": "any" | K, "fault": false,
//! "timeout_ms": T}`: `N` microseconds of device work (0 to 10 s) on stream
//! `K` (or the next one, round robin), waited for up to `T` ms (504 after
//! that; no limit when absent). The answer is `{"stream", "device_us", "queued_us",
//! "total_us", "backend"}`: the device time of the work (from the
//! profiler), the rest of the request's time (mostly waiting behind earlier
//! work on its stream), and the whole request. The request's body stands
//! for a staging buffer the work reads: it is kept in a drop queue until
//! the work's fence passes. Bad input gets a 4xx with the reason; a faulted
//! stream (`"fault": true` on a host stream panics in its work, as an
//! illegal address would) answers 500 with the `ServerError`, and the
//! others go on.
//!
//! `--spawn-blocking` waits with `spawn_blocking(move || fence.wait_sync())`
//! instead of `.await`, for comparison. Ctrl-C stops accepting, lets requests
//! in flight finish (up to 10 s), then shuts the drop queue and the waiter
//! down.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use device_events::drop_queue::{DropQueue, Rejected};
use device_events::host::HostContext;
use device_events::{AnyFence, AnyProfile, AnyProfiler, AnyStream, ServerError, Waiter};
use serde_json::{json, Value};

/// The port when none is given.
pub const DEFAULT_PORT: u16 = 3000;
/// How many streams jobs run on.
pub const STREAMS: usize = 4;
/// The longest job accepted.
pub const MAX_WORK: Duration = Duration::from_secs(10);
/// How long shutdown lets requests in flight finish.
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);
/// How long a wait may be pending before the waiter reports it stuck: past
/// the longest job, with room for a queue of them.
pub const STUCK_AFTER: Duration = Duration::from_secs(30);
/// How many staging buffers may wait for their fences at once.
pub const STAGING_BUFFERS: usize = 1024;

/// How a request waits for its fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitBy {
    /// `fence.await`, on this service's waiter.
    Await,
    /// `spawn_blocking(move || fence.wait_sync())`.
    SpawnBlocking,
}

/// Launching a job's work: a closure on a host stream, a kernel on a CUDA
/// stream. The one part of the service written per backend.
pub enum Launcher {
    /// Host streams run closures.
    Host,
    /// CUDA streams on device 0 run the sleep kernel.
    #[cfg(feature = "cuda")]
    Cuda(gpu::Gpu),
}

/// A stream jobs run on, and the profiler that times them: a profiler's
/// events belong to one device (context), and the host streams here each
/// have a context of their own.
pub struct JobStream {
    /// Either backend's stream.
    pub stream: AnyStream,
    /// Times each job's work on the stream.
    pub profiler: AnyProfiler,
}

/// What every request shares.
pub struct AppState {
    /// Where jobs run, either backend.
    pub streams: Vec<JobStream>,
    /// How work is launched on them.
    pub launcher: Launcher,
    /// Serves this service's awaits; shut down with the service.
    pub waiter: Waiter,
    /// Keeps each job's staging buffer until its work is done; shut down
    /// with the service.
    pub staging: DropQueue<AnyFence, Bytes>,
    /// `.await`, or `spawn_blocking` for comparison.
    pub wait_by: WaitBy,
    /// The next stream for `"stream": "any"`.
    next: AtomicUsize,
}

impl AppState {
    /// Host streams, whatever the machine has; each on a context of its
    /// own, as if each were a device of its own, so a fault injected on one
    /// leaves the others serving.
    ///
    /// # Errors
    ///
    /// A stream's (or the drop queue's) thread could not start.
    pub fn host(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        let streams = (0..streams)
            .map(|_| HostContext::new().new_stream().map(AnyStream::from))
            .collect::<Result<_, _>>()?;
        Self::with(streams, Launcher::Host, wait_by)
    }

    /// CUDA streams on device 0.
    ///
    /// # Errors
    ///
    /// No CUDA driver or device, or the driver refused a stream or the
    /// kernel.
    #[cfg(feature = "cuda")]
    pub fn cuda(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        let (gpu, streams) = gpu::Gpu::open(streams)?;
        Self::with(streams, Launcher::Cuda(gpu), wait_by)
    }

    /// CUDA streams when a GPU is present, host streams otherwise.
    ///
    /// # Errors
    ///
    /// A stream's thread could not start.
    pub fn open(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        #[cfg(feature = "cuda")]
        match Self::cuda(streams, wait_by) {
            Ok(state) => return Ok(state),
            Err(why) => eprintln!("no CUDA GPU ({why}): host streams"),
        }
        Self::host(streams, wait_by)
    }

    fn with(
        streams: Vec<AnyStream>,
        launcher: Launcher,
        wait_by: WaitBy,
    ) -> Result<Self, ServerError> {
        let streams = streams
            .into_iter()
            .map(|stream| JobStream {
                stream,
                profiler: AnyProfiler::new(),
            })
            .collect();
        Ok(Self {
            streams,
            launcher,
            waiter: Waiter::builder()
                .thread_name("http-waiter")
                .stuck_after(STUCK_AFTER)
                .build(),
            staging: DropQueue::new(STAGING_BUFFERS)?,
            wait_by,
            next: AtomicUsize::new(0),
        })
    }

    /// `"Cuda"` or `"Host"`.
    pub fn backend(&self) -> &'static str {
        self.streams[0].stream.backend()
    }
}

impl Launcher {
    /// Queue `job`'s work on `stream`: the only code of the service that
    /// names a backend.
    ///
    /// # Errors
    ///
    /// The stream refused the work; on CUDA, a fault asked for (it would
    /// fault every stream of the device).
    fn launch(&self, stream: &AnyStream, job: &Job) -> Result<(), Refused> {
        match (self, stream) {
            (Self::Host, AnyStream::Host(host)) => {
                let (work, fault) = (job.work, job.fault);
                host.launch(move || {
                    assert!(!fault, "a fault injected by the request");
                    if !work.is_zero() {
                        std::thread::sleep(work);
                    }
                })?;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Self::Cuda(gpu), AnyStream::Cuda(cuda)) => {
                if job.fault {
                    return Err(Refused::BadRequest(
                        "\"fault\" is for host streams only: on CUDA it would fault every stream",
                    ));
                }
                Ok(gpu.sleep.launch(cuda, job.work)?)
            }
            _ => unreachable!("the streams were made for their launcher's backend"),
        }
    }
}

/// Why a job's work was not launched.
enum Refused {
    /// The stream (or its device) refused it.
    Stream(ServerError),
    /// The job asks for something this backend cannot do.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    BadRequest(&'static str),
}

impl From<ServerError> for Refused {
    fn from(err: ServerError) -> Self {
        Self::Stream(err)
    }
}

/// The service's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/jobs", post(job))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Serve on `listener` until `shutdown` resolves, then let requests in flight
/// finish (up to [`SHUTDOWN_DEADLINE`]) and shut the drop queue and the
/// waiter down.
///
/// # Errors
///
/// Accepting connections failed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, router(state.clone())).with_graceful_shutdown(async move {
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
    // Buffers of requests cut off by the deadline still wait for their work;
    // the queue is shared by every handler, and closes without a lock.
    state.staging.shutdown_async().await;
    state.waiter.shutdown();
    result
}

/// A 4xx or 5xx with a JSON body naming the reason.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// What a job asks for, checked.
struct Job {
    work: Duration,
    stream: usize,
    fault: bool,
    /// How long the request waits for its work before it gives up (504).
    timeout: Option<Duration>,
}

// The error is the response itself, sent as it is.
#[allow(clippy::result_large_err)]
fn parse_job(state: &AppState, body: &[u8]) -> Result<Job, Response> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|err| error(StatusCode::BAD_REQUEST, format!("malformed JSON: {err}")))?;
    let work_us = value
        .get("work_us")
        .ok_or_else(|| error(StatusCode::BAD_REQUEST, "missing \"work_us\""))?;
    let work_us = match work_us.as_i64() {
        Some(us) if us < 0 => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!("\"work_us\" must not be negative, got {us}"),
            ))
        }
        Some(us) if Duration::from_micros(us.unsigned_abs()) > MAX_WORK => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!("\"work_us\" {us} is more than the most a job may take, {MAX_WORK:?}"),
            ))
        }
        Some(us) => us.unsigned_abs(),
        None => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!("\"work_us\" must be a whole number of microseconds, got {work_us}"),
            ))
        }
    };
    let count = state.streams.len();
    let stream = match value.get("stream") {
        None => state.next.fetch_add(1, Ordering::Relaxed) % count,
        Some(Value::String(any)) if any == "any" => {
            state.next.fetch_add(1, Ordering::Relaxed) % count
        }
        Some(choice) => match choice.as_u64() {
            Some(index) if (index as usize) < count => index as usize,
            _ => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("unknown stream {choice}: use \"any\" or 0 to {}", count - 1),
                ))
            }
        },
    };
    let fault = match value.get("fault") {
        None => false,
        Some(Value::Bool(fault)) => *fault,
        Some(other) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!("\"fault\" must be true or false, got {other}"),
            ))
        }
    };
    let timeout = match value.get("timeout_ms") {
        None => None,
        Some(ms) => match ms.as_u64() {
            Some(ms) => Some(Duration::from_millis(ms)),
            None => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("\"timeout_ms\" must be a whole number of milliseconds, got {ms}"),
                ))
            }
        },
    };
    Ok(Job {
        work: Duration::from_micros(work_us),
        stream,
        fault,
        timeout,
    })
}

async fn job(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let received = Instant::now();
    let job = match parse_job(&state, &body) {
        Ok(job) => job,
        Err(response) => return response,
    };
    let stream = &state.streams[job.stream];
    let (fence, profile) = match launch(&state, stream, &job) {
        Ok(launched) => launched,
        Err(response) => return response,
    };
    // The body stands for a staging buffer the work reads: it must live
    // until the work is done, and the drop queue keeps it so, off this
    // handler. Refused (full, or closed by shutdown), the handler keeps it
    // until its own wait below is over, or, if it gives up waiting, hands it
    // on to be kept until then.
    let unqueued = state.staging.push(stream.stream.fence(), body).err();
    let waited = async {
        match state.wait_by {
            WaitBy::Await => state.waiter.wait(fence).await,
            WaitBy::SpawnBlocking => tokio::task::spawn_blocking(move || fence.wait_sync())
                .await
                .unwrap_or_else(|err| {
                    Err(ServerError::WaiterPanicked {
                        message: err.to_string(),
                    })
                }),
        }
    };
    // Given up on at the timeout: the wait's future is dropped, which the
    // waiter counts as cancelled (the work itself runs on).
    let waited = match job.timeout {
        None => waited.await,
        Some(timeout) => match tokio::time::timeout(timeout, waited).await {
            Ok(waited) => waited,
            Err(_) => {
                if let Some(refused) = unqueued {
                    keep_until_done(refused);
                }
                return error(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("the work did not finish within {timeout:?}"),
                );
            }
        },
    };
    // The profile's stop is before the fence on the same stream: reached
    // by now, so this await is answered at once.
    let device = match waited {
        Ok(()) => state.waiter.wait(profile).await,
        Err(err) => Err(err),
    };
    let total = received.elapsed();
    drop(unqueued);
    let device = match device {
        Ok(device) => device,
        Err(err) => return error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()),
    };
    let (device_us, total_us) = (micros(device), micros(total));
    Json(json!({
        "stream": job.stream,
        "device_us": device_us,
        "queued_us": total_us.saturating_sub(device_us),
        "total_us": total_us,
        "backend": state.backend(),
    }))
    .into_response()
}

/// Keep a staging buffer the drop queue refused, whose request gave up
/// waiting for its work, until that work is done, then drop it (or leak it
/// if the work failed, as the queue does). On the runtime's blocking pool,
/// where each such buffer holds a thread until its work is done: it is rare
/// (a full queue and a timeout at once), and a runtime that shuts down waits
/// for a blocking task it has started, where it would drop an async task,
/// and the buffer with it, while the device may still read it. (One not
/// started yet when the runtime shuts down is dropped all the same: on a
/// hung device, size the queue so that it is not full.)
fn keep_until_done(refused: Rejected<AnyFence, Bytes>) {
    tokio::task::spawn_blocking(move || {
        // A failure is logged by the queue's code, its buffer leaked.
        let _ = refused.wait_then_drop();
    });
}

/// Whole microseconds, saturating.
fn micros(time: Duration) -> u64 {
    u64::try_from(time.as_micros()).unwrap_or(u64::MAX)
}

/// Queue the job's work on `on` between the two points of a profile; a
/// fence after it. The same for either backend but for the launch.
#[allow(clippy::result_large_err)]
fn launch(state: &AppState, on: &JobStream, job: &Job) -> Result<(AnyFence, AnyProfile), Response> {
    let (stream, profiler) = (&on.stream, &on.profiler);
    let refused = |err: ServerError| {
        let status = if err.is_faulted() {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        error(status, err.to_string())
    };
    let start = profiler.start(stream).map_err(refused)?;
    match state.launcher.launch(stream, job) {
        Ok(()) => {}
        Err(Refused::Stream(err)) => return Err(refused(err)),
        Err(Refused::BadRequest(why)) => return Err(error(StatusCode::BAD_REQUEST, why)),
    }
    let profile = profiler.stop(start, stream).map_err(refused)?;
    Ok((stream.fence(), profile))
}

async fn stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    let staging = state.staging.stats();
    Json(json!({
        "backend": state.backend(),
        "wait_by": format!("{:?}", state.wait_by),
        "waiter": {
            "threads": state.waiter.threads(),
            "peak_threads": state.waiter.peak_threads(),
            "pending": state.waiter.pending(),
        },
        "profiler": {
            "created": state.streams.iter().map(|on| on.profiler.created()).sum::<usize>(),
            "pooled": state.streams.iter().map(|on| on.profiler.pooled()).sum::<usize>(),
        },
        "staging": {
            "pushed": staging.pushed,
            "dropped": staging.dropped,
            "leaked": staging.leaked,
            "pending": staging.pending,
        },
        "process_threads": process_threads(),
    }))
}

/// `GET /metrics`: the waiter's, the drop queue's and the profilers' stats
/// in the Prometheus text format (version 0.0.4).
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = prometheus_text(&state);
    ([("content-type", "text/plain; version=0.0.4")], text).into_response()
}

/// The stats as Prometheus metrics, `device_events_*`.
pub fn prometheus_text(state: &AppState) -> String {
    use std::fmt::Write as _;
    let waiter = state.waiter.stats();
    let staging = state.staging.stats();
    let created: u64 = state
        .streams
        .iter()
        .map(|on| on.profiler.stats().created)
        .sum();
    let pooled: usize = state
        .streams
        .iter()
        .map(|on| on.profiler.stats().pooled)
        .sum();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(out, "# HELP device_events_{name} {help}");
        let _ = writeln!(out, "# TYPE device_events_{name} {kind}");
        let _ = writeln!(out, "device_events_{name} {value}");
    };
    let gauges: [(&str, &str, usize); 5] = [
        (
            "waiter_threads",
            "Waiter threads alive now.",
            waiter.threads,
        ),
        (
            "waiter_peak_threads",
            "The most waiter threads alive at once.",
            waiter.peak_threads,
        ),
        (
            "waiter_pending",
            "Waits handed to the waiter and not finished.",
            waiter.pending,
        ),
        (
            "waiter_cancelled_held",
            "Waits cancelled but still held by a blocked waiter thread.",
            waiter.cancelled_held,
        ),
        (
            "waiter_stuck_streams",
            "Streams whose oldest wait has gone past stuck_after with none of their waits ending.",
            waiter.stuck,
        ),
    ];
    for (name, help, value) in gauges {
        metric(name, "gauge", help, value as u64);
    }
    let counters = [
        (
            "waiter_ready_at_first_poll_total",
            "Awaits answered at their first poll.",
            waiter.ready_at_first_poll,
        ),
        (
            "waiter_handed_off_total",
            "Waits handed to the waiter's threads.",
            waiter.handed_off,
        ),
        (
            "waiter_resolved_total",
            "Handed-off waits resolved Ok.",
            waiter.resolved,
        ),
        (
            "waiter_failed_total",
            "Handed-off waits resolved with an error.",
            waiter.failed,
        ),
        (
            "waiter_watched_total",
            "Resolved waits the watcher saw end on their stream's progress word.",
            waiter.watched,
        ),
        (
            "waiter_watcher_cpu_microseconds_total",
            "CPU time the waiter's watcher thread has used (Linux).",
            u64::try_from(waiter.watcher_cpu.as_micros()).unwrap_or(u64::MAX),
        ),
        (
            "waiter_cancelled_total",
            "Handed-off waits whose future was dropped first.",
            waiter.cancelled,
        ),
        (
            "drop_queue_pushed_total",
            "Values pushed to the staging drop queue.",
            staging.pushed,
        ),
        (
            "drop_queue_dropped_total",
            "Values dropped after their fence passed.",
            staging.dropped,
        ),
        (
            "drop_queue_leaked_total",
            "Values leaked because their fence failed.",
            staging.leaked,
        ),
        (
            "profiler_events_created_total",
            "Timing events the profilers created.",
            created,
        ),
    ];
    for (name, help, value) in counters {
        metric(name, "counter", help, value);
    }
    metric(
        "drop_queue_pending",
        "gauge",
        "Values waiting for their fence.",
        staging.pending as u64,
    );
    metric(
        "profiler_events_pooled",
        "gauge",
        "Idle timing events in the profilers' pools.",
        pooled as u64,
    );
    let name = "device_events_waiter_wake_latency_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Handed-off waits, from hand-off to the task's wake."
    );
    let _ = writeln!(out, "# TYPE {name} histogram");
    let mut cumulative = 0;
    for (bound, count) in waiter.wake_latency.buckets() {
        cumulative += count;
        if let Some(bound) = bound {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{}\"}} {cumulative}",
                bound.as_secs_f64()
            );
        }
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
    let _ = writeln!(
        out,
        "{name}_sum {}",
        waiter.wake_latency.sum().as_secs_f64()
    );
    let _ = writeln!(out, "{name}_count {cumulative}");
    out
}

/// The process's thread count, from `/proc` (0 where there is none).
pub fn process_threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Threads:"))
                .and_then(|count| count.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use device_events::cuda::cudarc::driver::CudaContext;
    use device_events::cuda::{self, SleepKernel};
    use device_events::{AnyStream, ServerError};

    /// Device 0's context and a kernel of known length.
    pub struct Gpu {
        _ctx: Arc<CudaContext>,
        /// Work of a known length.
        pub sleep: SleepKernel,
    }

    impl Gpu {
        /// Device 0's context, the sleep kernel, and `streams` streams.
        pub fn open(streams: usize) -> Result<(Self, Vec<AnyStream>), ServerError> {
            let ctx = cuda::context(0)?;
            let sleep = SleepKernel::new(&ctx)?;
            let streams = (0..streams)
                .map(|_| ctx.new_stream().map(AnyStream::from))
                .collect::<Result<_, _>>()?;
            Ok((Self { _ctx: ctx, sleep }, streams))
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut port = DEFAULT_PORT;
    let mut wait_by = WaitBy::Await;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--spawn-blocking" => wait_by = WaitBy::SpawnBlocking,
            number => {
                port = number.parse().map_err(|_| {
                    format!(
                        "usage: http_service [PORT] [--spawn-blocking]; {number:?} is not a port"
                    )
                })?
            }
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let state = Arc::new(AppState::open(STREAMS, wait_by)?);
        let listener =
            tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
        println!(
            "listening on http://{} ({} streams, {}, waiting by {wait_by:?})",
            listener.local_addr()?,
            state.streams.len(),
            state.backend()
        );
        let ctrl_c = async {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("Ctrl-C: finishing requests in flight");
        };
        serve(listener, state, ctrl_c).await?;
        Ok(())
    })
}
