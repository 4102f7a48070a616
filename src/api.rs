//! The backend contract: what a driver must offer for events and fences, and
//! [`ProgressWord`], how far a stream has got, in host memory that the stream itself sets as it
//! passes each recorded point, so a host thread learns it with a memory load, not a driver call.

use core::fmt::{self, Debug};
use core::hash::{Hash, Hasher};
use core::time::Duration;
use std::collections::hash_map::DefaultHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::ServerError;

/// Orders recorded points across the process: for backends that keep no per-stream order (the
/// default `EventApi::stream_sequence`), and for fences resolved at creation.
static NEXT_SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// The next number in the process-wide order of recorded points.
pub(crate) fn next_sequence() -> u64 {
    NEXT_SEQUENCE.fetch_add(1, Ordering::Relaxed)
}

/// How an event is created.
///
/// Fences want [`EventFlags::FENCE`]: no timestamps (cheaper to record) and a blocking
/// synchronize, so a thread waiting on one sleeps in the driver rather than spinning. Timing
/// events ([`EventFlags::TIMING`]) keep timestamps for [`EventApi::event_elapsed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventFlags {
    /// Record a timestamp, so the time between two events can be read.
    pub timing: bool,
    /// A synchronize on this event sleeps instead of spinning.
    pub blocking_sync: bool,
}

impl EventFlags {
    /// For fences: no timing, blocking synchronize.
    pub const FENCE: Self = Self {
        timing: false,
        blocking_sync: true,
    };
    /// For profiling: timing on, blocking synchronize.
    pub const TIMING: Self = Self {
        timing: true,
        blocking_sync: true,
    };
}

