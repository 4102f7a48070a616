//! [`IdlePool`]: idle items (events) kept for reuse, bounded, over one or more locks: the CUDA
//! and host fence-event pools.

use crate::sync::Mutex;

/// The most room a shard is made with: a pool asked to keep more grows past it.
const PREALLOCATED: usize = 1024;

/// Up to a capacity of idle items, spread over `SHARDS` shards (a power of two) that each hold an
/// equal share. A thread takes from its home shard ([`crate::sync::shards::home`]) first, then
/// from the others, and gives back to the shard it took from; a full shard hands the item back
/// rather than lock another (a burst beyond the capacity would lock every shard each time).
pub(crate) struct IdlePool<T, const SHARDS: usize> {
    shards: [Mutex<Vec<T>>; SHARDS],
    shard_capacity: usize,
}

impl<T, const SHARDS: usize> IdlePool<T, SHARDS> {
    /// Room for `capacity` idle items. Each shard is made with room for its share (up to
    /// [`PREALLOCATED`]): a `Vec` growing in a burst made the allocator consolidate, measurably.
    pub(crate) fn new(capacity: usize) -> Self {
        const { assert!(SHARDS.is_power_of_two(), "shards are a power of two") };
        let shard_capacity = capacity.div_ceil(SHARDS);
        Self {
            shards: std::array::from_fn(|_| {
                Mutex::new(Vec::with_capacity(shard_capacity.min(PREALLOCATED)))
            }),
            shard_capacity,
        }
    }

    /// An idle item from `shard`, else from another. `counted` is told the length of the shard it
    /// came from, under that shard's lock (a gauge kept in step).
    pub(crate) fn take(&self, shard: usize, counted: impl Fn(usize)) -> Option<T> {
        (0..SHARDS).find_map(|step| {
            let mut idle = self.shards[(shard + step) & (SHARDS - 1)].lock();
            let item = idle.pop()?;
            counted(idle.len());
            Some(item)
        })
    }

    /// Keep `item` in `shard`, or hand it back when that shard is full; `counted` as in `take`.
    pub(crate) fn give_back(
        &self,
        shard: usize,
        item: T,
        counted: impl FnOnce(usize),
    ) -> Result<(), T> {
        let mut idle = self.shards[shard].lock();
        if idle.len() >= self.shard_capacity {
            return Err(item);
        }
        idle.push(item);
        counted(idle.len());
        Ok(())
    }

