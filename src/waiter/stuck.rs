//! Stuck waits: a wait pending longer than
//! [`WaiterBuilder::stuck_after`](super::WaiterBuilder::stuck_after) is
//! listed by [`Waiter::stuck`](super::Waiter::stuck) and logged once, and
//! its end is logged once. No thread of its own: the check runs when a wait
//! is handed off or the poller ends a round (each at most a few times per
//! `stuck_after`), and whenever the list or the stats are read.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::checked::Checked;
use super::contain;
use super::pool::Shared;

/// A wait pending longer than its waiter's
/// [`stuck_after`](super::WaiterBuilder::stuck_after): the oldest of its
/// stream's waits, blocked on by a waiter thread or next in line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct StuckWait {
    /// The stream, as its backend shows it (`Debug` of its handle).
    pub stream: String,
    /// How long it has been pending, since its hand-off.
    pub waited: Duration,
    /// Waits handed off on the same stream after it, queued behind it.
    pub behind: usize,
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
    /// The waits pending longer than `stuck_after` (none when it is off),
    /// oldest first per stream; those not reported before are logged now.
    pub(crate) fn check_stuck(&self) -> Vec<StuckWait> {
        let Some(after) = self.config.stuck_after else {
            return Vec::new();
        };
        if self.is_forked() {
            return Vec::new();
        }
        let now = Instant::now();
        let mut stuck = Vec::new();
        let mut newly = Vec::new();
        for shard in self.shards() {
            let shard = Checked::lock(shard);
            for lane in shard.lanes.values() {
                let (slot, behind) = match (&lane.blocked_on, lane.waits.first_key_value()) {
                    (Some(slot), _) => (slot, lane.waits.len()),
                    (None, Some((_, oldest))) => (&oldest.slot, lane.waits.len() - 1),
                    (None, None) => continue,
                };
                let waited = now.saturating_duration_since(slot.handed_at());
                if waited < after {
                    continue;
                }
                let wait = StuckWait {
                    stream: lane.name.clone().unwrap_or_default(),
                    waited,
                    behind,
                };
                let what = format!(
                    "waiter {:?}: the wait on {}",
                    self.config.thread_name, wait.stream
                );
                if slot.report_stuck(what) {
                    newly.push(wait.clone());
                }
                stuck.push(wait);
            }
        }
        for wait in newly {
            contain::log(|| {
                log::warn!(
                    "waiter {:?}: a wait on {} has been pending for {:?} (stuck_after {after:?}), \
                     with {} more queued behind it",
                    self.config.thread_name,
                    wait.stream,
                    wait.waited,
                    wait.behind
                );
            });
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
