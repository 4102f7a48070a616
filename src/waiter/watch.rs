//! Watching a stream's progress word: how a lane thread learns that its held wait's work ended
//! within microseconds, at close to the CPU of a thread asleep in the driver.
//!
//! A lane thread whose stream keeps a [`ProgressWord`] predicts when the wait it holds will end,
//! from how long the lane's recent waits took (the least of the last few, as the stream's items
//! keep their length from one to the next), sleeps until shortly before that (earlier by the
//! most its recent sleeps overslept, and a margin), and then spins on the word: a memory load,
//! no driver call. It spins only while one of the waiter's
//! [`Watchers`] turns is free, and at most a bounded window; then it blocks in the driver, as a
//! thread without a word always does. A lane with no history yet watches the short
//! [`FIRST_WINDOW`] at once. A wake that finds the word already passed came late: the margin
//! before the predicted end doubles; each wake in time shrinks it by an eighth.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::loom::AtomicUsize;
use crate::ProgressWord;

/// How long a lane with no history spins on its word before it blocks.
pub(crate) const FIRST_WINDOW: Duration = Duration::from_micros(50);
/// The least margin before a predicted end, beyond how late sleeps have lately ended.
const MIN_MARGIN: Duration = Duration::from_micros(5);
/// A sleep shorter than this is spun instead (a wake-up costs about this much).
const MIN_NAP: Duration = Duration::from_micros(20);
/// Looks at the word with a pause between them before a watcher yields between looks instead.
const SPIN_LOOKS: u32 = 64;
/// How many recent waits a prediction looks at.
const HISTORY: usize = 4;

/// The waiter-wide budget of threads that spin on words at once.
#[derive(Debug)]
pub(super) struct Watchers {
    max: usize,
    now: AtomicUsize,
}

/// A turn to spin, given back on drop.
pub(super) struct Turn<'a>(&'a AtomicUsize);

impl Watchers {
    pub(super) fn new(max: usize) -> Self {
        Self {
            max,
            now: AtomicUsize::new(0),
        }
    }

    /// A turn to spin, if fewer than the most allowed are spinning.
    fn turn(&self) -> Option<Turn<'_>> {
        let taken = self
            .now
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now < self.max).then_some(now + 1)
            });
        taken.ok().map(|_| Turn(&self.now))
    }

    /// Whether every turn is taken now.
    fn all_taken(&self) -> bool {
        self.now.load(Ordering::Relaxed) >= self.max
    }

    /// Threads spinning now.
    #[cfg(test)]
    pub(super) fn spinning(&self) -> usize {
        self.now.load(Ordering::Acquire)
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let before = self.0.fetch_sub(1, Ordering::AcqRel);
        assert!(before > 0, "a watcher's turn given back twice");
    }
}

/// The last few durations of one kind.
#[derive(Default)]
struct Recent {
    values: [Duration; HISTORY],
    seen: usize,
}

impl Recent {
    fn push(&mut self, value: Duration) {
        self.values[self.seen % HISTORY] = value;
        self.seen += 1;
    }

    fn values(&self) -> &[Duration] {
        &self.values[..self.seen.min(HISTORY)]
    }
}

/// One lane's word and recent history, kept by the lane thread that serves it.
pub(super) struct Watch {
    word: ProgressWord,
    /// How long the lane's recent waits took, from the start of their hold to their end.
    took: Recent,
    /// How late this thread's recent sleeps ended (timer slack, the scheduler, a hypervisor).
    overslept: Recent,
    /// How much earlier still it wakes, beyond the oversleep it expects.
    margin: Duration,
}

impl Watch {
    pub(super) fn new(word: ProgressWord) -> Self {
        Self {
            word,
            took: Recent::default(),
            overslept: Recent::default(),
            margin: MIN_MARGIN,
        }
    }

