//! [`Shard`]: a share of the waiter's lanes behind one lock, and the
//! [`Wait`]s in them. Work on streams in different shards never touches the
//! same lock.

use std::collections::{btree_map, BTreeMap, VecDeque};

use super::checked::Invariants;
use super::slot::Slot;
use super::stuck::{LaneWatch, StuckReports};
use super::waitable::{LaneKey, Waitable};
use crate::loom::Arc;
use crate::ServerError;

/// How many shards the lanes are spread over: a power of two. Two under
/// loom, whose models use lanes 0 and 1, one in each.
pub(super) const SHARDS: usize = if cfg!(device_events_loom) { 2 } else { 16 };

/// One shard's lanes. Invariants, each kept under the shard's lock (and
/// checked as it is let go, in debug and loom builds):
///
/// - **pending**: `pending` counts this shard's waits handed to the pool
///   and not yet resolved, withdrawn or failed: those in lanes, those a lane
///   thread is blocked on, and those a server has taken out to query
///   (`out`). [`Shard::wait_added`] adds one, [`Shard::waits_finished`]
///   takes finished ones off.
/// - **lanes**: a lane is created by the wait that finds none
///   ([`Shard::insert`]) and queued for a server in the same critical
///   section (a lane is never made and left unqueued), and removed only by
///   its server when it is empty, by a failed spawn, or by shutdown. The
///   pool counts lanes over all shards as they are made and removed.
/// - **shut**: set by shutdown when it drains the shard; no lane is made in
///   it after.
/// - **out**: while stuck waits are looked for (`watching`), each wait out
///   in a batch is counted by its key's lane too, or, if that lane was
///   removed while it was out, by the key's entry in `parked`: the lanes'
///   and the parked counts add up to `out`.
pub(super) struct Shard {
    /// Ordered, so iteration (and a loom model) is deterministic.
    pub(super) lanes: BTreeMap<LaneKey, Lane>,
    pending: usize,
    /// Waits taken out of their lanes to query and not settled yet.
    out: usize,
    pub(super) shut: bool,
    /// Stuck waits are looked for: lanes keep watches and count their
    /// waits out.
    watching: bool,
    /// Lanes removed while some of their waits were out in a batch, at most
    /// one per key: their stall and their count out, taken over by the next
    /// lane made for the key, or ended when the last of them comes back.
    pub(super) parked: Vec<Parked>,
    /// The names of streams whose lanes were removed lately, newest last:
    /// a stream that goes idle between its waits is named once.
    names: VecDeque<(LaneKey, std::sync::Arc<str>)>,
}

/// How many names of idle streams a shard keeps.
const NAMES: usize = 8;

/// A lane removed while some of its waits were out in a batch.
pub(super) struct Parked {
    pub(super) key: LaneKey,
    pub(super) watch: LaneWatch,
    out: usize,
}

impl Parked {
    /// Its waits out in a batch: at least one while it is parked.
    pub(super) fn out(&self) -> usize {
        self.out
    }
}

#[derive(Default)]
pub(super) struct Lane {
    pub(super) waits: BTreeMap<u64, Wait>,
    pub(super) owner: Owner,
    /// The slot of the wait this lane's thread is blocked on, so shutdown
    /// can resolve it without waiting for the block to end.
    pub(super) blocked_on: Option<Arc<Slot>>,
    /// Its stream's progress, for stuck-wait reports; kept only when they
    /// are on.
    pub(super) watch: Option<LaneWatch>,
    /// Its waits out in a server's batch, not settled yet.
    pub(super) out: usize,
}

impl Lane {
    /// Nothing in it: no wait queued, blocked on, or out in a batch.
    pub(super) fn is_idle(&self) -> bool {
        self.waits.is_empty() && self.blocked_on.is_none() && self.out == 0
    }
}

