//! [`EventProfiler`]: device time between two stream points, from a bounded pool of timing events.

use std::collections::HashSet;
use std::fmt;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::FusedFuture;

use crate::sync::checked::{Checked, Invariants};
use crate::sync::Mutex;
use crate::waiter::{Handoff, LaneKey, Waitable, Waiter};
use crate::{Event, EventApi, EventFlags, ServerError};

/// Default [`EventProfiler::with_capacity`].
pub const DEFAULT_PROFILER_CAPACITY: usize = 64;

/// Measures device time between two points of a stream.
///
/// [`start`](Self::start) and [`stop`](Self::stop) record timing events; the [`Profile`] they give
/// resolves to the device time between them, by [`Profile::wait_sync`] or `.await` (on the
/// [`Waiter`]). Events come from a pool and go back to it once read or dropped unread, so a hot
/// loop allocates no events after its first round; the pool destroys those past its capacity.
///
/// The pool keeps idle events per context ([`EventApi::stream_context`]), so one profiler serves
/// every device or host context; once full, the context used least recently gives up an idle
/// event to the one in use. A profile's two points must be on streams of one context: else it is
/// refused when read, as the driver refuses (`CUDA_ERROR_INVALID_HANDLE`; each host stream made
/// with [`HostStream::new`](crate::host::HostStream::new) has its own context).
///
/// # Example
///
/// ```
/// use device_events::host::{Host, HostStream};
/// use device_events::EventProfiler;
/// use std::time::Duration;
///
/// let stream = HostStream::new()?;
/// let profiler = EventProfiler::<Host>::new();
/// let mut total = Duration::ZERO;
/// for _ in 0..10 {
///     let start = profiler.start(stream.handle())?;
///     stream.launch(|| std::thread::sleep(Duration::from_millis(1)))?;
///     total += profiler.stop(start, stream.handle())?.wait_sync()?;
/// }
/// assert!(total >= Duration::from_millis(10));
/// assert_eq!(profiler.created(), 2, "two events, reused for every round");
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct EventProfiler<A: EventApi> {
    pool: Arc<EventPool<A>>,
}

struct EventPool<A: EventApi> {
    idle: Mutex<Idle<A>>,
    created: AtomicUsize,
}

/// The idle events, by context key.
struct Idle<A: EventApi> {
    /// An entry per context key with idle events, and those emptied since a key was last added
    /// (so a busy context keeps its `Vec`): about one per device in use, so searched in turn.
    contexts: Vec<ContextEvents<A>>,
    /// Idle events over all contexts, at most `capacity`.
    len: usize,
    capacity: usize,
    /// Counts takes and give-backs, to tell which context was used least recently.
    clock: u64,
}

struct ContextEvents<A: EventApi> {
    key: u64,
    events: Vec<Event<A>>,
    /// [`Idle::clock`] at the context's last take or give-back.
    used: u64,
}

/// What a profiler holds and has made, over all the contexts it serves:
/// [`EventProfiler::stats`], [`AnyProfiler::stats`](crate::AnyProfiler::stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ProfilerStats {
    /// [`EventProfiler::created`].
    pub created: u64,
    /// Idle events in its pool now.
    pub pooled: usize,
}

/// A started measurement for [`EventProfiler::stop`]. Dropped, its event goes back to the pool.
#[must_use = "a profile start measures nothing until it is stopped"]
pub struct ProfileStart<A: EventApi> {
    event: Option<Event<A>>,
    key: u64,
    pool: Arc<EventPool<A>>,
}

/// A stopped measurement: the device time from start to stop, once the device reaches the stop.
/// Dropped unread, its events go back to the pool.
#[must_use = "a profile is read with wait_sync() or .await"]
pub struct Profile<A: EventApi> {
    pair: Arc<EventPair<A>>,
    stream: A::Stream,
    sequence: u64,
}

/// The two events of a measurement, each held as a [`ProfileStart`] is: back to its pool when the
/// last holder (the caller, or a waiter thread) drops the pair.
struct EventPair<A: EventApi> {
    start: ProfileStart<A>,
    end: ProfileStart<A>,
}

