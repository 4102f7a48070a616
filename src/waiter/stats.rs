//! [`WaiterStats`]: what a waiter holds and has done, read without stopping
//! it; and [`Counters`], the striped counters behind it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How many buckets a [`LatencyHistogram`] has.
pub const LATENCY_BUCKETS: usize = 32;

/// A snapshot of a [`Waiter`](super::Waiter): [`Waiter::stats`](super::Waiter::stats).
///
/// Gauges are what the waiter holds now; counters count since it was made.
/// Every wait handed off ends as exactly one of `resolved`, `failed` or
/// `cancelled` (its result or its future's drop, whichever came first), and
/// every snapshot has `handed_off >= resolved + failed + cancelled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct WaiterStats {
    /// Threads alive now: lane threads, plus the poller if it runs.
    pub threads: usize,
    /// The most threads alive at once.
    pub peak_threads: usize,
    /// [`Waiter::pending`](super::Waiter::pending), `cancelled_held` included.
    pub pending: usize,
    /// Waits whose future was dropped but that a lane thread is still
    /// blocked on: they leave `pending` when the device reaches them.
    pub cancelled_held: usize,
    /// Stuck streams (0 while `stuck_after` is off), as
    /// [`Waiter::stuck`](super::Waiter::stuck) lists them.
    pub stuck: usize,
    /// Awaits answered at their first poll, without a hand-off: the fence
    /// was reached (or failed, or the waiter refused it) when first asked.
    pub ready_at_first_poll: u64,
    /// Waits handed to the waiter's threads.
    pub handed_off: u64,
    /// Handed-off waits that resolved `Ok`.
    pub resolved: u64,
    /// Handed-off waits that resolved with an error (a fault, a shutdown, a
    /// panicking backend call).
    pub failed: u64,
    /// Handed-off waits whose future was dropped before their result came.
    pub cancelled: u64,
    /// How long `resolved` and `failed` waits took from hand-off to the
    /// wake of their task: the device's work left at the hand-off, plus the
    /// wake-up. A tail far above the work's own length means slow wake-ups
    /// (an overloaded host, or more busy streams than `max_threads`).
    pub wake_latency: LatencyHistogram,
}

/// Counts of durations in log2 buckets of microseconds: bucket 0 holds those
/// under 1 µs, bucket `i` those from `2^(i-1)` µs up to `2^i` µs, and the last
/// everything from `2^(LATENCY_BUCKETS - 2)` µs (about 18 minutes) on.
///
/// [`buckets`](LatencyHistogram::buckets) are not cumulative: a Prometheus
/// histogram sums them in order, as `examples/http_service.rs` does. With the
/// `serde` feature it serializes as `{"buckets": [32 counts, bucket 0
/// first], "sum_nanos": <the durations added up, in nanoseconds>}`.
///
/// ```
/// use device_events::LatencyHistogram;
/// use std::time::Duration;
///
/// let empty = LatencyHistogram::default();
/// assert_eq!(empty.count(), 0);
/// assert_eq!(empty.percentile(50.0), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LatencyHistogram {
    buckets: [u64; LATENCY_BUCKETS],
    /// The durations added up, in nanoseconds (saturating).
    sum_nanos: u64,
}

impl LatencyHistogram {
    /// How many durations it holds.
    pub fn count(&self) -> u64 {
        self.buckets
            .iter()
            .fold(0u64, |count, &bucket| count.saturating_add(bucket))
    }

