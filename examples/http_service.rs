//! An HTTP service as tokio users build one (axum on a multi-thread runtime):
//! `POST /jobs` launches work on one of a set of streams and awaits its
//! fence; `GET /stats` reports the waiter and the process's threads. CUDA
//! streams (with `SleepKernel`) when a GPU is present, host streams
//! otherwise.
//!
//! ```sh
//! cargo run --release --example http_service                    # port 3000
//! cargo run --release --example http_service -- 8080            # another port
//! cargo run --release --example http_service -- 3000 --spawn-blocking
//! curl -s -X POST localhost:3000/jobs -H 'content-type: application/json' \
//!      -d '{"work_us": 2000, "stream": "any"}'
//! curl -s localhost:3000/stats
//! ```
//!
//! A job is `{"work_us": N, "stream": "any" | K, "fault": false}`: `N`
//! microseconds of device work (0 to 10 s) on stream `K` (or the next one,
//! round robin). The answer is `{"stream", "queued_us", "total_us",
//! "backend"}`: the time the work waited behind earlier work on its stream,
//! and the whole request. Bad input gets a 4xx with the reason; a faulted
//! stream (`"fault": true` on a host stream panics in its work, as an illegal
//! address would) answers 500 with the `ServerError`, and the others go on.
//!
//! `--spawn-blocking` waits with `spawn_blocking(move || fence.wait_sync())`
//! instead of `.await`, for comparison. Ctrl-C stops accepting, lets requests
//! in flight finish (up to 10 s), then shuts the waiter down.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use device_events::host::{HostContext, HostStream};
use device_events::{AnyFence, ServerError, Waiter};
use serde_json::{json, Value};

/// The port when none is given.
pub const DEFAULT_PORT: u16 = 3000;
/// How many streams jobs run on.
pub const STREAMS: usize = 4;
/// The longest job accepted.
pub const MAX_WORK: Duration = Duration::from_secs(10);
/// How long shutdown lets requests in flight finish.
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// How a request waits for its fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitBy {
    /// `fence.await`, on this service's waiter.
    Await,
    /// `spawn_blocking(move || fence.wait_sync())`.
    SpawnBlocking,
}

/// The streams jobs run on.
pub enum Streams {
    /// CPU worker queues.
    Host(Vec<HostStream>),
    /// CUDA streams on device 0.
    #[cfg(feature = "cuda")]
    Cuda(gpu::Gpu),
}

/// What every request shares.
pub struct AppState {
    /// Where jobs run.
    pub streams: Streams,
    /// Serves this service's awaits; shut down with the service.
    pub waiter: Waiter,
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
    /// A stream's thread could not start.
    pub fn host(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        let streams = (0..streams)
            .map(|_| HostContext::new().new_stream())
            .collect::<Result<_, _>>()?;
        Ok(Self::with(Streams::Host(streams), wait_by))
    }

    /// CUDA streams when a GPU is present, host streams otherwise.
    ///
    /// # Errors
    ///
    /// A stream's thread could not start.
    pub fn open(streams: usize, wait_by: WaitBy) -> Result<Self, ServerError> {
        #[cfg(feature = "cuda")]
        match gpu::Gpu::open(streams) {
            Ok(gpu) => return Ok(Self::with(Streams::Cuda(gpu), wait_by)),
            Err(why) => eprintln!("no CUDA GPU ({why}): host streams"),
        }
        Self::host(streams, wait_by)
    }

    fn with(streams: Streams, wait_by: WaitBy) -> Self {
        Self {
            streams,
            waiter: Waiter::builder().thread_name("http-waiter").build(),
            wait_by,
            next: AtomicUsize::new(0),
        }
    }

    fn backend(&self) -> &'static str {
        match &self.streams {
            Streams::Host(_) => "Host",
            #[cfg(feature = "cuda")]
            Streams::Cuda(_) => "Cuda",
        }
    }

    fn stream_count(&self) -> usize {
        match &self.streams {
            Streams::Host(streams) => streams.len(),
            #[cfg(feature = "cuda")]
            Streams::Cuda(gpu) => gpu.streams.len(),
        }
    }
}

/// The service's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/jobs", post(job))
        .route("/stats", get(stats))
        .with_state(state)
}

