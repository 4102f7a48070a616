//! [`Shared`]: the state a [`DropQueue`](super::DropQueue), its thread and its futures share,
//! and the queue's thread.

use std::collections::{HashMap, VecDeque};
use std::sync::OnceLock;
use std::task::Waker;
use std::thread::ThreadId;

use super::fence::{drop_if_passed, settle, Fence};
use super::stats::DropQueueStats;
use crate::panics;
use crate::sync::{Condvar, Mutex, MutexGuard};

pub(super) struct Shared<F, T> {
    pub(super) state: Mutex<State<F, T>>,
    /// The queue's thread waits here for entries, flushes and blocking pushes for progress.
    pub(super) changed: Condvar,
    /// The queue's thread, set once started (before any value can reach it): a value's drop runs
    /// there, and must not wait for it.
    pub(super) thread: OnceLock<ThreadId>,
}

pub(super) struct State<F, T> {
    /// Entries with their push numbers (1, 2, ...), in push order.
    pub(super) queue: VecDeque<(u64, F, T)>,
    pub(super) capacity: usize,
    /// The push number of the entry the queue's thread is waiting on.
    pub(super) in_flight: Option<u64>,
    /// The lowest push number among entries [`shutdown_now`](super::DropQueue::shutdown_now) took
    /// out and has not yet dropped or handed back.
    pub(super) checking: Option<u64>,
    pub(super) closing: bool,
    /// Set by the queue's thread, under this lock, when it has decided to exit (closing,
    /// nothing queued): from then on nobody else will drop a queued value.
    pub(super) exited: bool,
    pub(super) stats: DropQueueStats,
    /// Futures awaiting progress or room: woken after each value and on exit.
    pub(super) wakers: Wakers,
}

/// The wakers of pending futures, one per future, found without a scan; a future dropped
/// unresolved takes its waker out.
#[derive(Default)]
pub(super) struct Wakers {
    next: u64,
    by_future: HashMap<u64, Waker>,
}

impl Wakers {
    pub(super) fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Keep `waker` for future `id`; the one it replaces comes back, to drop outside the lock (a
    /// waker's drop is an executor's code).
    #[must_use]
    pub(super) fn register(&mut self, id: u64, waker: &Waker) -> Option<Waker> {
        match self.by_future.get(&id) {
            Some(known) if known.will_wake(waker) => None,
            _ => self.by_future.insert(id, waker.clone()),
        }
    }

    /// Forget future `id`'s waker; it comes back, to drop outside the lock.
    #[must_use]
    pub(super) fn remove(&mut self, id: u64) -> Option<Waker> {
        self.by_future.remove(&id)
    }

    /// All of them, to wake outside the lock (a future still waiting registers again).
    pub(super) fn take(&mut self) -> Vec<Waker> {
        self.by_future.drain().map(|(_, waker)| waker).collect()
    }
}

impl<F, T> Shared<F, T> {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                capacity,
                in_flight: None,
                checking: None,
                closing: false,
                exited: false,
                stats: DropQueueStats::default(),
                wakers: Wakers::default(),
            }),
            changed: Condvar::new(),
            thread: OnceLock::new(),
        }
    }

    /// Whether the caller is the queue's own thread (in a value's drop).
    pub(super) fn on_own_thread(&self) -> bool {
        self.thread.get() == Some(&current_thread())
    }

    /// Refuse new pushes; wake the queue's thread, blocked pushers and pending push futures.
    pub(super) fn close(&self) {
        self.update_and_wake(|state| state.closing = true);
    }

    /// Change the state, then wake everyone who waits on it: blocked threads and pending futures.
    pub(super) fn update_and_wake(&self, change: impl FnOnce(&mut State<F, T>)) {
        let wakers = {
            let mut state = self.state.lock();
            change(&mut state);
            state.wakers.take()
        };
        self.changed.notify_all();
        // A waker that panics (a user's executor) costs only its own wake.
        for waker in wakers {
            if let Err(message) = panics::catch(|| waker.wake()) {
                panics::log(|| {
                    log::error!("a task's waker panicked when the drop queue woke it: {message}")
                });
            }
        }
    }
}

