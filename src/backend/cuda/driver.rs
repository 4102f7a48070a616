//! Every raw CUDA driver call of the crate, behind [`check`], which turns a
//! status into a [`ServerError`].
//!
//! cudarc's safe layer is used where it fits (contexts and streams); the calls
//! here drop to `cudarc::driver::sys` because a fence event needs flags that
//! cudarc's enum cannot express (`DISABLE_TIMING | BLOCKING_SYNC`), queries
//! need all three outcomes, destroying an event must report its error to the
//! caller, and binding a context must not take cudarc's stored errors.
//!
//! The driver API pages the rules here come from (CUDA 12 and 13):
//! - events (`cuEventCreate`, `cuEventRecord`, `cuEventQuery`,
//!   `cuEventSynchronize`, `cuEventDestroy`, `cuEventElapsedTime`):
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EVENT.html>
//! - streams (`cuStreamWaitEvent`, `cuStreamSynchronize`, the default streams):
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html>
//! - contexts (`cuCtxGetCurrent`, `cuCtxSetCurrent`):
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__CTX.html>
//! - status codes and which are sticky (`CUresult`), event flags
//!   (`CUevent_flags`): <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html>
//! - modules and launches (`cuModuleLoadData`, `cuLaunchKernel`):
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html>,
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html>
// The crate's one FFI edge: every `unsafe` of the crate is here, each with
// a `// SAFETY:` comment (the crate root denies `unsafe_code` elsewhere).
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::fmt;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::loom::Mutex;
use crate::ServerError;

pub(super) const BACKEND: &str = "Cuda";

/// Every driver entry point this crate or the cudarc calls it makes resolve.
/// cudarc resolves a symbol on first use and panics if it is missing, so all
/// are probed once, up front, and a missing one makes the backend unavailable.
/// Each exists in CUDA 12.0 and later drivers, CUDA 13 included.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// The names `cuEventElapsedTime` has had: CUDA 12.8 added `_v2`, and CUDA
/// 13 headers map the plain name to it. Both take the same arguments, so the
/// first one the library exports is used, and a driver with neither only
/// loses timing, not the backend.
const ELAPSED_SYMBOLS: [&str; 2] = ["cuEventElapsedTime", "cuEventElapsedTime_v2"];

/// A driver status, as the driver returns it: a C `enum`, which is an `int`.
type Status = c_int;

/// The driver entry points this crate calls itself, looked up once by name
/// and typed to return the status as a plain integer. cudarc's `sys` bindings
/// return a Rust `enum`, and a status that the compiled bindings do not list
/// (a driver newer than the bindings a user picked: `CUDA_ERROR_CONTAINED`
/// from a CUDA 13 driver under the CUDA 12.0 bindings, say) would be undefined
/// behaviour the moment it came back. As an integer, any status is a number.
/// Signatures: the CUDA driver API reference (links at the top of this file).
struct Api {
    init: unsafe extern "C" fn(c_uint) -> Status,
    error_name: unsafe extern "C" fn(Status, *mut *const c_char) -> Status,
    error_string: unsafe extern "C" fn(Status, *mut *const c_char) -> Status,
    ctx_get_current: unsafe extern "C" fn(*mut sys::CUcontext) -> Status,
    ctx_set_current: unsafe extern "C" fn(sys::CUcontext) -> Status,
    event_create: unsafe extern "C" fn(*mut sys::CUevent, c_uint) -> Status,
    event_record: unsafe extern "C" fn(sys::CUevent, sys::CUstream) -> Status,
    event_query: unsafe extern "C" fn(sys::CUevent) -> Status,
    event_synchronize: unsafe extern "C" fn(sys::CUevent) -> Status,
    event_destroy: unsafe extern "C" fn(sys::CUevent) -> Status,
    /// Under either of its names (see [`ELAPSED_SYMBOLS`]); a driver with
    /// neither only loses timing.
    event_elapsed: Option<unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> Status>,
    stream_wait_event: unsafe extern "C" fn(sys::CUstream, sys::CUevent, c_uint) -> Status,
    stream_synchronize: unsafe extern "C" fn(sys::CUstream) -> Status,
    module_load_data: unsafe extern "C" fn(*mut sys::CUmodule, *const c_void) -> Status,
    module_get_function:
        unsafe extern "C" fn(*mut sys::CUfunction, sys::CUmodule, *const c_char) -> Status,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        sys::CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        sys::CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> Status,
}

