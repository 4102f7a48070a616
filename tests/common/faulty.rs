//! `Faulty`: the host backend with faults injected on demand, per stream, so
//! every fallback of `EventFence` can be reached and asserted.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use device_events::host::{Host, HostEvent, HostStreamHandle};
use device_events::{EventApi, EventFlags, ServerError};

/// What to refuse or break on one stream. Every injected error's message
/// carries `label`, so a test can find its own warnings among all logged.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub label: &'static str,
    pub refuse_create: bool,
    pub refuse_record: bool,
    /// Refuse device-side waits *of* this stream (it is the waiting one).
    pub refuse_stream_wait: bool,
    pub refuse_stream_synchronize: bool,
    /// A refused stream synchronize carries a source of the backend's own.
    pub stream_synchronize_source: bool,
    /// Refuse synchronizes of events created for this stream.
    pub refuse_synchronize: bool,
    /// Panic inside queries of events created for this stream.
    pub panic_in_query: bool,
    /// Panic inside synchronizes of events created for this stream.
    pub panic_in_synchronize: bool,
    /// Answer "not reached" to the first this-many queries of events created
    /// for this stream (then ask the host backend): a fence that passes
    /// between two queries, at an exact point.
    pub unreached_queries: usize,
    /// Panic inside the destroy of events created for this stream (after
    /// destroying them): an outside backend's event release that panics.
    pub panic_in_destroy: bool,
    /// Give every fence recorded on this stream the same sequence: two
    /// fences that collide in their stream's lane.
    pub same_sequence: bool,
    /// Refuse as a shut-down driver does (`ServerError::ShutDown`) rather
    /// than with a failed call.
    pub shut_down: bool,
}

static PLANS: Mutex<Option<HashMap<HostStreamHandle, Plan>>> = Mutex::new(None);

/// Inject `plan` into every later call on `stream`.
///
/// # Panics
///
/// If another stream already has a plan with the same label: log checks find
/// a test's warnings by its label in the process-wide capture, so a label
/// must belong to one stream (one test) only, and no label may contain
/// another.
pub fn inject(stream: HostStreamHandle, plan: Plan) {
    let mut plans = PLANS.lock().unwrap_or_else(|poison| poison.into_inner());
    let plans = plans.get_or_insert_with(HashMap::new);
    let clash = plans.iter().find(|(other, planned)| {
        **other != stream
            && (planned.label.contains(plan.label) || plan.label.contains(planned.label))
    });
    if let Some((_, planned)) = clash {
        panic!(
            "fault plan labels must be unique: '{}' clashes with '{}'",
            plan.label, planned.label
        );
    }
    plans.insert(stream, plan);
}

/// What a per-stream map holds for `stream` (the default when nothing).
fn read<T: Clone + Default>(
    map: &Mutex<Option<HashMap<HostStreamHandle, T>>>,
    stream: HostStreamHandle,
) -> T {
    map.lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .as_ref()
        .and_then(|map| map.get(&stream).cloned())
        .unwrap_or_default()
}

fn plan_of(stream: HostStreamHandle) -> Plan {
    read(&PLANS, stream)
}

fn refused(call: &'static str, plan: &Plan) -> ServerError {
    if plan.shut_down {
        return ServerError::ShutDown {
            backend: "Faulty",
            call,
        };
    }
    ServerError::call(
        "Faulty",
        call,
        device_events::status::UNKNOWN,
        "injected",
        format!("refused by the fault plan '{}'", plan.label),
    )
}

/// Per-stream counts of calls, for tests that must see where a call is.
type Counts = Mutex<Option<HashMap<HostStreamHandle, usize>>>;

static SYNCHRONIZING: Counts = Mutex::new(None);
static STREAM_SYNCHRONIZING: Counts = Mutex::new(None);
static SYNCHRONIZES: Counts = Mutex::new(None);
static STREAM_SYNCHRONIZES: Counts = Mutex::new(None);
static QUERIES: Counts = Mutex::new(None);
/// Per stream, the name of the thread each destroy ran on.
static DESTROYED_ON: Mutex<Option<HashMap<HostStreamHandle, Vec<String>>>> = Mutex::new(None);

/// Add `delta` to `stream`'s count; the new count.
fn add(counts: &Counts, stream: HostStreamHandle, delta: isize) -> usize {
    let mut counts = counts.lock().unwrap_or_else(|poison| poison.into_inner());
    let entry = counts
        .get_or_insert_with(HashMap::new)
        .entry(stream)
        .or_default();
    *entry = entry
        .checked_add_signed(delta)
        .expect("counts stay positive");
    *entry
}

/// How many events created for `stream` have been destroyed (`event_destroy`
/// called on them) so far.
pub fn destroyed(stream: HostStreamHandle) -> usize {
    destroyed_on(stream).len()
}

/// The names of the threads that destroyed the events created for `stream`,
/// in order (`"?"` for an unnamed thread).
pub fn destroyed_on(stream: HostStreamHandle) -> Vec<String> {
    read(&DESTROYED_ON, stream)
}

