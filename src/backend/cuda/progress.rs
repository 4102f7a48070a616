//! A CUDA stream's progress word: a `u64` of page-locked, device-mapped host memory that the
//! stream sets with `cuStreamWriteValue64`, right after each fence's event record, to one more than
//! the fence's number, so a host thread learns that the stream passed a fence with one load instead
//! of a `cuEventQuery` (which takes the driver's lock). The event stays the truth: a waiter
//! confirms a word's "passed" with one query before resolving a wait.
//!
//! A stream keeps a word once a waiter asks for it (a spinning first poll, or a lane thread while
//! the watcher is on): the write costs every fence a driver call. The first ask gets no word: it
//! hands the stream to the word thread ([`super::word_thread`]), which takes one for it, and the
//! stream's fences write it from the next record on; meanwhile its waits go to the driver alone.
//! Only where the device reports both `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY` and
//! `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` ("64-bit operations are supported in
//! cuStreamBatchMemOp and related MemOp APIs"), and never on a stream seen capturing (a captured
//! write would be a graph node, replaying old numbers). Any refusal turns the stream's word off.
//!
//! # Memory
//!
//! Word memory is never freed while its context lives: another thread can begin and end a relaxed
//! capture of the stream between the two capture checks around a record, capturing a write unseen,
//! and a graph can be launched any time while its context lives. So:
//!
//! - Words come from a per-context [`WordSlab`] of pages of
//!   [`WORDS_PER_PAGE`](super::driver::WORDS_PER_PAGE) words (one `cuMemHostAlloc` each), which
//!   the driver frees with the context. A slab outlives its pool: parked when the pool goes, it is
//!   taken back by the context's next pool (told apart by the driver's context id).
//! - A word is recycled (reset to 0, given to another stream of the context) once its stream is
//!   gone, no reader holds it, and its last queued write has landed. A stale write replayed into it
//!   only shows a wrong number, which the waiter's event query catches.
//! - A [`ProgressWord`] handed out holds its stream's context alive (a [`HeldContext`]).
//! - Pages are allocated on the word thread only, which serves no wait, and no lock is held
//!   across the allocation (the slab's is let go; a stream's word has a lock of its own that no
//!   driver call holds): page-locked allocation may make the context's streams wait for each
//!   other (the CUDA programming guide, "Implicit Synchronization"), so an allocation may take as
//!   long as the context's longest queued work. `cuda::fence()`, a poll and a lane thread before
//!   its block allocate and free nothing, and wait for no allocation.
//!
//! A write that may have been captured turns the word off ([`StreamWord::captured`]): a stream
//! seen capturing is likely to capture again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::CudaStream;

use super::bind::{bind, Bound, HeldContext};
use super::driver::MappedWord;
use crate::api::WordMemory;
use crate::sync::Mutex;
use crate::{ProgressWord, ServerError};

/// The device attributes a word needs, with their numbers in CUDA 12 and 13 headers.
const ATTRIBUTES: [(i32, &str); 2] = [
    (19, "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY"),
    (122, "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"),
];

/// A stream's progress word: what its fences write and its waiters read. Its lock is never held
/// across a driver call, so a reader (a poll, a lane thread before its block) never waits for one.
/// Writers (fence records, which the stream's sequence lock keeps one at a time) and the word
/// thread ([`super::word_thread`]) each change only states of their own, so a writer's state holds
/// across its driver call.
#[derive(Default)]
pub(super) struct StreamWord(Mutex<WordState>);

/// Where a stream's progress word stands.
#[derive(Default)]
pub(super) enum WordState {
    /// Nothing asked for the stream's progress yet: its fences write none.
    #[default]
    Unasked,
    /// Asked for: the word thread is taking one from the context's slab.
    Requested,
    /// Taken from the context's slab (which holds it), for the next fence to write; no reader
    /// gets it before then.
    Installed(Weak<SlabWord>),
    /// Written by the stream's fences.
    Open(Weak<SlabWord>),
    /// Refused, or stopped: its fences are waited on through events alone.
    Off,
}

/// What a reader's ask found ([`StreamWord::ask`]).
pub(super) enum Asked {
    /// The first ask: the caller hands the stream to the word thread.
    First,
    /// The open word.
    Open(Arc<SlabWord>),
    /// No word to read (yet, or for good).
    None,
}

