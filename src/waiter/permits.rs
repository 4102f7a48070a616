//! [`Permits`]: how many lane threads may query their batches at once.
//!
//! A lane thread sleeps in the driver while it blocks, which costs nothing;
//! querying the batch it takes afterwards is CPU work. When many streams
//! finish together (a burst of thousands of awaits on 64 streams), 64 lane
//! threads at once on a machine with a few cores crowd out the executor's
//! own threads, which must run the woken tasks: such a burst resolved
//! sooner with one querying thread per core than with one per lane
//! (`cargo bench --bench waiters`, the burst scenarios). So at most one
//! querying thread per core: the rest wait for a permit, asleep.
//!
//! The permit covers the queries only, never the wakes that follow: a waker
//! may run its task inline, and a task that then blocks would hold a permit
//! every other lane needs.

use crate::loom::{Condvar, Mutex};

pub(crate) struct Permits {
    /// Permits free now.
    free: Mutex<usize>,
    returned: Condvar,
}

/// A permit, given back when dropped (even by a panic).
pub(crate) struct Permit<'a> {
    permits: &'a Permits,
}

impl Permits {
    pub(crate) fn new(count: usize) -> Self {
        Self {
            free: Mutex::new(count.max(1)),
            returned: Condvar::new(),
        }
    }

    /// Take a permit, sleeping until one is free.
    pub(crate) fn acquire(&self) -> Permit<'_> {
        let mut free = self.free.lock();
        while *free == 0 {
            free = self.returned.wait(free);
        }
        *free -= 1;
        Permit { permits: self }
    }

    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        *self.free.lock()
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *self.permits.free.lock() += 1;
        self.permits.returned.notify_one();
    }
}
