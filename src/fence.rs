//! [`EventFence`]: a point in a stream that others can wait for.

use core::fmt;

use crate::api::next_sequence;
use crate::{status, Event, EventApi, ServerError};

/// An event recorded on a stream and handed out, so a caller can wait for that stream's work
/// from outside whatever owns the stream.
///
/// Recording costs the host nothing: the owner records one and returns, and whoever holds the
/// fence waits on its own time: [`wait_sync`](Self::wait_sync) blocks the host,
/// [`wait_async`](Self::wait_async) makes another stream wait on the device, and (with the
/// waiter) `.await` sleeps a task.
///
/// When the driver refuses to create or record the event, the stream is synchronized on the
/// spot instead, which keeps every guarantee a fence gives; only when that fails too does the
/// fence hold the error. A caller that must not block (one holding a lock) uses
/// [`try_new`](Self::try_new) and [`try_wait_async`](Self::try_wait_async), which return the
/// refusal.
///
/// # Example
///
/// ```
/// use device_events::host::{Host, HostStream};
/// use device_events::EventFence;
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
///
/// let producer = HostStream::new()?;
/// let consumer = HostStream::new()?;
/// let written = Arc::new(AtomicBool::new(false));
///
/// let flag = written.clone();
/// producer.launch(move || flag.store(true, Ordering::SeqCst))?;
/// // The consumer's later work runs after the producer's, without the host waiting for either.
/// EventFence::<Host>::new(producer.handle()).wait_async(consumer.handle())?;
/// let flag = written.clone();
/// consumer.launch(move || assert!(flag.load(Ordering::SeqCst)))?;
///
/// EventFence::<Host>::new(consumer.handle()).wait_sync()?;
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct EventFence<A: EventApi> {
    /// `Ok(None)`: reached at creation (a refused event whose stream was synchronized instead).
    /// The error is boxed: few fences hold one, and a waiter moves each fence into an
    /// allocation of its own (120 bytes unboxed, on the host backend).
    event: Result<Option<Event<A>>, Box<ServerError>>,
    stream: A::Stream,
    sequence: u64,
    /// The refusal, when the fence fell back to synchronizing its stream (boxed: most have none).
    refused: Option<Box<ServerError>>,
}

impl<A: EventApi> EventFence<A> {
    /// Record a fence at the current position of `stream`.
    ///
    /// A refused event makes `stream` synchronize instead (with a warning logged), so the fence
    /// is already reached; errors surface when it is waited on. A stream-capture refusal
    /// ([`ServerError::is_stream_capture`]) or a shut-down driver ([`ServerError::is_shut_down`])
    /// is not worked around: the fence holds that error. [`try_new`](Self::try_new) returns the
    /// refusal instead. A faulted stream warns once; later fences on it log at debug level.
    pub fn new(stream: A::Stream) -> Self {
        Self::try_new(stream).unwrap_or_else(|err| Self::fall_back(stream, err))
    }

    /// Record a fence at the current position of `stream`, or return the driver's refusal: no
    /// fallback, so it never blocks (no stream synchronize) and logs nothing, for a caller that
    /// records while holding a lock.
    ///
    /// # Errors
    ///
    /// The driver refused to create or record the event (a faulted or invalid stream, a
    /// capture, a shut-down driver).
    ///
    /// ```
    /// use device_events::host::{Host, HostStream};
    /// use device_events::EventFence;
    /// use std::sync::Mutex;
    ///
    /// let stream = Mutex::new(HostStream::new()?);
    /// // Nothing blocks while the lock is held: a refusal comes back.
    /// let fence = EventFence::<Host>::try_new(stream.lock().unwrap().handle());
    /// match fence {
    ///     Ok(fence) => fence.wait_sync()?,
    ///     // Refused: work around it with the lock let go (or report it).
    ///     Err(_refused) => stream.lock().unwrap().synchronize()?,
    /// }
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn try_new(stream: A::Stream) -> Result<Self, ServerError> {
        let (event, sequence) = Event::recorded_for_fence(stream)?;
        Ok(Self {
            event: Ok(Some(event)),
            stream,
            sequence,
            refused: None,
        })
    }

    /// [`new`](Self::new)'s fallback for a refused event: synchronize `stream` instead, unless
    /// the refusal is one a synchronize cannot work around.
    fn fall_back(stream: A::Stream, err: ServerError) -> Self {
        // Reached (or failed) at creation: never waits in a lane, so any unique number will do.
        let sequence = next_sequence();
        // A capture refused the record: synchronizing the capturing stream would be refused
        // too, and would invalidate the capture. A shut-down driver answers every call the same
        // way. The fence fails with the driver's answer.
        let (event, refused) = if err.is_shut_down() || err.is_stream_capture() {
            (Err(Box::new(err)), None)
        } else {
            fault_log::warn(
                A::BACKEND,
                &stream,
                &err,
                &format!(
                    "a {} fence could not be recorded, synchronizing its stream instead: {err}",
                    A::BACKEND
                ),
            );
            // A failed synchronize gets the refusal as its source, unless the backend gave it one.
            let event = A::stream_synchronize(stream)
                .map(|()| None)
                .map_err(|failed| {
                    Box::new(match failed.error_source() {
                        Some(_) => failed,
                        None => failed.with_source(err.clone()),
                    })
                });
            (event, Some(Box::new(err)))
        };
        Self {
            event,
            stream,
            sequence,
            refused,
        }
    }

