//! A CUDA stream's progress word: a `u64` of page-locked, device-mapped host memory that the
//! stream itself sets with `cuStreamWriteValue64`, right after each fence's event record, to one
//! more than the fence's number, so a host thread learns that the stream has passed a fence with
//! one load instead of a `cuEventQuery` (which takes the driver's lock). The event stays the
//! truth: a waiter confirms a word's "passed" with one query before resolving a wait.
//!
//! A stream keeps a word once a waiter has asked for it (a spinning first poll does, and so does
//! a lane thread while the waiter's watcher is on): the write costs every fence a driver call,
//! which a stream no one waits on through a waiter should not pay. Only where the
//! device reports both `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY` and
//! `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` ("64-bit operations are supported in
//! cuStreamBatchMemOp and related MemOp APIs"), and never on a capturing stream (a captured write
//! would be a graph node, replaying old numbers into memory the graph does not own). Any refusal
//! turns the stream's word off, and its fences are waited on through their events alone.
//!
//! A word is freed only once nothing can read it and the device writes to it no more: its stream
//! is gone, no waiter holds it, and its stream's last queued value has landed (writes of one
//! stream land in order). The context's pool holds every word and frees them so (see
//! [`PoolWords`]); a word whose write may have been captured into a graph is never freed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::CudaStream;

use super::bind::Bound;
use super::driver::MappedWord;
use crate::loom::Mutex;
use crate::progress_word::WordMemory;
use crate::{ProgressWord, ServerError};

