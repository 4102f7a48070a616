//! Recipe: await work on a stream that a library built on cudarc hands out.
//!
//! candle hands out its device's stream (`CudaDevice::cuda_stream()`, an
//! `Arc<cudarc::driver::CudaStream>`); `cuda::fence` takes such a stream as
//! it is. The `library` module below stands in for such a library: it opens
//! its own context and stream, queues its own work there, and hands the
//! stream out. What to know:
//!
//! - **The fence binds the stream's own context.** `cuda::fence(&stream)`
//!   makes the stream's context (`stream.context()`, the library's
//!   `CudaContext`) current for its calls and gives the calling thread its
//!   previous context back: no context is shared with the library or made
//!   current by hand, and `cuda::context` is not needed. (Contexts opened for
//!   one device from several places, as `CudaContext::new` in each library
//!   does, are one driver context: the device's primary context.)
//! - **The library keeps ownership.** The `Arc` is a clone: holding it keeps
//!   the stream alive (cudarc destroys a stream it made with its last `Arc`),
//!   so hold it no longer than the library expects. A fence does not hold
//!   the stream: once made, it needs neither the stream nor the library, and
//!   its event keeps the context alive until it resolves. A fence covers all
//!   the work queued on the stream before it, the library's own included.
//! - **Fences from two libraries' streams join** like any futures
//!   (`tokio::try_join!`, `futures::future::try_join_all`), each binding its
//!   own context, even on two devices; `fence.wait_async(..)` orders another
//!   stream after it on the device instead.
//! - **Per-thread default streams.** candle 0.11's `Device::new_cuda` hands
//!   out cudarc's per-thread default stream (`ctx.per_thread_stream()`):
//!   the calling thread's own stream, a different one on each thread. Make
//!   the fence on the thread that queued the work, with no `.await` between
//!   the two (a task may resume on another worker thread); it may be awaited
//!   anywhere. `Device::new_cuda_with_stream` gives a stream of its own
//!   (`new_stream()`), and candle 0.10's `Device::new_cuda` the legacy
//!   default stream (`default_stream()`): either may be fenced from any
//!   thread.
//! - **Libraries that hand out no `Arc<CudaStream>`.** cubecl makes its
//!   streams through cudarc's lower layers and keeps the raw `CUstream`s
//!   inside its compute server. A raw `CUstream` from a library can be
//!   wrapped with cudarc's `CudaContext::wrap_borrowed_stream` (unsafe: its
//!   owner must keep it alive; in cudarc 0.19.10) and fenced like any other.
//!
//! Each library's result is read back after its fence and checked; a wrong
//! value fails the run (exit status 1), as does a driver error.
//!
//! `cargo run --example cuda_library_stream` needs a CUDA GPU, or the crate's
//! fake driver (`scripts/fake-cuda.sh` runs it there); without one it prints
//! why it skips and exits 0 (with `DEVICE_EVENTS_REQUIRE_CUDA=1`, it fails
//! instead). Built only with the `cuda` feature (a default one).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use device_events::cuda;
use device_events::cuda::cudarc::driver::{CudaSlice, CudaStream};
use device_events::ServerError;

/// A stand-in for a library built on cudarc (candle, say).
mod library {
    use std::sync::Arc;
    use std::time::Duration;

    use device_events::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use device_events::cuda::SleepKernel;
    use device_events::ServerError;

    /// The library's device: its own context object, as candle's
    /// `CudaDevice` holds one, and its own stream.
    pub struct Device {
        stream: Arc<CudaStream>,
        kernel: SleepKernel,
    }

    impl Device {
        pub fn new(ordinal: usize) -> Result<Self, ServerError> {
            let ctx = CudaContext::new(ordinal)?;
            let stream = ctx.new_stream()?;
            let kernel = SleepKernel::new(&ctx)?;
            Ok(Self { stream, kernel })
        }

        /// The library's stream, as candle's `CudaDevice::cuda_stream()`.
        pub fn cuda_stream(&self) -> Arc<CudaStream> {
            self.stream.clone()
        }

        /// The library's own work (a model's forward pass, say), queued on
        /// its stream and not waited for, as a library's calls are: kernels
        /// (a sleep kernel stands in for them) and their result, `input`
        /// times each index (uploaded here, as the kernels would compute
        /// it), in device memory written once the kernels end.
        pub fn forward(&self, time: Duration, input: u32) -> Result<CudaSlice<u32>, ServerError> {
            let mut output = self.stream.alloc_zeros::<u32>(super::LEN)?;
            self.kernel.launch(&self.stream, time)?;
            let result: Vec<u32> = (0..super::LEN).map(|i| super::expected(input, i)).collect();
            self.stream.memcpy_htod(&result, &mut output)?;
            Ok(output)
        }
    }
}

