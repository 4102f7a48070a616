//! [`SleepKernel`]: device work of a known length, for tests, examples and
//! benchmarks.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};

use super::driver::Kernel;
use crate::ServerError;

/// Spins one GPU thread on `%globaltimer` until the given number of
/// nanoseconds has passed. Hand-written PTX, JIT-compiled by the driver, so no
/// NVRTC or toolkit is needed. `{TARGET}` is filled in from [`TARGETS`].
const PTX: &str = r#"
.version 7.0
.target {TARGET}
.address_size 64

.visible .entry sleep_ns(
    .param .u64 duration_ns
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [duration_ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
SPIN:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra SPIN;
    ret;
}
"#;

/// Tried in order: the newest target first (drivers for CUDA 13 may no longer
/// compile the oldest), the oldest last (for older GPUs on older drivers).
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
    /// Load the kernel into `ctx`. Its module stays loaded as long as the
    /// context: load once per context, not once per launch.
    ///
    /// # Errors
    ///
    /// The driver could not JIT-compile the PTX for this device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, ServerError> {
        super::driver::ensure_loaded()?;
        let mut last = None;
        for target in TARGETS {
            let ptx = PTX.replace("{TARGET}", target) + "\0";
            let Ok(ptx) = CStr::from_bytes_with_nul(ptx.as_bytes()) else {
                continue;
            };
            match Kernel::load(ctx, ptx, c"sleep_ns") {
                Ok(kernel) => return Ok(Self { kernel }),
                Err(err) => last = Some(err),
            }
        }
        Err(last.unwrap_or_else(|| ServerError::Unavailable {
            backend: super::driver::BACKEND,
            reason: "no PTX target could be loaded".to_owned(),
        }))
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