    /// The durations it holds, added up (for a mean, or a Prometheus
    /// histogram's `_sum`).
    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_nanos)
    }

    /// The count in each bucket, with the bucket's upper bound (exclusive;
    /// `None` for the last, which has none).
    pub fn buckets(&self) -> impl Iterator<Item = (Option<Duration>, u64)> + '_ {
        self.buckets
            .iter()
            .enumerate()
            .map(|(index, &count)| (Self::upper_bound(index), count))
    }

    /// The upper bound of the bucket that holds the `percentile`-th
    /// duration (0 to 100): at least `percentile` percent of the durations
    /// were under it. `None` when it holds none, or `percentile` is out of
    /// range (or NaN); [`Duration::MAX`] when that bucket is the last.
    pub fn percentile(&self, percentile: f64) -> Option<Duration> {
        let count = self.count();
        if count == 0 || !(0.0..=100.0).contains(&percentile) {
            return None;
        }
        // 1-based, and at most the count (past 2^53 the float may round up).
        let rank = ((percentile / 100.0 * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        for (index, &bucket) in self.buckets.iter().enumerate() {
            seen = bucket.saturating_add(seen);
            if seen >= rank {
                return Some(Self::upper_bound(index).unwrap_or(Duration::MAX));
            }
        }
        Some(Duration::MAX) // not reached: the rank is at most the count
    }

    /// The bucket `duration` falls in.
    pub(crate) fn bucket_of(duration: Duration) -> usize {
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        let bits = (u64::BITS - micros.leading_zeros()) as usize;
        bits.min(LATENCY_BUCKETS - 1)
    }

    fn upper_bound(index: usize) -> Option<Duration> {
        (index < LATENCY_BUCKETS - 1).then(|| Duration::from_micros(1 << index))
    }

    #[cfg(all(test, not(device_events_loom)))]
    pub(crate) fn from_buckets(buckets: [u64; LATENCY_BUCKETS]) -> Self {
        Self {
            buckets,
            sum_nanos: 0,
        }
    }
}

/// Threads count on their own stripe ([`crate::shards::home`]), so executor
/// and waiter threads do not bounce one cache line.
const STRIPES: usize = 16;

/// The counters behind [`WaiterStats`], striped by thread.
///
/// A wait's outcome is counted (release) after its hand-off, its latency
/// (release) after its outcome; [`Counters::read`] reads them in the other
/// order (acquire), so a snapshot never shows more latencies than
/// outcomes, nor more outcomes than hand-offs.
pub(crate) struct Counters {
    stripes: Box<[Stripe]>,
}

/// One thread stripe's counts, on cache lines of its own.
#[derive(Default)]
#[repr(align(128))]
struct Stripe {
    ready_at_first_poll: AtomicU64,
    handed_off: AtomicU64,
    resolved: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
    latency_sum_nanos: AtomicU64,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
        }
    }
}

impl Counters {
    fn stripe(&self) -> &Stripe {
        &self.stripes[crate::shards::home(STRIPES)]
    }

    /// An await was answered at its first poll.
    pub(crate) fn ready_at_first_poll(&self) {
        self.stripe()
            .ready_at_first_poll
            .fetch_add(1, Ordering::Relaxed);
    }

    /// A wait was handed off (before any thread can take it).
    pub(crate) fn handed_off(&self) {
        self.stripe().handed_off.fetch_add(1, Ordering::Relaxed);
    }

    /// A handed-off wait's result reached its future, `ok` or not, `since`
    /// its hand-off.
    pub(crate) fn delivered(&self, ok: bool, since: Instant) {
        let stripe = self.stripe();
        let took = since.elapsed();
        let outcome = if ok { &stripe.resolved } else { &stripe.failed };
        outcome.fetch_add(1, Ordering::Release);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        stripe.latency_sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        stripe.latency[LatencyHistogram::bucket_of(took)].fetch_add(1, Ordering::Release);
    }

    /// A handed-off wait's future was dropped before its result came.
    pub(crate) fn cancelled(&self) {
        self.stripe().cancelled.fetch_add(1, Ordering::Release);
    }

    /// The counters (gauges left 0): latencies, then outcomes, then the rest
    /// (see the type's docs for why in that order).
    pub(crate) fn read(&self) -> WaiterStats {
        let sum = |field: fn(&Stripe) -> &AtomicU64| -> u64 {
            self.stripes
                .iter()
                .map(|stripe| field(stripe).load(Ordering::Acquire))
                .sum()
        };
        let mut buckets = [0u64; LATENCY_BUCKETS];
        let mut sum_nanos = 0u64;
        for stripe in self.stripes.iter() {
            for (total, count) in buckets.iter_mut().zip(&stripe.latency) {
                *total = total.saturating_add(count.load(Ordering::Acquire));
            }
            sum_nanos = sum_nanos.saturating_add(stripe.latency_sum_nanos.load(Ordering::Relaxed));
        }
        let resolved = sum(|stripe| &stripe.resolved);
        let failed = sum(|stripe| &stripe.failed);
        let cancelled = sum(|stripe| &stripe.cancelled);
        WaiterStats {
            ready_at_first_poll: sum(|stripe| &stripe.ready_at_first_poll),
            handed_off: sum(|stripe| &stripe.handed_off),
            resolved,
            failed,
            cancelled,
            wake_latency: LatencyHistogram { buckets, sum_nanos },
            ..WaiterStats::default()
        }
    }
}
