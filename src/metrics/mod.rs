//! The stats published to the [`metrics`] crate's recorder (feature `metrics`).
//!
//! The stats types stay the source: [`WaiterStats`], [`DropQueueStats`] and [`ProfilerStats`]
//! are read when a service asks, and nothing is published on the hot path. A service makes one
//! publisher per source, with labels that tell the sources apart, and calls its `publish` with a
//! fresh snapshot where it is scraped (its `/metrics` handler), before it renders. Counters are
//! set to the snapshot's values ([`Counter::absolute`](::metrics::Counter::absolute)), so
//! publishing twice counts nothing twice; the wake-latency histogram gets the waits that ended
//! since the last publish. Call [`describe`] once where the recorder is installed.
//!
//! | series | type | from |
//! |---|---|---|
//! | `device_events_waiter_threads` | gauge | [`WaiterStats::threads`] |
//! | `device_events_waiter_peak_threads` | gauge | [`WaiterStats::peak_threads`] |
//! | `device_events_waiter_pending` | gauge | [`WaiterStats::pending`] |
//! | `device_events_waiter_cancelled_held` | gauge | [`WaiterStats::cancelled_held`] |
//! | `device_events_waiter_stuck_streams` | gauge | [`WaiterStats::stuck`] |
//! | `device_events_waiter_handed_off_total` | counter | [`WaiterStats::handed_off`] |
//! | `device_events_waiter_awaits_total{outcome}` | counter | `outcome` one of `ready_at_first_poll`, `resolved`, `failed`, `cancelled`: how each await ended |
//! | `device_events_waiter_watched_total` | counter | [`WaiterStats::watched`] |
//! | `device_events_waiter_watcher_cpu_seconds` | gauge | [`WaiterStats::watcher_cpu`] (only grows; a gauge because `metrics` counters are whole numbers) |
//! | `device_events_waiter_wake_latency_seconds` | histogram | [`WaiterStats::wake_latency`] ([`WAKE_LATENCY_SECONDS`]) |
//! | `device_events_drop_queue_pushed_total` | counter | [`DropQueueStats::pushed`] |
//! | `device_events_drop_queue_settled_total{outcome}` | counter | `outcome` one of `dropped`, `leaked`, `handed_back` |
//! | `device_events_drop_queue_pending` | gauge | [`DropQueueStats::pending`] |
//! | `device_events_drop_queue_queued` | gauge | [`DropQueueStats::queued`] |
//! | `device_events_profiler_events_created_total` | counter | [`ProfilerStats::created`] |
//! | `device_events_profiler_events_pooled` | gauge | [`ProfilerStats::pooled`] |
//!
//! Labels are the publisher's own, fixed when it is made: a waiter's name, a device ordinal, a
//! backend, a stream's place in a fixed set; never anything per fence or request. Two
//! publishers with one set of labels would overwrite each other's counters.
//!
//! An exporter renders a histogram as a summary unless told its buckets: give it
//! [`LATENCY_BUCKETS_SECONDS`], which are [`LatencyHistogram`]'s.
//!
//! ```
//! use device_events::host::HostStream;
//! use device_events::metrics::{self, WaiterMetrics, LATENCY_BUCKETS_SECONDS, WAKE_LATENCY_SECONDS};
//! use device_events::Waiter;
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//!
//! let recorder = PrometheusBuilder::new()
//!     .set_buckets_for_metric(
//!         Matcher::Full(WAKE_LATENCY_SECONDS.into()),
//!         &LATENCY_BUCKETS_SECONDS,
//!     )?
//!     .build_recorder();
//! let prometheus = recorder.handle();
//! let waiter = Waiter::builder().thread_name("service").build();
//! let published = WaiterMetrics::new(&[("waiter", "service")]);
//! let stream = HostStream::new()?;
//! futures::executor::block_on(waiter.wait(stream.fence()))?;
//! let text = ::metrics::with_local_recorder(&recorder, || {
//!     metrics::describe();
//!     published.publish(&waiter.stats()); // in the service's /metrics handler
//!     prometheus.render()
//! });
//! assert!(text.contains("device_events_waiter_handed_off_total{waiter=\"service\"}"));
//! assert!(text.contains("# TYPE device_events_waiter_wake_latency_seconds histogram"));
//! waiter.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use ::metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, IntoLabels,
    Label, Unit,
};

use crate::drop_queue::DropQueueStats;
use crate::sync::Mutex;
use crate::waiter::{LatencyHistogram, WaiterStats, LATENCY_BUCKETS};
use crate::ProfilerStats;

