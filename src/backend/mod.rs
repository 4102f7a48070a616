//! Implementations of [`EventApi`](crate::EventApi): the CUDA driver and CPU host streams, and
//! what only backends use. Backends know nothing of the waiter, and name fences only to offer
//! `cuda::fence` and `HostStream::fence`.
//!
//! - `cuda/`: the CUDA driver, through cudarc (feature `cuda`);
//! - `host/`: CPU streams, each a worker thread running launched closures in order;
//! - `registry.rs`: copyable stream handles that cannot dangle (a registry of weak references);
//! - `idle_pool.rs`: bounded pools of idle events (the fence-event pools);
//! - `live_events.rs`: per-stream event counts for leak checks (feature `test-util`).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host;
pub(crate) mod idle_pool;
pub(crate) mod live_events;
mod registry;
