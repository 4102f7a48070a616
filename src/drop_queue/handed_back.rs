//! [`Rejected`] and [`HandedBack`]: values handed back with fences they must still outlive.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use super::fence::{drop_if_passed, settle, Fence};
use super::shared::Adopt;
use crate::{panics, ServerError};

/// Why a push was refused, with the fence and value ([`Refused`]).
///
/// Take both back with [`into_inner`](Self::into_inner) (then keeping the value alive until the
/// fence passes is the caller's job), or wait here with [`wait_then_drop`](Self::wait_then_drop).
/// Ignored (dropped, `.ok()`, `?`), it never frees the value early and never blocks (see
/// `# Drop`).
///
/// ```
/// use device_events::drop_queue::{DropQueue, Rejected};
/// use device_events::host::HostStream;
///
/// let stream = HostStream::new()?;
/// let (done, copied) = std::sync::mpsc::channel::<()>();
/// stream.launch(move || {
///     let _ = copied.recv(); // a copy that still reads the buffers
/// })?;
/// let queue = DropQueue::new(1)?;
/// queue.push(stream.fence(), vec![0u8; 64])?;
/// let refused = queue.push(stream.fence(), vec![1u8; 64]);
/// assert!(matches!(refused, Err(Rejected::Full(_))));
/// drop(refused); // not freed: queued past the capacity
/// assert_eq!(queue.stats().pending, 2);
/// drop(done);
/// queue.flush();
/// assert_eq!(queue.stats().dropped, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Drop
///
/// Dropping it (or the [`Refused`] inside) returns at once, panicking thread or not: the value is
/// queued all the same, past the capacity, even while the queue closes. Once the queue's thread
/// has exited, the value is dropped there and then if its fence has passed, else leaked (counted
/// in [`leaked`](super::DropQueueStats::leaked)), never freed early.
#[must_use = "dropping a Rejected queues its value past the queue's capacity; \
              into_inner() takes it back"]
pub enum Rejected<F, T> {
    /// `capacity` values are already waiting.
    Full(Refused<F, T>),
    /// The queue is shutting down.
    Closed(Refused<F, T>),
}

/// A refused push's fence and value; see [`Rejected`], whose `# Drop` says what dropping it does.
pub struct Refused<F, T> {
    entry: Option<(F, T)>,
    queue: Arc<dyn Adopt<F, T>>,
}

impl<F, T> Rejected<F, T> {
    pub(super) fn full(queue: Arc<dyn Adopt<F, T>>, fence: F, value: T) -> Self {
        Self::Full(Refused::new(queue, fence, value))
    }

    pub(super) fn closed(queue: Arc<dyn Adopt<F, T>>, fence: F, value: T) -> Self {
        Self::Closed(Refused::new(queue, fence, value))
    }

    /// The fence and value, for the caller to keep alive until the fence passes.
    pub fn into_inner(self) -> (F, T) {
        match self {
            Self::Full(refused) | Self::Closed(refused) => refused.into_inner(),
        }
    }
}

impl<F: Fence, T> Rejected<F, T> {
    /// Block until the fence has passed, then drop the value, as the queue would have.
    ///
    /// # Errors
    ///
    /// The fence failed: the value is leaked, not dropped, and the error logged.
    pub fn wait_then_drop(self) -> Result<(), ServerError> {
        match self {
            Self::Full(refused) | Self::Closed(refused) => refused.wait_then_drop(),
        }
    }
}

impl<F, T> Refused<F, T> {
    fn new(queue: Arc<dyn Adopt<F, T>>, fence: F, value: T) -> Self {
        Self {
            entry: Some((fence, value)),
            queue,
        }
    }

    /// As [`Rejected::into_inner`].
    pub fn into_inner(mut self) -> (F, T) {
        self.entry.take().expect("taken only here and by the drop")
    }
}

impl<F: Fence, T> Refused<F, T> {
    /// As [`Rejected::wait_then_drop`]: block until the fence has passed, then drop the value.
    ///
    /// ```
    /// use device_events::drop_queue::{DropQueue, Rejected};
    /// use device_events::host::HostStream;
    ///
    /// let stream = HostStream::new()?;
    /// let queue = DropQueue::new(1)?;
    /// queue.push(stream.fence(), vec![0u8; 64])?;
    /// if let Err(Rejected::Full(refused)) = queue.push(stream.fence(), vec![1u8; 64]) {
    ///     refused.wait_then_drop()?; // here, not on the queue's thread
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The fence failed: the value is leaked, not dropped, and the error logged.
    pub fn wait_then_drop(self) -> Result<(), ServerError> {
        let (fence, value) = self.into_inner();
        settle(fence, value)
    }
}