pub(super) fn current_thread() -> ThreadId {
    std::thread::current().id()
}

impl<F: Fence, T: Send + 'static> Shared<F, T> {
    /// Queue an entry (the caller checked room and closing) and wake the queue's thread.
    pub(super) fn enqueue(&self, mut state: MutexGuard<'_, State<F, T>>, fence: F, value: T) {
        state.stats.pushed += 1;
        let number = state.stats.pushed;
        state.queue.push_back((number, fence, value));
        drop(state);
        self.changed.notify_all();
    }

    /// Take in a value whose push was refused or abandoned: queued past the capacity, even while
    /// closing, as long as the queue's thread will see it; after, dropped here if its fence has
    /// passed, else leaked (the dropping thread may be an executor's, and must not wait).
    pub(super) fn adopt(&self, fence: F, value: T) {
        let state = self.state.lock();
        if !state.exited {
            self.enqueue(state, fence, value);
            return;
        }
        drop(state);
        let passed = drop_if_passed(fence, value);
        if !passed {
            panics::log(|| {
                log::warn!(
                    "a value was given to a drop queue whose thread has exited, before its \
                     fence passed; leaking it rather than freeing memory the device may \
                     still read"
                );
            });
        }
        // Both at once: a reader never sees the value in no count.
        let mut state = self.state.lock();
        state.stats.pushed += 1;
        state.count_settled(passed);
    }

    /// The queue's thread: settle each value in push order.
    pub(super) fn run(&self) {
        crate::os::mark_own_thread();
        // Whichever way the thread ends, awaiting shutdowns learn it.
        let _exit = ExitGuard(self);
        loop {
            let (fence, value) = {
                let mut state = self.state.lock();
                loop {
                    if let Some((number, fence, value)) = state.queue.pop_front() {
                        state.in_flight = Some(number);
                        break (fence, value);
                    }
                    if state.closing {
                        state.exited = true;
                        return;
                    }
                    state = self.changed.wait(state);
                }
            };
            let dropped = settle(fence, value).is_ok();
            self.update_and_wake(|state| {
                state.in_flight = None;
                state.count_settled(dropped);
            });
        }
    }
}

/// What a [`Rejected`](super::Rejected)'s drop needs of its queue, without its bounds on `F`, `T`.
pub(super) trait Adopt<F, T>: Send + Sync {
    /// As [`Shared::adopt`].
    fn adopt(&self, fence: F, value: T);
}

impl<F: Fence, T: Send + 'static> Adopt<F, T> for Shared<F, T> {
    fn adopt(&self, fence: F, value: T) {
        Shared::adopt(self, fence, value);
    }
}

/// The queue's thread's last act, even by a panic: say it exits, and wake who awaits that.
struct ExitGuard<'a, F: Fence, T: Send + 'static>(&'a Shared<F, T>);

impl<F: Fence, T: Send + 'static> Drop for ExitGuard<'_, F, T> {
    fn drop(&mut self) {
        self.0.update_and_wake(|state| state.exited = true);
    }
}

impl<F, T> State<F, T> {
    pub(super) fn pending(&self) -> usize {
        self.queue.len() + usize::from(self.in_flight.is_some())
    }

    /// Count a value [`settle`]d: dropped, or leaked when its fence failed.
    pub(super) fn count_settled(&mut self, dropped: bool) {
        if dropped {
            self.stats.dropped += 1;
        } else {
            self.stats.leaked += 1;
        }
    }

    /// Whether the first `target` values pushed are all dropped, leaked or handed back: none is
    /// queued, waited on, or checked by `shutdown_now` (by push number: it hands back later values
    /// while an earlier one is waited on); or the thread has exited with nothing being checked.
    pub(super) fn handled(&self, target: u64) -> bool {
        let after = |number: Option<u64>| number.is_none_or(|number| number > target);
        let settled = after(self.in_flight)
            && after(self.queue.front().map(|(number, ..)| *number))
            && after(self.checking);
        settled || (self.exited && self.checking.is_none())
    }

    pub(super) fn stats(&self) -> DropQueueStats {
        DropQueueStats {
            pending: self.pending(),
            queued: self.queue.len(),
            ..self.stats
        }
    }
}