/// Filled by [`load`] once every required symbol was found.
static API: OnceLock<Api> = OnceLock::new();

/// The driver's entry points: loads the driver first if need be.
fn api() -> Result<&'static Api, ServerError> {
    ensure_loaded()?;
    API.get()
        .ok_or_else(|| unavailable("the CUDA driver's entry points were not found".to_owned()))
}

/// Status codes after which the process must restart: "This leaves the
/// process in an inconsistent state and any further CUDA work will return the
/// same error. To continue using CUDA, the process must be terminated and
/// relaunched" (CUDA driver API, `CUresult`, CUDA 12 and 13 docs:
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html>).
/// Taken from cudarc's `sys` enum wherever every binding this crate builds
/// with (CUDA 12.0 and later) has the variant.
const STICKY: &[sys::CUresult] = &[
    sys::CUresult::CUDA_ERROR_ECC_UNCORRECTABLE,
    sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
    sys::CUresult::CUDA_ERROR_LAUNCH_TIMEOUT,
    sys::CUresult::CUDA_ERROR_ASSERT,
    sys::CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR,
    sys::CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION,
    sys::CUresult::CUDA_ERROR_MISALIGNED_ADDRESS,
    sys::CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE,
    sys::CUresult::CUDA_ERROR_INVALID_PC,
    sys::CUresult::CUDA_ERROR_LAUNCH_FAILED,
    sys::CUresult::CUDA_ERROR_MPS_CLIENT_TERMINATED,
    sys::CUresult::CUDA_ERROR_EXTERNAL_DEVICE,
];

/// Sticky codes that cudarc's bindings for CUDA 12.0 to 12.6 lack, so they
/// cannot be named through `sys` in every build: `CUDA_ERROR_CONTAINED` (226,
/// CUDA 12.8) and `CUDA_ERROR_TENSOR_MEMORY_LEAK` (721, CUDA 12.8); their
/// driver docs say the process must be restarted, as above.
const STICKY_SINCE_12_8: &[i32] = &[226, 721];

/// Whether `code` leaves the context (and process) unusable for good.
pub(super) fn is_sticky(code: i32) -> bool {
    if crate::plant::planted("cuda-illegal-address-not-sticky")
        && code == sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS as i32
        || crate::plant::planted("cuda-contained-not-sticky") && code == 226
    {
        return false;
    }
    STICKY.iter().any(|sticky| *sticky as i32 == code) || STICKY_SINCE_12_8.contains(&code)
}

/// `cuEventCreate` flags.
const EVENT_BLOCKING_SYNC: c_uint = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as c_uint;
const EVENT_DISABLE_TIMING: c_uint = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;

/// Load the driver library, probe its symbols and initialize it, once.
///
/// # Errors
///
/// [`ServerError::Unavailable`] when the library is missing, too old, or
/// finds no device.
pub(crate) fn ensure_loaded() -> Result<(), ServerError> {
    static LOADED: OnceLock<Result<(), ServerError>> = OnceLock::new();
    LOADED.get_or_init(load).clone()
}

/// Set once cudarc has loaded the driver library and every symbol it needs
/// was found: from then on its error name and description lookups cannot
/// panic.
static LIBRARY_FOUND: AtomicBool = AtomicBool::new(false);

