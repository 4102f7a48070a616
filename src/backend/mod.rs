//! Implementations of [`EventApi`](crate::EventApi): the CUDA driver and CPU
//! host streams. Backends know nothing of fences or the waiter.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
mod registry;
