//! What the benchmark measures: latencies, process CPU time, thread counts.
// FFI: clock_gettime for process CPU time, with a SAFETY note.
#![allow(unsafe_code)]

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

/// Nanoseconds since the benchmark's epoch, so instants fit in atomics.
#[derive(Clone, Copy)]
pub struct Clock {
    epoch: Instant,
}

impl Clock {
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
        }
    }

    pub fn now(&self) -> u64 {
        self.at(Instant::now())
    }

    pub fn at(&self, instant: Instant) -> u64 {
        u64::try_from(instant.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a few lines, deterministic, good
/// enough to spread item lengths and shuffle turns.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The order in which `count` strategies take their turns in round or rep `turn`. Turns come
/// in blocks of `count`: each block shuffles the strategies (a fixed seed per block, so every
/// run has the same orders) and rotates that order by one place per turn. Within a block each
/// strategy takes each place once, and from block to block it follows a different one: no
/// strategy always runs in the same place, or right after the same other, inheriting its
/// aftermath (threads winding down, CPUs awake or asleep) turn after turn.
pub fn turn_order(count: usize, turn: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..count).collect();
    let (block, shift) = (turn / count.max(1), turn % count.max(1));
    let mut random = SplitMix64(0x5eed_0000_0000_0000 ^ block as u64);
    // Fisher-Yates.
    for last in (1..count).rev() {
        order.swap(last, (random.next() % (last as u64 + 1)) as usize);
    }
    order.rotate_left(shift);
    order
}

/// One timestamp per wait, written by whoever observes the moment, and a
/// task that awaits the stamp ([`Stamps::stamped`]), woken by its writer.
pub struct Stamps {
    stamps: Vec<AtomicU64>,
    wakers: Vec<AtomicWaker>,
}

impl Stamps {
    pub fn new(len: usize) -> Arc<Self> {
        Arc::new(Self {
            stamps: (0..len).map(|_| AtomicU64::new(0)).collect(),
            wakers: (0..len).map(|_| AtomicWaker::new()).collect(),
        })
    }

    /// Stamp `index` (never 0: the clock's epoch is before any work) and
    /// wake the task awaiting it.
    pub fn set(&self, index: usize, nanos: u64) {
        self.stamps[index].store(nanos.max(1), Ordering::SeqCst);
        self.wakers[index].wake();
    }

    pub fn get(&self, index: usize) -> u64 {
        self.stamps[index].load(Ordering::SeqCst)
    }

    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Ready once `index` is stamped: the one-hop floor's wait, woken by
    /// the thread that stamps it.
    pub fn stamped(&self, index: usize) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            if self.get(index) != 0 {
                return Poll::Ready(());
            }
            self.wakers[index].register(cx.waker());
            // Stamped between the look and the registration: seen now.
            if self.get(index) != 0 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}

/// Latencies (wake minus work end) of every wait from index `from` on (the
/// ones before are warm-up), sorted.
pub fn latencies(ends: &Stamps, wakes: &Stamps, from: usize) -> Vec<u64> {
    let mut latencies: Vec<u64> = (from..ends.len())
        .map(|i| wakes.get(i).saturating_sub(ends.get(i)))
        .collect();
    latencies.sort_unstable();
    latencies
}

/// One strategy's runs (each its figures and its sorted latencies) made
/// into one: the median of each figure over the runs, and the latencies of
/// the median run by figure `by`.
pub fn median_run(mut runs: Vec<(Vec<f64>, Vec<u64>)>, by: usize) -> (Vec<f64>, Vec<u64>) {
    let figures = (0..runs[0].0.len())
        .map(|column| {
            let mut values: Vec<f64> = runs.iter().map(|run| run.0[column]).collect();
            values.sort_by(f64::total_cmp);
            values[values.len() / 2]
        })
        .collect();
    runs.sort_by(|a, b| a.0[by].total_cmp(&b.0[by]));
    let median = runs.swap_remove(runs.len() / 2);
    (figures, median.1)
}

/// The `q` quantile of sorted `values`, in microseconds.
pub fn quantile_us(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[index] as f64 / 1_000.0
}

/// CPU time the whole process has used so far (all threads).
pub fn process_cpu() -> Duration {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `time` is a valid, writable timespec; CLOCK_PROCESS_CPUTIME_ID
    // is supported on every Linux this benchmark runs on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut time) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(time.tv_sec as u64, time.tv_nsec as u32)
}

/// CPU time used so far by this process's threads whose names start with
/// `prefix` (from `/proc/self/task/*/schedstat`, in nanoseconds), alive now.
pub fn threads_cpu(prefix: &str) -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let mut total = 0u64;
    for task in tasks.flatten() {
        let path = task.path();
        let named = std::fs::read_to_string(path.join("comm"))
            .is_ok_and(|comm| comm.trim_end().starts_with(prefix));
        if !named {
            continue;
        }
        total += std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|stat| stat.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Duration::from_nanos(total)
}

/// Threads of this process right now, from /proc.
pub fn process_threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Threads:"))
                .and_then(|count| count.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The name of [`ThreadSampler`]'s thread, whose CPU is the benchmark's own
/// (it reads `/proc` every millisecond), not any strategy's.
pub const SAMPLER_THREAD: &str = "bench-sampler";

/// Samples the thread count every millisecond until stopped; keeps the peak.
pub struct ThreadSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicUsize>,
    handle: Option<JoinHandle<()>>,
}

impl ThreadSampler {
    pub fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicUsize::new(process_threads()));
        let handle = {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::Builder::new()
                .name(SAMPLER_THREAD.to_owned())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        peak.fetch_max(process_threads(), Ordering::Relaxed);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
                .expect("start the thread sampler")
        };
        Self {
            stop,
            peak,
            handle: Some(handle),
        }
    }

    /// The peak thread count seen, sampler included.
    pub fn finish(mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
        self.peak.load(Ordering::Relaxed).max(process_threads())
    }
}
