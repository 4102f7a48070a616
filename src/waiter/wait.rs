//! [`Wait`]: one pending wait, and its [`Place`] in its lane.

use super::slot::Slot;
use super::waitable::{LaneKey, Waitable};
use crate::sync::Arc;

/// A wait's place in its lane: ordered by its sequence in its stream, then by its hand-off's ticket
/// (so a backend whose numbers repeat loses no wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Place {
    pub(crate) sequence: u64,
    pub(crate) ticket: u64,
}

/// One pending wait: what to wait on and where its result goes.
pub(crate) struct Wait {
    /// Shared with the watcher while it watches the wait.
    pub(crate) waitable: std::sync::Arc<dyn Waitable>,
    pub(crate) slot: Arc<Slot>,
    pub(crate) lane: LaneKey,
    pub(crate) place: Place,
    /// Its stream's name while stuck streams are reported (made before the hand-off: the backend's
    /// `Debug`).
    pub(crate) name: Option<std::sync::Arc<str>>,
}

impl Wait {
    pub(crate) fn new(
        waitable: std::sync::Arc<dyn Waitable>,
        slot: Arc<Slot>,
        lane: LaneKey,
        name: Option<std::sync::Arc<str>>,
    ) -> Self {
        let place = Place {
            sequence: waitable.sequence(),
            ticket: 0,
        };
        Self {
            waitable,
            slot,
            lane,
            place,
            name,
        }
    }
}
