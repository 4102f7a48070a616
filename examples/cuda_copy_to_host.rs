//! Recipe: await a device-to-host copy in an async handler.
//!
//! A handler queues its kernels and a copy of their result into page-locked
//! host memory with cudarc, awaits a fence behind the copy, then reads the
//! host memory. The await parks the task, not the executor thread: the
//! runtime serves other requests while the device works.
//!
//! Every value read back is checked against the value written; a wrong one
//! fails the run (exit status 1), as does a driver error.
//!
//! `cargo run --example cuda_copy_to_host` needs a CUDA GPU, or the crate's
//! fake driver (`scripts/fake-cuda.sh` runs it there); without one it prints
//! why it skips and exits 0 (with `DEVICE_EVENTS_REQUIRE_CUDA=1`, it fails
//! instead). Built only with the `cuda` feature (a default one).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use device_events::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream, PinnedHostSlice};
use device_events::cuda::{self, SleepKernel};
use device_events::ServerError;

/// `u32`s per result: 4 MiB.
const LEN: usize = 1 << 20;
const REQUESTS: usize = 4;
/// Each request's kernels, stood in for by a sleep kernel.
const WORK: Duration = Duration::from_millis(20);

/// The pattern: copies `src` (on the device) into `host` (page-locked) and
/// returns the host's copy once the device has written it, without blocking
/// the calling thread.
///
/// Why the fence must be awaited before the read: `memcpy_dtoh` only queues
/// the copy (`cuMemcpyDtoHAsync`) behind the work already on the stream, and
/// returns at once. Until the fence behind it passes, `host` holds whatever
/// it held before, or is being written. cudarc's `as_slice()` does wait for
/// the copy, but by blocking the calling thread (`cuEventSynchronize` on the
/// buffer's own event), an executor thread here, for as long as the kernels
/// and the copy take; and it only waits where cudarc tracks the buffer (a
/// context with a stream made by `new_stream()`, and event tracking on):
/// on a context used only through `default_stream()`, or after
/// `disable_event_tracking()`, it returns at once and the read races the
/// copy. Awaiting the fence parks the task until the copy is done; the read
/// after it finds the buffer's event passed and does not block.
///
/// Why the buffer must stay alive until then: the device writes into its
/// pages until the copy ends, and freed pages may be handed out again.
/// Where cudarc tracks it (as above), a dropped `PinnedHostSlice` waits for
/// its last copy before it frees, by blocking the dropping thread (and
/// `cuMemFreeHost` may wait for the device too). Here the buffer is borrowed
/// for the whole future, so safe code can neither drop nor reuse it while
/// the copy runs, and its owner keeps it for the next request. Dropping this
/// future early (a client gone, a timeout) stops the wait, not the copy: the
/// copy still lands, and the buffer's next use must come after it (a copy
/// queued on the same stream does; a tracked buffer's `as_slice()` blocks
/// for it). To free a buffer that a copy may still write, without blocking,
/// give it to a `device_events::drop_queue::DropQueue` with a fence.
async fn copy_to_host<'a>(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<u32>,
    host: &'a mut PinnedHostSlice<u32>,
) -> Result<&'a [u32], ServerError> {
    stream.memcpy_dtoh(src, host)?; // queued: returns before the copy ran
    cuda::fence(stream).await?; // the task sleeps until the copy is done
    let host: &'a PinnedHostSlice<u32> = host;
    Ok(&host.as_slice()?[..src.len()]) // the copy's event has passed: no wait
}

/// What the service holds, made at start-up.
struct Service {
    stream: Arc<CudaStream>,
    sleep: SleepKernel,
    /// One result per request, on the device.
    results: Vec<CudaSlice<u32>>,
    /// The staging buffer, reused by every request. Page-locked memory is
    /// allocated once, not per request: allocating it is a point where the
    /// context's streams wait for each other (the CUDA C++ Programming
    /// Guide, "Implicit Synchronization"), and freeing it may wait for the
    /// device. Plain page-locked memory, not cudarc's `alloc_pinned()`, which
    /// allocates write-combined memory: fast for the host to write and the
    /// device to read, but "cannot be read efficiently by most CPUs" (the
    /// driver API's `cuMemHostAlloc`), and the host reads this one.
    staging: tokio::sync::Mutex<PinnedHostSlice<u32>>,
}