impl<A: EventApi> EventProfiler<A> {
    /// A profiler keeping up to [`DEFAULT_PROFILER_CAPACITY`] idle events.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_PROFILER_CAPACITY)
    }

    /// A profiler keeping up to `capacity` idle events, over all contexts (0 keeps none).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            pool: Arc::new(EventPool {
                idle: Mutex::new(Idle {
                    contexts: Vec::new(),
                    len: 0,
                    capacity,
                    clock: 0,
                }),
                created: AtomicUsize::new(0),
            }),
        }
    }

    /// Record the start of a measurement at the current end of `stream`.
    ///
    /// # Errors
    ///
    /// The driver refused to create or record a timing event, or the stream is faulted or invalid;
    /// [`ServerError::InvalidArgument`] when the backend gives two contexts one key (the default
    /// [`EventApi::stream_context`]) and the idle events are of the other.
    pub fn start(&self, stream: A::Stream) -> Result<ProfileStart<A>, ServerError> {
        Ok(self.record(stream)?.0)
    }

    /// Record the end of `start` at the current end of `stream` (usually the one it started on).
    ///
    /// # Errors
    ///
    /// As for [`start`](Self::start); `start`'s event goes back to the pool.
    pub fn stop(
        &self,
        start: ProfileStart<A>,
        stream: A::Stream,
    ) -> Result<Profile<A>, ServerError> {
        let (end, sequence) = self.record(stream)?;
        Ok(Profile {
            pair: Arc::new(EventPair { start, end }),
            stream,
            sequence,
        })
    }

    /// A pooled timing event recorded at the current end of `stream`, with the record's sequence.
    fn record(&self, stream: A::Stream) -> Result<(ProfileStart<A>, u64), ServerError> {
        let key = A::stream_context(stream)?;
        let (event, sequence) = self.pool.record(key, stream)?;
        let start = ProfileStart {
            event: Some(event),
            key,
            pool: self.pool.clone(),
        };
        Ok((start, sequence))
    }

    /// Idle events in the pool now, over all contexts.
    pub fn pooled(&self) -> usize {
        self.pool.idle.lock().len
    }

    /// Events this profiler has created in all, over all contexts (a loop that stops growing this
    /// allocates no events).
    pub fn created(&self) -> usize {
        self.pool.created.load(Ordering::Relaxed)
    }

    /// [`created`](Self::created) and [`pooled`](Self::pooled) together.
    pub fn stats(&self) -> ProfilerStats {
        ProfilerStats {
            created: self.created() as u64,
            pooled: self.pooled(),
        }
    }
}

impl<A: EventApi> Default for EventProfiler<A> {
    fn default() -> Self {
        Self::new()
    }
}

impl<A: EventApi> EventPool<A> {
    /// A pooled event of the context `key` (or a new one) recorded on `stream`, with the record's
    /// sequence. A pooled event the stream refuses goes back to the pool: with the stream's error
    /// when a new event is refused too (faulted or gone), so refused starts neither destroy
    /// healthy events nor make new ones; when a new one is accepted, the pooled one is of another
    /// context under the same key (the default [`EventApi::stream_context`]): an error, not a
    /// silent swap of the pool.
    fn record(&self, key: u64, stream: A::Stream) -> Result<(Event<A>, u64), ServerError> {
        let refused = match Checked::lock(&self.idle).take(key) {
            Some(event) => match event.record_sequenced(stream) {
                Ok(sequence) => return Ok((event, sequence)),
                Err(err) => Some((event, err)),
            },
            None => None,
        };
        let fresh = Event::new(stream, EventFlags::TIMING).map(|fresh| {
            self.created.fetch_add(1, Ordering::Relaxed);
            let sequence = fresh.record_sequenced(stream);
            (fresh, sequence)
        });
        let refused = refused.map(|(event, err)| {
            self.give_back(key, event);
            err
        });
        match (fresh?, refused) {
            ((fresh, Err(err)), _) => {
                self.give_back(key, fresh);
                Err(err)
            }
            ((fresh, Ok(sequence)), None) => Ok((fresh, sequence)),
            ((_fresh, Ok(_)), Some(err)) => Err(ServerError::InvalidArgument {
                what: "EventProfiler stream",
                reason: format!(
                    "this profiler's events belong to another {} context (device) than the \
                     stream's, which refused them ({err}), and the backend does not tell its \
                     contexts apart (EventApi::stream_context): use one profiler per context",
                    A::BACKEND
                ),
            }),
        }
    }

