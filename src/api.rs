//! The backend contract: what a driver must offer for events and fences, and [`ProgressWord`],
//! how far a stream has got, learned with a memory load rather than a driver call.

use core::fmt::{self, Debug};
use core::hash::{Hash, Hasher};
use core::time::Duration;
use std::collections::hash_map::DefaultHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::ServerError;

/// Orders recorded points across the process: for backends that keep no per-stream order (the
/// default `EventApi::stream_sequence`), and for fences resolved at creation.
pub(crate) fn next_sequence() -> u64 {
    static NEXT_SEQUENCE: AtomicU64 = AtomicU64::new(0);
    NEXT_SEQUENCE.fetch_add(1, Ordering::Relaxed)
}

/// How an event is created: [`FENCE`](Self::FENCE) or [`TIMING`](Self::TIMING).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventFlags {
    /// Record a timestamp, so the time between two events can be read.
    pub timing: bool,
    /// A synchronize on this event sleeps instead of spinning.
    pub blocking_sync: bool,
}

impl EventFlags {
    /// For fences: no timestamps (cheaper to record), and a thread waiting sleeps in the driver.
    pub const FENCE: Self = Self {
        timing: false,
        blocking_sync: true,
    };
    /// For profiling: timestamps for [`EventApi::event_elapsed`], blocking synchronize.
    pub const TIMING: Self = Self {
        timing: true,
        blocking_sync: true,
    };
}

/// A backend's event and stream calls, shaped like a driver's C API.
///
/// Every function is static and works on raw handles; [`Event`](crate::Event) and
/// [`EventFence`](crate::EventFence) add ownership and the fallbacks. Implementations never panic
/// on a driver or user fault: every failure is a [`ServerError`].
///
/// Driver rules an implementation keeps (CUDA driver API semantics):
/// - an event never recorded is complete;
/// - a record replaces the event's previous record, and a query, synchronize or stream wait
///   refers to the most recent record at the time of the call;
/// - destroying an event whose work is pending is allowed and does not block.
///
/// Hooks hidden from these docs (`fence_event_acquire`, `fence_event_release`,
/// `fence_event_record`, `event_record_sequenced`, `stream_sequence`, `stream_id`,
/// `stream_progress`) have defaults correct for any backend; a backend may override them to pool
/// fence events, keep a counter per stream, number its streams exactly or publish their progress.
/// Their contracts are documented in the source, `src/api.rs`.
pub trait EventApi: Sized + Send + Sync + 'static {
    /// The backend's name, e.g. `"Cuda"` or `"Host"`.
    const BACKEND: &'static str;

    /// A stream handle: cheap to copy, usable as a map key.
    type Stream: Copy + Send + Sync + Eq + Hash + Debug + 'static;

    /// A raw event. Owned: [`EventApi::event_destroy`] consumes it.
    type Event: Send + Sync + 'static;

    /// Create an event of `stream`'s context (CUDA refuses to record it on another context's).
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
    /// ([`status::INVALID_HANDLE`](crate::status::INVALID_HANDLE)).
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

    /// A key of `stream`'s context, by which an [`EventProfiler`](crate::EventProfiler) keeps its
    /// idle timing events. The contract:
    /// - an event created for a stream of one key can be recorded on every stream of that key;
    /// - a key is never given to a stream of another context while an event created for a
    ///   stream of that key may be alive (a number unique for the process's life is simplest);
    /// - streams of one context should share a key (else events are reused less).
    ///
    /// The default gives every stream the key 0, right for a backend with one context; with more,
    /// a profiler used on a second context refuses ([`ServerError::InvalidArgument`]).
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

    /// An event for a fence on `stream` ([`EventFlags::FENCE`]): from the backend's pool, if it
    /// keeps one (creating events contends on the driver's context lock on busy GPUs), else new.
    ///
    /// # Errors
    ///
    /// As for [`event_create`](Self::event_create).
    #[doc(hidden)]
    fn fence_event_acquire(stream: Self::Stream) -> Result<Self::Event, ServerError> {
        Self::event_create(stream, EventFlags::FENCE)
    }

    /// Give back an event from [`fence_event_acquire`](Self::fence_event_acquire) that nothing
    /// can wait on any more: keep it for a later fence, or destroy it (the default). Its last
    /// record may still be pending (a later record replaces it). Must not block.
    ///
    /// # Errors
    ///
    /// As for [`event_destroy`](Self::event_destroy).
    #[doc(hidden)]
    fn fence_event_release(event: Self::Event) -> Result<(), ServerError> {
        Self::event_destroy(event)
    }

    /// A number for a point just recorded on `stream`, larger for each later record on it: the
    /// order the waiter serves a stream's waits in. The default takes one process-wide counter; a
    /// backend may keep one per stream (no contended cache line), and answers `u64::MAX` for a
    /// dropped stream (sorting after every number the stream gave).
    #[doc(hidden)]
    fn stream_sequence(stream: Self::Stream) -> u64 {
        let _ = stream;
        next_sequence()
    }

    /// A number that tells `stream` apart from the backend's other live streams: the waiter gives
    /// each a lane. The default hashes the handle, so two streams may share one (then one may
    /// wait behind the other's waits, but none fails or is lost).
    #[doc(hidden)]
    fn stream_id(stream: Self::Stream) -> u64 {
        let mut hasher = DefaultHasher::new();
        stream.hash(&mut hasher);
        hasher.finish()
    }

    /// `stream`'s [`ProgressWord`], if this backend keeps one (the default keeps none): a waiter
    /// may watch it rather than block; the point's event stays the truth. A backend may start
    /// keeping one only once asked (the CUDA backend does: a word costs each record a write).
    #[doc(hidden)]
    fn stream_progress(stream: Self::Stream) -> Option<ProgressWord> {
        let _ = stream;
        None
    }

    /// [`event_record`](Self::event_record) and the record's
    /// [`stream_sequence`](Self::stream_sequence) as one step, so two threads recording on one
    /// stream get numbers in record order. The default records, then numbers; a backend whose
    /// records can race keeps the two under one per-stream lock.
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

    /// [`fence_event_acquire`](Self::fence_event_acquire) then
    /// [`event_record_sequenced`](Self::event_record_sequenced), giving the event back if the
    /// record fails: one call, so a backend can resolve the stream once.
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

