//! [`ProgressWord`]: how far a stream has got, in host memory that the stream itself sets as it
//! passes each recorded point, so a host thread learns it with a memory load, not a driver call.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A stream's progress word, from `EventApi::stream_progress`: whether the stream has passed a
/// recorded point, read with one load. Cheap to clone.
///
/// A word that says "passed" means the stream got there; whether the work before the point
/// succeeded is the point's event's to say (a faulted stream stops moving its word, and its
/// events fail), so a waiter confirms with one query of the event before resolving a wait.
#[derive(Clone)]
pub struct ProgressWord(Arc<dyn WordMemory>);

impl ProgressWord {
    pub(crate) fn new(memory: Arc<dyn WordMemory>) -> Self {
        Self(memory)
    }

    /// Whether the stream has passed its point numbered `sequence`; never blocks.
    pub fn passed(&self, sequence: u64) -> bool {
        self.0.get() > sequence
    }
}

/// Where a backend keeps a stream's word: 0 until the stream passes its first recorded point,
/// then one more than the number (`EventApi::stream_sequence`) of the latest point it passed.
pub(crate) trait WordMemory: Send + Sync {
    /// The word now, with acquire ordering.
    fn get(&self) -> u64;
}

impl fmt::Debug for ProgressWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ProgressWord").field(&self.0.get()).finish()
    }
}

/// A progress word in host memory, on a cache line of its own (the host backend's: its stream's
/// worker advances it). It only grows.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(crate) struct HostWord(AtomicU64);

impl WordMemory for HostWord {
    fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

impl HostWord {
    /// The stream has passed its point numbered `sequence`, and every point before it.
    pub(crate) fn advance(&self, sequence: u64) {
        self.0
            .fetch_max(sequence.saturating_add(1), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{HostWord, ProgressWord};

    #[test]
    fn a_word_passes_each_point_once_the_stream_is_there_and_never_goes_back() {
        let memory = Arc::new(HostWord::default());
        let word = ProgressWord::new(memory.clone());
        assert!(!word.passed(0), "no point passed yet");
        memory.advance(0);
        assert!(word.passed(0));
        assert!(!word.passed(1));
        memory.advance(5);
        assert!(word.passed(3) && word.passed(5) && !word.passed(6));
        memory.advance(2);
        assert!(word.passed(5), "an older point does not move the word back");
        assert!(
            !word.passed(u64::MAX),
            "a dropped stream's number is never passed"
        );
        assert_eq!(format!("{word:?}"), "ProgressWord(6)");
    }
}
