//! The host backend: streams that are CPU worker queues.
//!
//! It implements [`EventApi`] with the CUDA backend's semantics, so fences and the waiter can be
//! tested and demonstrated without a GPU, and GPU-shaped pipelines run on a CPU. Each CUDA rule
//! it models is cited beside the code: a wait is for the record current at the call
//! ([`HostEvent`]); a fault poisons its context ([`HostContext`]); dropping a stream returns at
//! once and its queued work still runs ([`HostStream`]).
//!
//! ```
//! use device_events::host::{Host, HostStream};
//! use device_events::{EventApi, EventFence};
//!
//! let stream = HostStream::new()?;
//! stream.launch(|| println!("runs on the stream's worker"))?;
//! let fence = EventFence::<Host>::new(stream.handle());
//! assert_eq!(format!("{fence:?}"), "HostFence");
//! fence.wait_sync()?;
//! Host::stream_synchronize(stream.handle())?;
//! # Ok::<(), device_events::ServerError>(())
//! ```

mod context;
mod event;
mod stream;

use std::time::Duration;

#[cfg(any(test, feature = "test-util"))]
pub use crate::backend::live_events::LiveEvents;
pub use context::HostContext;
pub use event::HostEvent;
pub use stream::{HostStream, HostStreamHandle};

use crate::{EventApi, EventFlags, ProgressWord, ServerError};

const BACKEND: &str = "Host";

/// The host backend; see the [module](self) docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Host;

impl EventApi for Host {
    const BACKEND: &'static str = BACKEND;
    type Stream = HostStreamHandle;
    type Event = HostEvent;

    fn event_create(stream: HostStreamHandle, flags: EventFlags) -> Result<HostEvent, ServerError> {
        stream.resolve("event_create")?.create_event(flags.timing)
    }

    fn event_record(event: &HostEvent, stream: HostStreamHandle) -> Result<(), ServerError> {
        stream.resolve("event_record")?.record(event).map(|_| ())
    }

    /// Numbered under the stream's lock, with the record's place in its queue.
    fn event_record_sequenced(
        event: &HostEvent,
        stream: HostStreamHandle,
    ) -> Result<u64, ServerError> {
        stream.resolve("event_record")?.record(event)
    }

    fn event_query(event: &HostEvent) -> Result<bool, ServerError> {
        event.query("event_query")
    }

    fn event_synchronize(event: &HostEvent) -> Result<(), ServerError> {
        event.wait_for(event.latest_generation(), "event_synchronize")
    }

    fn event_destroy(event: HostEvent) -> Result<(), ServerError> {
        // Queued markers hold their own reference, as a driver frees a destroyed event once its
        // work completes.
        drop(event);
        Ok(())
    }

    fn stream_wait_event(stream: HostStreamHandle, event: &HostEvent) -> Result<(), ServerError> {
        stream.resolve("stream_wait_event")?.wait_event(event)
    }

    fn stream_synchronize(stream: HostStreamHandle) -> Result<(), ServerError> {
        stream.resolve("stream_synchronize")?.synchronize()
    }

    fn event_elapsed(start: &HostEvent, end: &HostEvent) -> Result<Duration, ServerError> {
        HostEvent::elapsed(start, end)
    }

    /// The number of the stream's [`HostContext`], never given to another.
    fn stream_context(stream: HostStreamHandle) -> Result<u64, ServerError> {
        Ok(stream.resolve("stream_context")?.context.id)
    }

    /// From the stream's pool of up to 64 idle fence events.
    fn fence_event_acquire(stream: HostStreamHandle) -> Result<HostEvent, ServerError> {
        stream.resolve("event_create")?.take_fence_event()
    }

    fn fence_event_release(event: HostEvent) -> Result<(), ServerError> {
        event.release();
        Ok(())
    }

    /// One counter per stream: fences on different streams share nothing.
    fn stream_sequence(stream: HostStreamHandle) -> u64 {
        match stream.resolve("event_record") {
            Ok(stream) => stream.next_sequence(),
            // A dropped stream records nothing after: the number sorts after every one it gave.
            Err(_) => u64::MAX,
        }
    }

    /// Exact: the stream's registry number, never given to two streams.
    fn stream_id(stream: HostStreamHandle) -> u64 {
        stream.id
    }

    /// Advanced by the stream's worker as it passes each marker; a dropped stream has none.
    fn stream_progress(stream: HostStreamHandle) -> Option<ProgressWord> {
        stream
            .resolve("stream_progress")
            .ok()
            .map(|stream| ProgressWord::new(stream.progress.clone()))
    }

    fn fence_event_record(stream: HostStreamHandle) -> Result<(HostEvent, u64), ServerError> {
        let stream = stream.resolve("event_create")?;
        crate::api::record_fence_event(
            || stream.take_fence_event(),
            |event| stream.record(event),
            Self::fence_event_release,
        )
    }
}

/// The host backend's errors, with the CUDA codes of the same meaning.
mod error {
    use crate::{status, ServerError};

    pub(super) const INVALID_HANDLE: (i32, &str) = (status::INVALID_HANDLE, "invalid handle");
    pub(super) const NOT_READY: (i32, &str) = (status::NOT_READY, "not ready");
    pub(super) const NOT_PERMITTED: (i32, &str) = (status::NOT_PERMITTED, "not permitted");
    const LAUNCH_FAILED: (i32, &str) = (status::LAUNCH_FAILED, "launch failed");

    pub(super) fn call(
        call: &'static str,
        (code, name): (i32, &str),
        message: &str,
    ) -> ServerError {
        ServerError::call(super::BACKEND, call, code, name, message)
    }

    pub(super) fn faulted(call: &'static str, message: String) -> ServerError {
        let (code, name) = LAUNCH_FAILED;
        ServerError::faulted(super::BACKEND, call, code, name, message)
    }
}
