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

/// How many locks a context's pool is split into: every executor thread makes fences on the same
/// context, so one lock would be shared by all. Each thread takes from its own shard, or another's
/// when its own is empty; an event goes back to its taker's shard (see [`IdlePool`]).
const FENCE_POOL_SHARDS: usize = 8;

/// One context's idle fence events (`DISABLE_TIMING | BLOCKING_SYNC`), for later fences: on busy
/// GPUs `cuEventCreate` contends on the driver's context lock, so a steady loop of fences creates
/// none after warm-up. At most [`FENCE_POOL_CAPACITY`] idle events, spread over
/// [`FENCE_POOL_SHARDS`] locks.
///
/// One pool per driver context, not per `CudaContext` object: cudarc makes an object (and a
/// primary-context retain) per `CudaContext::new`, and objects come and go while another (or
/// another library) keeps the context alive; their events are the context's, and go on serving it.
/// The driver's context id (`cuCtxGetId`) tells the context apart from one made later under the
/// same handle; a driver without it gets a pool per object.
///
/// Idle events do not keep the context alive (the pool holds its objects weakly): when the pool
/// goes, it destroys them through any of its objects still alive, or through the device's primary
/// context when that is provably the same one still alive (something the pool never saw keeps it:
/// another cudarc object, another library, the CUDA runtime); only a context that is gone has its
/// events forgotten, as the driver freed them with it.
pub(crate) struct FencePool {
    /// The driver's id of the context, when it has `cuCtxGetId`.
    id: Option<u64>,
    /// The context's device, and its handle, to find it again.
    ordinal: usize,
    device: sys::CUdevice,
    handle: usize,
    /// Objects of the driver context whose streams use the pool: any one alive keeps it alive.
    /// Without an id, only the first, whose allocation (held by the `Weak`) identifies the pool.
    objects: Mutex<Vec<Weak<CudaContext>>>,
    idle: IdlePool<IdleEvent, FENCE_POOL_SHARDS>,
    /// The progress words of the context's streams (its slab, kept past the pool: see
    /// `progress.rs`).
    pub(super) words: PoolWords,
}

/// An idle event's raw handle.
struct IdleEvent(RawEvent);

impl FencePool {
    /// The pool of `ctx`'s fence events: the same pool for every stream of a
    /// driver context, found once per stream registration (not per fence).
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
        let found = pools.iter().filter_map(Weak::upgrade).find(|pool| {
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
        found.unwrap_or_else(|| {
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
        })
    }

    /// An idle fence event of this pool's context from the calling thread's shard, or a new one,
    /// counted in `live` (its stream's counts). `ctx` is an object of the pool's context, kept
    /// alive by the caller's stream.
    pub(crate) fn take(
        self: &Arc<Self>,
        ctx: &Arc<CudaContext>,
        live: &LiveEvents,
    ) -> Result<CudaEvent, ServerError> {
        let shard = self.idle.home();
        let event = match self.idle.take(shard, |_| {}) {
            Some(IdleEvent(raw)) => {
                live.reused();
                CudaEvent::from_raw(raw, ctx).counted(live)
            }
            None => CudaEvent::create(ctx, EventFlags::FENCE, live)?,
        };
        Ok(event.pooled(self.clone(), shard))
    }

    /// Keep `raw`, a released fence event of this pool's context, in
    /// `shard`; hand it back when that shard is full.
    pub(super) fn give_back(&self, shard: usize, raw: RawEvent) -> Result<(), RawEvent> {
        self.idle
            .give_back(shard, IdleEvent(raw), |_| {})
            .map_err(|IdleEvent(raw)| raw)
    }

    /// A live object of the pool's context: one of its own, or the device's primary context when
    /// provably the same one; `None` once the context is gone (the driver freed what it held).
    /// Held, so that if it is the last handle, the thread's current context is left as found.
    pub(super) fn live_context(&self) -> Option<HeldContext> {
        let known = self.objects.lock().iter().find_map(Weak::upgrade);
        known
            .or_else(|| self.primary_still_alive())
            .map(HeldContext::from)
    }

    /// The device's primary context, when it is still the pool's own: active (retained by someone),
    /// under the same handle and with the same id, which a context made again would not have
    /// ("unique for the life of the program", `cuCtxGetId`). Retained for the call, not made: an
    /// inactive primary context is not looked at.
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
            drop(CudaEvent::from_raw(raw, &ctx));
        }
    }
}
