//! [`AnyProfiler`]: device time between two points of an [`AnyStream`], on either backend.

use std::fmt;
use std::time::Duration;

use super::stream::AnyStream;
#[cfg(feature = "cuda")]
use crate::cuda::{Cuda, CudaStreamHandle};
use crate::host::Host;
use crate::{
    EventProfiler, Profile, ProfileFuture, ProfileStart, ProfilerStats, ServerError, Waiter,
    DEFAULT_PROFILER_CAPACITY,
};

/// Measures device time between two points of an [`AnyStream`], whichever its backend: an
/// [`EventProfiler`] per backend behind one type, whose pooling and rules it shares.
///
/// ```
/// use device_events::host::HostStream;
/// use device_events::{AnyProfiler, AnyStream};
/// use std::time::Duration;
///
/// let stream = AnyStream::from(HostStream::new()?);
/// let profiler = AnyProfiler::new();
/// let start = profiler.start(&stream)?;
/// if let AnyStream::Host(host) = &stream {
///     host.launch(|| std::thread::sleep(Duration::from_millis(2)))?;
/// }
/// let took = futures::executor::block_on(profiler.stop(start, &stream)?.wait())?;
/// assert!(took >= Duration::from_millis(2));
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct AnyProfiler {
    #[cfg(feature = "cuda")]
    cuda: EventProfiler<Cuda>,
    host: EventProfiler<Host>,
}

/// A started measurement for [`AnyProfiler::stop`], as [`ProfileStart`].
#[must_use = "a profile start measures nothing until it is stopped"]
pub struct AnyProfileStart(Start);

enum Start {
    #[cfg(feature = "cuda")]
    Cuda(ProfileStart<Cuda>),
    Host(ProfileStart<Host>),
}

/// A stopped measurement of [`AnyProfiler`], as [`Profile`].
#[must_use = "a profile is read with wait_sync() or .await"]
pub struct AnyProfile(Stopped);

enum Stopped {
    #[cfg(feature = "cuda")]
    Cuda(Profile<Cuda>),
    Host(Profile<Host>),
}

impl AnyProfiler {
    /// A profiler keeping up to [`DEFAULT_PROFILER_CAPACITY`] idle events per backend.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_PROFILER_CAPACITY)
    }

    /// A profiler keeping up to `capacity` idle events per backend (0 keeps none).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            #[cfg(feature = "cuda")]
            cuda: EventProfiler::with_capacity(capacity),
            host: EventProfiler::with_capacity(capacity),
        }
    }

    /// Record the start of a measurement at the current end of `stream`.
    ///
    /// # Errors
    ///
    /// As for [`EventProfiler::start`].
    pub fn start(&self, stream: &AnyStream) -> Result<AnyProfileStart, ServerError> {
        Ok(AnyProfileStart(match stream {
            #[cfg(feature = "cuda")]
            AnyStream::Cuda(cuda) => Start::Cuda(self.cuda.start(CudaStreamHandle::new(cuda))?),
            AnyStream::Host(host) => Start::Host(self.host.start(host.handle())?),
        }))
    }

    /// Record the end of `start` at the current end of `stream` (usually the stream it started on).
    ///
    /// # Errors
    ///
    /// As for [`EventProfiler::stop`]; and [`ServerError::InvalidArgument`], with nothing recorded,
    /// when `stream` is of another backend than the start's. Either way `start`'s event goes back
    /// to the pool.
    pub fn stop(
        &self,
        start: AnyProfileStart,
        stream: &AnyStream,
    ) -> Result<AnyProfile, ServerError> {
        Ok(AnyProfile(match (start.0, stream) {
            #[cfg(feature = "cuda")]
            (Start::Cuda(start), AnyStream::Cuda(cuda)) => {
                Stopped::Cuda(self.cuda.stop(start, CudaStreamHandle::new(cuda))?)
            }
            (Start::Host(start), AnyStream::Host(host)) => {
                Stopped::Host(self.host.stop(start, host.handle())?)
            }
            #[allow(unreachable_patterns)]
            (start, stream) => {
                return Err(ServerError::InvalidArgument {
                    what: "AnyProfiler::stop",
                    reason: format!(
                        "a profile started on a {} stream cannot stop on a {} stream: both \
                         must be of one backend",
                        match_backend!(&start, Start(_) => BACKEND),
                        stream.backend()
                    ),
                })
            }
        }))
    }

    /// [`EventProfiler::pooled`], both backends together.
    pub fn pooled(&self) -> usize {
        self.stats().pooled
    }

    /// [`EventProfiler::created`], both backends together.
    pub fn created(&self) -> usize {
        self.stats().created as usize
    }

    /// [`created`](Self::created) and [`pooled`](Self::pooled) together.
    pub fn stats(&self) -> ProfilerStats {
        #[allow(unused_mut)]
        let mut stats = self.host.stats();
        #[cfg(feature = "cuda")]
        {
            let cuda = self.cuda.stats();
            stats.created += cuda.created;
            stats.pooled += cuda.pooled;
        }
        stats
    }
}

impl Default for AnyProfiler {
    fn default() -> Self {
        Self::new()
    }
}

impl AnyProfileStart {
    /// The backend's name, `"Cuda"` or `"Host"`, as [`AnyStream::backend`].
    pub fn backend(&self) -> &'static str {
        match_backend!(&self.0, Start(_) => BACKEND)
    }
}

impl AnyProfile {
    /// The backend's name, `"Cuda"` or `"Host"`, as [`AnyStream::backend`].
    pub fn backend(&self) -> &'static str {
        match_backend!(&self.0, Stopped(_) => BACKEND)
    }

    /// [`Profile::wait_sync`].
    ///
    /// # Errors
    ///
    /// As for [`Profile::wait_sync`].
    pub fn wait_sync(self) -> Result<Duration, ServerError> {
        match_backend!(self.0, Stopped(profile) => profile.wait_sync())
    }

    /// A future on [`Waiter::global()`], as `profile.await`; on another waiter,
    /// `waiter.wait(profile)`.
    pub fn wait(self) -> AnyProfileFuture {
        Waiter::global().wait(self)
    }
}

/// The future of [`AnyProfile::wait`] and `profile.await`, with [`ProfileFuture`]'s errors.
///
/// # Cancel safety
///
/// As [`ProfileFuture`]: a drop cancels the wait without blocking; its events go back to the pool.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct AnyProfileFuture(Reading);

enum Reading {
    #[cfg(feature = "cuda")]
    Cuda(ProfileFuture<Cuda>),
    Host(ProfileFuture<Host>),
}

any_future!(AnyProfile.0(Stopped) => AnyProfileFuture(Reading) -> Result<Duration, ServerError>);
any_debug!(AnyProfileStart.0(Start), AnyProfile.0(Stopped));

impl fmt::Debug for AnyProfiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyProfiler")
            .field("pooled", &self.pooled())
            .field("created", &self.created())
            .finish()
    }
}