    /// [`Idle::give_back`], destroying what it hands back outside the pool's lock.
    fn give_back(&self, key: u64, event: Event<A>) {
        let destroyed = Checked::lock(&self.idle).give_back(key, event);
        drop(destroyed);
    }
}

impl<A: EventApi> Idle<A> {
    /// An idle event of the context `key`.
    fn take(&mut self, key: u64) -> Option<Event<A>> {
        self.clock += 1;
        let context = self
            .contexts
            .iter_mut()
            .find(|context| context.key == key)?;
        let event = context.events.pop()?;
        context.used = self.clock;
        assert!(self.len > 0, "an idle event taken from an empty pool");
        self.len -= 1;
        Some(event)
    }

    /// Keep `event`, of the context `key`; the event to destroy, if any. At the capacity, the
    /// context used least recently, when that is another, gives up an idle event for it (so
    /// contexts no longer used make way), and otherwise `event` itself is destroyed.
    fn give_back(&mut self, key: u64, event: Event<A>) -> Option<Event<A>> {
        if self.capacity == 0 {
            return Some(event);
        }
        self.clock += 1;
        let index = self.contexts.iter().position(|context| context.key == key);
        let index = index.unwrap_or_else(|| {
            self.contexts.retain(|context| !context.events.is_empty());
            self.contexts.push(ContextEvents {
                key,
                events: Vec::new(),
                used: 0,
            });
            self.contexts.len() - 1
        });
        let evicted = if self.len < self.capacity {
            self.len += 1;
            None
        } else {
            let oldest = self
                .contexts
                .iter_mut()
                .enumerate()
                .filter(|(other, context)| *other != index && !context.events.is_empty())
                .min_by_key(|(_, context)| context.used);
            match oldest {
                Some((_, context)) => context.events.pop(),
                None => return Some(event),
            }
        };
        let context = &mut self.contexts[index];
        context.events.push(event);
        context.used = self.clock;
        evicted
    }
}

/// `len` counts the idle events, within the capacity; one entry per key.
impl<A: EventApi> Invariants for Idle<A> {
    fn check_invariants(&self) {
        let idle = self.contexts.iter().map(|c| c.events.len()).sum::<usize>();
        assert_eq!(self.len, idle, "the idle count drifted");
        assert!(self.len <= self.capacity, "more idle than the capacity");
        let keys = self.contexts.iter().map(|c| c.key).collect::<HashSet<_>>();
        assert_eq!(keys.len(), self.contexts.len(), "a context listed twice");
    }
}

impl<A: EventApi> Profile<A> {
    /// Block until the device reached both the start and the stop (`cuEventElapsedTime` returns
    /// `CUDA_ERROR_NOT_READY` until both are); the device time from start to stop.
    ///
    /// # Errors
    ///
    /// A fault of either stream, or the driver's refusal to time the events.
    pub fn wait_sync(self) -> Result<Duration, ServerError> {
        self.pair.wait_both()?;
        self.pair.elapsed()
    }

    /// A future of the device time on [`Waiter::global()`], as `profile.await`; on another waiter,
    /// `waiter.wait(profile)`.
    pub fn wait(self) -> ProfileFuture<A> {
        Waiter::global().wait(self)
    }
}

impl<A: EventApi> crate::waiter::sealed::Sealed for Profile<A> {}

impl<A: EventApi> crate::waiter::Awaitable for Profile<A> {
    type Future = ProfileFuture<A>;