const A_WORK: Duration = Duration::from_millis(30);
const B_WORK: Duration = Duration::from_millis(50);
/// Values in each result.
const LEN: usize = 1 << 16;

/// Value `i` of the result of a forward pass given `input`.
fn expected(input: u32, i: usize) -> u32 {
    input.wrapping_mul(i as u32)
}

/// Reads a result back, once the fence behind it has passed, and checks it.
/// The copy is queued on the library's stream, behind nothing now: it
/// returns once the bytes are on the host (a copy to pageable memory
/// returns only once it has completed), without waiting for other work.
fn check(
    stream: &Arc<CudaStream>,
    output: &CudaSlice<u32>,
    input: u32,
    what: &str,
) -> Result<(), Failure> {
    let read = stream.clone_dtoh(output).map_err(ServerError::from)?;
    match read
        .iter()
        .enumerate()
        .find(|&(i, &value)| value != expected(input, i))
    {
        None if read.len() == LEN => Ok(()),
        None => Err(Failure::Read(format!(
            "{what}: {} values read, {LEN} written",
            read.len()
        ))),
        Some((i, value)) => Err(Failure::Read(format!(
            "{what}: value {i} read as {value}, computed as {}",
            expected(input, i)
        ))),
    }
}

async fn run() -> Result<(), Failure> {
    // Two libraries, each with its context object and stream on device 0.
    let a = library::Device::new(0)?;
    let b = library::Device::new(0)?;
    let (a_stream, b_stream) = (a.cuda_stream(), b.cuda_stream());

    // One library's work, awaited on its stream, and its result read.
    let started = Instant::now();
    let output = a.forward(A_WORK, 3)?;
    cuda::fence(&a_stream).await?;
    check(&a_stream, &output, 3, "library A")?;
    println!(
        "library A's stream: fence awaited after {:?} (its {A_WORK:?} of work), result as computed",
        started.elapsed()
    );

    // Both libraries' work, side by side, awaited together.
    let started = Instant::now();
    let a_output = a.forward(A_WORK, 5)?;
    let b_output = b.forward(B_WORK, 7)?;
    tokio::try_join!(cuda::fence(&a_stream).wait(), cuda::fence(&b_stream).wait())?;
    check(&a_stream, &a_output, 5, "library A, joined")?;
    check(&b_stream, &b_output, 7, "library B, joined")?;
    println!(
        "libraries A and B: fences joined after {:?} ({A_WORK:?} and {B_WORK:?} side by side), \
         results as computed",
        started.elapsed()
    );

    // The libraries go away with work in flight: a fence made before does
    // not need their streams or them (the result goes too: it holds its
    // stream).
    let started = Instant::now();
    let output = a.forward(A_WORK, 9)?;
    let fence = cuda::fence(&a_stream);
    drop((output, a_output, b_output, a_stream, b_stream, a, b));
    fence.await?;
    println!(
        "libraries dropped with work queued: the fence made before resolved after {:?}",
        started.elapsed()
    );
    Ok(())
}

fn main() -> ExitCode {
    // cudarc's `CudaContext::new` panics where no driver library loads, and
    // so would a library that calls it: ask this crate first, which answers
    // with an error.
    match cuda::device_count() {
        Ok(0) => return no_gpu(&"the driver reports no device"),
        Ok(_) => {}
        Err(err) => return no_gpu(&err),
    }
    println!("backend: CUDA, device 0, through two stand-in libraries' streams");
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("cuda_library_stream: failed: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Why the run failed: the driver, or a result read back that differs from
/// the one computed.
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

/// No usable GPU: one line saying why, and success; a failure with
/// `DEVICE_EVENTS_REQUIRE_CUDA=1`, as for the crate's CUDA tests.
fn no_gpu(why: &dyn std::fmt::Display) -> ExitCode {
    if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1") {
        eprintln!("cuda_library_stream: DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {why}");
        return ExitCode::FAILURE;
    }
    println!(
        "cuda_library_stream: skipped, no CUDA GPU here ({why}); \
         set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
    );
    ExitCode::SUCCESS
}
