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
//! `cargo run --example cuda_library_stream` needs a CUDA GPU; without one it
//! prints why it skips and exits 0 (with `DEVICE_EVENTS_REQUIRE_CUDA=1`, it
//! fails instead). Built only with the `cuda` feature (a default one).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use device_events::cuda;
use device_events::ServerError;

/// A stand-in for a library built on cudarc (candle, say).
mod library {
    use std::sync::Arc;
    use std::time::Duration;

    use device_events::cuda::cudarc::driver::{CudaContext, CudaStream};
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
        /// its stream and not waited for, as a library's calls are.
        pub fn forward(&self, time: Duration) -> Result<(), ServerError> {
            self.kernel.launch(&self.stream, time)
        }
    }
}

const A_WORK: Duration = Duration::from_millis(30);
const B_WORK: Duration = Duration::from_millis(50);

async fn run() -> Result<(), ServerError> {
    // Two libraries, each with its context object and stream on device 0.
    let a = library::Device::new(0)?;
    let b = library::Device::new(0)?;
    let (a_stream, b_stream) = (a.cuda_stream(), b.cuda_stream());

    // One library's work, awaited on its stream.
    let started = Instant::now();
    a.forward(A_WORK)?;
    cuda::fence(&a_stream).await?;
    println!(
        "library A's stream: fence awaited after {:?} (its {A_WORK:?} of work)",
        started.elapsed()
    );

    // Both libraries' work, side by side, awaited together.
    let started = Instant::now();
    a.forward(A_WORK)?;
    b.forward(B_WORK)?;
    tokio::try_join!(cuda::fence(&a_stream).wait(), cuda::fence(&b_stream).wait())?;
    println!(
        "libraries A and B: fences joined after {:?} ({A_WORK:?} and {B_WORK:?} side by side)",
        started.elapsed()
    );

    // The libraries go away with work in flight: a fence made before does
    // not need their streams or them.
    let started = Instant::now();
    a.forward(A_WORK)?;
    let fence = cuda::fence(&a_stream);
    drop((a_stream, b_stream, a, b));
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
