//! Copyable stream handles that cannot dangle.
//!
//! [`EventApi::Stream`](crate::EventApi::Stream) must be `Copy`, so a handle is a number in a
//! registry of weak references: a call through one whose stream was dropped returns an error.
//!
//! Every fence resolves its stream here, from every executor thread, so the registry is split into
//! shards behind read-write locks: a lookup, or registering a known stream, takes one shard's read
//! lock; only a stream's first registration and its removal write.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::sync::shards;
use crate::sync::RwLock;

/// Entries whose stream is gone are swept once a shard has grown past this many, then past twice
/// what survived the last sweep.
const FIRST_SWEEP: usize = 64;

/// How many shards: a power of two, so a handle's low bits name its shard.
const SHARDS: usize = 16;
const SHARD_BITS: u32 = SHARDS.trailing_zeros();

/// Maps handle numbers to weak references of `T`, each with a payload `X` (a pool, say).
pub(crate) struct Registry<T, X = ()> {
    shards: [RwLock<Shard<T, X>>; SHARDS],
    next: AtomicU64,
}

struct Shard<T, X> {
    by_id: BTreeMap<u64, (Weak<T>, X)>,
    /// The id of a live `Arc`, by address (a sound key: a `Weak` in `by_id` keeps the allocation).
    by_address: BTreeMap<usize, u64>,
    sweep_at: usize,
}

impl<T, X: Clone> Registry<T, X> {
    pub(crate) const fn new() -> Self {
        Self {
            shards: [const {
                RwLock::new(Shard {
                    by_id: BTreeMap::new(),
                    by_address: BTreeMap::new(),
                    sweep_at: FIRST_SWEEP,
                })
            }; SHARDS],
            next: AtomicU64::new(1),
        }
    }

    /// The id of `value` and its payload, registering it (with the payload `payload` makes) if it
    /// has none yet.
    pub(crate) fn register(&self, value: &Arc<T>, payload: impl FnOnce() -> X) -> (u64, X) {
        let address = Arc::as_ptr(value) as usize;
        // The shard of an allocation: its address, mixed.
        let index = shards::of_hash(shards::hash_address(address), SHARDS);
        {
            let shard = self.shards[index].read();
            if let Some(found) = shard.known(address) {
                return found;
            }
        }
        let payload = payload();
        let mut shard = self.shards[index].write();
        if let Some(found) = shard.known(address) {
            return found;
        }
        let swept = (shard.by_id.len() >= shard.sweep_at).then(|| shard.sweep());
        let id = (self.next.fetch_add(1, Ordering::Relaxed) << SHARD_BITS) | index as u64;
        shard
            .by_id
            .insert(id, (Arc::downgrade(value), payload.clone()));
        shard.by_address.insert(address, id);
        drop(shard);
        // After the lock: a payload's drop may call the driver (a context's last fence pool).
        drop(swept);
        (id, payload)
    }

    pub(crate) fn get(&self, id: u64) -> Option<(Arc<T>, X)> {
        let shard = self.shards[shard_of_id(id)].read();
        let (weak, payload) = shard.by_id.get(&id)?;
        Some((weak.upgrade()?, payload.clone()))
    }

    pub(crate) fn remove(&self, id: u64) {
        let mut shard = self.shards[shard_of_id(id)].write();
        let removed = shard.by_id.remove(&id);
        if let Some((weak, _)) = &removed {
            shard.by_address.remove(&(weak.as_ptr() as usize));
        }
        drop(shard);
        // After the lock, as in `register`.
        drop(removed);
    }
}

/// The shard of an id: ids are handed out in turn, so their low bits spread.
fn shard_of_id(id: u64) -> usize {
    shards::of_hash(id, SHARDS)
}

impl<T, X: Clone> Shard<T, X> {
    /// The id and payload of the live value at `address`, if registered.
    fn known(&self, address: usize) -> Option<(u64, X)> {
        let id = *self.by_address.get(&address)?;
        let (weak, payload) = self.by_id.get(&id)?;
        // A dead entry at this address is an old value's: not this one.
        (weak.strong_count() > 0).then(|| (id, payload.clone()))
    }

