//! [`FencePool`]: each context's idle fence events, for later fences.

use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::{sys, CudaContext};

use super::bind::HeldContext;
use super::driver::{driver, RawEvent};
use super::event::CudaEvent;
use super::progress::PoolWords;
use crate::backend::idle_pool::IdlePool;
use crate::backend::live_events::LiveEvents;
use crate::sync::Mutex;
use crate::{EventFlags, ServerError};

/// The most idle fence events a context's pool keeps, over [`FENCE_POOL_SHARDS`] shards.
const FENCE_POOL_CAPACITY: usize = 512;

/// How many locks a context's pool is split into, since every executor thread makes fences on the
/// same context (see [`IdlePool`]).
const FENCE_POOL_SHARDS: usize = 8;

/// One context's idle fence events, for later fences: on busy GPUs `cuEventCreate` contends on the
/// driver's context lock, so a steady loop of fences creates none after warm-up.
///
/// One pool per driver context (told apart by `cuCtxGetId`; without it, one per `CudaContext`
/// object), holding its objects weakly: when it goes, its idle events are destroyed through a
/// context object still alive ([`live_context`](Self::live_context)), or left to the driver,
/// which freed them with the context. See the CUDA guide, docs/cuda.md.
pub(crate) struct FencePool {
    /// The driver's id of the context, when it has `cuCtxGetId`.
    id: Option<u64>,
    /// The context's device, and its handle, to find it again.
    ordinal: usize,
    device: sys::CUdevice,
    handle: usize,
    /// Objects of the context whose streams use the pool. Without an id, only the first, whose
    /// allocation (held by the `Weak`) identifies the pool.
    objects: Mutex<Vec<Weak<CudaContext>>>,
    idle: IdlePool<IdleEvent, FENCE_POOL_SHARDS>,
    /// The progress words of the context's streams (kept past the pool: see `progress.rs`).
    pub(super) words: PoolWords,
}

/// An idle event's raw handle.
struct IdleEvent(RawEvent);

impl FencePool {
    /// The pool of `ctx`'s driver context, found once per stream registration (not per fence).
    pub(crate) fn of(ctx: &Arc<CudaContext>) -> Arc<Self> {
        // In a `OnceLock`: the crate's mutex is not `const` under loom.
        static POOLS: OnceLock<Mutex<Vec<Weak<FencePool>>>> = OnceLock::new();
        let id = driver()
            .and_then(|driver| driver.ctx_id(ctx))
            .unwrap_or_else(|err| {
                log::debug!("no CUDA context id, the fence pool is per object: {err}");
                None
            });
        let mut pools = POOLS.get_or_init(Mutex::default).lock();
        pools.retain(|pool| pool.strong_count() > 0);
        // Every pool upgraded is dropped after the lock: one whose last stream went meanwhile
        // is dropped here, and a pool's drop calls the driver.
        let live: Vec<Arc<Self>> = pools.iter().filter_map(Weak::upgrade).collect();
        let found = live.iter().find(|pool| {
            let mut objects = pool.objects.lock();
            match (id, pool.id) {
                (Some(id), Some(pool_id)) if id == pool_id => {
                    objects.retain(|object| object.strong_count() > 0);
                    if !objects
                        .iter()
                        .any(|object| object.as_ptr() == Arc::as_ptr(ctx))
                    {
                        objects.push(Arc::downgrade(ctx));
                    }
                    true
                }
                (None, None) => objects
                    .first()
                    .is_some_and(|object| object.as_ptr() == Arc::as_ptr(ctx)),
                _ => false,
            }
        });
        let pool = found.cloned().unwrap_or_else(|| {
            let pool = Arc::new(Self {
                id,
                ordinal: ctx.ordinal(),
                device: ctx.cu_device(),
                handle: ctx.cu_ctx() as usize,
                objects: Mutex::new(vec![Arc::downgrade(ctx)]),
                idle: IdlePool::new(FENCE_POOL_CAPACITY),
                words: PoolWords::adopt(ctx.ordinal(), id),
            });
            pools.push(Arc::downgrade(&pool));
            pool
        });
        drop(pools);
        drop(live);
        pool
    }

    /// An idle fence event from the calling thread's shard, or a new one, counted in `live`. `ctx`
    /// is an object of the pool's context, kept alive by the caller's stream.
    pub(crate) fn take(
        self: &Arc<Self>,
        ctx: &Arc<CudaContext>,
        live: &LiveEvents,
    ) -> Result<CudaEvent, ServerError> {
        let shard = crate::sync::shards::home(FENCE_POOL_SHARDS);
        let event = match self.idle.take(shard, |_| {}) {
            Some(IdleEvent(raw)) => {
                live.reused();
                CudaEvent::from_raw(raw, ctx, Some(live))
            }
            None => CudaEvent::create(ctx, EventFlags::FENCE, live)?,
        };
        Ok(event.pooled(self.clone(), shard))
    }

    /// Keep `raw`, a released fence event of this pool's context, in `shard`; back if it is full.
    pub(super) fn give_back(&self, shard: usize, raw: RawEvent) -> Result<(), RawEvent> {
        self.idle
            .give_back(shard, IdleEvent(raw), |_| {})
            .map_err(|IdleEvent(raw)| raw)
    }

    /// A live object of the pool's context: one of its own, or the device's primary context when
    /// provably the same one (kept alive by something the pool never saw: another library, the
    /// CUDA runtime); `None` once the context is gone.
    pub(super) fn live_context(&self) -> Option<HeldContext> {
        let known = self.objects.lock().iter().find_map(Weak::upgrade);
        known
            .or_else(|| self.primary_still_alive())
            .map(HeldContext::from)
    }

    /// The device's primary context, when it is still the pool's own: active (retained by someone;
    /// an inactive one is not made), under the same handle and with the same id, which a context
    /// made again would not have ("unique for the life of the program", `cuCtxGetId`).
    fn primary_still_alive(&self) -> Option<Arc<CudaContext>> {
        let id = self.id?;
        let driver = driver().ok()?;
        if !driver.primary_ctx_active(self.device).ok()? {
            return None;
        }
        let ctx = super::context::context(self.ordinal).ok()?;
        let same = ctx.cu_ctx() as usize == self.handle
            && matches!(driver.ctx_id(&ctx), Ok(Some(same)) if same == id);
        if same {
            return Some(ctx);
        }
        // Not the pool's: dropped as a held context, leaving the thread's current context as found.
        drop(HeldContext::from(ctx));
        None
    }
}

impl Drop for FencePool {
    fn drop(&mut self) {
        if super::driver::in_forked_child() {
            // Its locks may be held in the parent: its events are forgotten.
            return;
        }
        // Never freed while the context may live (a graph can replay a write into them): kept
        // for the context's next pool, touching no memory (see `progress.rs`).
        self.words.park(self.ordinal, self.id);
        let idle = self.idle.take_all(|_| {});
        if idle.is_empty() {
            return;
        }
        let Some(ctx) = self.live_context() else {
            // Gone, or not told apart from a later context: the driver freed its events with it.
            return;
        };
        for IdleEvent(raw) in idle {
            drop(CudaEvent::from_raw(raw, &ctx, None));
        }
    }
}
