//! The waiter: `fence.await` without blocking an executor thread and without spinning. [`Waiter`]'s
//! docs say what a user sees; this is how it works.
//!
//! # Words
//!
//! - **wait**: a handed-off future's fence, and the `Slot` its result goes to.
//! - **lane**: one stream's pending waits in order, keyed by the backend and `EventApi::stream_id`.
//! - **lane thread**: serves one lane at a time. **Poller** (at most one): asks the lanes past
//!   `max_threads` in rounds, drops withdrawn waits, reports stalls. **Watcher** (at most one,
//!   where watchers are on): races the lane threads' blocks by watching progress words (below).
//! - **hand-off**: a first poll that found the fence not reached puts its wait in its lane.
//!   **Resolve**: leave a result in the slot, wake the task.
//! - **held**: the wait a lane thread has out to block on or ask. **batch**: waits taken out to ask
//!   together; **settle**: put back those not reached.
//! - **withdraw**: a dropped future's wait leaves its lane, for a waiter thread to drop. **stall**:
//!   no wait of a lane ended for `stuck_after`.
//!
//! # The lane algorithm
//!
//! 1. **First poll** (`handoff.rs`): one query (more within a spin budget); reached is ready at
//!    once, with no allocation.
//! 2. **Hand-off** (`pool.rs`, `state.rs`): the wait goes into its lane under the one lock. A wait
//!    that makes its lane picks who serves it: an idle lane thread, else one between lanes, else a
//!    new one (up to `max_threads`), else the poller. Decided under the lock, done after it
//!    (`Action`).
//! 3. **Serving a lane** (`threads.rs`): block on the oldest wait in the driver, always (the
//!    watcher, below, may race the block); then, in one hold of the lock (`Pool::end_hold`, the one
//!    way a hold ends, whether its lane thread or the watcher ends it), resolve it (unless the
//!    watcher did) and take the next, and ask that once. Not reached (work ending item after item):
//!    block on it. Reached (a burst): ask the later waits in batches, doubling from 2 to `BATCH`
//!    while all are reached. An idle lane is removed; its thread takes a queued lane, or one back
//!    from the poller, or exits after its keep-alive.
//! 4. **The poller** (`poller.rs`) asks its lanes in batches (from 1), backing off from
//!    `POLL_BACKOFF_MIN` to `POLL_BACKOFF_MAX` while nothing moves, and wakes an idle lane thread
//!    to take one back. It exits after `POLLER_LINGER_ROUNDS` idle rounds, unless `stuck_after` is
//!    on and a lane is left: then it looks each quarter of `stuck_after` and warns once per stall.
//! 5. **Withdraw**: the wait goes to the withdrawn list, for the poller or an idle lane thread to
//!    drop; one held or in a batch stays with its thread (and on the watcher's list, if there,
//!    until one of them is done).
//! 6. **Faults** (`contain.rs`): code the waiter does not own is called with no lock held, under
//!    `catch_unwind`: a panic costs only its wait. A thread lost anyway (the OS would not start it,
//!    or it unwound) gives back what it held, in one recovery path (`recovery.rs`): its batch and
//!    held wait fail, its lanes go to another lane thread (to the poller, where a lane thread would
//!    not start; they fail where the poller would not), and a lost watcher's entries are left to
//!    their lane threads' blocks.
//! 7. **Shutdown** fails every wait, held ones too, and empties the watcher's list. A pool made
//!    before a **fork** refuses everything in the child and touches nothing.
//! 8. **The watcher** (below) exits after its keep-alive idle.
//!
//! # Which thread calls the driver
//!
//! - **The caller's thread**, in `poll`: the first poll's event query (`cuEventQuery` on CUDA), and
//!   within a spin budget more queries and loads of the stream's progress word. Asking for the word
//!   never allocates and never waits on a lock held across a driver call: a stream's first ask
//!   hands it to the backend's own thread (on CUDA, the `device-events-words` thread, which serves
//!   no wait), and gets no word. Making the fence (`cuda::fence()`) records its event, and a word
//!   write on a stream that has one, on the caller's thread too, before any poll: driver calls that
//!   another thread's kernel load can hold up (CUDA's lazy loading may wait on the context's work).
//! - **The waiter's threads**, for everything else: a lane thread asks for its stream's word (as
//!   above, never an allocation) and blocks in the driver; the poller and the watcher query events.
//!   A dropped future's event is released by one of them, off the caller's thread.
//!
//! # The watcher
//!
//! An accelerator that races the driver and never replaces it (`watcher/`; the constants named here
//! are in `watcher/timing.rs`). Where a stream publishes its progress in host memory (a
//! [`ProgressWord`](crate::ProgressWord): an atomic the host stream's worker sets; on CUDA, a
//! page-locked word the stream writes with `cuStreamWriteValue64` after each fence), a lane thread
//! about to block on its held wait first puts it on the watcher's list, due when the lane's
//! **prediction** says: the least of its last `HISTORY` waits, each from the start of its hold (a
//! lane with fewer than two, whose first wait often waited out more than one item, is looked at for
//! `FIRST_WINDOW` from the hand-over). Then it blocks in the driver as with the watcher off.
//!
//! The watcher sleeps until its **lead** before the first entry due, never more than `MAX_NAP` at a
//! time (a nap shorter than `MIN_NAP` is spent looking), planned from the list under the lock: it
//! holds no entry while it sleeps, so a wait its lane thread resolves meanwhile leaves with that
//! thread, fence and all. The lead is the most its recent sleeps overslept plus the lane's margin,
//! at most half the prediction (so a watcher that overslept badly once still sleeps, and learns how
//! late it wakes now) and half `MAX_LOOK`. Awake, it takes the entries and looks at the words of
//! those due, a memory load each, pausing between looks and yielding after `SPIN_LOOKS` (so the
//! threads it wakes can run on a busy machine). A word that passed is confirmed by one query of the
//! wait's event (so a faulted stream still fails its waits), and the watcher resolves the wait. The
//! lane's held wait is taken under the lock by whichever of the two comes first: each wait resolves
//! exactly once, and none later than the driver's wake. An entry not seen to end within its window
//! (twice the lead past its due, at least `FIRST_WINDOW`, at most `MAX_LOOK` of looking), or whose
//! word ran ahead of its event, leaves the list: its lane thread is in the driver already.
//!
//! - **History per lane**, kept by the pool under the lane's key (for the `HISTORIES` lanes used
//!   last), not by a thread: a lane that goes idle between requests, or is served by another
//!   thread, keeps it. A sighting at the first look after a sleep (late) doubles that lane's margin
//!   (up to a quarter of its prediction); one in time cuts it by an eighth, down to `MIN_MARGIN`.
//! - **Waits too short to watch** (predicted shorter than `MIN_WATCHED`, or than twice how early
//!   the watcher wakes, lately) are left to the driver, whose wake comes about as soon, without a
//!   wake-up of the watcher's thread on a host whose cores the streams keep busy. How early it
//!   wakes (the least its recent sleeps overslept, plus `MIN_MARGIN`) is measured by each sleep
//!   that runs its course, not by a round that does not sleep, and halves every `EARLY_HALF_LIFE`
//!   it is not measured again, so a bad spell cannot switch the watcher off for good. A lane thread
//!   is told, as each wait ends, whether its lane's next wait is worth offering, and skips the list
//!   (and its lock) while it is not.
//! - **Its CPU is bounded by design**: at most `MAX_LOOK` of looking per wait, and, over time, at
//!   most a `CPU_SHARE`th of one core for its thread: a budget that earns that share of the time
//!   passing, saves up at most `BURST` and spends each round's CPU time (looks, wake-ups, naps),
//!   from the thread's CPU clock (where there is none, the time it looked), going into debt when a
//!   round runs over; while it is spent, entries that come due are left to the driver.
//!   [`WaiterStats::watcher_cpu`] reports its thread's CPU time.
//! - Streams whose words went off (a refused write, a capture) get no word, so are not watched.
//! - **Lanes it cannot win** cost it little: items of irregular length, or a host whose cores the
//!   streams keep so busy that the driver's wake comes first. Each lane counts its misses (the
//!   window ended before the word passed, or the driver woke the lane thread while the wait was
//!   still on the list): one more for each, halved by each sighting (not cleared). After a miss
//!   with `n` counted, the lane's next `2^(n-1) - 1` watchable waits (at most `MAX_SKIP`) are left
//!   to the driver. So a lane the watcher wins one watch in several leaves most of its waits to the
//!   driver, and one it wins again is watched at every wait after a few sightings.
//!
//! # One `.await`'s path
//!
//! The waiter's functions one `.await` crosses, each named once, in order, for a wait not reached
//! at its first poll, on a stream whose lane an idle lane thread takes:
//!
//! 1. The task's thread: `FenceFuture::poll`, `Handoff::poll`, `PoolRef::get`,
//!    `Handoff::first_poll`, `contain::backend` (around `Waitable::query`, `Waitable::lane`),
//!    `Slot::new`, `Wait::new`, `Pool::submit`, `Pool::is_forked`, `Pool::lock`,
//!    `Counters::handed_off`, `State::insert`, `State::place`, `State::wake_idle`, `threads::act`,
//!    `Pool::notify`.
//! 2. The lane thread, asleep in `Pool::next_lane`: `State::woke`, `State::claim`,
//!    `WaiterThread::serve_lane`, `State::take_oldest`, `State::lane_of`,
//!    `WaiterThread::wait_out` (`Waitable::block`), `Pool::end_hold`, `Lane::end_hold`,
//!    `Lane::progressed`, `Pool::deliver`, `Slot::complete`, `Counters::delivered`,
//!    `contain::wake`, `contain::drop`.
//! 3. The task's thread again: `FenceFuture::poll`, `Handoff::poll`, `Slot::poll`.
//!
//! Watched (watchers on, a stream with a word, the watcher first), `wait_out` also calls
//! `Waitable::progress` and `Pool::watch` (`WatcherState::early`, `Early::at`,
//! `WatcherState::history`, `LaneHistory::entry`, `LaneHistory::worth_watching`,
//! `LaneHistory::predicted`, `State::watcher_for_work`), and `Pool::end_hold`
//! `WatcherState::unwatch`; the watcher, woken in `Pool::watcher_nap`, crosses
//! `Pool::watch_round`, `Timing::look_from`, `Timing::overslept`, `Timing::early`,
//! `CpuBudget::earn`, `WaiterThread::look`, `Watched::passed`, `WaiterThread::resolve_watched`
//! (`Waitable::query`), `Pool::end_hold` (`LaneHistory::seen`), `Pool::deliver` and on; the lane
//! thread's own `Pool::end_hold` then finds the hold ended.

mod contain;
mod future;
mod handle;
mod handoff;
pub(crate) mod latency_histogram;
mod poller;
mod pool;
mod recovery;
mod slot;
mod state;
mod stats;
mod stuck;
#[cfg(test)]
mod tests;
mod threads;
mod wait;
mod waitable;
mod watcher;

pub use future::FenceFuture;
pub(crate) use handle::sealed;
pub use handle::{
    default_watchers, Awaitable, Waiter, WaiterBuilder, DEFAULT_KEEP_ALIVE, DEFAULT_MAX_THREADS,
    MAX_SPIN_BUDGET, MAX_THREADS_LIMIT, WATCHER_MIN_CORES,
};
pub(crate) use handoff::Handoff;
pub use latency_histogram::{LatencyHistogram, LATENCY_BUCKETS};
pub use stats::WaiterStats;
pub use stuck::StuckWait;
pub(crate) use waitable::{LaneKey, Waitable};
