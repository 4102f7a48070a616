//! Stuck waits: a stream whose oldest pending wait has gone
//! [`WaiterBuilder::stuck_after`](super::WaiterBuilder::stuck_after)
//! without progress is listed by [`Waiter::stuck`](super::Waiter::stuck)
//! and logged once, and the end of its stall is logged once.
//!
//! Stalls are told apart from backlogs by the stream's progress, not by a
//! wait's age: the stall is timed from the hand-off that found the stream
//! idle, or from the end of the last wait on it, whichever is later. A
//! healthy stream with a long queue ends a wait every so often and is never
//! reported, however old its queued waits are. A wait given up (its future
//! dropped) while a thread is blocked on it still holds the stream: the
//! stall goes on, and is reported, until the device moves. One given up
//! while queued leaves the queue; the stall goes on, from the same start,
//! for the waits behind it. A stream with no wait left is no longer
//! watched.
//!
//! No thread of its own: the check runs when a wait is handed off, when
//! the poller ends a round, and when the idle lane thread holding the idle
//! watch wakes on its own timeout (all together at most once per
//! [`check_interval`]), and
//! whenever the list or the stats are read. Each lane keeps its watch under
//! its shard's lock; the lines about a stall are made there, in order, and
//! logged after the lock is let go, one thread at a time, so a stall's end
//! never comes before its warning and no lock is held while a logger runs.
//! A lane removed while some of its waits are out in a batch leaves its
//! watch with its shard until the batch is settled, so the stall goes on if
//! they come back.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::checked::Checked;
use super::contain;
use super::line_queue::LineQueue;
use super::pool::Shared;
use crate::ServerError;

/// A stream whose oldest pending wait has gone longer than its waiter's
/// [`stuck_after`](super::WaiterBuilder::stuck_after) without progress:
/// blocked on by a waiter thread or next in line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct StuckWait {
    /// The stream, as the waiter names it in its log lines: the backend's
    /// name and the `Debug` of the stream's handle, as in `Host stream
    /// HostStreamHandle(3)`.
    pub stream: String,
    /// How long the stream has gone without ending a wait while one was
    /// pending on it: since its oldest pending wait was handed off to an
    /// idle stream, or since the wait before it ended. With the `serde`
    /// feature it serializes as serde writes a `Duration`:
    /// `{"secs": u64, "nanos": u32}`.
    pub waited: Duration,
    /// Waits queued behind the oldest, on the same stream.
    pub behind: usize,
    /// Whether the future of the wait a thread is blocked on was dropped (a
    /// timeout gave up on it): the stream is still held on it, and the
    /// waits behind it with it.
    pub given_up: bool,
}

/// One lane's watch for stuck waits, kept only when `stuck_after` is on:
/// since when its stream has made no progress, and whether that stall has
/// been reported.
pub(crate) struct LaneWatch {
    /// The stream, as its backend shows it.
    stream: Arc<str>,
    /// When the lane last went from idle to waited on (a hand-off), or when
    /// its server last ended a wait.
    since: Instant,
    /// The stall since `since` was warned about; its end is due a line.
    reported: bool,
}

/// A line about a stall, made under its lane's shard lock (so a stall's
/// lines are in order) and logged once no lock is held (a logger is code
/// the crate does not own: it may block, or call back into the waiter).
enum StuckLine {
    Stuck {
        stream: Arc<str>,
        wait: StuckWait,
    },
    Ended {
        stream: Arc<str>,
        stalled: Duration,
        failed: Option<ServerError>,
        given_up: bool,
    },
    Left {
        stream: Arc<str>,
        stalled: Duration,
    },
}

/// The pool's stuck-wait bookkeeping: when the busy paths look next, and
/// the lines waiting to be logged, in the order they were made.
pub(crate) struct StuckReports {
    epoch: Instant,
    next_check: AtomicU64,
    /// An idle lane thread holds the idle watch: it wakes on its own every
    /// [`check_interval`] to look for stuck streams, and the other idle
    /// threads sleep their whole keep-alive.
    idle_watch: AtomicBool,
    lines: LineQueue<StuckLine>,
    /// Lines made so far, by kind (stuck, ended, left), for unit tests.
    #[cfg(test)]
    pub(crate) made: [std::sync::atomic::AtomicUsize; 3],
}

