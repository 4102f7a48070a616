//! This crate's `fence.await` against what users would use instead, on the
//! same fences, in one run: `spawn_blocking(wait_sync)`, a thread per wait, a
//! query-and-yield loop, and the floors: a raw thread blocked in the
//! backend's synchronize, and that thread handing each wake on (to a parked
//! thread, or to the fence's task). Scenario 8 has streams end their work
//! item after item, as kernels do on a GPU stream: 8a, 8b and 8c items of
//! 10 us, 100 us and 1 ms on many streams; 8d one stream of six 100 ms items,
//! then one hundred 1 ms items, timed over the 1 ms ones (a waiter still
//! expecting 100 ms holds them); 8e four streams of 150 items of 0.5 to 4 ms
//! from a fixed seed. `--quick` runs fewer, shorter items (8d: two 20 ms
//! items, then twenty 1 ms items).
//!
//! This crate's rows: the default waiter (`Waiter::builder().build()`, whose
//! number of watcher threads depends on the machine), `watchers(0)` (every
//! wait sleeps in the driver) and `watchers(1)` (the watcher on, wherever the
//! default has none). Scenarios 1 and 8 show each; scenario 8 also the
//! watcher thread's CPU per await.
//!
//! ```sh
//! cargo bench --bench waiters               # full run (host; CUDA too when present)
//! cargo bench --bench waiters -- --quick    # smoke run, seconds
//! cargo bench --bench waiters -- --large    # adds 100,000 awaits on 64 streams
//! cargo bench --bench waiters -- --only 8   # streams ending items one after another (8a-8e)
//! cargo bench --bench waiters -- --only 8d --strategies await_watching,await_sleeping
//! cargo bench --bench waiters -- --only 1 --strategies await_watching,await,await_sleeping
//! ```
//!
//! Prints a table per scenario with each strategy's ratio to this crate's,
//! and writes `target/bench-results/waiters.json` and latency plots (SVG).

mod costs;
mod latency;
mod measure;
mod report;
mod rig;
mod settings;
mod strategies;
mod streaming;
mod targets;
mod throughput;

use std::sync::Arc;
use std::time::{Duration, Instant};

use measure::Clock;
use report::Table;
use rig::{HostRig, Rig};
use settings::Settings;
use strategies::{Strategy, ALL};

/// Every scenario on one rig.
fn run_all<R: Rig>(shared: &Arc<R>, settings: &Settings, clock: Clock, tables: &mut Vec<Table>) {
    let rig = &**shared;
    if settings.runs("1") {
        let (table, series) = latency::single_wait(rig, settings, clock);
        let plot = report::write_latency_svg(
            &format!("latency-single-{}.svg", rig.name()),
            &format!("Single wait: wake latency, {} backend", rig.name()),
            &series,
        );
        table.print();
        println!("  plot: {}", plot.display());
        tables.push(table);
    }

    if settings.runs("2") {
        let (table, series) = latency::many_pending(
            rig,
            settings.many,
            settings.hold,
            settings.reps,
            &settings.pick(&ALL),
            clock,
        );
        let plot = report::write_latency_svg(
            &format!("latency-many-{}.svg", rig.name()),
            &format!(
                "{} pending awaits: wake latency, {} backend",
                settings.many.0 * settings.many.1,
                rig.name()
            ),
            &series,
        );
        table.print();
        println!("  plot: {}", plot.display());
        tables.push(table);
    }

    if settings.large && settings.runs("2b") {
        // A thread per wait would start 100,000 threads: left out.
        let strategies = [
            Strategy::Await,
            Strategy::AwaitSleeping,
            Strategy::SpawnBlocking,
            Strategy::QueryYield,
            Strategy::RawThread,
        ];
        let (table, _) = latency::many_pending(
            rig,
            (64, 1_563),
            Duration::from_secs(2),
            5,
            &settings.pick(&strategies),
            clock,
        );
        table.print();
        tables.push(table);
    }

    for shape in streaming::shapes(settings.quick) {
        let id = shape.scenario.id();
        if settings.runs("8") || settings.runs(id) {
            let (table, series) = streaming::streaming(rig, &shape, settings, clock);
            let plot = report::write_latency_svg(
                &format!("latency-streaming-{id}-{}.svg", rig.name()),
                &format!(
                    "{}: wake latency, {} backend",
                    shape.scenario.title(),
                    rig.name()
                ),
                &series,
            );
            table.print();
            println!("  plot: {}", plot.display());
            tables.push(table);
        }
    }

    let loops = throughput::Loops {
        tasks: if settings.quick { 32 } else { 128 },
        streams: 16,
        round: if settings.quick {
            Duration::from_millis(100)
        } else {
            Duration::from_millis(700)
        },
        rounds: if settings.quick { 1 } else { 3 },
    };
    let one_per_stream = throughput::Loops {
        tasks: loops.streams,
        ..loops
    };
    let scenarios: [(&str, &dyn Fn() -> Table); 6] = [
        ("3", &|| costs::ready_fence(rig, settings)),
        ("4", &|| costs::fence_cost(rig, settings)),
        ("5", &|| costs::idle_cpu(rig, settings, clock)),
        ("6", &|| throughput::loop_awaits(shared, &loops)),
        ("6b", &|| throughput::loop_awaits(shared, &one_per_stream)),
        ("7", &|| throughput::ready_scaling(shared, &loops)),
    ];
    for (id, scenario) in scenarios {
        if settings.runs(id) {
            let table = scenario();
            table.print();
            tables.push(table);
        }
    }
}

fn main() {
    let settings = Settings::from_args();
    let clock = Clock::new();
    let started = Instant::now();
    println!(
        "# device-events waiters benchmark ({} mode{}); {} CPUs",
        if settings.quick { "quick" } else { "full" },
        if settings.large { ", large" } else { "" },
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let mut tables = Vec::new();

    let streams = if settings.large {
        64
    } else {
        settings.many.0.max(16)
    };
    match HostRig::new(streams, clock) {
        Ok(rig) => run_all(&Arc::new(rig), &settings, clock, &mut tables),
        Err(err) => println!("host rig failed: {err}"),
    }

    #[cfg(feature = "cuda")]
    match rig::CudaRig::new(streams, clock) {
        Ok(rig) => run_all(&Arc::new(rig), &settings, clock, &mut tables),
        Err(err) if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            println!("\nCUDA: DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}");
            std::process::exit(1);
        }
        Err(err) => println!("\nCUDA: skipped ({err})"),
    }

    let summary = targets::summary(&tables);
    let path = report::write_json("waiters.json", &tables, &summary);
    println!("\n## summary ({:?})", started.elapsed());
    for line in &summary {
        println!("{line}");
    }
    println!("results: {}", path.display());
}
