//! [`CudaStreamHandle`]: a copyable handle to a cudarc stream.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::driver::BACKEND;
use crate::backend::registry::Registry;
use crate::ServerError;

/// Every cudarc stream a handle was made for, held weakly.
static STREAMS: Registry<CudaStream> = Registry::new();

/// A copyable handle to an `Arc<cudarc::driver::CudaStream>`, taken by
/// [`EventFence::new`](crate::EventFence::new) and the
/// [`Cuda`](super::Cuda) calls.
///
/// The handle does not keep the stream alive (it is `Copy`, so it cannot own
/// anything): while the `Arc<CudaStream>` lives, calls through the handle use
/// it; once every `Arc` is dropped, they return an invalid-handle error instead
/// of touching a destroyed stream. A fence does not need its stream once
/// recorded: its event keeps the stream's context alive.
///
/// Handles made from the same `Arc` are equal; two `Arc<CudaStream>` made
/// separately for the same raw stream give different handles.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CudaStreamHandle {
    id: u64,
}

impl CudaStreamHandle {
    /// The handle for `stream`. Infallible and cheap after the first call for
    /// the same `Arc` (one map lookup).
    pub fn new(stream: &Arc<CudaStream>) -> Self {
        Self {
            id: STREAMS.register(stream),
        }
    }

    /// The stream, while some `Arc` of it is alive.
    pub fn stream(self) -> Option<Arc<CudaStream>> {
        STREAMS.get(self.id)
    }

    /// The stream, or an invalid-handle error once it has been dropped.
    pub(super) fn resolve(self, call: &'static str) -> Result<Arc<CudaStream>, ServerError> {
        self.stream().ok_or_else(|| ServerError::Call {
            backend: BACKEND,
            call,
            code: 400,
            name: "CUDA_ERROR_INVALID_HANDLE".to_owned(),
            message: "the stream behind this handle was dropped".to_owned(),
        })
    }
}

impl From<&Arc<CudaStream>> for CudaStreamHandle {
    fn from(stream: &Arc<CudaStream>) -> Self {
        Self::new(stream)
    }
}

impl fmt::Debug for CudaStreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaStreamHandle({})", self.id)
    }
}