fn load() -> Result<(), ServerError> {
    // SAFETY: loading the driver library runs only its initializers; the
    // handle is dropped at once.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver library (libcuda.so / nvcuda.dll) was not found".to_owned(),
        ));
    }
    // SAFETY: as above; the library was just found, so cudarc's loader does
    // not reach its panic for a missing library.
    let library = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up, never called through this
        // type, so the placeholder signature does not matter.
        .filter(|name| unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(unavailable(format!(
            "the CUDA driver is too old: it lacks {}",
            missing.join(", ")
        )));
    }
    // One entry point, typed by the `Api` field it fills: each field's type
    // is the driver API's signature for that name, with `CUresult` as the
    // `int` it is.
    macro_rules! entry {
        ($name:expr) => {
            // SAFETY: the field's type is the symbol's C signature (see
            // `Api`); the library stays loaded for the life of the process
            // (cudarc keeps it in a static), so the pointer stays valid.
            match unsafe { library.get($name.as_bytes()) } {
                Ok(symbol) => *symbol,
                Err(_) => return Err(unavailable(format!("the CUDA driver lacks {}", $name))),
            }
        };
    }
    let elapsed = ELAPSED_SYMBOLS.iter().find_map(|name| {
        // SAFETY: as in `entry!`: both names have this signature.
        unsafe { library.get(name.as_bytes()) }
            .ok()
            .map(|symbol| *symbol)
    });
    let found = Api {
        init: entry!("cuInit"),
        error_name: entry!("cuGetErrorName"),
        error_string: entry!("cuGetErrorString"),
        ctx_get_current: entry!("cuCtxGetCurrent"),
        ctx_set_current: entry!("cuCtxSetCurrent"),
        event_create: entry!("cuEventCreate"),
        event_record: entry!("cuEventRecord"),
        event_query: entry!("cuEventQuery"),
        event_synchronize: entry!("cuEventSynchronize"),
        event_destroy: entry!("cuEventDestroy_v2"),
        event_elapsed: elapsed,
        stream_wait_event: entry!("cuStreamWaitEvent"),
        stream_synchronize: entry!("cuStreamSynchronize"),
        module_load_data: entry!("cuModuleLoadData"),
        module_get_function: entry!("cuModuleGetFunction"),
        launch_kernel: entry!("cuLaunchKernel"),
    };
    let api = API.get_or_init(|| found);
    LIBRARY_FOUND.store(true, Ordering::Release);
    // SAFETY: cuInit takes flags by value; 0 is the only documented value.
    check("cuInit", unsafe { (api.init)(0) }).map_err(|err| unavailable(err.to_string()))
}

fn unavailable(reason: String) -> ServerError {
    ServerError::Unavailable {
        backend: BACKEND,
        reason,
    }
}

/// The one place a driver status becomes a result.
pub(super) fn check(call: &'static str, status: Status) -> Result<(), ServerError> {
    if status == sys::CUresult::CUDA_SUCCESS as Status {
        Ok(())
    } else {
        Err(status_error(call, status, || {
            format!("CUDA error {status}")
        }))
    }
}

/// A cudarc error (from its own calls, or a user's), as this crate reports
/// driver errors. Never panics, with or without a driver.
pub(super) fn driver_error(call: &'static str, err: DriverError) -> ServerError {
    status_error(call, err.0 as Status, || format!("{:?}", err.0))
}

