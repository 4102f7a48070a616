//! Soak: a million awaits on the host backend across 32 streams, with random
//! cancellation (timeouts, dropped futures, dropped streams), random panics
//! in work, and concurrent `wait_sync` / `wait_async` on the same streams.
//! At the end: no waiter thread left beyond keep-alive, no event leaked,
//! memory back near where it started.
//!
//! Ignored by default (`cargo test --release --test soak -- --ignored`);
//! `SOAK_AWAITS` sets the count (CI runs a short one).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use device_events::host::{Host, HostStream, LiveEvents};
use device_events::{EventFence, ServerError, Waiter};
use futures::FutureExt;

const STREAMS: usize = 32;
const BATCH: usize = 2_000;

/// A small, seeded, dependency-free random source (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn resident_kib() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("VmRSS:"))
                .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

#[derive(Default)]
struct Outcomes {
    ok: AtomicUsize,
    faulted: AtomicUsize,
    invalid: AtomicUsize,
    cancelled: AtomicUsize,
    other: AtomicUsize,
}

impl Outcomes {
    fn count(&self, result: Result<(), ServerError>) {
        let counter = match result {
            Ok(()) => &self.ok,
            Err(err) if err.is_faulted() => &self.faulted,
            Err(err) if err.code() == Some(device_events::status::INVALID_HANDLE) => &self.invalid,
            Err(err) => {
                eprintln!("unexpected: {err}");
                &self.other
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
#[ignore = "a long soak; run with --ignored (CI runs a short one)"]
fn a_million_awaits_under_faults_leave_nothing_behind() {
    let awaits: usize = std::env::var("SOAK_AWAITS")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(1_000_000);
    // The injected panics are expected: keep them off stderr.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.to_string().contains("soak: injected fault") {
            default_hook(info);
        }
    }));
    let keep_alive = Duration::from_millis(100);
    let waiter = Waiter::builder()
        .max_threads(16)
        .keep_alive(keep_alive)
        .build();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let outcomes = Arc::new(Outcomes::default());
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut streams: Vec<HostStream> = (0..STREAMS).map(|_| common::faultable_stream()).collect();
    // The event counts of every stream the soak made, replaced ones too.
    let mut live: Vec<LiveEvents> = streams.iter().map(HostStream::live_events).collect();
    let mut resident_start = 0;

    let mut done = 0;
    while done < awaits {
        let batch = BATCH.min(awaits - done);
        let mut tasks = Vec::with_capacity(batch);
        for _ in 0..batch {
            let s = rng.below(STREAMS as u64) as usize;
            match rng.below(1_000) {
                // A panic in work: the stream faults for good; replace it.
                0..=2 => {
                    let _ = streams[s].launch(|| panic!("soak: injected fault"));
                }
                // Drop the stream while waits on it are pending.
                3..=5 => {
                    streams[s] = common::faultable_stream();
                    live.push(streams[s].live_events());
                }
                // Occasionally slower work.
                6..=50 => {
                    let _ = streams[s].launch(|| std::thread::sleep(Duration::from_micros(50)));
                }
                _ => {
                    let _ = streams[s].launch(|| {});
                }
            }
            if streams[s].is_faulted() {
                streams[s] = common::faultable_stream();
                live.push(streams[s].live_events());
            }
            let fence = EventFence::<Host>::new(streams[s].handle());
            let (outcomes, waiter) = (outcomes.clone(), waiter.clone());
            let other = streams[(s + 1) % STREAMS].handle();
            tasks.push(match rng.below(100) {
                // A timeout that may cancel the wait.
                0..=9 => {
                    let limit = Duration::from_micros(rng.below(200));
                    runtime.spawn(async move {
                        match tokio::time::timeout(limit, waiter.wait(fence)).await {
                            Ok(result) => outcomes.count(result),
                            Err(_) => {
                                outcomes.cancelled.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    })
                }
                // A future polled once, then dropped.
                10..=14 => runtime.spawn(async move {
                    let mut future = waiter.wait(fence);
                    match (&mut future).now_or_never() {
                        Some(result) => outcomes.count(result),
                        None => {
                            drop(future);
                            outcomes.cancelled.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }),
                // A host wait on a blocking thread, at the same time.
                15..=17 => runtime.spawn_blocking(move || outcomes.count(fence.wait_sync())),
                // A device-side wait into the next stream.
                18..=20 => runtime.spawn(async move { outcomes.count(fence.wait_async(other)) }),
                _ => runtime.spawn(async move { outcomes.count(waiter.wait(fence).await) }),
            });
        }
        runtime.block_on(async {
            for task in tasks {
                task.await.unwrap();
            }
        });
        done += batch;
        if resident_start == 0 && done >= BATCH * 5 {
            // After warm-up: allocator pools, thread stacks, runtime buffers.
            resident_start = resident_kib();
        }
    }

    let total = ["ok", "faulted", "invalid", "cancelled", "other"]
        .iter()
        .zip([
            &outcomes.ok,
            &outcomes.faulted,
            &outcomes.invalid,
            &outcomes.cancelled,
            &outcomes.other,
        ])
        .map(|(name, counter)| {
            let count = counter.load(Ordering::Relaxed);
            eprintln!("{name}: {count}");
            count
        })
        .sum::<usize>();
    assert_eq!(total, awaits, "every wait resolved or was cancelled");
    assert_eq!(outcomes.other.load(Ordering::Relaxed), 0);
    assert!(outcomes.ok.load(Ordering::Relaxed) > awaits / 2);

    drop(streams);
    common::eventually(Duration::from_secs(30), "the waiter is idle", || {
        waiter.pending() == 0
    });
    common::eventually(
        Duration::from_secs(30),
        "waiter threads left after keep-alive",
        || waiter.threads() == 0,
    );
    common::eventually(Duration::from_secs(30), "every event released", || {
        live.iter().all(|live| live.count() == 0)
    });
    let resident_end = resident_kib();
    eprintln!(
        "resident: {resident_start} KiB after warm-up, {resident_end} KiB at the end; peak waiter threads {}",
        waiter.peak_threads()
    );
    if resident_start > 0 {
        assert!(
            resident_end < resident_start + 64 * 1024,
            "memory grew from {resident_start} KiB to {resident_end} KiB"
        );
    }
    // A lane thread per stream, the poller and the watcher.
    assert!(waiter.peak_threads() <= 18);
}
