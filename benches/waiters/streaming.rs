//! Scenario 8: streams that finish work item after item, as kernels end one
//! after another on a GPU stream. Each item has a fence after it, awaited by
//! its own task, so the waits resolve in a steady trickle rather than all at
//! once: how soon each task runs after its item ends, and what that costs.

use std::time::{Duration, Instant};

use crate::measure::{
    latencies, median_run, process_cpu, process_threads, quantile_us, threads_cpu, Clock, Stamps,
    ThreadSampler, SAMPLER_THREAD,
};
use crate::report::{Metric, Scenario, Table};
use crate::rig::Rig;
use crate::settings::{runtime, Settings};
use crate::strategies::{self, Pending, Strategy, Waiters, SINGLE};

/// One shape: `streams` streams, each running `items` items of `item`
/// length back to back.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub scenario: Scenario,
    pub streams: usize,
    pub items: usize,
    pub item: Duration,
}

/// The shapes of a full run: short, medium and long items.
pub fn shapes(quick: bool) -> [Shape; 3] {
    let shape = |scenario, streams, items, micros| Shape {
        scenario,
        streams,
        items,
        item: Duration::from_micros(micros),
    };
    if quick {
        [
            shape(Scenario::Streaming10Us, 4, 50, 10),
            shape(Scenario::Streaming100Us, 4, 50, 100),
            shape(Scenario::Streaming1Ms, 4, 20, 1_000),
        ]
    } else {
        [
            shape(Scenario::Streaming10Us, 16, 625, 10),
            shape(Scenario::Streaming100Us, 16, 625, 100),
            shape(Scenario::Streaming1Ms, 8, 200, 1_000),
        ]
    }
}

/// Scenario 8 for one shape: every strategy, the two floors included, taking
/// turns rep by rep; each figure the median over the reps.
pub fn streaming<R: Rig>(
    rig: &R,
    shape: Shape,
    settings: &Settings,
    clock: Clock,
) -> (Table, Vec<(String, Vec<u64>)>) {
    let streams = shape.streams.min(rig.streams());
    let mut table = Table::new(
        shape.scenario,
        rig.name(),
        &[
            Metric::P50Us,
            Metric::P99Us,
            Metric::CpuUsPerAwait,
            Metric::ProcessCpuUsPerAwait,
            Metric::PeakThreads,
        ],
    );
    let reps = settings.reps;
    table.notes.push(format!(
        "{streams} streams x {} items of {:?} back to back, a fence after each, each awaited by its own task \
         (tokio, 2 workers); latency: the task runs minus its item's end; CPU: from the first wait \
         to the last wake, per await: the process's, less the bench's thread sampler{}; median of {reps} runs",
        shape.items,
        shape.item,
        match rig.device_threads() {
            Some(prefix) => format!(
                " and ('CPU us per await') its {prefix}* threads, which stand in for the device \
                 and whose work a GPU's host does not pay for"
            ),
            None => String::new(),
        }
    ));
    let mut strategies = settings.pick(&SINGLE);
    strategies.retain(|&strategy| strategy != Strategy::OneHop || rig.work_stamps_its_end());
    let mut all_runs: Vec<Vec<(Vec<f64>, Vec<u64>)>> =
        strategies.iter().map(|_| Vec::new()).collect();
    for _ in 0..reps {
        for (&strategy, runs) in strategies.iter().zip(&mut all_runs) {
            runs.push(once(rig, shape, streams, strategy, clock, &mut table.notes));
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
/// device's, process CPU per await, peak threads) and its sorted latencies.
fn once<R: Rig>(
    rig: &R,
    shape: Shape,
    streams: usize,
    strategy: Strategy,
    clock: Clock,
    notes: &mut Vec<String>,
) -> (Vec<f64>, Vec<u64>) {
    rig.drain();
    let threads_before = process_threads();
    let runtime = runtime();
    let waiters = Waiters::new();
    let total = streams * shape.items;
    let (ends, wakes, releases) = (Stamps::new(total), Stamps::new(total), Stamps::new(streams));
    // Held until every wait has started, so the items all end after it.
    let hold = Duration::from_millis(if total > 2_000 { 300 } else { 100 });
    for stream in 0..streams {
        rig.work(stream, hold, &releases, stream);
    }
    let mut fences = Vec::with_capacity(total);
    for item in 0..shape.items {
        for stream in 0..streams {
            let index = item * streams + stream;
            rig.work(stream, shape.item, &ends, index);
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
    // Read before the process's CPU at the start and after it at the end, so
    // that reading `/proc` falls outside the window.
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
    let peak = sampler.finish().saturating_sub(baseline + 1);
    let release = (0..streams).map(|s| releases.get(s)).min().unwrap_or(0);
    let started = (0..total).map(|i| ends.get(i)).min().unwrap_or(0);
    if setup > hold || started < release {
        notes.push(format!(
            "{}: starting the waits took {setup:?}, longer than the {hold:?} hold: some items ended first",
            strategy.name()
        ));
    }
    let sorted = latencies(&ends, &wakes, 0);
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
        peak as f64,
    ];
    (figures, sorted)
}