/// A failed status, named and described by the driver itself when it is
/// loaded (`fallback` names it otherwise), marked faulted when it is one of
/// the sticky ones.
fn status_error(
    call: &'static str,
    code: Status,
    fallback: impl FnOnce() -> String,
) -> ServerError {
    let loaded = LIBRARY_FOUND
        .load(Ordering::Acquire)
        .then(|| API.get())
        .flatten();
    let text = |lookup: unsafe extern "C" fn(Status, *mut *const c_char) -> Status| {
        let mut text = ptr::null();
        // SAFETY: `text` is a valid place for the pointer; the driver points
        // it at a static string (or leaves it null) for any status.
        let status = unsafe { lookup(code, &mut text) };
        (status == sys::CUresult::CUDA_SUCCESS as Status && !text.is_null()).then(|| {
            // SAFETY: a non-null answer is a NUL-terminated static string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        })
    };
    let name = loaded
        .and_then(|api| text(api.error_name))
        .unwrap_or_else(fallback);
    let message = loaded
        .and_then(|api| text(api.error_string))
        .unwrap_or_default();
    if is_sticky(code) {
        ServerError::Faulted {
            backend: BACKEND,
            call,
            code,
            name,
            message,
            source: None,
        }
    } else {
        ServerError::Call {
            backend: BACKEND,
            call,
            code,
            name,
            message,
            source: None,
        }
    }
}

impl From<DriverError> for ServerError {
    fn from(err: DriverError) -> Self {
        driver_error("cudarc", err)
    }
}

/// A context made current on the calling thread for the guard's life; the
/// context that was current before is made current again when it drops, as a
/// device guard does, so executor threads (and threads that drop events) are
/// left as found and multi-GPU code on them keeps its device.
///
/// It binds through the driver, not cudarc's `bind_to_thread`: that first
/// takes any error a cudarc `Drop` stored in the context (cudarc's drops store
/// failures there instead of panicking), which belongs to the user's next
/// cudarc call, and would come back from here mislabelled as this crate's.
///
/// On the crate's own threads (the waiter's and the drop queue's, see
/// [`own_threads`](crate::own_threads)) nothing is restored: the context
/// stays bound, so a waiter thread querying a batch of fences of one context
/// switches contexts once, not twice per query. No executor runs there, and
/// user code that does (a value the drop queue drops) finds some context
/// current, as it would after any CUDA call; cudarc binds its own first.
#[must_use = "the context is current only while the guard lives"]
struct Bound {
    /// What was current before, to restore; `None` when it already was `ctx`,
    /// or on the crate's own threads.
    previous: Option<sys::CUcontext>,
    api: &'static Api,
}

thread_local! {
    /// On the crate's own threads: the context this thread left bound.
    /// Weak, so it holds the allocation (no other context can take its
    /// address while it is kept here) and not the context.
    static LEFT_BOUND: RefCell<Weak<CudaContext>> = const { RefCell::new(Weak::new()) };
}

/// Make `ctx` current on this thread until the returned guard drops (on the
/// crate's own threads, until another is bound).
fn bind(ctx: &Arc<CudaContext>) -> Result<Bound, ServerError> {
    if crate::plant::planted("cuda-bind-takes-stored-errors") {
        ctx.bind_to_thread()
            .map_err(|err| driver_error("cuCtxSetCurrent", err))?;
    }
    let api = api()?;
    let mut previous = ptr::null_mut();
    // SAFETY: `previous` is a valid place for the handle.
    check("cuCtxGetCurrent", unsafe {
        (api.ctx_get_current)(&mut previous)
    })?;
    let target = ctx.cu_ctx();
    let own = crate::own_threads::is_own();
    // A handle equal to the target is the target still bound, except on
    // the crate's own threads after the context it left there was torn
    // down: a context made later (a device's primary context retained
    // anew, say) can have the same handle, and the thread's binding is
    // stale (the driver answers CUDA_ERROR_CONTEXT_IS_DESTROYED there). So
    // there it counts only if this very context object bound it, alive all
    // along since (its `Arc` holds the context's retain).
    if previous == target
        && (!own
            || left_bound_by(ctx)
            || crate::plant::planted("cuda-own-thread-trusts-stale-binding"))
    {
        return Ok(Bound {
            previous: None,
            api,
        });
    }
    // SAFETY: `target` is live: `ctx` holds its primary-context retain for
    // as long as the borrow lasts.
    check("cuCtxSetCurrent", unsafe { (api.ctx_set_current)(target) })?;
    if own {
        // During the thread's exit nothing is remembered: the next bind
        // (if any) switches again.
        let _ = LEFT_BOUND.try_with(|left| *left.borrow_mut() = Arc::downgrade(ctx));
        return Ok(Bound {
            previous: None,
            api,
        });
    }
    Ok(Bound {
        previous: Some(previous),
        api,
    })
}

/// Whether `ctx` is the context object this (own) thread left bound.
fn left_bound_by(ctx: &Arc<CudaContext>) -> bool {
    LEFT_BOUND
        .try_with(|left| ptr::eq(left.borrow().as_ptr(), Arc::as_ptr(ctx)))
        .unwrap_or(false)
}

impl Drop for Bound {
    fn drop(&mut self) {
        let Some(previous) = self
            .previous
            .filter(|_| !crate::plant::planted("cuda-previous-context-not-restored"))
        else {
            return;
        };
        // SAFETY: `previous` was current on this thread when the guard was
        // made (or null: no context), so it is the caller's to keep alive; a
        // context destroyed meanwhile is a handle the driver rejects with an
        // error, reported below.
        if let Err(err) = check("cuCtxSetCurrent", unsafe {
            (self.api.ctx_set_current)(previous)
        }) {
            log::debug!(
                "the thread's previous CUDA context could not be made current again: {err}"
            );
        }
    }
}

/// The driver would refuse (or misbehave on) a handle of one context used on
/// a stream of another: say so before calling it.
fn same_context(
    call: &'static str,
    ctx: &CudaContext,
    stream: &CudaStream,
) -> Result<(), ServerError> {
    if stream.context().cu_ctx() == ctx.cu_ctx() {
        return Ok(());
    }
    Err(invalid_context(
        call,
        "the handle and the stream belong to different contexts",
    ))
}

/// `CUDA_ERROR_INVALID_CONTEXT` for `call`, refused before the driver.
fn invalid_context(call: &'static str, message: &str) -> ServerError {
    refused(call, sys::CUresult::CUDA_ERROR_INVALID_CONTEXT, message)
}

/// A call this crate refuses before the driver sees it, with the status the
/// driver would have given.
pub(super) fn refused(call: &'static str, code: sys::CUresult, message: &str) -> ServerError {
    ServerError::Call {
        backend: BACKEND,
        call,
        code: code as i32,
        name: format!("{code:?}"),
        message: message.to_owned(),
        source: None,
    }
}

/// The most idle fence events a context's pool keeps: [`SHARD_CAPACITY`] in
/// each of its [`FENCE_POOL_SHARDS`] shards.
const FENCE_POOL_CAPACITY: usize = 512;

/// How many locks a context's pool is split into. Every executor thread
/// makes fences on the same context, so one lock would be a lock shared by
/// all of them; each thread takes from its own shard (see [`home_shard`]),
/// or another's when its own is empty, and an event goes back to the shard
/// of the thread that took it.
const FENCE_POOL_SHARDS: usize = 8;

/// The most idle events one shard keeps.
const SHARD_CAPACITY: usize = FENCE_POOL_CAPACITY / FENCE_POOL_SHARDS;

/// One context's idle fence events (`DISABLE_TIMING | BLOCKING_SYNC`), for
/// later fences: on busy GPUs `cuEventCreate` contends on the driver's
/// context lock, so a steady loop of fences creates none after warm-up. At
/// most [`FENCE_POOL_CAPACITY`] idle events, spread over
/// [`FENCE_POOL_SHARDS`] locks.
///
/// Idle events do not keep the context alive (the pool holds it weakly): if
/// the context goes, the driver frees its events with it, and the pool
/// forgets them without a call.
pub(crate) struct FencePool {
    ctx: Weak<CudaContext>,
    shards: Vec<Mutex<Vec<IdleEvent>>>,
}

/// An idle event's raw handle.
struct IdleEvent(sys::CUevent);

// SAFETY: a CUevent is a driver handle, not memory this process reads; an
// idle one is touched only under its shard's lock, then by one owner.
unsafe impl Send for IdleEvent {}

/// The pool shard of the calling thread: threads are spread over the shards
/// in the order they first make a fence.
fn home_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % FENCE_POOL_SHARDS;
    }
    SHARD.with(|shard| *shard)
}

