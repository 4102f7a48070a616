//! [`DropQueueStats`]: what a queue has done and holds (named by the handle, its futures and the
//! shared state alike).

/// What a [`DropQueue`](super::DropQueue) has done (counters, since it was made) and holds
/// (gauges): [`DropQueue::stats`](super::DropQueue::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct DropQueueStats {
    /// Values taken in: accepted by a push, or given with a dropped
    /// [`Rejected`](super::Rejected) or [`PushFuture`](super::PushFuture).
    pub pushed: u64,
    /// Values dropped after their fence passed.
    pub dropped: u64,
    /// Values leaked because their fence failed, or had not passed when given to a queue whose
    /// thread had exited: kept for good, as a faulted device may still read their memory.
    pub leaked: u64,
    /// Values handed back by [`DropQueue::shutdown_now`](super::DropQueue::shutdown_now).
    pub handed_back: u64,
    /// Values waiting now (queued or being waited on); more than the capacity while values given
    /// with a dropped [`Rejected`](super::Rejected) wait.
    pub pending: usize,
    /// Of those, the ones the queue's thread has not taken up yet.
    pub queued: usize,
}

#[cfg(test)]
mod tests {
    use super::DropQueueStats;

    /// Each field is its own: `==` compares all six, `Debug` shows each under its name.
    #[test]
    fn every_field_counts_in_eq_and_debug() {
        let stats = DropQueueStats {
            pushed: 1,
            dropped: 2,
            leaked: 3,
            handed_back: 4,
            pending: 5,
            queued: 6,
        };
        assert_eq!(
            format!("{stats:?}"),
            "DropQueueStats { pushed: 1, dropped: 2, leaked: 3, handed_back: 4, pending: 5, \
             queued: 6 }"
        );
        for other in [
            DropQueueStats { pushed: 0, ..stats },
            DropQueueStats {
                dropped: 0,
                ..stats
            },
            DropQueueStats { leaked: 0, ..stats },
            DropQueueStats {
                handed_back: 0,
                ..stats
            },
            DropQueueStats {
                pending: 0,
                ..stats
            },
            DropQueueStats { queued: 0, ..stats },
        ] {
            assert_ne!(other, stats);
        }
    }
}
