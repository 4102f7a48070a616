//! Log lines queued where they are made (under some lock, so they are in
//! order) and logged later, where no lock is held: in the order they were
//! queued, one thread at a time, each exactly once. The stuck-wait reports
//! use it ([`super::stuck`]).
//!
//! Whoever queues a line calls [`LineQueue::log`] once it holds no lock. If
//! another thread is logging then, that thread logs the line too: it stops
//! only when it finds the queue empty, under the same lock a push takes, so
//! a line is either found by it or pushed after it stopped (and then logged
//! by its maker).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;

use crate::loom::{AtomicBool, Mutex};

pub(crate) struct LineQueue<L> {
    state: Mutex<State<L>>,
    /// Whether `state` holds lines: read without its lock, so the paths
    /// that end waits take no lock when there is nothing to log. Set under
    /// the lock by each push, cleared under it by the logger that empties
    /// the queue.
    has_lines: AtomicBool,
}

struct State<L> {
    lines: VecDeque<L>,
    /// A thread is logging this queue's lines: others leave theirs to it,
    /// so that they come out in order.
    logging: bool,
}

impl<L> LineQueue<L> {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State {
                lines: VecDeque::new(),
                logging: false,
            }),
            has_lines: AtomicBool::new(false),
        }
    }

    /// Queue `line`; the caller then calls [`LineQueue::log`] once it holds
    /// no lock.
    pub(crate) fn push(&self, line: L) {
        let mut state = self.state.lock();
        state.lines.push_back(line);
        self.has_lines.store(true, Ordering::Release);
    }

    /// Hand each line queued so far to `log`, oldest first, with no lock
    /// held; or leave them to the thread doing so now, which also hands on
    /// those queued before it finds the queue empty. `log` must not unwind
    /// (the caller contains the logger's panics): a logger that unwound
    /// would leave the queue marked as being logged, and no line would
    /// leave it again.
    pub(crate) fn log(&self, mut log: impl FnMut(L)) {
        // A line pushed after this look is logged by its own maker.
        if !self.has_lines.load(Ordering::Acquire) {
            return;
        }
        {
            let mut state = self.state.lock();
            if state.logging || state.lines.is_empty() {
                return;
            }
            if state.lines.len() == 1 && crate::plant::planted("line-maker-logs-a-lone-line-itself")
            {
                // Logged outside the turn: it can overtake a line logged
                // before it by the thread whose turn it is.
                let line = state.lines.pop_front();
                drop(state);
                line.into_iter().for_each(log);
                return;
            }
            state.logging = true;
        }
        loop {
            let line = {
                let mut state = self.state.lock();
                let Some(line) = state.lines.pop_front() else {
                    if crate::plant::planted("line-logger-stops-after-letting-go") {
                        // Stops in a second hold of the lock: a line pushed
                        // in between is left to a logger that is gone.
                        drop(state);
                        self.has_lines.store(false, Ordering::Release);
                        self.state.lock().logging = false;
                        return;
                    }
                    state.logging = false;
                    self.has_lines.store(false, Ordering::Release);
                    return;
                };
                line
            };
            log(line);
        }
    }
}
