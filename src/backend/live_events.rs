//! [`LiveEvents`]: per-stream counts of the events a backend made for a stream, for leak checks
//! that run the same on either backend.

#[cfg(any(test, feature = "test-util"))]
use std::fmt;
#[cfg(any(test, feature = "test-util"))]
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(any(test, feature = "test-util"))]
use std::sync::Arc;

/// Counts of the events created for one stream: a host stream's
/// ([`HostStream::live_events`](crate::host::HostStream::live_events)) or a CUDA stream's
/// (`cuda::live_events`). For tests: only with the `test-util` feature (without it, the backends
/// keep no counts).
///
/// A cheap handle shared by the stream and its events, so it can be read after the stream is
/// dropped. It counts one stream's events, not the process's, so other streams (or tests)
/// creating events at the same time do not disturb a leak check.
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
#[derive(Clone, Default)]
pub struct LiveEvents(Arc<Counts>);

/// Without `test-util` nothing reads the counts, so none are kept.
#[cfg(not(any(test, feature = "test-util")))]
#[derive(Clone, Default)]
pub(crate) struct LiveEvents(());

#[cfg(not(any(test, feature = "test-util")))]
impl LiveEvents {
    pub(crate) fn allocated(&self) {}
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn reused(&self) {}
    pub(crate) fn freed(&self) {}
    pub(crate) fn set_idle(&self, _idle: usize) {}
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Default)]
struct Counts {
    /// The stream's events allocated (or taken from a shared pool) and not yet freed (or given
    /// back there): in use, or idle in the stream's own pool.
    alive: AtomicUsize,
    /// Of those, how many are idle in the stream's own pool: a gauge the pool stores under its
    /// lock, so a pooled event costs no read-modify-write here.
    idle: AtomicUsize,
    created: AtomicU64,
}

#[cfg(any(test, feature = "test-util"))]
impl LiveEvents {
    /// How many of the stream's events are in use right now: created (or taken from a pool) and
    /// not yet destroyed or given back. An event destroyed while a marker for it is still queued
    /// counts until the marker passes (a driver frees it once its work completes).
    pub fn count(&self) -> usize {
        // The gauge first: an event given back between the two reads still counts (never a count
        // too low for a leak check to trust).
        let idle = self.0.idle.load(Ordering::SeqCst);
        self.0.alive.load(Ordering::SeqCst).saturating_sub(idle)
    }

    /// How many events were ever created for the stream (a steady loop of fences creates none).
    pub fn created(&self) -> u64 {
        self.0.created.load(Ordering::SeqCst)
    }

    pub(crate) fn allocated(&self) {
        self.0.created.fetch_add(1, Ordering::SeqCst);
        self.0.alive.fetch_add(1, Ordering::SeqCst);
    }

    /// An idle event of a pool shared with other streams (a CUDA context's) is in use.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn reused(&self) {
        self.0.alive.fetch_add(1, Ordering::SeqCst);
    }

    /// An event of the stream was destroyed, or given back to a shared pool.
    pub(crate) fn freed(&self) {
        self.0.alive.fetch_sub(1, Ordering::SeqCst);
    }

    /// The stream's own pool now holds `idle` events; called under the pool's lock.
    pub(crate) fn set_idle(&self, idle: usize) {
        self.0.idle.store(idle, Ordering::Release);
    }
}

#[cfg(any(test, feature = "test-util"))]
impl fmt::Debug for LiveEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveEvents")
            .field("count", &self.count())
            .field("created", &self.created())
            .finish()
    }
}
