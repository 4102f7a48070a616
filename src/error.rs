//! The crate's one error type.

/// What went wrong when creating, recording or waiting on a device event.
///
/// Every variant is one a caller can act on: retry elsewhere when the driver is
/// [`Unavailable`](Self::Unavailable), report a failed [`Call`](Self::Call),
/// rebuild the device or stream when it is [`Faulted`](Self::Faulted) (which is
/// sticky: every later call on it fails the same way), or rebuild the waiter
/// when it is gone.
///
/// Its [`source`](std::error::Error::source) is `None`: the variants carry
/// the driver's own status (a number and its name, not a Rust error), and
/// they are plain data that backends outside this crate construct. Where one
/// failure led to another (a fence whose event was refused and whose stream
/// could not be synchronized either), the first is kept by the fence:
/// [`EventFence::fallback_cause`](crate::EventFence::fallback_cause).
///
/// `code` fields carry the driver's status code. The host backend reuses the
/// CUDA code with the same meaning (`400` for an invalid handle, `719` for a
/// fault), so a caller can match one set of codes for both backends.
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
    /// A driver call failed; the device and stream may still be usable.
    #[error("{backend} call {call} failed: {name} ({code}): {message}")]
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
    },
    /// The device or stream hit a fault and stays faulted: every later call on
    /// it returns this error again.
    #[error("{backend} is faulted ({call}): {name} ({code}): {message}")]
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
    },
    /// The waiter serving this wait was shut down before the wait resolved.
    #[error(
        "the waiter was shut down before this wait resolved: await through a waiter that is \
         still running (Waiter::global() never shuts down)"
    )]
    WaiterGone,
    /// A thread this crate needs could not be started (the operating system
    /// refused: too many threads, say). Not [`Unavailable`](Self::Unavailable):
    /// the driver and device may be fine, so falling back to the CPU would be
    /// the wrong answer; retry later, or with fewer threads.
    #[error("{component} could not start a thread: {reason}")]
    ThreadSpawn {
        /// What needed the thread: `"Waiter"`, `"DropQueue"` or `"HostStream"`.
        component: &'static str,
        /// The operating system's answer.
        reason: String,
    },
    /// An argument or setting this crate cannot work with, refused where it
    /// was given: the caller's bug, not the driver's.
    #[error("invalid {what}: {reason}")]
    InvalidArgument {
        /// What was given, e.g. `"Waiter thread_name"`.
        what: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
    /// The waiter was made before this process forked: its threads stayed
    /// in the parent. A child makes a waiter of its own (and
    /// [`Waiter::global()`](crate::Waiter::global) is made afresh in each
    /// child).
    #[error(
        "the waiter was made before this process forked, and its threads stayed in the parent: \
         make a new Waiter in the child (Waiter::global() is made afresh there)"
    )]
    WaiterForked,
    /// A measurement's stop was reached before its start (they were on
    /// different streams, and the stop's stream got there first): there is
    /// no device time from start to stop. CUDA's `cuEventElapsedTime` gives
    /// a negative time here; a `Duration` cannot be negative, and a zero
    /// would pass for a real one.
    #[error("{backend}: the stop was reached {by:?} before the start")]
    StopBeforeStart {
        /// The backend whose events were timed.
        backend: &'static str,
        /// How much earlier the stop was reached.
        by: std::time::Duration,
    },
    /// A backend call made on a waiter thread panicked; the waiter keeps
    /// serving other waits.
    #[error("a waiter thread panicked: {message}")]
    WaiterPanicked {
        /// The panic's payload, when it was a string.
        message: String,
    },
}

impl ServerError {
    /// Whether the device or stream is faulted for good (sticky).
    pub fn is_faulted(&self) -> bool {
        matches!(self, Self::Faulted { .. })
    }

    /// Whether the backend has no driver or device here.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }

    /// The driver's status code, for the variants that carry one.
    pub fn code(&self) -> Option<i32> {
        match self {
            Self::Call { code, .. } | Self::Faulted { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The error a panic payload becomes: its message when it is a string.
    pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
        if let Some(message) = payload.downcast_ref::<&'static str>() {
            (*message).to_owned()
        } else if let Some(message) = payload.downcast_ref::<String>() {
            message.clone()
        } else {
            "a panic with a non-string payload".to_owned()
        }
    }
}