impl<F, T> Drop for Refused<F, T> {
    fn drop(&mut self) {
        if let Some((fence, value)) = self.entry.take() {
            self.queue.adopt(fence, value);
        }
    }
}

impl<F, T> fmt::Display for Rejected<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Full(..) => "the drop queue is full: its capacity of values are waiting",
            Self::Closed(..) => "the drop queue is shutting down",
        })
    }
}

impl<F, T> std::error::Error for Rejected<F, T> {}

/// The values [`DropQueue::shutdown_now`](super::DropQueue::shutdown_now) handed back with their
/// fences, in push order, none passed yet: a slice. Take them over with
/// [`into_vec`](Self::into_vec) or by iterating (then keeping each alive until its fence passes is
/// the caller's job), or let [`wait_then_drop`](Self::wait_then_drop), or the drop, wait for each
/// fence here and drop its value (leaking it if the fence fails).
///
/// # Drop
///
/// - **Normally**, dropping it **blocks** as [`wait_then_drop`](Self::wait_then_drop) does: each
///   value is dropped once its fence has passed, and leaked (never dropped), with an error
///   logged, if its fence fails.
/// - **While the dropping thread panics** ([`std::thread::panicking`]), it returns at once: each
///   value whose fence has already passed ([`Fence::is_passed`]) is dropped, and the rest are
///   **leaked**, with one warning that says how many. Waiting could hang the unwind for good (a
///   failing test holding the values over work it holds back itself), and freeing a value whose
///   fence has not passed could let the device read freed memory.
#[must_use = "dropping the handed-back values blocks until each fence has passed \
              (while panicking, it leaks those not passed); keep them alive, \
              or call wait_then_drop() where blocking is fine"]
pub struct HandedBack<F: Fence, T> {
    pub(super) entries: Vec<(F, T)>,
}

impl<F: Fence, T> HandedBack<F, T> {
    /// The fences and values, for the caller to keep alive.
    pub fn into_vec(mut self) -> Vec<(F, T)> {
        std::mem::take(&mut self.entries)
    }

    /// Block until each fence has passed, dropping its value as it does.
    ///
    /// # Errors
    ///
    /// The first fence that failed; every failed fence's value is leaked.
    pub fn wait_then_drop(mut self) -> Result<(), ServerError> {
        let mut first = Ok(());
        for (fence, value) in std::mem::take(&mut self.entries) {
            first = first.and(settle(fence, value));
        }
        first
    }

    /// The values dropped by a panicking thread (see [`HandedBack`]'s `# Drop`).
    fn drop_passed_leak_rest(&mut self) {
        let mut dropped = 0;
        let mut leaked = 0;
        for (fence, value) in self.entries.drain(..) {
            if drop_if_passed(fence, value) {
                dropped += 1;
            } else {
                leaked += 1;
            }
        }
        if leaked > 0 {
            panics::log(|| {
                log::warn!(
                    "a HandedBack dropped during a panic does not wait for its fences: it \
                     dropped the {dropped} value(s) whose fence had passed, and leaks the \
                     other {leaked} rather than free memory the device may still read"
                );
            });
        }
    }
}

impl<F: Fence, T> Deref for HandedBack<F, T> {
    type Target = [(F, T)];

    fn deref(&self) -> &[(F, T)] {
        &self.entries
    }
}

impl<F: Fence, T> IntoIterator for HandedBack<F, T> {
    type Item = (F, T);
    type IntoIter = std::vec::IntoIter<(F, T)>;

    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl<F: Fence, T> Drop for HandedBack<F, T> {
    /// See [`HandedBack`]'s `# Drop`: waits, unless this thread panics.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.drop_passed_leak_rest();
        } else {
            for (fence, value) in self.entries.drain(..) {
                let _ = settle(fence, value);
            }
        }
    }
}

impl<F: Fence, T> fmt::Debug for HandedBack<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandedBack")
            .field("len", &self.entries.len())
            .finish()
    }
}

impl<F, T> fmt::Debug for Rejected<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Full(..) => "Rejected::Full",
            Self::Closed(..) => "Rejected::Closed",
        })
    }
}

impl<F, T> fmt::Debug for Refused<F, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Refused").finish_non_exhaustive()
    }
}
