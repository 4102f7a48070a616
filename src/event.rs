//! [`Event`]: one raw device event, destroyed when dropped.

use core::fmt;
use core::time::Duration;

use crate::{EventApi, EventFlags, ServerError};

/// One device event, owned: destroyed when dropped, on every path, without blocking on pending
/// work (the driver releases it once the work completes).
///
/// # Example
///
/// ```
/// use device_events::host::{Host, HostStream};
/// use device_events::{Event, EventFlags};
///
/// let stream = HostStream::new()?;
/// stream.launch(|| { /* work */ })?;
/// let event = Event::<Host>::new(stream.handle(), EventFlags::FENCE)?;
/// event.record(stream.handle())?;
/// event.wait_sync()?;
/// assert!(event.is_complete()?);
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct Event<A: EventApi> {
    /// `None` only inside `drop`, once destroyed.
    raw: Option<A::Event>,
    /// From the backend's fence-event pool: given back there when dropped.
    pooled: bool,
}

impl<A: EventApi> Event<A> {
    /// Create an event on `stream`'s device; not recorded yet, it reports complete.
    ///
    /// # Errors
    ///
    /// The driver refused to create the event, or `stream` is invalid.
    pub fn new(stream: A::Stream, flags: EventFlags) -> Result<Self, ServerError> {
        Ok(Self {
            raw: Some(A::event_create(stream, flags)?),
            pooled: false,
        })
    }

    /// An event for a fence, recorded at the current end of `stream`, with the record's sequence:
    /// from the backend's fence-event pool ([`EventApi::fence_event_record`]), and given back to
    /// it when dropped.
    pub(crate) fn recorded_for_fence(stream: A::Stream) -> Result<(Self, u64), ServerError> {
        let (raw, sequence) = A::fence_event_record(stream)?;
        Ok((
            Self {
                raw: Some(raw),
                pooled: true,
            },
            sequence,
        ))
    }

    /// Record this event at the current end of `stream`'s work, replacing any earlier record.
    ///
    /// # Errors
    ///
    /// The driver refused the record, or the stream is faulted or invalid.
    pub fn record(&self, stream: A::Stream) -> Result<(), ServerError> {
        A::event_record(self.raw(), stream)
    }

    /// [`EventApi::event_record_sequenced`].
    pub(crate) fn record_sequenced(&self, stream: A::Stream) -> Result<u64, ServerError> {
        A::event_record_sequenced(self.raw(), stream)
    }

    /// Whether the device has reached this event, without blocking.
    ///
    /// # Errors
    ///
    /// A fault of the device or stream; never folded into `Ok(false)`.
    pub fn is_complete(&self) -> Result<bool, ServerError> {
        A::event_query(self.raw())
    }

    /// Block the calling thread until the device has reached this event.
    ///
    /// # Errors
    ///
    /// A fault of the work before the event, or a refused call.
    #[doc(alias = "wait")]
    #[doc(alias = "synchronize")]
    pub fn wait_sync(&self) -> Result<(), ServerError> {
        A::event_synchronize(self.raw())
    }

    /// Make `stream` wait for this event on the device; the host does not block.
    ///
    /// # Errors
    ///
    /// The driver refused the dependency.
    pub fn wait_async(&self, stream: A::Stream) -> Result<(), ServerError> {
        A::stream_wait_event(stream, self.raw())
    }

    /// Device time from `start` to this event; both must be [`EventFlags::TIMING`] and reached.
    ///
    /// # Errors
    ///
    /// Either event has no timing, is not reached, or is faulted.
    pub fn elapsed_since(&self, start: &Self) -> Result<Duration, ServerError> {
        A::event_elapsed(start.raw(), self.raw())
    }

    /// The raw event, for backends and the waiter.
    pub fn raw(&self) -> &A::Event {
        self.raw.as_ref().expect("emptied only by its drop")
    }
}

impl<A: EventApi> Drop for Event<A> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            let released = if self.pooled {
                A::fence_event_release(raw)
            } else {
                A::event_destroy(raw)
            };
            match released {
                Ok(()) => {}
                // Gone with the driver (at process exit, say).
                Err(err) if err.is_shut_down() => log::trace!("{err}"),
                Err(err) => log::error!("a {} event could not be destroyed: {err}", A::BACKEND),
            }
        }
    }
}

impl<A: EventApi> fmt::Debug for Event<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}Event", A::BACKEND)
    }
}
