//! [`Waitable`]: how the waiter sees a fence, without naming a backend.

use std::any::TypeId;
use std::hash::{Hash, Hasher};

use crate::{EventApi, EventFence, ServerError};

/// Identifies a stream across backends: the backend's type and a hash of its
/// stream handle. Two streams whose hashes collide share a lane, which costs
/// only latency (one waits behind the other), never correctness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct LaneKey {
    backend: TypeId,
    /// A hash of the backend's stream handle (not the stream itself).
    stream_hash: u64,
}

#[cfg(test)]
impl LaneKey {
    /// A lane for the loom models and unit tests, which have no backend.
    pub(crate) fn for_tests(stream: u64) -> Self {
        Self {
            backend: TypeId::of::<()>(),
            stream_hash: stream,
        }
    }
}

/// What the waiter needs of a fence: which stream, where in it, and the two
/// ways to ask the device.
pub(crate) trait Waitable: Send + 'static {
    /// The lane (stream) this wait belongs to.
    fn lane(&self) -> LaneKey;
    /// Its order in the lane: earlier fences on a stream complete first.
    fn sequence(&self) -> u64;
    /// Reached, not yet, or a fault; never blocks.
    fn query(&self) -> Result<bool, ServerError>;
    /// Block the calling thread until reached (sleeping in the driver). The
    /// caller drops the waitable afterwards, apart from the wait.
    fn block(&self) -> Result<(), ServerError>;
    /// The stream, as its backend shows it, for stuck-wait reports.
    fn stream_name(&self) -> String {
        format!("{:?}", self.lane())
    }
}

impl LaneKey {
    /// Which of `shards` (a power of two) holds this lane: the low bits of
    /// its stream's hash, which are as well mixed as the rest.
    pub(crate) fn shard(self, shards: usize) -> usize {
        crate::shards::of_hash(self.stream_hash, shards)
    }

    /// The lane of `stream` of backend `A`.
    pub(crate) fn of<A: EventApi>(stream: A::Stream) -> Self {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        stream.hash(&mut hasher);
        Self {
            backend: TypeId::of::<A>(),
            stream_hash: hasher.finish(),
        }
    }
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
}
