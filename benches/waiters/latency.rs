//! Scenarios 1 and 2: how soon a wait wakes after its work ends, one at a
//! time and many pending at once.

use std::time::{Duration, Instant};

use crate::measure::{
    latencies, median_run, process_cpu, process_threads, quantile_us, threads_cpu, turn_order,
    Clock, Stamps, ThreadSampler,
};
use crate::report::{Metric, Scenario, Table};
use crate::rig::Rig;
use crate::settings::{runtime, Settings};
use crate::strategies::{self, Pending, Strategy, Waiters, SINGLE};

/// Scenario 1: one stream, work of known length, a fence; wake latency, and
/// the watcher thread's CPU per await of this crate's waiters.
///
/// The strategies take turns round by round (each with its own runtime), in
/// a balanced order ([`turn_order`]), so a noisy stretch of the machine, or
/// the aftermath of the turn before, hits all of them alike and the ratios
/// compare like with like.
pub fn single_wait<R: Rig>(
    rig: &R,
    settings: &Settings,
    clock: Clock,
) -> (Table, Vec<(String, Vec<u64>)>) {
    let mut table = Table::new(
        Scenario::SingleWait,
        rig.name(),
        &[
            Metric::P50Us,
            Metric::P99Us,
            Metric::MeanUs,
            Metric::WatcherCpuUsPerAwait,
        ],
    );
    table.notes.push(
        "watcher CPU: the waiter's watcher thread's over every round, warm-up included, \
         per await ('-': no waiter of this crate)"
            .to_owned(),
    );
    let mut strategies = settings.pick_or(&SINGLE, &strategies::nameable());
    strategies.retain(|&strategy| strategy != Strategy::OneHop || rig.work_stamps_its_end());
    let runtimes: Vec<_> = strategies.iter().map(|_| runtime()).collect();
    let waiters = Waiters::new();
    let total = settings.warmup + settings.rounds;
    let stamps: Vec<_> = strategies
        .iter()
        .map(|_| (Stamps::new(total), Stamps::new(total)))
        .collect();
    for index in 0..total {
        for turn in turn_order(strategies.len(), index) {
            let (strategy, runtime) = (&strategies[turn], &runtimes[turn]);
            let (ends, wakes) = &stamps[turn];
            rig.work(0, settings.work, ends, index);
            let pending = Pending {
                index,
                stream: 0,
                fence: rig.fence(0),
            };
            strategies::wait_one(*strategy, runtime, &waiters, pending, (ends, wakes), clock);
        }
    }
    // Before the shutdown, while the watcher threads (those that started)
    // are there.
    let watcher_cpu: Vec<f64> = strategies
        .iter()
        .map(|&strategy| {
            Waiters::watcher_thread(strategy).map_or(f64::NAN, |name| {
                threads_cpu(&name).as_secs_f64() * 1e6 / total as f64
            })
        })
        .collect();
    waiters.shutdown();
    let mut series = Vec::new();
    for ((strategy, (ends, wakes)), watcher_cpu) in strategies.iter().zip(&stamps).zip(watcher_cpu)
    {
        let sorted = latencies(ends, wakes, settings.warmup);
        let mean = sorted.iter().sum::<u64>() as f64 / sorted.len() as f64 / 1_000.0;
        table.row(
            strategy.name(),
            vec![
                quantile_us(&sorted, 0.5),
                quantile_us(&sorted, 0.99),
                mean,
                watcher_cpu,
            ],
        );
        series.push((strategy.name().to_owned(), sorted));
    }
    (table, series)
}

/// Scenario 2: many awaits pending at once across streams, released together.
pub fn many_pending<R: Rig>(
    rig: &R,
    (streams, per_stream): (usize, usize),
    hold: Duration,
    reps: usize,
    strategies: &[Strategy],
    clock: Clock,
) -> (Table, Vec<(String, Vec<u64>)>) {
    let scenario = if streams * per_stream >= 100_000 {
        Scenario::ManyPendingLarge
    } else {
        Scenario::ManyPending
    };
    let mut table = Table::new(
        scenario,
        rig.name(),
        &[
            Metric::AllResolvedMs,
            Metric::P50Us,
            Metric::P99Us,
            Metric::PeakThreads,
            Metric::CpuMs,
        ],
    );
    table.notes.push(format!(
        "{} awaits on {streams} streams, released together after {hold:?}; median of {reps} runs",
        streams * per_stream
    ));
    let mut series = Vec::new();
    // The strategies take turns, rep by rep, in a balanced order, so a noisy
    // stretch of the machine hits each alike.
    let mut all_runs: Vec<Vec<(Vec<f64>, Vec<u64>)>> =
        strategies.iter().map(|_| Vec::new()).collect();
    for rep in 0..reps {
        for turn in turn_order(strategies.len(), rep) {
            all_runs[turn].push(many_pending_once(
                rig,
                (streams, per_stream),
                hold,
                strategies[turn],
                clock,
                &mut table.notes,
            ));
        }
    }
    for (&strategy, runs) in strategies.iter().zip(all_runs) {
        // The median of each figure, and the latencies of the median run by
        // p50 (figure 1).
        let (figures, latencies) = median_run(runs, 1);
        table.row(strategy.name(), figures);
        series.push((strategy.name().to_owned(), latencies));
    }
    (table, series)
}

/// One run of scenario 2 for one strategy: its figures and sorted latencies.
fn many_pending_once<R: Rig>(
    rig: &R,
    (streams, per_stream): (usize, usize),
    hold: Duration,
    strategy: Strategy,
    clock: Clock,
    notes: &mut Vec<String>,
) -> (Vec<f64>, Vec<u64>) {
    rig.drain();
    let runtime = runtime();
    let waiters = Waiters::new();
    let total = streams * per_stream;
    let (ends, wakes, releases) = (Stamps::new(total), Stamps::new(total), Stamps::new(streams));
    let baseline = process_threads();
    let sampler = ThreadSampler::start();
    let cpu = process_cpu();
    let setup = Instant::now();
    for stream in 0..streams {
        rig.work(stream, hold, &releases, stream);
    }
    let mut fences = Vec::with_capacity(total);
    for round in 0..per_stream {
        for stream in 0..streams {
            let index = round * streams + stream;
            rig.work(stream, Duration::ZERO, &ends, index);
            fences.push(Pending {
                index,
                stream,
                fence: rig.fence(stream),
            });
        }
    }
    let finish = strategies::start(strategy, &runtime, &waiters, fences, (&ends, &wakes), clock);
    let setup = setup.elapsed();
    finish();
    let cpu = process_cpu().saturating_sub(cpu);
    // The sampler's own thread is not the strategy's.
    let peak = sampler.finish().saturating_sub(baseline + 1);
    if setup > hold.mul_f64(0.8) {
        notes.push(format!(
            "{}: setting up took {setup:?}, close to the hold: not all waits were pending at once",
            strategy.name()
        ));
    }
    let release = (0..streams).map(|s| releases.get(s)).min().unwrap_or(0);
    let last = (0..total).map(|i| wakes.get(i)).max().unwrap_or(0);
    let sorted = latencies(&ends, &wakes, 0);
    waiters.shutdown();
    let figures = vec![
        last.saturating_sub(release) as f64 / 1e6,
        quantile_us(&sorted, 0.5),
        quantile_us(&sorted, 0.99),
        peak as f64,
        cpu.as_secs_f64() * 1e3,
    ];
    (figures, sorted)
}
