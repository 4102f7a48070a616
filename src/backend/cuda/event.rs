//! [`CudaEvent`]: the CUDA backend's raw event, owned.

use std::fmt;
use std::sync::{Arc, Weak};

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::bind::{bind, HeldContext};
use super::driver::{driver, in_forked_child, not_forked, refused, Capture, Driver, RawEvent};
use super::fence_pool::FencePool;
use super::progress::Publish;
use crate::backend::live_events::LiveEvents;
use crate::sync::Mutex;
use crate::{status, EventFlags, ServerError};

/// The CUDA backend's raw event. It keeps its context alive; a drop destroys it unless
/// [`Cuda::event_destroy`](super::Cuda) did. Usually held in an [`Event`](crate::Event) or a fence:
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
    /// `None` only once destroyed or pooled; all that take it but [`Drop`] consume the event.
    raw: Option<RawEvent>,
    /// The pool a fence event goes back to, and its shard. Dropped before `ctx`: a pool dropped
    /// here destroys its idle events through a live object of its context, maybe this one's.
    pool: Option<(Arc<FencePool>, usize)>,
    /// Dropped after the event is destroyed (fields drop after `Drop`).
    ctx: HeldContext,
    /// Where its latest record was made (see [`Self::record`]).
    recorded: Mutex<Recorded>,
    /// Its stream's counts until destroyed or given back (`test-util` feature; [`LiveEvents`]).
    live: Option<LiveEvents>,
}

/// Where an event's latest record was made: a captured record marks a place in a graph, and the
/// driver refuses queries and waits on it (invalidating the capture while it goes on; after it,
/// `CUDA_ERROR_INVALID_VALUE`, measured on an H200), so this crate refuses first.
#[derive(Clone, Default)]
enum Recorded {
    /// Outside any capture (or never recorded): work that runs.
    #[default]
    Outside,
    /// In the capture of this id, on `stream` (held weakly, to ask whether the capture goes on).
    InCapture { id: u64, stream: Weak<CudaStream> },
    /// A capture began or ended on the stream (another thread's) during the record: it may be in a
    /// graph or not, and nothing the driver says tells which, so it counts as captured.
    Unknown,
}

impl Recorded {
    /// From the stream's capture state just before and just after the record: the same capture on
    /// both sides holds it (ids are unique for the process, and an ended capture never resumes);
    /// none on both sides means outside, unless a whole capture began and ended inside the call
    /// (see [`CudaEvent::answered`]).
    fn of(before: Capture, after: Capture, stream: &Arc<CudaStream>) -> Self {
        match (before, after) {
            (Capture::None, Capture::None) => Self::Outside,
            (Capture::Active(id), Capture::Active(same)) if id == same => Self::InCapture {
                id,
                stream: Arc::downgrade(stream),
            },
            _ => Self::Unknown,
        }
    }
}

impl CudaEvent {
    /// Create an event in `ctx`, for the stream counted in `live`.
    pub(super) fn create(
        ctx: &Arc<CudaContext>,
        flags: EventFlags,
        live: &LiveEvents,
    ) -> Result<Self, ServerError> {
        let bound = bind(ctx)?;
        let raw = bound.driver.event_create(flags)?;
        live.allocated();
        Ok(Self::from_raw(raw, ctx, Some(live)))
    }

    /// Own `raw`, an event of `ctx`'s, counted in `live` (if any) until destroyed or given back.
    pub(super) fn from_raw(
        raw: RawEvent,
        ctx: &Arc<CudaContext>,
        live: Option<&LiveEvents>,
    ) -> Self {
        Self {
            raw: Some(raw),
            pool: None,
            ctx: HeldContext::from(ctx.clone()),
            recorded: Mutex::default(),
            live: live.cloned(),
        }
    }

    /// No longer in use for its stream: counted out, once.
    fn uncount(&mut self) {
        if let Some(live) = self.live.take() {
            live.freed();
        }
    }

    /// The same event, to go back to `shard` of `pool` when released.
    pub(super) fn pooled(mut self, pool: Arc<FencePool>, shard: usize) -> Self {
        self.pool = Some((pool, shard));
        self
    }

    fn raw(&self) -> &RawEvent {
        self.raw
            .as_ref()
            .expect("a CudaEvent holds its handle until it is consumed")
    }

    /// Return a fence event to its context's pool, or destroy it if there is none or it is full. A
    /// pending last record is fine: the next `cuEventRecord` replaces it, which the driver allows.
    pub(super) fn release(mut self) -> Result<(), ServerError> {
        if in_forked_child() {
            // Forgotten by the drop: the pool's locks may be held in the parent.
            return Ok(());
        }
        if let (Some((pool, shard)), Some(raw)) = (self.pool.take(), self.raw.take()) {
            match pool.give_back(shard, raw) {
                Ok(()) => {
                    self.uncount();
                    return Ok(());
                }
                Err(full) => self.raw = Some(full),
            }
        }
        self.destroy()
    }