    /// Wait for the stream to pass point `sequence`, its hold begun at `started`: sleep until
    /// shortly before its predicted end, then spin on the word while `watchers` has a turn, for
    /// a bounded window. Whether the word passed; if not, the caller blocks in the driver, and
    /// tells [`Watch::ended`] when the wait ended.
    pub(super) fn watch(&mut self, sequence: u64, started: Instant, watchers: &Watchers) -> bool {
        if self.word.passed(sequence) {
            return true;
        }
        if watchers.all_taken() {
            // Others watch: a sleep now would most likely end in the driver all the same.
            return false;
        }
        let window = match self.predicted() {
            Some(predicted) => {
                let lead = self.lead(predicted);
                let wake = started + predicted.saturating_sub(lead);
                if let Some(overslept) = nap_until(wake) {
                    self.overslept.push(overslept);
                    if self.word.passed(sequence) {
                        self.woke(true, predicted);
                        self.ended(started.elapsed());
                        return true;
                    }
                }
                (lead * 2).max(FIRST_WINDOW)
            }
            None => FIRST_WINDOW,
        };
        let Some(_turn) = watchers.turn() else {
            return false;
        };
        let until = Instant::now() + window;
        let mut looks = 0u32;
        loop {
            if self.word.passed(sequence) {
                self.woke(false, Duration::MAX);
                self.ended(started.elapsed());
                return true;
            }
            looks = looks.wrapping_add(1);
            if window_over(until, looks) {
                return false;
            }
            spin(looks);
        }
    }

    /// The wait held since `took` ago ended (seen on the word, or by blocking).
    pub(super) fn ended(&mut self, took: Duration) {
        self.took.push(took);
    }

    /// How long before the `predicted` end a sleep is set to end: the most it overslept lately,
    /// and the margin; at most half the prediction, so that a thread that overslept badly once
    /// still sleeps (and learns how late it wakes now) rather than spin whole items.
    fn lead(&self, predicted: Duration) -> Duration {
        let overslept = self.overslept.values().iter().max().copied();
        (overslept.unwrap_or_default() + self.margin).min(predicted / 2)
    }

    /// After a wake that found the word passed: `late` (the work ended during the sleep), the
    /// margin doubles, up to a quarter of `predicted`; in time, it shrinks by an eighth, down to
    /// the least.
    fn woke(&mut self, late: bool, predicted: Duration) {
        self.margin = if late {
            (self.margin * 2).min(predicted / 4).max(MIN_MARGIN)
        } else {
            (self.margin - self.margin / 8).max(MIN_MARGIN)
        };
    }

    /// When the held wait should end, from the start of its hold: the least of the recent waits,
    /// once there are two (a lane's first wait often waited for more than one item).
    fn predicted(&self) -> Option<Duration> {
        let took = self.took.values();
        (took.len() >= 2).then(|| took.iter().copied().min().unwrap_or_default())
    }
}

/// Sleep until `wake` if that is long enough to be worth a sleep: how late it woke, if it slept.
fn nap_until(wake: Instant) -> Option<Duration> {
    let left = wake.saturating_duration_since(Instant::now());
    if left < MIN_NAP || cfg!(device_events_loom) {
        return None;
    }
    std::thread::sleep(left);
    Some(Instant::now().saturating_duration_since(wake))
}

/// Whether a spin that looked `looks` times should stop: at `until` (the clock read once in 32
/// looks); under loom, after two looks, so a model sees the word pass before, between and after.
fn window_over(until: Instant, looks: u32) -> bool {
    if cfg!(device_events_loom) {
        return looks >= 2;
    }
    looks.is_multiple_of(32) && Instant::now() >= until
}