impl FencePool {
    /// The pool of `ctx`'s fence events: the same pool for every stream of a
    /// context, found once per stream registration (not per fence).
    pub(crate) fn of(ctx: &Arc<CudaContext>) -> Arc<Self> {
        // In a `OnceLock`: the crate's mutex is not `const` under loom.
        static POOLS: OnceLock<Mutex<Vec<Weak<FencePool>>>> = OnceLock::new();
        let mut pools = POOLS.get_or_init(Mutex::default).lock();
        pools.retain(|pool| pool.strong_count() > 0);
        let found = pools
            .iter()
            .filter_map(Weak::upgrade)
            .find(|pool| pool.ctx.as_ptr() == Arc::as_ptr(ctx));
        found.unwrap_or_else(|| {
            let pool = Arc::new(Self {
                ctx: Arc::downgrade(ctx),
                // Room for a full shard: a release never grows it.
                shards: (0..FENCE_POOL_SHARDS)
                    .map(|_| Mutex::new(Vec::with_capacity(SHARD_CAPACITY)))
                    .collect(),
            });
            pools.push(Arc::downgrade(&pool));
            pool
        })
    }

    /// An idle fence event of this pool's context from the calling thread's
    /// shard, or a new one. `ctx` is the pool's context, kept alive by the
    /// caller's stream.
    pub(crate) fn take(self: &Arc<Self>, ctx: &Arc<CudaContext>) -> Result<CudaEvent, ServerError> {
        let shard = home_shard();
        // Another shard's idle event before a new one: the pool holds up to
        // its capacity for whichever threads make fences.
        let idle = self.shards_from(shard).find_map(|other| other.lock().pop());
        let mut event = match idle {
            Some(IdleEvent(raw)) => CudaEvent {
                raw,
                ctx: ctx.clone(),
                pool: None,
            },
            None => CudaEvent::create(ctx, false, true)?,
        };
        event.pool = Some((self.clone(), shard));
        Ok(event)
    }