    /// Block until the device has reached this fence, so everything queued on its stream
    /// before it is done.
    ///
    /// The calling thread blocks for as long as the device takes. In async code that thread is
    /// an executor's, whose other tasks (on a current-thread runtime, all of them) wait
    /// meanwhile: there, use `.await` (or [`wait`](Self::wait)), which hands the wait to the
    /// waiter's own threads.
    ///
    /// # Errors
    ///
    /// The error the fence holds (the driver refused both the event and the stream
    /// synchronize), or the driver's error from the wait, e.g. a faulted stream.
    pub fn wait_sync(self) -> Result<(), ServerError> {
        self.block()
    }

    /// [`wait_sync`](Self::wait_sync) without giving up the fence, for a waiter thread: it drops
    /// the fence (releasing its event, an outside backend's call) apart from the wait, so a
    /// panic in the release does not pass for a failed wait.
    pub(crate) fn block(&self) -> Result<(), ServerError> {
        match &self.event {
            Ok(Some(event)) => event.wait_sync(),
            Ok(None) => Ok(()),
            Err(err) => Err(ServerError::clone(err)),
        }
    }

    /// Make `stream` wait for this fence on the device, so work queued on it afterwards runs
    /// behind the fenced stream's. Does not block the host, unless the driver refuses the
    /// dependency: the host then waits for the fence itself (with a warning logged), which
    /// orders the work just the same. A faulted `stream` (sticky: it refuses every wait the
    /// same way) warns once; later refusals of it log at debug level.
    ///
    /// Not refusals, and so returned at once with no host wait: an invalid `stream` (a dropped
    /// stream's handle, or another thread's per-thread default stream: the caller's bug); a
    /// stream-capture status ([`ServerError::is_stream_capture`]: a capturing `stream` may wait
    /// only on a fence recorded in the same capture, and a host wait would leave the dependency
    /// out of the graph); a shut-down driver ([`ServerError::is_shut_down`]).
    /// [`try_wait_async`](Self::try_wait_async) returns every refusal, with no host wait.
    ///
    /// # Errors
    ///
    /// The error the fence holds; the invalid-handle error ([`status::INVALID_HANDLE`]) for an
    /// invalid `stream`; a stream-capture or shut-down error; or, on the fallback path, the
    /// error of the host wait.
    ///
    /// A fault reaches the waiting stream: when the fenced stream's work faults before the
    /// fence, `stream` is faulted too, its later work does not run, and its fences fail with an
    /// error that names the wait it came through. So a failed stage shows on every stage that
    /// waited on it, as on CUDA, where a sticky fault poisons the whole context.
    ///
    /// The fence is not used up: the wait takes the fence's state at the call, as the driver
    /// does ("`cuStreamWaitEvent()` use\[s\] the most recently captured state at the time of
    /// the API call", `cuEventRecord` in the CUDA driver API), so the same fence can then make
    /// another stream wait, be awaited, be waited on, or go in a drop queue, with no second
    /// event recorded.
    ///
    /// Streams for stages: a device-side wait holds back everything queued on `stream` after
    /// it, not only one request's work. Stage two of a request made to wait on its stage one
    /// delays every later piece of work on that stream, other requests' included, so routing
    /// each request's stage two to the next stream of a shared pool serializes requests behind
    /// each other's stage one. Give each request in flight its own pair of streams, or queue
    /// stage two behind its own stage one on the same stream (which orders it at no cost), and
    /// keep `wait_async` for joining work that has to run on another stream.
    ///
    /// ```
    /// use device_events::host::HostStream;
    ///
    /// # futures::executor::block_on(async {
    /// let stage_one = HostStream::new()?;
    /// let stage_two = HostStream::new()?;
    /// let logger = HostStream::new()?;
    /// stage_one.launch(|| { /* work */ })?;
    /// let done = stage_one.fence();
    /// done.wait_async(stage_two.handle())?; // stage two runs after stage one
    /// done.wait_async(logger.handle())?; // and so does the logger
    /// done.await?; // and this task wakes once stage one is done
    /// # Ok::<(), device_events::ServerError>(())
    /// # }).unwrap();
    /// ```
    pub fn wait_async(&self, stream: A::Stream) -> Result<(), ServerError> {
        match (self.try_wait_async(stream), &self.event) {
            // Only a refused device-side wait falls back, not the held error.
            (Err(err), Ok(Some(event))) if !refusal_is_final(&err) => {
                // Keyed by the waiting stream, whose call was refused: a faulted one refuses
                // every wait the same way, and warns once.
                fault_log::warn(
                    A::BACKEND,
                    &stream,
                    &err,
                    &format!(
                        "a {} stream could not be made to wait on a fence, waiting on the host: \
                         {err}",
                        A::BACKEND
                    ),
                );
                event.wait_sync()
            }
            (result, _) => result,
        }
    }

