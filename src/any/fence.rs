//! [`AnyFence`]: one fence type for either backend, not generic over [`EventApi`](crate::EventApi).

use super::stream::AnyStream;
#[cfg(feature = "cuda")]
use crate::cuda::Cuda;
use crate::host::Host;
use crate::{EventFence, FenceFuture, ServerError, Waiter};

/// A fence of either backend, made with `From` an [`EventFence`] or by [`AnyStream::fence`]; a
/// device-side wait ([`wait_async`](Self::wait_async)) takes an [`AnyStream`] of its backend.
///
/// ```
/// use device_events::host::HostStream;
/// use device_events::AnyFence;
///
/// /// A pipeline stage that runs on CUDA or on host streams alike.
/// async fn finish(fence: AnyFence) -> Result<(), device_events::ServerError> {
///     println!("waiting on a {} fence", fence.backend());
///     fence.await
/// }
///
/// let stream = HostStream::new()?;
/// stream.launch(|| { /* work */ })?;
/// let fence: AnyFence = stream.fence().into();
/// futures::executor::block_on(finish(fence))?;
/// # Ok::<(), device_events::ServerError>(())
/// ```
#[non_exhaustive]
pub enum AnyFence {
    /// A fence on a CUDA stream.
    #[cfg(feature = "cuda")]
    Cuda(EventFence<Cuda>),
    /// A fence on a host stream.
    Host(EventFence<Host>),
}

impl AnyFence {
    /// The backend's name, `"Cuda"` or `"Host"`.
    pub fn backend(&self) -> &'static str {
        match_backend!(self, AnyFence(_) => BACKEND)
    }

    /// [`EventFence::wait_sync`].
    ///
    /// # Errors
    ///
    /// As for [`EventFence::wait_sync`].
    pub fn wait_sync(self) -> Result<(), ServerError> {
        match_backend!(self, AnyFence(fence) => fence.wait_sync())
    }

    /// [`EventFence::is_complete`].
    ///
    /// # Errors
    ///
    /// As for [`EventFence::is_complete`].
    pub fn is_complete(&self) -> Result<bool, ServerError> {
        match_backend!(self, AnyFence(fence) => fence.is_complete())
    }

    /// [`EventFence::is_resolved_at_creation`].
    pub fn is_resolved_at_creation(&self) -> bool {
        match_backend!(self, AnyFence(fence) => fence.is_resolved_at_creation())
    }

    /// [`EventFence::wait_async`].
    ///
    /// # Errors
    ///
    /// As for [`EventFence::wait_async`]; and [`ServerError::InvalidArgument`], with no wait
    /// made, when `on` is of the other backend.
    pub fn wait_async(&self, on: &AnyStream) -> Result<(), ServerError> {
        let paired = self.paired(on, "AnyFence::wait_async")?;
        match_backend!(paired, Paired(fence, stream) => fence.wait_async(stream))
    }

    /// [`EventFence::try_wait_async`].
    ///
    /// # Errors
    ///
    /// As for [`EventFence::try_wait_async`]; and [`ServerError::InvalidArgument`] when `on`
    /// is of the other backend.
    ///
    /// ```
    /// use device_events::host::HostStream;
    /// use device_events::{AnyFence, AnyStream};
    ///
    /// let producer = AnyStream::from(HostStream::new()?);
    /// let consumer = AnyStream::from(HostStream::new()?);
    /// let fence: AnyFence = producer.fence();
    /// fence.try_wait_async(&consumer)?;
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    pub fn try_wait_async(&self, on: &AnyStream) -> Result<(), ServerError> {
        let paired = self.paired(on, "AnyFence::try_wait_async")?;
        match_backend!(paired, Paired(fence, stream) => fence.try_wait_async(stream))
    }

    fn paired(&self, on: &AnyStream, what: &'static str) -> Result<Paired<'_>, ServerError> {
        match (self, on) {
            #[cfg(feature = "cuda")]
            (Self::Cuda(fence), AnyStream::Cuda(stream)) => Ok(Paired::Cuda(
                fence,
                crate::cuda::CudaStreamHandle::new(stream),
            )),
            (Self::Host(fence), AnyStream::Host(stream)) => {
                Ok(Paired::Host(fence, stream.handle()))
            }
            #[allow(unreachable_patterns)]
            _ => Err(ServerError::InvalidArgument {
                what,
                reason: format!(
                    "a {} fence cannot make a {} stream wait on the device: both must be of \
                     one backend",
                    self.backend(),
                    on.backend()
                ),
            }),
        }
    }

    /// A future on [`Waiter::global()`], as `fence.await`; on another waiter, `waiter.wait(fence)`.
    pub fn wait(self) -> AnyFenceFuture {
        Waiter::global().wait(self)
    }
}

enum Paired<'a> {
    #[cfg(feature = "cuda")]
    Cuda(&'a EventFence<Cuda>, crate::cuda::CudaStreamHandle),
    Host(&'a EventFence<Host>, crate::host::HostStreamHandle),
}

#[cfg(feature = "cuda")]
impl From<EventFence<Cuda>> for AnyFence {
    fn from(fence: EventFence<Cuda>) -> Self {
        Self::Cuda(fence)
    }
}

impl From<EventFence<Host>> for AnyFence {
    fn from(fence: EventFence<Host>) -> Self {
        Self::Host(fence)
    }
}

any_debug!(AnyFence(AnyFence));

/// The future of [`AnyFence::wait`] and `fence.await`, with [`FenceFuture`]'s errors.
///
/// # Cancel safety
///
/// As for [`FenceFuture`]: dropping it cancels the wait without blocking.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct AnyFenceFuture(Inner);

enum Inner {
    #[cfg(feature = "cuda")]
    Cuda(FenceFuture<Cuda>),
    Host(FenceFuture<Host>),
}

any_future!(AnyFence(AnyFence) => AnyFenceFuture(Inner) -> Result<(), ServerError>);