/// Who serves a lane. A lane is created `Queued`; a thread or the poller
/// claims it; it is never handed from one server to another except when a
/// lane thread takes one back from the poller, or a server unwinds and its
/// guard queues it again.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owner {
    /// Waiting for a server: its key is in one of the scheduler's queues, or
    /// was just taken out by a thread or the poller on its way to claim it.
    /// Someone will serve it either way, so a wait that finds it adds
    /// nothing.
    #[default]
    Queued,
    /// Served by the lane thread with this number (each has its own, so a
    /// thread's guard never takes a lane another thread serves).
    Thread(usize),
    /// Served by the poller (there is at most one).
    Poller,
}

/// One pending wait: what to wait on, where its result goes, and where it
/// sits in its lane.
pub(crate) struct Wait {
    pub(crate) waitable: Box<dyn Waitable>,
    pub(crate) slot: Arc<Slot>,
    pub(super) lane: LaneKey,
    /// Its key in its lane: its sequence, or the next free place after it
    /// when that was taken (two streams whose keys collide). A thread that
    /// takes it out and puts it back puts it here, where its future's
    /// withdraw looks for it.
    placed: u64,
    /// Its stream, as its backend shows it: worked out before the wait is
    /// handed off (never under a lock), only when stuck waits are looked
    /// for and its lane is not there, to name the lane it makes.
    pub(super) stream_name: Option<std::sync::Arc<str>>,
}

impl Wait {
    /// A wait for `waitable` in lane `lane`, first placed at its sequence.
    pub(crate) fn new(waitable: Box<dyn Waitable>, slot: Arc<Slot>, lane: LaneKey) -> Self {
        let placed = waitable.sequence();
        Self {
            waitable,
            slot,
            lane,
            placed,
            stream_name: None,
        }
    }
}

impl Shard {
    /// An empty shard; `watching` when stuck waits are looked for.
    pub(super) fn new(watching: bool) -> Self {
        Self {
            lanes: BTreeMap::new(),
            pending: 0,
            out: 0,
            shut: false,
            watching,
            parked: Vec::new(),
            names: VecDeque::new(),
        }
    }

    /// A wait was handed to this shard.
    pub(super) fn wait_added(&mut self) {
        self.pending += 1;
    }

    /// `count` of this shard's waits left the pool: resolved, withdrawn, or
    /// failed.
    pub(super) fn waits_finished(&mut self, count: usize) {
        take_off(&mut self.pending, count, "pending count");
    }

    /// Waits handed to this shard and not finished.
    pub(super) fn pending(&self) -> usize {
        self.pending
    }

    /// Waits a lane thread is blocked on whose future was dropped (a slot's
    /// lock under the shard's: the lock order allows it).
    pub(super) fn cancelled_held(&self) -> usize {
        self.lanes
            .values()
            .filter_map(|lane| lane.blocked_on.as_ref())
            .filter(|slot| slot.is_cancelled())
            .count()
    }

    /// Put `wait` in its lane at its place or, if that is taken, the next
    /// free one (sequences are unique per stream, but two streams may share
    /// a lane whose keys collide: no wait may overwrite another). A wait
    /// that had to move is told so in its slot, where its withdraw looks.
    /// Returns where it went, and whether it made a new lane, which the
    /// caller must count and queue before it lets go of the shard.
    ///
    /// When stuck waits are looked for, a lane it makes gets a watch: the
    /// one parked for its key (with its count of waits out), or a new one,
    /// named by the wait's stream (worked out before the lock) or by the
    /// shard's memory of it; and a lane it wakes from idle starts its
    /// stall's clock again.
    pub(super) fn insert(&mut self, mut wait: Wait) -> (u64, bool) {
        let key = wait.lane;
        if self.watching && !self.lanes.contains_key(&key) {
            let (watch, out) = self.take_parked(key).unwrap_or_else(|| {
                let name = wait
                    .stream_name
                    .take()
                    .or_else(|| self.stream_name(key).cloned());
                // Put back with no name of its own: its lane's key.
                let name = name.unwrap_or_else(|| format!("a stream ({key:?})").into());
                (LaneWatch::new(name, wait.slot.handed_at()), 0)
            });
            let lane = Lane {
                watch: Some(watch),
                out,
                ..Lane::default()
            };
            self.lanes.insert(key, lane);
            return (self.insert_in_lane(wait).0, true);
        }
        if self.watching {
            if let Some(lane) = self.lanes.get_mut(&key).filter(|lane| lane.is_idle()) {
                if let Some(watch) = &mut lane.watch {
                    watch.woke(wait.slot.handed_at());
                }
            }
        }
        self.insert_in_lane(wait)
    }

