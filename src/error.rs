//! The crate's one error type, what it may carry as its source, and the driver statuses the
//! crate acts on.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// Driver status codes this crate acts on or reports, named after the CUDA `CUresult` values they
/// mirror; the host backend reports the same codes, so one match serves both backends:
///
/// ```
/// use device_events::host::{Host, HostStream};
/// use device_events::{status, EventApi};
///
/// let stream = HostStream::new()?;
/// let handle = stream.handle();
/// drop(stream);
/// let err = Host::stream_synchronize(handle).unwrap_err();
/// assert_eq!(err.code(), Some(status::INVALID_HANDLE));
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub mod status {
    /// `CUDA_ERROR_INVALID_VALUE`: an argument is out of range.
    pub const INVALID_VALUE: i32 = 1;
    /// `CUDA_ERROR_INVALID_HANDLE`: a handle names nothing live (a dropped stream, an event of
    /// another context); `EventFence::wait_async` returns it, with no host wait.
    pub const INVALID_HANDLE: i32 = 400;
    /// `CUDA_ERROR_NOT_READY`: the work is not done yet (two events timed before both are reached).
    pub const NOT_READY: i32 = 600;
    /// `CUDA_ERROR_LAUNCH_FAILED`: what a faulted host stream reports (sticky, as on CUDA).
    pub const LAUNCH_FAILED: i32 = 719;
    /// `CUDA_ERROR_NOT_PERMITTED`: what a host stream's work gets for a wait on its own stream's
    /// later work (`HostStream::launch`).
    pub const NOT_PERMITTED: i32 = 800;
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`: a call not permitted while a stream captures a
    /// graph; the first stream-capture status.
    pub const STREAM_CAPTURE_UNSUPPORTED: i32 = 900;
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`: an earlier error invalidated the capture.
    pub const STREAM_CAPTURE_INVALIDATED: i32 = 901;
    /// `CUDA_ERROR_STREAM_CAPTURE_MERGE`: a wait would merge two independent captures.
    pub const STREAM_CAPTURE_MERGE: i32 = 902;
    /// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`: a capturing stream asked to wait on work outside it.
    pub const STREAM_CAPTURE_ISOLATION: i32 = 905;
    /// `CUDA_ERROR_CAPTURED_EVENT`: a query or wait of an event recorded during a capture.
    pub const CAPTURED_EVENT: i32 = 907;
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`: the last of the stream-capture statuses.
    pub const STREAM_CAPTURE_WRONG_THREAD: i32 = 908;
    /// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down (at process exit).
    pub const DEINITIALIZED: i32 = 4;
    /// `CUDA_ERROR_UNKNOWN`: a failure the driver does not name.
    pub const UNKNOWN: i32 = 999;
}

/// The cause a [`ServerError`] carries: an opaque `Arc`, so that [`ServerError`] stays `Clone`.
/// Like [`std::io::Error`] around a custom error, it shows its error's message and passes on that
/// error's [`source`](Error::source); [`get_ref`](Self::get_ref) and
/// [`downcast_ref`](Self::downcast_ref) reach the error itself.
///
/// Two sources are equal when the `Display` of the error and of each error in its source chain
/// are (types are not compared), and a clone is always equal to its original.
#[derive(Clone)]
pub struct ErrorSource(Arc<BoxedError>);

/// Boxed, so that an [`ErrorSource`] is one thin pointer: every `Result<_, ServerError>` has room
/// for one.
type BoxedError = Box<dyn Error + Send + Sync + 'static>;

impl ErrorSource {
    /// Wrap `error`; an `ErrorSource` given here is kept as it is, not wrapped twice.
    pub fn new<E: Error + Send + Sync + 'static>(error: E) -> Self {
        let any: &dyn std::any::Any = &error;
        match any.downcast_ref::<Self>() {
            Some(source) => source.clone(),
            None => Self(Arc::new(Box::new(error))),
        }
    }

    /// The error itself.
    pub fn get_ref(&self) -> &(dyn Error + Send + Sync + 'static) {
        &**self.0
    }

    /// The error itself, if it is an `E`: a `cudarc::driver::DriverError` (CUDA backend), a
    /// [`std::io::Error`] (thread spawn) or a [`ServerError`] (fallback).
    pub fn downcast_ref<E: Error + 'static>(&self) -> Option<&E> {
        self.get_ref().downcast_ref::<E>()
    }

    fn messages(&self) -> impl Iterator<Item = String> + '_ {
        let mut next: Option<&(dyn Error + 'static)> = Some(self.get_ref());
        std::iter::from_fn(move || {
            let error = next?;
            next = error.source();
            Some(error.to_string())
        })
    }
}

impl fmt::Debug for ErrorSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.get_ref(), f)
    }
}

impl fmt::Display for ErrorSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.get_ref(), f)
    }
}

impl Error for ErrorSource {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.get_ref().source()
    }
}

impl PartialEq for ErrorSource {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.messages().eq(other.messages())
    }
}

impl Eq for ErrorSource {}

// A source is only read, never changed, so a panic cannot leave one half-updated (as
// `anyhow::Error` and `std::io::Error`).
impl std::panic::UnwindSafe for ErrorSource {}
impl std::panic::RefUnwindSafe for ErrorSource {}

/// What went wrong when creating, recording or waiting on a device event.
///
/// Each variant says what to do: retry elsewhere when [`Unavailable`](Self::Unavailable), report
/// a failed [`Call`](Self::Call), rebuild the device or stream when [`Faulted`](Self::Faulted)
/// (sticky), or rebuild the waiter when it is gone.
///
/// [`Call`](Self::Call), [`Faulted`](Self::Faulted) and [`ThreadSpawn`](Self::ThreadSpawn) may
/// carry a [`source`](std::error::Error::source) ([`ErrorSource`]): the backend's own error (a
/// cudarc `DriverError`), the operating system's [`std::io::Error`], or the failure a fallback
/// could not recover from (see [`EventFence::fallback_cause`](crate::EventFence::fallback_cause)).
/// They are `#[non_exhaustive]`: build them with [`call`](Self::call), [`faulted`](Self::faulted)
/// and [`thread_spawn`](Self::thread_spawn), and match them with `..`. `code` fields carry the
/// driver's status code, the same on both backends ([`status`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// No driver, no device, or a driver too old for a call this crate makes.
    #[error("{backend} is unavailable: {reason}")]
    Unavailable {
        /// The backend that was asked for, e.g. `"Cuda"`.
        backend: &'static str,
        /// Why, in words: the library that was not found, the missing symbol.
        reason: String,
    },
    /// A driver call failed; the device and stream may still be usable: report it, or retry.
    #[error("{backend} call {call} failed: {name} ({code}): {message}")]
    #[non_exhaustive]
    Call {
        /// The backend whose call failed.
        backend: &'static str,
        /// The driver function, e.g. `"cuEventRecord"`.
        call: &'static str,
        /// The driver's status code.
        code: i32,
        /// The status's name, e.g. `"CUDA_ERROR_INVALID_HANDLE"`.
        name: String,
        /// The driver's description of the status.
        message: String,
        /// The cause, when known.
        #[source]
        source: Option<ErrorSource>,
    },
    /// The device or stream is faulted for good: every later call on it returns this again.
    /// Rebuild the context (on CUDA, restart the process; on the host, its
    /// [`HostContext`](crate::host::HostContext)).
    #[error("{backend} is faulted ({call}): {name} ({code}): {message}")]
    #[non_exhaustive]
    Faulted {
        /// The backend that reported the fault.
        backend: &'static str,
        /// The call that observed the fault.
        call: &'static str,
        /// The driver's status code.
        code: i32,
        /// The status's name, e.g. `"CUDA_ERROR_ILLEGAL_ADDRESS"`.
        name: String,
        /// The driver's description of the status, or the panic message.
        message: String,
        /// The cause, when known.
        #[source]
        source: Option<ErrorSource>,
    },
    /// The waiter serving this wait was shut down before the wait resolved.
    #[error(
        "the waiter was shut down before this wait resolved: await through a waiter that is \
         still running (Waiter::global() never shuts down)"
    )]
    WaiterGone,
    /// The operating system refused a thread this crate needs. Not
    /// [`Unavailable`](Self::Unavailable): the device may be fine, so do not fall back to the CPU;
    /// retry later, or with fewer threads.
    #[error("{component} could not start a thread: {reason}")]
    #[non_exhaustive]
    ThreadSpawn {
        /// What needed the thread: `"Waiter"`, `"DropQueue"` or `"HostStream"`.
        component: &'static str,
        /// The operating system's answer.
        reason: String,
        /// The operating system's error, when there was one.
        #[source]
        source: Option<ErrorSource>,
    },
    /// An argument or setting this crate cannot work with: the caller's bug, not the driver's.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// What was given, e.g. `"Waiter thread_name"`.
        what: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
    /// The waiter was made before this process forked, and its threads stayed in the parent
    /// ([`Waiter::global()`](crate::Waiter::global) is made afresh in each child).
    #[error(
        "the waiter was made before this process forked, and its threads stayed in the parent: \
         make a new Waiter in the child (Waiter::global() is made afresh there)"
    )]
    WaiterForked,
    /// A measurement's stop was reached before its start (on another stream). CUDA's
    /// `cuEventElapsedTime` gives a negative time; a zero `Duration` would pass for a real one.
    #[error("{backend}: the stop was reached {by:?} before the start")]
    StopBeforeStart {
        /// The backend whose events were timed.
        backend: &'static str,
        /// How much earlier the stop was reached.
        by: std::time::Duration,
    },
    /// The driver was shut down (at process exit, while the waiter's threads may still run) and
    /// answers every call with [`status::DEINITIALIZED`]. Terminal: once one call saw it, the
    /// backend makes no more driver calls; each returns this at once, and pending waits fail.
    #[error(
        "{backend} call {call} refused: the driver was shut down (at process exit, say), \
         and no more calls are made to it"
    )]
    ShutDown {
        /// The backend whose driver was shut down.
        backend: &'static str,
        /// The call that failed, or was refused without reaching the driver.
        call: &'static str,
    },
    /// A backend call (an outside [`EventApi`](crate::EventApi), say) panicked on a waiter
    /// thread, which serves on; the stream is in whatever state the panic left it.
    #[error("a waiter thread panicked: {message}")]
    WaiterPanicked {
        /// The panic's payload, when it was a string.
        message: String,
    },
    /// A [`drop_queue::Fence`](crate::drop_queue::Fence)'s
    /// [`wait_blocking`](crate::drop_queue::Fence::wait_blocking) panicked (on the queue's thread
    /// or in `wait_then_drop`): its value was leaked; the queue serves on.
    #[error("a drop queue's fence panicked: {message}")]
    DropQueuePanicked {
        /// The panic's payload, when it was a string.
        message: String,
    },
}

