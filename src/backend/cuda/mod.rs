//! The CUDA backend, on cudarc's driver API loaded at run time: without a driver (or with one
//! too old, or no device) calls return [`ServerError::Unavailable`], never panic. Fence events are
//! `CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC`, so a waiting thread sleeps in the driver.
//! Every call binds the stream's or event's context first and gives your thread its previous
//! context back; for contexts and threads, default streams, faults and graph capture, see the
//! CUDA guide, docs/cuda.md.
//!
//! Where the device allows, a stream the waiter's watcher or a spinning first poll reads also
//! keeps a progress word, which tells with a load that a fence was passed (see the CUDA guide).
//!
//! From cudarc, a fence is one call:
//!
//! ```no_run
//! use device_events::cuda;
//!
//! let ctx = cuda::context(0)?; // an Arc<cudarc::driver::CudaContext>
//! let stream = ctx.new_stream()?; // an Arc<cudarc::driver::CudaStream>
//! // ... launch work on `stream` with cudarc ...
//! let fence = cuda::fence(&stream);
//! assert_eq!(format!("{fence:?}"), "CudaFence");
//! fence.wait_sync()?;
//! # Ok::<(), device_events::ServerError>(())
//! ```

mod bind;
mod context;
mod driver;
mod event;
mod fence_pool;
mod kernels;
mod progress;
mod stream;
mod word_thread;

use std::sync::Arc;
use std::time::Duration;

pub use context::{context, device_count};
pub use cudarc;
use cudarc::driver::{sys, CudaStream};
pub use event::CudaEvent;
pub use kernels::SleepKernel;
#[cfg(feature = "test-util")]
pub use kernels::{ptx_modules, FaultKernel};

/// Every driver entry point the backend probes before its first call: a driver library missing
/// any of them makes the backend unavailable. For tests (feature `test-util`) that build
/// stand-in drivers.
///
/// ```
/// assert!(device_events::cuda::required_symbols().contains(&"cuEventQuery"));
/// ```
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub fn required_symbols() -> &'static [&'static str] {
    driver::REQUIRED_SYMBOLS
}
pub use stream::CudaStreamHandle;

/// Counts of the events the backend made for `stream` and has not destroyed or given back to its
/// context's pool (idle pooled events do not count), readable after the stream is dropped: as
/// [`HostStream::live_events`](crate::host::HostStream::live_events). Feature `test-util`.
///
/// ```no_run
/// use device_events::cuda;
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let live = cuda::live_events(&stream);
/// let fence = cuda::fence(&stream);
/// assert_eq!(live.count(), 1);
/// fence.wait_sync()?; // its event goes back to the context's pool
/// assert_eq!(live.count(), 0);
/// # Ok::<(), device_events::ServerError>(())
/// ```
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub fn live_events(stream: &Arc<CudaStream>) -> crate::LiveEvents {
    CudaStreamHandle::new(stream)
        .resolve_per_stream("cuEventCreate")
        .map(|(_, per_stream)| per_stream.live.clone())
        .unwrap_or_default()
}

/// Wait (at most `timeout`) until every stream whose progress word was asked for before the call
/// has one installed, or was refused one (or, where the word thread could not start, will ask
/// again at its next wait): from then on, its next fence writes its word. Words
/// are taken on a thread of the crate's own, never where a wait waits, so a stream's first ask
/// gets none; tests that need a word at a given fence wait here first. Whether it got there in
/// time; `false` at once in a forked child. Feature `test-util`.
///
/// ```no_run
/// use device_events::cuda::{self, Cuda, CudaStreamHandle};
/// use device_events::EventApi;
/// use std::time::Duration;
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let handle = CudaStreamHandle::new(&stream);
/// assert!(Cuda::stream_progress(handle).is_none(), "the first ask gets none");
/// assert!(cuda::wait_for_progress_words(Duration::from_secs(10)));
/// cuda::fence(&stream).wait_sync()?; // writes the word
/// // Where the device supports stream memory operations:
/// assert!(Cuda::stream_progress(handle).is_some());
/// # Ok::<(), device_events::ServerError>(())
/// ```
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub fn wait_for_progress_words(timeout: Duration) -> bool {
    word_thread::wait_idle(timeout)
}