/// [`EventApi::fence_event_record`]'s steps, for the default and for backends that resolve
/// their stream once: a refused `record` gives the event back (`release`) and is the error.
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

/// A stream's progress word, from `EventApi::stream_progress`: set by the stream itself, in host
/// memory, as it passes each recorded point, so whether it passed one is read with one load.
/// Cheap to clone.
///
/// "Passed" means the stream got there; whether the work before succeeded is the point's event's
/// to say (a faulted stream stops moving its word), so a waiter queries the event once before
/// resolving a wait.
#[derive(Clone)]
pub struct ProgressWord(Arc<dyn WordMemory>);

impl ProgressWord {
    pub(crate) fn new(memory: Arc<dyn WordMemory>) -> Self {
        Self(memory)
    }

    /// Whether the stream has passed its point numbered `sequence` (by `stream_sequence`).
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

/// The host backend's progress word, on a cache line of its own; it only grows.
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
    use crate::ServerError;

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

    /// A refused record gives the event back, and is the error even when giving
    /// it back fails too.
    #[test]
    fn a_refused_fence_record_gives_its_event_back_and_is_the_error() {
        let refused = || ServerError::InvalidArgument {
            what: "record",
            reason: "refused".into(),
        };
        let given_back = std::cell::Cell::new(None);
        let result = super::record_fence_event(
            || Ok("event"),
            |_| Err(refused()),
            |event| {
                given_back.set(Some(event));
                Err(ServerError::InvalidArgument {
                    what: "release",
                    reason: "refused too".into(),
                })
            },
        );
        assert_eq!(result.unwrap_err(), refused());
        assert_eq!(given_back.get(), Some("event"));
    }
}
