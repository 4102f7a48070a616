//! Stuck waits: a stream whose oldest pending wait has gone
//! [`WaiterBuilder::stuck_after`](super::WaiterBuilder::stuck_after)
//! without progress is listed by [`Waiter::stuck`](super::Waiter::stuck)
//! and logged once, and the end of its stall is logged once.
//!
//! Stalls are told apart from backlogs by the stream's progress, not by a
//! wait's age: a wait is measured from its hand-off or from the end of the
//! wait before it on its stream, whichever is later. A healthy stream with a
//! long queue ends a wait every so often and is never reported, however old
//! its queued waits are. A stream held on a wait whose future was dropped is
//! still held: its stall goes on, and is reported, until the device moves.
//!
//! No thread of its own: the check runs when a wait is handed off or the
//! poller ends a round (each at most a few times per `stuck_after`), and
//! whenever the list or the stats are read. Each lane keeps its watch under
//! its shard's lock, and both lines are logged under that lock, so a stall's
//! end is never logged before its warning.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::checked::Checked;
use super::contain;
use super::pool::Shared;
use crate::ServerError;

/// A stream whose oldest pending wait has gone longer than its waiter's
/// [`stuck_after`](super::WaiterBuilder::stuck_after) without progress:
/// blocked on by a waiter thread or next in line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct StuckWait {
    /// The stream, as its backend shows it (`Debug` of its handle).
    pub stream: String,
    /// How long its oldest wait has been pending without the stream ending
    /// any wait: since that wait's hand-off, or since the wait before it on
    /// the stream ended, whichever is later.
    pub waited: Duration,
    /// Waits handed off on the same stream after it, queued behind it.
    pub behind: usize,
    /// Whether the future of the oldest wait was dropped (a timeout gave up
    /// on it): the stream is still held on it, and the waits behind it
    /// with it.
    pub given_up: bool,
}

/// One lane's watch for stuck waits, kept only when `stuck_after` is on:
/// since when its stream has made no progress, and whether that stall has
/// been reported.
pub(crate) struct LaneWatch {
    /// The stream, as its backend shows it.
    stream: String,
    /// The waiter's thread name, for log lines.
    waiter: String,
    /// When the lane was made (its first wait's hand-off), or when its
    /// server last ended a wait.
    since: Instant,
    /// The stall since `since` was warned about; its end is due a line.
    reported: bool,
}

impl LaneWatch {
    /// The watch of a lane made for a wait on `stream` handed off at
    /// `since`, in waiter `waiter`.
    pub(crate) fn new(waiter: &str, stream: String, since: Instant) -> Self {
        Self {
            stream,
            waiter: waiter.to_owned(),
            since,
            reported: false,
        }
    }

    /// The lane's server ended its oldest wait with `result` (`given_up`:
    /// its future had been dropped): the stream made progress. The end of a
    /// reported stall is logged, once.
    pub(crate) fn progressed(&mut self, result: Option<&ServerError>, given_up: bool) {
        let now = Instant::now();
        if std::mem::take(&mut self.reported) {
            let stalled = now.saturating_duration_since(self.since);
            let result: Result<(), &ServerError> = result.map_or(Ok(()), Err);
            let given_up = if given_up { ", its future dropped" } else { "" };
            contain::log(|| {
                log::info!(
                    "waiter {:?}: the wait on {}, reported stuck, ended ({result:?}){given_up} \
                     after {stalled:?}",
                    self.waiter,
                    self.stream
                );
            });
        }
        self.since = now;
    }

    /// The lane is gone with no wait on it left to end (each was given up,
    /// failed, or shut down): a reported stall ends here, logged once.
    pub(crate) fn removed(&mut self) {
        if std::mem::take(&mut self.reported) {
            let stalled = self.since.elapsed();
            contain::log(|| {
                log::info!(
                    "waiter {:?}: the wait on {}, reported stuck, left the waiter with no wait \
                     on its stream after {stalled:?}",
                    self.waiter,
                    self.stream
                );
            });
        }
    }
}

/// When the next check on the hand-off and poller paths is due, in
/// nanoseconds since `epoch`.
pub(crate) struct StuckClock {
    epoch: Instant,
    next_check: AtomicU64,
}

impl StuckClock {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            next_check: AtomicU64::new(0),
        }
    }
}

impl Shared {
    /// The streams stalled longer than `stuck_after` (none when it is off);
    /// those not reported before are logged now.
    pub(crate) fn check_stuck(&self) -> Vec<StuckWait> {
        let Some(after) = self.config.stuck_after else {
            return Vec::new();
        };
        if self.is_forked() {
            return Vec::new();
        }
        let now = Instant::now();
        let mut stuck = Vec::new();
        for shard in self.shards() {
            let mut shard = Checked::lock(shard);
            for lane in shard.lanes.values_mut() {
                let (head, behind) = match (&lane.blocked_on, lane.waits.first_key_value()) {
                    (Some(slot), _) => (slot, lane.waits.len()),
                    (None, Some((_, oldest))) => (&oldest.slot, lane.waits.len() - 1),
                    (None, None) => continue,
                };
                let Some(watch) = lane.watch.as_mut() else {
                    continue;
                };
                let mut since = watch.since.max(head.handed_at());
                if crate::plant::planted("stall-timed-from-hand-off") {
                    since = head.handed_at();
                }
                let waited = now.saturating_duration_since(since);
                if waited < after {
                    continue;
                }
                let wait = StuckWait {
                    stream: watch.stream.clone(),
                    waited,
                    behind,
                    given_up: head.is_cancelled(),
                };
                if !std::mem::replace(&mut watch.reported, true) {
                    let given_up = if wait.given_up {
                        " (its future was dropped, and the stream is still held on it)"
                    } else {
                        ""
                    };
                    contain::log(|| {
                        log::warn!(
                            "waiter {:?}: a wait on {} has been pending for {:?} (stuck_after \
                             {after:?}){given_up}, with {} more queued behind it",
                            self.config.thread_name,
                            wait.stream,
                            wait.waited,
                            wait.behind
                        );
                    });
                }
                stuck.push(wait);
            }
        }
        stuck
    }

    /// [`Shared::check_stuck`] if a check is due at `now`: at most one per
    /// quarter of `stuck_after`, whichever thread comes first.
    pub(crate) fn check_stuck_if_due(&self, now: Instant) {
        let Some(after) = self.config.stuck_after else {
            return;
        };
        let clock = &self.stuck_clock;
        let at = u64::try_from(now.saturating_duration_since(clock.epoch).as_nanos())
            .unwrap_or(u64::MAX);
        let due = clock.next_check.load(Ordering::Relaxed);
        if at < due {
            return;
        }
        let next = at.saturating_add(u64::try_from((after / 4).as_nanos()).unwrap_or(u64::MAX));
        if clock
            .next_check
            .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.check_stuck();
        }
    }
}
