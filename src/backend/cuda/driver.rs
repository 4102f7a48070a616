//! Every raw CUDA driver call of the crate, behind [`check`], which turns a
//! status into a [`ServerError`].
//!
//! cudarc's safe layer is used where it fits (contexts, streams, binding a
//! context to the calling thread); the calls here drop to `cudarc::driver::sys`
//! because a fence event needs flags that cudarc's enum cannot express
//! (`DISABLE_TIMING | BLOCKING_SYNC`), queries need all three outcomes, and
//! destroying an event must report its error to the caller.

use std::ffi::{c_uint, c_void, CStr};
use std::fmt;
use std::ptr;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result::DriverError;
use cudarc::driver::{sys, CudaContext, CudaStream};

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

type ElapsedFn = unsafe extern "C" fn(*mut f32, sys::CUevent, sys::CUevent) -> sys::CUresult;

/// The driver's elapsed-time entry point, looked up once.
fn elapsed_fn() -> Result<ElapsedFn, ServerError> {
    static FOUND: OnceLock<Option<ElapsedFn>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        // SAFETY: only called after `ensure_loaded` found the library (an
        // event exists), so cudarc's loader does not reach its panic.
        let library = unsafe { sys::culib() };
        ELAPSED_SYMBOLS.iter().find_map(|name| {
            // SAFETY: both names have the signature of `ElapsedFn`
            // (CUDA driver API, cuEventElapsedTime); the library stays
            // loaded for the life of the process, so the pointer does too.
            unsafe { library.get::<ElapsedFn>(name.as_bytes()) }
                .ok()
                .map(|symbol| *symbol)
        })
    });
    found.ok_or_else(|| {
        unavailable(format!(
            "the CUDA driver exports neither {}",
            ELAPSED_SYMBOLS.join(" nor ")
        ))
    })
}

/// Status codes after which a context is unusable for good: every later call
/// on it returns the same error (CUDA driver API, "Error Handling").
const STICKY_CODES: &[i32] = &[
    214, // CUDA_ERROR_ECC_UNCORRECTABLE
    700, // CUDA_ERROR_ILLEGAL_ADDRESS
    702, // CUDA_ERROR_LAUNCH_TIMEOUT
    710, // CUDA_ERROR_ASSERT
    714, // CUDA_ERROR_HARDWARE_STACK_ERROR
    715, // CUDA_ERROR_ILLEGAL_INSTRUCTION
    716, // CUDA_ERROR_MISALIGNED_ADDRESS
    717, // CUDA_ERROR_INVALID_ADDRESS_SPACE
    718, // CUDA_ERROR_INVALID_PC
    719, // CUDA_ERROR_LAUNCH_FAILED
];

/// `cuEventCreate` flags.
const EVENT_BLOCKING_SYNC: c_uint = 0x1;
const EVENT_DISABLE_TIMING: c_uint = 0x2;

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
    // SAFETY: cuInit takes flags by value; 0 is the only documented value.
    check("cuInit", unsafe { sys::cuInit(0) }).map_err(|err| unavailable(err.to_string()))
}

fn unavailable(reason: String) -> ServerError {
    ServerError::Unavailable {
        backend: BACKEND,
        reason,
    }
}

/// The one place a driver status becomes a result.
pub(super) fn check(call: &'static str, status: sys::CUresult) -> Result<(), ServerError> {
    status.result().map_err(|err| driver_error(call, err))
}

/// A driver error, named and described by the driver, marked faulted when it
/// is one of the sticky ones.
pub(super) fn driver_error(call: &'static str, err: DriverError) -> ServerError {
    let code = err.0 as i32;
    let name = err
        .error_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", err.0));
    let message = err
        .error_string()
        .map(|message| message.to_string_lossy().into_owned())
        .unwrap_or_default();
    if STICKY_CODES.contains(&code) {
        ServerError::Faulted {
            backend: BACKEND,
            call,
            code,
            name,
            message,
        }
    } else {
        ServerError::Call {
            backend: BACKEND,
            call,
            code,
            name,
            message,
        }
    }
}