/// A backend's event and stream calls, shaped like a driver's C API.
///
/// Every function is static and works on raw handles; [`Event`](crate::Event) and
/// [`EventFence`](crate::EventFence) add ownership and the fallbacks. Implementations must never
/// panic on a driver or user fault: every failure comes back as a [`ServerError`].
///
/// Driver rules an implementation keeps (CUDA driver API semantics):
/// - an event never recorded is complete;
/// - a record replaces the event's previous record, and a query, synchronize or stream wait
///   refers to the most recent record at the time of the call;
/// - destroying an event whose work is pending is allowed and does not block.
///
/// The trait also has hooks for fence events, hidden from these docs as they are for backends,
/// not callers: `fence_event_acquire`, `fence_event_release`, `fence_event_record`,
/// `event_record_sequenced`, `stream_sequence`, `stream_id` and `stream_progress`. Their
/// defaults (create, destroy, create-then-record, record-then-number, one process-wide counter,
/// a hash of the handle, no progress word) are correct for any backend; a backend may override
/// them to pool fence events, keep a counter per stream, number its streams exactly or publish
/// its streams' progress. Their contracts are documented in the source, `src/api.rs`.
pub trait EventApi: Sized + Send + Sync + 'static {
    /// The backend's name, e.g. `"Cuda"` or `"Host"`.
    const BACKEND: &'static str;

    /// A stream handle: cheap to copy, usable as a map key.
    type Stream: Copy + Send + Sync + Eq + Hash + Debug + 'static;

    /// A raw event. Owned: [`EventApi::event_destroy`] consumes it.
    type Event: Send + Sync + 'static;

    /// Create an event belonging to `stream`'s device and context (an event belongs to a
    /// context: CUDA refuses to record an event on a stream of another context).
    ///
    /// # Errors
    ///
    /// The driver refused (out of resources, a faulted context), or `stream` is invalid (a
    /// dropped stream: [`status::INVALID_HANDLE`](crate::status::INVALID_HANDLE)).
    fn event_create(stream: Self::Stream, flags: EventFlags) -> Result<Self::Event, ServerError>;

    /// Record `event` at the current end of `stream`'s work.
    ///
    /// # Errors
    ///
    /// The driver refused, `stream` is faulted ([`ServerError::Faulted`]) or
    /// invalid, or the event belongs to another context.
    fn event_record(event: &Self::Event, stream: Self::Stream) -> Result<(), ServerError>;

    /// Ask, without blocking, whether the device has reached `event`: `Ok(true)` reached,
    /// `Ok(false)` not yet, `Err` a fault (never folded into "not yet").
    ///
    /// # Errors
    ///
    /// A fault of the work before the event, or a refused call.
    fn event_query(event: &Self::Event) -> Result<bool, ServerError>;

    /// Block the calling thread until the device has reached `event`.
    ///
    /// # Errors
    ///
    /// A fault of the work before the event, or a refused call.
    fn event_synchronize(event: &Self::Event) -> Result<(), ServerError>;

    /// Release `event`. Must not block, even when its work is still pending.
    ///
    /// # Errors
    ///
    /// The driver refused (a faulted context, say); the event is gone either way.
    fn event_destroy(event: Self::Event) -> Result<(), ServerError>;

    /// Make `stream`'s later work wait, on the device, for `event`'s most recent record. Does
    /// not block the host.
    ///
    /// # Errors
    ///
    /// The driver refused the dependency, or `stream` is faulted or invalid
    /// ([`status::INVALID_HANDLE`](crate::status::INVALID_HANDLE): the caller's bug, which
    /// [`EventFence::wait_async`](crate::EventFence::wait_async) does not paper over with a
    /// host wait).
    fn stream_wait_event(stream: Self::Stream, event: &Self::Event) -> Result<(), ServerError>;

    /// Block the calling thread until all work queued on `stream` is done.
    ///
    /// # Errors
    ///
    /// A fault of the stream's work, or `stream` is invalid.
    fn stream_synchronize(stream: Self::Stream) -> Result<(), ServerError>;

    /// Device time from `start` to `end`; both must be timing events and reached.
    ///
    /// # Errors
    ///
    /// Either event has no timing or is not reached (`CUDA_ERROR_NOT_READY`), or a fault.
    fn event_elapsed(start: &Self::Event, end: &Self::Event) -> Result<Duration, ServerError>;

    /// A key of `stream`'s context (device), for pools of events that belong to one context:
    /// an [`EventProfiler`](crate::EventProfiler) keeps its idle timing events per key, so one
    /// profiler serves every context it is given.
    ///
    /// For a backend's author, the contract:
    /// - an event created for a stream of one key can be recorded on every stream of that key
    ///   (one key, one context);
    /// - a key is never given to a stream of another context while an event created for a
    ///   stream of that key may still be alive: a number unique for the life of the process is
    ///   simplest;
    /// - streams of one context should share a key (else each key gets its own pool, and
    ///   events are reused less).
    ///
    /// The default gives every stream the key 0, right for a backend with one context. A
    /// backend with more that keeps the default gets one pool per profiler: used on a second
    /// context, a profiler finds its idle events refused there and says so (a
    /// [`ServerError::InvalidArgument`]), so its users keep one profiler per context.
    ///
    /// # Errors
    ///
    /// `stream` is invalid (a dropped stream:
    /// [`status::INVALID_HANDLE`](crate::status::INVALID_HANDLE)), or the driver refused to
    /// name the context.
    fn stream_context(stream: Self::Stream) -> Result<u64, ServerError> {
        let _ = stream;
        Ok(0)
    }

    /// An event for a fence on `stream` ([`EventFlags::FENCE`]): from the backend's pool of
    /// fence events when it keeps one, else a new one (the default creates one). Creating
    /// events contends on the driver's context lock on busy GPUs; a pool makes a steady loop of
    /// fences create none after warm-up.
    ///
    /// # Errors
    ///
    /// As for [`event_create`](Self::event_create).
    #[doc(hidden)]
    fn fence_event_acquire(stream: Self::Stream) -> Result<Self::Event, ServerError> {
        Self::event_create(stream, EventFlags::FENCE)
    }

    /// Give back an event from [`fence_event_acquire`](Self::fence_event_acquire) that nothing
    /// can wait on any more (its fence, future, waiter entry and drop-queue entry are gone):
    /// keep it for a later fence, or destroy it (the default). Its last record may still be
    /// pending; a later record replaces it, as the driver allows. Must not block.
    ///
    /// # Errors
    ///
    /// As for [`event_destroy`](Self::event_destroy).
    #[doc(hidden)]
    fn fence_event_release(event: Self::Event) -> Result<(), ServerError> {
        Self::event_destroy(event)
    }

    /// A number for a point just recorded on `stream`: larger for a later record on the same
    /// stream, and never the same twice for one stream. The waiter serves a stream's waits in
    /// this order. The default takes one process-wide counter; a backend with per-stream state
    /// keeps one counter per stream, so that fences on different streams, made on different
    /// cores, do not contend on one cache line. Such a backend answers `u64::MAX` for a stream
    /// it no longer finds (dropped): nothing is recorded on it after, so that number sorts after
    /// every one the stream gave.
    #[doc(hidden)]
    fn stream_sequence(stream: Self::Stream) -> u64 {
        let _ = stream;
        next_sequence()
    }

    /// A number that tells `stream` apart from every other stream of this backend alive at the
    /// same time: the waiter gives each number a lane of its own. The default hashes the
    /// handle, so two streams of a backend that keeps it may share a number (their waits then
    /// share a lane: one may wait behind the other's, but none fails or is lost).
    #[doc(hidden)]
    fn stream_id(stream: Self::Stream) -> u64 {
        let mut hasher = DefaultHasher::new();
        stream.hash(&mut hasher);
        hasher.finish()
    }

    /// `stream`'s progress word, if this backend keeps one: set by the stream itself, in its
    /// order, as it passes each point recorded on it, so that `passed(n)` tells that the point
    /// numbered `n` by [`stream_sequence`](Self::stream_sequence) was reached, with one load. A
    /// waiter may watch it rather than block; the point's event stays the truth (for faults, and
    /// to block on). A backend may start keeping one only once asked (the CUDA backend does, from
    /// the stream's next point: a word costs each record a write). The default keeps none.
    #[doc(hidden)]
    fn stream_progress(stream: Self::Stream) -> Option<ProgressWord> {
        let _ = stream;
        None
    }

    /// [`event_record`](Self::event_record) and the record's
    /// [`stream_sequence`](Self::stream_sequence) as one step of `stream`: two threads recording
    /// on one stream get numbers in the order of their records, so the waiter never serves a
    /// stream's newer record before an older one. The default records, then numbers; a backend
    /// whose records can race keeps the two under one per-stream lock.
    ///
    /// # Errors
    ///
    /// As for [`event_record`](Self::event_record).
    #[doc(hidden)]
    fn event_record_sequenced(
        event: &Self::Event,
        stream: Self::Stream,
    ) -> Result<u64, ServerError> {
        Self::event_record(event, stream)?;
        Ok(Self::stream_sequence(stream))
    }

    /// A fence's whole making: [`fence_event_acquire`](Self::fence_event_acquire) then
    /// [`event_record_sequenced`](Self::event_record_sequenced) on `stream`, giving the event
    /// back if the record fails. One call, so a backend can resolve the stream once (every
    /// fence pays for it).
    ///
    /// # Errors
    ///
    /// As for the acquire, or for the record.
    #[doc(hidden)]
    fn fence_event_record(stream: Self::Stream) -> Result<(Self::Event, u64), ServerError> {
        record_fence_event(
            || Self::fence_event_acquire(stream),
            |event| Self::event_record_sequenced(event, stream),
            Self::fence_event_release,
        )
    }
}