use crate::{EventApi, EventFence, EventFlags, ServerError};

/// The CUDA backend; see the [module](self) docs. Named as the type parameter of the generic
/// types, or through its aliases:
///
/// ```no_run
/// use device_events::cuda::{self, Cuda, CudaStreamHandle};
/// use device_events::{EventFence, EventProfiler};
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let fence: EventFence<Cuda> = EventFence::new(CudaStreamHandle::new(&stream));
/// let profiler = EventProfiler::<Cuda>::new();
/// # let _ = (fence, profiler);
/// # Ok::<(), device_events::ServerError>(())
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Cuda;

/// A fence on a CUDA stream.
///
/// ```no_run
/// use device_events::cuda::{self, CudaFence};
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let fences: Vec<CudaFence> = (0..4).map(|_| cuda::fence(&stream)).collect();
/// for fence in fences {
///     fence.wait_sync()?;
/// }
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub type CudaFence = EventFence<Cuda>;

/// Whether the driver loads and reports a device: the switch between a CUDA path and host fallback.
///
/// ```
/// if device_events::cuda::is_available() {
///     println!("running on the GPU");
/// } else {
///     println!("no GPU: running on host streams");
/// }
/// ```
pub fn is_available() -> bool {
    device_count().is_ok_and(|count| count > 0)
}

/// A fence at the current end of a cudarc stream, in one call.
///
/// ```no_run
/// use device_events::cuda;
///
/// let stream = cuda::context(0)?.new_stream()?;
/// // ... launch work on `stream` with cudarc ...
/// cuda::fence(&stream).wait_sync()?;
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub fn fence(stream: &Arc<CudaStream>) -> CudaFence {
    EventFence::new(CudaStreamHandle::new(stream))
}

/// `stream.fence()` on a cudarc `Arc<CudaStream>`: the same as [`cuda::fence(&stream)`](fence).
///
/// ```no_run
/// use device_events::cuda::{self, CudaStreamExt};
///
/// # async fn run() -> Result<(), device_events::ServerError> {
/// let stream = cuda::context(0)?.new_stream()?;
/// // ... launch work on `stream` with cudarc ...
/// stream.fence().await?; // or stream.fence().wait_sync()?
/// # Ok(())
/// # }
/// ```
pub trait CudaStreamExt {
    /// A fence at the current end of this stream's work.
    fn fence(&self) -> CudaFence;
}

impl CudaStreamExt for Arc<CudaStream> {
    fn fence(&self) -> CudaFence {
        fence(self)
    }
}

impl EventApi for Cuda {
    const BACKEND: &'static str = driver::BACKEND;
    type Stream = CudaStreamHandle;
    type Event = CudaEvent;

    fn event_create(stream: CudaStreamHandle, flags: EventFlags) -> Result<CudaEvent, ServerError> {
        driver::driver()?;
        let (stream, per_stream) = stream.resolve_per_stream("cuEventCreate")?;
        CudaEvent::create(stream.context(), flags, &per_stream.live)
    }

    fn event_record(event: &CudaEvent, stream: CudaStreamHandle) -> Result<(), ServerError> {
        event.record(&stream.resolve("cuEventRecord")?, None)
    }

    /// Under the stream's sequence lock (`PerStream::record_in_order`).
    fn event_record_sequenced(
        event: &CudaEvent,
        stream: CudaStreamHandle,
    ) -> Result<u64, ServerError> {
        let (stream, per_stream) = stream.resolve_per_stream("cuEventRecord")?;
        per_stream.record_in_order(event, &stream)
    }

    fn event_query(event: &CudaEvent) -> Result<bool, ServerError> {
        event.query()
    }

