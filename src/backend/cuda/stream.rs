//! [`CudaStreamHandle`]: a copyable handle to a cudarc stream.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::{sys, CudaStream};

use super::bind::bind;
use super::driver::{in_forked_child, not_forked, refused, Capture};
use super::event::CudaEvent;
use super::fence_pool::FencePool;
use super::progress::{self, Asked, Publish, StreamWord, WordState};
use super::word_thread;
use crate::backend::live_events::LiveEvents;
use crate::backend::registry::Registry;
use crate::sync::Mutex;
use crate::{ProgressWord, ServerError};

/// Every cudarc stream a handle was made for, held weakly, with what this crate keeps for it.
static STREAMS: Registry<CudaStream, Arc<PerStream>> = Registry::new();

/// What this crate keeps per registered stream.
pub(super) struct PerStream {
    /// The stream's context's fence-event pool.
    pub(super) pool: Arc<FencePool>,
    /// Its events in use (feature `test-util`).
    pub(super) live: LiveEvents,
    /// The next number in the stream's order of records. A lock, not an atomic:
    /// [`record_in_order`](Self::record_in_order) records, numbers and writes the word in one
    /// step.
    next: Mutex<u64>,
    /// Its progress word, whose own lock readers take (never held across a driver call).
    word: StreamWord,
}

impl PerStream {
    /// The next number in the stream's order of recorded points.
    pub(super) fn next_sequence(&self) -> u64 {
        let mut next = self.next.lock();
        *next += 1;
        *next - 1
    }

    /// Record `event` on `stream` (this one's), number it and publish the number in the progress
    /// word, as one step: numbered apart, two threads' records could take numbers in the opposite
    /// order, and a waiter lane would block on the newer first (and the word would go back). Only
    /// threads recording on this stream at once contend, which the driver serializes anyway.
    pub(super) fn record_in_order(
        &self,
        event: &CudaEvent,
        stream: &Arc<CudaStream>,
    ) -> Result<u64, ServerError> {
        let mut next = self.next.lock();
        let sequence = *next;
        event.record(
            stream,
            Some(Publish {
                word: &self.word,
                value: sequence + 1,
            }),
        )?;
        *next += 1;
        Ok(sequence)
    }

    /// `stream`'s (this one's) progress word, once a fence wrote it; the first ask hands the stream
    /// to the word thread. Makes no driver call, and waits for no lock held across one.
    pub(super) fn progress(self: &Arc<Self>, stream: &Arc<CudaStream>) -> Option<ProgressWord> {
        match self.word.ask() {
            Asked::Open(word) => Some(progress::reader(word, stream)),
            Asked::First => {
                word_thread::request(Box::new(WordFor {
                    stream: Arc::downgrade(stream),
                    per_stream: Arc::downgrade(self),
                }));
                None
            }
            Asked::None => None,
        }
    }

    /// On the word thread: take a word for `stream` (this one's) from its context's slab and
    /// install it, or turn the stream's word off if the device or the driver refuses one.
    pub(super) fn take_word(&self, stream: &Arc<CudaStream>) {
        match self.pool.words.take(stream) {
            Ok(word) => self
                .word
                .answer(WordState::Installed(Arc::downgrade(&word))),
            Err(err) => {
                log::debug!(
                    "no progress word for a CUDA stream: its fences are waited on through their \
                     events alone: {err}"
                );
                self.word.answer(WordState::Off);
            }
        }
    }
}

/// A stream's request for a word, served on the word thread.
struct WordFor {
    stream: Weak<CudaStream>,
    per_stream: Weak<PerStream>,
}

impl word_thread::Request for WordFor {
    fn serve(&self) {
        if let (Some(stream), Some(per_stream)) = (self.stream.upgrade(), self.per_stream.upgrade())
        {
            per_stream.take_word(&stream);
            // The stream may be dropped here, its last handle gone: cudarc destroys it.
        }
    }

    fn unserved(&self) {
        if let Some(per_stream) = self.per_stream.upgrade() {
            per_stream.word.answer(WordState::Unasked);
        }
    }
}

