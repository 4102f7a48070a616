//! The CUDA backend, on cudarc's driver API loaded at run time.
//!
//! The crate builds and runs without CUDA: the driver library is looked for on first use, and
//! its absence (or a driver too old, or no device) is a [`ServerError::Unavailable`], never a
//! panic. Fence events are created with `CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC`, so a
//! thread waiting on one sleeps in the driver instead of spinning. Every call binds the stream's
//! or event's context on the calling thread first, so any thread (a waiter thread has no current
//! context) may wait. Your threads get their previous context back after each call (and after
//! the crate drops the last handle of a context, which cudarc's drop leaves current); a binding
//! left from a context torn down and made again under the same handle is bound afresh, not
//! trusted. The crate's own threads (the waiter's, the drop queue's) keep the last one bound,
//! which spares a waiter thread two `cuCtxSetCurrent` calls per query in a burst.
//!
//! Where the device reports 64-bit stream memory operations and host-mapped memory, a stream
//! that a waiter has asked about (its watcher, or a spinning first poll) also keeps a progress
//! word: a fence's record is followed by a `cuStreamWriteValue64` of the fence's number into a
//! cache line of page-locked host memory, so the waiter's watcher (see
//! `WaiterBuilder::watchers`) and a spinning first poll (`WaiterBuilder::spin_budget`) read
//! memory instead of querying the driver, and ask the event once when the word says the stream
//! got there. Never on a capturing stream; any refusal leaves
//! the stream's fences on events alone.
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
/// context's pool: the same [`LiveEvents`](crate::LiveEvents) a host stream gives
/// ([`HostStream::live_events`](crate::host::HostStream::live_events)), so a leak check runs the
/// same on either backend (see [`AnyStream::live_events`](crate::AnyStream::live_events)). Idle
/// events in the context's pool do not count; it stays readable after the stream is dropped.
/// For tests: only with the `test-util` feature.
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
        driver::ensure_loaded()?;
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
        driver::ensure_loaded()?;
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
    /// program"), so a context made again under an old handle gets a new key. A driver without
    /// it: the address of the stream's cudarc context object, which every event made for the
    /// stream holds, so it is not reused while such an event is alive (two objects of one context
    /// then get two keys: less reuse, no error).
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
        driver::ensure_loaded()?;
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
    /// number, side by side.
    fn stream_id(stream: CudaStreamHandle) -> u64 {
        stream.lane_id()
    }

    /// The stream's progress word, once a fence wrote it: the first ask takes a word (off the
    /// fence path) for the stream's next fences outside a capture to write (see `progress.rs`:
    /// only where the device supports stream memory operations), so a stream no waiter watches
    /// writes none. The word holds the stream's context alive: its memory is the context's.
    fn stream_progress(stream: CudaStreamHandle) -> Option<crate::ProgressWord> {
        let (stream, per_stream) = stream.resolve_per_stream("cuStreamWriteValue64").ok()?;
        per_stream.progress(&stream)
    }

    fn fence_event_release(event: CudaEvent) -> Result<(), ServerError> {
        event.release()
    }

    fn fence_event_record(stream: CudaStreamHandle) -> Result<(CudaEvent, u64), ServerError> {
        driver::ensure_loaded()?;
        let (stream, per_stream) = stream.resolve_per_stream("cuEventCreate")?;
        crate::api::record_fence_event(
            || per_stream.pool.take(stream.context(), &per_stream.live),
            |event| per_stream.record_in_order(event, &stream),
            CudaEvent::release,
        )
    }
}
