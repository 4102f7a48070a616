//! This crate's `fence.await` against what users would use instead, on the
//! same fences, in one run: `spawn_blocking(wait_sync)`, a thread per wait, a
//! query-and-yield loop, and (the floor) a raw thread blocked in the backend's
//! synchronize.
//!
//! ```sh
//! cargo bench --bench waiters               # full run (host; CUDA too when present)
//! cargo bench --bench waiters -- --quick    # smoke run, seconds
//! cargo bench --bench waiters -- --large    # adds 100,000 awaits on 64 streams
//! ```
//!
//! Prints a table per scenario with each strategy's ratio to this crate's,
//! and writes `target/bench-results/waiters.json` and latency plots (SVG).

mod measure;
mod report;
mod rig;
mod strategies;
mod throughput;

use std::sync::Arc;
use std::time::{Duration, Instant};

use device_events::{Event, EventFlags, Waiter};
use measure::{latencies, process_cpu, process_threads, quantile_us, Clock, Stamps, ThreadSampler};
use report::Table;
use rig::{HostRig, Rig};
use strategies::{Pending, Strategy, ALL, SINGLE};

struct Settings {
    quick: bool,
    large: bool,
    rounds: usize,
    warmup: usize,
    work: Duration,
    many: (usize, usize),
    hold: Duration,
    ready: usize,
    idle_waits: usize,
    idle_window: Duration,
    /// Repetitions of scenario 2; each figure is the median over them.
    reps: usize,
    /// `--only 1,4`: run just these scenarios (by number; `2b` is `--large`).
    only: Option<Vec<String>>,
}

const USAGE: &str =
    "usage: cargo bench --bench waiters -- [--quick] [--large] [--only 1,2,2b,3,4,5,6,7]";

impl Settings {
    fn from_args() -> Self {
        let (mut quick, mut large, mut only) = (false, false, None);
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => quick = true,
                "--large" => large = true,
                // cargo bench passes --bench to harness = false benchmarks.
                "--bench" => {}
                "--only" => match args.next() {
                    Some(list) => {
                        only = Some(list.split(',').map(str::to_owned).collect::<Vec<_>>())
                    }
                    None => usage_error("--only needs a list of scenarios"),
                },
                other => usage_error(&format!("unknown argument {other:?}")),
            }
        }
        let settings = Self::for_mode(quick, large);
        Self { only, ..settings }
    }

    /// Whether scenario `id` ("1", "2b", ...) runs.
    fn runs(&self, id: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|wanted| wanted == id))
    }

    fn for_mode(quick: bool, large: bool) -> Self {
        if quick {
            Self {
                quick,
                large,
                rounds: 50,
                warmup: 5,
                work: Duration::from_micros(200),
                many: (4, 100),
                hold: Duration::from_millis(300),
                ready: 5_000,
                idle_waits: 100,
                idle_window: Duration::from_millis(200),
                reps: 1,
                only: None,
            }
        } else {
            Self {
                quick,
                large,
                rounds: 3_000,
                warmup: 50,
                work: Duration::from_micros(200),
                many: (16, 625),
                hold: Duration::from_millis(1_500),
                ready: 100_000,
                idle_waits: 1_000,
                idle_window: Duration::from_secs(1),
                reps: 3,
                only: None,
            }
        }
    }
}

