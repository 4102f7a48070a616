//! Test kernels, hand-written PTX JIT-compiled by the driver (no NVRTC or toolkit needed):
//! [`SleepKernel`], device work of a known length, and `FaultKernel` (feature `test-util`), a
//! write to an illegal address; both launch a [`Kernel`], one entry of the PTX in a context.

use std::ffi::CStr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::bind::{bind, HeldContext};
use super::driver::{refused, unavailable, Function};
use crate::sync::Mutex;
use crate::ServerError;

/// `sleep_ns` spins one GPU thread on `%globaltimer` for the given nanoseconds, and at most once
/// per nanosecond (`%rd5` counts down): the PTX ISA leaves `%globaltimer` unspecified when PTX is
/// JIT-compiled for another target, and a spin takes well over a nanosecond, so a stalled timer
/// cannot hang it and a working one is never cut short. `write_u32` stores 1 at the given address.
/// `{TARGET}` comes from [`TARGETS`] (each assembled by `ptxas` in CI, `tests/ptx.rs`). Every entry
/// takes exactly one `.u64`: what [`Kernel::launch_u64`] passes.
const PTX: &str = r#"
.version 7.0
.target {TARGET}
.address_size 64

.visible .entry sleep_ns(
    .param .u64 duration_ns
)
{
    .reg .pred %p<3>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [duration_ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
    mov.u64 %rd5, %rd1;
SPIN:
    setp.eq.u64 %p2, %rd5, 0;
    @%p2 bra DONE;
    sub.u64 %rd5, %rd5, 1;
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra SPIN;
DONE:
    ret;
}

.visible .entry write_u32(
    .param .u64 address
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<2>;

    ld.param.u64 %rd1, [address];
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
"#;

/// One kernel of a PTX module loaded into a context (never unloaded, see `driver::Module`).
struct Kernel {
    function: Function,
    ctx: HeldContext,
}

impl Kernel {
    /// JIT-load the test module into `ctx`, trying each target, find `name` and load it now, not
    /// at its first launch (why: [`SleepKernel::new`]; how: `driver::FUNC_LOAD_SYMBOL`).
    fn load(ctx: &Arc<CudaContext>, name: &CStr) -> Result<Self, ServerError> {
        let bound = bind(ctx)?;
        let mut last = None;
        for (_, ptx) in ptx_modules() {
            let ptx = ptx + "\0";
            let Ok(ptx) = CStr::from_bytes_with_nul(ptx.as_bytes()) else {
                continue;
            };
            // Relaxed: a load can synchronize the context, which could invalidate a capture.
            let loaded = bound.relaxed(|driver| {
                let module = driver.module_load_data(ptx)?;
                let function = driver.module_get_function(&module, name)?;
                driver.func_load(&function)?;
                Ok(function)
            });
            match loaded {
                Ok(function) => {
                    let ctx = HeldContext::from(ctx.clone());
                    return Ok(Self { function, ctx });
                }
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| unavailable("no PTX target could be loaded".to_owned())))
    }

    /// Launch on one thread of one block with one `u64` argument.
    fn launch_u64(&self, stream: &CudaStream, argument: u64) -> Result<(), ServerError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(refused(
                "cuLaunchKernel",
                sys::CUresult::CUDA_ERROR_INVALID_CONTEXT,
                "the kernel and the stream belong to different contexts",
            ));
        }
        let bound = bind(&self.ctx)?;
        bound.driver.launch_u64(&self.function, stream, argument)
    }
}

/// The PTX modules the crate ships, `(target, NUL-free PTX text)` in the order they are tried,
/// to check with `ptxas -arch=<target>` without a GPU. Public with feature `test-util`.
///
/// ```
/// let modules = device_events::cuda::ptx_modules();
/// assert!(modules.iter().all(|(target, ptx)| ptx.contains(&format!(".target {target}"))));
/// ```
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub fn ptx_modules() -> Vec<(&'static str, String)> {
    TARGETS
        .iter()
        .map(|target| (*target, PTX.replace("{TARGET}", target)))
        .collect()
}

/// Tried in order: the newest target first (drivers for CUDA 13 may no longer compile the
/// oldest), the oldest last (for older GPUs on older drivers).
const TARGETS: &[&str] = &["sm_75", "sm_60", "sm_50"];

/// A kernel that keeps a stream busy for a given time: work of known length.
///
/// ```no_run
/// use device_events::cuda::{self, SleepKernel};
/// use std::time::Duration;
///
/// let ctx = cuda::context(0)?;
/// let stream = ctx.new_stream()?;
/// let sleep = SleepKernel::new(&ctx)?;
/// sleep.launch(&stream, Duration::from_millis(10))?;
/// cuda::fence(&stream).wait_sync()?;
/// # Ok::<(), device_events::ServerError>(())
/// ```
pub struct SleepKernel {
    kernel: Kernel,
}

