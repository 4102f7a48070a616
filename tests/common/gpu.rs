//! The CUDA tests' device: its context and the sleep kernel, loaded once per
//! test binary, or a skip (a failure with `DEVICE_EVENTS_REQUIRE_CUDA=1`)
//! where there is no driver.

use std::sync::{Arc, OnceLock};

use device_events::cuda::cudarc::driver::CudaContext;
use device_events::cuda::{self, SleepKernel};
use device_events::ServerError;

/// Whether a missing driver fails the test instead of skipping it.
pub fn required() -> bool {
    std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1")
}

/// The device's context and the sleep kernel, or `None` (skipping) without
/// one. The kernel is loaded once for the whole binary, before any test
/// launches it: loading a module can synchronize its context (the driver
/// waits for the work in flight on every stream, as an H200 showed), so a
/// test loading its own kernel while another's sleep runs would end that
/// sleep's wait early and fail the tests that check work is still running.
pub fn gpu(test: &str) -> Option<(Arc<CudaContext>, &'static SleepKernel)> {
    type Loaded = Result<(Arc<CudaContext>, Arc<SleepKernel>), ServerError>;
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        cuda::context(0).and_then(|ctx| SleepKernel::shared(&ctx).map(|kernel| (ctx, kernel)))
    });
    match loaded {
        Ok((ctx, kernel)) => Some((ctx.clone(), &**kernel)),
        Err(err) if required() => {
            panic!("{test}: DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}")
        }
        Err(err) => {
            super::skipped::skip(
                test,
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            None
        }
    }
}
