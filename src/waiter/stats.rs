//! [`WaiterStats`] and the striped [`Counters`] behind it (its gauges: `Pool::gauges`).

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::time::{Duration, Instant};

use crate::waiter::latency_histogram::{LatencyHistogram, LATENCY_BUCKETS};

/// A snapshot of a [`Waiter`](super::Waiter): [`Waiter::stats`](super::Waiter::stats).
///
/// Gauges are what the waiter holds now; counters count since it was made. Every wait handed off
/// ends as exactly one of `resolved`, `failed` or `cancelled` (its result or its future's drop,
/// whichever came first), and every snapshot has `handed_off >= resolved + failed + cancelled`.
///
/// Read without stopping the waiter: counters are striped per thread, gauges read under the
/// waiter's lock. Worth an alert: `failed` growing (device faults, which are sticky: the stream or
/// context needs recreating; or a waiter shut down under live requests), and `pending` growing
/// without bound while `resolved` stays flat (work queued faster than the device finishes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct WaiterStats {
    /// Threads alive now: lane threads, plus the poller and the watcher if they run.
    pub threads: usize,
    /// The most threads alive at once.
    pub peak_threads: usize,
    /// [`Waiter::pending`](super::Waiter::pending), `cancelled_held` included.
    pub pending: usize,
    /// Waits whose future was dropped but that a lane thread is still blocked on: they leave
    /// `pending` when the device reaches them.
    pub cancelled_held: usize,
    /// Stuck streams (0 while `stuck_after` is off), as [`Waiter::stuck`](super::Waiter::stuck)
    /// lists them.
    pub stuck: usize,
    /// Awaits answered at their first poll, without a hand-off: the fence was reached (or failed,
    /// or the waiter refused it) when first asked.
    pub ready_at_first_poll: u64,
    /// Waits handed to the waiter's threads.
    pub handed_off: u64,
    /// Handed-off waits that resolved `Ok`.
    pub resolved: u64,
    /// Handed-off waits that resolved with an error (a fault, a shutdown, a panicking backend
    /// call).
    pub failed: u64,
    /// Handed-off waits whose future was dropped before their result came.
    pub cancelled: u64,
    /// Of `resolved`, the waits the watcher saw end on their stream's progress word (see
    /// [`WaiterBuilder::watchers`](super::WaiterBuilder::watchers)); the rest woke in the driver.
    pub watched: u64,
    /// The CPU time the watcher thread has used (its thread's CPU clock; Linux only, zero
    /// elsewhere): what racing the driver has cost. It is bounded by design (see
    /// [`WaiterBuilder::watchers`](super::WaiterBuilder::watchers)).
    pub watcher_cpu: Duration,
    /// How long `resolved` and `failed` waits took from hand-off to the wake of their task: the
    /// device's work left at the hand-off, plus the wake-up. A tail far above the work's own length
    /// means slow wake-ups (an overloaded host, or more busy streams than `max_threads`).
    pub wake_latency: LatencyHistogram,
}

/// Stripes, one per thread's [`crate::sync::shards::home`]: executor and waiter threads do not
/// bounce one cache line.
const STRIPES: usize = 16;

/// The counters behind [`WaiterStats`]. An outcome is counted (release) after its hand-off, its
/// latency after it; [`Counters::read`] reads them in the other order (acquire), so no snapshot
/// shows more latencies than outcomes, nor more outcomes than hand-offs.
#[derive(Default)]
pub(crate) struct Counters {
    stripes: [Stripe; STRIPES],
    /// The watcher's CPU time, in nanoseconds (one writer: the watcher).
    watcher_cpu_nanos: AtomicU64,
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
    watched: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
    latency_sum_nanos: AtomicU64,
}

impl Counters {
    fn stripe(&self) -> &Stripe {
        &self.stripes[crate::sync::shards::home(STRIPES)]
    }

    pub(crate) fn ready_at_first_poll(&self) {
        self.stripe().ready_at_first_poll.fetch_add(1, Relaxed);
    }

    /// A wait was handed off (before any thread can take it).
    pub(crate) fn handed_off(&self) {
        self.stripe().handed_off.fetch_add(1, Relaxed);
    }

    /// A handed-off wait's result, `ok` or not, reached its future.
    pub(crate) fn delivered(&self, ok: bool, since: Instant) {
        let stripe = self.stripe();
        let took = since.elapsed();
        let outcome = if ok { &stripe.resolved } else { &stripe.failed };
        outcome.fetch_add(1, Release);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        stripe.latency_sum_nanos.fetch_add(nanos, Relaxed);
        stripe.latency[LatencyHistogram::bucket_of(took)].fetch_add(1, Release);
    }

    /// A held wait was seen to end on its stream's progress word.
    pub(crate) fn watched(&self) {
        self.stripe().watched.fetch_add(1, Release);
    }

    /// The watcher used `cpu` more CPU time.
    pub(crate) fn watcher_cpu(&self, cpu: Duration) {
        let nanos = u64::try_from(cpu.as_nanos()).unwrap_or(u64::MAX);
        self.watcher_cpu_nanos.fetch_add(nanos, Relaxed);
    }

    pub(crate) fn cancelled(&self) {
        self.stripe().cancelled.fetch_add(1, Release);
    }

    /// `gauges` with the counters, read in the order the type's docs say.
    pub(crate) fn read(&self, gauges: WaiterStats) -> WaiterStats {
        let sum = |field: &dyn Fn(&Stripe) -> &AtomicU64| -> u64 {
            let counts = self.stripes.iter().map(|s| field(s).load(Acquire));
            counts.fold(0, u64::saturating_add)
        };
        let buckets = std::array::from_fn(|bucket| sum(&|stripe| &stripe.latency[bucket]));
        let sum_nanos = sum(&|stripe| &stripe.latency_sum_nanos);
        // Read in the order written: `watched` (counted after its `resolved`), the outcomes, then
        // the hand-offs.
        WaiterStats {
            watched: sum(&|stripe| &stripe.watched),
            resolved: sum(&|stripe| &stripe.resolved),
            failed: sum(&|stripe| &stripe.failed),
            cancelled: sum(&|stripe| &stripe.cancelled),
            ready_at_first_poll: sum(&|stripe| &stripe.ready_at_first_poll),
            handed_off: sum(&|stripe| &stripe.handed_off),
            watcher_cpu: Duration::from_nanos(self.watcher_cpu_nanos.load(Relaxed)),
            wake_latency: LatencyHistogram::new(buckets, sum_nanos),
            ..gauges
        }
    }
}
