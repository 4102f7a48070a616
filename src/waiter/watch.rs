//! Watching streams' progress words: how a task wakes within microseconds of its work's end, at
//! close to the CPU of a thread asleep in the driver.
//!
//! A lane thread whose stream keeps a [`ProgressWord`] hands the wait it holds to the waiter's
//! **watcher** thread as a [`Watched`] entry: the word, the wait's number, and when the wait
//! should end, predicted from how long the lane's recent waits took ([`LaneWatch`]: the least of
//! the last few, as a stream's items keep their length from one to the next; none for a lane
//! with no history). It sleeps meanwhile (a [`Handback`], not the driver), and blocks in the
//! driver only if the watcher hands the wait back unresolved, or if the lane's waits are too
//! short to watch (shorter than twice how early the watcher wakes: [`Timing::early`]).
//!
//! The watcher sleeps until shortly before the earliest predicted end (earlier by the most its
//! recent sleeps overslept, and a margin: [`Timing`]), then looks at the words of every entry
//! due by then, a memory load each, no driver call, pausing and then yielding between looks. A
//! word that passed is confirmed by one query of the wait's event (a faulted stream's word
//! stops, and its event reports the fault), and the watcher resolves the wait at once, then
//! wakes its lane thread for the next. An entry is watched for a bounded window (at least
//! [`FIRST_WINDOW`]) past its predicted end, then handed back to be blocked on in the driver: a
//! stalled stream stops being watched. A wake that finds a word already passed came late: the
//! margin doubles (up to a quarter of the prediction); each end seen in time shrinks it by an
//! eighth.

use std::time::{Duration, Instant};

use super::slot::Slot;
use super::waitable::{LaneKey, Waitable};
use crate::loom::{Arc, Condvar, Mutex};
use crate::ProgressWord;

/// How long past its hand-over the watcher looks at the word of a lane with no history.
pub(super) const FIRST_WINDOW: Duration = Duration::from_micros(50);
/// The least margin before a predicted end, beyond how late sleeps have lately ended.
const MIN_MARGIN: Duration = Duration::from_micros(5);
/// A sleep shorter than this is spent looking instead.
pub(super) const MIN_NAP: Duration = Duration::from_micros(20);
/// Looks with a pause between them before the watcher yields between looks instead.
const SPIN_LOOKS: u32 = 64;
/// How many recent durations a prediction looks at.
const HISTORY: usize = 4;

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

/// A lane's progress word and how long its recent waits took, kept by the lane thread serving it.
pub(super) struct LaneWatch {
    word: ProgressWord,
    took: Recent,
}

impl LaneWatch {
    pub(super) fn new(word: ProgressWord) -> Self {
        Self {
            word,
            took: Recent::default(),
        }
    }

    /// The entry for the watcher of a wait (`waitable`'s, point `sequence`, result to `slot`)
    /// held from `started`; none if the lane's waits are shorter than twice `early`, how early
    /// the watcher wakes before an end it expects ([`Timing::early`]): it would look for most of
    /// each (serving them one after another), while the lane thread's wake-up in the driver
    /// comes about as soon.
    pub(super) fn entry(
        &self,
        (lane, sequence): (LaneKey, u64),
        slot: &Arc<Slot>,
        waitable: &std::sync::Arc<dyn Waitable>,
        started: Instant,
        early: Duration,
    ) -> Option<Watched> {
        let predicted = self.predicted();
        if predicted.is_some_and(|predicted| predicted < early * 2) {
            return None;
        }
        let predicted = predicted.unwrap_or_default();
        Some(Watched {
            lane,
            slot: slot.clone(),
            waitable: waitable.clone(),
            word: self.word.clone(),
            sequence,
            due: started + predicted,
            predicted,
            handback: Arc::default(),
        })
    }

    /// The wait held from the start of `took` ended (seen by the watcher, or by blocking).
    pub(super) fn ended(&mut self, took: Duration) {
        self.took.push(took);
    }

    /// How long a wait should take from the start of its hold: the least of the recent waits,
    /// once there are two (a lane's first wait often waited for more than one item).
    fn predicted(&self) -> Option<Duration> {
        let took = self.took.values();
        (took.len() >= 2).then(|| took.iter().copied().min().unwrap_or_default())
    }
}

/// A held wait handed to the watcher; its lane thread sleeps on the `handback` meanwhile.
#[derive(Clone)]
pub(super) struct Watched {
    pub(super) lane: LaneKey,
    pub(super) slot: Arc<Slot>,
    pub(super) waitable: std::sync::Arc<dyn Waitable>,
    word: ProgressWord,
    sequence: u64,
    /// When it should end: `predicted` after its hold began (zero: no history).
    due: Instant,
    predicted: Duration,
    pub(super) handback: Arc<Handback>,
}

impl Watched {
    /// Whether the stream has passed the wait's point.
    pub(super) fn passed(&self) -> bool {
        self.word.passed(self.sequence)
    }
}

/// What the watcher made of a wait it was handed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Its word passed at this time, and the watcher resolved it (with the event's answer).
    Resolved(Instant),
    /// Left to the driver: its window ended, its word ran ahead of its event, or the watcher
    /// stopped.
    Driver,
}

