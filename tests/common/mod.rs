//! Shared test helpers: a fault-injecting backend over the host backend, a log
//! capture, a gate that holds a stream's worker, the CUDA tests' device and
//! the fake CUDA driver's test hooks.
#![allow(dead_code)] // each test binary uses a different part

#[cfg(feature = "cuda")]
pub mod fake_driver;
pub mod faulty;
#[cfg(unix)]
pub mod fork;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod logs;
pub mod skipped;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use device_events::host::{HostContext, HostStream};

/// A stream on a context of its own, for a test that faults it: a fault
/// poisons its whole context (as on CUDA). `HostStream::new` gives one too;
/// this name says the test means the fault.
pub fn faultable_stream() -> HostStream {
    HostContext::new()
        .new_stream()
        .expect("a stream on a new context")
}

/// Holds a stream's worker inside launched work until opened (or dropped),
/// so a test controls exactly when the "device" makes progress.
pub struct Gate {
    open: mpsc::Sender<()>,
}

impl Gate {
    /// Queue work on `stream` that blocks until the gate opens.
    pub fn hold(stream: &HostStream) -> Self {
        let (open, opened) = mpsc::channel::<()>();
        stream
            .launch(move || {
                // An error means the sender was dropped: also "open".
                let _ = opened.recv();
            })
            .expect("launch the gate");
        Self { open }
    }

    pub fn open(self) {
        let _ = self.open.send(());
    }
}

/// A counter that launched work bumps, to see what has run.
#[derive(Clone, Default)]
pub struct Progress(Arc<AtomicUsize>);

impl Progress {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Count one step.
    pub fn bump(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    /// Queue a step on `stream` that bumps the counter.
    pub fn step_on(&self, stream: &HostStream) {
        let counter = self.0.clone();
        stream
            .launch(move || {
                counter.fetch_add(1, Ordering::SeqCst);
            })
            .expect("launch a step");
    }
}

/// Until `queue`'s thread has taken every queued value out (it waits on the
/// last one's fence, or drops it): a value pushed next is queued behind it.
pub fn until_taken<F: device_events::drop_queue::Fence, T: Send + 'static>(
    queue: &device_events::drop_queue::DropQueue<F, T>,
) {
    let limit = std::time::Duration::from_secs(20);
    eventually(limit, "the queue's thread took its values", || {
        queue.stats().queued == 0
    });
}

/// Run `wait` on its own thread and return its result, printed with how long
/// it took; the test fails, rather than hangs, if it has not returned after
/// 20 s (far beyond what a correct run needs).
pub fn resolves<F>(what: &str, wait: F) -> Result<(), device_events::ServerError>
where
    F: FnOnce() -> Result<(), device_events::ServerError> + Send + 'static,
{
    const HANG: std::time::Duration = std::time::Duration::from_secs(20);
    let (sender, receiver) = mpsc::channel();
    let started = std::time::Instant::now();
    std::thread::spawn(move || {
        let _ = sender.send(wait());
    });
    match receiver.recv_timeout(HANG) {
        Ok(result) => {
            eprintln!("{what}: {result:?} after {:?}", started.elapsed());
            result
        }
        Err(_) => panic!("{what} hung for {HANG:?}"),
    }
}

/// The process's threads (Linux, `/proc/self/task`) whose name starts with
/// `prefix`; the kernel keeps 15 bytes of a name.
pub fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// Poll `condition` until it holds, failing the test after `limit`: turns a
/// hang into a failure. Not a timing assertion: `limit` is far beyond what a
/// correct run needs.
pub fn eventually(limit: std::time::Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !condition() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        std::thread::yield_now();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
