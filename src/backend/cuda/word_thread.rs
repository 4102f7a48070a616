//! The word thread: the one thread that takes progress words for streams, so that page-locked
//! allocation never runs where a wait waits (why: `progress.rs`, "Memory"). It serves no wait,
//! starts at a request when none runs, and exits once its queue is empty, as the drop queue's and
//! the waiter's threads leave when idle; a thread that cannot start leaves its requests unserved,
//! and their streams ask again at their next wait.
//!
//! One thread serves every context, in turn: a stream's word can wait behind another context's
//! allocation, its waits going to the driver meanwhile. While it serves a stream it holds the
//! stream alive, so a stream whose last handle went meanwhile is destroyed on this thread
//! (cudarc binds the context to do so, keeping the error a user's next call is due).

use std::collections::VecDeque;
use std::sync::OnceLock;

use crate::sync::{Condvar, Mutex};
use crate::{panics, ServerError};

/// A stream's request for a word.
pub(super) trait Request: Send {
    /// Take a word for the stream, if it is still alive (on the word thread).
    fn serve(&self);
    /// The thread could not start: the stream asks again at its next wait.
    fn unserved(&self);
}

/// The streams waiting for a word, and whether a thread serves them.
#[derive(Default)]
struct Requests {
    queue: VecDeque<Box<dyn Request>>,
    running: bool,
}

fn requests() -> &'static Mutex<Requests> {
    // In a `OnceLock`: the crate's mutex is not `const` under loom.
    static REQUESTS: OnceLock<Mutex<Requests>> = OnceLock::new();
    REQUESTS.get_or_init(Mutex::default)
}

/// Queue `request`, and start the thread if none runs. Makes no driver call; holds the queue's
/// lock only to queue.
pub(super) fn request(request: Box<dyn Request>) {
    let start = {
        let mut requests = requests().lock();
        requests.queue.push_back(request);
        !std::mem::replace(&mut requests.running, true)
    };
    if !start {
        return;
    }
    let started = std::thread::Builder::new()
        .name("device-events-words".to_owned())
        .spawn(run);
    if let Err(err) = started {
        let err = ServerError::thread_spawn("the CUDA progress-word thread", err);
        log::debug!("no progress words for now: {err}; their streams ask again at their next wait");
        let unserved = {
            let mut requests = requests().lock();
            requests.running = false;
            std::mem::take(&mut requests.queue)
        };
        idle().notify_all();
        for request in unserved {
            request.unserved();
        }
    }
}

/// Wait (at most `timeout`) until no stream is queued or being served: whether that came.
#[cfg(feature = "test-util")]
pub(super) fn wait_idle(timeout: std::time::Duration) -> bool {
    if super::driver::in_forked_child() {
        // The queue's lock may have stayed held in the parent.
        return false;
    }
    let deadline = std::time::Instant::now() + timeout;
    let mut requests = requests().lock();
    while requests.running || !requests.queue.is_empty() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        requests = idle().wait_timeout(requests, left).0;
    }
    true
}

/// Notified when the thread has nothing left to serve.
fn idle() -> &'static Condvar {
    static IDLE: OnceLock<Condvar> = OnceLock::new();
    IDLE.get_or_init(Condvar::default)
}

/// The thread: serve each queued request, until none is queued.
fn run() {
    #[cfg(multi_threading)]
    crate::os::mark_own_thread();
    loop {
        let next = {
            let mut requests = requests().lock();
            let next = requests.queue.pop_front();
            requests.running = next.is_some();
            next
        };
        let Some(request) = next else {
            idle().notify_all();
            return;
        };
        // cudarc's or the driver's code: a panic costs this stream its word, not the thread.
        if let Err(message) = panics::catch(|| request.serve()) {
            log::error!("taking a CUDA stream's progress word panicked: {message}");
        }
        let _ = panics::drop_caught(request);
    }
}