    /// Record at the current end of `stream`, of the event's context (a graph node if it captures),
    /// between two questions of its capture state ([`Recorded::of`]); until the second answer it is
    /// [`Recorded::Unknown`], so a concurrent query is refused.
    ///
    /// With `publish`, a record made while the stream was not capturing is followed, inside the
    /// same two questions, by the progress word's write; one that may have been captured turns the
    /// word off ([`StreamWord::captured`](super::progress::StreamWord::captured)).
    pub(super) fn record(
        &self,
        stream: &Arc<CudaStream>,
        publish: Option<Publish<'_>>,
    ) -> Result<(), ServerError> {
        const CALL: &str = "cuEventRecord";
        // The driver's own answer to a handle of one context on a stream of another, whichever
        // context is current (measured: an H200, driver 13000), given before calling it.
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(refused(
                CALL,
                sys::CUresult::CUDA_ERROR_INVALID_HANDLE,
                "the handle and the stream belong to different contexts",
            ));
        }
        let bound = bind(&self.ctx)?;
        let driver = bound.driver;
        let before = driver.stream_capture(CALL, stream)?;
        let previous = std::mem::replace(&mut *self.recorded.lock(), Recorded::Unknown);
        if let Err(refused) = driver.event_record(self.raw(), stream) {
            // Not recorded: the latest record is still the previous one.
            *self.recorded.lock() = previous;
            return Err(refused);
        }
        let published = match publish {
            Some(Publish { word, value }) if before == Capture::None => {
                word.publish(&bound, stream, value).then_some(word)
            }
            _ => None,
        };
        let after = driver.stream_capture(CALL, stream);
        let recorded = match &after {
            Ok(after) => Recorded::of(before, *after, stream),
            Err(_) => Recorded::Unknown,
        };
        if let (Some(word), false) = (published, matches!(recorded, Recorded::Outside)) {
            word.captured();
        }
        *self.recorded.lock() = recorded;
        after.map(|_| ())
    }

    fn recorded(&self) -> Recorded {
        self.recorded.lock().clone()
    }

    /// Refused when the latest record may be in a capture: see [`Recorded`].
    fn not_captured(&self, call: &'static str) -> Result<(), ServerError> {
        match self.recorded() {
            Recorded::Outside => Ok(()),
            Recorded::InCapture { .. } => Err(captured(call)),
            Recorded::Unknown => Err(maybe_captured(call, UNKNOWN_CAPTURE)),
        }
    }

    /// The driver's answer for an event recorded outside any capture, as far as the crate saw:
    /// `CUDA_ERROR_INVALID_VALUE` (its answer for an event of an ended capture) may mean a whole
    /// capture began and ended inside the record, so it is a capture status, never a fallback.
    fn answered<T>(call: &'static str, answer: Result<T, ServerError>) -> Result<T, ServerError> {
        answer.map_err(|err| {
            if err.code() != Some(status::INVALID_VALUE) {
                return err;
            }
            maybe_captured(
                call,
                "the driver answered CUDA_ERROR_INVALID_VALUE, its answer for an event \
                 recorded in a capture that has ended",
            )
            .with_source(err)
        })
    }

    /// Reached, not yet, or an error: all three outcomes of `cuEventQuery`.
    pub(super) fn query(&self) -> Result<bool, ServerError> {
        self.ask("cuEventQuery", Driver::event_query)
    }

    /// Block until reached; sleeps in the driver for a `BLOCKING_SYNC` event.
    pub(super) fn synchronize(&self) -> Result<(), ServerError> {
        self.ask("cuEventSynchronize", Driver::event_synchronize)
    }

    /// `call`, made on the event in the relaxed capture mode, unless its record may be captured.
    fn ask<T>(
        &self,
        call: &'static str,
        make: impl FnOnce(Driver, &RawEvent) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        not_forked()?;
        self.not_captured(call)?;
        let bound = bind(&self.ctx)?;
        Self::answered(call, bound.relaxed(|driver| make(driver, self.raw())))
    }

    /// Make `stream` (of any context) wait on the device for this event's latest record. What the
    /// driver would refuse, invalidating captures ("Stream capture" in its docs), is refused first:
    /// a capturing stream waits only on its own capture's events, a stream not capturing not on an
    /// ended capture's, and none on [`Recorded::Unknown`]; see the CUDA guide, docs/cuda.md.
    pub(super) fn wait_on(&self, stream: &CudaStream) -> Result<(), ServerError> {
        const CALL: &str = "cuStreamWaitEvent";
        let bound = bind(stream.context())?;
        let waiting = bound.driver.stream_capture(CALL, stream)?;
        let refusal = match (self.recorded(), waiting) {
            (Recorded::Outside, Capture::None) => None,
            (Recorded::Outside, _) => Some(refused(
                CALL,
                sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                "the stream is capturing a CUDA graph and the fence was recorded outside that \
                 capture: a captured stream can wait only on fences recorded in the same \
                 capture (the driver would refuse it and invalidate the capture, which is left \
                 intact); wait before beginning the capture, or on the host",
            )),
            (Recorded::InCapture { id, .. }, Capture::Active(same)) if id == same => None,
            (Recorded::InCapture { id, stream: origin }, Capture::Active(_)) => {
                Some(if self.capture_goes_on(id, &origin)? {
                    refused(
                        CALL,
                        sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_MERGE,
                        "the stream is capturing a CUDA graph and the fence was recorded in \
                         another capture: the wait would merge two independent captures (the \
                         driver would refuse it and invalidate both, which are left intact)",
                    )
                } else {
                    ended_capture()
                })
            }
            // Already invalidated: the driver's answer says so.
            (Recorded::InCapture { .. }, Capture::Invalidated) => None,
            (Recorded::InCapture { id, stream: origin }, Capture::None) => {
                (!self.capture_goes_on(id, &origin)?).then(ended_capture)
            }
            (Recorded::Unknown, _) => Some(maybe_captured(CALL, UNKNOWN_CAPTURE)),
        };
        match refusal {
            Some(err) => Err(err),
            None => bound.driver.stream_wait_event(stream, self.raw()),
        }
    }

    /// Whether capture `id`, which `origin` was in, goes on (its streams stay in it until it ends).
    fn capture_goes_on(&self, id: u64, origin: &Weak<CudaStream>) -> Result<bool, ServerError> {
        let Some(origin) = origin.upgrade() else {
            return Ok(false);
        };
        let bound = bind(origin.context())?;
        Ok(bound.driver.stream_capture("cuStreamWaitEvent", &origin)? == Capture::Active(id))
    }

    /// Milliseconds from `start` to `self`; refused first across contexts, as the driver would.
    pub(super) fn elapsed_ms(&self, start: &Self) -> Result<f32, ServerError> {
        start.not_captured("cuEventElapsedTime")?;
        self.not_captured("cuEventElapsedTime")?;
        if start.ctx.cu_ctx() != self.ctx.cu_ctx() {
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

    /// Destroy now and report the driver's answer (without blocking: see
    /// [`Driver::event_destroy`](super::driver::Driver::event_destroy)).
    pub(super) fn destroy(mut self) -> Result<(), ServerError> {
        self.destroy_raw()
    }

    fn destroy_raw(&mut self) -> Result<(), ServerError> {
        let Some(raw) = self.raw.take() else {
            return Ok(());
        };
        self.uncount();
        // In a forked child no CUDA call is made; its pool and context are the parent's.
        if let Err(forked) = not_forked() {
            std::mem::forget(self.pool.take());
            return Err(forked);
        }
        // Destroyed even if the bind fails (say, a faulted context), else it leaks for good.
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
            // Gone with the driver (at exit, say): its shutdown was logged once, where first seen.
            Err(err) if err.is_shut_down() || err.is_unavailable() => log::trace!("{err}"),
            Err(err) => log::error!("a CUDA event could not be destroyed: {err}"),
        }
    }
}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CudaEvent").field(self.raw()).finish()
    }
}