    /// Put `wait` in its lane, made if missing (see [`Shard::insert`]).
    fn insert_in_lane(&mut self, mut wait: Wait) -> (u64, bool) {
        let mut new_lane = false;
        let lane = self.lanes.entry(wait.lane).or_insert_with(|| {
            new_lane = true;
            Lane::default()
        });
        let mut place = wait.placed;
        if crate::plant::planted("wait-put-back-at-its-sequence") {
            place = wait.waitable.sequence();
        }
        // One walk down the tree for the usual free place: its entry.
        let entry = loop {
            match lane.waits.entry(place) {
                btree_map::Entry::Vacant(entry) => break entry,
                btree_map::Entry::Occupied(_) => place = place.wrapping_add(1),
            }
        };
        if crate::plant::planted("wait-put-back-at-its-sequence") {
            wait.placed = place;
        } else if place != wait.placed {
            wait.placed = place;
            wait.slot.moved_to(place);
        }
        entry.insert(wait);
        (place, new_lane)
    }

    /// The lane `key` if `owner` serves it.
    pub(super) fn lane_of(&mut self, key: LaneKey, owner: Owner) -> Option<&mut Lane> {
        self.lanes.get_mut(&key).filter(|lane| lane.owner == owner)
    }

    /// Lane thread `owner`, serving `key`, takes its oldest wait to block on
    /// (noted in `blocked_on`). `None` when the lane is empty or no longer
    /// this thread's.
    pub(super) fn take_oldest(&mut self, key: LaneKey, owner: Owner) -> Option<Wait> {
        let lane = self.lane_of(key, owner)?;
        let (_, wait) = lane.waits.pop_first()?;
        lane.blocked_on = Some(wait.slot.clone());
        Some(wait)
    }

    /// Move up to `limit` waits of `lane` into `batch`, oldest first, and
    /// count them out (until [`Shard::batch_settled`]).
    pub(super) fn take_batch(&mut self, key: LaneKey, limit: usize, batch: &mut Vec<Wait>) {
        debug_assert!(batch.is_empty(), "the caller's buffer is cleared");
        let Some(lane) = self.lanes.get_mut(&key) else {
            return;
        };
        // One at a time from the front, not `split_off`: that allocates a
        // new tree for the rest on every batch, in the middle of a burst.
        while batch.len() < limit {
            let Some((_, wait)) = lane.waits.pop_first() else {
                break;
            };
            batch.push(wait);
        }
        if self.watching {
            lane.out += batch.len();
        }
        self.out += batch.len();
    }

    /// `count` waits taken out by [`Shard::take_batch`] are back: resolved,
    /// failed, or put in their lane again.
    pub(super) fn batch_settled(&mut self, count: usize) {
        take_off(&mut self.out, count, "count of waits out");
    }

    /// A lane thread's block on `slot`'s wait in lane `key` ended with
    /// `result`: unless shutdown has resolved it meanwhile, count it
    /// finished, and its stream as progressed. Whether it was still the
    /// thread's to resolve.
    pub(super) fn finish_blocked(
        &mut self,
        key: LaneKey,
        slot: &Arc<Slot>,
        result: &Result<(), ServerError>,
        reports: &StuckReports,
    ) -> bool {
        let Some(lane) = self.lanes.get_mut(&key) else {
            return false;
        };
        if lane
            .blocked_on
            .take_if(|blocked| Arc::ptr_eq(blocked, slot))
            .is_none()
        {
            return false;
        }
        if let Some(watch) = &mut lane.watch {
            if !crate::plant::planted("blocked-wait-end-not-progress") {
                watch.progressed(result.as_ref().err(), || slot.is_cancelled(), reports);
            }
        }
        self.waits_finished(1);
        true
    }

