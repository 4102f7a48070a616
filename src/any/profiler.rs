//! [`AnyProfiler`]: device time between two points of an [`AnyStream`], on
//! either backend, beside [`AnyStream`] and [`AnyFence`](crate::AnyFence).

use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::FusedFuture;

use super::stream::AnyStream;
#[cfg(feature = "cuda")]
use crate::cuda::{Cuda, CudaStreamHandle};
use crate::host::Host;
use crate::{
    EventProfiler, Profile, ProfileFuture, ProfileStart, ProfilerStats, ServerError, Waiter,
    DEFAULT_PROFILER_CAPACITY,
};

/// Measures device time between two points of an [`AnyStream`], whichever its backend: an
/// [`EventProfiler`] per backend behind one type, so code written against `AnyStream` times its
/// stages without knowing where they run.
///
/// [`start`](Self::start) and [`stop`](Self::stop) take the stream by reference; the [`AnyProfile`]
/// they give is read by [`wait_sync`](AnyProfile::wait_sync) or `.await`. Events are pooled as in
/// [`EventProfiler`], per backend and per context, so one profiler serves every device and host
/// stream it is given; as there, a profile's start and stop must be on streams of one context.
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

/// A started measurement of [`AnyProfiler`]; pass it to [`AnyProfiler::stop`] with a stream of the
/// same backend. Dropping it returns its event to the pool.
#[must_use = "a profile start measures nothing until it is stopped"]
pub struct AnyProfileStart(Start);

enum Start {
    #[cfg(feature = "cuda")]
    Cuda(ProfileStart<Cuda>),
    Host(ProfileStart<Host>),
}

/// A stopped measurement of [`AnyProfiler`]: the device time from start to stop, read with
/// [`wait_sync`](Self::wait_sync) or `.await`; see [`Profile`].
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
    /// when `stream` is of another backend than the start's (a device cannot time one backend's
    /// event against another's). Either way `start`'s event goes back to the pool.
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

    /// Idle events in the pools now, both backends together.
    pub fn pooled(&self) -> usize {
        #[cfg(feature = "cuda")]
        let cuda = self.cuda.pooled();
        #[cfg(not(feature = "cuda"))]
        let cuda = 0;
        cuda + self.host.pooled()
    }

    /// Events this profiler has created in all, both backends together (a
    /// loop that stops growing this allocates no events).
    pub fn created(&self) -> usize {
        #[cfg(feature = "cuda")]
        let cuda = self.cuda.created();
        #[cfg(not(feature = "cuda"))]
        let cuda = 0;
        cuda + self.host.created()
    }

    /// [`created`](Self::created) and [`pooled`](Self::pooled) together, both backends.
    pub fn stats(&self) -> ProfilerStats {
        ProfilerStats {
            created: self.created() as u64,
            pooled: self.pooled(),
        }
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

    /// Block until the device reached both the start and the stop; the
    /// device time from start to stop. See [`Profile::wait_sync`].
    ///
    /// # Errors
    ///
    /// As for [`Profile::wait_sync`].
    pub fn wait_sync(self) -> Result<Duration, ServerError> {
        match_backend!(self.0, Stopped(profile) => profile.wait_sync())
    }

    /// A future of the device time, served by [`Waiter::global()`]; the
    /// same as `profile.await`. On another waiter: `waiter.wait(profile)`.
    pub fn wait(self) -> AnyProfileFuture {
        Waiter::global().wait(self)
    }
}

impl crate::waiter::sealed::Sealed for AnyProfile {}

impl crate::waiter::Awaitable for AnyProfile {
    type Future = AnyProfileFuture;

    fn wait_on(self, waiter: &Waiter) -> AnyProfileFuture {
        AnyProfileFuture(match self.0 {
            #[cfg(feature = "cuda")]
            Stopped::Cuda(profile) => Reading::Cuda(waiter.wait(profile)),
            Stopped::Host(profile) => Reading::Host(waiter.wait(profile)),
        })
    }
}

impl IntoFuture for AnyProfile {
    type Output = Result<Duration, ServerError>;
    type IntoFuture = AnyProfileFuture;

    fn into_future(self) -> AnyProfileFuture {
        self.wait()
    }
}

/// The future of [`AnyProfile::wait`] and `profile.await`; see
/// [`ProfileFuture`], whose errors and cancel safety it shares.
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

impl Future for AnyProfileFuture {
    type Output = Result<Duration, ServerError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match_backend!(&mut self.get_mut().0, Reading(future) => Pin::new(future).poll(cx))
    }
}

impl FusedFuture for AnyProfileFuture {
    fn is_terminated(&self) -> bool {
        match_backend!(&self.0, Reading(future) => future.is_terminated())
    }
}

impl fmt::Debug for AnyProfiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnyProfiler")
            .field("pooled", &self.pooled())
            .field("created", &self.created())
            .finish()
    }
}

impl fmt::Debug for AnyProfileStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match_backend!(&self.0, Start(start) => start.fmt(f))
    }
}

impl fmt::Debug for AnyProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match_backend!(&self.0, Stopped(profile) => profile.fmt(f))
    }
}

impl fmt::Debug for AnyProfileFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match_backend!(&self.0, Reading(future) => future.fmt(f))
    }
}