impl StreamWord {
    /// A reader asks for the word: the open one, or, at the first ask, a request for one (the
    /// state says so from now on). Takes the lock only, never a driver call.
    pub(super) fn ask(&self) -> Asked {
        let mut state = self.0.lock();
        match &*state {
            WordState::Unasked => {
                *state = WordState::Requested;
                Asked::First
            }
            WordState::Open(word) => word.upgrade().map_or(Asked::None, Asked::Open),
            WordState::Requested | WordState::Installed(_) | WordState::Off => Asked::None,
        }
    }

    /// End the stream's request with `answer`: `Installed`, a word the word thread took from the
    /// slab for it; `Off`, refused; `Unasked`, never served (the word thread could not start), so
    /// the next ask asks again. Only the word thread serves requests, one at a time, so the request
    /// is still there (were it not, an installed word would stay with the slab, in use by the
    /// stream until the stream goes).
    pub(super) fn answer(&self, answer: WordState) {
        let mut state = self.0.lock();
        if matches!(*state, WordState::Requested) {
            *state = answer;
        }
    }

    /// Queue the write of `value` on `stream` (its context bound, not capturing just before the
    /// fence's record) if a word is installed or open, allocating nothing: whether one was queued.
    /// The lock is let go across the driver call.
    pub(super) fn publish(&self, bound: &Bound, stream: &Arc<CudaStream>, value: u64) -> bool {
        // The slab holds the word while the stream lives.
        let target = match &*self.0.lock() {
            WordState::Installed(word) | WordState::Open(word) => word.upgrade(),
            WordState::Unasked | WordState::Requested | WordState::Off => None,
        };
        let Some(word) = target else {
            return false;
        };
        let written = bound
            .driver
            .stream_write_value64(stream, &word.memory, value);
        let mut state = self.0.lock();
        match written {
            Ok(()) => {
                word.queued.store(value, Ordering::Relaxed);
                if let WordState::Installed(installed) = &*state {
                    *state = WordState::Open(installed.clone());
                }
                true
            }
            Err(err) => {
                log::debug!("a CUDA stream's progress word is off from now on: {err}");
                *state = WordState::Off;
                false
            }
        }
    }

    /// The write just queued may have been captured into a graph: the word is off for later
    /// fences (its memory is safe whatever the graph does, see the module's docs).
    pub(super) fn captured(&self) {
        *self.0.lock() = WordState::Off;
    }
}

/// What a fence's record publishes: `value` into its stream's `word`.
pub(super) struct Publish<'a> {
    pub(super) word: &'a StreamWord,
    pub(super) value: u64,
}

/// A word of a context's slab, in use by one stream.
pub(super) struct SlabWord {
    memory: MappedWord,
    /// The last value queued to it.
    queued: AtomicU64,
}

/// What a [`ProgressWord`] of a CUDA stream holds alive: the word, and its context (which owns
/// the memory).
struct WordReader {
    word: Arc<SlabWord>,
    _context: HeldContext,
}

impl WordMemory for WordReader {
    /// 0 (no fence passed) in a forked child: the driver's mappings are the parent's.
    fn get(&self) -> u64 {
        if super::driver::in_forked_child() {
            return 0;
        }
        self.word.memory.get()
    }
}

/// A reader of `word`, a word of `stream`'s context.
pub(super) fn reader(word: Arc<SlabWord>, stream: &CudaStream) -> ProgressWord {
    ProgressWord::new(Arc::new(WordReader {
        word,
        _context: HeldContext::from(stream.context().clone()),
    }))
}

/// A context's progress words: the pool's handle to its [`WordSlab`] (see the module's docs).
#[derive(Default)]
pub(super) struct PoolWords(Mutex<WordSlab>);

/// A context's word pages, split into the words streams use and the words free to reuse.
#[derive(Default)]
pub(super) struct WordSlab {
    /// Words in use, each with its stream (weakly).
    in_use: Vec<(Weak<CudaStream>, Arc<SlabWord>)>,
    /// Words free, each with the last value queued to it (reused once it holds that value).
    free: Vec<(MappedWord, u64)>,
    /// Pages allocated (for the logs).
    pages: usize,
}