/// Serve on `listener` until `shutdown` resolves, then let requests in flight
/// finish (up to [`SHUTDOWN_DEADLINE`]) and shut the waiter down.
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
    let count = state.stream_count();
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
    Ok(Job {
        work: Duration::from_micros(work_us),
        stream,
        fault,
    })
}

async fn job(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let received = Instant::now();
    let job = match parse_job(&state, &body) {
        Ok(job) => job,
        Err(response) => return response,
    };
    let started = Arc::new(AtomicU64::new(u64::MAX));
    let fence = match launch(&state, &job, &started, received) {
        Ok(fence) => fence,
        Err(response) => return response,
    };
    let waited = match state.wait_by {
        WaitBy::Await => state.waiter.wait(fence).await,
        WaitBy::SpawnBlocking => tokio::task::spawn_blocking(move || fence.wait_sync())
            .await
            .unwrap_or_else(|err| {
                Err(ServerError::WaiterPanicked {
                    message: err.to_string(),
                })
            }),
    };
    let total = received.elapsed();
    if let Err(err) = waited {
        return error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string());
    }
    let queued_us = match started.load(Ordering::SeqCst) {
        // Host: the work said when it started.
        started_us if started_us != u64::MAX => started_us,
        // CUDA: what the request took beyond the work itself.
        _ => u64::try_from(total.saturating_sub(job.work).as_micros()).unwrap_or(u64::MAX),
    };
    Json(json!({
        "stream": job.stream,
        "queued_us": queued_us,
        "total_us": u64::try_from(total.as_micros()).unwrap_or(u64::MAX),
        "backend": state.backend(),
    }))
    .into_response()
}

/// Queue the job's work on its stream; a fence after it.
#[allow(clippy::result_large_err)]
fn launch(
    state: &AppState,
    job: &Job,
    started: &Arc<AtomicU64>,
    received: Instant,
) -> Result<AnyFence, Response> {
    let refused = |err: ServerError| {
        let status = if err.is_faulted() {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        error(status, err.to_string())
    };
    match &state.streams {
        Streams::Host(streams) => {
            let stream = &streams[job.stream];
            let (work, fault, started) = (job.work, job.fault, started.clone());
            stream
                .launch(move || {
                    let queued = u64::try_from(received.elapsed().as_micros()).unwrap_or(0);
                    started.store(queued, Ordering::SeqCst);
                    assert!(!fault, "a fault injected by the request");
                    if !work.is_zero() {
                        std::thread::sleep(work);
                    }
                })
                .map_err(refused)?;
            Ok(stream.fence().into())
        }
        #[cfg(feature = "cuda")]
        Streams::Cuda(gpu) => {
            if job.fault {
                // A CUDA fault poisons the whole context, every stream with it.
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "\"fault\" is for host streams only: on CUDA it would fault every stream",
                ));
            }
            let stream = &gpu.streams[job.stream];
            gpu.sleep.launch(stream, job.work).map_err(refused)?;
            Ok(device_events::cuda::fence(stream).into())
        }
    }
}

async fn stats(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "backend": state.backend(),
        "wait_by": format!("{:?}", state.wait_by),
        "waiter": {
            "threads": state.waiter.threads(),
            "peak_threads": state.waiter.peak_threads(),
            "pending": state.waiter.pending(),
        },
        "process_threads": process_threads(),
    }))
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

    use device_events::cuda::cudarc::driver::{CudaContext, CudaStream};
    use device_events::cuda::{self, SleepKernel};
    use device_events::ServerError;

    /// Device 0's streams and a kernel of known length.
    pub struct Gpu {
        _ctx: Arc<CudaContext>,
        /// The streams jobs run on.
        pub streams: Vec<Arc<CudaStream>>,
        /// Work of a known length.
        pub sleep: SleepKernel,
    }

    impl Gpu {
        /// Device 0's context, `streams` streams and the sleep kernel.
        pub fn open(streams: usize) -> Result<Self, ServerError> {
            let ctx = cuda::context(0)?;
            let sleep = SleepKernel::new(&ctx)?;
            let streams = (0..streams)
                .map(|_| ctx.new_stream())
                .collect::<Result<_, _>>()?;
            Ok(Self {
                _ctx: ctx,
                streams,
                sleep,
            })
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
            state.stream_count(),
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