/// Why a [`Recorded::Unknown`] record may be in a capture.
const UNKNOWN_CAPTURE: &str =
    "a capture began or ended on the fence's stream (on another thread) while the fence was \
     recorded";

/// A wait on an event recorded in a capture that has ended, refused.
fn ended_capture() -> ServerError {
    refused(
        "cuStreamWaitEvent",
        sys::CUresult::CUDA_ERROR_CAPTURED_EVENT,
        "the fence was recorded in a CUDA graph capture that has ended: it marks a place in a \
         graph, not work that runs, so there is nothing to wait for; record a fence after \
         launching the graph instead",
    )
}

/// A query or wait of an event recorded in a capture, refused.
fn captured(call: &'static str) -> ServerError {
    refused(
        call,
        sys::CUresult::CUDA_ERROR_CAPTURED_EVENT,
        "the fence was recorded while its stream was capturing a CUDA graph: it marks a \
         place in the graph, not work that runs, so it cannot be queried or waited on \
         (the driver would invalidate the capture); record a fence after launching the \
         graph instead",
    )
}

/// As [`captured`], for a record that may be in a capture: `why` says what left it in doubt.
fn maybe_captured(call: &'static str, why: &str) -> ServerError {
    refused(
        call,
        sys::CUresult::CUDA_ERROR_CAPTURED_EVENT,
        &format!(
            "the fence may have been recorded into a CUDA graph capture ({why}): it may mark a \
             place in a graph, which can be launched later, so it is never taken as reached; \
             record fences on a stream only while no other thread begins or ends a capture of it"
        ),
    )
}
