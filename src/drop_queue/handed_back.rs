//! [`Rejected`] and [`HandedBack`]: values the queue gives back to the
//! caller, with their fences; the value must outlive its fence still.

use std::fmt;
use std::ops::Deref;

use super::fence::{settle, Fence};
use crate::ServerError;

/// Why a push was refused; the fence and value come back, and the value
/// must be kept alive until the fence passes.
///
/// Dropping it drops the value **at once**, while the device may still read
/// it: wait for the fence first, with [`wait_then_drop`](Self::wait_then_drop),
/// or take both back with [`into_inner`](Self::into_inner). To never hold a
/// refused value, push with [`DropQueue::push_blocking`](super::DropQueue::push_blocking) or
/// [`DropQueue::push_async`](super::DropQueue::push_async), which wait for room.
///
/// It is an error (`Display` and [`std::error::Error`]); propagating it with
/// `?` drops the value wherever the error ends, so do that only with values
/// no device work reads.
#[must_use = "dropping a Rejected drops its value now, while the device may still read it: \
              call wait_then_drop() or into_inner()"]
pub enum Rejected<F, T> {
    /// `capacity` values are already waiting.
    Full(F, T),
    /// The queue is shutting down.
    Closed(F, T),
}

impl<F, T> Rejected<F, T> {
    /// The fence and value that were refused.
    pub fn into_inner(self) -> (F, T) {
        match self {
            Self::Full(fence, value) | Self::Closed(fence, value) => (fence, value),
        }
    }
}

impl<F: Fence, T> Rejected<F, T> {
    /// Block until the fence has passed, then drop the value, as the queue
    /// would have.
    ///
    /// # Errors
    ///
    /// The fence failed: the value is leaked, not dropped (see
    /// [`DropQueue`](super::DropQueue)), and the error logged.
    pub fn wait_then_drop(self) -> Result<(), ServerError> {
        let (fence, value) = self.into_inner();
        settle(fence, value)
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

/// The values [`DropQueue::shutdown_now`](super::DropQueue::shutdown_now) handed back, with their fences, in
/// push order: none has passed yet.
///
/// Read them as a slice; take them over with [`into_vec`](Self::into_vec) or
/// by iterating (then keeping each value alive until its fence passes is
/// the caller's job); or let [`wait_then_drop`](Self::wait_then_drop), or
/// the drop, wait for each fence on this thread and drop its value (a value
/// whose fence fails is leaked, as in the queue).
#[must_use = "dropping the handed-back values blocks until each fence has passed; \
              keep them alive, or call wait_then_drop() where blocking is fine"]
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
            if let Err(err) = settle(fence, value) {
                if first.is_ok() {
                    first = Err(err);
                }
            }
        }
        first
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
    fn drop(&mut self) {
        for (fence, value) in self.entries.drain(..) {
            let _ = settle(fence, value);
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
