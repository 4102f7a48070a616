//! The CUDA backend's FFI edge, as cudarc's `result.rs` sits under its `safe/` types: the driver's
//! entry points and load state, the mapping of a status to a [`ServerError`] ([`check`]), and a
//! thin safe wrapper ([`Driver`]) around each raw call; the rest of the backend has no `unsafe`.
//!
//! cudarc's safe layer serves contexts and streams; events drop to raw calls because a fence
//! event needs flags cudarc's enum cannot express (`DISABLE_TIMING | BLOCKING_SYNC`), queries need
//! all three outcomes, a destroy must report its error, and a bind must not take cudarc's stored
//! errors.
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
//! - stream capture (`cuStreamGetCaptureInfo`,
//!   `cuThreadExchangeStreamCaptureMode`, the capture statuses 900 to 908):
//!   the stream management and type pages above
//! - page-locked, device-mapped host memory (`cuMemHostAlloc`, `cuMemHostGetDevicePointer`,
//!   `cuMemFreeHost`): <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
//! - stream memory operations (`cuStreamWriteValue64`):
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEMOP.html>
//! - modules, functions and launches (`cuModuleLoadData`, `cuFuncLoad`, `cuLaunchKernel`):
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MODULE.html>,
//!   <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__EXEC.html>
// The CUDA backend's every `unsafe` is here, each with a `// SAFETY:` comment; the crate's only
// other `unsafe` is the operating-system calls of `src/os.rs`. `Cargo.toml`'s `[lints]` deny
// `unsafe_code` everywhere else (`tests/layers.rs` checks which files allow it).
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::sync::shards;
use crate::{EventFlags, ServerError};

pub(super) const BACKEND: &str = "Cuda";

/// Every driver entry point this crate or the cudarc calls it makes resolve. cudarc resolves a
/// symbol on first use and panics if it is missing, so all are probed once, up front, and a
/// missing one makes the backend unavailable. Each exists in CUDA 12.0 and later, 13 included.
pub(super) const REQUIRED_SYMBOLS: &[&str] = &[
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
    "cuStreamGetCaptureInfo_v2",
    "cuDevicePrimaryCtxGetState",
    "cuThreadExchangeStreamCaptureMode",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuLaunchKernel",
];

/// The names `cuEventElapsedTime` has had, preferred first: CUDA 12.8 added `_v2` (CUDA 13 maps
/// the plain name to it), which returns only the timing's own errors, not earlier work's. Same
/// arguments (and times, on an H200 with driver 13.0); a driver with neither only loses timing.
const ELAPSED_SYMBOLS: [&str; 2] = ["cuEventElapsedTime_v2", "cuEventElapsedTime"];

/// `cuCtxGetId` (CUDA 12.0): tells apart contexts made one after another under one handle.
/// Optional: a driver without it only shares less ([`Driver::ctx_id`]).
const CTX_ID_SYMBOL: &str = "cuCtxGetId";

/// `cuFuncLoad` (CUDA 12.4; cudarc's bindings have it from `cuda-12040`): "Finalizes function
/// loading" of a function lazy loading left partly loaded, which "CUDA APIs may load [...]
/// automatically when called" (`cuModuleEnumerateFunctions`), a launch included. Optional: on older
/// drivers `cuModuleGetFunction` is where a kernel loads ("Loading of kernels happens during
/// cuModuleGetFunction() call", CUDA C++ Programming Guide, 12.x, "Lazy Loading").
const FUNC_LOAD_SYMBOL: &str = "cuFuncLoad";

/// The entry points of a stream's progress word (`progress.rs`), in CUDA 12.0 and later (whose
/// headers map the plain names to these); all or none, else fences wait on events alone.
const WORD_SYMBOLS: [&str; 4] = [
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuStreamWriteValue64_v2",
];

/// A driver status, as the driver returns it: a C `enum`, which is an `int`.
type Status = c_int;

/// The driver entry points this crate calls itself, typed to return the status as an integer:
/// cudarc's `sys` bindings return a Rust `enum`, and a status they do not list
/// (`CUDA_ERROR_CONTAINED` from a CUDA 13 driver under the 12.0 bindings, say) would be undefined
/// behaviour. Signatures: the CUDA driver API reference (links at the top).
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
    /// The first of [`ELAPSED_SYMBOLS`] the driver exports, with that name; `None`: no timing.
    #[allow(clippy::type_complexity)]
    event_elapsed: Option<(
        &'static str,
        unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> Status,
    )>,
    /// Optional (see [`CTX_ID_SYMBOL`]); `unsigned long long *` is a `u64` place.
    ctx_get_id: Option<unsafe extern "C" fn(sys::CUcontext, *mut u64) -> Status>,
    /// Optional (see [`FUNC_LOAD_SYMBOL`]).
    func_load: Option<unsafe extern "C" fn(sys::CUfunction) -> Status>,
    stream_wait_event: unsafe extern "C" fn(sys::CUstream, sys::CUevent, c_uint) -> Status,
    device_attribute: unsafe extern "C" fn(*mut c_int, c_int, sys::CUdevice) -> Status,
    /// Optional (see [`WORD_SYMBOLS`]).
    word: Option<WordApi>,
    stream_synchronize: unsafe extern "C" fn(sys::CUstream) -> Status,
    /// `cuStreamGetCaptureInfo_v2` (CUDA 11.3; CUDA 12 headers map `cuStreamGetCaptureInfo` to
    /// it): the status as the C enum's `int`, the capture id, and optional outputs left null.
    #[allow(clippy::type_complexity)]
    stream_capture_info: unsafe extern "C" fn(
        sys::CUstream,
        *mut c_int,
        *mut u64,
        *mut sys::CUgraph,
        *mut *const sys::CUgraphNode,
        *mut usize,
    ) -> Status,
    /// `cuDevicePrimaryCtxGetState`: the primary context's flags and whether it is active.
    primary_ctx_state: unsafe extern "C" fn(sys::CUdevice, *mut c_uint, *mut c_int) -> Status,
    /// The capture mode as the `int` the C enum is.
    thread_exchange_capture_mode: unsafe extern "C" fn(*mut c_int) -> Status,
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