    /// Make `stream` wait for this fence on the device, or return the driver's refusal:
    /// [`wait_async`](Self::wait_async) with no host wait, so it never blocks the host, for a
    /// caller that holds a lock.
    ///
    /// # Errors
    ///
    /// The error the fence holds, or the driver's refusal of the dependency (an invalid or
    /// faulted `stream`, a capture, a shut-down driver).
    ///
    /// ```
    /// use device_events::host::HostStream;
    ///
    /// let producer = HostStream::new()?;
    /// let consumer = HostStream::new()?;
    /// let fence = producer.fence();
    /// if let Err(refused) = fence.try_wait_async(consumer.handle()) {
    ///     // Work around it where blocking is allowed: wait on the host.
    ///     eprintln!("no device-side wait ({refused}), waiting on the host");
    ///     fence.wait_sync()?;
    /// }
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn try_wait_async(&self, stream: A::Stream) -> Result<(), ServerError> {
        match &self.event {
            Ok(Some(event)) => event.wait_async(stream),
            Ok(None) => Ok(()),
            Err(err) => Err(ServerError::clone(err)),
        }
    }

    /// Whether the device has reached this fence, without blocking.
    ///
    /// # Errors
    ///
    /// The error the fence holds, or a fault the driver reports (never folded into `Ok(false)`).
    pub fn is_complete(&self) -> Result<bool, ServerError> {
        match &self.event {
            Ok(Some(event)) => event.is_complete(),
            Ok(None) => Ok(true),
            Err(err) => Err(ServerError::clone(err)),
        }
    }

    /// The stream this fence was recorded on.
    pub fn stream(&self) -> A::Stream {
        self.stream
    }

    /// The fence's place in its stream's order of recorded points: a later fence on the same
    /// stream has a larger number (the backend's `EventApi::stream_sequence` hook). Numbers of
    /// different streams are not comparable, nor is a fence resolved at creation's.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Whether the fence was resolved at creation (by a stream synchronize), successfully or not.
    pub fn is_resolved_at_creation(&self) -> bool {
        !matches!(self.event, Ok(Some(_)))
    }

    /// Why the driver refused this fence's event, when it fell back to synchronizing its
    /// stream: the first failure. When the synchronize failed too, the fence's own error (from
    /// [`wait_sync`](Self::wait_sync)) is the synchronize's, and this is the failure that led to
    /// it (a dropped stream's `event_create`, say), also that error's
    /// [`source`](std::error::Error::source) when its variant carries one
    /// ([`ServerError::with_source`]).
    pub fn fallback_cause(&self) -> Option<&ServerError> {
        self.refused.as_deref()
    }
}

/// Whether a refused device-side wait comes back as it is, with no host wait standing in: an
/// invalid stream (the caller's bug), a stream-capture status (a host wait would leave the
/// dependency out of the graph being captured, and could invalidate the capture), or a
/// shut-down driver (which refuses the host wait too).
fn refusal_is_final(err: &ServerError) -> bool {
    err.code() == Some(status::INVALID_HANDLE) || err.is_shut_down() || err.is_stream_capture()
}

impl<A: EventApi> fmt::Debug for EventFence<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}Fence", A::BACKEND)
    }
}

mod fault_log {
    //! Warnings about faults, once per stream: a faulted stream (sticky: every
    //! later call fails the same way) would otherwise log the same warning for
    //! every fence made on it.

    use std::collections::HashSet;
    use std::hash::{BuildHasher, Hash, RandomState};
    use std::sync::OnceLock;

    use crate::sync::Mutex;
    use crate::ServerError;

    /// Streams already warned about, by hash of backend and stream. Bounded: when
    /// full it starts over, so a long-lived process with many faulted streams
    /// warns about some again rather than growing without end.
    const REMEMBERED: usize = 4096;

    /// Log `message` (which includes `err`) as a warning, unless `err` is a sticky
    /// fault already warned about for this `stream`: then at debug level.
    pub(crate) fn warn<S: Hash>(
        backend: &'static str,
        stream: &S,
        err: &ServerError,
        message: &str,
    ) {
        if err.is_faulted() && !first_for(backend, stream) {
            log::debug!("{message} (this stream's fault was warned about before)");
        } else {
            log::warn!("{message}");
        }
    }

    /// Whether this is the first fault seen for `stream`.
    fn first_for<S: Hash>(backend: &'static str, stream: &S) -> bool {
        static SEEN: OnceLock<(RandomState, Mutex<HashSet<u64>>)> = OnceLock::new();
        let (hasher, seen) = SEEN.get_or_init(|| (RandomState::new(), Mutex::new(HashSet::new())));
        let key = hasher.hash_one((backend, stream));
        let mut seen = seen.lock();
        if seen.len() >= REMEMBERED {
            seen.clear();
        }
        seen.insert(key)
    }
}
