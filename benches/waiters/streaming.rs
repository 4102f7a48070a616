//! Scenario 8: streams that finish work item after item, as kernels end one
//! after another on a GPU stream. Each item has a fence after it, awaited by
//! its own task, so the waits resolve in a steady trickle rather than all at
//! once: how soon each task runs after its item ends, and what that costs.
//!
//! The shapes (full run; `--quick` runs fewer, shorter items):
//!
//! - 8a, 8b, 8c: 16, 16 and 8 streams of 625, 625 and 200 items of 10 us,
//!   100 us and 1 ms.
//! - 8d: one stream, six 100 ms items, then one hundred 1 ms items (quick:
//!   two 20 ms items, then twenty 1 ms items). The latencies are the 1 ms
//!   items' only: a waiter that still expects 100 ms items (a stale
//!   prediction) holds their waits too long; CPU is over every await.
//! - 8e: four streams of 150 items, each 0.5 to 4 ms long, uniformly at
//!   random from a fixed seed, the same in every run (quick: 30 items).
//!
//! Rows: this crate's default waiter, with `watchers(0)` and with
//! `watchers(1)` (so the watcher shows where the default has none),
//! spawn_blocking and the hand-off floors; `--strategies` picks any of
//! scenario 1's instead. Besides latency and CPU per await, the watcher
//! thread's own CPU per await (`{prefix}-watcher`, read from `/proc`).

use std::time::{Duration, Instant};

use crate::measure::{
    latencies, median_run, process_cpu, process_threads, quantile_us, threads_cpu, turn_order,
    Clock, SplitMix64, Stamps, ThreadSampler, SAMPLER_THREAD,
};
use crate::report::{Metric, Scenario, Table};
use crate::rig::Rig;
use crate::settings::{runtime, Settings};
use crate::strategies::{self, Pending, Strategy, Waiters, SINGLE, STREAMING};

/// One shape: streams each running its items back to back.
#[derive(Clone, Debug)]
pub struct Shape {
    pub scenario: Scenario,
    /// Each stream's items' lengths, in order; as many items on every
    /// stream.
    pub lengths: Vec<Vec<Duration>>,
    /// Items at the start of each stream whose latencies are left out (8d's
    /// long items); their waits still count for CPU.
    pub unmeasured: usize,
    /// The items in words, for the table's note.
    pub describe: String,
}

impl Shape {
    /// `streams` streams of `items` items of `micros` each.
    fn even(scenario: Scenario, streams: usize, items: usize, micros: u64) -> Self {
        let item = Duration::from_micros(micros);
        Self {
            scenario,
            lengths: vec![vec![item; items]; streams],
            unmeasured: 0,
            describe: format!("{streams} streams x {items} items of {item:?}"),
        }
    }

    /// One stream: `long` items of `long_ms`, then `short` items of 1 ms;
    /// latencies of the 1 ms items only.
    fn long_then_short(long: usize, long_ms: u64, short: usize) -> Self {
        let (long_item, short_item) = (Duration::from_millis(long_ms), Duration::from_millis(1));
        let mut items = vec![long_item; long];
        items.extend(std::iter::repeat_n(short_item, short));
        Self {
            scenario: Scenario::StreamingLongThenShort,
            lengths: vec![items],
            unmeasured: long,
            describe: format!(
                "1 stream: {long} items of {long_item:?}, then {short} of {short_item:?} \
                 (latencies: the {short_item:?} items only)"
            ),
        }
    }

    /// `streams` streams of `items` items each 0.5 to 4 ms long, uniformly
    /// at random from a fixed seed.
    fn varied(streams: usize, items: usize) -> Self {
        let (min, max) = (500u64, 4_000u64);
        let mut random = SplitMix64(0x8e5e_ed00_0000_0008);
        let lengths = (0..streams)
            .map(|_| {
                (0..items)
                    .map(|_| Duration::from_micros(min + random.next() % (max - min + 1)))
                    .collect()
            })
            .collect();
        Self {
            scenario: Scenario::StreamingVaried,
            lengths,
            unmeasured: 0,
            describe: format!(
                "{streams} streams x {items} items of {:?} to {:?} (uniform, fixed seed)",
                Duration::from_micros(min),
                Duration::from_micros(max)
            ),
        }
    }

    fn items(&self) -> usize {
        self.lengths.first().map_or(0, Vec::len)
    }
}

/// The shapes of a run: 8a to 8e.
pub fn shapes(quick: bool) -> Vec<Shape> {
    if quick {
        vec![
            Shape::even(Scenario::Streaming10Us, 4, 50, 10),
            Shape::even(Scenario::Streaming100Us, 4, 50, 100),
            Shape::even(Scenario::Streaming1Ms, 4, 20, 1_000),
            Shape::long_then_short(2, 20, 20),
            Shape::varied(4, 30),
        ]
    } else {
        vec![
            Shape::even(Scenario::Streaming10Us, 16, 625, 10),
            Shape::even(Scenario::Streaming100Us, 16, 625, 100),
            Shape::even(Scenario::Streaming1Ms, 8, 200, 1_000),
            Shape::long_then_short(6, 100, 100),
            Shape::varied(4, 150),
        ]
    }
}