/// [`WORD_SYMBOLS`], typed.
struct WordApi {
    host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> Status,
    host_device_pointer: unsafe extern "C" fn(*mut sys::CUdeviceptr, *mut c_void, c_uint) -> Status,
    free_host: unsafe extern "C" fn(*mut c_void) -> Status,
    write_value64: unsafe extern "C" fn(sys::CUstream, sys::CUdeviceptr, u64, c_uint) -> Status,
}

/// The driver as [`load`] left it.
struct Loaded {
    api: Api,
    /// `cuInit`'s answer: an error makes the backend unavailable; the entry points still name and
    /// describe statuses.
    init: Result<(), ServerError>,
    /// The fork generation it was loaded in (see [`in_forked_child`]).
    generation: u64,
}

/// The one load state: an error if the library or an entry point is missing.
static DRIVER: OnceLock<Result<Loaded, ServerError>> = OnceLock::new();

/// The driver's entry points: loads the driver library, probes its symbols and initializes it
/// first, once.
///
/// # Errors
///
/// [`ServerError::Unavailable`] when the library is missing, too old, or finds no device (or in a
/// forked child); [`ServerError::ShutDown`] once the driver has shut down, naming the call that
/// first saw it.
pub(super) fn driver() -> Result<Driver, ServerError> {
    if let Some(first) = SHUT_DOWN.get() {
        live(first)?;
    }
    not_forked()?;
    match DRIVER.get_or_init(load) {
        Ok(Loaded {
            api, init: Ok(()), ..
        }) => Ok(Driver { api }),
        Ok(Loaded { init: Err(err), .. }) | Err(err) => Err(err.clone()),
    }
}

/// Why a forked child makes no CUDA call.
const FORKED: &str = "this process is a fork of the one that initialized the CUDA driver: \
                      \"CUDA does not duplicate any of its internal data structures or threads \
                      to other processes upon a call to fork\" (NVIDIA's CUDA C++ guidelines), so \
                      no CUDA call is made here; use CUDA in a child only after exec";

/// Whether this process is a fork of the one that loaded the driver ("Any use of CUDA after a call
/// to fork and before a subsequent call to exec has undefined behavior", NVIDIA's CUDA C++
/// guidelines), where a lock of the crate's may be held by a thread left in the parent: the
/// backend refuses every call before taking a lock, and its drops forget what they hold.
pub(super) fn in_forked_child() -> bool {
    matches!(DRIVER.get(), Some(Ok(loaded)) if loaded.generation != crate::os::fork_generation())
}

/// [`in_forked_child`] as an error for the caller.
///
/// # Errors
///
/// [`ServerError::Unavailable`] in a forked child.
pub(super) fn not_forked() -> Result<(), ServerError> {
    if in_forked_child() {
        return Err(unavailable(FORKED.to_owned()));
    }
    Ok(())
}

/// The entry points once loaded, whatever `cuInit` answered (so error lookups cannot panic).
/// Never loads.
fn loaded_api() -> Option<&'static Api> {
    DRIVER.get()?.as_ref().ok().map(|loaded| &loaded.api)
}

fn load() -> Result<Loaded, ServerError> {
    // SAFETY: loading the driver library runs only its initializers; the handle is dropped at once.
    if !unsafe { sys::is_culib_present() } {
        return Err(unavailable(
            "the CUDA driver library (libcuda.so / nvcuda.dll) was not found".to_owned(),
        ));
    }
    // SAFETY: as above; the library was just found, so cudarc's loader does not reach its panic
    // for a missing library.
    let library = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: only looked up, never called through this type, so the signature is moot.
        .filter(|name| unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(unavailable(format!(
            "the CUDA driver is too old: it lacks {}",
            missing.join(", ")
        )));
    }
    // One entry point a driver may lack, typed by the `Api` (or `WordApi`) field it fills: the
    // driver API's signature for that name, with `CUresult` as the `int` it is.
    macro_rules! optional {
        ($name:expr) => {
            // SAFETY: the field's type is the symbol's C signature (`Api`, `WordApi`; both names
            // of `ELAPSED_SYMBOLS` have one); the library stays loaded for the life of the process
            // (cudarc keeps it in a static), so the pointer stays valid.
            unsafe { library.get($name.as_bytes()) }
                .ok()
                .map(|symbol| *symbol)
        };
    }
    // One entry point every driver has (`REQUIRED_SYMBOLS`), likewise.
    macro_rules! entry {
        ($name:expr) => {
            match optional!($name) {
                Some(entry) => entry,
                None => return Err(unavailable(format!("the CUDA driver lacks {}", $name))),
            }
        };
    }
    let elapsed = ELAPSED_SYMBOLS
        .iter()
        .find_map(|name| Some((*name, optional!(name)?)));
    let word = (|| {
        Some(WordApi {
            host_alloc: optional!(WORD_SYMBOLS[0])?,
            host_device_pointer: optional!(WORD_SYMBOLS[1])?,
            free_host: optional!(WORD_SYMBOLS[2])?,
            write_value64: optional!(WORD_SYMBOLS[3])?,
        })
    })();
    let api = Api {
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
        ctx_get_id: optional!(CTX_ID_SYMBOL),
        func_load: optional!(FUNC_LOAD_SYMBOL),
        stream_wait_event: entry!("cuStreamWaitEvent"),
        device_attribute: entry!("cuDeviceGetAttribute"),
        word,
        stream_synchronize: entry!("cuStreamSynchronize"),
        stream_capture_info: entry!("cuStreamGetCaptureInfo_v2"),
        primary_ctx_state: entry!("cuDevicePrimaryCtxGetState"),
        thread_exchange_capture_mode: entry!("cuThreadExchangeStreamCaptureMode"),
        module_load_data: entry!("cuModuleLoadData"),
        module_get_function: entry!("cuModuleGetFunction"),
        launch_kernel: entry!("cuLaunchKernel"),
    };
    // Taken first: a fork from now on is one of a process that may have initialized the driver.
    let generation = crate::os::track_forks();
    // SAFETY: cuInit takes flags by value; 0 is the only documented value.
    let status = unsafe { (api.init)(0) };
    // Named by the driver's own lookups: the table is not stored yet.
    let init = check(Some(&api), "cuInit", status).map_err(|err| unavailable(err.to_string()));
    Ok(Loaded {
        api,
        init,
        generation,
    })
}

