//! With the `serde` feature, every stats type serializes, under the field
//! names the docs give (what a metrics exporter keys on).
#![cfg(feature = "serde")]

mod common;

use common::Gate;
use device_events::drop_queue::DropQueue;
use device_events::host::{Host, HostStream};
use device_events::{AnyProfiler, AnyStream, EventFence, Waiter};
use serde_json::{json, Value};
use std::time::Duration;

fn keys(value: &Value) -> Vec<&str> {
    let mut keys: Vec<&str> = value
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    keys
}

#[test]
fn waiter_stats_and_stuck_waits_serialize() {
    let waiter = Waiter::builder()
        .stuck_after(Duration::from_millis(1))
        .build();
    let stream = HostStream::new().unwrap();
    let gate = Gate::hold(&stream);
    let mut future = waiter.wait(stream.fence());
    let pending = futures::executor::block_on(futures::future::poll_immediate(&mut future));
    assert!(pending.is_none(), "the stream is held");
    common::eventually(Duration::from_secs(30), "listed stuck", || {
        !waiter.stuck().is_empty()
    });
    let stuck = serde_json::to_value(&waiter.stuck()[0]).unwrap();
    assert_eq!(
        keys(&stuck),
        ["behind", "given_up", "stream", "stream_id", "waited"]
    );
    assert_eq!(stuck["behind"], 0);
    assert_eq!(stuck["given_up"], false);
    // As serde writes a `Duration`, which `StuckWait::waited` documents.
    assert_eq!(keys(&stuck["waited"]), ["nanos", "secs"]);
    gate.open();
    futures::executor::block_on(future).unwrap();
    let stats = serde_json::to_value(waiter.stats()).unwrap();
    assert_eq!(
        keys(&stats),
        [
            "cancelled",
            "cancelled_held",
            "failed",
            "handed_off",
            "peak_threads",
            "pending",
            "ready_at_first_poll",
            "resolved",
            "stuck",
            "threads",
            "wake_latency",
            "watched",
            "watcher_cpu"
        ]
    );
    assert_eq!(stats["resolved"], 1);
    assert_eq!(keys(&stats["wake_latency"]), ["buckets", "sum_nanos"]);
    let buckets = stats["wake_latency"]["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), device_events::LATENCY_BUCKETS);
    assert_eq!(buckets.iter().filter_map(Value::as_u64).sum::<u64>(), 1);
}

#[test]
fn drop_queue_and_profiler_stats_serialize() {
    let stream = HostStream::new().unwrap();
    let queue = DropQueue::<EventFence<Host>, Vec<u8>>::new(4).unwrap();
    queue.push(stream.fence(), vec![0; 16]).unwrap();
    queue.flush();
    let stats = serde_json::to_value(queue.stats()).unwrap();
    assert_eq!(
        stats,
        json!({"pushed": 1, "dropped": 1, "leaked": 0, "handed_back": 0, "pending": 0, "queued": 0})
    );
    // `ProfilerStats`, as `EventProfiler::stats` returns it too.
    let any = AnyProfiler::new();
    let stream = AnyStream::from(stream);
    let start = any.start(&stream).unwrap();
    any.stop(start, &stream).unwrap().wait_sync().unwrap();
    assert_eq!(
        serde_json::to_value(any.stats()).unwrap(),
        json!({"created": 2, "pooled": 2})
    );
}
