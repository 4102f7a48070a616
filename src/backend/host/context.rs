//! [`HostContext`]: the fault domain of host streams, as a CUDA context is of its streams.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use super::error;
use super::stream::{HostStream, StreamShared};
use crate::sync::Mutex;
use crate::ServerError;

/// A cheap handle to a group of host streams that a fault poisons as a whole, as a fault poisons a
/// CUDA context; clones name the same context.
///
/// The CUDA driver's rule for a fault such as an illegal address (`CUDA_ERROR_ILLEGAL_ADDRESS`,
/// driver API error codes): "This leaves the process in an inconsistent state and any further CUDA
/// work will return the same error. To continue using CUDA, the process must be terminated and
/// relaunched." So here, once work on any stream of a context panics, all its streams are faulted
/// for good: queued work never runs, pending records fail their waiters, and every later call and
/// new stream on the context returns [`ServerError::Faulted`]. Other contexts carry on, except a
/// stream waiting on a record the fault lost (the driver docs do not say; the stricter reading
/// keeps work that depends on lost work from running).
///
/// [`HostStream::new`] gives each stream a context of its own, so one panicking job does not break
/// every other test or pipeline; streams made with [`new_stream`](Self::new_stream) share one:
///
/// ```
/// use device_events::host::{HostContext, HostStream};
///
/// let context = HostContext::new();
/// let (a, b) = (context.new_stream()?, context.new_stream()?);
/// let alone = HostStream::new()?; // a context of its own
/// a.launch(|| panic!("illegal address"))?;
/// assert!(a.synchronize().unwrap_err().is_faulted());
/// assert!(b.synchronize().unwrap_err().is_faulted(), "the whole context");
/// assert!(context.new_stream().unwrap_err().is_faulted());
/// alone.synchronize()?; // another context carries on
/// HostStream::new()?.synchronize()?;
/// # Ok::<(), device_events::ServerError>(())
/// ```
///
/// An event is recorded only on its context's streams (`cuEventRecord`: "hEvent and hStream must
/// be from the same context otherwise CUDA_ERROR_INVALID_HANDLE is returned"); a stream may wait
/// on an event of any context (`cuStreamWaitEvent`: "hEvent may be from a different context or
/// device than hStream"); a profile across contexts is refused when read. So streams that share
/// events or profiles go on one context.
#[derive(Clone)]
pub struct HostContext {
    pub(super) shared: Arc<ContextShared>,
}

pub(super) struct ContextShared {
    pub(super) id: u64,
    /// The fork generation it was made in (see [`crate::os`]).
    generation: u64,
    /// The first fault's message; set once, never cleared.
    pub(super) fault: OnceLock<String>,
    /// The context's streams, to fault them all.
    streams: Mutex<Vec<Weak<StreamShared>>>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl HostContext {
    /// A new context, with no streams and no fault.
    #[allow(clippy::new_without_default)] // a new context is not a default one: see `primary`
    pub fn new() -> Self {
        Self {
            shared: Arc::new(ContextShared {
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                generation: crate::os::track_forks(),
                fault: OnceLock::new(),
                streams: Mutex::new(Vec::new()),
            }),
        }
    }

    /// One context for the whole process, as CUDA code shares a device's primary context: a panic
    /// on any of its streams faults them all for the rest of the process. [`HostStream::new`]
    /// does not use it: use `HostContext::primary().new_stream()`. A forked child gets its own.
    pub fn primary() -> Self {
        static PRIMARY: OnceLock<Mutex<HostContext>> = OnceLock::new();
        let mut primary = PRIMARY.get_or_init(|| Mutex::new(Self::new())).lock();
        if primary.shared.generation != crate::os::fork_generation() {
            *primary = Self::new();
        }
        primary.clone()
    }

    /// Start a stream on this context.
    ///
    /// # Errors
    ///
    /// [`ServerError::Faulted`] once the context is faulted; [`ServerError::ThreadSpawn`] when
    /// the operating system refused to start the stream's thread.
    pub fn new_stream(&self) -> Result<HostStream, ServerError> {
        HostStream::on(self)
    }

    /// Whether work on one of this context's streams has panicked.
    pub fn is_faulted(&self) -> bool {
        self.shared.fault.get().is_some()
    }
}

impl ContextShared {
    /// An error for `call` if the context was made before this process forked: its workers stayed
    /// in the parent, so a wait would never end.
    pub(super) fn not_forked(&self, call: &'static str) -> Result<(), ServerError> {
        if self.generation == crate::os::fork_generation() {
            return Ok(());
        }
        Err(error::call(
            call,
            error::INVALID_HANDLE,
            "the stream's context was made before this process forked: its worker threads \
             stayed in the parent, so its streams run nothing here; make streams in this process",
        ))
    }

    /// An error for `call` when the context is faulted, or was made before this process forked.
    pub(super) fn check(&self, call: &'static str) -> Result<(), ServerError> {
        self.not_forked(call)?;
        match self.fault.get() {
            Some(message) => Err(error::faulted(call, message.clone())),
            None => Ok(()),
        }
    }

    /// Count `stream` among the context's streams unless the context is faulted, checked under
    /// the lock [`poison`](Self::poison) takes: no stream joins a context being poisoned unseen.
    pub(super) fn join(&self, stream: &Arc<StreamShared>) -> Result<(), ServerError> {
        // Before the lock, which the parent may have held at a fork.
        self.not_forked("stream_create")?;
        let mut streams = self.streams.lock();
        self.check("stream_create")?;
        streams.retain(|stream| stream.strong_count() > 0);
        streams.push(Arc::downgrade(stream));
        Ok(())
    }

    /// A fault on one of the context's streams: fault them all; the first fault's message is kept.
    pub(super) fn poison(&self, message: String) {
        let streams: Vec<Arc<StreamShared>> = {
            let streams = self.streams.lock();
            // Set under the lock, so every stream that joined is in the list.
            let _ = self.fault.set(message);
            streams.iter().filter_map(Weak::upgrade).collect()
        };
        let message = self.fault.get().cloned().unwrap_or_default();
        for stream in streams {
            stream.fault_with(&message);
        }
    }
}

/// The same context: clones of one [`HostContext`].
impl PartialEq for HostContext {
    fn eq(&self, other: &Self) -> bool {
        self.shared.id == other.shared.id
    }
}

impl Eq for HostContext {}

impl fmt::Debug for HostContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostContext")
            .field("id", &self.shared.id)
            .field("faulted", &self.is_faulted())
            .finish()
    }
}