impl SleepKernel {
    /// Load the kernel into `ctx`, for as long as the context lives: once per context, and before
    /// launching work that must overlap (the CUDA Programming Guide, "Lazy Loading": loading
    /// kernels "might require context synchronization"; on an H200 it held other threads' calls).
    /// The kernel is loaded here (by `cuFuncLoad` where the driver has it), whether lazy loading
    /// (the default on Linux since CUDA 12.2) is on or not, so no launch loads it: a first launch
    /// waits for no other stream.
    ///
    /// # Errors
    ///
    /// The driver could not JIT-compile the PTX for this device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, ServerError> {
        Ok(Self {
            kernel: Kernel::load(ctx, c"sleep_ns")?,
        })
    }

    /// The kernel loaded into `ctx`'s context on the first call, and the same `Arc` while any is
    /// alive: loaded once per context (see [`new`](Self::new)).
    ///
    /// ```no_run
    /// use device_events::cuda::{self, SleepKernel};
    /// use std::sync::Arc;
    ///
    /// let ctx = cuda::context(0)?;
    /// let first = SleepKernel::shared(&ctx)?;
    /// let again = SleepKernel::shared(&ctx)?;
    /// assert!(Arc::ptr_eq(&first, &again));
    /// # Ok::<(), device_events::ServerError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), for the first call (or the first after every `Arc` was dropped).
    pub fn shared(ctx: &Arc<CudaContext>) -> Result<Arc<Self>, ServerError> {
        // Keyed by the context's handle: a live kernel holds its context, so no other context can
        // have that handle meanwhile. Held over the load, so racing callers load it once.
        static SHARED: OnceLock<Mutex<Vec<Weak<SleepKernel>>>> = OnceLock::new();
        super::driver::driver()?;
        let mut shared = SHARED.get_or_init(Mutex::default).lock();
        shared.retain(|kernel| kernel.strong_count() > 0);
        let found = shared
            .iter()
            .filter_map(Weak::upgrade)
            .find(|kernel| kernel.kernel.ctx.cu_ctx() == ctx.cu_ctx());
        if let Some(kernel) = found {
            return Ok(kernel);
        }
        let kernel = Arc::new(Self::new(ctx)?);
        shared.push(Arc::downgrade(&kernel));
        Ok(kernel)
    }

    /// Queue `duration` of device-side spinning on `stream`.
    ///
    /// # Errors
    ///
    /// The stream belongs to another context, or the launch was refused.
    pub fn launch(&self, stream: &CudaStream, duration: Duration) -> Result<(), ServerError> {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        self.kernel.launch_u64(stream, nanos)
    }
}

impl std::fmt::Debug for SleepKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SleepKernel")
    }
}

/// A kernel that writes to an illegal address, poisoning its context for tests of faults (feature
/// `test-util`): every later call on the context fails with `CUDA_ERROR_ILLEGAL_ADDRESS` (a sticky
/// [`ServerError::Faulted`]), so run it in a test binary of its own.
///
/// ```no_run
/// use device_events::cuda::{self, FaultKernel};
///
/// let ctx = cuda::context(0)?;
/// let stream = ctx.new_stream()?;
/// FaultKernel::new(&ctx)?.launch(&stream)?;
/// let err = cuda::fence(&stream).wait_sync().unwrap_err();
/// assert!(err.is_faulted()); // and so is every later call on `ctx`
/// # Ok::<(), device_events::ServerError>(())
/// ```
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub struct FaultKernel {
    kernel: Kernel,
}

#[cfg(feature = "test-util")]
impl FaultKernel {
    /// Load the kernel into `ctx` (loaded here, not at its first launch: see
    /// [`SleepKernel::new`]).
    ///
    /// # Errors
    ///
    /// The driver could not JIT-compile the PTX for this device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, ServerError> {
        Ok(Self {
            kernel: Kernel::load(ctx, c"write_u32")?,
        })
    }

    /// Queue a write to an address no allocation covers.
    ///
    /// # Errors
    ///
    /// The stream belongs to another context, or the launch was refused.
    pub fn launch(&self, stream: &CudaStream) -> Result<(), ServerError> {
        // Far from any allocation, and 4-byte aligned: an illegal address, not a misaligned one.
        self.kernel.launch_u64(stream, 0x10)
    }
}

#[cfg(feature = "test-util")]
impl std::fmt::Debug for FaultKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FaultKernel")
    }
}
