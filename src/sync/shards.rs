//! How the crate spreads state over locks: by a key's hash (the waiter's lanes, the stream
//! registry), or by the calling thread (pools of idle events).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Which of `shards` (a power of two) a well-mixed `hash` falls in: its low bits.
pub(crate) fn of_hash(hash: u64, shards: usize) -> usize {
    debug_assert!(shards.is_power_of_two());
    (hash as usize) & (shards - 1)
}

/// A well-mixed hash of an allocation's address: the alignment bits dropped, then Fibonacci
/// hashing, whose high bits are the mixed ones.
pub(crate) fn hash_address(address: usize) -> u64 {
    ((address as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 32
}

/// The calling thread's shard among `shards` (a power of two), in the order threads first ask, so
/// a few threads each get their own.
pub(crate) fn home(shards: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static ORDINAL: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    debug_assert!(shards.is_power_of_two());
    // During the thread's exit the ordinal may be gone: any shard will do.
    ORDINAL.try_with(|ordinal| *ordinal).unwrap_or(0) & (shards - 1)
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use super::*;

    /// Same-sized allocations made one after another, as an allocator lays them out: the elements
    /// of one allocation, so other tests' allocations in between cannot change the spacing.
    #[test]
    fn nearby_allocations_spread_over_the_shards() {
        fn shards_used<const SIZE: usize>() -> [bool; 16] {
            let run = vec![[0u8; SIZE]; 256];
            let mut used = [false; 16];
            for item in &run {
                used[of_hash(hash_address(item.as_ptr() as usize), 16)] = true;
            }
            used
        }
        for used in [
            shards_used::<64>(),
            shards_used::<80>(),
            shards_used::<128>(),
        ] {
            assert!(used.iter().all(|&used| used), "{used:?}");
        }
    }

    #[test]
    fn threads_get_different_home_shards() {
        let homes: Vec<usize> = (0..16)
            .map(|_| std::thread::spawn(|| home(8)).join().unwrap())
            .collect();
        assert!(homes.iter().all(|&home| home < 8), "{homes:?}");
        assert!((0..64).all(|_| home(1) == 0), "one shard: always it");
        let mut distinct = homes.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 1, "{homes:?}");
    }

    #[test]
    fn a_thread_keeps_its_home() {
        let home_of_8 = home(8);
        assert!(
            (0..64).all(|_| home(8) == home_of_8),
            "one thread, one home"
        );
        assert_eq!(
            home(2),
            home_of_8 & 1,
            "the same ordinal, whatever the shards"
        );
    }

    /// Threads that first ask one after another take the next ordinals, each
    /// wrapped to its shards: past the first few threads, two shards both serve.
    #[test]
    fn later_threads_wrap_around_the_shards() {
        let first_ask = || std::thread::spawn(|| home(2)).join().unwrap();
        for _ in 0..8 {
            first_ask();
        }
        let homes: Vec<usize> = (0..16).map(|_| first_ask()).collect();
        assert!(homes.contains(&0) && homes.contains(&1), "{homes:?}");
    }
}