impl StuckReports {
    pub(crate) fn new() -> Self {
        Self {
            epoch: Instant::now(),
            next_check: AtomicU64::new(0),
            idle_watch: AtomicBool::new(false),
            lines: LineQueue::new(),
            #[cfg(test)]
            made: Default::default(),
        }
    }

    /// Take the idle watch if no idle thread holds it.
    pub(crate) fn take_idle_watch(&self) -> bool {
        self.idle_watch
            .compare_exchange(false, true, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// The idle thread holding the idle watch woke: another may take it.
    pub(crate) fn end_idle_watch(&self) {
        self.idle_watch.store(false, Ordering::Relaxed);
    }

    fn push(&self, line: StuckLine) {
        #[cfg(test)]
        {
            let kind = match line {
                StuckLine::Stuck { .. } => 0,
                StuckLine::Ended { .. } => 1,
                StuckLine::Left { .. } => 2,
            };
            self.made[kind].fetch_add(1, Ordering::SeqCst);
        }
        self.lines.push(line);
    }
}

impl LaneWatch {
    /// The watch of a lane made for a wait on `stream` handed off at
    /// `since`.
    pub(crate) fn new(stream: Arc<str>, since: Instant) -> Self {
        Self {
            stream,
            since,
            reported: false,
        }
    }

    /// A wait handed off at `handed_at` came to the lane while it was idle
    /// (nothing in it, blocked on or out): unless a reported stall goes
    /// on, the stream's wait starts now.
    pub(crate) fn woke(&mut self, handed_at: Instant) {
        if !self.reported {
            self.since = self.since.max(handed_at);
        }
    }

    /// The lane's server ended its oldest wait (`failed`: with that error;
    /// `given_up`: whether its future had been dropped, asked only for a
    /// reported stall): the stream made progress. The end of a reported
    /// stall is due its line.
    pub(crate) fn progressed(
        &mut self,
        failed: Option<&ServerError>,
        given_up: impl FnOnce() -> bool,
        reports: &StuckReports,
    ) {
        let now = Instant::now();
        if std::mem::take(&mut self.reported) {
            reports.push(StuckLine::Ended {
                stream: self.stream.clone(),
                stalled: now.saturating_duration_since(self.since),
                failed: failed.cloned(),
                given_up: given_up(),
            });
        }
        self.since = now;
    }

    /// The lane is gone with no wait on it left to end (each was given up,
    /// failed, or shut down): a reported stall ends here.
    pub(crate) fn removed(self, reports: &StuckReports) {
        if self.reported {
            reports.push(StuckLine::Left {
                stream: self.stream,
                stalled: self.since.elapsed(),
            });
        }
    }

    /// The stream's name.
    pub(crate) fn stream(&self) -> &Arc<str> {
        &self.stream
    }
}

/// How often the busy paths (hand-offs, poller rounds) and idle lane
/// threads look for stuck streams: four times per `stuck_after`, so a stall
/// is found within a quarter of it, but never more than once a millisecond,
/// so a tiny `stuck_after` does not make every hand-off scan every shard.
pub(crate) fn check_interval(after: Duration) -> Duration {
    (after / 4).max(Duration::from_millis(1))
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
                // The oldest: blocked on, or the first queued or out in a
                // batch; the rest are behind it.
                let queued = lane.waits.len() + lane.out;
                let head = match (&lane.blocked_on, lane.waits.first_key_value()) {
                    (Some(slot), _) => Some(slot),
                    (None, Some((_, oldest))) => Some(&oldest.slot),
                    (None, None) if lane.out > 0 => None,
                    (None, None) => continue,
                };
                let behind = if lane.blocked_on.is_some() {
                    queued
                } else {
                    queued - 1
                };
                let Some(watch) = lane.watch.as_mut() else {
                    continue;
                };
                let since = match head {
                    Some(head) if crate::plant::planted("stall-timed-from-hand-off") => {
                        head.handed_at()
                    }
                    _ => watch.since,
                };
                let waited = now.saturating_duration_since(since);
                if waited < after {
                    continue;
                }
                let given_up = lane
                    .blocked_on
                    .as_ref()
                    .is_some_and(|slot| slot.is_cancelled());
                stuck.push(self.report(watch, waited, behind, given_up));
            }
            // Lanes removed while their waits are out in a batch.
            for parked in &mut shard.parked {
                let waited = now.saturating_duration_since(parked.watch.since);
                if waited >= after {
                    // Its waits are all out: the oldest of them and the rest.
                    let behind = parked.out() - 1;
                    stuck.push(self.report(&mut parked.watch, waited, behind, false));
                }
            }
        }
        self.log_stuck_lines();
        stuck
    }

    /// The entry for a stalled lane's `watch`; the first makes its line.
    fn report(
        &self,
        watch: &mut LaneWatch,
        waited: Duration,
        behind: usize,
        given_up: bool,
    ) -> StuckWait {
        let wait = StuckWait {
            stream: watch.stream.to_string(),
            waited,
            behind,
            given_up,
        };
        if !std::mem::replace(&mut watch.reported, true) {
            self.stuck.push(StuckLine::Stuck {
                stream: watch.stream.clone(),
                wait: wait.clone(),
            });
        }
        wait
    }

    /// [`Shared::check_stuck`] if a check is due at `now`: at most one per
    /// [`check_interval`], whichever thread comes first.
    pub(crate) fn check_stuck_if_due(&self, now: Instant) {
        let Some(after) = self.config.stuck_after else {
            return;
        };
        let reports = &self.stuck;
        let at = u64::try_from(now.saturating_duration_since(reports.epoch).as_nanos())
            .unwrap_or(u64::MAX);
        let due = reports.next_check.load(Ordering::Relaxed);
        if at < due {
            return;
        }
        let interval = u64::try_from(check_interval(after).as_nanos()).unwrap_or(u64::MAX);
        let next = at.saturating_add(interval);
        if reports
            .next_check
            .compare_exchange(due, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.check_stuck();
        }
    }

    /// Log the stuck-wait lines made so far, in order, with no lock held:
    /// called after a shard's lock is let go, by whoever may have made one.
    /// One thread logs at a time; a line made meanwhile is logged by it.
    pub(crate) fn log_stuck_lines(&self) {
        let Some(after) = self.config.stuck_after else {
            return;
        };
        let waiter = &self.config.thread_name;
        self.stuck.lines.log(|line| {
            contain::log(|| match line {
                StuckLine::Stuck { stream, wait } => {
                    let given_up = if wait.given_up {
                        " (its future was dropped, and the stream is still held on it)"
                    } else {
                        ""
                    };
                    log::warn!(
                        "waiter {waiter:?}: a wait on {stream} has been pending for {:?} \
                         (stuck_after {after:?}){given_up}, with {} more queued behind it",
                        wait.waited,
                        wait.behind
                    );
                }
                StuckLine::Ended {
                    stream,
                    stalled,
                    failed,
                    given_up,
                } => {
                    let result: Result<(), ServerError> = failed.map_or(Ok(()), Err);
                    let given_up = if given_up { ", its future dropped" } else { "" };
                    log::info!(
                        "waiter {waiter:?}: the wait on {stream}, reported stuck, ended \
                         ({result:?}){given_up} after {stalled:?}"
                    );
                }
                StuckLine::Left { stream, stalled } => log::info!(
                    "waiter {waiter:?}: the wait on {stream}, reported stuck, left the waiter \
                     after {stalled:?}: every wait on its stream was given up, failed or shut \
                     down"
                ),
            });
        });
    }
}
