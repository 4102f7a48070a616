//! [`EventFence`]: a point in a stream that others can wait for.

use core::fmt;

use crate::api::next_sequence;
use crate::{status, Event, EventApi, ServerError};

/// An event recorded on a stream and handed out, so a caller can wait for that stream's work
/// from outside whatever owns the stream: [`wait_sync`](Self::wait_sync) blocks the host,
/// [`wait_async`](Self::wait_async) makes another stream wait on the device, and `.await` sleeps
/// a task.
///
/// When the driver refuses the event, the stream is synchronized on the spot instead, which keeps
/// every guarantee a fence gives; only when that fails too does the fence hold the error. A caller
/// that must not block (holding a lock) uses [`try_new`](Self::try_new) and
/// [`try_wait_async`](Self::try_wait_async), which return the refusal.
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
    /// Errors are boxed: few fences hold one, and a waiter moves each fence into an allocation.
    event: Result<Option<Event<A>>, Box<ServerError>>,
    stream: A::Stream,
    sequence: u64,
    /// The refusal, when the fence fell back to synchronizing its stream.
    refused: Option<Box<ServerError>>,
}

impl<A: EventApi> EventFence<A> {
    /// Record a fence at the current position of `stream`.
    ///
    /// A refused event makes `stream` synchronize instead (with a warning, once per faulted
    /// stream, then at debug level), so the fence is already reached; errors surface when it is
    /// waited on. A stream-capture refusal ([`ServerError::is_stream_capture`]) or a shut-down
    /// driver ([`ServerError::is_shut_down`]) is not worked around: the fence holds that error.
    pub fn new(stream: A::Stream) -> Self {
        Self::try_new(stream).unwrap_or_else(|err| Self::fall_back(stream, err))
    }

    /// Record a fence at the current position of `stream`, or return the driver's refusal: no
    /// fallback, so it never blocks and logs nothing, for a caller holding a lock.
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

    /// [`new`](Self::new)'s fallback for a refused event.
    fn fall_back(stream: A::Stream, err: ServerError) -> Self {
        // Reached (or failed) at creation: never waits in a lane, so any unique number will do.
        let sequence = next_sequence();
        // Synchronizing a capturing stream would be refused too, and invalidate the capture; a
        // shut-down driver answers every call the same way.
        let (event, refused) = if err.is_shut_down() || err.is_stream_capture() {
            (Err(Box::new(err)), None)
        } else {
            let what = "fence could not be recorded, synchronizing its stream instead";
            fault_log::warn(A::BACKEND, &stream, &err, what);
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

    /// Block until the device has reached this fence. In async code, use `.await` (or
    /// [`wait`](Self::wait)) instead: it blocks no executor thread.
    ///
    /// # Errors
    ///
    /// The error the fence holds (the driver refused both the event and the stream
    /// synchronize), or the driver's error from the wait, e.g. a faulted stream.
    pub fn wait_sync(self) -> Result<(), ServerError> {
        self.block()
    }

    /// [`wait_sync`](Self::wait_sync) without giving up the fence, for a waiter thread: it drops
    /// the fence apart from the wait, so a panic in the release does not pass for a failed wait.
    pub(crate) fn block(&self) -> Result<(), ServerError> {
        self.with_event((), Event::wait_sync)
    }

    /// `call` on the fence's event; `reached` for a fence reached at creation.
    fn with_event<T>(
        &self,
        reached: T,
        call: impl FnOnce(&Event<A>) -> Result<T, ServerError>,
    ) -> Result<T, ServerError> {
        match &self.event {
            Ok(Some(event)) => call(event),
            Ok(None) => Ok(reached),
            Err(err) => Err(ServerError::clone(err)),
        }
    }

    /// Make `stream` wait for this fence on the device, so work queued on it afterwards runs
    /// behind the fenced stream's. Does not block the host, unless the driver refuses the
    /// dependency: the host then waits for the fence itself (with a warning, once per faulted
    /// `stream`, then at debug level), which orders the work just the same.
    ///
    /// Returned at once with no host wait ([`try_wait_async`](Self::try_wait_async) returns every
    /// refusal so): an invalid `stream` (a dropped stream, another thread's per-thread default
    /// stream: the caller's bug); a stream-capture status ([`ServerError::is_stream_capture`]: a
    /// host wait would leave the dependency out of the graph); a shut-down driver.
    ///
    /// # Errors
    ///
    /// The error the fence holds; [`status::INVALID_HANDLE`] for an invalid `stream`; a
    /// stream-capture or shut-down error; or the error of the fallback's host wait.
    ///
    /// A fault reaches the waiting stream: when the fenced stream's work faults before the
    /// fence, `stream` is faulted too, and its fences fail with an error naming the wait, as on
    /// CUDA, where a sticky fault poisons the whole context.
    ///
    /// The fence is not used up: the wait takes the fence's state at the call, as the driver
    /// does ("`cuStreamWaitEvent()` use\[s\] the most recently captured state at the time of
    /// the API call", `cuEventRecord` in the CUDA driver API), so the same fence serves on
    /// (another wait, an await, a drop queue) with no second event recorded.
    ///
    /// Which streams to give a request's stages: `docs/service.md` (Deadlines) in the repository.
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
                // Keyed by the waiting stream, whose call was refused.
                let what = "stream could not be made to wait on a fence, waiting on the host";
                fault_log::warn(A::BACKEND, &stream, &err, what);
                event.wait_sync()
            }
            (result, _) => result,
        }
    }

    /// [`wait_async`](Self::wait_async) with no host wait: the driver's refusal is returned, so it
    /// never blocks the host, for a caller holding a lock.
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
        self.with_event((), |event| event.wait_async(stream))
    }

    /// Whether the device has reached this fence, without blocking.
    ///
    /// # Errors
    ///
    /// The error the fence holds, or a fault the driver reports (never folded into `Ok(false)`).
    pub fn is_complete(&self) -> Result<bool, ServerError> {
        self.with_event(true, Event::is_complete)
    }

    /// The stream this fence was recorded on.
    pub fn stream(&self) -> A::Stream {
        self.stream
    }

    /// The fence's place in its stream's order of recorded points: a later fence on the same
    /// stream has a larger number. Not comparable across streams, nor for a fence resolved at
    /// creation.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Whether the fence was resolved at creation (by a stream synchronize), successfully or not.
    pub fn is_resolved_at_creation(&self) -> bool {
        !matches!(self.event, Ok(Some(_)))
    }

    /// Why the driver refused this fence's event, when it fell back to synchronizing its stream.
    /// When the synchronize failed too, that is the fence's own error, and this is also its
    /// [`source`](std::error::Error::source) (when its variant carries one).
    pub fn fallback_cause(&self) -> Option<&ServerError> {
        self.refused.as_deref()
    }
}

