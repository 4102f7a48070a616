//! [`CudaStreamHandle`]: a copyable handle to a cudarc stream.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use super::bind::bind;
use super::driver::{in_forked_child, not_forked, refused, Capture};
use super::event::CudaEvent;
use super::fence_pool::FencePool;
use super::progress::{self, Publish, StreamWord};
use crate::backend::live_events::LiveEvents;
use crate::backend::registry::Registry;
use crate::sync::Mutex;
use crate::{ProgressWord, ServerError};

/// Every cudarc stream a handle was made for, held weakly, with what this crate keeps per stream.
static STREAMS: Registry<CudaStream, Arc<PerStream>> = Registry::new();

/// What this crate keeps per registered stream.
pub(super) struct PerStream {
    /// The stream's context's fence-event pool.
    pub(super) pool: Arc<FencePool>,
    /// The stream's counts of its events in use (feature `test-util`).
    pub(super) live: LiveEvents,
    /// The waiter's next number in the stream's order of recorded points, and the stream's
    /// progress word. A lock, not an atomic: [`record_in_order`](Self::record_in_order) takes a
    /// record, its number and its word's write as one step.
    sequenced: Mutex<Sequenced>,
}

#[derive(Default)]
struct Sequenced {
    next: u64,
    word: StreamWord,
}

impl PerStream {
    /// The next number in the stream's order of recorded points.
    pub(super) fn next_sequence(&self) -> u64 {
        let mut sequenced = self.sequenced.lock();
        sequenced.next += 1;
        sequenced.next - 1
    }

    /// Record `event` on `stream` (this one's), number it, and have the stream publish the number
    /// in its progress word, as one step: numbered after the call, two threads recording could
    /// take numbers in the opposite order to their records, and a waiter lane would block on the
    /// newer one first (and the word would go back). The lock is the stream's: only two threads
    /// recording on it at once contend, and the driver serializes those anyway.
    pub(super) fn record_in_order(
        &self,
        event: &CudaEvent,
        stream: &Arc<CudaStream>,
    ) -> Result<u64, ServerError> {
        let mut sequenced = self.sequenced.lock();
        let Sequenced { next, word } = &mut *sequenced;
        let sequence = *next;
        event.record(
            stream,
            Some(Publish {
                word,
                value: sequence + 1,
            }),
        )?;
        *next += 1;
        Ok(sequence)
    }

    /// `stream`'s (this one's) progress word, once a fence wrote it. Asked for the first time,
    /// a word is taken from the context's slab (which may allocate a page: off the fence path,
    /// before the stream's lock) and installed for the next fence to write.
    pub(super) fn progress(&self, stream: &Arc<CudaStream>) -> Option<ProgressWord> {
        {
            let sequenced = self.sequenced.lock();
            if !sequenced.word.is_unasked() {
                return sequenced
                    .word
                    .open()
                    .map(|word| progress::reader(word, stream));
            }
        }
        let words = &self.pool.words;
        match words.take(stream) {
            Ok(word) => {
                let installed = self.sequenced.lock().word.install(&word);
                if !installed {
                    // Another thread installed one meanwhile.
                    words.untake(word);
                }
            }
            Err(err) => {
                log::debug!(
                    "no progress word for a CUDA stream: its fences are waited on through their \
                     events alone: {err}"
                );
                self.sequenced.lock().word.refuse();
            }
        }
        None
    }
}

/// A copyable handle to an `Arc<cudarc::driver::CudaStream>`, taken by
/// [`EventFence::new`](crate::EventFence::new) and the [`Cuda`](super::Cuda) calls.
///
/// The handle does not keep the stream alive (it is `Copy`, so it cannot own anything): while the
/// `Arc<CudaStream>` lives, calls through the handle use it; once every `Arc` is dropped, they
/// return an invalid-handle error instead of touching a destroyed stream. A fence does not need its
/// stream once recorded: its event keeps the stream's context alive.
///
/// Handles made from the same `Arc` are equal; two `Arc<CudaStream>` made
/// separately for the same raw stream give different handles.
///
/// # Per-thread default streams
///
/// `CU_STREAM_PER_THREAD` (cudarc's `ctx.per_thread_stream()`) means "the calling thread's default
/// stream": the same handle names a different stream on every thread. A handle made for one
/// therefore belongs to the thread that made it, and a stream call through it on another thread (a
/// drop queue's fallback synchronize, say) is refused with `CUDA_ERROR_INVALID_HANDLE` instead of
/// silently using that thread's stream. Events and fences are not affected: a fence is recorded on
/// the caller's thread, and waiting on its event is correct from any thread. The legacy default
/// stream (null or `CU_STREAM_LEGACY`) is one per context and may be used from any thread.
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
    id: u64,
    /// Per-thread default stream: the thread the handle belongs to (see [`thread_key`]); else 0.
    thread: u64,
}

/// `CU_STREAM_PER_THREAD`, as the driver API defines it.
const PER_THREAD_STREAM: usize = 0x2;

/// A number for the calling thread, unique for the life of the process (a
/// `ThreadId` has no stable number to order or hash by value).
fn thread_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static KEY: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    KEY.with(|key| *key)
}

impl CudaStreamHandle {
    /// The handle for `stream`. Infallible and cheap after the first call for the same `Arc` (one
    /// map lookup). For a per-thread default stream, the handle belongs to the calling thread (see
    /// the type's docs). In a forked child of a process that used CUDA, a handle that names no
    /// stream: no CUDA call may be made there.
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
                sequenced: Mutex::default(),
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

    /// A number no other stream alive at the same time has, a per-thread default stream counting as
    /// one stream per thread (see [`EventApi::stream_id`](crate::EventApi::stream_id)).
    pub(super) fn lane_id(self) -> u64 {
        // Both are counters from 1 (the registry's, times its 16 shards, plus the shard; the
        // thread's, or 0 if not per-thread), far below 2^32 in any process: the number is exact.
        self.id | self.thread << 32
    }

    /// The stream, or an invalid-handle error once it has been dropped, or
    /// when it is another thread's per-thread default stream.
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

/// Block until all work queued on `stream` is done. A stream capturing a graph runs nothing to wait
/// for: it is refused here with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, before the driver refuses
/// it the same way and invalidates the capture.
pub(super) fn synchronize_stream(stream: &CudaStream) -> Result<(), ServerError> {
    let bound = bind(stream.context())?;
    if bound
        .driver()
        .stream_capture("cuStreamSynchronize", stream)?
        != Capture::None
    {
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
        if self.thread == 0 {
            write!(f, "CudaStreamHandle({})", self.id)
        } else {
            write!(f, "CudaStreamHandle({}, per-thread)", self.id)
        }
    }
}
