//! The `metrics` feature: what the waiter, a drop queue and a profiler publish, rendered by a
//! Prometheus recorder of the test's own (`with_local_recorder`, so no test shares a recorder):
//! each series there with its type, values that follow from what ran, histogram buckets, and
//! publishing twice counting nothing twice.

mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{faultable_stream, Gate};
use device_events::drop_queue::{DropQueue, Rejected};
use device_events::host::{Host, HostStream};
use device_events::metrics::{
    self, DropQueueMetrics, ProfilerMetrics, WaiterMetrics, LATENCY_BUCKETS_SECONDS,
    WAKE_LATENCY_SECONDS,
};
use device_events::{EventFence, EventProfiler, Waiter, WaiterStats};
use futures::task::noop_waker_ref;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

/// A recorder with the wake-latency buckets, as a service would build it.
fn recorder() -> PrometheusRecorder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(WAKE_LATENCY_SECONDS.into()),
            &LATENCY_BUCKETS_SECONDS,
        )
        .expect("buckets")
        .build_recorder()
}

/// Run `publish` against `recorder`, then render it.
fn scrape(recorder: &PrometheusRecorder, publish: impl FnOnce()) -> Scraped {
    ::metrics::with_local_recorder(recorder, || {
        metrics::describe();
        publish();
    });
    Scraped::parse(&recorder.handle().render())
}

/// Rendered text, parsed: each series' type, and each sample by name and sorted labels.
struct Scraped {
    text: String,
    types: BTreeMap<String, String>,
    samples: BTreeMap<(String, Vec<(String, String)>), f64>,
}

impl Scraped {
    fn parse(text: &str) -> Self {
        let (mut types, mut samples) = (BTreeMap::new(), BTreeMap::new());
        for line in text.lines() {
            if let Some(typed) = line.strip_prefix("# TYPE ") {
                let (name, kind) = typed.split_once(' ').expect("# TYPE name kind");
                types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').expect("name value");
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            let mut labels: Vec<(String, String)> = labels
                .split(',')
                .filter(|label| !label.is_empty())
                .map(|label| {
                    let (key, value) = label.split_once('=').expect("key=\"value\"");
                    (key.to_owned(), value.trim_matches('"').to_owned())
                })
                .collect();
            labels.sort();
            let value = value.parse().unwrap_or_else(|_| panic!("a number: {line}"));
            samples.insert((name.to_owned(), labels), value);
        }
        Self {
            text: text.to_owned(),
            types,
            samples,
        }
    }

    /// The sample `name{labels}`, labels in any order.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<_> = labels
            .iter()
            .map(|&(key, value)| (key.to_owned(), value.to_owned()))
            .collect();
        labels.sort();
        *self
            .samples
            .get(&(name.to_owned(), labels.clone()))
            .unwrap_or_else(|| panic!("no {name}{labels:?} in:\n{}", self.text))
    }

    fn kind(&self, name: &str) -> &str {
        self.types
            .get(name)
            .unwrap_or_else(|| panic!("no # TYPE {name} in:\n{}", self.text))
    }

    /// The histogram's buckets with `labels`, by bound (`+Inf` last).
    fn buckets(&self, name: &str, labels: &[(&str, &str)]) -> Vec<(f64, f64)> {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|((series, series_labels), _)| {
                *series == bucket
                    && labels.iter().all(|&(key, value)| {
                        series_labels.contains(&(key.to_owned(), value.to_owned()))
                    })
            })
            .map(|((_, series_labels), &count)| {
                let le = series_labels.iter().find(|(key, _)| key == "le");
                let le = le.expect("an le label").1.as_str();
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().expect("a bound")
                };
                (bound, count)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    }
}

/// Poll `future` once: pending (handed off) or not.
fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(noop_waker_ref()))
}