/// The wake-latency histogram's name, for an exporter's per-metric bucket setting.
pub const WAKE_LATENCY_SECONDS: &str = "device_events_waiter_wake_latency_seconds";

/// The upper bounds of [`LatencyHistogram`]'s buckets, in seconds: 1 µs, 2 µs, 4 µs, … 2^30 µs
/// (about 18 minutes); its last bucket, above them, is the exporter's `+Inf`.
///
/// ```
/// use device_events::metrics::LATENCY_BUCKETS_SECONDS;
///
/// assert_eq!(LATENCY_BUCKETS_SECONDS[0], 1e-6);
/// assert_eq!(LATENCY_BUCKETS_SECONDS[10], 1024e-6);
/// ```
pub const LATENCY_BUCKETS_SECONDS: [f64; LATENCY_BUCKETS - 1] = {
    let mut bounds = [0.0; LATENCY_BUCKETS - 1];
    let mut index = 0;
    while index < bounds.len() {
        bounds[index] = (1u64 << index) as f64 / 1e6;
        index += 1;
    }
    bounds
};

/// Describes every series this module publishes (help text and unit) to the current recorder.
/// Call it once, where the recorder is installed (or inside
/// [`with_local_recorder`](::metrics::with_local_recorder)).
pub fn describe() {
    let counters = [
        (
            "device_events_waiter_handed_off_total",
            "Waits handed to the waiter's threads.",
        ),
        (
            "device_events_waiter_awaits_total",
            "Awaits ended, by outcome: ready_at_first_poll (no hand-off), or a handed-off wait \
             resolved, failed or cancelled.",
        ),
        (
            "device_events_waiter_watched_total",
            "Resolved waits the watcher saw end on their stream's progress word.",
        ),
        (
            "device_events_drop_queue_pushed_total",
            "Values taken in by the drop queue.",
        ),
        (
            "device_events_drop_queue_settled_total",
            "Values done with, by outcome: dropped after their fence, leaked (fence failed) or \
             handed_back by shutdown_now.",
        ),
        (
            "device_events_profiler_events_created_total",
            "Timing events the profiler created.",
        ),
    ];
    for (name, help) in counters {
        describe_counter!(name, Unit::Count, help);
    }
    let gauges = [
        ("device_events_waiter_threads", "Waiter threads alive now."),
        (
            "device_events_waiter_peak_threads",
            "The most waiter threads alive at once.",
        ),
        (
            "device_events_waiter_pending",
            "Waits handed to the waiter and not finished.",
        ),
        (
            "device_events_waiter_cancelled_held",
            "Waits cancelled but still held by a blocked waiter thread.",
        ),
        (
            "device_events_waiter_stuck_streams",
            "Streams whose oldest wait has gone past stuck_after with none of their waits ending.",
        ),
        (
            "device_events_drop_queue_pending",
            "Values waiting for their fence.",
        ),
        (
            "device_events_drop_queue_queued",
            "Of those, values the queue's thread has not taken up.",
        ),
        (
            "device_events_profiler_events_pooled",
            "Idle timing events in the profiler's pool.",
        ),
    ];
    for (name, help) in gauges {
        describe_gauge!(name, Unit::Count, help);
    }
    describe_gauge!(
        "device_events_waiter_watcher_cpu_seconds",
        Unit::Seconds,
        "CPU time the waiter's watcher thread has used (Linux); only grows."
    );
    describe_histogram!(
        WAKE_LATENCY_SECONDS,
        Unit::Seconds,
        "Handed-off waits that resolved or failed, from hand-off to the wake of their task."
    );
}

/// Publishes a [`Waiter`](crate::Waiter)'s stats under fixed labels; see the [module
/// docs](self).
///
/// ```
/// use device_events::metrics::WaiterMetrics;
/// use device_events::Waiter;
///
/// let waiter = Waiter::builder().build();
/// let published = WaiterMetrics::new(&[("waiter", "jobs"), ("backend", "Host")]);
/// published.publish(&waiter.stats()); // no recorder installed: nothing is kept
/// ```
#[derive(Debug)]
pub struct WaiterMetrics {
    labels: Vec<Label>,
    /// The wake latencies published so far: the next publish records only the rest.
    published: Mutex<LatencyHistogram>,
}

impl WaiterMetrics {
    /// A publisher whose series carry `labels` (bounded ones: see the [module docs](self)).
    pub fn new(labels: impl IntoLabels) -> Self {
        Self {
            labels: labels.into_labels(),
            published: Mutex::new(LatencyHistogram::default()),
        }
    }

