//! [`HostEvent`]: a marker that host streams pass when they reach it.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::context::ContextShared;
use super::error;
use super::stream::{this_workers_stream, waits_for_itself};
use crate::backend::idle_pool::IdlePool;
use crate::backend::live_events::LiveEvents;
use crate::sync::{Condvar, Mutex, MutexGuard};
use crate::ServerError;

/// The most idle fence events a host stream keeps for later fences.
pub(super) const FENCE_POOL_CAPACITY: usize = 64;

/// A host stream's idle fence events. Its events point back at it weakly, so one given back after
/// the stream is gone is freed.
pub(super) struct FencePool {
    /// One shard: a host stream's fences are made by whoever holds it.
    idle: IdlePool<HostEvent, 1>,
    /// The stream's counts, whose idle gauge this pool keeps.
    live: LiveEvents,
    context: Arc<ContextShared>,
}

impl FencePool {
    pub(super) fn new(live: LiveEvents, context: Arc<ContextShared>) -> Self {
        Self {
            idle: IdlePool::new(FENCE_POOL_CAPACITY),
            live,
            context,
        }
    }

    /// An idle fence event, now in use, or a new one.
    pub(super) fn take(self: &Arc<Self>) -> HostEvent {
        if let Some(event) = self.idle.take(0, |idle| self.live.set_idle(idle)) {
            return event;
        }
        HostEvent::create(false, &self.live, &self.context, Some(Arc::downgrade(self)))
    }

    /// Free the idle events (their stream is dropped); events given back later still come here.
    pub(super) fn clear(&self) {
        // The gauge before the frees: a count read meanwhile is too high, never too low.
        let freed = self.idle.take_all(|idle| self.live.set_idle(idle));
        drop(freed);
    }
}

impl Drop for FencePool {
    fn drop(&mut self) {
        // Its idle events are freed with it (each counted out of `alive`).
        self.live.set_idle(0);
    }
}

/// The host backend's raw event: shared by its owner and the stream markers that will signal it.
///
/// Each record starts a new *generation*; a waiter waits for the one latest when it asked, only
/// that one, by the driver's rule (`cuEventRecord`, CUDA driver API): "Other APIs such as
/// `cuStreamWaitEvent()` use the most recently captured state at the time of the API call, and are
/// not affected by later calls to `cuEventRecord()`." A query looks at the latest record only
/// ("Any subsequent calls which examine the status of hEvent will only examine the completion of
/// this most recent call").
#[derive(Clone)]
pub struct HostEvent {
    pub(super) inner: Arc<EventInner>,
}

pub(super) struct EventInner {
    state: Mutex<EventState>,
    changed: Condvar,
    timing: bool,
    /// The creating stream's counts.
    live: LiveEvents,
    /// The only context it may be recorded on, whose fault it reports.
    pub(super) context: Arc<ContextShared>,
    /// For fence events, the pool it goes back to.
    pool: Option<Weak<FencePool>>,
}

#[derive(Default)]
struct EventState {
    /// The generation of the latest record; 0 when never recorded.
    recorded: u64,
    /// Generations whose marker is queued and not yet passed, ascending: binary-searched, as an
    /// event recorded over and over on a busy stream has many. A pooled event keeps the buffer.
    /// Each with the [`worker_key`](super::stream::StreamShared::worker_key) of the stream
    /// whose queue holds its marker.
    pending: VecDeque<(u64, usize)>,
    /// When the latest record was reached, for timing events.
    reached_at: Option<Instant>,
    /// Generations lost to a fault, with its message; bounded: a faulted context takes no records.
    faulted: Vec<(u64, String)>,
    /// Threads waiting on `changed`; with none, a signal skips the notify (a system call).
    waiting: usize,
}

impl EventState {
    /// `Some(result)` once generation `target` is settled.
    fn settled(&self, target: u64) -> Option<Result<(), String>> {
        if self.pending_at(target).is_ok() {
            return None;
        }
        let fault = self.faulted.iter().find(|(lost, _)| *lost == target);
        Some(fault.map_or(Ok(()), |(_, message)| Err(message.clone())))
    }

    /// `generation`'s marker has left its queue (passed or dropped).
    fn settle(&mut self, generation: u64) {
        if let Ok(index) = self.pending_at(generation) {
            self.pending.remove(index);
        }
    }

    fn pending_at(&self, generation: u64) -> Result<usize, usize> {
        self.pending
            .binary_search_by_key(&generation, |&(pending, _)| pending)
    }

    /// Whether `generation`'s marker is queued on the stream whose worker is calling: passed only
    /// after the work running now returns.
    fn queued_behind_this_work(&self, generation: u64) -> bool {
        let queued_on = self
            .pending_at(generation)
            .map(|index| self.pending[index].1);
        this_workers_stream().is_some_and(|worker| queued_on == Ok(worker))
    }
}