#[test]
fn the_waiter_publishes_its_stats_and_publishing_twice_counts_once() {
    let waiter = Waiter::builder().build();
    let published = WaiterMetrics::new(&[("waiter", "test")]);
    let labels = [("waiter", "test")];
    // One await ready at its first poll.
    let stream = HostStream::new().unwrap();
    futures::executor::block_on(waiter.wait(stream.fence())).unwrap();
    // Three handed off: one cancelled, two resolved.
    let gate = Gate::hold(&stream);
    let mut cancelled = waiter.wait(stream.fence());
    assert!(poll_once(&mut cancelled).is_pending(), "the stream is held");
    drop(cancelled);
    let mut resolved: Vec<_> = (0..2).map(|_| waiter.wait(stream.fence())).collect();
    for future in &mut resolved {
        assert!(poll_once(future).is_pending(), "the stream is held");
    }
    gate.open();
    for result in futures::executor::block_on(futures::future::join_all(resolved)) {
        result.unwrap();
    }
    // One handed off that fails: its stream faults.
    let faulted = faultable_stream();
    let gate = Gate::hold(&faulted);
    faulted
        .launch(|| panic!("a fault planted by the test"))
        .unwrap();
    let mut failed = waiter.wait(faulted.fence());
    assert!(poll_once(&mut failed).is_pending(), "the stream is held");
    gate.open();
    assert!(futures::executor::block_on(failed).is_err());

    let recorder = recorder();
    let stats = waiter.stats();
    let first = scrape(&recorder, || published.publish(&stats));
    let outcome = |outcome| [labels[0], ("outcome", outcome)];
    let awaits = "device_events_waiter_awaits_total";
    assert_eq!(first.kind(awaits), "counter");
    assert_eq!(first.get(awaits, &outcome("ready_at_first_poll")), 1.0);
    assert_eq!(first.get(awaits, &outcome("resolved")), 2.0);
    assert_eq!(first.get(awaits, &outcome("cancelled")), 1.0);
    assert_eq!(first.get(awaits, &outcome("failed")), 1.0);
    let handed_off = "device_events_waiter_handed_off_total";
    assert_eq!(first.kind(handed_off), "counter");
    assert_eq!(first.get(handed_off, &labels), 4.0);
    let watched = "device_events_waiter_watched_total";
    assert_eq!(first.kind(watched), "counter");
    assert_eq!(first.get(watched, &labels), stats.watched as f64);
    let gauges = [
        ("device_events_waiter_threads", stats.threads),
        ("device_events_waiter_peak_threads", stats.peak_threads),
        ("device_events_waiter_pending", stats.pending),
        ("device_events_waiter_cancelled_held", stats.cancelled_held),
        ("device_events_waiter_stuck_streams", 0),
    ];
    for (name, value) in gauges {
        assert_eq!(first.kind(name), "gauge", "{name}");
        assert_eq!(first.get(name, &labels), value as f64, "{name}");
    }
    assert!(stats.peak_threads >= 1);
    let cpu = "device_events_waiter_watcher_cpu_seconds";
    assert_eq!(first.kind(cpu), "gauge");
    assert_eq!(first.get(cpu, &labels), stats.watcher_cpu.as_secs_f64());
    // A snapshot whose fields all differ, published twice: each series is its own field, set
    // (not added to) each time, the watcher's CPU time in seconds.
    let mut distinct = WaiterStats::default();
    (distinct.threads, distinct.peak_threads, distinct.pending) = (2, 7, 3);
    (distinct.cancelled_held, distinct.stuck, distinct.watched) = (1, 4, 9);
    (distinct.ready_at_first_poll, distinct.handed_off) = (11, 23);
    (distinct.resolved, distinct.failed, distinct.cancelled) = (12, 5, 6);
    distinct.watcher_cpu = Duration::from_millis(1_500);
    let distinct_labels = [("waiter", "distinct")];
    let distinct_metrics = WaiterMetrics::new(&distinct_labels);
    for publish in ["first", "second"] {
        let scraped = scrape(&recorder, || distinct_metrics.publish(&distinct));
        let series = [
            ("device_events_waiter_threads", 2.0),
            ("device_events_waiter_peak_threads", 7.0),
            ("device_events_waiter_pending", 3.0),
            ("device_events_waiter_cancelled_held", 1.0),
            ("device_events_waiter_stuck_streams", 4.0),
            (watched, 9.0),
            (handed_off, 23.0),
            (cpu, 1.5),
        ];
        for (name, value) in series {
            let got = scraped.get(name, &distinct_labels);
            assert_eq!(got, value, "{publish} publish: {name}");
        }
        let outcomes = [
            ("ready_at_first_poll", 11.0),
            ("resolved", 12.0),
            ("failed", 5.0),
            ("cancelled", 6.0),
        ];
        for (outcome, value) in outcomes {
            let got = scraped.get(awaits, &[distinct_labels[0], ("outcome", outcome)]);
            assert_eq!(got, value, "{publish} publish: awaits {outcome}");
        }
    }

    // The wake latencies of the three that resolved or failed, in LatencyHistogram's buckets.
    let latency = WAKE_LATENCY_SECONDS;
    assert_eq!(first.kind(latency), "histogram");
    let buckets = first.buckets(latency, &labels);
    assert_eq!(
        buckets.len(),
        LATENCY_BUCKETS_SECONDS.len() + 1,
        "{}",
        first.text
    );
    let mut cumulative = 0;
    for ((bound, count), (expected, own)) in buckets.iter().zip(stats.wake_latency.buckets()) {
        cumulative += own;
        let expected = expected.map_or(f64::INFINITY, |bound| bound.as_secs_f64());
        let close = *bound == expected || (bound - expected).abs() <= expected * 1e-9;
        assert!(close, "{bound} {expected}");
        assert_eq!(*count, cumulative as f64, "le={bound}:\n{}", first.text);
    }
    assert_eq!(first.get(&format!("{latency}_count"), &labels), 3.0);
    let sum = first.get(&format!("{latency}_sum"), &labels);
    let own = stats.wake_latency.sum().as_secs_f64();
    assert!((sum - own).abs() <= own * 1e-6, "{sum} against {own}");

    // Published again with nothing new: the same counts, no latency counted twice.
    let again = scrape(&recorder, || published.publish(&waiter.stats()));
    assert_eq!(again.get(awaits, &outcome("resolved")), 2.0);
    assert_eq!(again.get(handed_off, &labels), 4.0);
    assert_eq!(again.get(&format!("{latency}_count"), &labels), 3.0);
    assert_eq!(again.buckets(latency, &labels), buckets);
    // One more handed-off wait: counted once.
    let gate = Gate::hold(&stream);
    let mut more = waiter.wait(stream.fence());
    assert!(poll_once(&mut more).is_pending(), "the stream is held");
    gate.open();
    futures::executor::block_on(more).unwrap();
    let after = scrape(&recorder, || published.publish(&waiter.stats()));
    assert_eq!(after.get(awaits, &outcome("resolved")), 3.0);
    assert_eq!(after.get(&format!("{latency}_count"), &labels), 4.0);
    let own = waiter.stats().wake_latency.sum().as_secs_f64();
    let sum = after.get(&format!("{latency}_sum"), &labels);
    assert!((sum - own).abs() <= own * 1e-6, "{sum} against {own}");
    waiter.shutdown();
}