pub(super) fn unavailable(reason: String) -> ServerError {
    ServerError::Unavailable {
        backend: BACKEND,
        reason,
    }
}

/// `CUDA_ERROR_DEINITIALIZED`: "This indicates that the CUDA driver is in the process of
/// shutting down" (`CUresult`, link above); at exit, see the CUDA guide, docs/cuda.md.
const CUDA_ERROR_DEINITIALIZED: Status = sys::CUresult::CUDA_ERROR_DEINITIALIZED as Status;

/// The call that first saw [`CUDA_ERROR_DEINITIALIZED`]: no later call reaches the driver.
static SHUT_DOWN: OnceLock<&'static str> = OnceLock::new();

/// The driver is shutting down, as `call` found: logged once, quietly (expected at exit).
fn shutting_down(call: &'static str) -> ServerError {
    if SHUT_DOWN.set(call).is_ok() {
        log::debug!(
            "the CUDA driver is shutting down ({call} returned CUDA_ERROR_DEINITIALIZED; at \
             process exit, say): no more CUDA calls are made, and pending waits fail"
        );
    }
    shut_down(call)
}

fn shut_down(call: &'static str) -> ServerError {
    ServerError::ShutDown {
        backend: BACKEND,
        call,
    }
}

/// `call` may reach the driver: not once it has shut down. Every [`Driver`] wrapper asks first.
///
/// # Errors
///
/// [`ServerError::ShutDown`] once any call saw the driver shut down.
fn live(call: &'static str) -> Result<(), ServerError> {
    SHUT_DOWN.get().map_or(Ok(()), |_| Err(shut_down(call)))
}

const CUDA_SUCCESS: Status = sys::CUresult::CUDA_SUCCESS as Status;
/// `cuEventQuery`'s "not yet".
const CUDA_ERROR_NOT_READY: Status = sys::CUresult::CUDA_ERROR_NOT_READY as Status;

/// Status codes after which the process must restart: "This leaves the process in an
/// inconsistent state and any further CUDA work will return the same error. To continue using
/// CUDA, the process must be terminated and relaunched" (`CUresult`, link at the top of the file).
/// Taken from cudarc's `sys` enum wherever every binding this crate builds with (CUDA 12.0 and
/// later) has the variant.
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

/// Sticky codes of CUDA 12.8, which cudarc's 12.0 to 12.6 bindings lack: `CUDA_ERROR_CONTAINED`
/// (226) and `CUDA_ERROR_TENSOR_MEMORY_LEAK` (721); their driver docs say the process must restart.
const STICKY_SINCE_12_8: &[Status] = &[226, 721];

/// Whether `code` leaves the context (and process) unusable for good.
fn is_sticky(code: Status) -> bool {
    STICKY.iter().any(|sticky| *sticky as Status == code) || STICKY_SINCE_12_8.contains(&code)
}

/// The one place a status becomes a result; `api` (entry points, or none) names and describes it.
fn check(api: Option<&Api>, call: &'static str, status: Status) -> Result<(), ServerError> {
    if status == CUDA_SUCCESS {
        Ok(())
    } else if status == CUDA_ERROR_DEINITIALIZED {
        Err(shutting_down(call))
    } else {
        Err(status_error(api, call, status, || {
            format!("CUDA error {status}")
        }))
    }
}

/// A cudarc error as this crate reports driver errors, with `err` as its source once the driver is
/// loaded: without one, cudarc's `Display` of it would panic in its loader.
pub(super) fn driver_error(call: &'static str, err: DriverError) -> ServerError {
    if err.0 as Status == CUDA_ERROR_DEINITIALIZED {
        return shutting_down(call);
    }
    let api = loaded_api();
    let error = status_error(api, call, err.0 as Status, || format!("{:?}", err.0));
    match api {
        Some(_) => error.with_source(err),
        None => error,
    }
}