    /// Set the series to `stats`, a snapshot of this publisher's waiter
    /// ([`Waiter::stats`](crate::Waiter::stats)), and record the waits that ended since the
    /// last publish in the wake-latency histogram: each bucket's at a value inside that bucket,
    /// chosen so that the histogram's sum grows by the new waits' own.
    pub fn publish(&self, stats: &WaiterStats) {
        let labels = &self.labels;
        let gauges = [
            ("device_events_waiter_threads", stats.threads),
            ("device_events_waiter_peak_threads", stats.peak_threads),
            ("device_events_waiter_pending", stats.pending),
            ("device_events_waiter_cancelled_held", stats.cancelled_held),
            ("device_events_waiter_stuck_streams", stats.stuck),
        ];
        for (name, value) in gauges {
            gauge!(name, labels.iter()).set(value as f64);
        }
        gauge!("device_events_waiter_watcher_cpu_seconds", labels.iter())
            .set(stats.watcher_cpu.as_secs_f64());
        counter!("device_events_waiter_handed_off_total", labels.iter()).absolute(stats.handed_off);
        counter!("device_events_waiter_watched_total", labels.iter()).absolute(stats.watched);
        let outcomes = [
            ("ready_at_first_poll", stats.ready_at_first_poll),
            ("resolved", stats.resolved),
            ("failed", stats.failed),
            ("cancelled", stats.cancelled),
        ];
        by_outcome(labels, "device_events_waiter_awaits_total", &outcomes);
        // Under the lock, so two publishes at once record each wait once.
        let mut published = self.published.lock();
        let latency = histogram!(WAKE_LATENCY_SECONDS, labels.iter());
        for (value, count) in samples(&published, &stats.wake_latency) {
            latency.record_many(value, usize::try_from(count).unwrap_or(usize::MAX));
        }
        *published = stats.wake_latency;
    }
}

/// Publishes a [`DropQueue`](crate::drop_queue::DropQueue)'s stats under fixed labels; see the
/// [module docs](self).
///
/// ```
/// use device_events::drop_queue::DropQueue;
/// use device_events::host::HostStream;
/// use device_events::metrics::DropQueueMetrics;
///
/// let stream = HostStream::new()?;
/// let queue = DropQueue::new(16)?;
/// let published = DropQueueMetrics::new(&[("stream", "0")]);
/// queue.push(stream.fence(), vec![0u8; 64])?;
/// published.publish(&queue.stats());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct DropQueueMetrics {
    labels: Vec<Label>,
}

impl DropQueueMetrics {
    /// A publisher whose series carry `labels` (bounded ones: see the [module docs](self)).
    pub fn new(labels: impl IntoLabels) -> Self {
        Self {
            labels: labels.into_labels(),
        }
    }

    /// Set the series to `stats`, a snapshot of this publisher's queue.
    pub fn publish(&self, stats: &DropQueueStats) {
        let labels = &self.labels;
        counter!("device_events_drop_queue_pushed_total", labels.iter()).absolute(stats.pushed);
        let outcomes = [
            ("dropped", stats.dropped),
            ("leaked", stats.leaked),
            ("handed_back", stats.handed_back),
        ];
        by_outcome(labels, "device_events_drop_queue_settled_total", &outcomes);
        gauge!("device_events_drop_queue_pending", labels.iter()).set(stats.pending as f64);
        gauge!("device_events_drop_queue_queued", labels.iter()).set(stats.queued as f64);
    }
}

/// Publishes an [`EventProfiler`](crate::EventProfiler)'s or
/// [`AnyProfiler`](crate::AnyProfiler)'s stats under fixed labels; see the [module docs](self).
///
/// ```
/// use device_events::host::Host;
/// use device_events::metrics::ProfilerMetrics;
/// use device_events::EventProfiler;
///
/// let profiler = EventProfiler::<Host>::new();
/// ProfilerMetrics::new(&[("device", "0")]).publish(&profiler.stats());
/// ```
#[derive(Debug)]
pub struct ProfilerMetrics {
    labels: Vec<Label>,
}

impl ProfilerMetrics {
    /// A publisher whose series carry `labels` (bounded ones: see the [module docs](self)).
    pub fn new(labels: impl IntoLabels) -> Self {
        Self {
            labels: labels.into_labels(),
        }
    }

    /// Set the series to `stats`, a snapshot of this publisher's profiler.
    pub fn publish(&self, stats: &ProfilerStats) {
        let labels = &self.labels;
        counter!("device_events_profiler_events_created_total", labels.iter())
            .absolute(stats.created);
        gauge!("device_events_profiler_events_pooled", labels.iter()).set(stats.pooled as f64);
    }
}

