//! Scenarios 6 and 7: throughput with every executor worker busy, as in an
//! inference service whose tasks create and await fences from every worker.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use device_events::Waiter;
use futures::FutureExt;

use crate::measure::{process_cpu, turn_order};
use crate::report::{Metric, Scenario, Table};
use crate::rig::Rig;
use crate::strategies::Strategy;

/// Scenario 7's ratio row, read by the targets.
pub const SCALING: &str = "scaling: all / (workers x one)";

/// How long each strategy loops, per round, and how many rounds (taken in
/// turns, so a noisy stretch of the machine hits every strategy alike).
pub struct Loops {
    pub tasks: usize,
    pub streams: usize,
    pub round: Duration,
    pub rounds: usize,
}

fn workers() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Scenario 6: `tasks` tasks on every worker loop launch + fence + wait on
/// `streams` streams; awaits per second and CPU per await, per strategy.
/// With as many tasks as streams (scenario 6b), each stream's lane empties
/// after every await and starts again with the next: the waiter's
/// scheduler lock is taken twice per await, which 6 (many tasks per
/// stream, lanes that rarely empty) mostly avoids.
pub fn loop_awaits<R: Rig>(rig: &Arc<R>, loops: &Loops) -> Table {
    let workers = workers();
    let streams = loops.streams.min(rig.streams());
    let scenario = if loops.tasks == streams {
        Scenario::OneTaskPerStream
    } else {
        Scenario::BusyWorkers
    };
    let mut table = Table::new(
        scenario,
        rig.name(),
        &[Metric::AwaitsPerSecond, Metric::CpuUsPerAwait],
    );
    table.notes.push(format!(
        "{} tasks on {workers} workers loop launch + fence + wait on {streams} streams; {} rounds of {:?} per strategy, in turns",
        loops.tasks, loops.rounds, loops.round
    ));
    let strategies = [
        Strategy::Await,
        Strategy::SpawnBlocking,
        Strategy::QueryYield,
    ];
    let mut totals = vec![(0u64, Duration::ZERO, Duration::ZERO); strategies.len()];
    for round in 0..loops.rounds {
        for turn in turn_order(strategies.len(), round) {
            let (count, elapsed, cpu) = one_round(rig, strategies[turn], loops, workers, streams);
            let total = &mut totals[turn];
            total.0 += count;
            total.1 += elapsed;
            total.2 += cpu;
        }
    }
    for (strategy, (count, elapsed, cpu)) in strategies.iter().zip(totals) {
        let count = count.max(1) as f64;
        table.row(
            strategy.name(),
            vec![
                count / elapsed.as_secs_f64(),
                cpu.as_secs_f64() * 1e6 / count,
            ],
        );
    }
    table
}

fn one_round<R: Rig>(
    rig: &Arc<R>,
    strategy: Strategy,
    loops: &Loops,
    workers: usize,
    streams: usize,
) -> (u64, Duration, Duration) {
    let runtime = runtime(workers);
    let waiter = Waiter::builder().build();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    rig.drain();
    let cpu = process_cpu();
    let started = Instant::now();
    let tasks: Vec<_> = (0..loops.tasks)
        .map(|task| {
            let (rig, waiter, stop, count) =
                (rig.clone(), waiter.clone(), stop.clone(), count.clone());
            let stream = task % streams;
            runtime.spawn(async move {
                let mut done = 0;
                while !stop.load(Ordering::Relaxed) {
                    rig.launch(stream, Duration::ZERO);
                    let fence = rig.fence(stream);
                    let result = match strategy {
                        Strategy::Await => waiter.wait(fence).await,
                        Strategy::SpawnBlocking => {
                            tokio::task::spawn_blocking(move || fence.wait_sync())
                                .await
                                .expect("spawn_blocking")
                        }
                        _ => loop {
                            match fence.is_complete() {
                                Ok(true) => break Ok(()),
                                Ok(false) => tokio::task::yield_now().await,
                                Err(err) => break Err(err),
                            }
                        },
                    };
                    result.expect("fence");
                    done += 1;
                }
                count.fetch_add(done, Ordering::Relaxed);
            })
        })
        .collect();
    std::thread::sleep(loops.round);
    stop.store(true, Ordering::Relaxed);
    runtime.block_on(async {
        for task in tasks {
            task.await.expect("task");
        }
    });
    let elapsed = started.elapsed();
    let cpu = process_cpu().saturating_sub(cpu);
    waiter.shutdown();
    drop(runtime);
    (count.load(Ordering::Relaxed), elapsed, cpu)
}

/// Scenario 7: ready fences awaited in a loop, by one task on one worker,
/// then by one task per worker on every worker (each on its own stream):
/// whether the first poll's path scales with the workers.
pub fn ready_scaling<R: Rig>(rig: &Arc<R>, loops: &Loops) -> Table {
    let workers = workers().min(rig.streams());
    let mut table = Table::new(
        Scenario::ReadyScaling,
        rig.name(),
        &[Metric::AwaitsPerSecond],
    );
    table.notes.push(format!(
        "a loop of fence + await on an idle stream; {} rounds of {:?} each, in turns",
        loops.rounds, loops.round
    ));
    let (mut one, mut all) = (0.0, 0.0);
    for _ in 0..loops.rounds {
        one += ready_round(rig, 1, loops.round);
        all += ready_round(rig, workers, loops.round);
    }
    let rounds = loops.rounds as f64;
    table.row("one worker", vec![one / rounds]);
    table.row(&format!("{workers} workers"), vec![all / rounds]);
    table.row(SCALING, vec![all / (workers as f64 * one)]);
    table
}

fn ready_round<R: Rig>(rig: &Arc<R>, workers: usize, round: Duration) -> f64 {
    let runtime = runtime(workers);
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    rig.drain();
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|stream| {
            let (rig, stop, count) = (rig.clone(), stop.clone(), count.clone());
            runtime.spawn(async move {
                let mut done = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        // `fence.wait()`: the global waiter, as `.await` uses.
                        rig.fence(stream)
                            .wait()
                            .now_or_never()
                            .expect("an idle stream's fence is ready")
                            .expect("fence");
                    }
                    done += 64;
                    tokio::task::yield_now().await;
                }
                count.fetch_add(done, Ordering::Relaxed);
            })
        })
        .collect();
    std::thread::sleep(round);
    stop.store(true, Ordering::Relaxed);
    runtime.block_on(async {
        for task in tasks {
            task.await.expect("task");
        }
    });
    let elapsed = started.elapsed();
    count.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64()
}