/// Whether a refused device-side wait comes back as it is, with no host wait (see
/// [`EventFence::wait_async`]; a shut-down driver refuses the host wait too).
fn refusal_is_final(err: &ServerError) -> bool {
    err.code() == Some(status::INVALID_HANDLE) || err.is_shut_down() || err.is_stream_capture()
}

impl<A: EventApi> fmt::Debug for EventFence<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}Fence", A::BACKEND)
    }
}

mod fault_log {
    //! Warnings about faults, once per stream: a faulted stream (sticky) would otherwise log the
    //! same warning for every fence made on it.

    use std::collections::HashSet;
    use std::hash::{BuildHasher, Hash, RandomState};
    use std::sync::OnceLock;

    use crate::sync::Mutex;
    use crate::ServerError;

    /// Streams already warned about, by hash of backend and stream. When full it starts over:
    /// some warn again rather than the set growing without end.
    pub(super) const REMEMBERED: usize = 4096;

    /// Log "a `backend` `what`: `err`" as a warning, unless `err` is a sticky fault already
    /// warned about for this `stream`: then at debug level.
    pub(crate) fn warn<S: Hash>(backend: &'static str, stream: &S, err: &ServerError, what: &str) {
        let message = format!("a {backend} {what}: {err}");
        if err.is_faulted() && !first_for(backend, stream) {
            log::debug!("{message} (this stream's fault was warned about before)");
        } else {
            log::warn!("{message}");
        }
    }

    /// Whether this is the first fault seen for `stream`.
    pub(super) fn first_for<S: Hash>(backend: &'static str, stream: &S) -> bool {
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

#[cfg(test)]
mod tests {
    use super::fault_log;

    /// The fault log's set is bounded: after `REMEMBERED` more streams, the first is forgotten
    /// (other tests' streams only make it forgotten sooner).
    #[test]
    fn a_stream_is_forgotten_after_remembered_others() {
        const BACKEND: &str = "fault-log-test";
        assert!(fault_log::first_for(BACKEND, &0_usize));
        for stream in 1..=fault_log::REMEMBERED {
            fault_log::first_for(BACKEND, &stream);
        }
        let forgotten = fault_log::first_for(BACKEND, &0_usize);
        assert!(forgotten, "remembered past the bound");
    }
}