/// Between two looks at the word: a pause, then, once it has looked a while, a yield, so that a
/// watcher on a busy machine lets the threads it would wake (an executor's) run meanwhile.
fn spin(looks: u32) {
    #[cfg(device_events_loom)]
    crate::loom::thread::yield_now();
    if looks < SPIN_LOOKS {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

#[cfg(all(test, not(device_events_loom)))]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{Watch, Watchers, FIRST_WINDOW, MIN_MARGIN};
    use crate::progress_word::HostWord;
    use crate::ProgressWord;

    fn watch() -> (Watch, Arc<HostWord>) {
        let memory = Arc::new(HostWord::default());
        (Watch::new(ProgressWord::new(memory.clone())), memory)
    }

    #[test]
    fn no_more_threads_spin_than_the_budget_allows() {
        let watchers = Watchers::new(2);
        let (first, second) = (watchers.turn(), watchers.turn());
        assert!(first.is_some() && second.is_some());
        assert!(watchers.turn().is_none(), "a third is refused");
        drop(first);
        assert_eq!(watchers.spinning(), 1);
        assert!(
            watchers.turn().is_some(),
            "a turn given back is taken again"
        );
        assert!(Watchers::new(0).turn().is_none());
    }

    #[test]
    fn a_prediction_needs_two_waits_and_takes_the_shortest_of_the_last_four() {
        let (mut watch, _) = watch();
        assert_eq!(watch.predicted(), None, "no history");
        // A lane's first wait often waited out a hold: one is not enough.
        watch.ended(Duration::from_millis(300));
        assert_eq!(watch.predicted(), None);
        watch.ended(Duration::from_micros(900));
        assert_eq!(watch.predicted(), Some(Duration::from_micros(900)));
        for micros in [1_000, 1_100, 1_200, 1_300] {
            watch.ended(Duration::from_micros(micros));
        }
        // 900 us has left the last four.
        assert_eq!(watch.predicted(), Some(Duration::from_micros(1_000)));
    }

    #[test]
    fn a_sleep_ends_early_by_the_most_it_overslept_lately_and_the_margin_up_to_half_the_prediction()
    {
        let (mut watch, _) = watch();
        let predicted = Duration::from_millis(1);
        assert_eq!(watch.lead(predicted), MIN_MARGIN, "no sleep yet");
        for micros in [60, 40, 45, 50] {
            watch.overslept.push(Duration::from_micros(micros));
        }
        assert_eq!(
            watch.lead(predicted),
            Duration::from_micros(60) + MIN_MARGIN
        );
        watch.overslept.push(Duration::from_micros(10));
        let lead = watch.lead(predicted);
        assert_eq!(
            lead,
            Duration::from_micros(50) + MIN_MARGIN,
            "60 us is past"
        );
        watch.overslept.push(Duration::from_millis(5));
        assert_eq!(
            watch.lead(predicted),
            predicted / 2,
            "at most half the prediction"
        );
    }

    #[test]
    fn a_passed_word_is_seen_at_once_and_without_a_turn() {
        let (mut watch, word) = watch();
        word.advance(4);
        let none = Watchers::new(0);
        assert!(watch.watch(4, Instant::now(), &none));
        assert!(!watch.watch(5, Instant::now(), &none), "no turn: no spin");
    }

    #[test]
    fn a_stream_with_no_history_is_watched_for_the_first_window_only() {
        let (mut watch, _) = watch();
        let watchers = Watchers::new(1);
        let started = Instant::now();
        assert!(!watch.watch(0, started, &watchers));
        assert!(started.elapsed() >= FIRST_WINDOW);
        assert_eq!(watchers.spinning(), 0);
    }

    #[test]
    fn a_late_wake_doubles_the_margin_up_to_a_quarter_of_the_prediction_and_one_in_time_shrinks_it()
    {
        let (mut watch, _) = watch();
        let predicted = Duration::from_micros(200);
        watch.woke(true, predicted);
        assert_eq!(watch.margin, MIN_MARGIN * 2);
        for _ in 0..8 {
            watch.woke(true, predicted);
        }
        assert_eq!(
            watch.margin,
            predicted / 4,
            "never past a quarter of the prediction"
        );
        watch.woke(false, predicted);
        let quarter = predicted / 4;
        assert_eq!(watch.margin, quarter - quarter / 8);
        for _ in 0..100 {
            watch.woke(false, predicted);
        }
        assert_eq!(watch.margin, MIN_MARGIN, "never under the least");
    }
}