#[test]
fn drop_queues_publish_under_their_own_labels() {
    let recorder = recorder();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let queue = DropQueue::new(1).unwrap();
    queue.push(stream.fence(), vec![0u8; 8]).unwrap();
    common::until_taken(&queue);
    let refused = queue.push(stream.fence(), vec![1u8; 8]);
    assert!(matches!(refused, Err(Rejected::Full(_))), "{refused:?}");
    drop(refused); // queued past the capacity
    let faulted = faultable_stream();
    faulted
        .launch(|| panic!("a fault planted by the test"))
        .unwrap();
    let other = DropQueue::new(4).unwrap();
    other
        .push(EventFence::<Host>::new(faulted.handle()), vec![2u8; 8])
        .unwrap();
    let (zero, one) = (
        DropQueueMetrics::new(&[("stream", "0")]),
        DropQueueMetrics::new(&[("stream", "1")]),
    );
    let held = scrape(&recorder, || {
        zero.publish(&queue.stats());
        one.publish(&other.stats());
    });
    let (labels_zero, labels_one) = ([("stream", "0")], [("stream", "1")]);
    let pushed = "device_events_drop_queue_pushed_total";
    assert_eq!(held.kind(pushed), "counter");
    assert_eq!(held.get(pushed, &labels_zero), 2.0);
    assert_eq!(held.get(pushed, &labels_one), 1.0);
    let pending = "device_events_drop_queue_pending";
    assert_eq!(held.kind(pending), "gauge");
    assert_eq!(held.get(pending, &labels_zero), 2.0);
    let queued = "device_events_drop_queue_queued";
    assert_eq!(held.kind(queued), "gauge");
    // One in flight on the queue's thread, one queued behind it.
    assert_eq!(held.get(queued, &labels_zero), 1.0);
    gate.open();
    queue.flush();
    other.flush();
    let settled = scrape(&recorder, || {
        zero.publish(&queue.stats());
        one.publish(&other.stats());
        zero.publish(&queue.stats()); // twice: set, not added
    });
    let name = "device_events_drop_queue_settled_total";
    assert_eq!(settled.kind(name), "counter");
    let outcome = |stream, outcome| [("stream", stream), ("outcome", outcome)];
    assert_eq!(settled.get(name, &outcome("0", "dropped")), 2.0);
    assert_eq!(settled.get(name, &outcome("0", "leaked")), 0.0);
    assert_eq!(settled.get(name, &outcome("0", "handed_back")), 0.0);
    assert_eq!(settled.get(name, &outcome("1", "dropped")), 0.0);
    assert_eq!(settled.get(name, &outcome("1", "leaked")), 1.0);
    assert_eq!(settled.get(name, &outcome("1", "handed_back")), 0.0);
    assert_eq!(settled.get(pushed, &labels_zero), 2.0);
    assert_eq!(settled.get(pending, &labels_zero), 0.0);
    assert_eq!(
        settled.get("device_events_drop_queue_queued", &labels_one),
        0.0
    );
}