/// `CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY`.
const CAN_MAP_HOST_MEMORY: i32 = 19;
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`, its number in CUDA 12 and 13 headers.
const CAN_USE_64_BIT_STREAM_MEM_OPS: i32 = 122;

/// A stream's progress word, kept under the stream's sequence lock: every write is queued in the
/// order of the fences' numbers.
#[derive(Default)]
pub(super) enum StreamWord {
    /// Nothing asked for the stream's progress yet: its fences write none, so a stream no waiter
    /// watches pays nothing for it.
    #[default]
    Unasked,
    /// Opened at the stream's next fence recorded outside a capture.
    Unopened,
    /// Held by the context's pool (weakly here: the pool frees it once the stream is gone).
    Open(Weak<DeviceWord>),
    /// Refused, or stopped: its fences are waited on through events alone.
    Off,
}

impl StreamWord {
    /// The word, for a waiter to read; `None` while none is open. The first ask has the word
    /// opened at the stream's next fence.
    pub(super) fn progress(&mut self) -> Option<ProgressWord> {
        match self {
            Self::Open(word) => Some(ProgressWord::new(word.upgrade()?)),
            Self::Unasked => {
                *self = Self::Unopened;
                None
            }
            Self::Unopened | Self::Off => None,
        }
    }

    /// Queue the write of `value` on `stream` (its context bound, the stream not capturing just
    /// before the fence's record), opening the word first if need be. Whether a write was queued.
    pub(super) fn publish(
        &mut self,
        bound: &Bound,
        stream: &Arc<CudaStream>,
        words: &PoolWords,
        value: u64,
    ) -> bool {
        if let Self::Unopened = self {
            *self = match DeviceWord::open(bound, stream) {
                Ok(word) => {
                    let word = Arc::new(word);
                    words.hold(bound, stream, word.clone());
                    Self::Open(Arc::downgrade(&word))
                }
                Err(err) => {
                    log::debug!(
                        "no progress word for a CUDA stream: its fences are waited on through \
                         their events alone: {err}"
                    );
                    Self::Off
                }
            };
        }
        // The pool holds it while the stream lives.
        let Some(word) = (match self {
            Self::Open(word) => word.upgrade(),
            Self::Unasked | Self::Unopened | Self::Off => None,
        }) else {
            return false;
        };
        match bound
            .driver()
            .stream_write_value64(stream, &word.memory, value)
        {
            Ok(()) => {
                word.queued.store(value, Ordering::Relaxed);
                true
            }
            Err(err) => {
                log::debug!("a CUDA stream's progress word is off from now on: {err}");
                *self = Self::Off;
                false
            }
        }
    }

    /// The write just queued may have been captured into a graph (a capture began or ended on
    /// the stream around the record): the word's memory is kept for good, and the word is off.
    pub(super) fn captured(&mut self) {
        if let Self::Open(word) = std::mem::replace(self, Self::Off) {
            if let Some(word) = word.upgrade() {
                word.kept.store(true, Ordering::Relaxed);
            }
        }
    }
}

/// What a fence's record publishes: `value` into its stream's `word`, held with the other
/// `words` of its context.
pub(super) struct Publish<'a> {
    pub(super) word: &'a mut StreamWord,
    pub(super) words: &'a PoolWords,
    pub(super) value: u64,
}

/// An open progress word.
pub(super) struct DeviceWord {
    memory: MappedWord,
    /// The last value queued to it.
    queued: AtomicU64,
    /// A write to it may be in a graph: never freed.
    kept: AtomicBool,
}

impl DeviceWord {
    fn open(bound: &Bound, stream: &Arc<CudaStream>) -> Result<Self, ServerError> {
        let driver = bound.driver();
        let device = stream.context().cu_device();
        for (attribute, name) in [
            (
                CAN_MAP_HOST_MEMORY,
                "CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY",
            ),
            (
                CAN_USE_64_BIT_STREAM_MEM_OPS,
                "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
            ),
        ] {
            if driver.device_attribute(attribute, device)? == 0 {
                return Err(super::driver::refused(
                    "cuDeviceGetAttribute",
                    cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
                    &format!("the device reports {name} = 0"),
                ));
            }
        }
        // Allocating is a "potentially unsafe" call during another thread's capture.
        let memory = bound.relaxed(|driver| driver.alloc_mapped_word())?;
        Ok(Self {
            memory,
            queued: AtomicU64::new(0),
            kept: AtomicBool::new(false),
        })
    }
}

impl WordMemory for DeviceWord {
    fn get(&self) -> u64 {
        self.memory.get()
    }
}

/// A context's progress words, each with its stream (weakly). A word is freed, the pool's context
/// bound, once its stream is gone, no waiter holds it (the pool's is its only handle) and its last
/// write has landed: looked at each time a word opens, and when the pool goes (there, one still
/// read or written to is forgotten: freeing it could let a reader or the device touch freed
/// memory, and the driver frees it with the context).
#[derive(Default)]
pub(super) struct PoolWords(Mutex<Vec<(Weak<CudaStream>, Arc<DeviceWord>)>>);

impl PoolWords {
    /// Hold `stream`'s new `word`, and free the words done with.
    fn hold(&self, bound: &Bound, stream: &Arc<CudaStream>, word: Arc<DeviceWord>) {
        self.free_done(bound);
        self.0.lock().push((Arc::downgrade(stream), word));
    }

    /// Free, with the pool's context bound, every word done with (see the type's docs).
    pub(super) fn free_done(&self, bound: &Bound) {
        let mut words = self.0.lock();
        for (stream, word) in std::mem::take(&mut *words) {
            if stream.strong_count() > 0 || word.kept.load(Ordering::Relaxed) {
                words.push((stream, word));
                continue;
            }
            let word = match Arc::try_unwrap(word) {
                Ok(word) => word,
                Err(read) => {
                    words.push((stream, read));
                    continue;
                }
            };
            let DeviceWord {
                memory,
                queued,
                kept,
            } = word;
            let last = queued.load(Ordering::Relaxed);
            // Freeing is a "potentially unsafe" call during another thread's capture.
            match bound.relaxed(|driver| driver.free_mapped_word(memory, last)) {
                Ok(Ok(())) => {}
                Ok(Err(pending)) => words.push((
                    stream,
                    Arc::new(DeviceWord {
                        memory: pending,
                        queued,
                        kept,
                    }),
                )),
                Err(err) => log::debug!("a CUDA stream's progress word could not be freed: {err}"),
            }
        }
    }

    /// Whether it holds none (for the pool's drop).
    pub(super) fn is_empty(&self) -> bool {
        self.0.lock().is_empty()
    }
}
