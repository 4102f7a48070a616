//! Copyable stream handles that cannot dangle.
//!
//! [`EventApi::Stream`](crate::EventApi::Stream) must be `Copy`, so a handle
//! cannot own its stream. Each backend keeps a registry of weak references
//! instead: a handle is a number, and a call through a handle whose stream has
//! been dropped finds nothing and returns an error, never touches freed memory.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock, Weak};

/// Entries whose stream is gone are swept once the map has grown past this
/// many, then past twice what survived the last sweep.
const FIRST_SWEEP: usize = 64;

/// Maps handle numbers to weak references of `T`.
pub(crate) struct Registry<T> {
    inner: RwLock<Inner<T>>,
}

struct Inner<T> {
    by_id: BTreeMap<u64, Weak<T>>,
    /// The id already given to a live `Arc`, so registering it again returns
    /// the same handle. Sound as a key because a `Weak` in `by_id` keeps the
    /// allocation, so its address cannot be reused while the entry exists.
    by_address: BTreeMap<usize, u64>,
    next_id: u64,
    sweep_at: usize,
}

impl<T> Registry<T> {
    /// An empty registry; `const` so it can be a `static`.
    pub(crate) const fn new() -> Self {
        Self {
            inner: RwLock::new(Inner {
                by_id: BTreeMap::new(),
                by_address: BTreeMap::new(),
                next_id: 1,
                sweep_at: FIRST_SWEEP,
            }),
        }
    }

    /// The id of `value`, registering it if it has none yet.
    pub(crate) fn register(&self, value: &Arc<T>) -> u64 {
        let address = Arc::as_ptr(value) as usize;
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(&id) = inner.by_address.get(&address) {
            return id;
        }
        if inner.by_id.len() >= inner.sweep_at {
            inner.sweep();
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.by_id.insert(id, Arc::downgrade(value));
        inner.by_address.insert(address, id);
        id
    }

    /// The value behind `id`, while it is alive.
    pub(crate) fn get(&self, id: u64) -> Option<Arc<T>> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        inner.by_id.get(&id).and_then(Weak::upgrade)
    }

    /// Forget `id` (its owner is being dropped).
    pub(crate) fn remove(&self, id: u64) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(weak) = inner.by_id.remove(&id) {
            inner.by_address.remove(&(weak.as_ptr() as usize));
        }
    }
}

impl<T> Inner<T> {
    fn sweep(&mut self) {
        let by_address = &mut self.by_address;
        self.by_id.retain(|_, weak| {
            let alive = weak.strong_count() > 0;
            if !alive {
                by_address.remove(&(weak.as_ptr() as usize));
            }
            alive
        });
        self.sweep_at = (self.by_id.len() * 2).max(FIRST_SWEEP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_to_a_dropped_value_finds_nothing() {
        let registry = Registry::new();
        let value = Arc::new(5);
        let id = registry.register(&value);
        assert_eq!(registry.get(id).as_deref(), Some(&5));
        assert_eq!(registry.register(&value), id, "same Arc, same id");
        drop(value);
        assert!(registry.get(id).is_none());
    }

    #[test]
    fn dead_entries_are_swept_and_ids_never_reused() {
        let registry = Registry::new();
        let mut ids = Vec::new();
        for i in 0..(FIRST_SWEEP * 4) {
            let value = Arc::new(i);
            ids.push(registry.register(&value));
        }
        let keep = Arc::new(usize::MAX);
        let kept = registry.register(&keep);
        let len = registry.inner.read().unwrap().by_id.len();
        assert!(len <= FIRST_SWEEP, "dead entries were swept, {len} left");
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            FIRST_SWEEP * 4,
            "every registration got a new id"
        );
        assert!(ids.iter().all(|id| registry.get(*id).is_none()));
        assert_eq!(registry.get(kept).as_deref(), Some(&usize::MAX));
        registry.remove(kept);
        assert!(registry.get(kept).is_none());
    }
}