impl HostEvent {
    /// A new event of `context`, counted in `live` until freed; a fence event goes back to `pool`
    /// when released.
    pub(super) fn create(
        timing: bool,
        live: &LiveEvents,
        context: &Arc<ContextShared>,
        pool: Option<Weak<FencePool>>,
    ) -> Self {
        live.allocated();
        Self {
            inner: Arc::new(EventInner {
                state: Mutex::new(EventState::default()),
                changed: Condvar::new(),
                timing,
                live: live.clone(),
                context: context.clone(),
                pool,
            }),
        }
    }

    /// Give a fence event back to its stream's pool, or free it if the pool is full or gone.
    /// Queued markers still signal it.
    pub(super) fn release(self) {
        let Some(pool) = self.inner.pool.as_ref().and_then(Weak::upgrade) else {
            return;
        };
        let full = pool
            .idle
            .give_back(0, self, |idle| pool.live.set_idle(idle));
        drop(full);
    }

    /// Start a new generation; the caller queues a marker for it on the stream of `worker_key`.
    pub(super) fn next_generation(&self, worker_key: usize) -> u64 {
        let mut state = self.inner.state.lock();
        state.recorded += 1;
        let generation = state.recorded;
        state.pending.push_back((generation, worker_key));
        state.reached_at = None;
        generation
    }

    /// [`next_generation`](Self::next_generation) and [`signal`](Self::signal) in one lock, for
    /// an idle stream.
    pub(super) fn record_reached(&self) {
        let mut state = self.inner.state.lock();
        state.recorded += 1;
        state.reached_at = self.inner.timing.then(Instant::now);
        self.inner.wake(state, || {});
    }

    /// The generation a waiter asking now refers to.
    pub(super) fn latest_generation(&self) -> u64 {
        self.inner.state.lock().recorded
    }

    /// A stream passed the marker of `generation`. `then` runs once a query sees it passed and
    /// before the threads blocked on it are woken, as a device runs what follows a record (a
    /// progress word's write) while the driver is still waking the threads blocked in it.
    pub(super) fn signal(&self, generation: u64, then: impl FnOnce()) {
        let mut state = self.inner.state.lock();
        state.settle(generation);
        if generation == state.recorded && self.inner.timing {
            state.reached_at = Some(Instant::now());
        }
        self.inner.wake(state, then);
    }

    /// The stream holding the marker of `generation` faulted.
    pub(super) fn fail(&self, generation: u64, message: &str) {
        let mut state = self.inner.state.lock();
        state.settle(generation);
        state.faulted.push((generation, message.to_owned()));
        self.inner.wake(state, || {});
    }

    /// Whether the latest record has been passed; a fault of the record or of the event's
    /// context is an error (sticky: "any further CUDA work will return the same error"). Refused
    /// from a stream's own work for a record it queued later (`HostStream::launch`).
    pub(super) fn query(&self, call: &'static str) -> Result<bool, ServerError> {
        self.inner.context.check(call)?;
        let state = self.inner.state.lock();
        match state.settled(state.recorded) {
            Some(Ok(())) => Ok(true),
            Some(Err(message)) => Err(error::faulted(call, message)),
            None if state.queued_behind_this_work(state.recorded) => Err(waits_for_itself(call)),
            None => Ok(false),
        }
    }

    /// Block until `generation` is passed or lost; a faulted context's error as in
    /// [`query`](Self::query), and refused where it would wait for itself as there.
    pub(super) fn wait_for(&self, generation: u64, call: &'static str) -> Result<(), ServerError> {
        self.inner.context.check(call)?;
        self.wait_record(generation, call)?;
        self.inner.context.check(call)
    }

    /// Block until `generation` is passed or lost, whatever became of the context since: what a
    /// stream of another context waits for (the docs do not say a later fault reaches it).
    /// Refused where it would wait for itself, as [`query`](Self::query) is.
    pub(super) fn wait_record(
        &self,
        generation: u64,
        call: &'static str,
    ) -> Result<(), ServerError> {
        let mut state = self.inner.state.lock();
        loop {
            match state.settled(generation) {
                Some(result) => return result.map_err(|message| error::faulted(call, message)),
                None if state.queued_behind_this_work(generation) => {
                    return Err(waits_for_itself(call))
                }
                None => {
                    state.waiting += 1;
                    state = self.inner.changed.wait(state);
                    state.waiting -= 1;
                }
            }
        }
    }