/// A failed status, named and described by the driver when loaded (else by `fallback`), faulted
/// when sticky.
fn status_error(
    api: Option<&Api>,
    call: &'static str,
    code: Status,
    fallback: impl FnOnce() -> String,
) -> ServerError {
    let text = |lookup: unsafe extern "C" fn(Status, *mut *const c_char) -> Status| {
        let mut text = ptr::null();
        // SAFETY: `text` is a valid place for the pointer; the driver points it at a static
        // string (or leaves it null) for any status.
        let status = unsafe { lookup(code, &mut text) };
        (status == CUDA_SUCCESS && !text.is_null()).then(|| {
            // SAFETY: a non-null answer is a NUL-terminated static string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        })
    };
    let name = api
        .and_then(|api| text(api.error_name))
        .unwrap_or_else(fallback);
    let message = api
        .and_then(|api| text(api.error_string))
        .unwrap_or_default();
    if is_sticky(code) {
        ServerError::faulted(BACKEND, call, code, name, message)
    } else {
        ServerError::call(BACKEND, call, code, name, message)
    }
}

impl From<DriverError> for ServerError {
    fn from(err: DriverError) -> Self {
        driver_error("cudarc", err)
    }
}

/// A call refused before the driver (or whose answer is unusable), with the driver's status.
pub(super) fn refused(call: &'static str, code: sys::CUresult, message: &str) -> ServerError {
    ServerError::call(BACKEND, call, code as Status, format!("{code:?}"), message)
}

/// `CUstreamCaptureMode`: the thread's mode under which "potentially unsafe API calls" are
/// allowed whatever other threads capture (`CU_STREAM_CAPTURE_MODE_RELAXED`;
/// `cuThreadExchangeStreamCaptureMode`).
pub(super) const CAPTURE_MODE_RELAXED: c_int = 2;

/// `CUstreamCaptureStatus`: `CU_STREAM_CAPTURE_STATUS_NONE` and `_ACTIVE`.
const CAPTURE_STATUS_NONE: c_int = 0;
const CAPTURE_STATUS_ACTIVE: c_int = 1;

/// A stream's capture state, from [`Driver::stream_capture`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Capture {
    /// Not capturing: work runs.
    None,
    /// Capturing, in the capture of this id ("unique over the lifetime of the process",
    /// `cuStreamGetCaptureInfo`).
    Active(u64),
    /// In a capture an error invalidated, not yet ended (no id is given).
    Invalidated,
}

const EVENT_BLOCKING_SYNC: c_uint = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as c_uint;
const EVENT_DISABLE_TIMING: c_uint = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;

/// The context current on a thread when [`Driver::ctx_get_current`] asked (null: none), to make
/// current again with [`Driver::ctx_restore`]. Not `Send`: it is the thread's own.
#[derive(PartialEq, Eq)]
pub(super) struct CurrentContext(sys::CUcontext);

impl CurrentContext {
    /// Whether it is `ctx`'s handle (a context made later can have the same).
    pub(super) fn is(&self, ctx: &CudaContext) -> bool {
        self.0 == ctx.cu_ctx()
    }
}

/// An event made by [`Driver::event_create`], destroyed only by [`Driver::event_destroy`] (by
/// value); dropped, it is forgotten (its context frees it). It is called through only while a
/// [`CudaEvent`](super::CudaEvent) holds it, and so its context, alive.
#[derive(Debug)]
pub(super) struct RawEvent(sys::CUevent);

// SAFETY: a CUevent is a driver handle, not memory this process reads; the driver API is
// thread-safe, so the handle may move between threads.
unsafe impl Send for RawEvent {}
// SAFETY: as for `Send`; the driver serializes concurrent calls on one event.
unsafe impl Sync for RawEvent {}

/// A module loaded by [`Driver::module_load_data`]. Never unloaded: `cuModuleUnload` makes no
/// promise about launches still queued, and a module goes with its context anyway.
pub(super) struct Module(sys::CUmodule);

/// A kernel found by [`Driver::module_get_function`]; it lives as long as its context.
pub(super) struct Function(sys::CUfunction);

// SAFETY: the function is a driver handle; the driver API is thread-safe.
unsafe impl Send for Function {}
// SAFETY: as for `Send`; launching is the only use and the driver serializes it.
unsafe impl Sync for Function {}

/// A progress word's bytes: one cache line, shared with nothing the host writes.
const MAPPED_WORD_BYTES: usize = 64;
/// One page-locked allocation holds many streams' words.
const MAPPED_PAGE_BYTES: usize = 4096;
pub(super) const WORDS_PER_PAGE: usize = MAPPED_PAGE_BYTES / MAPPED_WORD_BYTES;

/// One word of a page of mapped page-locked host memory ([`Driver::alloc_mapped_page`]): its host
/// and device addresses. A place, not an owner: the crate never frees a page it handed out (see
/// `progress.rs`); its context frees it ("all resources" of a context go with it), and whoever
/// reads or resets a word holds that context alive. At process exit the driver's exit handler may
/// free it all the same (the docs do not say), so no access starts once the crate's own exit
/// handler has run ([`stop_word_access`]): a word reads 0 from then on.
#[derive(Clone, Copy)]
pub(super) struct MappedWord {
    host: NonNull<AtomicU64>,
    device: sys::CUdeviceptr,
}

// SAFETY: the memory is process-wide host memory, not tied to a thread; the host only touches it
// with atomic loads and stores.
unsafe impl Send for MappedWord {}
// SAFETY: as above: every access through `&MappedWord` is atomic.
unsafe impl Sync for MappedWord {}

/// Counts the host's accesses to memory under way, and closes once: then no access starts, and
/// closing returns once those under way are done. Accesses must not panic. The count is striped
/// by thread ([`shards::home`]): readers on different threads share no cache line.
struct AccessGate {
    closed: AtomicBool,
    under_way: [UnderWay; GATE_STRIPES],
}

/// One stripe of an [`AccessGate`]'s count, on cache lines of its own.
#[repr(align(128))]
struct UnderWay(AtomicUsize);

const GATE_STRIPES: usize = 16;

impl AccessGate {
    const fn new() -> Self {
        Self {
            closed: AtomicBool::new(false),
            under_way: [const { UnderWay(AtomicUsize::new(0)) }; GATE_STRIPES],
        }
    }

    /// `access`, unless the gate is closed.
    fn pass<R>(&self, access: impl FnOnce() -> R) -> Option<R> {
        // Seen closed, a thread counts itself in no more: threads that keep reading cannot keep
        // the count above zero.
        if self.closed.load(Ordering::Relaxed) {
            return None;
        }
        let count = &self.under_way[shards::home(GATE_STRIPES)].0;
        count.fetch_add(1, Ordering::SeqCst);
        // Either this sees the gate closed, or its closing sees this access counted.
        let done = (!self.closed.load(Ordering::SeqCst)).then(access);
        count.fetch_sub(1, Ordering::Release);
        done
    }

    /// Close the gate and wait for the accesses under way, in the process of fork `generation`
    /// ([`crate::os`]); in a forked child of it, close only: the accesses its parent's other
    /// threads had under way never end there. A second close returns at once.
    fn close(&self, generation: u64) {
        if self.closed.swap(true, Ordering::SeqCst) || crate::os::fork_generation() != generation {
            return;
        }
        for count in &self.under_way {
            while count.0.load(Ordering::SeqCst) != 0 {
                std::thread::yield_now();
            }
        }
    }
}

/// The host's accesses to word memory, closed at process exit ([`stop_word_access`]).
static WORD_ACCESS: AccessGate = AccessGate::new();
/// The fork generation of the process that registered [`stop_word_access`].
static EXIT_HANDLER_GENERATION: OnceLock<u64> = OnceLock::new();
/// [`stop_word_access`] registered before the first word page, and whether `atexit` took it.
static BEFORE_FIRST_PAGE: OnceLock<bool> = OnceLock::new();
/// [`stop_word_access`] registered again after the first word page.
static AFTER_FIRST_PAGE: OnceLock<bool> = OnceLock::new();

/// Register [`stop_word_access`] once per `registration` (its generation recorded first, so a
/// handler that runs at once finds it); whether `atexit` took it.
fn stop_word_access_at_exit(registration: &'static OnceLock<bool>) -> bool {
    *registration.get_or_init(|| {
        EXIT_HANDLER_GENERATION.get_or_init(crate::os::track_forks);
        crate::os::at_exit(stop_word_access)
    })
}

impl MappedWord {
    /// `access` to the word, unless the process is exiting ([`stop_word_access`] ran).
    fn access<R>(&self, access: impl FnOnce(&AtomicU64) -> R) -> Option<R> {
        // SAFETY: the page is never freed by the crate, only with its context, and every caller
        // holds that context alive (see the type's docs); nor by the driver's exit handler while
        // `WORD_ACCESS` lets an access through, as `stop_word_access`, registered before the page
        // was made and again after, runs first and closes it (given a driver that registers its
        // handler by its first page-locked allocation). The word is 64-byte aligned (checked as
        // its page was made), `u64`-sized, and accessed by the host only atomically.
        WORD_ACCESS.pass(|| access(unsafe { self.host.as_ref() }))
    }

    /// The word, as the device's latest write to it left it (0 once the process is exiting).
    pub(super) fn get(&self) -> u64 {
        self.access(|word| word.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// Set the word to 0 from the host, before it serves another stream.
    pub(super) fn reset(&self) {
        self.access(|word| word.store(0, Ordering::Release));
    }
}

/// The crate's exit handler, registered (`atexit`) before the first word page is made and again
/// once it is, so after the driver's own (which a driver registers by then: the fake's at
/// `cuInit`, or at its first page-locked allocation), and so run before it: it closes
/// [`WORD_ACCESS`]. A thread still reading a word as the process exits (the watcher, a spinning
/// poll, a user's) then never reads memory the driver's handler freed.
extern "C" fn stop_word_access() {
    if let Some(&generation) = EXIT_HANDLER_GENERATION.get() {
        WORD_ACCESS.close(generation);
    }
}

/// The loaded driver: a safe wrapper around each raw call, from [`driver`] (or a binding guard).
/// The calls act on the calling thread's current context, which the caller binds first.
#[derive(Clone, Copy)]
pub(super) struct Driver {
    api: &'static Api,
}

impl Driver {
    fn check(self, call: &'static str, status: Status) -> Result<(), ServerError> {
        check(Some(self.api), call, status)
    }

    /// Make `raw`, the driver call `call`, unless the driver has shut down ([`live`]); its status
    /// checked.
    fn call(self, call: &'static str, raw: impl FnOnce() -> Status) -> Result<(), ServerError> {
        live(call)?;
        self.check(call, raw())
    }

    /// `cuCtxGetCurrent`: the calling thread's current context.
    pub(super) fn ctx_get_current(self) -> Result<CurrentContext, ServerError> {
        let mut current = ptr::null_mut();
        // SAFETY: `current` is a valid place for the handle.
        self.call("cuCtxGetCurrent", || unsafe {
            (self.api.ctx_get_current)(&mut current)
        })?;
        Ok(CurrentContext(current))
    }

    /// `cuCtxSetCurrent`: make `ctx` current on the calling thread.
    pub(super) fn ctx_set_current(self, ctx: &CudaContext) -> Result<(), ServerError> {
        // SAFETY: the handle is live: `ctx` holds its primary-context retain for the borrow.
        self.call("cuCtxSetCurrent", || unsafe {
            (self.api.ctx_set_current)(ctx.cu_ctx())
        })
    }

    /// `cuCtxGetId`: `ctx`'s number, unique for the process's life; `None` if the driver lacks it.
    pub(super) fn ctx_id(self, ctx: &CudaContext) -> Result<Option<u64>, ServerError> {
        let Some(get_id) = self.api.ctx_get_id else {
            return Ok(None);
        };
        let mut id = 0u64;
        // SAFETY: the handle is live (`ctx` holds its retain for the borrow); `id` is a valid
        // place for the number.
        self.call("cuCtxGetId", || unsafe { get_id(ctx.cu_ctx(), &mut id) })?;
        Ok(Some(id))
    }

    /// `cuCtxSetCurrent`: make a context found by [`ctx_get_current`](Self::ctx_get_current)
    /// current again.
    pub(super) fn ctx_restore(self, previous: CurrentContext) -> Result<(), ServerError> {
        // SAFETY: `previous` was current on this thread when it was found (or null: no context),
        // so it is the caller's to keep alive; the driver rejects one destroyed meanwhile.
        self.call("cuCtxSetCurrent", || unsafe {
            (self.api.ctx_set_current)(previous.0)
        })
    }

    /// `cuEventCreate` in the current context.
    pub(super) fn event_create(self, flags: EventFlags) -> Result<RawEvent, ServerError> {
        let mut bits = 0;
        if !flags.timing {
            bits |= EVENT_DISABLE_TIMING;
        }
        if flags.blocking_sync {
            bits |= EVENT_BLOCKING_SYNC;
        }
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` is a valid place for the new handle; the flags are documented bits.
        self.call("cuEventCreate", || unsafe {
            (self.api.event_create)(&mut raw, bits)
        })?;
        Ok(RawEvent(raw))
    }

    /// `cuEventRecord`: record `event` at the current end of `stream`.
    pub(super) fn event_record(
        self,
        event: &RawEvent,
        stream: &CudaStream,
    ) -> Result<(), ServerError> {
        // SAFETY: both handles are live: the event until it is destroyed by value (see
        // `RawEvent`), the stream borrowed from its owner for the call.
        self.call("cuEventRecord", || unsafe {
            (self.api.event_record)(event.0, stream.cu_stream())
        })
    }

    /// `cuEventQuery`: reached, not yet, or an error; all three outcomes.
    pub(super) fn event_query(self, event: &RawEvent) -> Result<bool, ServerError> {
        live("cuEventQuery")?;
        // SAFETY: the event is live (see `RawEvent`).
        match unsafe { (self.api.event_query)(event.0) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            status => self.check("cuEventQuery", status).map(|()| false),
        }
    }

    /// `cuEventSynchronize`: block until `event` is reached.
    pub(super) fn event_synchronize(self, event: &RawEvent) -> Result<(), ServerError> {
        // SAFETY: the event is live (see `RawEvent`).
        self.call("cuEventSynchronize", || unsafe {
            (self.api.event_synchronize)(event.0)
        })
    }

    /// `cuEventElapsedTime_v2`, or the legacy one if missing: milliseconds from `start` to `end`.
    pub(super) fn event_elapsed_ms(
        self,
        start: &RawEvent,
        end: &RawEvent,
    ) -> Result<f32, ServerError> {
        let mut ms = 0.0f32;
        let (name, elapsed) = self.api.event_elapsed.ok_or_else(|| {
            unavailable(format!(
                "the CUDA driver exports neither {}",
                ELAPSED_SYMBOLS.join(" nor ")
            ))
        })?;
        // SAFETY: `ms` is a valid place for the result; both events are live (see `RawEvent`);
        // `elapsed` has the driver's signature for these arguments.
        self.call(name, || unsafe { elapsed(&mut ms, start.0, end.0) })?;
        Ok(ms)
    }

    /// `cuEventDestroy`. Does not block: the driver releases the event once its pending work ends.
    pub(super) fn event_destroy(self, event: RawEvent) -> Result<(), ServerError> {
        // SAFETY: the event is live, and destroyed once: it is taken by value.
        self.call("cuEventDestroy", || unsafe {
            (self.api.event_destroy)(event.0)
        })
    }

    /// `cuStreamWaitEvent`: make `stream` wait, on the device, for `event`'s latest record.
    /// Works across contexts.
    pub(super) fn stream_wait_event(
        self,
        stream: &CudaStream,
        event: &RawEvent,
    ) -> Result<(), ServerError> {
        // SAFETY: both handles are live (see `event_record`); flag 0 is CU_EVENT_WAIT_DEFAULT.
        self.call("cuStreamWaitEvent", || unsafe {
            (self.api.stream_wait_event)(stream.cu_stream(), event.0, 0)
        })
    }

    /// `cuStreamSynchronize`: block until all work queued on `stream` is done.
    pub(super) fn stream_synchronize(self, stream: &CudaStream) -> Result<(), ServerError> {
        // SAFETY: the stream is live, borrowed from its owner for the call.
        self.call("cuStreamSynchronize", || unsafe {
            (self.api.stream_synchronize)(stream.cu_stream())
        })
    }

    /// `cuStreamGetCaptureInfo`: whether `stream` is capturing a graph, and in which capture.
    /// `call` names the caller's own call in an error (a fault found here is the user's record or
    /// wait failing, not a capture query of theirs). On the legacy default stream while a
    /// blocking stream of its context captures, the driver answers
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` ("If called on CU_STREAM_LEGACY (the NULL stream)
    /// while a stream not created with CU_STREAM_NON_BLOCKING is capturing"): an error to report.
    pub(super) fn stream_capture(
        self,
        call: &'static str,
        stream: &CudaStream,
    ) -> Result<Capture, ServerError> {
        let mut status = CAPTURE_STATUS_NONE;
        let mut id = 0u64;
        // SAFETY: the stream is live, borrowed from its owner for the call; `status` and `id` are
        // valid places for the enum's `int` and the `cuuint64_t`; the three other outputs are
        // optional (null).
        self.call(call, || unsafe {
            (self.api.stream_capture_info)(
                stream.cu_stream(),
                &mut status,
                &mut id,
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
            )
        })?;
        // "A valid id is returned only if [...] captureStatus is set to
        // CU_STREAM_CAPTURE_STATUS_ACTIVE".
        Ok(match status {
            CAPTURE_STATUS_NONE => Capture::None,
            CAPTURE_STATUS_ACTIVE => Capture::Active(id),
            _ => Capture::Invalidated,
        })
    }

    /// `cuDevicePrimaryCtxGetState`: whether the primary context of `device` is active (retained
    /// by someone, this process's other libraries included).
    pub(super) fn primary_ctx_active(self, device: sys::CUdevice) -> Result<bool, ServerError> {
        let (mut flags, mut active) = (0, 0);
        // SAFETY: a device handle is a plain number the driver validates; `flags` and `active`
        // are valid places for the outputs.
        self.call("cuDevicePrimaryCtxGetState", || unsafe {
            (self.api.primary_ctx_state)(device, &mut flags, &mut active)
        })?;
        Ok(active != 0)
    }

    /// `cuThreadExchangeStreamCaptureMode`: set this thread's capture mode, returning the old one.
    pub(super) fn exchange_capture_mode(self, mode: c_int) -> Result<c_int, ServerError> {
        let mut mode = mode;
        // SAFETY: `mode` is a valid, initialized place for the enum's `int`; callers pass a
        // documented mode or one the driver gave back.
        self.call("cuThreadExchangeStreamCaptureMode", || unsafe {
            (self.api.thread_exchange_capture_mode)(&mut mode)
        })?;
        Ok(mode)
    }

    /// `cuDeviceGetAttribute`: the value of `attribute` (a `CUdevice_attribute`) of `device`.
    pub(super) fn device_attribute(
        self,
        attribute: c_int,
        device: sys::CUdevice,
    ) -> Result<c_int, ServerError> {
        let mut value = 0;
        // SAFETY: `value` is a valid place for the `int`; the attribute and device are plain
        // numbers the driver validates.
        self.call("cuDeviceGetAttribute", || unsafe {
            (self.api.device_attribute)(&mut value, attribute, device)
        })?;
        Ok(value)
    }

    /// The progress word's entry points, or a `CUDA_ERROR_NOT_SUPPORTED` naming what is missing.
    fn word_api(self, call: &'static str) -> Result<&'static WordApi, ServerError> {
        self.api.word.as_ref().ok_or_else(|| {
            refused(
                call,
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
                &format!("the driver lacks one of {}", WORD_SYMBOLS.join(", ")),
            )
        })
    }

    /// A page of [`WORDS_PER_PAGE`] zeroed words of page-locked host memory mapped into the
    /// current context: `cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP` ("Maps the allocation
    /// into the CUDA address space"), neither portable nor write-combined (the host reads it), and
    /// its device address from `cuMemHostGetDevicePointer` (flags "must be set to 0"). A page that
    /// cannot be mapped or used (not aligned, or no exit handler after it) is freed at once. Never
    /// on a fence's path (see `progress.rs`).
    pub(super) fn alloc_mapped_page(self) -> Result<Vec<MappedWord>, ServerError> {
        live("cuMemHostAlloc")?;
        let api = self.word_api("cuMemHostAlloc")?;
        let no_exit_handler = || {
            let reason = "atexit refused the handler that stops word reads at exit";
            refused(
                "cuMemHostAlloc",
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
                reason,
            )
        };
        if !stop_word_access_at_exit(&BEFORE_FIRST_PAGE) {
            return Err(no_exit_handler());
        }
        let mut host = ptr::null_mut();
        // SAFETY: `host` is a valid place for the pointer; DEVICEMAP is a documented flag.
        self.check("cuMemHostAlloc", unsafe {
            (api.host_alloc)(&mut host, MAPPED_PAGE_BYTES, sys::CU_MEMHOSTALLOC_DEVICEMAP)
        })?;
        let Some(page) = NonNull::new(host.cast::<AtomicU64>()) else {
            return Err(refused(
                "cuMemHostAlloc",
                sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                "the driver returned a null pointer",
            ));
        };
        let mut device = 0;
        // SAFETY: `page` is the start of a live page-locked allocation of the current context;
        // `device` is a valid place for the address; flags 0 as documented.
        let mapped = self.check("cuMemHostGetDevicePointer", unsafe {
            (api.host_device_pointer)(&mut device, page.as_ptr().cast(), 0)
        });
        // The docs promise no alignment (drivers give whole pages).
        let mapped = mapped.and_then(|()| match page.as_ptr().align_offset(MAPPED_WORD_BYTES) {
            0 => Ok(()),
            _ => Err(refused(
                "cuMemHostAlloc",
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED,
                "the driver returned memory not aligned for progress words",
            )),
        });
        // Again, in case the driver registered its own handler as it made its first page.
        let mapped = mapped.and_then(|()| {
            let registered = stop_word_access_at_exit(&AFTER_FIRST_PAGE);
            registered.then_some(()).ok_or_else(no_exit_handler)
        });
        if let Err(err) = mapped {
            // SAFETY: the allocation was made just above, in the current context, and never
            // handed out or written: nothing can touch it after this free.
            let freed = self.check("cuMemFreeHost", unsafe {
                (api.free_host)(page.as_ptr().cast())
            });
            if let Err(free) = freed {
                log::debug!("an unmapped progress-word page could not be freed: {free}");
            }
            return Err(err);
        }
        let words: Vec<MappedWord> = (0..WORDS_PER_PAGE)
            .map(|index| index * MAPPED_WORD_BYTES)
            .map(|offset| MappedWord {
                // SAFETY: `offset` is within the `MAPPED_PAGE_BYTES` allocation, at a multiple of
                // 64 bytes from its start, which is 64-byte aligned (checked above).
                host: unsafe { page.byte_add(offset) },
                device: device + offset as sys::CUdeviceptr,
            })
            .collect();
        // The driver does not say it zeroes the memory.
        for word in &words {
            word.reset();
        }
        Ok(words)
    }

    /// `cuStreamWriteValue64`: `stream` stores `value` into `word` when it gets there, after its
    /// earlier work ("the write is preceded by a memory barrier", flags 0 being
    /// `CU_STREAM_WRITE_VALUE_DEFAULT`).
    pub(super) fn stream_write_value64(
        self,
        stream: &CudaStream,
        word: &MappedWord,
        value: u64,
    ) -> Result<(), ServerError> {
        live("cuStreamWriteValue64")?;
        let api = self.word_api("cuStreamWriteValue64")?;
        // SAFETY: the stream is borrowed from its owner for the call; `word.device` is the device
        // address of a live, 8-byte-aligned mapped allocation of the stream's context.
        self.check("cuStreamWriteValue64", unsafe {
            (api.write_value64)(stream.cu_stream(), word.device, value, 0)
        })
    }

    /// `cuModuleLoadData`: JIT-load `ptx` (NUL-terminated PTX text) into the current context.
    pub(super) fn module_load_data(self, ptx: &CStr) -> Result<Module, ServerError> {
        let mut module = ptr::null_mut();
        // SAFETY: `ptx` is NUL-terminated and outlives the call; `module` is a valid place.
        self.call("cuModuleLoadData", || unsafe {
            (self.api.module_load_data)(&mut module, ptx.as_ptr().cast())
        })?;
        Ok(Module(module))
    }

    /// `cuModuleGetFunction`: the kernel `name` of `module`.
    pub(super) fn module_get_function(
        self,
        module: &Module,
        name: &CStr,
    ) -> Result<Function, ServerError> {
        let mut function = ptr::null_mut();
        // SAFETY: the module is live (never unloaded); `name` is NUL-terminated; `function` is a
        // valid place for the handle.
        self.call("cuModuleGetFunction", || unsafe {
            (self.api.module_get_function)(&mut function, module.0, name.as_ptr())
        })?;
        Ok(Function(function))
    }

    /// `cuFuncLoad`: finish loading `function` now, in the current context, not at its first
    /// launch; `false`: the driver lacks it, and `cuModuleGetFunction` loaded it (see the symbol).
    pub(super) fn func_load(self, function: &Function) -> Result<bool, ServerError> {
        let Some(load) = self.api.func_load else {
            return Ok(false);
        };
        // SAFETY: the function is live (its module is never unloaded); loading a loaded function
        // "has no effect".
        self.call("cuFuncLoad", || unsafe { load(function.0) })?;
        Ok(true)
    }

    /// `cuLaunchKernel`: `function` on one thread of one block, with one `u64` argument. Only for
    /// the kernels of this crate's PTX (`kernels.rs`), each of which takes exactly one `.u64`.
    pub(super) fn launch_u64(
        self,
        function: &Function,
        stream: &CudaStream,
        mut argument: u64,
    ) -> Result<(), ServerError> {
        let mut params = [ptr::addr_of_mut!(argument).cast::<c_void>()];
        // SAFETY: the function is live (its module is never unloaded) and is one of this crate's
        // kernels, each of which takes exactly one u64 parameter; the driver copies the parameter
        // values before cuLaunchKernel returns, so pointers to locals are enough; the stream is
        // borrowed from its owner for the call.
        self.call("cuLaunchKernel", || unsafe {
            (self.api.launch_kernel)(
                function.0,
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{mpsc, Arc};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use super::AccessGate;

    /// What `thread` returned, failing rather than hanging past 20 s.
    fn joined<T>(thread: JoinHandle<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !thread.is_finished() {
            assert!(Instant::now() < deadline, "a thread hung");
            std::thread::sleep(Duration::from_millis(1));
        }
        thread.join().expect("the thread panicked")
    }

    /// Close `gate` on a thread of its own, failing rather than hanging.
    fn close(gate: &Arc<AccessGate>) {
        let gate = gate.clone();
        let generation = crate::os::fork_generation();
        joined(std::thread::spawn(move || gate.close(generation)));
    }

    #[test]
    fn a_closed_gate_lets_no_access_through() {
        let gate = Arc::new(AccessGate::new());
        assert_eq!(gate.pass(|| 1), Some(1));
        close(&gate);
        assert_eq!(gate.pass(|| 2), None);
        close(&gate);
    }

    #[test]
    fn closing_returns_once_the_accesses_under_way_are_done() {
        let gate = Arc::new(AccessGate::new());
        let done = Arc::new(AtomicBool::new(false));
        let (inside, entered) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let accessing = std::thread::spawn({
            let (gate, done) = (gate.clone(), done.clone());
            move || {
                gate.pass(|| {
                    inside.send(()).unwrap();
                    released.recv().unwrap();
                    done.store(true, Ordering::SeqCst);
                })
            }
        });
        entered.recv_timeout(Duration::from_secs(20)).unwrap();
        let closing = std::thread::spawn({
            let (gate, done) = (gate.clone(), done.clone());
            let generation = crate::os::fork_generation();
            move || {
                gate.close(generation);
                done.load(Ordering::SeqCst)
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while !gate.closed.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the gate did not close");
            std::thread::sleep(Duration::from_millis(1));
        }
        release.send(()).unwrap();
        assert!(
            joined(closing),
            "closing returned before the access under way was done"
        );
        assert_eq!(joined(accessing), Some(()));
        assert_eq!(gate.pass(|| ()), None);
    }

    /// Threads that keep reading after the close (a spinning poll, the watcher, a user's loop),
    /// many to a stripe, cannot keep it from returning: one refused by a closed gate counts itself
    /// in no more.
    #[test]
    fn closing_is_not_starved_by_readers_that_keep_reading() {
        let gate = Arc::new(AccessGate::new());
        let closed = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..128)
            .map(|_| {
                let (gate, closed) = (gate.clone(), closed.clone());
                std::thread::spawn(move || {
                    while !closed.load(Ordering::Relaxed) {
                        std::hint::black_box(gate.pass(|| 1));
                    }
                })
            })
            .collect();
        close(&gate);
        closed.store(true, Ordering::Relaxed);
        readers.into_iter().for_each(joined);
        assert_eq!(gate.pass(|| ()), None);
    }

    /// A forked child inherits the exit handler, and the count of the accesses the parent's
    /// threads had under way: closing there must not wait for them.
    #[test]
    fn a_forked_child_closes_without_waiting_for_its_parents_accesses() {
        let generation = crate::os::track_forks();
        let gate = AccessGate::new();
        let status = gate.pass(|| {
            // SAFETY: the child only closes the gate (atomics, no lock, no allocation) and leaves
            // with `_exit`; an alarm ends it if that hangs.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                // SAFETY: alarm only schedules a signal for this process, and `_exit` ends it
                // without running the harness's exit handlers.
                unsafe {
                    libc::alarm(20);
                    gate.close(generation);
                    libc::_exit(0);
                }
            }
            let mut status = 0;
            // SAFETY: waits for the child forked here; `status` outlives the call.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            status
        });
        let status = status.expect("the gate is open");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child did not exit (killed by signal {}: SIGALRM is a hang)",
            libc::WTERMSIG(status)
        );
    }
}
