//! [`Waitable`]: how the waiter sees a fence, without naming a backend.

use std::any::TypeId;

use crate::{EventApi, EventFence, ProgressWord, ServerError};

/// A stream's lane: its backend's type and the backend's number for it (`EventApi::stream_id`),
/// which tells live streams apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct LaneKey {
    backend: TypeId,
    stream: u64,
}

impl LaneKey {
    /// The lane of `stream` of backend `A`.
    pub(crate) fn of<A: EventApi>(stream: A::Stream) -> Self {
        Self {
            backend: TypeId::of::<A>(),
            stream: A::stream_id(stream),
        }
    }

    /// The backend's number for the stream.
    pub(crate) fn stream_id(self) -> u64 {
        self.stream
    }
}

/// What the waiter needs of a fence.
pub(crate) trait Waitable: Send + Sync + 'static {
    /// The lane (stream) this wait belongs to.
    fn lane(&self) -> LaneKey;
    /// Its order in the lane: earlier fences on a stream complete first.
    fn sequence(&self) -> u64;
    /// Reached, not yet, or a fault; never blocks.
    fn query(&self) -> Result<bool, ServerError>;
    /// Block the calling thread until reached (sleeping in the driver).
    fn block(&self) -> Result<(), ServerError>;
    /// The stream, as its backend shows it, for stuck-stream reports.
    fn stream_name(&self) -> String;
    /// The stream's progress word, if its backend keeps one (asked once per lane).
    fn progress(&self) -> Option<ProgressWord>;
}

impl<A: EventApi> Waitable for EventFence<A> {
    fn lane(&self) -> LaneKey {
        LaneKey::of::<A>(self.stream())
    }

    fn sequence(&self) -> u64 {
        EventFence::sequence(self)
    }

    fn query(&self) -> Result<bool, ServerError> {
        self.is_complete()
    }

    fn block(&self) -> Result<(), ServerError> {
        EventFence::block(self)
    }

    fn stream_name(&self) -> String {
        format!("{} stream {:?}", A::BACKEND, self.stream())
    }

    fn progress(&self) -> Option<ProgressWord> {
        A::stream_progress(self.stream())
    }
}

#[cfg(test)]
mod tests {
    impl super::LaneKey {
        pub(crate) fn for_tests(stream: u64) -> Self {
            let backend = std::any::TypeId::of::<()>();
            Self { backend, stream }
        }
    }
}