impl From<DriverError> for ServerError {
    fn from(err: DriverError) -> Self {
        driver_error("cudarc", err)
    }
}

/// Make `ctx` current on this thread (a waiter thread has none).
fn bind(ctx: &CudaContext) -> Result<(), ServerError> {
    ctx.bind_to_thread()
        .map_err(|err| driver_error("cuCtxSetCurrent", err))
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
    Err(ServerError::Call {
        backend: BACKEND,
        call,
        code: 201,
        name: "CUDA_ERROR_INVALID_CONTEXT".to_owned(),
        message: "the handle and the stream belong to different contexts".to_owned(),
    })
}

/// The CUDA backend's raw event. It keeps its context alive, and is destroyed
/// when dropped if [`Cuda::event_destroy`](super::Cuda) did not already.
pub struct CudaEvent {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
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
        bind(ctx)?;
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` is a valid place for the new handle; the flags are a
        // combination of documented bits.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Self {
            raw,
            ctx: ctx.clone(),
        })
    }

    /// Record at the current end of `stream`; the stream must share the
    /// event's context.
    pub(super) fn record(&self, stream: &CudaStream) -> Result<(), ServerError> {
        same_context("cuEventRecord", &self.ctx, stream)?;
        bind(&self.ctx)?;
        // SAFETY: both handles are live: the event is owned by `self`, the
        // stream is borrowed from its owner for the call.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.cu_stream())
        })
    }

    /// Reached, not yet, or an error: all three outcomes of `cuEventQuery`.
    pub(super) fn query(&self) -> Result<bool, ServerError> {
        bind(&self.ctx)?;
        // SAFETY: the event is live, owned by `self`.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            status => check("cuEventQuery", status).map(|()| false),
        }
    }

    /// Block until reached; sleeps in the driver for a `BLOCKING_SYNC` event.
    pub(super) fn synchronize(&self) -> Result<(), ServerError> {
        bind(&self.ctx)?;
        // SAFETY: the event is live, owned by `self`.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Make `stream` wait for this event's latest record, on the device. Works
    /// across contexts.
    pub(super) fn wait_on(&self, stream: &CudaStream) -> Result<(), ServerError> {
        bind(stream.context())?;
        // SAFETY: both handles are live; flag 0 is CU_EVENT_WAIT_DEFAULT.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.cu_stream(), self.raw, 0)
        })
    }

    /// Milliseconds from `start` to `self`, as the driver measures them.
    pub(super) fn elapsed_ms(&self, start: &Self) -> Result<f32, ServerError> {
        bind(&self.ctx)?;
        let mut ms = 0.0f32;
        // SAFETY: `ms` is a valid place for the result; both events are live.
        let elapsed = elapsed_fn()?;
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
        bind(&self.ctx)?;
        // SAFETY: `raw` was created by cuEventCreate and is destroyed once:
        // the field is nulled above.
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(raw) })
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
        bind(ctx)?;
        let mut module = ptr::null_mut();
        // SAFETY: `ptx` is a NUL-terminated image that outlives the call;
        // `module` is a valid place for the handle.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast())
        })?;
        let mut function = ptr::null_mut();
        // SAFETY: the module was just loaded and is never unloaded; `name` is
        // NUL-terminated; `function` is a valid place for the handle.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut function, module, name.as_ptr())
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
            return Err(ServerError::Call {
                backend: BACKEND,
                call: "cuLaunchKernel",
                code: 201,
                name: "CUDA_ERROR_INVALID_CONTEXT".to_owned(),
                message: "the kernel and the stream belong to different contexts".to_owned(),
            });
        }
        bind(&self.ctx)?;
        let mut params = [ptr::addr_of_mut!(argument).cast::<c_void>()];
        // SAFETY: the function is live (its module is never unloaded); the
        // kernel takes exactly one u64 parameter, and the driver copies the
        // parameter values before cuLaunchKernel returns, so pointers to
        // locals are enough.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
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
    bind(stream.context())?;
    // SAFETY: the stream is live, borrowed from its owner for the call.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(stream.cu_stream())
    })
}