    fn event_synchronize(event: &CudaEvent) -> Result<(), ServerError> {
        event.synchronize()
    }

    fn event_destroy(event: CudaEvent) -> Result<(), ServerError> {
        event.destroy()
    }

    fn stream_wait_event(stream: CudaStreamHandle, event: &CudaEvent) -> Result<(), ServerError> {
        event.wait_on(&*stream.resolve("cuStreamWaitEvent")?)
    }

    fn stream_synchronize(stream: CudaStreamHandle) -> Result<(), ServerError> {
        driver::driver()?;
        let stream = stream.resolve("cuStreamSynchronize")?;
        stream::synchronize_stream(&stream)
    }

    fn event_elapsed(start: &CudaEvent, end: &CudaEvent) -> Result<Duration, ServerError> {
        let ms = f64::from(end.elapsed_ms(start)?);
        // Negative when the stop was reached before the start (recorded on different streams).
        let time = Duration::try_from_secs_f64(ms.abs() / 1000.0).map_err(|_| {
            driver::refused(
                "cuEventElapsedTime",
                sys::CUresult::CUDA_ERROR_UNKNOWN,
                &format!("the driver returned a time of {ms} ms"),
            )
        })?;
        if ms < 0.0 {
            return Err(ServerError::StopBeforeStart {
                backend: driver::BACKEND,
                by: time,
            });
        }
        Ok(time)
    }

    /// The driver's id of the stream's context (`cuCtxGetId`: "unique for the life of the
    /// program"). A driver without it: the address of the stream's cudarc context object, which
    /// the stream's events hold, so it is not reused while one is alive (less reuse, no error).
    fn stream_context(stream: CudaStreamHandle) -> Result<u64, ServerError> {
        let stream = stream.resolve("cuCtxGetId")?;
        let ctx = stream.context();
        Ok(match driver::driver()?.ctx_id(ctx)? {
            Some(id) => id,
            None => Arc::as_ptr(ctx) as usize as u64,
        })
    }

    /// From the stream's context's pool of idle fence events.
    fn fence_event_acquire(stream: CudaStreamHandle) -> Result<CudaEvent, ServerError> {
        driver::driver()?;
        let (stream, per_stream) = stream.resolve_per_stream("cuEventCreate")?;
        per_stream.pool.take(stream.context(), &per_stream.live)
    }

    /// One counter per stream: fences on different streams share nothing.
    fn stream_sequence(stream: CudaStreamHandle) -> u64 {
        match stream.resolve_per_stream("cuEventRecord") {
            Ok((_, per_stream)) => per_stream.next_sequence(),
            // A dropped stream records nothing after: the number sorts after every one it gave.
            Err(_) => u64::MAX,
        }
    }

    /// Exact: the stream's registry number and, for a per-thread default stream, its thread's
    /// number, side by side. Both are counters from 1 (the registry's, times its 16 shards, plus
    /// the shard; the thread's, or 0 if not per-thread), far below 2^32 in any process.
    fn stream_id(stream: CudaStreamHandle) -> u64 {
        stream.id | stream.thread << 32
    }

    /// The stream's progress word, once a fence wrote it; the first ask installs one for later
    /// fences (see `progress.rs`), so a stream no waiter watches writes none.
    fn stream_progress(stream: CudaStreamHandle) -> Option<crate::ProgressWord> {
        let (stream, per_stream) = stream.resolve_per_stream("cuStreamWriteValue64").ok()?;
        per_stream.progress(&stream)
    }

    fn fence_event_release(event: CudaEvent) -> Result<(), ServerError> {
        event.release()
    }

    fn fence_event_record(stream: CudaStreamHandle) -> Result<(CudaEvent, u64), ServerError> {
        driver::driver()?;
        let (stream, per_stream) = stream.resolve_per_stream("cuEventCreate")?;
        crate::api::record_fence_event(
            || per_stream.pool.take(stream.context(), &per_stream.live),
            |event| per_stream.record_in_order(event, &stream),
            CudaEvent::release,
        )
    }
}