fn usage_error(message: &str) -> ! {
    eprintln!("{message}\n{USAGE}");
    std::process::exit(2);
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Scenario 1: one stream, work of known length, a fence; wake latency.
///
/// The strategies take turns round by round (each with its own runtime), so
/// a noisy stretch of the machine hits all of them alike and the ratios
/// compare like with like.
fn single_wait<R: Rig>(
    rig: &R,
    settings: &Settings,
    clock: Clock,
) -> (Table, Vec<(String, Vec<u64>)>) {
    let mut table = Table::new(
        "1. single wait latency",
        rig.name(),
        &["p50 us", "p99 us", "mean us"],
    );
    let runtimes: Vec<_> = SINGLE.iter().map(|_| runtime()).collect();
    let waiter = Waiter::builder().build();
    let total = settings.warmup + settings.rounds;
    let stamps: Vec<_> = SINGLE
        .iter()
        .map(|_| (Stamps::new(total), Stamps::new(total)))
        .collect();
    for index in 0..total {
        for ((strategy, runtime), (ends, wakes)) in SINGLE.iter().zip(&runtimes).zip(&stamps) {
            rig.work(0, settings.work, ends, index);
            let pending = Pending {
                index,
                stream: 0,
                fence: rig.fence(0),
            };
            strategies::wait_one(*strategy, runtime, &waiter, pending, wakes, clock);
        }
    }
    waiter.shutdown();
    let mut series = Vec::new();
    for (strategy, (ends, wakes)) in SINGLE.iter().zip(&stamps) {
        let sorted = latencies(ends, wakes, settings.warmup);
        let mean = sorted.iter().sum::<u64>() as f64 / sorted.len() as f64 / 1_000.0;
        table.row(
            strategy.name(),
            vec![quantile_us(&sorted, 0.5), quantile_us(&sorted, 0.99), mean],
        );
        series.push((strategy.name().to_owned(), sorted));
    }
    (table, series)
}

/// Scenario 2: many awaits pending at once across streams, released together.
fn many_pending<R: Rig>(
    rig: &R,
    (streams, per_stream): (usize, usize),
    hold: Duration,
    reps: usize,
    strategies: &[Strategy],
    clock: Clock,
) -> (Table, Vec<(String, Vec<u64>)>) {
    let name = if streams * per_stream >= 100_000 {
        "2b. many pending (large)"
    } else {
        "2. many pending"
    };
    let mut table = Table::new(
        name,
        rig.name(),
        &[
            "all resolved ms",
            "p50 us",
            "p99 us",
            "peak threads",
            "CPU ms",
        ],
    );
    table.notes.push(format!(
        "{} awaits on {streams} streams, released together after {hold:?}; median of {reps} runs",
        streams * per_stream
    ));
    let mut series = Vec::new();
    // The strategies take turns, rep by rep, so a noisy stretch of the
    // machine hits each alike.
    let mut all_runs: Vec<Vec<(Vec<f64>, Vec<u64>)>> =
        strategies.iter().map(|_| Vec::new()).collect();
    for _ in 0..reps {
        for (&strategy, runs) in strategies.iter().zip(&mut all_runs) {
            runs.push(many_pending_once(
                rig,
                (streams, per_stream),
                hold,
                strategy,
                clock,
                &mut table.notes,
            ));
        }
    }
    for (&strategy, mut runs) in strategies.iter().zip(all_runs) {
        // The median run by p50, and the median of each figure over the runs.
        runs.sort_by(|a, b| a.0[1].total_cmp(&b.0[1]));
        let figures = (0..runs[0].0.len())
            .map(|column| {
                let mut values: Vec<f64> = runs.iter().map(|run| run.0[column]).collect();
                values.sort_by(f64::total_cmp);
                values[values.len() / 2]
            })
            .collect();
        table.row(strategy.name(), figures);
        let median = runs.swap_remove(runs.len() / 2);
        series.push((strategy.name().to_owned(), median.1));
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
    let waiter = Waiter::builder().build();
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
    let finish = strategies::start(strategy, &runtime, &waiter, fences, &wakes, clock);
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
    waiter.shutdown();
    let figures = vec![
        last.saturating_sub(release) as f64 / 1e6,
        quantile_us(&sorted, 0.5),
        quantile_us(&sorted, 0.99),
        peak as f64,
        cpu.as_secs_f64() * 1e3,
    ];
    (figures, sorted)
}

/// Scenario 3: awaiting fences already reached, against `wait_sync` and a
/// bare query on the same kind of fence.
fn ready_fence<R: Rig>(rig: &R, settings: &Settings) -> Table {
    let mut table = Table::new("3. ready fence", rig.name(), &["ns per op"]);
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
    table.row("await (first poll, ready)", vec![per_op(started, count)]);

    let batch = fences(count);
    let started = Instant::now();
    for fence in batch {
        fence.wait_sync().expect("fence");
    }
    table.row("wait_sync", vec![per_op(started, count)]);

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
fn fence_cost<R: Rig>(rig: &R, settings: &Settings) -> Table {
    let mut table = Table::new("4. fence cost", rig.name(), &["ns per fence"]);
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
    table.row(
        "fence in a steady loop, pooled (record + drop)",
        vec![per_fence(pooled)],
    );
    table.row(
        "unpooled (Event::new + record + drop)",
        vec![per_fence(unpooled)],
    );
    table
}

/// Scenario 5: CPU burned while awaits pend on work that has not finished.
fn idle_cpu<R: Rig>(rig: &R, settings: &Settings, clock: Clock) -> Table {
    let mut table = Table::new("5. idle CPU", rig.name(), &["CPU % of a core", "threads"]);
    let streams = rig.streams().min(4);
    table.notes.push(format!(
        "{} awaits pending on {streams} streams for {:?}",
        settings.idle_waits, settings.idle_window
    ));
    for strategy in ALL {
        rig.drain();
        let runtime = runtime();
        let waiter = Waiter::builder().build();
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
        let finish = strategies::start(strategy, &runtime, &waiter, fences, &wakes, clock);
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
        waiter.shutdown();
    }
    table
}

/// Every scenario on one rig.
fn run_all<R: Rig>(shared: &Arc<R>, settings: &Settings, clock: Clock, tables: &mut Vec<Table>) {
    let rig = &**shared;
    if settings.runs("1") {
        let (table, series) = single_wait(rig, settings, clock);
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
        let (table, series) = many_pending(
            rig,
            settings.many,
            settings.hold,
            settings.reps,
            &ALL,
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
            Strategy::SpawnBlocking,
            Strategy::QueryYield,
            Strategy::RawThread,
        ];
        let (table, _) = many_pending(
            rig,
            (64, 1_563),
            Duration::from_secs(2),
            5,
            &strategies,
            clock,
        );
        table.print();
        tables.push(table);
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
    let scenarios: [(&str, &dyn Fn() -> Table); 5] = [
        ("3", &|| ready_fence(rig, settings)),
        ("4", &|| fence_cost(rig, settings)),
        ("5", &|| idle_cpu(rig, settings, clock)),
        ("6", &|| throughput::loop_awaits(shared, &loops)),
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

/// The issue's targets, checked against the measured ratios.
fn summary(tables: &[Table]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut info = Vec::new();
    let find = |scenario: &str, backend: &str| {
        tables
            .iter()
            .find(|table| table.scenario.starts_with(scenario) && table.backend == backend)
    };
    let mut check = |what: String, value: Option<f64>, limit: f64| {
        let line = match value {
            Some(value) => format!(
                "{} {what}: {value:.2} (target <= {limit})",
                if value <= limit { "PASS" } else { "MISS" }
            ),
            None => format!("---- {what}: not measured"),
        };
        lines.push(line);
    };
    let ours = Strategy::Await.name();
    let blocking = Strategy::SpawnBlocking.name();
    let ratio = |table: Option<&Table>, metric: &str, other: &str| {
        let table = table?;
        Some(table.value(ours, metric)? / table.value(other, metric)?)
    };
    for backend in ["host", "cuda"] {
        let single = find("1.", backend);
        let many = find("2.", backend);
        if single.is_none() {
            continue;
        }
        check(
            format!("[{backend}] 2: threads vs spawn_blocking"),
            ratio(many, "peak threads", blocking),
            0.1,
        );
        check(
            format!("[{backend}] 2: CPU vs spawn_blocking"),
            ratio(many, "CPU ms", blocking),
            1.0,
        );
        for (label, table) in [("1", single), ("2", many)] {
            for metric in ["p50 us", "p99 us"] {
                check(
                    format!("[{backend}] {label}: wake {metric} vs spawn_blocking"),
                    ratio(table, metric, blocking),
                    1.5,
                );
            }
        }
        // Not a target: how far this crate is from the cheapest possible
        // hand-off (one more thread wake-up than the raw blocked thread).
        if let Some(value) = ratio(single, "p50 us", Strategy::RawHandoff.name()) {
            info.push(format!(
                "INFO [{backend}] 1: wake p50 vs raw thread + hand-off: {value:.2}"
            ));
        }
        let ready = find("3.", backend).and_then(|table| {
            Some(
                table.value("await (first poll, ready)", "ns per op")?
                    / table.value("wait_sync", "ns per op")?,
            )
        });
        check(
            format!("[{backend}] 3: ready await vs wait_sync"),
            ready,
            3.0,
        );
        let pooled = find("4.", backend).and_then(|table| {
            Some(
                table.value(
                    "fence in a steady loop, pooled (record + drop)",
                    "ns per fence",
                )? / table.value("unpooled (Event::new + record + drop)", "ns per fence")?,
            )
        });
        check(
            format!("[{backend}] 4: pooled fence vs unpooled create + record"),
            pooled,
            0.5,
        );
        let busy = find("6.", backend);
        let per_second = |table: Option<&Table>| {
            let table = table?;
            Some(table.value(ours, "awaits/s")? / table.value(blocking, "awaits/s")?)
        };
        if let Some(value) = per_second(busy) {
            // A floor, not a ceiling: checked as spawn_blocking's rate over
            // ours, at most 0.5.
            check(
                format!("[{backend}] 6: spawn_blocking awaits/s vs ours (ours >= 2x)"),
                Some(1.0 / value),
                0.5,
            );
        }
        check(
            format!("[{backend}] 6: CPU per await vs spawn_blocking"),
            ratio(busy, "CPU us per await", blocking),
            0.6,
        );
        if let Some(scaling) = find("7.", backend)
            .and_then(|table| table.value("scaling: all / (workers x one)", "awaits/s"))
        {
            check(
                format!("[{backend}] 7: ready-await scaling shortfall (1 - scaling)"),
                Some(1.0 - scaling),
                0.2,
            );
        }
        if backend == "cuda" {
            check(
                "[cuda] 1: wake p50 us".to_owned(),
                single.and_then(|table| table.value(ours, "p50 us")),
                10.0,
            );
            check(
                "[cuda] 1: wake p50 vs raw blocked thread".to_owned(),
                ratio(single, "p50 us", Strategy::RawThread.name()),
                1.2,
            );
            check(
                "[cuda] 5: idle CPU % of a core".to_owned(),
                find("5.", backend).and_then(|table| table.value(ours, "CPU % of a core")),
                1.0,
            );
            check(
                "[cuda] 2b: waiter threads for 100,000 on 64 streams".to_owned(),
                find("2b.", backend).and_then(|table| table.value(ours, "peak threads")),
                65.0,
            );
        }
    }
    lines.extend(info);
    lines
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

    let summary = summary(&tables);
    let path = report::write_json("waiters.json", &tables, &summary);
    println!("\n## summary ({:?})", started.elapsed());
    for line in &summary {
        println!("{line}");
    }
    println!("results: {}", path.display());
}