    /// Every shard, starting with `first`.
    fn shards_from(&self, first: usize) -> impl Iterator<Item = &Mutex<Vec<IdleEvent>>> {
        (0..FENCE_POOL_SHARDS).map(move |step| &self.shards[(first + step) % FENCE_POOL_SHARDS])
    }
}

impl Drop for FencePool {
    fn drop(&mut self) {
        let idle: Vec<IdleEvent> = self
            .shards
            .iter_mut()
            .flat_map(|shard| std::mem::take(shard.get_mut()))
            .collect();
        let Some(ctx) = self.ctx.upgrade() else {
            // The context is gone, and the driver freed its events with it.
            return;
        };
        for IdleEvent(raw) in idle {
            drop(CudaEvent {
                raw,
                ctx: ctx.clone(),
                pool: None,
            });
        }
    }
}

/// The CUDA backend's raw event. It keeps its context alive, and is destroyed
/// when dropped if [`Cuda::event_destroy`](super::Cuda) did not already.
/// Usually held inside an [`Event`](crate::Event) or a fence:
///
/// ```no_run
/// use device_events::cuda::{self, Cuda, CudaStreamHandle};
/// use device_events::{Event, EventFlags};
///
/// let stream = cuda::context(0)?.new_stream()?;
/// let handle = CudaStreamHandle::new(&stream);
/// let event = Event::<Cuda>::new(handle, EventFlags::TIMING)?;
/// event.record(handle)?;
/// let raw: &cuda::CudaEvent = event.raw();
/// println!("{raw:?}");
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct CudaEvent {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
    /// The pool a fence event goes back to, and the shard it came from.
    pool: Option<(Arc<FencePool>, usize)>,
}

