//! [`CudaEvent`]: the CUDA backend's raw event, owned.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::bind::{bind, HeldContext};
use super::driver::{driver, invalid_context, refused, RawEvent};
use super::fence_pool::FencePool;
use crate::{EventFlags, ServerError};

/// The CUDA backend's raw event. It keeps its context alive, and is destroyed
/// when dropped if [`Cuda::event_destroy`](super::Cuda) did not already.
/// Usually held inside an [`Event`](crate::Event) or a fence:
///
/// ```no_run
/// use device_events::cuda::{self, Cuda, CudaStreamHandle};
/// use device_events::{Event, EventFlags};
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let handle = CudaStreamHandle::new(&stream);
/// let event = Event::<Cuda>::new(handle, EventFlags::TIMING)?;
/// event.record(handle)?;
/// let raw: &cuda::CudaEvent = event.raw();
/// println!("{raw:?}");
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct CudaEvent {
    /// `None` only once destroyed or pooled: every path that takes it
    /// consumes the event, but for [`Drop`].
    raw: Option<RawEvent>,
    /// Dropped after the event is destroyed (fields drop after `Drop`),
    /// leaving the thread's current context as found if it is the last.
    ctx: HeldContext,
    /// The pool a fence event goes back to, and the shard it came from.
    pool: Option<(Arc<FencePool>, usize)>,
    /// Whether its latest record was made while the stream was capturing a
    /// graph: then it marks a place in the graph, and the driver refuses to
    /// query or wait on it (and a query invalidates the capture), so this
    /// crate refuses first (see [`Self::record`]).
    captured: AtomicBool,
}

impl CudaEvent {
    /// Create an event in `ctx`.
    pub(super) fn create(ctx: &Arc<CudaContext>, flags: EventFlags) -> Result<Self, ServerError> {
        let bound = bind(ctx)?;
        let raw = bound.driver().event_create(flags)?;
        Ok(Self::from_raw(raw, ctx))
    }

    /// Own `raw`, an event of `ctx`'s.
    pub(super) fn from_raw(raw: RawEvent, ctx: &Arc<CudaContext>) -> Self {
        Self {
            raw: Some(raw),
            ctx: HeldContext::new(ctx),
            pool: None,
            captured: AtomicBool::new(false),
        }
    }

    /// The same event, to go back to `shard` of `pool` when released.
    pub(super) fn pooled(mut self, pool: Arc<FencePool>, shard: usize) -> Self {
        self.pool = Some((pool, shard));
        self
    }

    /// The handle; held from creation until the event is consumed.
    fn raw(&self) -> &RawEvent {
        self.raw
            .as_ref()
            .expect("a CudaEvent holds its handle until it is consumed")
    }

    /// Give a fence event back to its context's pool, or destroy it when the
    /// pool is full (or it has none). Its last record may still be pending:
    /// the next `cuEventRecord` replaces it, which the driver allows.
    pub(super) fn release(mut self) -> Result<(), ServerError> {
        if let (Some((pool, shard)), Some(raw)) = (self.pool.take(), self.raw.take()) {
            match pool.give_back(shard, raw) {
                Ok(()) => return Ok(()),
                Err(full) => self.raw = Some(full),
            }
        }
        self.destroy()
    }

    /// Record at the current end of `stream`; the stream must share the
    /// event's context. On a stream capturing a graph the record is legal
    /// and becomes a node of the graph: the event is marked captured, which
    /// is asked of the driver after the record, so a capture that begins
    /// meanwhile marks it too (failing its waits, not a capture).
    pub(super) fn record(&self, stream: &CudaStream) -> Result<(), ServerError> {
        same_context("cuEventRecord", &self.ctx, stream)?;
        let bound = bind(&self.ctx)?;
        bound.driver().event_record(self.raw(), stream)?;
        let captured = !crate::plant::planted("cuda-captured-record-not-marked")
            && bound.driver().stream_is_capturing(stream)?;
        self.captured.store(captured, Ordering::Relaxed);
        Ok(())
    }

    /// Refused when the latest record was captured: see [`Self::captured`].
    fn not_captured(&self, call: &'static str) -> Result<(), ServerError> {
        if !self.captured.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(refused(
            call,
            sys::CUresult::CUDA_ERROR_CAPTURED_EVENT,
            "the fence was recorded while its stream was capturing a CUDA graph: it marks a \
             place in the graph, not work that runs, so it cannot be queried or waited on \
             (the driver would invalidate the capture); record a fence after launching the \
             graph instead",
        ))
    }