    /// Take out the entries whose value is gone, for the caller to drop after the lock.
    fn sweep(&mut self) -> Vec<(Weak<T>, X)> {
        let (by_id, mut swept) = (&mut self.by_id, Vec::new());
        // Every entry has one in the address map, so each is visited; the live stay in place.
        self.by_address.retain(|_, id| {
            let gone = matches!(by_id.get(id), Some((weak, _)) if weak.strong_count() == 0);
            swept.extend(gone.then(|| by_id.remove(id)).flatten());
            !gone
        });
        self.sweep_at = (self.by_id.len() * 2).max(FIRST_SWEEP);
        swept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handle_to_a_dropped_value_finds_nothing() {
        let registry = Registry::<i32, &str>::new();
        let value = Arc::new(5);
        let (id, payload) = registry.register(&value, || "made once");
        assert_eq!(payload, "made once");
        assert_eq!(
            registry.get(id).map(|(v, p)| (*v, p)),
            Some((5, "made once"))
        );
        let again = registry.register(&value, || unreachable!("already known"));
        assert_eq!(again, (id, "made once"), "same Arc, same id and payload");
        drop(value);
        assert!(registry.get(id).is_none());
    }

    #[test]
    fn dead_entries_are_swept_and_ids_never_reused() {
        let registry = Registry::<usize>::new();
        let mut ids = Vec::new();
        for i in 0..(FIRST_SWEEP * SHARDS * 4) {
            let value = Arc::new(i);
            ids.push(registry.register(&value, || ()).0);
        }
        let keep = Arc::new(usize::MAX);
        let (kept, ()) = registry.register(&keep, || ());
        for shard in &registry.shards {
            let len = shard.read().by_id.len();
            assert!(len <= FIRST_SWEEP, "dead entries were swept, {len} left");
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            FIRST_SWEEP * SHARDS * 4,
            "every registration got a new id"
        );
        assert!(ids.iter().all(|id| registry.get(*id).is_none()));
        assert_eq!(registry.get(kept).map(|(v, ())| *v), Some(usize::MAX));
        registry.remove(kept);
        assert!(registry.get(kept).is_none());
    }

    #[test]
    fn values_spread_over_the_shards() {
        // Of a size the other tests here do not register: their frees, shard by shard, would hand
        // back addresses that fall in few shards.
        let registry = Registry::<[u8; 200]>::new();
        let values: Vec<_> = (0..=255u8).map(|i| Arc::new([i; 200])).collect();
        let mut used = [false; SHARDS];
        for value in &values {
            let (id, ()) = registry.register(value, || ());
            used[shard_of_id(id)] = true;
        }
        assert!(used.iter().filter(|used| **used).count() > SHARDS / 2);
    }

    /// A payload whose last drop checks, from another thread, that no shard of [`PROBED`] is
    /// locked (a payload's drop may call the driver), counting the drops that found one locked.
    #[derive(Clone)]
    struct Probe(#[allow(dead_code)] Arc<LastDrop>);

    struct LastDrop;

    static PROBED: Registry<u32, Probe> = Registry::new();
    static DROPPED: AtomicU64 = AtomicU64::new(0);
    static UNDER_A_LOCK: AtomicU64 = AtomicU64::new(0);

    impl Drop for LastDrop {
        fn drop(&mut self) {
            DROPPED.fetch_add(1, Ordering::Relaxed);
            if UNDER_A_LOCK.load(Ordering::Relaxed) > 0 {
                // Found once: the test fails without waiting out each later drop.
                return;
            }
            let (done, finished) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for shard in &PROBED.shards {
                    drop(shard.read());
                }
                let _ = done.send(());
            });
            let timeout = std::time::Duration::from_secs(5);
            if finished.recv_timeout(timeout).is_err() {
                UNDER_A_LOCK.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn payloads_swept_or_removed_are_dropped_after_the_lock() {
        let probe = || Probe(Arc::new(LastDrop));
        for i in 0..(FIRST_SWEEP * SHARDS * 2) as u32 {
            let value = Arc::new(i);
            PROBED.register(&value, probe);
        }
        let kept = Arc::new(u32::MAX);
        let (id, _) = PROBED.register(&kept, probe);
        PROBED.remove(id);
        assert!(DROPPED.load(Ordering::Relaxed) > 1, "entries were swept");
        assert_eq!(
            UNDER_A_LOCK.load(Ordering::Relaxed),
            0,
            "dropped under a lock"
        );
    }

    /// Every shard's two maps name the same entries (no address left behind).
    fn addresses_match_entries<T, X>(registry: &Registry<T, X>) {
        for shard in &registry.shards {
            let shard = shard.read();
            assert_eq!(
                shard.by_address.len(),
                shard.by_id.len(),
                "addresses left behind"
            );
        }
    }

    #[test]
    fn sweeps_keep_live_values_and_wait_for_twice_what_survived() {
        // Values of a size no other test registers, freed in the order they were
        // made: freed shard by shard, reused addresses would fall in few shards.
        let values: Vec<_> = (0..FIRST_SWEEP * SHARDS * 4)
            .map(|i| Arc::new([i; 4]))
            .collect();
        // Live values, each held by one `Arc`: swept past, never out.
        let registry = Registry::<[usize; 4]>::new();
        let ids: Vec<_> = values
            .iter()
            .map(|v| registry.register(v, || ()).0)
            .collect();
        for (value, id) in values.iter().zip(&ids) {
            assert_eq!(registry.get(*id).map(|(v, ())| *v), Some(**value));
        }
        for shard in &registry.shards {
            let shard = shard.read();
            let (len, sweep_at) = (shard.by_id.len(), shard.sweep_at);
            assert!(
                len <= sweep_at,
                "{len} entries past the next sweep at {sweep_at}"
            );
        }
        // Dead values only: each sweep leaves none, and the next waits for the floor.
        let registry = Registry::<[usize; 4]>::new();
        for i in 0..(FIRST_SWEEP * SHARDS * 4) {
            registry.register(&Arc::new([i; 4]), || ());
        }
        for shard in &registry.shards {
            assert_eq!(shard.read().sweep_at, FIRST_SWEEP);
        }
        addresses_match_entries(&registry);
    }

    #[test]
    fn a_removed_value_leaves_no_address_behind() {
        let registry = Registry::<u32>::new();
        let values: Vec<_> = (0..64).map(Arc::new).collect();
        for value in &values {
            let (id, ()) = registry.register(value, || ());
            registry.remove(id);
        }
        addresses_match_entries(&registry);
        assert!(registry
            .shards
            .iter()
            .all(|shard| shard.read().by_id.is_empty()));
    }

    /// A lookup, or registering a known value, takes a shard's read lock only: it
    /// goes on while another thread reads every shard.
    #[test]
    fn a_lookup_and_a_known_registration_only_read() {
        let registry = Registry::<u32>::new();
        let value = Arc::new(1);
        let (id, ()) = registry.register(&value, || ());
        let readers: Vec<_> = registry.shards.iter().map(|shard| shard.read()).collect();
        std::thread::scope(|scope| {
            let (done, finished) = std::sync::mpsc::channel();
            let (registry, value) = (&registry, &value);
            scope.spawn(move || {
                let found = registry.get(id).is_some();
                let again = registry.register(value, || unreachable!("known")).0;
                let _ = done.send((found, again));
            });
            let answer = finished.recv_timeout(std::time::Duration::from_secs(20));
            drop(readers);
            assert_eq!(answer, Ok((true, id)), "blocked behind the readers");
        });
    }

    /// Two registrations of one value that race (both make a payload) agree on
    /// one id and payload: the later writer looks again under the lock.
    #[test]
    fn registrations_racing_for_one_value_agree_on_its_id() {
        use std::sync::mpsc;
        use std::time::Duration;
        let registry = Registry::<u32, &str>::new();
        let value = Arc::new(7);
        let (making, made) = mpsc::channel();
        let (go_on, resume) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let (registry, value) = (&registry, &value);
            let late = scope.spawn(move || {
                registry.register(value, move || {
                    let _ = making.send(());
                    // Until the other registration is in.
                    let _ = resume.recv_timeout(Duration::from_secs(20));
                    "late"
                })
            });
            made.recv_timeout(Duration::from_secs(20)).unwrap();
            let first = registry.register(value, || "first");
            let _ = go_on.send(());
            assert_eq!(late.join().unwrap(), first);
        });
        addresses_match_entries(&registry);
    }

    static MADE_IN: Registry<u32> = Registry::new();

    /// A payload is made with no shard locked (making one may call the driver).
    #[test]
    fn a_payload_is_made_with_no_shard_locked() {
        let value = Arc::new(3);
        MADE_IN.register(&value, || {
            let (done, finished) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for shard in &MADE_IN.shards {
                    drop(shard.read());
                }
                let _ = done.send(());
            });
            let unlocked = finished.recv_timeout(std::time::Duration::from_secs(20));
            assert!(unlocked.is_ok(), "made under a shard's lock");
        });
    }
}
