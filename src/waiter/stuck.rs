//! Stuck streams: which lanes are stalled, what is reported of one, and how the warning reads.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::state::Lane;
use super::waitable::LaneKey;
use crate::panics;

/// A stream that has ended no pending wait for longer than its waiter's
/// [`stuck_after`](super::WaiterBuilder::stuck_after).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct StuckWait {
    /// The backend's name and the `Debug` of the stream's handle, as in `Host stream
    /// HostStreamHandle(3)`.
    pub stream: String,
    /// The backend's number for the stream, unique among that backend's live streams
    /// (`HostStreamHandle(3)`: 3).
    pub stream_id: u64,
    /// Since its oldest wait was handed off to an idle stream, or the wait before it ended.
    /// Serialized as `{"secs": u64, "nanos": u32}`.
    pub waited: Duration,
    /// Waits queued behind the oldest, on the same stream.
    pub behind: usize,
    /// The oldest wait's future was dropped (a timeout gave up on it) while a thread still holds
    /// it.
    pub given_up: bool,
}

/// Log the one warning about `wait`'s stall.
pub(super) fn warn(waiter: &str, after: Duration, wait: &StuckWait) {
    let dropped = " (its future was dropped, and the stream is still held on it)";
    let given_up = if wait.given_up { dropped } else { "" };
    let (stream, waited, behind) = (&wait.stream, wait.waited, wait.behind);
    panics::log(|| {
        log::warn!(
            "waiter {waiter:?}: a wait on {stream} has been pending for {waited:?} (stuck_after \
             {after:?}){given_up}, with {behind} more queued behind it"
        );
    });
}

/// The lanes stalled for `after` at `now` with a wait pending; with `mark`, those not reported
/// yet, now marked.
pub(super) fn stalled(
    lanes: &mut BTreeMap<LaneKey, Lane>,
    now: Instant,
    after: Duration,
    mark: bool,
) -> Vec<StuckWait> {
    let mut found = Vec::new();
    for (key, lane) in lanes {
        let pending = lane.pending();
        let waited = now.saturating_duration_since(lane.since);
        if waited < after || pending == 0 || mark && std::mem::replace(&mut lane.reported, true) {
            continue;
        }
        let stream_id = key.stream_id();
        let name = lane.name.as_deref();
        found.push(StuckWait {
            stream: name.map_or_else(|| format!("a stream ({stream_id})"), str::to_owned),
            stream_id,
            waited,
            // The oldest is the held wait, or the first queued where none is held.
            behind: pending - 1,
            given_up: lane.held_given_up(),
        });
    }
    found
}