/// A copyable handle to an `Arc<cudarc::driver::CudaStream>`, taken by
/// [`EventFence::new`](crate::EventFence::new) and the [`Cuda`](super::Cuda) calls.
///
/// The handle does not keep the stream alive (it is `Copy`): once every `Arc` is dropped, calls
/// through it return an invalid-handle error instead of touching a destroyed stream; a recorded
/// fence's event keeps the context alive. Handles made from the same `Arc` are equal; two `Arc`s
/// made separately for one raw stream give different handles.
///
/// A handle to a per-thread default stream (`CU_STREAM_PER_THREAD`) belongs to the thread that
/// made it: stream calls through it on another thread are refused with
/// `CUDA_ERROR_INVALID_HANDLE` (its fences may be awaited anywhere); see the CUDA guide,
/// docs/cuda.md.
///
/// ```no_run
/// use device_events::cuda::{self, Cuda, CudaStreamHandle};
/// use device_events::EventApi;
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let handle = CudaStreamHandle::new(&stream);
/// assert_eq!(handle, CudaStreamHandle::from(&stream));
/// Cuda::stream_synchronize(handle)?;
/// drop(stream);
/// assert!(handle.stream().is_none()); // gone: calls through it are errors
/// # Ok::<(), device_events::ServerError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CudaStreamHandle {
    pub(super) id: u64,
    /// Per-thread default stream: the thread the handle belongs to (see [`thread_key`]); else 0.
    pub(super) thread: u64,
}

/// `CU_STREAM_PER_THREAD`, as the driver API defines it.
const PER_THREAD_STREAM: usize = 0x2;

/// A number for the calling thread, unique for the process's life (`ThreadId` has no stable one).
fn thread_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static KEY: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    KEY.with(|key| *key)
}

impl CudaStreamHandle {
    /// The handle for `stream`: infallible, one map lookup after the first call for the same
    /// `Arc`. In a forked child of a process that used CUDA, a handle that names no stream.
    pub fn new(stream: &Arc<CudaStream>) -> Self {
        let per_thread = stream.cu_stream() as usize == PER_THREAD_STREAM;
        if in_forked_child() {
            // The registry's lock may have stayed held in the parent.
            return Self { id: 0, thread: 0 };
        }
        let (id, _per_stream) = STREAMS.register(stream, || {
            Arc::new(PerStream {
                pool: FencePool::of(stream.context()),
                live: LiveEvents::default(),
                next: Mutex::default(),
                word: StreamWord::default(),
            })
        });
        Self {
            id,
            thread: if per_thread { thread_key() } else { 0 },
        }
    }

    /// The stream, while some `Arc` of it is alive.
    pub fn stream(self) -> Option<Arc<CudaStream>> {
        if in_forked_child() {
            // The registry's lock may have stayed held in the parent.
            return None;
        }
        STREAMS.get(self.id).map(|(stream, _)| stream)
    }

    /// The stream, or an invalid-handle error once it was dropped or on another thread's
    /// per-thread default stream.
    pub(super) fn resolve(self, call: &'static str) -> Result<Arc<CudaStream>, ServerError> {
        self.resolve_per_stream(call).map(|(stream, _)| stream)
    }

    /// As [`resolve`](Self::resolve), with what this crate keeps for the stream.
    pub(super) fn resolve_per_stream(
        self,
        call: &'static str,
    ) -> Result<(Arc<CudaStream>, Arc<PerStream>), ServerError> {
        // Before any lock: one may have stayed held in the parent.
        not_forked()?;
        if self.thread != 0 && self.thread != thread_key() {
            return Err(invalid_handle(
                call,
                "a per-thread default stream (CU_STREAM_PER_THREAD) names the calling thread's \
                 own stream, and this handle was made on another thread: the call would reach \
                 a different stream",
            ));
        }
        STREAMS
            .get(self.id)
            .ok_or_else(|| invalid_handle(call, "the stream behind this handle was dropped"))
    }
}

/// Block until `stream`'s work is done; refused on a capturing stream, before the driver would
/// invalidate the capture.
pub(super) fn synchronize_stream(stream: &CudaStream) -> Result<(), ServerError> {
    let bound = bind(stream.context())?;
    if bound.driver.stream_capture("cuStreamSynchronize", stream)? != Capture::None {
        return Err(refused(
            "cuStreamSynchronize",
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "the stream is capturing a CUDA graph: its work is recorded, not run, so there is \
             nothing to wait for (the driver would refuse it and invalidate the capture, which \
             is left intact)",
        ));
    }
    bound.relaxed(|driver| driver.stream_synchronize(stream))
}

fn invalid_handle(call: &'static str, message: &str) -> ServerError {
    refused(call, sys::CUresult::CUDA_ERROR_INVALID_HANDLE, message)
}

impl From<&Arc<CudaStream>> for CudaStreamHandle {
    fn from(stream: &Arc<CudaStream>) -> Self {
        Self::new(stream)
    }
}

impl fmt::Debug for CudaStreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_thread = if self.thread == 0 { "" } else { ", per-thread" };
        write!(f, "CudaStreamHandle({}{per_thread})", self.id)
    }
}