/// Where a lane thread sleeps while the watcher has its wait, until it gives the [`Verdict`].
#[derive(Default)]
pub(super) struct Handback {
    verdict: Mutex<Option<Verdict>>,
    given: Condvar,
}

impl Handback {
    /// Give the lane thread its verdict (the first stands) and wake it.
    pub(super) fn give(&self, verdict: Verdict) {
        self.verdict.lock().get_or_insert(verdict);
        self.given.notify_one();
    }

    /// Sleep until the verdict is given.
    pub(super) fn wait(&self) -> Verdict {
        let mut verdict = self.verdict.lock();
        loop {
            if let Some(verdict) = *verdict {
                return verdict;
            }
            verdict = self.given.wait(verdict);
        }
    }
}

/// The watcher's timing: how late its sleeps end, and the margin it keeps beyond that.
pub(super) struct Timing {
    overslept: Recent,
    margin: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            overslept: Recent::default(),
            margin: MIN_MARGIN,
        }
    }
}

impl Timing {
    /// How early before an end it expects the watcher wakes, at the least: the least its
    /// recent sleeps overslept, and the margin. Waits shorter than twice that are not worth
    /// watching (`LaneWatch::entry`).
    pub(super) fn early(&self) -> Duration {
        let overslept = self.overslept.values().iter().min().copied();
        overslept.unwrap_or_default() + self.margin
    }

    /// How long before its predicted end to look at `entry`'s word: the most the watcher's
    /// sleeps overslept lately, and the margin; at most half the prediction, so that a watcher
    /// that overslept badly once still sleeps (and learns how late it wakes now).
    fn lead(&self, entry: &Watched) -> Duration {
        let overslept = self.overslept.values().iter().max().copied();
        (overslept.unwrap_or_default() + self.margin).min(entry.predicted / 2)
    }

    /// From when to look at `entry`'s word.
    pub(super) fn look_from(&self, entry: &Watched) -> Instant {
        entry.due - self.lead(entry)
    }

    /// Until when to look at `entry`'s word before leaving it to the driver.
    pub(super) fn look_until(&self, entry: &Watched) -> Instant {
        entry.due + (self.lead(entry) * 2).max(FIRST_WINDOW)
    }

    /// A sleep meant to end at some time ended `late` after it.
    pub(super) fn overslept(&mut self, late: Duration) {
        self.overslept.push(late);
    }

    /// `entry`'s word was seen passed: at the first look after a sleep (`late`: the work ended
    /// during the sleep), the margin doubles, up to a quarter of the prediction; later, it
    /// shrinks by an eighth, down to the least.
    pub(super) fn seen(&mut self, entry: &Watched, late: bool) {
        self.margin = if late {
            (self.margin * 2).min(entry.predicted / 4).max(MIN_MARGIN)
        } else {
            (self.margin - self.margin / 8).max(MIN_MARGIN)
        };
    }
}

/// Whether a watch that has looked `looks` times is past `until` (the clock read once in 32
/// looks); under loom, after two looks, so a model sees the word pass before, between and after.
pub(super) fn past(until: Instant, looks: u32) -> bool {
    if cfg!(device_events_loom) {
        return looks >= 2;
    }
    looks.is_multiple_of(32) && Instant::now() >= until
}