    /// Every idle item, taken out; `counted` is told each emptied shard's new length (zero).
    pub(crate) fn take_all(&self, counted: impl Fn(usize)) -> Vec<T> {
        let mut all = Vec::new();
        for shard in &self.shards {
            let mut idle = shard.lock();
            all.append(&mut idle);
            counted(0);
        }
        all
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use super::*;

    /// Idle items now, over all shards.
    fn len<T, const SHARDS: usize>(pool: &IdlePool<T, SHARDS>) -> usize {
        pool.shards.iter().map(|shard| shard.lock().len()).sum()
    }

    #[test]
    fn a_full_shard_hands_back_and_a_take_finds_other_shards() {
        let pool = IdlePool::<_, 2>::new(4);
        assert_eq!(pool.give_back(0, 1, |_| {}), Ok(()));
        assert_eq!(pool.give_back(0, 2, |_| {}), Ok(()));
        assert_eq!(pool.give_back(0, 3, |_| {}), Err(3));
        assert_eq!(len(&pool), 2);
        assert_eq!(pool.take(1, |_| {}), Some(2));
        assert_eq!(pool.take(1, |_| {}), Some(1));
        assert_eq!(pool.take(1, |_| {}), None);
        // From shard 0 too, whichever shard holds the item.
        assert_eq!(pool.give_back(1, 4, |_| {}), Ok(()));
        assert_eq!(pool.take(0, |_| {}), Some(4));
    }

    #[test]
    fn a_pool_of_no_capacity_keeps_nothing() {
        let pool = IdlePool::<_, 1>::new(0);
        assert_eq!(pool.give_back(0, 1, |_| {}), Err(1));
    }

    #[test]
    fn the_gauge_follows_each_shard_under_its_lock() {
        let pool = IdlePool::<_, 1>::new(4);
        let seen = std::cell::Cell::new(usize::MAX);
        pool.give_back(0, 'a', |len| seen.set(len)).unwrap();
        pool.give_back(0, 'b', |len| seen.set(len)).unwrap();
        assert_eq!(seen.get(), 2);
        pool.take(0, |len| seen.set(len));
        assert_eq!(seen.get(), 1);
        assert_eq!(pool.take_all(|len| seen.set(len)), ['a']);
        assert_eq!(seen.get(), 0);
    }

    #[test]
    fn a_thread_takes_from_and_gives_back_to_its_own_shard_first() {
        let pool = IdlePool::<_, 2>::new(4);
        assert_eq!(pool.give_back(0, 'a', |_| {}), Ok(()));
        assert_eq!(pool.give_back(1, 'b', |_| {}), Ok(()));
        assert_eq!(pool.give_back(1, 'c', |_| {}), Ok(()));
        assert_eq!(
            pool.give_back(1, 'd', |_| {}),
            Err('d'),
            "shard 1 is full, whatever room shard 0 has"
        );
        assert_eq!(pool.take(1, |_| {}), Some('c'), "its own shard first");
        assert_eq!(pool.take(0, |_| {}), Some('a'));
        assert_eq!(pool.take(0, |_| {}), Some('b'), "then another's");
    }

    #[test]
    fn each_shard_has_room_for_its_share_rounded_up_and_past_the_preallocated() {
        // 5 over 2 shards: room for 3 in each, so 5 fit however they spread.
        let pool = IdlePool::<_, 2>::new(5);
        for item in 0..3 {
            assert_eq!(pool.give_back(0, item, |_| {}), Ok(()));
        }
        assert_eq!(pool.give_back(0, 3, |_| {}), Err(3));
        // Fewer items than shards: each shard still keeps one.
        let pool = IdlePool::<_, 8>::new(1);
        assert_eq!(pool.give_back(7, 'a', |_| {}), Ok(()));
        // More than a shard is made with room for: it grows.
        let pool = IdlePool::<_, 1>::new(PREALLOCATED + 1);
        for item in 0..=PREALLOCATED {
            assert_eq!(pool.give_back(0, item, |_| {}), Ok(()));
        }
        assert_eq!(pool.give_back(0, usize::MAX, |_| {}), Err(usize::MAX));
        assert_eq!(len(&pool), PREALLOCATED + 1);
    }

    /// `counted` runs while the shard is locked: a thread that locks the shard
    /// meanwhile (here, to count the pool) gets it only once `counted` returned.
    #[test]
    fn the_gauge_is_told_before_the_shard_is_let_go() {
        use std::sync::{mpsc, Arc};
        use std::time::Duration;
        let pool = Arc::new(IdlePool::<_, 1>::new(4));
        let locked_out = |pool: &Arc<IdlePool<char, 1>>| {
            let (counted, finished) = mpsc::channel();
            let pool = pool.clone();
            let reader = std::thread::spawn(move || {
                let _ = counted.send(len(&*pool));
            });
            let early = finished.recv_timeout(Duration::from_millis(100));
            assert!(
                early.is_err(),
                "the shard was let go before the gauge was told"
            );
            reader
        };
        let readers = std::cell::RefCell::new(Vec::new());
        pool.give_back(0, 'a', |_| readers.borrow_mut().push(locked_out(&pool)))
            .unwrap();
        pool.take(0, |_| readers.borrow_mut().push(locked_out(&pool)));
        for reader in readers.into_inner() {
            reader.join().unwrap();
        }
    }
}
