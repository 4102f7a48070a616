//! The watcher's thread: sleep until entries are nearly due, look at their words, resolve those
//! that passed, within its CPU budget.

use std::time::Duration;

use super::list::Plan;
use super::timing::{self, CpuBudget, Timing, Watched, MAX_NAP};
use crate::waiter::contain;
use crate::waiter::pool::Ended;
use crate::waiter::threads::WaiterThread;

impl WaiterThread {
    /// The watcher's loop, until idle or shut down ([module docs](crate::waiter#the-watcher)).
    pub(crate) fn run_watcher(&mut self) {
        crate::os::lower_timer_slack();
        let mut timing = Timing::default();
        let mut budget = CpuBudget::new(self.pool.now());
        let mut cpu = crate::os::thread_cpu_time();
        let mut entries = Vec::new();
        while let Some(Plan { published, first }) = self.pool.watch_round(&timing, &mut entries) {
            let mut napped = false;
            // None copied: the first is not due yet; it naps holding none (the module docs: why).
            if entries.is_empty() {
                let until = first.min(self.pool.now() + MAX_NAP);
                let slept = (self.pool).watcher_nap(until, published, &mut timing, &mut entries);
                napped = slept && until == first;
            }
            let mut looked = Duration::ZERO;
            if !entries.is_empty() {
                let started = self.pool.now();
                if budget.earn(started) {
                    self.look(&mut timing, &entries, published, napped);
                    looked = self.pool.now().saturating_duration_since(started);
                } else {
                    // Its CPU budget spent, it leaves the entries due to the driver.
                    let due = entries.iter().filter(|e| timing.look_from(e) <= started);
                    due.for_each(|entry| self.unwatch(entry, false));
                }
            }
            // Its copies of the entries go here, each maybe a fence's last.
            entries.drain(..).for_each(contain::drop);
            // The round's CPU, all of it, is spent from the budget.
            let now = crate::os::thread_cpu_time();
            let used = cpu.zip(now).map(|(before, now)| now.saturating_sub(before));
            if let Some(used) = used {
                self.pool.counters().watcher_cpu(used);
            }
            budget.spend(used.unwrap_or(looked));
            cpu = now;
        }
    }

    /// Look at the words of `entries` due until each has passed or its window ended, taking each
    /// off the list as it is decided; return when none is due (to sleep until the next is), or when
    /// entries came after the `published`th.
    fn look(&self, timing: &mut Timing, entries: &[Watched], published: usize, napped: bool) {
        let mut open: Vec<&Watched> = entries.iter().collect();
        let mut looks = 0u32;
        loop {
            let now = self.pool.now();
            let mut due = false;
            open.retain(|entry| {
                if timing.look_from(entry) > now {
                    return true;
                }
                due = true;
                if entry.passed() {
                    self.resolve_watched(entry, napped && looks == 0);
                } else if timing::past(timing.look_until(entry), looks) {
                    self.unwatch(entry, true);
                } else {
                    return true;
                }
                false
            });
            // New entries are taken in each 32 looks, not at each: a round copies them all.
            let replan = looks.is_multiple_of(32) && self.pool.published() != published;
            if !due || open.is_empty() || replan {
                return;
            }
            looks = looks.wrapping_add(1);
            timing::pause(looks);
        }
    }

    /// `entry`'s word passed (seen `late`, at the first look after a sleep): confirm with a query,
    /// and resolve its wait (with a fault too), unless its lane thread did first; a word ahead of
    /// its event leaves the wait to the driver.
    fn resolve_watched(&self, entry: &Watched, late: bool) {
        let took = self.pool.now().saturating_duration_since(entry.started);
        let result = match contain::backend(|| entry.waitable.query()) {
            Ok(false) => return self.unwatch(entry, false),
            reached => reached.map(drop),
        };
        let ok = result.is_ok();
        let seen = Ended::Seen { result, took, late };
        if self.pool.end_hold(entry.lane, &entry.slot, seen).delivered && ok {
            self.pool.counters().watched();
        }
    }

    /// Leave `entry` to its lane thread, blocked on it in the driver (a `missed` watch counts).
    fn unwatch(&self, entry: &Watched, missed: bool) {
        let _ = (self.pool).end_hold(entry.lane, &entry.slot, Ended::Unwatched { missed });
    }
}