    fn wait_on(self, waiter: &Waiter) -> ProfileFuture<A> {
        let wait = PairWait {
            pair: Arc::downgrade(&self.pair),
            stream: self.stream,
            sequence: self.sequence,
        };
        ProfileFuture {
            pair: self.pair,
            handoff: waiter.handoff(wait),
        }
    }
}

impl<A: EventApi> EventPair<A> {
    fn start(&self) -> &Event<A> {
        self.start.event.as_ref().expect("emptied only by its drop")
    }

    fn end(&self) -> &Event<A> {
        self.end.event.as_ref().expect("emptied only by its drop")
    }

    /// The start may be on another, busier stream than the stop.
    fn wait_both(&self) -> Result<(), ServerError> {
        self.start().wait_sync()?;
        self.end().wait_sync()
    }

    fn elapsed(&self) -> Result<Duration, ServerError> {
        self.end().elapsed_since(self.start())
    }
}

impl<A: EventApi> Drop for ProfileStart<A> {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            self.pool.give_back(self.key, event);
        }
    }
}

/// What the waiter holds of a profile: its two events, weakly, upgraded only for a query or a
/// blocking wait, so a completed profile's events are back in the pool by the time its future
/// returns (a loop awaiting each profile reuses the same two).
struct PairWait<A: EventApi> {
    pair: Weak<EventPair<A>>,
    stream: A::Stream,
    sequence: u64,
}

/// Both events, on the stop stream's lane (the lane's thread may block on a start stream's work
/// first). A pair already gone (its future dropped) has nothing left to wait for.
impl<A: EventApi> Waitable for PairWait<A> {
    fn lane(&self) -> LaneKey {
        LaneKey::of::<A>(self.stream)
    }

    fn sequence(&self) -> u64 {
        self.sequence
    }

    fn query(&self) -> Result<bool, ServerError> {
        let Some(pair) = self.pair.upgrade() else {
            return Ok(true);
        };
        Ok(pair.start().is_complete()? && pair.end().is_complete()?)
    }

    fn block(&self) -> Result<(), ServerError> {
        self.pair.upgrade().map_or(Ok(()), |pair| pair.wait_both())
    }

    fn stream_name(&self) -> String {
        format!("{} stream {:?}", A::BACKEND, self.stream)
    }

    fn progress(&self) -> Option<crate::ProgressWord> {
        None
    }
}

/// The future of [`Profile::wait`] and `profile.await`: the device time between start and stop.
///
/// # Cancel safety
///
/// Dropping it cancels the wait without blocking. Its events go back to the pool at once, or when
/// a waiter thread blocked on one of them right then stops waiting.
#[must_use = "futures do nothing unless you .await or poll them"]
pub struct ProfileFuture<A: EventApi> {
    pair: Arc<EventPair<A>>,
    handoff: Handoff<PairWait<A>>,
}

impl<A: EventApi> Future for ProfileFuture<A> {
    type Output = Result<Duration, ServerError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.handoff
            .poll(cx)
            .map(|reached| reached.and_then(|()| this.pair.elapsed()))
    }
}

// Nothing here is pinned in place: the future only moves handles.
impl<A: EventApi> Unpin for ProfileFuture<A> {}

impl<A: EventApi> FusedFuture for ProfileFuture<A> {
    fn is_terminated(&self) -> bool {
        self.handoff.is_terminated()
    }
}

impl<A: EventApi> IntoFuture for Profile<A> {
    type Output = Result<Duration, ServerError>;
    type IntoFuture = ProfileFuture<A>;

    fn into_future(self) -> ProfileFuture<A> {
        self.wait()
    }
}

impl<A: EventApi> fmt::Debug for EventProfiler<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(&format!("{}EventProfiler", A::BACKEND))
            .field("pooled", &self.pooled())
            .field("created", &self.created())
            .finish()
    }
}

impl<A: EventApi> fmt::Debug for ProfileStart<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ProfileStart", A::BACKEND)
    }
}

impl<A: EventApi> fmt::Debug for Profile<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}Profile", A::BACKEND)
    }
}

impl<A: EventApi> fmt::Debug for ProfileFuture<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ProfileFuture({})", A::BACKEND, self.handoff.phase())
    }
}
