//! Scenarios 3, 4 and 5: what a ready await, a fence and an idle wait cost.

use std::time::{Duration, Instant};

use device_events::{Event, EventFlags, Waiter};

use crate::measure::{process_cpu, process_threads, Clock, Stamps};
use crate::report::{Metric, Scenario, Table};
use crate::rig::Rig;
use crate::settings::{runtime, Settings};
use crate::strategies::{self, Pending, Strategy, Waiters, ALL};

/// Scenario 3's rows, read by the targets.
pub const READY_AWAIT: &str = "await (first poll, ready)";
pub const READY_WAIT_SYNC: &str = "wait_sync";
/// Scenario 4's rows, read by the targets.
pub const POOLED_FENCE: &str = "fence in a steady loop, pooled (record + drop)";
pub const UNPOOLED_FENCE: &str = "unpooled (Event::new + record + drop)";

/// Scenario 3: awaiting fences already reached, against `wait_sync` and a
/// bare query on the same kind of fence.
pub fn ready_fence<R: Rig>(rig: &R, settings: &Settings) -> Table {
    let mut table = Table::new(Scenario::ReadyFence, rig.name(), &[Metric::NsPerOp]);
    let waiter = Waiter::builder().build();
    let fences = |count: usize| {
        let fences: Vec<_> = (0..count).map(|_| rig.fence(0)).collect();
        rig.drain();
        fences
    };
    let per_op =
        |started: Instant, count: usize| started.elapsed().as_nanos() as f64 / count as f64;
    let count = settings.ready;

    let batch = fences(count);
    let started = Instant::now();
    for fence in batch {
        strategies::await_ready(&waiter, fence);
    }
    table.row(READY_AWAIT, vec![per_op(started, count)]);

    let batch = fences(count);
    let started = Instant::now();
    for fence in batch {
        fence.wait_sync().expect("fence");
    }
    table.row(READY_WAIT_SYNC, vec![per_op(started, count)]);

    let batch = fences(count);
    let started = Instant::now();
    for fence in &batch {
        assert!(fence.is_complete().expect("fence"));
    }
    table.row("is_complete (query only)", vec![per_op(started, count)]);
    drop(batch);
    table.notes.push(format!(
        "await and wait_sync consume the fence (its event is destroyed); the query does not; {count} fences each; threads handed off: {}",
        waiter.peak_threads()
    ));
    table
}

/// Scenario 4: what a fence costs to create and record, and to drop. A
/// steady loop (fence, drop, fence, ...) takes its events from the stream's
/// (or context's) pool; the unpooled path creates and destroys one each
/// time. Both loops run interleaved in rounds, so noise hits them alike.
pub fn fence_cost<R: Rig>(rig: &R, settings: &Settings) -> Table {
    let mut table = Table::new(Scenario::FenceCost, rig.name(), &[Metric::NsPerFence]);
    let count = settings.ready;
    rig.drain();
    let started = Instant::now();
    let fences: Vec<_> = (0..count).map(|_| rig.fence(0)).collect();
    table.row(
        "EventFence::new, all kept (create + record)",
        vec![started.elapsed().as_nanos() as f64 / count as f64],
    );
    rig.drain();
    let started = Instant::now();
    drop(fences);
    table.row(
        "drop of those (back to the pool, or destroyed)",
        vec![started.elapsed().as_nanos() as f64 / count as f64],
    );
    rig.drain();
    let rounds = 10;
    let per_round = count / rounds;
    let (mut pooled, mut unpooled) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let started = Instant::now();
        for _ in 0..per_round {
            drop(rig.fence(0));
        }
        pooled += started.elapsed();
        rig.drain();
        let started = Instant::now();
        for _ in 0..per_round {
            let event = Event::<R::Api>::new(rig.handle(0), EventFlags::FENCE).expect("event");
            event.record(rig.handle(0)).expect("record");
        }
        unpooled += started.elapsed();
        rig.drain();
    }
    let per_fence = |total: Duration| total.as_nanos() as f64 / (rounds * per_round) as f64;
    table.row(POOLED_FENCE, vec![per_fence(pooled)]);
    table.row(UNPOOLED_FENCE, vec![per_fence(unpooled)]);
    table
}

/// Scenario 5: CPU burned while awaits pend on work that has not finished.
pub fn idle_cpu<R: Rig>(rig: &R, settings: &Settings, clock: Clock) -> Table {
    let mut table = Table::new(
        Scenario::IdleCpu,
        rig.name(),
        &[Metric::CpuPercentOfCore, Metric::Threads],
    );
    let streams = rig.streams().min(4);
    table.notes.push(format!(
        "{} awaits pending on {streams} streams for {:?}",
        settings.idle_waits, settings.idle_window
    ));
    // The watcher's row too: its list empties as each wait's window ends.
    for strategy in ALL.into_iter().chain([Strategy::AwaitWatching]) {
        rig.drain();
        let runtime = runtime();
        let waiters = Waiters::new();
        let hold = settings.idle_window + Duration::from_millis(500);
        let (ends, wakes, releases) = (
            Stamps::new(settings.idle_waits),
            Stamps::new(settings.idle_waits),
            Stamps::new(streams),
        );
        let baseline = process_threads();
        for stream in 0..streams {
            rig.work(stream, hold, &releases, stream);
        }
        let fences = (0..settings.idle_waits)
            .map(|index| {
                let stream = index % streams;
                rig.work(stream, Duration::ZERO, &ends, index);
                Pending {
                    index,
                    stream,
                    fence: rig.fence(stream),
                }
            })
            .collect();
        let finish =
            strategies::start(strategy, &runtime, &waiters, fences, (&ends, &wakes), clock);
        // Let hand-offs settle before measuring the quiet window.
        std::thread::sleep(Duration::from_millis(100));
        let cpu = process_cpu();
        let threads = process_threads().saturating_sub(baseline);
        std::thread::sleep(settings.idle_window);
        let burned = process_cpu().saturating_sub(cpu);
        finish();
        table.row(
            strategy.name(),
            vec![
                burned.as_secs_f64() / settings.idle_window.as_secs_f64() * 100.0,
                threads as f64,
            ],
        );
        waiters.shutdown();
    }
    table
}
