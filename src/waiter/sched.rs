//! [`Sched`]: who serves which lane, and how many threads there are. Its
//! decisions are plain functions of its state, made under the scheduler's
//! lock and carried out ([`Action`]) once the lock is let go.

use std::collections::VecDeque;

use super::checked::Invariants;
use super::shard::Wait;
use super::waitable::LaneKey;

/// Everything under the scheduler's lock. It changes only through the
/// transitions below, each a method that keeps these invariants
/// ([`Sched::check_invariants`] checks them whenever the lock is let go, in
/// debug and loom builds):
///
/// - **queued**: `for_threads` and `for_poller` hold the keys of lanes whose
///   owner is [`Owner::Queued`](super::shard::Owner::Queued) and that no
///   server has taken out yet; a thread or the poller takes a key out and
///   then claims the lane in its shard. A lane a thread was started or woken
///   for is in `for_threads`, which the poller never takes from.
/// - **threads**: `lane_threads` and `poller` count the threads started (or
///   about to be), and nothing else: [`Sched::add_lane_thread`] /
///   [`Sched::lane_thread_left`], [`Sched::add_poller`] /
///   [`Sched::poller_left`], the last called by every way a thread ends,
///   unwinding included. `idle` counts lane threads asleep for work,
///   `notified` the wake-ups sent to them and not yet taken
///   ([`Sched::go_idle`], [`Sched::woke`]).
/// - **shutdown**: set once, before the shards are drained; nothing is
///   queued or withdrawn here after it.
#[derive(Default)]
pub(super) struct Sched {
    /// Lanes queued for a lane thread, oldest first: one was started or woken
    /// for each, or a lane thread serving no lane looks here before it sleeps
    /// or leaves (see [`Sched::place`]).
    pub(super) for_threads: VecDeque<LaneKey>,
    /// Lanes queued for the poller (every lane thread allowed is busy),
    /// oldest first. A lane thread that runs out of work takes one from here
    /// before the poller does.
    pub(super) for_poller: VecDeque<LaneKey>,
    pub(super) lane_threads: usize,
    idle: usize,
    /// Wake-ups sent to idle threads and not yet taken.
    notified: usize,
    pub(super) poller: bool,
    /// Waits whose futures were dropped, taken out of their lanes. A waiter
    /// thread drops them (destroying their events), never the thread that
    /// dropped the future.
    pub(super) withdrawn: Vec<Wait>,
    pub(super) peak_threads: usize,
    pub(super) shutdown: bool,
    next_thread: usize,
}

/// What the scheduler decided, carried out once its lock is let go (a woken
/// thread then finds the lock free, rather than wake only to wait for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Nothing,
    /// Wake an idle lane thread (counted in `Sched::notified` already).
    WakeIdleThread,
    /// Start lane thread number `.0` (counted in already).
    SpawnLaneThread(usize),
    /// Start the poller (counted in already).
    SpawnPoller,
}

impl Sched {
    /// Queue a new lane `key` and decide who serves it, given `lanes` (every
    /// lane in every shard, this one included) and `max_threads`.
    ///
    /// **The scheduler's invariant**, kept here: when it decides to do
    /// nothing, live servers cover every queued and polled lane. A lane
    /// queued for the poller has the poller running (it adopts the lane on
    /// its next round). A lane queued for threads has a thread coming: one
    /// woken or started for it, or, when there are at least as many lane
    /// threads as lanes, one serving no lane (each thread serves at most
    /// one, and this lane has none), which looks at `for_threads` under
    /// this lock before it sleeps or leaves. This keeps threads at one per
    /// busy stream even when lanes drain and refill faster than threads
    /// wake. After shutdown the lane is left alone: shutdown drains its
    /// shard.
    pub(super) fn place(&mut self, key: LaneKey, lanes: usize, max_threads: usize) -> Action {
        if self.shutdown {
            return Action::Nothing;
        }
        if self.wake_idle() {
            self.for_threads.push_back(key);
            Action::WakeIdleThread
        } else if self.lane_threads >= lanes {
            self.for_threads.push_back(key);
            Action::Nothing
        } else if self.lane_threads < max_threads {
            self.for_threads.push_back(key);
            self.add_lane_thread()
        } else {
            self.for_poller.push_back(key);
            if self.poller {
                Action::Nothing
            } else {
                self.add_poller()
            }
        }
    }