/// Slabs of pools gone while their context may live on, with its device and id, for the
/// context's next pool. At most one per device: a device has one primary context at a time, and
/// an older one's pages went with it.
fn parked() -> &'static Mutex<Vec<(usize, u64, WordSlab)>> {
    // In a `OnceLock`: the crate's mutex is not `const` under loom.
    static PARKED: OnceLock<Mutex<Vec<(usize, u64, WordSlab)>>> = OnceLock::new();
    PARKED.get_or_init(Mutex::default)
}

impl PoolWords {
    /// The words of a new pool of context `id` on device `ordinal`: the slab its context parked,
    /// if any.
    pub(super) fn adopt(ordinal: usize, id: Option<u64>) -> Self {
        let Some(id) = id else {
            return Self::default();
        };
        let mut parked = parked().lock();
        let mut slab = WordSlab::default();
        parked.retain_mut(|(device, parked_id, parked_slab)| {
            if *device != ordinal {
                return true;
            }
            if *parked_id == id {
                slab = std::mem::take(parked_slab);
            }
            // An older context of the device is gone, and its pages with it.
            false
        });
        Self(Mutex::new(slab))
    }

    /// The pool of context `id` on device `ordinal` goes: keep its slab for the context's next
    /// pool. Touches no word memory (the context may be gone).
    pub(super) fn park(&self, ordinal: usize, id: Option<u64>) {
        let slab = std::mem::take(&mut *self.0.lock());
        if slab.pages == 0 {
            return;
        }
        let Some(id) = id else {
            // No id to tell the context apart from a later one: its pages stay with the context.
            log::debug!(
                "{} progress-word pages are left to their CUDA context (no context id)",
                slab.pages
            );
            return;
        };
        let mut parked = parked().lock();
        parked.retain(|(device, _, _)| *device != ordinal);
        parked.push((ordinal, id, slab));
    }

    /// A word for `stream` (alive, of this pool's context): a free word that holds its last value,
    /// reset to 0, or one of a new page. Called on the word thread only (one at a time), with the
    /// context bound; the slab's lock is let go across the allocation, which may wait for the
    /// context's work (see the module's docs).
    pub(super) fn take(&self, stream: &Arc<CudaStream>) -> Result<Arc<SlabWord>, ServerError> {
        let bound = bind(stream.context())?;
        let driver = bound.driver;
        let device = stream.context().cu_device();
        for (attribute, name) in ATTRIBUTES {
            if driver.device_attribute(attribute, device)? == 0 {
                return Err(super::driver::refused(
                    "cuDeviceGetAttribute",
                    cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
                    &format!("the device reports {name} = 0"),
                ));
            }
        }
        let memory = match self.take_free() {
            Some(memory) => memory,
            None => {
                // Allocating is a "potentially unsafe" call during another thread's capture.
                let mut page = bound.relaxed(|driver| driver.alloc_mapped_page())?;
                let memory = page.pop().expect("a page holds words");
                let mut slab = self.0.lock();
                slab.pages += 1;
                slab.free.extend(page.into_iter().map(|word| (word, 0)));
                memory
            }
        };
        memory.reset();
        let word = Arc::new(SlabWord {
            memory,
            queued: AtomicU64::new(0),
        });
        let mut slab = self.0.lock();
        slab.in_use.push((Arc::downgrade(stream), word.clone()));
        Ok(word)
    }

    /// A free word that holds its last value (no write to it is still to land), if there is one.
    /// The caller's stream keeps the context, and so its words' memory, alive.
    fn take_free(&self) -> Option<MappedWord> {
        let mut slab = self.0.lock();
        slab.recycle();
        let found = slab
            .free
            .iter()
            .position(|(memory, last)| memory.get() == *last)?;
        let (memory, _last_write) = slab.free.swap_remove(found);
        Some(memory)
    }
}

impl WordSlab {
    /// Move to the free list every word whose stream is gone and that no reader holds (the slab's
    /// is its only handle). Touches no word memory.
    fn recycle(&mut self) {
        let gone: Vec<_> = self
            .in_use
            .extract_if(.., |(stream, word)| {
                stream.strong_count() == 0 && Arc::strong_count(word) == 1
            })
            .collect();
        // The counts are read relaxed: this pairs with the release of the last handles, so the
        // last value a writer queued (before letting its handle go) is the one read below.
        std::sync::atomic::fence(Ordering::Acquire);
        let free = gone
            .into_iter()
            .map(|(_, word)| (word.memory, word.queued.load(Ordering::Relaxed)));
        self.free.extend(free);
    }
}