/// Scenario 8 for one shape: every strategy, the two floors included, taking
/// turns rep by rep (in a balanced order: [`turn_order`]); each figure the
/// median over the reps.
pub fn streaming<R: Rig>(
    rig: &R,
    shape: &Shape,
    settings: &Settings,
    clock: Clock,
) -> (Table, Vec<(String, Vec<u64>)>) {
    let streams = shape.lengths.len().min(rig.streams());
    let mut table = Table::new(
        shape.scenario,
        rig.name(),
        &[
            Metric::P50Us,
            Metric::P99Us,
            Metric::CpuUsPerAwait,
            Metric::ProcessCpuUsPerAwait,
            Metric::WatcherCpuUsPerAwait,
            Metric::PeakThreads,
        ],
    );
    let reps = settings.reps;
    table.notes.push(format!(
        "{}, back to back, a fence after each, each awaited by its own task \
         (tokio, 2 workers); latency: the task runs minus its item's end; CPU: from the first wait \
         to the last wake, per await: the process's, less the bench's thread sampler{}; \
         watcher CPU: the waiter's watcher thread's, per await ('-': no waiter of this crate); \
         median of {reps} runs",
        shape.describe,
        match rig.device_threads() {
            Some(prefix) => format!(
                " and ('CPU us per await') its {prefix}* threads, which stand in for the device \
                 and whose work a GPU's host does not pay for"
            ),
            None => String::new(),
        }
    ));
    if streams < shape.lengths.len() {
        table.notes.push(format!(
            "the rig has {streams} streams: the first {streams} of the shape's {} ran",
            shape.lengths.len()
        ));
    }
    let mut strategies = settings.pick_or(&STREAMING, &SINGLE);
    strategies.retain(|&strategy| strategy != Strategy::OneHop || rig.work_stamps_its_end());
    let mut all_runs: Vec<Vec<(Vec<f64>, Vec<u64>)>> =
        strategies.iter().map(|_| Vec::new()).collect();
    for rep in 0..reps {
        for turn in turn_order(strategies.len(), rep) {
            let run = once(
                rig,
                shape,
                streams,
                strategies[turn],
                clock,
                &mut table.notes,
            );
            all_runs[turn].push(run);
        }
    }
    let mut series = Vec::new();
    for (&strategy, runs) in strategies.iter().zip(all_runs) {
        // The median of each figure, and the latencies of the median run by
        // p50 (figure 0).
        let (figures, latencies) = median_run(runs, 0);
        table.row(strategy.name(), figures);
        series.push((strategy.name().to_owned(), latencies));
    }
    (table, series)
}

/// One run of one strategy: its figures (p50, p99, CPU per await less the
/// device's, process CPU per await, watcher CPU per await, peak threads) and
/// its sorted latencies (of the measured items).
fn once<R: Rig>(
    rig: &R,
    shape: &Shape,
    streams: usize,
    strategy: Strategy,
    clock: Clock,
    notes: &mut Vec<String>,
) -> (Vec<f64>, Vec<u64>) {
    rig.drain();
    let threads_before = process_threads();
    let runtime = runtime();
    let waiters = Waiters::new();
    let items = shape.items();
    let total = streams * items;
    let (ends, wakes, releases) = (Stamps::new(total), Stamps::new(total), Stamps::new(streams));
    // Held until every wait has started, so the items all end after it.
    let hold = Duration::from_millis(if total > 2_000 { 300 } else { 100 });
    for stream in 0..streams {
        rig.work(stream, hold, &releases, stream);
    }
    let mut fences = Vec::with_capacity(total);
    for item in 0..items {
        for (stream, lengths) in shape.lengths.iter().take(streams).enumerate() {
            let index = item * streams + stream;
            rig.work(stream, lengths[item], &ends, index);
            fences.push(Pending {
                index,
                stream,
                fence: rig.fence(stream),
            });
        }
    }
    let baseline = process_threads();
    let sampler = ThreadSampler::start();
    let device = rig.device_threads();
    let device_cpu = || device.map_or(Duration::ZERO, threads_cpu);
    let watcher = Waiters::watcher_thread(strategy);
    let watcher_cpu = || watcher.as_deref().map(threads_cpu);
    // Read before the process's CPU at the start and after it at the end, so
    // that reading `/proc` falls outside the window.
    let watcher_before = watcher_cpu();
    let device_before = device_cpu();
    let cpu = process_cpu();
    let setup = Instant::now();
    let finish = strategies::start(strategy, &runtime, &waiters, fences, (&ends, &wakes), clock);
    let setup = setup.elapsed();
    finish();
    // The sampler reads `/proc` every millisecond: the benchmark's cost,
    // not the strategy's.
    let cpu = process_cpu()
        .saturating_sub(cpu)
        .saturating_sub(threads_cpu(SAMPLER_THREAD));
    let waiting_cpu = cpu.saturating_sub(device_cpu().saturating_sub(device_before));
    // Before the shutdown, while the watcher thread (if it started) is there.
    let watcher_cpu = watcher_cpu()
        .zip(watcher_before)
        .map(|(after, before)| after.saturating_sub(before));
    let peak = sampler.finish().saturating_sub(baseline + 1);
    let release = (0..streams).map(|s| releases.get(s)).min().unwrap_or(0);
    let started = (0..total).map(|i| ends.get(i)).min().unwrap_or(0);
    if setup > hold || started < release {
        notes.push(format!(
            "{}: starting the waits took {setup:?}, longer than the {hold:?} hold: some items ended first",
            strategy.name()
        ));
    }
    let sorted = latencies(&ends, &wakes, shape.unmeasured * streams);
    waiters.shutdown();
    drop(runtime);
    // A strategy's threads (ten thousand, for a thread per wait) are gone
    // before the next strategy's run starts, not exiting beside it.
    let settled = Instant::now();
    while process_threads() > threads_before && settled.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let figures = vec![
        quantile_us(&sorted, 0.5),
        quantile_us(&sorted, 0.99),
        waiting_cpu.as_secs_f64() * 1e6 / total as f64,
        cpu.as_secs_f64() * 1e6 / total as f64,
        watcher_cpu.map_or(f64::NAN, |cpu| cpu.as_secs_f64() * 1e6 / total as f64),
        peak as f64,
    ];
    (figures, sorted)
}