impl ServerError {
    /// Whether the device or stream is faulted for good (sticky).
    pub fn is_faulted(&self) -> bool {
        matches!(self, Self::Faulted { .. })
    }

    /// Whether this is a stream-capture status ([`status::STREAM_CAPTURE_UNSUPPORTED`] to
    /// [`status::STREAM_CAPTURE_WRONG_THREAD`], 900 to 908). The crate never falls back on one (a
    /// host wait or a stream synchronize would invalidate the capture); it returns it.
    ///
    /// ```
    /// use device_events::{status, ServerError};
    ///
    /// let err = ServerError::call("Cuda", "cuEventQuery", status::CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT", "");
    /// assert!(err.is_stream_capture());
    /// assert!(!ServerError::call("Cuda", "cuEventQuery", status::INVALID_HANDLE, "", "").is_stream_capture());
    /// ```
    pub fn is_stream_capture(&self) -> bool {
        self.code().is_some_and(|code| {
            (status::STREAM_CAPTURE_UNSUPPORTED..=status::STREAM_CAPTURE_WRONG_THREAD)
                .contains(&code)
        })
    }

    /// Whether the backend's driver was shut down ([`ShutDown`](Self::ShutDown)).
    pub fn is_shut_down(&self) -> bool {
        matches!(self, Self::ShutDown { .. })
    }