    /// Reached, not yet, or an error: all three outcomes of `cuEventQuery`.
    pub(super) fn query(&self) -> Result<bool, ServerError> {
        self.not_captured("cuEventQuery")?;
        let bound = bind(&self.ctx)?;
        bound.relaxed(|driver| driver.event_query(self.raw()))
    }

    /// Block until reached; sleeps in the driver for a `BLOCKING_SYNC` event.
    pub(super) fn synchronize(&self) -> Result<(), ServerError> {
        self.not_captured("cuEventSynchronize")?;
        let bound = bind(&self.ctx)?;
        bound.relaxed(|driver| driver.event_synchronize(self.raw()))
    }

    /// Make `stream` wait for this event's latest record, on the device. Works
    /// across contexts. A stream capturing a graph may wait only on an event
    /// recorded in a capture (the driver joins or refuses the two); one
    /// recorded outside is refused here, before the driver refuses it with
    /// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` and invalidates the capture.
    pub(super) fn wait_on(&self, stream: &CudaStream) -> Result<(), ServerError> {
        let bound = bind(stream.context())?;
        if !self.captured.load(Ordering::Relaxed)
            && !crate::plant::planted("cuda-capturing-stream-waits-on-outside-event")
            && bound.driver().stream_is_capturing(stream)?
        {
            return Err(refused(
                "cuStreamWaitEvent",
                sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                "the stream is capturing a CUDA graph and the fence was recorded outside that \
                 capture: a captured stream can wait only on fences recorded in the same \
                 capture (the driver would refuse it and invalidate the capture, which is left \
                 intact); wait before beginning the capture, or on the host",
            ));
        }
        bound.driver().stream_wait_event(stream, self.raw())
    }

    /// Milliseconds from `start` to `self`, as the driver measures them;
    /// refused before the driver when the two events belong to different
    /// contexts (the driver answers `CUDA_ERROR_INVALID_HANDLE` there).
    pub(super) fn elapsed_ms(&self, start: &Self) -> Result<f32, ServerError> {
        start.not_captured("cuEventElapsedTime")?;
        self.not_captured("cuEventElapsedTime")?;
        if start.ctx.cu_ctx() != self.ctx.cu_ctx()
            && !crate::plant::planted("cuda-elapsed-across-contexts-not-refused")
        {
            return Err(refused(
                "cuEventElapsedTime",
                sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
                "the start and stop events belong to different contexts: a measurement's two \
                 events must be recorded on streams of one context",
            ));
        }
        let bound = bind(&self.ctx)?;
        bound.relaxed(|driver| driver.event_elapsed_ms(start.raw(), self.raw()))
    }

    /// Destroy now and report the driver's answer. Does not block: the driver
    /// releases an event with pending work once the work completes.
    pub(super) fn destroy(mut self) -> Result<(), ServerError> {
        self.destroy_raw()
    }

    fn destroy_raw(&mut self) -> Result<(), ServerError> {
        let Some(raw) = self.raw.take() else {
            return Ok(());
        };
        // The destroy is attempted even if the bind fails (a faulted
        // context, say): skipping it would leak the event for good.
        let bound = bind(&self.ctx);
        let destroyed = driver().and_then(|driver| driver.event_destroy(raw));
        drop(bound);
        destroyed
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        match self.destroy_raw() {
            Ok(()) => {}
            // Gone with the driver (at process exit, say): the driver's
            // shutdown was logged once, where it was first seen.
            Err(err) if err.is_shut_down() => log::trace!("{err}"),
            Err(err) => log::error!("a CUDA event could not be destroyed: {err}"),
        }
    }
}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut event = f.debug_struct("CudaEvent");
        if let Some(raw) = &self.raw {
            event.field("raw", raw);
        }
        event.finish()
    }
}

/// The driver refuses a handle of one context used on a stream of another
/// (`CUDA_ERROR_INVALID_HANDLE`): say so before calling it.
fn same_context(
    call: &'static str,
    ctx: &CudaContext,
    stream: &CudaStream,
) -> Result<(), ServerError> {
    if stream.context().cu_ctx() == ctx.cu_ctx() {
        return Ok(());
    }
    let message = "the handle and the stream belong to different contexts";
    if crate::plant::planted("cuda-cross-context-record-invalid-context") {
        return Err(invalid_context(call, message));
    }
    // The driver's own answer (measured: an H200, driver 13000), whichever
    // context is current.
    Err(refused(
        call,
        sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
        message,
    ))
}