/// Value `i` of request `request`'s result.
fn expected(request: usize, i: usize) -> u32 {
    ((request << 24) | i) as u32
}

impl Service {
    /// Opening the device, loading a kernel and page-locking memory block:
    /// done once, before the runtime serves.
    fn open() -> Result<Self, ServerError> {
        let ctx: Arc<CudaContext> = cuda::context(0)?;
        let stream = ctx.new_stream()?;
        let sleep = SleepKernel::new(&ctx)?;
        let results = (0..REQUESTS)
            .map(|request| {
                let values: Vec<u32> = (0..LEN).map(|i| expected(request, i)).collect();
                stream.clone_htod(&values)
            })
            .collect::<Result<_, _>>()?;
        #[allow(unsafe_code)]
        // SAFETY: the memory is uninitialized after this call. Nothing reads
        // it before a copy has written it: the only read is `copy_to_host`'s,
        // after the fence behind its copy (of `LEN` values, the whole buffer)
        // has passed.
        let staging = unsafe { ctx.alloc_pinned_with_flags::<u32>(LEN, 0) }?;
        cuda::fence(&stream).wait_sync()?; // the uploads are done
        Ok(Self {
            stream,
            sleep,
            results,
            staging: tokio::sync::Mutex::new(staging),
        })
    }

    /// A handler: the request's kernels (a sleep kernel stands in for those
    /// that would compute its result, uploaded at start-up here), then its
    /// result read on the host and checked. Each request's result differs,
    /// and the staging buffer is shared: a read before its copy would see
    /// another's (or, for the first, the buffer's uninitialised bytes).
    async fn handle(&self, request: usize) -> Result<(), Failure> {
        let mut staging = self.staging.lock().await;
        self.sleep.launch(&self.stream, WORK)?;
        let host = copy_to_host(&self.stream, &self.results[request], &mut staging).await?;
        match host
            .iter()
            .enumerate()
            .find(|&(i, &value)| value != expected(request, i))
        {
            None if host.len() == LEN => Ok(()),
            None => Err(Failure::Read(format!(
                "request {request}: {} values read, {LEN} written",
                host.len()
            ))),
            Some((i, value)) => Err(Failure::Read(format!(
                "request {request}: value {i} read as {value:#x}, written as {:#x}",
                expected(request, i)
            ))),
        }
    }
}

/// Why a request failed: the driver, or bytes read back that differ from
/// those written.
enum Failure {
    Driver(ServerError),
    Read(String),
}

impl From<ServerError> for Failure {
    fn from(err: ServerError) -> Self {
        Self::Driver(err)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Driver(err) => err.fmt(f),
            Self::Read(what) => write!(f, "wrong bytes read back: {what}"),
        }
    }
}

fn main() -> ExitCode {
    let service = match Service::open() {
        Ok(service) => service,
        Err(err) if err.is_unavailable() => return no_gpu(&err),
        Err(err) => return failed(&err),
    };
    println!("backend: CUDA, device 0");
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let served = runtime.block_on(async {
        for request in 0..REQUESTS {
            let started = Instant::now();
            service.handle(request).await?;
            println!(
                "request {request}: {LEN} values read on the host after {:?} \
                 ({WORK:?} of kernels, then a 4 MiB copy), each as written",
                started.elapsed()
            );
        }
        Ok::<_, Failure>(())
    });
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => failed(&err),
    }
}

/// No usable GPU: one line saying why, and success; a failure with
/// `DEVICE_EVENTS_REQUIRE_CUDA=1`, as for the crate's CUDA tests.
fn no_gpu(err: &ServerError) -> ExitCode {
    if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1") {
        eprintln!("cuda_copy_to_host: DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}");
        return ExitCode::FAILURE;
    }
    println!(
        "cuda_copy_to_host: skipped, no CUDA GPU here ({err}); \
         set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
    );
    ExitCode::SUCCESS
}

fn failed(err: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("cuda_copy_to_host: failed: {err}");
    ExitCode::FAILURE
}
