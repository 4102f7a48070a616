//! [`FencePool`]: each context's idle fence events, for later fences.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::CudaContext;

use super::driver::RawEvent;
use super::event::CudaEvent;
use crate::loom::Mutex;
use crate::{EventFlags, ServerError};

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
struct IdleEvent(RawEvent);

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
        let event = match idle {
            Some(IdleEvent(raw)) => CudaEvent::from_raw(raw, ctx),
            None => CudaEvent::create(ctx, EventFlags::FENCE)?,
        };
        Ok(event.pooled(self.clone(), shard))
    }

    /// Keep `raw`, a released fence event of this pool's context, in
    /// `shard`; hand it back when that shard is full.
    pub(super) fn give_back(&self, shard: usize, raw: RawEvent) -> Result<(), RawEvent> {
        // Back to the shard of the thread that took it; a full shard
        // destroys it rather than lock the others (a burst of releases
        // beyond the pool's capacity would lock every shard each time).
        let mut idle = self.shards[shard].lock();
        if idle.len() < SHARD_CAPACITY && !crate::plant::planted("cuda-fence-events-not-pooled") {
            idle.push(IdleEvent(raw));
            return Ok(());
        }
        Err(raw)
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
            drop(CudaEvent::from_raw(raw, &ctx));
        }
    }
}