    /// Whether the backend has no driver or device here.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }

    /// The driver's status code, for the variants that carry one (see [`status`]).
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Call { code, .. } | Self::Faulted { code, .. } => Some(*code),
            Self::ShutDown { .. } => Some(status::DEINITIALIZED),
            _ => None,
        }
    }

    /// A failed call ([`Call`](Self::Call)), with no source.
    pub fn call(
        backend: &'static str,
        call: &'static str,
        code: i32,
        name: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::Call {
            backend,
            call,
            code,
            name: name.into(),
            message: message.into(),
            source: None,
        }
    }

    /// A sticky fault ([`Faulted`](Self::Faulted)), with no source.
    pub fn faulted(
        backend: &'static str,
        call: &'static str,
        code: i32,
        name: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::Faulted {
            backend,
            call,
            code,
            name: name.into(),
            message: message.into(),
            source: None,
        }
    }

    /// A thread `component` needed could not be started ([`ThreadSpawn`](Self::ThreadSpawn)):
    /// the operating system's `error` is its reason and its source.
    pub fn thread_spawn(component: &'static str, error: std::io::Error) -> Self {
        Self::ThreadSpawn {
            component,
            reason: error.to_string(),
            source: Some(ErrorSource::new(error)),
        }
    }

    /// This error with `source` as its [`source`](std::error::Error::source), replacing any it
    /// had; variants that carry none are returned unchanged.
    ///
    /// The source's `Display` runs whenever the error is shown or compared: a cudarc
    /// `DriverError` asks the driver for its text, and panics where no driver library is loaded,
    /// so attach one only once the driver is.
    #[must_use]
    pub fn with_source<E: Error + Send + Sync + 'static>(mut self, source: E) -> Self {
        if let Self::Call { source: slot, .. }
        | Self::Faulted { source: slot, .. }
        | Self::ThreadSpawn { source: slot, .. } = &mut self
        {
            *slot = Some(ErrorSource::new(source));
        }
        self
    }

    /// [`source`](std::error::Error::source), typed, for the variants that carry one.
    pub fn error_source(&self) -> Option<&ErrorSource> {
        match self {
            Self::Call { source, .. }
            | Self::Faulted { source, .. }
            | Self::ThreadSpawn { source, .. } => source.as_ref(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::{status, ErrorSource, ServerError};

    /// What each variant's helpers and `Display` promise.
    #[test]
    fn the_helpers_answer_for_each_variant_as_documented() {
        let call = |code| ServerError::call("Cuda", "cuEventQuery", code, "N", "m");
        for (code, capture) in [(899, false), (900, true), (908, true), (909, false)] {
            assert_eq!(call(code).is_stream_capture(), capture, "{code}");
        }
        let faulted = ServerError::faulted("Host", "event_query", 700, "FAULT", "it broke");
        assert!(faulted.is_faulted());
        let shown = faulted.to_string();
        assert!(
            shown.contains("(event_query)") && shown.contains("it broke"),
            "{shown}"
        );
        let shut_down = ServerError::ShutDown {
            backend: "Cuda",
            call: "cuEventQuery",
        };
        assert!(!shut_down.is_faulted() && shut_down.is_shut_down());
        assert_eq!(shut_down.code(), Some(status::DEINITIALIZED));
        let os = std::io::Error::other("spawn refused");
        let spawn = ServerError::thread_spawn("Waiter", os).with_source(std::fmt::Error);
        let source = spawn.error_source().expect("a source");
        assert!(
            source.downcast_ref::<std::fmt::Error>().is_some(),
            "{source}"
        );
    }

    /// Two sources are equal when every message of their chains is.
    #[test]
    fn sources_with_the_same_message_and_another_cause_differ() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let with = |inner| ErrorSource::new(Outer(std::io::Error::other(inner)));
        assert_eq!(with("a"), with("a"));
        assert_ne!(with("a"), with("b"));
    }

    #[test]
    fn errors_are_send_sync_and_unwind_safe_with_a_source() {
        fn traits<T: Send + Sync + std::panic::UnwindSafe + std::panic::RefUnwindSafe>(_: &T) {}
        let err = ServerError::call("Host", "event_record", status::UNKNOWN, "n", "m")
            .with_source(std::io::Error::other("inner"));
        traits(&err);
        let caught = std::panic::catch_unwind(|| err.to_string());
        assert!(caught.is_ok_and(|text| text.contains("event_record")));
    }

    #[test]
    fn a_thread_spawn_keeps_the_operating_systems_error_as_its_source() {
        let os = std::io::Error::new(std::io::ErrorKind::WouldBlock, "too many threads");
        let err = ServerError::thread_spawn("Waiter", os);
        assert_eq!(
            err.to_string(),
            "Waiter could not start a thread: too many threads"
        );
        let source = err.error_source().expect("a source");
        let io = source
            .downcast_ref::<std::io::Error>()
            .expect("an io::Error");
        assert_eq!(io.kind(), std::io::ErrorKind::WouldBlock);
        assert_eq!(
            err.source().map(|s| s.to_string()),
            Some("too many threads".into())
        );
    }

    #[test]
    fn with_source_chains_errors_and_skips_variants_without_one() {
        let first = ServerError::call("Host", "event_create", status::INVALID_HANDLE, "x", "y");
        let second = ServerError::faulted("Host", "sync", status::LAUNCH_FAILED, "a", "b")
            .with_source(first.clone());
        assert_eq!(
            second.source().map(|s| s.to_string()),
            Some(first.to_string())
        );
        assert_eq!(
            second
                .error_source()
                .and_then(|s| s.downcast_ref::<ServerError>()),
            Some(&first)
        );
        assert!(first.source().is_none());
        assert_eq!(
            ServerError::WaiterGone.with_source(first),
            ServerError::WaiterGone
        );
    }

    #[test]
    fn an_error_source_is_not_wrapped_twice() {
        let source = ErrorSource::new(std::io::Error::other("inner"));
        let again = ErrorSource::new(source.clone());
        assert!(again.downcast_ref::<std::io::Error>().is_some());
    }

    #[test]
    fn sources_compare_by_their_messages() {
        let a = ServerError::call("Host", "c", 1, "n", "m");
        let with = |message: &str| {
            a.clone()
                .with_source(std::io::Error::other(message.to_owned()))
        };
        assert_eq!(with("x"), with("x"));
        assert_ne!(with("x"), with("y"));
        assert_ne!(with("x"), a);
        let shared = with("x");
        assert_eq!(shared.clone(), shared);
    }
}