/// Set the counter `name`, under `labels` and each label `outcome`, to that outcome's value.
fn by_outcome(labels: &[Label], name: &'static str, outcomes: &[(&'static str, u64)]) {
    for &(outcome, value) in outcomes {
        let mut labels = labels.to_vec();
        labels.push(Label::from_static_parts("outcome", outcome));
        counter!(name, labels).absolute(value);
    }
}

/// The samples that bring a histogram from `before` to `now`, as (value in seconds, count): for
/// each bucket that grew, one value inside that bucket, all placed at one fraction `t` of their
/// buckets' widths so that they add up to the new durations' sum (the last bucket, open above,
/// just past its lower bound).
fn samples(before: &LatencyHistogram, now: &LatencyHistogram) -> Vec<(f64, u64)> {
    let counts = before.buckets().zip(now.buckets());
    let grown = counts.map(|((_, before), (_, now))| now.saturating_sub(before));
    let grown: Vec<(usize, u64)> = grown.enumerate().filter(|&(_, count)| count > 0).collect();
    let bounds = |index: usize| {
        let low = index
            .checked_sub(1)
            .map_or(0.0, |below| LATENCY_BUCKETS_SECONDS[below]);
        let high = LATENCY_BUCKETS_SECONDS.get(index).copied().unwrap_or(low);
        (low, high)
    };
    let (mut lows, mut widths) = (0.0, 0.0);
    for &(index, count) in &grown {
        let (low, high) = bounds(index);
        lows += low * count as f64;
        widths += (high - low) * count as f64;
    }
    let sum = now.sum().saturating_sub(before.sum()).as_secs_f64();
    let t = if widths > 0.0 {
        ((sum - lows) / widths).clamp(0.0, 1.0)
    } else {
        0.0
    };
    grown
        .into_iter()
        .map(|(index, count)| {
            let (low, high) = bounds(index);
            // Above the bucket below's bound (inclusive, as Prometheus's `le` is).
            let value = (low + t * (high - low)).min(high);
            let value = if index > 0 && value <= low {
                low.next_up()
            } else {
                value
            };
            (value, count)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bounds_are_the_histograms() {
        let empty = LatencyHistogram::default();
        let bounds: Vec<_> = empty.buckets().map(|(bound, _)| bound).collect();
        assert_eq!(bounds.len(), LATENCY_BUCKETS_SECONDS.len() + 1);
        for (seconds, bound) in LATENCY_BUCKETS_SECONDS.iter().zip(&bounds) {
            let bound = bound.expect("a finite bound").as_secs_f64();
            assert!(
                (seconds - bound).abs() <= bound * 1e-12,
                "{seconds} {bound}"
            );
        }
        assert_eq!(bounds.last(), Some(&None));
    }

    #[test]
    fn samples_fall_in_their_buckets_and_add_up_to_the_sum() {
        let mut buckets = [0; LATENCY_BUCKETS];
        buckets[0] = 2; // under 1 µs
        buckets[3] = 5; // 4 to 8 µs
        buckets[LATENCY_BUCKETS - 1] = 1; // the open last bucket
        let before = LatencyHistogram::new([0; LATENCY_BUCKETS], 0);
        let last = LATENCY_BUCKETS_SECONDS[LATENCY_BUCKETS - 2];
        // 2 × 0.5 µs, 5 × 6 µs, and one just past the last bound.
        let sum_nanos = 2 * 500 + 5 * 6_000 + (last * 1e9) as u64 + 1;
        let now = LatencyHistogram::new(buckets, sum_nanos);
        let samples = samples(&before, &now);
        assert_eq!(samples.len(), 3);
        let (first, fourth, open) = (samples[0], samples[1], samples[2]);
        assert_eq!((first.1, fourth.1, open.1), (2, 5, 1));
        assert!(first.0 > 0.0 && first.0 <= 1e-6, "{first:?}");
        assert!(fourth.0 > 4e-6 && fourth.0 <= 8e-6, "{fourth:?}");
        assert!(open.0 > last, "{open:?}");
        let total: f64 = samples
            .iter()
            .map(|&(value, count)| value * count as f64)
            .sum();
        let expected = sum_nanos as f64 / 1e9;
        assert!(
            (total - expected).abs() < 1e-6 * expected,
            "{total} {expected}"
        );
        // Nothing new, nothing recorded.
        assert!(super::samples(&now, &now).is_empty());
    }
}