// SAFETY: a CUevent is a driver handle, not memory this process reads; the
// driver API is thread-safe, and every call here binds the event's context
// on the calling thread first, so the event may move between threads.
unsafe impl Send for CudaEvent {}
// SAFETY: as for `Send`; the driver serializes concurrent calls on one event.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Create an event in `ctx`.
    pub(super) fn create(
        ctx: &Arc<CudaContext>,
        timing: bool,
        blocking: bool,
    ) -> Result<Self, ServerError> {
        let mut flags = 0;
        if !timing {
            flags |= EVENT_DISABLE_TIMING;
        }
        if blocking {
            flags |= EVENT_BLOCKING_SYNC;
        }
        let bound = bind(ctx)?;
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` is a valid place for the new handle; the flags are a
        // combination of documented bits.
        check("cuEventCreate", unsafe {
            (bound.api.event_create)(&mut raw, flags)
        })?;
        Ok(Self {
            raw,
            ctx: ctx.clone(),
            pool: None,
        })
    }

    /// Give a fence event back to its context's pool, or destroy it when the
    /// pool is full (or it has none). Its last record may still be pending:
    /// the next `cuEventRecord` replaces it, which the driver allows.
    pub(super) fn release(mut self) -> Result<(), ServerError> {
        if let Some((pool, shard)) = self.pool.take() {
            // Back to the shard of the thread that took it; a full shard
            // destroys it rather than lock the others (a burst of releases
            // beyond the pool's capacity would lock every shard each time).
            let mut idle = pool.shards[shard].lock();
            if idle.len() < SHARD_CAPACITY && !crate::plant::planted("cuda-fence-events-not-pooled")
            {
                let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
                idle.push(IdleEvent(raw));
                return Ok(());
            }
        }
        self.destroy()
    }

    /// Record at the current end of `stream`; the stream must share the
    /// event's context.
    pub(super) fn record(&self, stream: &CudaStream) -> Result<(), ServerError> {
        same_context("cuEventRecord", &self.ctx, stream)?;
        let bound = bind(&self.ctx)?;
        // SAFETY: both handles are live: the event is owned by `self`, the
        // stream is borrowed from its owner for the call.
        check("cuEventRecord", unsafe {
            (bound.api.event_record)(self.raw, stream.cu_stream())
        })
    }

    /// Reached, not yet, or an error: all three outcomes of `cuEventQuery`.
    pub(super) fn query(&self) -> Result<bool, ServerError> {
        let bound = bind(&self.ctx)?;
        // SAFETY: the event is live, owned by `self`.
        match unsafe { (bound.api.event_query)(self.raw) } {
            status if status == sys::CUresult::CUDA_SUCCESS as Status => Ok(true),
            status if status == sys::CUresult::CUDA_ERROR_NOT_READY as Status => Ok(false),
            status => check("cuEventQuery", status).map(|()| false),
        }
    }

    /// Block until reached; sleeps in the driver for a `BLOCKING_SYNC` event.
    pub(super) fn synchronize(&self) -> Result<(), ServerError> {
        let bound = bind(&self.ctx)?;
        // SAFETY: the event is live, owned by `self`.
        check("cuEventSynchronize", unsafe {
            (bound.api.event_synchronize)(self.raw)
        })
    }

    /// Make `stream` wait for this event's latest record, on the device. Works
    /// across contexts.
    pub(super) fn wait_on(&self, stream: &CudaStream) -> Result<(), ServerError> {
        let bound = bind(stream.context())?;
        // SAFETY: both handles are live; flag 0 is CU_EVENT_WAIT_DEFAULT.
        check("cuStreamWaitEvent", unsafe {
            (bound.api.stream_wait_event)(stream.cu_stream(), self.raw, 0)
        })
    }

    /// Milliseconds from `start` to `self`, as the driver measures them.
    pub(super) fn elapsed_ms(&self, start: &Self) -> Result<f32, ServerError> {
        let bound = bind(&self.ctx)?;
        let mut ms = 0.0f32;
        let elapsed = bound.api.event_elapsed.ok_or_else(|| {
            unavailable(format!(
                "the CUDA driver exports neither {}",
                ELAPSED_SYMBOLS.join(" nor ")
            ))
        })?;
        // SAFETY: `ms` is a valid place for the result; both events are live;
        // `elapsed` has the driver's signature for these arguments.
        check("cuEventElapsedTime", unsafe {
            elapsed(&mut ms, start.raw, self.raw)
        })?;
        Ok(ms)
    }

    /// Destroy now and report the driver's answer. Does not block: the driver
    /// releases an event with pending work once the work completes.
    pub(super) fn destroy(mut self) -> Result<(), ServerError> {
        self.destroy_raw()
    }

    fn destroy_raw(&mut self) -> Result<(), ServerError> {
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        if raw.is_null() {
            return Ok(());
        }
        // The destroy is attempted even if the bind fails (a faulted
        // context, say): skipping it would leak the event for good.
        let bound = bind(&self.ctx);
        // SAFETY: `raw` was created by cuEventCreate and is destroyed once:
        // the field is nulled above.
        let destroyed = match api() {
            // SAFETY: `raw` was created by cuEventCreate and is destroyed
            // once: the field is nulled above.
            Ok(api) => check("cuEventDestroy", unsafe { (api.event_destroy)(raw) }),
            Err(err) => Err(err),
        };
        drop(bound);
        destroyed
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if let Err(err) = self.destroy_raw() {
            log::error!("a CUDA event could not be destroyed: {err}");
        }
    }
}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaEvent").field("raw", &self.raw).finish()
    }
}

/// One kernel of a PTX module loaded into a context.
///
/// The module is never unloaded by this crate: `cuModuleUnload` makes no
/// promise about launches still queued, and a module goes with its context
/// anyway. Load a kernel once per context, not once per launch.
pub(super) struct Kernel {
    function: sys::CUfunction,
    ctx: Arc<CudaContext>,
}

// SAFETY: the function is a driver handle; the driver API is
// thread-safe and every call binds the module's context first.
unsafe impl Send for Kernel {}
// SAFETY: as for `Send`; launching is the only use and the driver serializes it.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// JIT-load `ptx` (NUL-terminated PTX text) into `ctx` and find `name`.
    pub(super) fn load(
        ctx: &Arc<CudaContext>,
        ptx: &CStr,
        name: &CStr,
    ) -> Result<Self, ServerError> {
        let bound = bind(ctx)?;
        let mut module = ptr::null_mut();
        // SAFETY: `ptx` is a NUL-terminated image that outlives the call;
        // `module` is a valid place for the handle.
        check("cuModuleLoadData", unsafe {
            (bound.api.module_load_data)(&mut module, ptx.as_ptr().cast())
        })?;
        let mut function = ptr::null_mut();
        // SAFETY: the module was just loaded and is never unloaded; `name` is
        // NUL-terminated; `function` is a valid place for the handle.
        check("cuModuleGetFunction", unsafe {
            (bound.api.module_get_function)(&mut function, module, name.as_ptr())
        })?;
        Ok(Self {
            function,
            ctx: ctx.clone(),
        })
    }

    /// Launch on one thread of one block with one `u64` argument.
    pub(super) fn launch_u64(
        &self,
        stream: &CudaStream,
        mut argument: u64,
    ) -> Result<(), ServerError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(invalid_context(
                "cuLaunchKernel",
                "the kernel and the stream belong to different contexts",
            ));
        }
        let bound = bind(&self.ctx)?;
        let mut params = [ptr::addr_of_mut!(argument).cast::<c_void>()];
        // SAFETY: the function is live (its module is never unloaded); the
        // kernel takes exactly one u64 parameter, and the driver copies the
        // parameter values before cuLaunchKernel returns, so pointers to
        // locals are enough.
        check("cuLaunchKernel", unsafe {
            (bound.api.launch_kernel)(
                self.function,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream.cu_stream(),
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }
}

/// Block until all work queued on `stream` is done.
pub(super) fn synchronize_stream(stream: &CudaStream) -> Result<(), ServerError> {
    let bound = bind(stream.context())?;
    // SAFETY: the stream is live, borrowed from its owner for the call.
    check("cuStreamSynchronize", unsafe {
        (bound.api.stream_synchronize)(stream.cu_stream())
    })
}