    pub(super) fn reached_at(&self, call: &'static str) -> Result<Instant, ServerError> {
        self.inner.context.check(call)?;
        let invalid = |message| Err(error::call(call, error::INVALID_HANDLE, message));
        if !self.inner.timing {
            return invalid("the event was created without timing");
        }
        let state = self.inner.state.lock();
        if state.recorded == 0 {
            return invalid("the event was never recorded");
        }
        if let Some(Err(message)) = state.settled(state.recorded) {
            return Err(error::faulted(call, message));
        }
        state
            .reached_at
            .ok_or_else(|| error::call(call, error::NOT_READY, "the event is not reached yet"))
    }

    /// Device time from `start` to `end`; refused across contexts, as CUDA does
    /// (`CUDA_ERROR_INVALID_HANDLE`).
    pub(super) fn elapsed(start: &Self, end: &Self) -> Result<Duration, ServerError> {
        const CALL: &str = "event_elapsed";
        if start.inner.context.id != end.inner.context.id {
            return Err(error::call(
                CALL,
                error::INVALID_HANDLE,
                "the start and stop events belong to different contexts: a measurement's two \
                 events must be recorded on streams of one context",
            ));
        }
        let (start, end) = (start.reached_at(CALL)?, end.reached_at(CALL)?);
        end.checked_duration_since(start)
            .ok_or_else(|| ServerError::StopBeforeStart {
                backend: super::BACKEND,
                by: start - end,
            })
    }
}

impl EventInner {
    /// Let go of `state`, run `then`, and wake the threads waiting on `changed`, if any.
    fn wake(&self, state: MutexGuard<'_, EventState>, then: impl FnOnce()) {
        let waiting = state.waiting > 0;
        drop(state);
        then();
        if waiting {
            self.changed.notify_all();
        }
    }
}

impl Drop for EventInner {
    fn drop(&mut self) {
        self.live.freed();
    }
}

impl fmt::Debug for HostEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.state.lock();
        f.debug_struct("HostEvent")
            .field("recorded", &state.recorded)
            .field("pending", &state.pending)
            .finish()
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use super::*;

    fn event() -> HostEvent {
        let context = super::super::HostContext::new();
        HostEvent::create(false, &LiveEvents::default(), &context.shared, None)
    }

    #[test]
    fn a_later_record_reached_first_does_not_release_a_wait_on_an_earlier_one() {
        let event = event();
        let first = event.next_generation(0); // queued on a busy stream
        event.record_reached(); // recorded again on an idle stream
        assert!(event.query("event_query").unwrap(), "the latest is reached");
        let waiter = {
            let event = event.clone();
            std::thread::spawn(move || event.wait_for(first, "event_synchronize"))
        };
        // Until the waiter blocks, or returns (the defect).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while event.inner.state.lock().waiting == 0 && !waiter.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter neither blocked nor returned"
            );
            std::thread::yield_now();
        }
        assert!(
            !waiter.is_finished(),
            "the wait returned before its record was passed"
        );
        event.signal(first, || {});
        waiter.join().unwrap().unwrap();
    }

    #[test]
    fn a_signal_runs_what_follows_the_record_once_it_is_passed_and_before_the_wake() {
        let event = event();
        let first = event.next_generation(0);
        let waiter = {
            let event = event.clone();
            std::thread::spawn(move || event.wait_for(first, "event_synchronize"))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while event.inner.state.lock().waiting == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter never blocked"
            );
            std::thread::yield_now();
        }
        let mut seen = None;
        event.signal(first, || {
            let blocked = event.inner.state.lock().waiting;
            seen = Some((event.query("event_query").unwrap(), blocked));
        });
        assert_eq!(
            seen,
            Some((true, 1)),
            "(passed, blocked waits) as what follows the record runs"
        );
        waiter.join().unwrap().unwrap();
        assert_eq!(event.inner.state.lock().waiting, 0);
    }

    #[test]
    fn a_fault_fails_the_record_it_lost_only() {
        let event = event();
        let first = event.next_generation(0);
        let second = event.next_generation(0);
        event.fail(second, "illegal address");
        assert!(event.query("event_query").unwrap_err().is_faulted());
        assert!(
            event.inner.state.lock().settled(first).is_none(),
            "still pending"
        );
        event.signal(first, || {});
        assert_eq!(event.inner.state.lock().settled(first), Some(Ok(())));
        assert!(event.wait_for(first, "event_synchronize").is_ok());
        assert!(event
            .wait_for(second, "event_synchronize")
            .unwrap_err()
            .is_faulted());
    }

    #[test]
    fn a_never_recorded_event_is_complete() {
        let event = event();
        assert!(event.query("event_query").unwrap());
        assert!(event
            .wait_for(event.latest_generation(), "event_synchronize")
            .is_ok());
    }
}