/// [`EventApi::fence_event_record`]'s steps, written once for the trait's default and for
/// backends that resolve their stream once for all of them: `acquire` an event, then `record`
/// it and take its sequence (one step, see [`EventApi::event_record_sequenced`]); a refused
/// record gives the event back (`release`) and is the error.
pub(crate) fn record_fence_event<E>(
    acquire: impl FnOnce() -> Result<E, ServerError>,
    record: impl FnOnce(&E) -> Result<u64, ServerError>,
    release: impl FnOnce(E) -> Result<(), ServerError>,
) -> Result<(E, u64), ServerError> {
    let event = acquire()?;
    match record(&event) {
        Ok(sequence) => Ok((event, sequence)),
        Err(err) => {
            if let Err(release) = release(event) {
                log::debug!("a refused fence event could not be given back: {release}");
            }
            Err(err)
        }
    }
}

/// A stream's progress word, from `EventApi::stream_progress`: whether the stream has passed a
/// recorded point, read with one load. Cheap to clone.
///
/// A word that says "passed" means the stream got there; whether the work before the point
/// succeeded is the point's event's to say (a faulted stream stops moving its word, and its
/// events fail), so a waiter confirms with one query of the event before resolving a wait.
#[derive(Clone)]
pub struct ProgressWord(Arc<dyn WordMemory>);

impl ProgressWord {
    pub(crate) fn new(memory: Arc<dyn WordMemory>) -> Self {
        Self(memory)
    }

    /// Whether the stream has passed its point numbered `sequence`; never blocks.
    pub fn passed(&self, sequence: u64) -> bool {
        self.0.get() > sequence
    }
}

/// Where a backend keeps a stream's word: 0 until the stream passes its first recorded point,
/// then one more than the number (`EventApi::stream_sequence`) of the latest point it passed.
pub(crate) trait WordMemory: Send + Sync {
    /// The word now, with acquire ordering.
    fn get(&self) -> u64;
}

impl fmt::Debug for ProgressWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ProgressWord").field(&self.0.get()).finish()
    }
}

/// A progress word in host memory, on a cache line of its own (the host backend's: its stream's
/// worker advances it). It only grows.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(crate) struct HostWord(AtomicU64);

impl WordMemory for HostWord {
    fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

impl HostWord {
    /// The stream has passed its point numbered `sequence`, and every point before it.
    pub(crate) fn advance(&self, sequence: u64) {
        self.0
            .fetch_max(sequence.saturating_add(1), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{HostWord, ProgressWord};

    #[test]
    fn a_word_passes_each_point_once_the_stream_is_there_and_never_goes_back() {
        let memory = Arc::new(HostWord::default());
        let word = ProgressWord::new(memory.clone());
        assert!(!word.passed(0), "no point passed yet");
        memory.advance(0);
        assert!(word.passed(0));
        assert!(!word.passed(1));
        memory.advance(5);
        assert!(word.passed(3) && word.passed(5) && !word.passed(6));
        memory.advance(2);
        assert!(word.passed(5), "an older point does not move the word back");
        assert!(
            !word.passed(u64::MAX),
            "a dropped stream's number is never passed"
        );
        assert_eq!(format!("{word:?}"), "ProgressWord(6)");
    }
}