#[test]
fn a_profiler_publishes_its_events() {
    let recorder = recorder();
    let stream = HostStream::new().unwrap();
    let profiler = EventProfiler::<Host>::new();
    for _ in 0..3 {
        let start = profiler.start(stream.handle()).unwrap();
        profiler
            .stop(start, stream.handle())
            .unwrap()
            .wait_sync()
            .unwrap();
    }
    // One measurement started: of the two events made, one is idle.
    let _started = profiler.start(stream.handle()).unwrap();
    let published = ProfilerMetrics::new(&[("device", "0")]);
    for publish in ["first", "second"] {
        let scraped = scrape(&recorder, || published.publish(&profiler.stats()));
        let created = "device_events_profiler_events_created_total";
        assert_eq!(scraped.kind(created), "counter");
        let made = scraped.get(created, &[("device", "0")]);
        assert_eq!(made, 2.0, "{publish} publish");
        let pooled = "device_events_profiler_events_pooled";
        assert_eq!(scraped.kind(pooled), "gauge");
        assert_eq!(
            scraped.get(pooled, &[("device", "0")]),
            1.0,
            "{publish} publish"
        );
    }
}

#[test]
fn described_series_have_help_and_nothing_is_published_in_microseconds() {
    let recorder = recorder();
    let waiter = Waiter::builder().build();
    let published = WaiterMetrics::new(&[("waiter", "help")]);
    let scraped = scrape(&recorder, || published.publish(&waiter.stats()));
    for name in scraped.types.keys() {
        assert!(name.starts_with("device_events_"), "{name}");
        assert!(!name.contains("micro") && !name.contains("nanos"), "{name}");
        assert!(
            scraped.text.contains(&format!("# HELP {name} ")),
            "no help for {name}:\n{}",
            scraped.text
        );
        assert_eq!(
            name.ends_with("_total"),
            scraped.kind(name) == "counter",
            "{name}: counters, and only they, end in _total"
        );
    }
    waiter.shutdown();
}
