//! The device count and each device's primary context, shared.

use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::CudaContext;

use super::{bind, driver};
use crate::sync::Mutex;
use crate::ServerError;

/// How many CUDA devices the driver reports.
///
/// ```
/// match device_events::cuda::device_count() {
///     Ok(count) => println!("{count} CUDA devices"),
///     Err(err) => assert!(err.is_unavailable(), "{err}"), // no driver: not a panic
/// }
/// ```
///
/// # Errors
///
/// [`ServerError::Unavailable`] without a driver.
pub fn device_count() -> Result<usize, ServerError> {
    driver::driver()?;
    let count = CudaContext::device_count()?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The primary context of device `ordinal`, once the driver and the device are found (cudarc
/// alone would panic without a driver). While one for `ordinal` is alive, later calls return the
/// same `Arc` (each new `CudaContext`'s first stream synchronizes the whole device). Unlike
/// `CudaContext::new`, it leaves the calling thread's current context as it found it.
///
/// ```
/// match device_events::cuda::context(0) {
///     Ok(ctx) => println!("device 0: {}", ctx.ordinal()),
///     Err(no_gpu) => eprintln!("{no_gpu}"), // ServerError::Unavailable
/// }
/// ```
///
/// # Errors
///
/// [`ServerError::Unavailable`] without a driver or without that device.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>, ServerError> {
    // In a `OnceLock`: the crate's mutex is not `const` under loom.
    static CONTEXTS: OnceLock<Mutex<Vec<Weak<CudaContext>>>> = OnceLock::new();
    let count = device_count()?;
    if ordinal >= count {
        return Err(driver::unavailable(format!(
            "no CUDA device {ordinal}: the driver reports {count}"
        )));
    }
    let mut contexts = CONTEXTS.get_or_init(Mutex::default).lock();
    if let Some(ctx) = contexts.get(ordinal).and_then(Weak::upgrade) {
        return Ok(ctx);
    }
    // cudarc binds the context it makes to the calling thread, and leaves it.
    let ctx = bind::keeping_current(|| CudaContext::new(ordinal))??;
    if contexts.len() <= ordinal {
        contexts.resize_with(ordinal + 1, Weak::new);
    }
    contexts[ordinal] = Arc::downgrade(&ctx);
    Ok(ctx)
}
