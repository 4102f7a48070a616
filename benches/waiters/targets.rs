//! The benchmark's targets, checked against the measured ratios: PASS, MISS, or
//! "not measured" when a scenario did not run. Metrics are typed
//! ([`Metric`]), so a renamed column fails to compile, and a table asked for
//! a metric it does not have panics rather than reading "not measured".

use crate::report::{Metric, Scenario, Table};
use crate::strategies::Strategy;
use crate::{costs, throughput};

/// The benchmark's targets, checked against the measured ratios.
pub fn summary(tables: &[Table]) -> Vec<String> {
    let mut lines = Vec::new();
    let mut info = Vec::new();
    let find = |scenario: Scenario, backend: &str| {
        tables
            .iter()
            .find(|table| table.scenario == scenario && table.backend == backend)
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
    let ratio_of = |table: Option<&Table>, metric: Metric, row: &str, other: &str| {
        let table = table?;
        Some(table.value(row, metric)? / table.value(other, metric)?)
    };
    let ratio =
        |table: Option<&Table>, metric: Metric, other: &str| ratio_of(table, metric, ours, other);
    for backend in ["host", "cuda"] {
        let single = find(Scenario::SingleWait, backend);
        let many = find(Scenario::ManyPending, backend);
        if !tables.iter().any(|table| table.backend == backend) {
            continue;
        }
        check(
            format!("[{backend}] 2: threads vs spawn_blocking"),
            ratio(many, Metric::PeakThreads, blocking),
            0.1,
        );
        check(
            format!("[{backend}] 2: CPU vs spawn_blocking"),
            ratio(many, Metric::CpuMs, blocking),
            1.0,
        );
        for (label, table) in [("1", single), ("2", many)] {
            for metric in [Metric::P50Us, Metric::P99Us] {
                check(
                    format!(
                        "[{backend}] {label}: wake {} vs spawn_blocking",
                        metric.label()
                    ),
                    ratio(table, metric, blocking),
                    1.5,
                );
            }
        }
        // Not a target: how far this crate is from the cheapest possible
        // hand-off (one more thread wake-up than the raw blocked thread).
        if let Some(value) = ratio(single, Metric::P50Us, Strategy::RawHandoff.name()) {
            info.push(format!(
                "INFO [{backend}] 1: wake p50 vs raw thread + hand-off: {value:.2}"
            ));
        }
        // The floor of any waiter: the stream's own thread wakes the task
        // (host only: a GPU stream cannot run a waker).
        let one_hop = Strategy::OneHop.name();
        let sleeping = Strategy::AwaitSleeping.name();
        let watching = Strategy::AwaitWatching.name();
        if backend == "host" {
            check(
                format!("[{backend}] 1: wake p50 vs one-hop floor"),
                ratio(single, Metric::P50Us, one_hop),
                1.25,
            );
        }
        // The default (with no watcher where the machine is small) against
        // `watchers(0)`: no worse; and the watcher on, `watchers(1)`: its
        // tail no worse, and a lone wait's median faster.
        check(
            format!("[{backend}] 1: wake p50 vs watchers(0)"),
            ratio(single, Metric::P50Us, sleeping),
            1.1,
        );
        check(
            format!("[{backend}] 1: wake p99 vs watchers(0)"),
            ratio(single, Metric::P99Us, sleeping),
            1.2,
        );
        check(
            format!("[{backend}] 1: watchers(1) wake p50 vs watchers(0)"),
            ratio_of(single, Metric::P50Us, watching, sleeping),
            0.95,
        );
        check(
            format!("[{backend}] 1: watchers(1) wake p99 vs watchers(0)"),
            ratio_of(single, Metric::P99Us, watching, sleeping),
            1.2,
        );
        // Not targets: the floors of any watcher (`--strategies` adds them): a
        // thread looking at the word wakes the task; the same, racing a thread
        // blocked in the driver, as the watcher races its lane thread.
        for floor in [Strategy::SpinHop, Strategy::SpinRace] {
            if let Some(value) = ratio_of(single, Metric::P50Us, floor.name(), sleeping) {
                info.push(format!(
                    "INFO [{backend}] 1: {} wake p50 vs watchers(0): {value:.2}",
                    floor.name()
                ));
            }
        }
        check(
            format!("[{backend}] 5: idle CPU % of a core"),
            find(Scenario::IdleCpu, backend)
                .and_then(|table| table.value(ours, Metric::CpuPercentOfCore)),
            1.0,
        );
        check(
            format!("[{backend}] 5: watchers(1) idle CPU % of a core"),
            find(Scenario::IdleCpu, backend)
                .and_then(|table| table.value(watching, Metric::CpuPercentOfCore)),
            1.0,
        );
        let ready = find(Scenario::ReadyFence, backend).and_then(|table| {
            Some(
                table.value(costs::READY_AWAIT, Metric::NsPerOp)?
                    / table.value(costs::READY_WAIT_SYNC, Metric::NsPerOp)?,
            )
        });
        check(
            format!("[{backend}] 3: ready await vs wait_sync"),
            ready,
            3.0,
        );
        let pooled = find(Scenario::FenceCost, backend).and_then(|table| {
            Some(
                table.value(costs::POOLED_FENCE, Metric::NsPerFence)?
                    / table.value(costs::UNPOOLED_FENCE, Metric::NsPerFence)?,
            )
        });
        check(
            format!("[{backend}] 4: pooled fence vs unpooled create + record"),
            pooled,
            0.5,
        );
        let large = find(Scenario::ManyPendingLarge, backend);
        if large.is_some() {
            check(
                format!("[{backend}] 2b: all resolved vs spawn_blocking"),
                ratio(large, Metric::AllResolvedMs, blocking),
                1.0,
            );
            check(
                format!("[{backend}] 2b: CPU vs spawn_blocking"),
                ratio(large, Metric::CpuMs, blocking),
                1.0,
            );
        }
        let busy = find(Scenario::BusyWorkers, backend);
        let per_second = |table: Option<&Table>| {
            let table = table?;
            Some(
                table.value(ours, Metric::AwaitsPerSecond)?
                    / table.value(blocking, Metric::AwaitsPerSecond)?,
            )
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
            ratio(busy, Metric::CpuUsPerAwait, blocking),
            0.6,
        );
        if let Some(scaling) = find(Scenario::ReadyScaling, backend)
            .and_then(|table| table.value(throughput::SCALING, Metric::AwaitsPerSecond))
        {
            check(
                format!("[{backend}] 7: ready-await scaling shortfall (1 - scaling)"),
                Some(1.0 - scaling),
                0.2,
            );
        }
        for scenario in [
            Scenario::Streaming10Us,
            Scenario::Streaming100Us,
            Scenario::Streaming1Ms,
            Scenario::StreamingLongThenShort,
            Scenario::StreamingVaried,
        ] {
            let table = find(scenario, backend);
            if table.is_none() {
                continue;
            }
            let id = scenario.id();
            let handoff = Strategy::RawHandoff.name();
            for (what, metric, other, label, limit) in [
                ("wake p50", Metric::P50Us, blocking, "spawn_blocking", 1.0),
                (
                    "wake p50",
                    Metric::P50Us,
                    handoff,
                    "raw thread + hand-off",
                    2.0,
                ),
                ("wake p50", Metric::P50Us, one_hop, "one-hop floor", 1.25),
                ("wake p50", Metric::P50Us, sleeping, "watchers(0)", 1.1),
                ("wake p99", Metric::P99Us, blocking, "spawn_blocking", 1.0),
                ("wake p99", Metric::P99Us, sleeping, "watchers(0)", 1.2),
                (
                    "CPU per await",
                    Metric::CpuUsPerAwait,
                    blocking,
                    "spawn_blocking",
                    1.0,
                ),
                (
                    "CPU per await",
                    Metric::CpuUsPerAwait,
                    sleeping,
                    "watchers(0)",
                    1.3,
                ),
                // Against the floor, not spawn_blocking: the floor itself
                // spends about 0.7x spawn_blocking's CPU.
                (
                    "CPU per await",
                    Metric::CpuUsPerAwait,
                    handoff,
                    "raw thread + hand-off",
                    1.15,
                ),
            ] {
                if other == one_hop && backend != "host" {
                    continue;
                }
                check(
                    format!("[{backend}] {id}: {what} vs {label}"),
                    ratio(table, metric, other),
                    limit,
                );
            }
            // The watcher on, against none: its tail no worse, its median
            // no worse; with 1 ms items, faster (the watcher sees each end in
            // the stream's word, where `watchers(0)`'s thread waits to be
            // woken from the driver).
            check(
                format!("[{backend}] {id}: watchers(1) wake p50 vs watchers(0)"),
                ratio_of(table, Metric::P50Us, watching, sleeping),
                if scenario == Scenario::Streaming1Ms {
                    0.8
                } else {
                    1.15
                },
            );
            check(
                format!("[{backend}] {id}: watchers(1) wake p99 vs watchers(0)"),
                ratio_of(table, Metric::P99Us, watching, sleeping),
                1.2,
            );
            if backend == "cuda" {
                check(
                    format!("[cuda] {id}: wake p50 us"),
                    table.and_then(|table| table.value(ours, Metric::P50Us)),
                    5.0,
                );
            }
        }
        if backend == "cuda" {
            check(
                "[cuda] 1: wake p50 us".to_owned(),
                single.and_then(|table| table.value(ours, Metric::P50Us)),
                10.0,
            );
            check(
                "[cuda] 1: wake p50 vs raw blocked thread".to_owned(),
                ratio(single, Metric::P50Us, Strategy::RawThread.name()),
                1.2,
            );
            check(
                "[cuda] 2b: waiter threads for 100,000 on 64 streams".to_owned(),
                find(Scenario::ManyPendingLarge, backend)
                    .and_then(|table| table.value(ours, Metric::PeakThreads)),
                65.0,
            );
        }
    }
    lines.extend(info);
    lines
}
