//! [`FencePool`]: each context's idle fence events, for later fences.

use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::CudaContext;

use super::driver::RawEvent;
use super::event::CudaEvent;
use crate::idle_pool::IdlePool;
use crate::loom::Mutex;
use crate::{EventFlags, ServerError};

/// The most idle fence events a context's pool keeps, over
/// [`FENCE_POOL_SHARDS`] shards.
const FENCE_POOL_CAPACITY: usize = 512;

/// How many locks a context's pool is split into. Every executor thread
/// makes fences on the same context, so one lock would be a lock shared by
/// all of them; each thread takes from its own shard, or another's when its
/// own is empty, and an event goes back to the shard of the thread that
/// took it (see [`IdlePool`]).
const FENCE_POOL_SHARDS: usize = 8;

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
    idle: IdlePool<IdleEvent, FENCE_POOL_SHARDS>,
}

/// An idle event's raw handle.
struct IdleEvent(RawEvent);

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
                idle: IdlePool::new(FENCE_POOL_CAPACITY),
            });
            pools.push(Arc::downgrade(&pool));
            pool
        })
    }

    /// An idle fence event of this pool's context from the calling thread's
    /// shard, or a new one. `ctx` is the pool's context, kept alive by the
    /// caller's stream.
    pub(crate) fn take(self: &Arc<Self>, ctx: &Arc<CudaContext>) -> Result<CudaEvent, ServerError> {
        let shard = self.idle.home();
        let event = match self.idle.take(shard, |_| {}) {
            Some(IdleEvent(raw)) => CudaEvent::from_raw(raw, ctx),
            None => CudaEvent::create(ctx, EventFlags::FENCE)?,
        };
        Ok(event.pooled(self.clone(), shard))
    }

    /// Keep `raw`, a released fence event of this pool's context, in
    /// `shard`; hand it back when that shard is full.
    pub(super) fn give_back(&self, shard: usize, raw: RawEvent) -> Result<(), RawEvent> {
        if crate::plant::planted("cuda-fence-events-not-pooled") {
            return Err(raw);
        }
        self.idle
            .give_back(shard, IdleEvent(raw), |_| {})
            .map_err(|IdleEvent(raw)| raw)
    }
}

impl Drop for FencePool {
    fn drop(&mut self) {
        let idle = self.idle.take_all(|_| {});
        let Some(ctx) = self.ctx.upgrade() else {
            // The context is gone, and the driver freed its events with it.
            return;
        };
        for IdleEvent(raw) in idle {
            drop(CudaEvent::from_raw(raw, &ctx));
        }
    }
}
