//! Stuck streams. A leaf: it reads the [`Stall`] it is given, and says
//! whether it is stuck and how the warning reads.

use std::time::{Duration, Instant};

use crate::panics;

/// A stream that has ended no pending wait for longer than its waiter's
/// [`stuck_after`](super::WaiterBuilder::stuck_after).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct StuckWait {
    /// The backend's name and the `Debug` of the stream's handle, as in
    /// `Host stream HostStreamHandle(3)`.
    pub stream: String,
    /// The backend's number for the stream, unique among that backend's live
    /// streams (`HostStreamHandle(3)`: 3).
    pub stream_id: u64,
    /// Since its oldest wait was handed off to an idle stream, or the wait
    /// before it ended. Serialized as `{"secs": u64, "nanos": u32}`.
    pub waited: Duration,
    /// Waits queued behind the oldest, on the same stream.
    pub behind: usize,
    /// The oldest wait's future was dropped (a timeout gave up on it) while
    /// a thread still holds it.
    pub given_up: bool,
}

/// What a lane shows of its stream's progress.
pub(super) struct Stall {
    /// Since when the stream has ended no wait while one was pending.
    pub(super) since: Instant,
    /// Waits queued or out in a batch.
    pub(super) queued: usize,
    /// A lane thread holds its oldest wait (blocked on it, or asking it).
    pub(super) held: bool,
    /// That wait's future was dropped.
    pub(super) given_up: bool,
}

impl Stall {
    /// This stall at `now`, if it has lasted `after` with a wait pending.
    pub(super) fn stuck(
        &self,
        now: Instant,
        after: Duration,
        name: Option<&str>,
        stream_id: u64,
    ) -> Option<StuckWait> {
        let waited = now.saturating_duration_since(self.since);
        if waited < after || (self.queued == 0 && !self.held) {
            return None;
        }
        Some(StuckWait {
            stream: name.map_or_else(|| format!("a stream ({stream_id})"), str::to_owned),
            stream_id,
            waited,
            behind: self.queued - usize::from(!self.held),
            given_up: self.given_up,
        })
    }
}

/// Log the one warning about `wait`'s stall.
pub(super) fn warn(waiter: &str, after: Duration, wait: &StuckWait) {
    let given_up = if wait.given_up {
        " (its future was dropped, and the stream is still held on it)"
    } else {
        ""
    };
    panics::log(|| {
        log::warn!(
            "waiter {waiter:?}: a wait on {} has been pending for {:?} (stuck_after \
             {after:?}){given_up}, with {} more queued behind it",
            wait.stream,
            wait.waited,
            wait.behind
        );
    });
}
