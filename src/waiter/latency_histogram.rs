//! [`LatencyHistogram`]: durations counted in log2 buckets of microseconds.

use std::time::Duration;

/// How many buckets a [`LatencyHistogram`] has.
pub const LATENCY_BUCKETS: usize = 32;

/// Counts of durations in log2 buckets of microseconds: bucket 0 holds those under 1 µs, bucket `i`
/// those from `2^(i-1)` µs up to `2^i` µs, and the last everything from `2^(LATENCY_BUCKETS - 2)`
/// µs (about 18 minutes) on.
///
/// [`buckets`](LatencyHistogram::buckets) are not cumulative: a Prometheus histogram sums them in
/// order (the `metrics` feature publishes them so, `device_events::metrics`). With the `serde`
/// feature it serializes as `{"buckets": [32 counts, bucket 0 first], "sum_nanos": <the durations
/// added up, in nanoseconds>}`.
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
        self.buckets.iter().fold(0, |n, &b| n.saturating_add(b))
    }

    /// The durations it holds, added up (for a mean, or a Prometheus histogram's `_sum`).
    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_nanos)
    }

    /// The count in each bucket, with the bucket's upper bound (exclusive; `None` for the last,
    /// which has none).
    pub fn buckets(&self) -> impl Iterator<Item = (Option<Duration>, u64)> + '_ {
        (0..LATENCY_BUCKETS)
            .map(Self::upper_bound)
            .zip(self.buckets)
    }

    /// The upper bound of the bucket that holds the `percentile`-th duration (0 to 100): at least
    /// `percentile` percent of the durations were under it. `None` when it holds none, or
    /// `percentile` is out of range (or NaN); [`Duration::MAX`] when that bucket is the last.
    pub fn percentile(&self, percentile: f64) -> Option<Duration> {
        let count = self.count();
        if count == 0 || !(0.0..=100.0).contains(&percentile) {
            return None;
        }
        // 1-based, and at most the count (past 2^53 the float may round up).
        let rank = ((percentile / 100.0 * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0u64;
        let index = self.buckets.iter().position(|&bucket| {
            seen = seen.saturating_add(bucket);
            seen >= rank
        });
        // Found: the rank is at most the count.
        Some(index.and_then(Self::upper_bound).unwrap_or(Duration::MAX))
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

    pub(crate) fn new(buckets: [u64; LATENCY_BUCKETS], sum_nanos: u64) -> Self {
        Self { buckets, sum_nanos }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fall_in_log2_buckets_of_microseconds() {
        let bucket = |micros| LatencyHistogram::bucket_of(Duration::from_micros(micros));
        assert_eq!(LatencyHistogram::bucket_of(Duration::from_nanos(999)), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(2), 2);
        assert_eq!(bucket(3), 2);
        assert_eq!(bucket(4), 3);
        assert_eq!(bucket(1023), 10);
        assert_eq!(bucket(1024), 11);
        assert_eq!(bucket(u64::MAX), LATENCY_BUCKETS - 1);
        assert_eq!(
            LatencyHistogram::bucket_of(Duration::MAX),
            LATENCY_BUCKETS - 1
        );
    }

    #[test]
    fn a_percentile_is_the_upper_bound_of_its_bucket() {
        let mut buckets = [0; LATENCY_BUCKETS];
        buckets[1] = 90; // 1 to 2 µs
        buckets[11] = 9; // 1024 to 2048 µs
        buckets[LATENCY_BUCKETS - 1] = 1; // the open last bucket
        let histogram = LatencyHistogram::new(buckets, 0);
        assert_eq!(histogram.count(), 100);
        assert_eq!(histogram.percentile(0.0), Some(Duration::from_micros(2)));
        assert_eq!(histogram.percentile(50.0), Some(Duration::from_micros(2)));
        assert_eq!(histogram.percentile(90.0), Some(Duration::from_micros(2)));
        assert_eq!(
            histogram.percentile(90.5),
            Some(Duration::from_micros(2048))
        );
        assert_eq!(
            histogram.percentile(99.0),
            Some(Duration::from_micros(2048))
        );
        assert_eq!(histogram.percentile(100.0), Some(Duration::MAX));
        assert_eq!(histogram.percentile(100.5), None);
        assert_eq!(histogram.percentile(-1.0), None);
        assert_eq!(histogram.percentile(f64::NAN), None);
        let bounds: Vec<_> = histogram.buckets().map(|(bound, _)| bound).collect();
        assert_eq!(bounds[0], Some(Duration::from_micros(1)));
        assert_eq!(bounds[LATENCY_BUCKETS - 1], None);
    }

    #[test]
    fn counts_past_what_a_float_holds_exactly_do_not_panic() {
        // 2^54 - 1 is odd: as a float it rounds up, past the count.
        let mut buckets = [0; LATENCY_BUCKETS];
        buckets[3] = (1 << 54) - 1;
        let histogram = LatencyHistogram::new(buckets, 0);
        assert_eq!(histogram.percentile(100.0), Some(Duration::from_micros(8)));
        // More than a u64 holds, added up: the count saturates.
        buckets[4] = u64::MAX;
        let histogram = LatencyHistogram::new(buckets, 0);
        assert_eq!(histogram.count(), u64::MAX);
        assert_eq!(histogram.percentile(50.0), Some(Duration::from_micros(16)));
    }
}