    /// Withdrawn waits are there to drop: leave them to the poller if it
    /// runs, else wake an idle thread, else start the poller. Never a new
    /// lane thread: a burst of drops (a client hanging up on many requests)
    /// would find no thread idle each time and start one per drop, up to
    /// `max_threads`; there is only ever one poller, and it lingers a few
    /// rounds for more before it exits.
    pub(super) fn wake_or_spawn_disposer(&mut self) -> Action {
        if self.poller {
            Action::Nothing
        } else if self.wake_idle() {
            Action::WakeIdleThread
        } else {
            self.add_poller()
        }
    }

    /// A lane thread is about to sleep, waiting for a lane.
    pub(super) fn go_idle(&mut self) {
        self.idle += 1;
    }

    /// Count a wake-up for an idle lane thread not woken yet, if there is
    /// one; the caller then notifies the pool's condition variable once it
    /// has let go of this lock. A thread that wakes on its own before the
    /// notification (a timeout) still looks at the queues under this lock,
    /// so the work it was woken for is found either way.
    pub(super) fn wake_idle(&mut self) -> bool {
        if self.idle > self.notified {
            self.notified += 1;
            true
        } else {
            false
        }
    }

    /// A lane thread woke (notified, spuriously, or timed out). It takes a
    /// wake-up if one is outstanding, whether or not it was the one woken:
    /// a thread that timed out as a notification came takes that
    /// notification's work too, as it looks at the queues before it leaves.
    /// None need be outstanding (a timeout or a spurious wake-up with none
    /// sent): then there is none to take. The idle count has this thread in
    /// it, always.
    pub(super) fn woke(&mut self) {
        assert!(self.idle > 0, "a lane thread woke that was not idle");
        if !crate::plant::planted("woke-keeps-idle-count") {
            self.idle -= 1;
        }
        if self.notified > 0 {
            self.notified -= 1;
        }
    }

    /// A lane thread exits (idle past keep-alive, shut down, unwound), or
    /// never started.
    pub(super) fn lane_thread_left(&mut self) {
        assert!(
            self.lane_threads > 0,
            "the count of lane threads underflowed"
        );
        self.lane_threads -= 1;
    }

    /// The poller exits (or unwound), or never started.
    pub(super) fn poller_left(&mut self) {
        assert!(self.poller, "the poller left twice");
        self.poller = false;
    }

    /// Count in a lane thread the caller is about to spawn.
    pub(super) fn add_lane_thread(&mut self) -> Action {
        self.lane_threads += 1;
        self.next_thread += 1;
        self.note_threads();
        Action::SpawnLaneThread(self.next_thread)
    }

    /// Count in the poller the caller is about to spawn.
    pub(super) fn add_poller(&mut self) -> Action {
        assert!(!self.poller, "there is one poller at most");
        self.poller = true;
        self.note_threads();
        Action::SpawnPoller
    }

    /// Threads alive (or about to be): lane threads and the poller.
    pub(super) fn threads(&self) -> usize {
        self.lane_threads + usize::from(self.poller)
    }

    fn note_threads(&mut self) {
        self.peak_threads = self.peak_threads.max(self.threads());
    }
}

