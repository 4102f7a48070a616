//! Warnings about faults, once per stream: a faulted stream (sticky: every
//! later call fails the same way) would otherwise log the same warning for
//! every fence made on it.

use std::collections::HashSet;
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::OnceLock;

use crate::loom::Mutex;
use crate::ServerError;

/// Streams already warned about, by hash of backend and stream. Bounded: when
/// full it starts over, so a long-lived process with many faulted streams
/// warns about some again rather than growing without end.
const REMEMBERED: usize = 4096;

/// Log `message` (which includes `err`) as a warning, unless `err` is a sticky
/// fault already warned about for this `stream`: then at debug level.
pub(crate) fn warn<S: Hash>(backend: &'static str, stream: &S, err: &ServerError, message: &str) {
    if err.is_faulted() && !first_for(backend, stream) {
        log::debug!("{message} (this stream's fault was warned about before)");
    } else {
        log::warn!("{message}");
    }
}

/// Whether this is the first fault seen for `stream`.
fn first_for<S: Hash>(backend: &'static str, stream: &S) -> bool {
    static SEEN: OnceLock<(RandomState, Mutex<HashSet<u64>>)> = OnceLock::new();
    let (hasher, seen) = SEEN.get_or_init(|| (RandomState::new(), Mutex::new(HashSet::new())));
    let key = hasher.hash_one((backend, stream));
    let mut seen = seen.lock();
    if seen.len() >= REMEMBERED {
        seen.clear();
    }
    seen.insert(key)
}