    /// `count` waits of `key` came back from a batch (settled, or failed by
    /// a guard; any put back are in their lane again): whoever counts the
    /// key's waits out, its lane or its parked entry, counts them back. The
    /// watch of a parked entry whose last waits these were is returned: no
    /// lane holds its stall any more, and it ends with them.
    pub(super) fn batch_returned(&mut self, key: LaneKey, count: usize) -> Option<LaneWatch> {
        if !self.watching {
            return None;
        }
        if let Some(lane) = self.lanes.get_mut(&key) {
            take_off(&mut lane.out, count, "lane's count of waits out");
            return None;
        }
        let at = self.parked.iter().position(|parked| parked.key == key)?;
        take_off(&mut self.parked[at].out, count, "parked count of waits out");
        (self.parked[at].out == 0).then(|| self.parked.swap_remove(at).watch)
    }

    /// Lane `key`, just removed, with its `watch` and its waits `out`:
    /// parked if some are out, its name kept either way. The watch is
    /// returned if it is not parked (the stall ends).
    pub(super) fn lane_removed(
        &mut self,
        key: LaneKey,
        watch: LaneWatch,
        out: usize,
    ) -> Option<LaneWatch> {
        self.names.retain(|(named, _)| *named != key);
        if self.names.len() == NAMES {
            self.names.pop_front();
        }
        self.names.push_back((key, watch.stream().clone()));
        if out > 0 && !crate::plant::planted("removed-lane-watch-not-parked") {
            self.parked.push(Parked { key, watch, out });
            return None;
        }
        Some(watch)
    }

    /// The parked stall and count out of `key`, for the lane made for it
    /// now.
    pub(super) fn take_parked(&mut self, key: LaneKey) -> Option<(LaneWatch, usize)> {
        let at = self.parked.iter().position(|parked| parked.key == key)?;
        let parked = self.parked.swap_remove(at);
        Some((parked.watch, parked.out))
    }

    /// The name of stream `key` if this shard knows it: from a lane now, a
    /// parked one, or one removed lately.
    pub(super) fn stream_name(&self, key: LaneKey) -> Option<&std::sync::Arc<str>> {
        if let Some(watch) = self.lanes.get(&key).and_then(|lane| lane.watch.as_ref()) {
            return Some(watch.stream());
        }
        let parked = self.parked.iter().find(|parked| parked.key == key);
        if let Some(parked) = parked {
            return Some(parked.watch.stream());
        }
        let named = self.names.iter().rev().find(|(named, _)| *named == key);
        named.map(|(_, name)| name)
    }
}

/// Take `count` off a shard's `counter`, asserting it does not underflow (a
/// count that would is a bug to reveal, not to clamp).
fn take_off(counter: &mut usize, count: usize, what: &str) {
    assert!(
        count <= *counter,
        "a shard's {what} underflowed ({count} taken off {counter})"
    );
    *counter -= count;
}

impl Invariants for Shard {
    fn check_invariants(&self) {
        let held: usize = self
            .lanes
            .values()
            .map(|lane| lane.waits.len() + usize::from(lane.blocked_on.is_some()))
            .sum();
        assert_eq!(
            self.pending,
            held + self.out,
            "a shard's pending count is not its waits in lanes ({held}) plus those out ({})",
            self.out
        );
        assert!(
            !self.shut || self.lanes.is_empty(),
            "a lane in a shard shut down"
        );
        if self.watching {
            let lanes: usize = self.lanes.values().map(|lane| lane.out).sum();
            let parked: usize = self.parked.iter().map(|parked| parked.out).sum();
            assert_eq!(
                lanes + parked,
                self.out,
                "a shard's lanes ({lanes}) and parked lanes ({parked}) count other than its \
                 waits out"
            );
        }
    }
}