impl Invariants for Sched {
    /// The invariants above that one look can check.
    fn check_invariants(&self) {
        assert!(
            self.notified <= self.idle,
            "more wake-ups ({}) than idle threads ({})",
            self.notified,
            self.idle
        );
        assert!(
            self.idle <= self.lane_threads,
            "more idle threads ({}) than threads ({})",
            self.idle,
            self.lane_threads
        );
        assert!(
            self.for_threads.is_empty() || self.lane_threads > 0 || self.shutdown,
            "lanes queued for lane threads, and none to take them"
        );
        assert!(
            self.for_poller.is_empty() || self.poller || self.lane_threads > 0 || self.shutdown,
            "lanes queued for the poller, and no server to take them"
        );
        assert!(
            !self.shutdown || self.for_threads.is_empty() && self.for_poller.is_empty(),
            "lanes queued after shutdown"
        );
        assert!(
            self.peak_threads >= self.threads(),
            "more threads than the peak"
        );
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use super::*;

    fn key(stream: u64) -> LaneKey {
        LaneKey::for_tests(stream)
    }

    #[test]
    fn a_new_lane_starts_a_thread_while_there_are_fewer_threads_than_lanes() {
        let mut sched = Sched::default();
        assert_eq!(sched.place(key(0), 1, 4), Action::SpawnLaneThread(1));
        assert_eq!(sched.place(key(1), 2, 4), Action::SpawnLaneThread(2));
        assert_eq!(sched.for_threads, [key(0), key(1)]);
        assert_eq!((sched.lane_threads, sched.peak_threads), (2, 2));
        sched.check_invariants();
    }

    #[test]
    fn a_new_lane_wakes_an_idle_thread_before_it_starts_one() {
        let mut sched = Sched::default();
        sched.place(key(0), 1, 4);
        sched.go_idle();
        assert_eq!(sched.place(key(1), 2, 4), Action::WakeIdleThread);
        // The one idle thread is woken once: the next lane starts a thread.
        assert_eq!(sched.place(key(2), 3, 4), Action::SpawnLaneThread(2));
        sched.woke();
        sched.check_invariants();
        assert_eq!((sched.idle, sched.notified), (0, 0));
    }

    #[test]
    fn a_thread_between_lanes_serves_a_new_one_without_another_thread() {
        let mut sched = Sched::default();
        sched.place(key(0), 1, 4);
        sched.for_threads.clear();
        // Its lane emptied and was removed; a wait makes it again: one
        // lane, one thread, which looks at the queue before it sleeps.
        assert_eq!(sched.place(key(0), 1, 4), Action::Nothing);
        assert_eq!(sched.for_threads, [key(0)]);
        assert_eq!(sched.lane_threads, 1);
    }

    #[test]
    fn lanes_past_max_threads_go_to_one_poller() {
        let mut sched = Sched::default();
        sched.place(key(0), 1, 1);
        assert_eq!(sched.place(key(1), 2, 1), Action::SpawnPoller);
        assert_eq!(sched.place(key(2), 3, 1), Action::Nothing);
        assert_eq!(sched.for_poller, [key(1), key(2)]);
        assert_eq!((sched.threads(), sched.peak_threads), (2, 2));
        sched.check_invariants();
    }

    #[test]
    fn nothing_is_queued_after_shutdown() {
        let mut sched = Sched {
            shutdown: true,
            ..Sched::default()
        };
        assert_eq!(sched.place(key(0), 1, 4), Action::Nothing);
        assert!(sched.for_threads.is_empty() && sched.lane_threads == 0);
        sched.check_invariants();
    }

    #[test]
    fn withdrawn_waits_go_to_the_poller_then_an_idle_thread_never_a_new_lane_thread() {
        let mut sched = Sched::default();
        assert_eq!(sched.wake_or_spawn_disposer(), Action::SpawnPoller);
        assert_eq!(sched.wake_or_spawn_disposer(), Action::Nothing);
        sched.poller_left();
        sched.place(key(0), 1, 4);
        sched.go_idle();
        assert_eq!(sched.wake_or_spawn_disposer(), Action::WakeIdleThread);
        assert_eq!(sched.lane_threads, 1);
    }

    #[test]
    fn a_wake_up_with_none_sent_takes_none() {
        let mut sched = Sched::default();
        sched.place(key(0), 1, 4);
        sched.go_idle();
        sched.woke();
        assert_eq!((sched.idle, sched.notified), (0, 0));
        sched.check_invariants();
    }

    #[test]
    #[should_panic(expected = "underflowed")]
    fn a_thread_that_leaves_twice_is_a_bug_caught_at_once() {
        let mut sched = Sched::default();
        sched.place(key(0), 1, 4);
        sched.lane_thread_left();
        sched.lane_thread_left();
    }

    #[test]
    #[should_panic(expected = "more idle threads")]
    fn the_invariants_catch_an_idle_thread_never_counted() {
        let mut sched = Sched::default();
        sched.go_idle();
        sched.check_invariants();
    }
}
