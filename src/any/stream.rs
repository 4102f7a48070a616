//! [`AnyStream`]: one stream type for code on a GPU if there is one, host streams otherwise.

use std::fmt;
use std::sync::Arc;

use super::fence::AnyFence;
#[cfg(feature = "cuda")]
use crate::cuda::{self, cudarc::driver::CudaStream, Cuda, CudaStreamHandle};
use crate::host::{Host, HostStream};
use crate::{EventFence, ServerError};

/// A stream of either backend: cheap to clone (one `Arc`), made with `From` a cudarc
/// `Arc<CudaStream>` or a [`HostStream`]. Code written against it differs per backend only where
/// it launches work; [`fence`](Self::fence) gives an [`AnyFence`].
///
/// ```
/// use device_events::host::HostStream;
/// use device_events::{AnyStream, ServerError};
///
/// /// Stage two runs behind stage one on the device; the task awaits both.
/// async fn pipeline(one: &AnyStream, two: &AnyStream) -> Result<(), ServerError> {
///     launch(one)?;
///     let first = one.fence();
///     first.wait_async(two)?; // the device orders stage two after stage one
///     launch(two)?;
///     let second = two.fence();
///     first.await?;
///     second.await
/// }
///
/// /// Launching is the only code written per backend.
/// fn launch(stream: &AnyStream) -> Result<(), ServerError> {
///     match stream {
///         AnyStream::Host(host) => host.launch(|| { /* stage work */ }),
///         // AnyStream::Cuda(stream) => your kernel's launch on `stream`,
///         _ => unreachable!("only host streams in this example"),
///     }
/// }
///
/// let (one, two) = (HostStream::new()?.into(), HostStream::new()?.into());
/// futures::executor::block_on(pipeline(&one, &two))?;
/// # Ok::<(), ServerError>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum AnyStream {
    /// A CUDA stream.
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaStream>),
    /// A host stream.
    Host(Arc<HostStream>),
}

impl AnyStream {
    /// The backend's name, `"Cuda"` or `"Host"`, as [`AnyFence::backend`].
    pub fn backend(&self) -> &'static str {
        match_backend!(self, AnyStream(_) => BACKEND)
    }

    /// A fence at the stream's current end ([`EventFence::new`](crate::EventFence::new)).
    pub fn fence(&self) -> AnyFence {
        match self {
            #[cfg(feature = "cuda")]
            Self::Cuda(stream) => cuda::fence(stream).into(),
            Self::Host(stream) => stream.fence().into(),
        }
    }

    /// [`EventFence::try_new`].
    ///
    /// # Errors
    ///
    /// As for [`EventFence::try_new`].
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use device_events::AnyStream;
    ///
    /// let stream = AnyStream::from(HostStream::new()?);
    /// stream.try_fence()?.wait_sync()?;
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn try_fence(&self) -> Result<AnyFence, ServerError> {
        Ok(match self {
            #[cfg(feature = "cuda")]
            Self::Cuda(stream) => {
                EventFence::<Cuda>::try_new(CudaStreamHandle::new(stream))?.into()
            }
            Self::Host(stream) => EventFence::<Host>::try_new(stream.handle())?.into(),
        })
    }

    /// Block until the stream's queued work has finished.
    ///
    /// # Errors
    ///
    /// The stream's (or its context's) fault, or the driver's error.
    pub fn synchronize(&self) -> Result<(), ServerError> {
        match self {
            #[cfg(feature = "cuda")]
            Self::Cuda(stream) => {
                <Cuda as crate::EventApi>::stream_synchronize(CudaStreamHandle::new(stream))
            }
            Self::Host(stream) => stream.synchronize(),
        }
    }

    /// The stream's [`LiveEvents`](crate::LiveEvents), on either backend, for a leak check
    /// written once. For tests: only with the `test-util` feature.
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use device_events::AnyStream;
    ///
    /// let stream = AnyStream::from(HostStream::new()?);
    /// let live = stream.live_events();
    /// stream.fence().wait_sync()?;
    /// assert_eq!(live.count(), 0, "nothing leaked");
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    #[cfg(any(test, feature = "test-util"))]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn live_events(&self) -> crate::LiveEvents {
        match self {
            #[cfg(feature = "cuda")]
            Self::Cuda(stream) => cuda::live_events(stream),
            Self::Host(stream) => stream.live_events(),
        }
    }
}

#[cfg(feature = "cuda")]
impl From<Arc<CudaStream>> for AnyStream {
    fn from(stream: Arc<CudaStream>) -> Self {
        Self::Cuda(stream)
    }
}

impl From<HostStream> for AnyStream {
    fn from(stream: HostStream) -> Self {
        Self::Host(Arc::new(stream))
    }
}

impl From<Arc<HostStream>> for AnyStream {
    fn from(stream: Arc<HostStream>) -> Self {
        Self::Host(stream)
    }
}

impl fmt::Debug for AnyStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.backend();
        match_backend!(self, AnyStream(stream) => f.debug_tuple(name).field(stream).finish())
    }
}