/// How many queries of events created for `stream` have been made.
pub fn queries(stream: HostStreamHandle) -> usize {
    read(&QUERIES, stream)
}

/// How many threads are inside `event_synchronize` on events of `stream`
/// right now.
pub fn synchronizing(stream: HostStreamHandle) -> usize {
    read(&SYNCHRONIZING, stream)
}

/// How many threads are inside `stream_synchronize` of `stream` right now.
pub fn stream_synchronizing(stream: HostStreamHandle) -> usize {
    read(&STREAM_SYNCHRONIZING, stream)
}

/// How many synchronizes of events created for `stream` have been made (host
/// waits on its fences), refused ones too.
pub fn synchronizes(stream: HostStreamHandle) -> usize {
    read(&SYNCHRONIZES, stream)
}

/// How many synchronizes of `stream` have been made, refused ones too.
pub fn stream_synchronizes(stream: HostStreamHandle) -> usize {
    read(&STREAM_SYNCHRONIZES, stream)
}

/// The fault-injecting backend.
pub struct Faulty;

/// A host event that remembers the stream it was created for.
pub struct FaultyEvent {
    inner: HostEvent,
    stream: HostStreamHandle,
}

impl EventApi for Faulty {
    const BACKEND: &'static str = "Faulty";
    type Stream = HostStreamHandle;
    type Event = FaultyEvent;

    fn event_create(
        stream: HostStreamHandle,
        flags: EventFlags,
    ) -> Result<FaultyEvent, ServerError> {
        let plan = plan_of(stream);
        if plan.refuse_create {
            return Err(refused("event_create", &plan));
        }
        Ok(FaultyEvent {
            inner: Host::event_create(stream, flags)?,
            stream,
        })
    }

    fn event_record(event: &FaultyEvent, stream: HostStreamHandle) -> Result<(), ServerError> {
        let plan = plan_of(stream);
        if plan.refuse_record {
            return Err(refused("event_record", &plan));
        }
        Host::event_record(&event.inner, stream)
    }

    fn event_query(event: &FaultyEvent) -> Result<bool, ServerError> {
        let plan = plan_of(event.stream);
        assert!(
            !plan.panic_in_query,
            "injected panic in query ({})",
            plan.label
        );
        if add(&QUERIES, event.stream, 1) <= plan.unreached_queries {
            return Ok(false);
        }
        Host::event_query(&event.inner)
    }

    fn event_synchronize(event: &FaultyEvent) -> Result<(), ServerError> {
        add(&SYNCHRONIZES, event.stream, 1);
        let plan = plan_of(event.stream);
        assert!(
            !plan.panic_in_synchronize,
            "injected panic in synchronize ({})",
            plan.label
        );
        if plan.refuse_synchronize {
            return Err(refused("event_synchronize", &plan));
        }
        add(&SYNCHRONIZING, event.stream, 1);
        let result = Host::event_synchronize(&event.inner);
        add(&SYNCHRONIZING, event.stream, -1);
        result
    }

    fn event_destroy(event: FaultyEvent) -> Result<(), ServerError> {
        let thread = std::thread::current();
        DESTROYED_ON
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .get_or_insert_with(HashMap::new)
            .entry(event.stream)
            .or_default()
            .push(thread.name().unwrap_or("?").to_owned());
        let plan = plan_of(event.stream);
        let destroyed = Host::event_destroy(event.inner);
        assert!(
            !plan.panic_in_destroy,
            "injected panic in destroy ({})",
            plan.label
        );
        destroyed
    }

    fn stream_wait_event(stream: HostStreamHandle, event: &FaultyEvent) -> Result<(), ServerError> {
        let plan = plan_of(stream);
        if plan.refuse_stream_wait {
            return Err(refused("stream_wait_event", &plan));
        }
        Host::stream_wait_event(stream, &event.inner)
    }

    fn stream_synchronize(stream: HostStreamHandle) -> Result<(), ServerError> {
        add(&STREAM_SYNCHRONIZES, stream, 1);
        let plan = plan_of(stream);
        if plan.refuse_stream_synchronize {
            let err = refused("stream_synchronize", &plan);
            return Err(match plan.stream_synchronize_source {
                true => err.with_source(std::io::Error::other("the backend's own cause")),
                false => err,
            });
        }
        add(&STREAM_SYNCHRONIZING, stream, 1);
        let result = Host::stream_synchronize(stream);
        add(&STREAM_SYNCHRONIZING, stream, -1);
        result
    }

    fn stream_sequence(stream: HostStreamHandle) -> u64 {
        if plan_of(stream).same_sequence {
            return 1;
        }
        Host::stream_sequence(stream)
    }

    fn event_elapsed(start: &FaultyEvent, end: &FaultyEvent) -> Result<Duration, ServerError> {
        Host::event_elapsed(&start.inner, &end.inner)
    }
}