/// Between two looks at the words: a pause, then, once it has looked a while, a yield, so that a
/// watcher on a busy machine lets the threads it wakes (an executor's) run meanwhile.
pub(super) fn pause(looks: u32) {
    #[cfg(device_events_loom)]
    crate::loom::thread::yield_now();
    if looks < SPIN_LOOKS {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

#[cfg(test)]
#[cfg(not(device_events_loom))]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{
        past, LaneKey, LaneWatch, Slot, Timing, Waitable, Watched, FIRST_WINDOW, MIN_MARGIN,
    };
    use crate::progress_word::HostWord;
    use crate::{ProgressWord, ServerError};

    /// A fence no test here waits on.
    struct Unused;

    impl Waitable for Unused {
        fn lane(&self) -> LaneKey {
            unreachable!()
        }
        fn sequence(&self) -> u64 {
            3
        }
        fn query(&self) -> Result<bool, ServerError> {
            unreachable!()
        }
        fn block(&self) -> Result<(), ServerError> {
            unreachable!()
        }
        fn stream_name(&self) -> String {
            unreachable!()
        }
        fn progress(&self) -> Option<ProgressWord> {
            None
        }
    }

    fn lane_watch() -> (LaneWatch, Arc<HostWord>) {
        let memory = Arc::new(HostWord::default());
        (LaneWatch::new(ProgressWord::new(memory.clone())), memory)
    }

    fn entry(watch: &LaneWatch, started: Instant) -> Watched {
        let slot = Arc::new(Slot::new(futures::task::noop_waker()));
        let fence: Arc<dyn Waitable> = Arc::new(Unused);
        watch
            .entry(
                (LaneKey::for_tests(0), 3),
                &slot,
                &fence,
                started,
                Duration::ZERO,
            )
            .expect("watched")
    }

    #[test]
    fn a_handback_keeps_the_first_verdict_given_before_or_after_the_wait() {
        let handback = super::Handback::default();
        let seen = Instant::now();
        handback.give(super::Verdict::Resolved(seen));
        handback.give(super::Verdict::Driver);
        assert_eq!(handback.wait(), super::Verdict::Resolved(seen));
        let handback = Arc::new(super::Handback::default());
        let giver = std::thread::spawn({
            let handback = handback.clone();
            move || handback.give(super::Verdict::Driver)
        });
        assert_eq!(handback.wait(), super::Verdict::Driver);
        giver.join().unwrap();
    }

    #[test]
    fn a_prediction_needs_two_waits_and_takes_the_shortest_of_the_last_four() {
        let (mut watch, _) = lane_watch();
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
    fn an_entry_is_due_its_prediction_after_its_hold_began_and_reads_its_word() {
        let (mut watch, word) = lane_watch();
        let started = Instant::now();
        let first = entry(&watch, started);
        assert_eq!(first.due, started, "no history: due at once");
        assert!(!first.passed());
        word.advance(3);
        assert!(first.passed());
        watch.ended(Duration::from_micros(400));
        watch.ended(Duration::from_micros(500));
        let later = entry(&watch, started);
        assert_eq!(later.due, started + Duration::from_micros(400));
        assert_eq!(later.predicted, Duration::from_micros(400));
        // Waits shorter than twice how early the watcher wakes are not watched.
        let slot = Arc::new(Slot::new(futures::task::noop_waker()));
        let fence: Arc<dyn Waitable> = Arc::new(Unused);
        let early = Duration::from_micros(200);
        assert!(watch
            .entry((LaneKey::for_tests(0), 3), &slot, &fence, started, early)
            .is_some());
        let early = Duration::from_micros(201);
        assert!(watch
            .entry((LaneKey::for_tests(0), 3), &slot, &fence, started, early)
            .is_none());
    }

    #[test]
    fn the_watcher_looks_early_by_the_most_it_overslept_lately_and_the_margin() {
        let (mut watch, _) = lane_watch();
        let started = Instant::now();
        let lone = entry(&watch, started);
        let mut timing = Timing::default();
        assert_eq!(timing.look_from(&lone), started, "no history: at once");
        assert_eq!(timing.look_until(&lone), started + FIRST_WINDOW);
        watch.ended(Duration::from_millis(1));
        watch.ended(Duration::from_millis(1));
        let entry = entry(&watch, started);
        let due = started + Duration::from_millis(1);
        assert_eq!(timing.look_from(&entry), due - MIN_MARGIN, "no sleep yet");
        for micros in [60, 40, 45, 50] {
            timing.overslept(Duration::from_micros(micros));
        }
        let lead = Duration::from_micros(60) + MIN_MARGIN;
        assert_eq!(timing.look_from(&entry), due - lead);
        assert_eq!(timing.look_until(&entry), due + lead * 2);
        timing.overslept(Duration::from_micros(10));
        let lead = Duration::from_micros(50) + MIN_MARGIN;
        assert_eq!(timing.look_from(&entry), due - lead, "60 us is past");
        timing.overslept(Duration::from_millis(5));
        let half = Duration::from_micros(500);
        assert_eq!(timing.look_from(&entry), due - half, "at most half");
    }

    #[test]
    fn a_late_wake_doubles_the_margin_up_to_a_quarter_of_the_prediction_and_one_in_time_shrinks_it()
    {
        let (mut watch, _) = lane_watch();
        watch.ended(Duration::from_micros(200));
        watch.ended(Duration::from_micros(200));
        let entry = entry(&watch, Instant::now());
        let mut timing = Timing::default();
        timing.seen(&entry, true);
        assert_eq!(timing.margin, MIN_MARGIN * 2);
        for _ in 0..8 {
            timing.seen(&entry, true);
        }
        let quarter = Duration::from_micros(50);
        assert_eq!(
            timing.margin, quarter,
            "never past a quarter of the prediction"
        );
        timing.seen(&entry, false);
        assert_eq!(timing.margin, quarter - quarter / 8);
        for _ in 0..100 {
            timing.seen(&entry, false);
        }
        assert_eq!(timing.margin, MIN_MARGIN, "never under the least");
    }

    #[test]
    fn the_watcher_wakes_early_by_at_least_the_least_it_overslept_lately_and_the_margin() {
        let mut timing = Timing::default();
        assert_eq!(timing.early(), MIN_MARGIN, "no sleep yet");
        for micros in [60, 40, 45] {
            timing.overslept(Duration::from_micros(micros));
        }
        assert_eq!(timing.early(), Duration::from_micros(40) + MIN_MARGIN);
    }

    #[test]
    fn a_window_is_past_once_its_end_is_and_the_clock_is_read_once_in_32_looks() {
        let now = Instant::now();
        let (ended, ahead) = (now - Duration::from_secs(1), now + Duration::from_secs(60));
        assert!(past(ended, 0));
        assert!(!past(ahead, 0));
        assert!(!past(ended, 1), "not read at this look");
        assert!(past(ended, 32));
        assert!(!past(ahead, 32));
    }
}
