//! The watcher's parts: a lane's history and its entries ([`LaneHistory`], [`Watched`]), how early
//! the watcher wakes and looks ([`Early`], [`Timing`]), its CPU budget ([`CpuBudget`]), and the
//! figures (the constants below). Why: the [module docs](crate::waiter#the-watcher).

use std::time::{Duration, Instant};

use crate::sync::Arc;
use crate::waiter::slot::Slot;
use crate::waiter::wait::Wait;
use crate::waiter::waitable::{LaneKey, Waitable};
use crate::ProgressWord;

/// How long past its hand-over the watcher looks at the word of a lane with no history.
pub(crate) const FIRST_WINDOW: Duration = Duration::from_micros(50);
/// The least margin before a predicted end, beyond how late sleeps have lately ended.
const MIN_MARGIN: Duration = Duration::from_micros(5);
/// A sleep shorter than this is spent looking instead.
pub(crate) const MIN_NAP: Duration = Duration::from_micros(20);
/// The longest the watcher naps: no prediction holds its attention for long.
pub(crate) const MAX_NAP: Duration = Duration::from_millis(20);
/// The most the watcher looks at one wait's word.
pub(crate) const MAX_LOOK: Duration = Duration::from_micros(200);
/// The watcher's thread takes, over time, at most one `CPU_SHARE`th of one core.
pub(crate) const CPU_SHARE: u32 = 4;
/// The most CPU time the watcher may save up while it uses less than its share.
const BURST: Duration = Duration::from_millis(10);
/// Looks with a pause between them before the watcher yields between looks instead.
const SPIN_LOOKS: u32 = 64;
/// How many recent durations a prediction looks at.
const HISTORY: usize = 4;
/// How early the watcher wakes, as last measured, halves each time this passes.
pub(crate) const EARLY_HALF_LIFE: Duration = Duration::from_millis(100);
/// Waits predicted shorter than this are left to the driver.
pub(crate) const MIN_WATCHED: Duration = Duration::from_micros(150);
/// The lanes whose history a pool keeps: those used last.
pub(crate) const HISTORIES: usize = 1024;
/// The most waits in a row a lane leaves to the driver after watches that missed.
pub(crate) const MAX_SKIP: u32 = 63;

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

/// A lane's recent waits and its margin, kept by the pool under the lane's key.
pub(crate) struct LaneHistory {
    took: Recent,
    margin: Duration,
    /// The lane's recent misses ([`LaneHistory::missed`]).
    misses: u32,
    /// Waits still to leave to the driver after those misses.
    skip: u32,
    /// When the pool last used it (its own count), so it keeps those used last.
    pub(crate) used: u64,
}

impl Default for LaneHistory {
    fn default() -> Self {
        Self {
            took: Recent::default(),
            margin: MIN_MARGIN,
            misses: 0,
            skip: 0,
            used: 0,
        }
    }
}

impl LaneHistory {
    /// The watcher's entry for `wait`, held from `started`, its stream's progress in `word`; none
    /// if the lane's waits are not [worth watching](Self::worth_watching) (the watcher waking
    /// `early`) or its last misses leave this one to the driver.
    pub(crate) fn entry(
        &mut self,
        wait: &Wait,
        word: &ProgressWord,
        started: Instant,
        early: Duration,
    ) -> Option<Watched> {
        if !self.worth_watching(early) {
            return None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        let predicted = self.predicted().unwrap_or_default();
        Some(Watched {
            lane: wait.lane,
            slot: wait.slot.clone(),
            waitable: wait.waitable.clone(),
            word: word.clone(),
            sequence: wait.place.sequence,
            started,
            due: started + predicted,
            predicted,
            margin: self.margin,
        })
    }

    /// A wait of the lane took at most `took` from the start of its hold.
    pub(crate) fn ended(&mut self, took: Duration) {
        self.took.push(took);
    }

    /// The watcher saw `entry`'s word passed after `took` (`late`: at its first look after a
    /// sleep): learn it, halve the misses, and widen or shrink the margin.
    pub(crate) fn seen(&mut self, entry: &Watched, took: Duration, late: bool) {
        self.ended(took);
        self.misses /= 2;
        self.margin = if late {
            (self.margin * 2).min(entry.predicted / 4).max(MIN_MARGIN)
        } else {
            (self.margin - self.margin / 8).max(MIN_MARGIN)
        };
    }

    /// A watch of the lane missed (its window ended before the word passed, or the driver woke the
    /// lane thread first): count it, and leave the lane's next waits to the driver.
    pub(crate) fn missed(&mut self) {
        self.misses = self.misses.saturating_add(1);
        self.skip = ((1u32 << (self.misses - 1).min(16)) - 1).min(MAX_SKIP);
    }

    /// Whether the lane's next wait is worth offering to the watcher, waking `early` before an end
    /// it expects: yes unless predicted shorter than [`MIN_WATCHED`] or than twice `early`.
    pub(crate) fn worth_watching(&self, early: Duration) -> bool {
        self.predicted()
            .is_none_or(|predicted| predicted >= (early * 2).max(MIN_WATCHED))
    }

    /// How long a wait should take from the start of its hold, once the lane has two.
    pub(crate) fn predicted(&self) -> Option<Duration> {
        let took = self.took.values();
        (took.len() >= 2).then(|| took.iter().copied().min().unwrap_or_default())
    }
}

/// A held wait on the watcher's list; its lane thread blocks on it in the driver meanwhile.
#[derive(Clone)]
pub(crate) struct Watched {
    pub(crate) lane: LaneKey,
    pub(crate) slot: Arc<Slot>,
    pub(crate) waitable: std::sync::Arc<dyn Waitable>,
    word: ProgressWord,
    sequence: u64,
    /// When its lane thread began to hold it.
    pub(crate) started: Instant,
    /// When it should end: `predicted` after its hold began (zero: no history).
    due: Instant,
    predicted: Duration,
    /// Its lane's margin when it was handed over.
    margin: Duration,
}

impl Watched {
    /// The earliest the watcher looks at its word, however late its sleeps end
    /// ([`Timing::look_from`] is never earlier): a watcher asleep until then need not be woken.
    pub(crate) fn looks_from_at_the_earliest(&self) -> Instant {
        self.due - (self.predicted / 2).min(MAX_LOOK / 2)
    }

    /// Whether the stream has passed the wait's point.
    pub(crate) fn passed(&self) -> bool {
        self.word.passed(self.sequence)
    }
}

/// How early the watcher wakes before an end it expects ([`Timing::early`]), as it said at `said`,
/// halved each [`EARLY_HALF_LIFE`] since.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Early {
    pub(crate) early: Duration,
    pub(crate) said: Instant,
}

impl Early {
    /// How early it wakes, as of `now`.
    pub(crate) fn at(&self, now: Instant) -> Duration {
        let age = now.saturating_duration_since(self.said).as_nanos();
        let halvings = (age / EARLY_HALF_LIFE.as_nanos()).min(64) as u32;
        let nanos = u64::try_from(self.early.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(nanos.checked_shr(halvings).unwrap_or(0))
    }
}

/// The watcher's timing: how late its sleeps end.
#[derive(Default)]
pub(crate) struct Timing {
    overslept: Recent,
}

impl Timing {
    /// How early before an end it expects the watcher wakes, at the least.
    pub(crate) fn early(&self) -> Duration {
        let overslept = self.overslept.values().iter().min().copied();
        overslept.unwrap_or_default() + MIN_MARGIN
    }

    /// How long before its predicted end to look at `entry`'s word (the lead).
    fn lead(&self, entry: &Watched) -> Duration {
        let overslept = self.overslept.values().iter().max().copied();
        let lead = overslept.unwrap_or_default() + entry.margin;
        lead.min(entry.predicted / 2).min(MAX_LOOK / 2)
    }

    /// From when to look at `entry`'s word.
    pub(crate) fn look_from(&self, entry: &Watched) -> Instant {
        entry.due - self.lead(entry)
    }

    /// Until when to look at `entry`'s word before leaving it to the driver.
    pub(crate) fn look_until(&self, entry: &Watched) -> Instant {
        let lead = self.lead(entry);
        let until = entry.due + (lead * 2).max(FIRST_WINDOW);
        until.min(entry.due - lead + MAX_LOOK)
    }

    /// A sleep meant to end at some time ended `late` after it.
    pub(crate) fn overslept(&mut self, late: Duration) {
        self.overslept.push(late);
    }
}

/// The watcher's CPU budget, as the [module docs](crate::waiter#the-watcher) tell.
pub(crate) struct CpuBudget {
    /// Nanoseconds left; below zero, owed.
    left: i64,
    earned_to: Instant,
}

/// `duration` in nanoseconds, as the budget counts.
fn nanos(duration: Duration) -> i64 {
    i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX)
}

impl CpuBudget {
    pub(crate) fn new(now: Instant) -> Self {
        Self {
            left: nanos(BURST),
            earned_to: now,
        }
    }

    /// Earn the share of the time since last asked; whether any is left to spend.
    pub(crate) fn earn(&mut self, now: Instant) -> bool {
        let passed = now.saturating_duration_since(self.earned_to);
        self.earned_to = self.earned_to.max(now);
        let earned = nanos(passed / CPU_SHARE);
        self.left = self.left.saturating_add(earned).min(nanos(BURST));
        self.left > 0
    }

    /// A round used `spent`.
    pub(crate) fn spend(&mut self, spent: Duration) {
        self.left = self.left.saturating_sub(nanos(spent));
    }
}

/// Whether a watch that has looked `looks` times is past `until` (the clock read once in 32 looks);
/// under loom, after two looks, so a model sees the word pass before, between and after.
pub(crate) fn past(until: Instant, looks: u32) -> bool {
    if cfg!(device_events_loom) {
        return looks >= 2;
    }
    looks.is_multiple_of(32) && Instant::now() >= until
}

/// Between two looks at the words: a pause, then, after [`SPIN_LOOKS`], a yield.
pub(crate) fn pause(looks: u32) {
    #[cfg(device_events_loom)]
    crate::sync::thread::yield_now();
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
        past, CpuBudget, Early, LaneHistory, LaneKey, Slot, Timing, Wait, Waitable, Watched, BURST,
        CPU_SHARE, EARLY_HALF_LIFE, FIRST_WINDOW, MAX_LOOK, MAX_SKIP, MIN_MARGIN, MIN_WATCHED,
    };
    use crate::api::HostWord;
    use crate::{ProgressWord, ServerError};

    impl LaneHistory {
        /// How many waits it has learnt.
        pub(crate) fn len(&self) -> usize {
            self.took.seen
        }
    }

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

    /// `history`'s entry for a wait at point 3 held from `started`, on `word` (a new one if none),
    /// if it watches it with the watcher waking `early`.
    fn try_entry(
        history: &mut LaneHistory,
        started: Instant,
        early: Duration,
        word: Option<&Arc<HostWord>>,
    ) -> Option<Watched> {
        let slot = Arc::new(Slot::new(futures::task::noop_waker()));
        let wait = Wait::new(Arc::new(Unused), slot, LaneKey::for_tests(0), None);
        let memory = word.cloned().unwrap_or_default();
        history.entry(&wait, &ProgressWord::new(memory), started, early)
    }

    fn entry(history: &mut LaneHistory, started: Instant) -> Watched {
        try_entry(history, started, Duration::ZERO, None).expect("watched")
    }

    /// The next watchable wait of `history` that is watched, and how many in a row before it were
    /// left to the driver (never for good: at most [`MAX_SKIP`]).
    fn next_watched(history: &mut LaneHistory) -> (u32, Watched) {
        let mut skipped = 0;
        loop {
            match try_entry(history, Instant::now(), Duration::ZERO, None) {
                Some(watch) => return (skipped, watch),
                None => {
                    skipped += 1;
                    assert!(skipped <= MAX_SKIP, "left to the driver for good");
                }
            }
        }
    }

    #[test]
    fn a_prediction_needs_two_waits_and_takes_the_shortest_of_the_last_four() {
        let mut history = LaneHistory::default();
        assert_eq!(history.predicted(), None, "no history");
        // A lane's first wait often waited out a hold: one is not enough.
        history.ended(Duration::from_millis(300));
        assert_eq!(history.predicted(), None);
        history.ended(Duration::from_micros(900));
        assert_eq!(history.predicted(), Some(Duration::from_micros(900)));
        for micros in [1_000, 1_100, 1_200, 1_300] {
            history.ended(Duration::from_micros(micros));
        }
        // 900 us has left the last four.
        assert_eq!(history.predicted(), Some(Duration::from_micros(1_000)));
    }

    #[test]
    fn one_short_wait_after_long_ones_sets_the_next_prediction() {
        // Six 100 ms items, then 1 ms ones: the first 1 ms item's end makes the next prediction 1
        // ms, not 100 ms.
        let mut history = LaneHistory::default();
        for _ in 0..6 {
            history.ended(Duration::from_millis(100));
        }
        history.ended(Duration::from_millis(1));
        assert_eq!(history.predicted(), Some(Duration::from_millis(1)));
    }

    #[test]
    fn waits_predicted_shorter_than_the_least_watched_are_left_to_the_driver() {
        let mut history = LaneHistory::default();
        for _ in 0..2 {
            history.ended(MIN_WATCHED - Duration::from_nanos(1));
        }
        let started = Instant::now();
        assert!(try_entry(&mut history, started, Duration::ZERO, None).is_none());
        history.ended(MIN_WATCHED);
        history.ended(MIN_WATCHED);
        history.ended(MIN_WATCHED);
        history.ended(MIN_WATCHED);
        assert!(try_entry(&mut history, started, Duration::ZERO, None).is_some());
        let predicting = |took| {
            let mut history = LaneHistory::default();
            history.ended(took);
            history.ended(took);
            history
        };
        let short = predicting(MIN_WATCHED - Duration::from_nanos(1));
        assert!(!short.worth_watching(Duration::ZERO));
        assert!(
            LaneHistory::default().worth_watching(Duration::from_secs(1)),
            "no history: watched"
        );
        // The figure `WaiterBuilder::watchers` gives.
        let micros = |n| predicting(Duration::from_micros(n)).worth_watching(Duration::ZERO);
        assert!(!micros(149));
        assert!(micros(150));
    }

    #[test]
    fn an_entry_is_due_its_prediction_after_its_hold_began_and_reads_its_word() {
        let mut history = LaneHistory::default();
        let word = Arc::new(HostWord::default());
        let started = Instant::now();
        let first = try_entry(&mut history, started, Duration::ZERO, Some(&word)).unwrap();
        assert_eq!(first.due, started, "no history: due at once");
        assert_eq!(first.started, started);
        assert!(!first.passed());
        word.advance(3);
        assert!(first.passed());
        history.ended(Duration::from_micros(400));
        history.ended(Duration::from_micros(500));
        let later = entry(&mut history, started);
        assert_eq!(later.due, started + Duration::from_micros(400));
        assert_eq!(later.predicted, Duration::from_micros(400));
        // Waits shorter than twice how early the watcher wakes are not watched.
        let early = Duration::from_micros(200);
        assert!(try_entry(&mut history, started, early, None).is_some());
        let early = Duration::from_micros(201);
        assert!(try_entry(&mut history, started, early, None).is_none());
    }

    #[test]
    fn the_watcher_looks_early_by_the_most_it_overslept_lately_and_the_lanes_margin() {
        let mut history = LaneHistory::default();
        let started = Instant::now();
        let lone = entry(&mut history, started);
        let mut timing = Timing::default();
        assert_eq!(timing.look_from(&lone), started, "no history: at once");
        assert_eq!(timing.look_until(&lone), started + FIRST_WINDOW);
        history.ended(Duration::from_millis(1));
        history.ended(Duration::from_millis(1));
        let entry = entry(&mut history, started);
        let due = started + Duration::from_millis(1);
        assert_eq!(timing.look_from(&entry), due - MIN_MARGIN, "no sleep yet");
        for micros in [30, 20, 25, 28] {
            timing.overslept(Duration::from_micros(micros));
        }
        let lead = Duration::from_micros(30) + MIN_MARGIN;
        assert_eq!(timing.look_from(&entry), due - lead);
        assert_eq!(timing.look_until(&entry), due + lead * 2);
        timing.overslept(Duration::from_micros(10));
        let lead = Duration::from_micros(28) + MIN_MARGIN;
        assert_eq!(timing.look_from(&entry), due - lead, "30 us is past");
    }

    #[test]
    fn no_entry_is_looked_at_for_longer_than_the_most_one_may_be() {
        let mut history = LaneHistory::default();
        let started = Instant::now();
        for _ in 0..2 {
            history.ended(Duration::from_millis(100));
        }
        let long = entry(&mut history, started);
        let mut timing = Timing::default();
        // A watcher that once overslept by 5 ms still looks at most MAX_LOOK at a word.
        timing.overslept(Duration::from_millis(5));
        let due = started + Duration::from_millis(100);
        assert_eq!(
            timing.look_from(&long),
            due - MAX_LOOK / 2,
            "at most half the most"
        );
        let looked = timing.look_until(&long) - timing.look_from(&long);
        assert!(looked <= MAX_LOOK, "{looked:?}");
        // The figure `WaiterBuilder::watchers` gives.
        assert!(looked <= Duration::from_micros(200), "{looked:?}");
        // And at most half the prediction early.
        history.ended(Duration::from_micros(160));
        let short = entry(&mut history, started);
        let due = started + Duration::from_micros(160);
        assert_eq!(timing.look_from(&short), due - Duration::from_micros(80));
        let looked = timing.look_until(&short) - timing.look_from(&short);
        assert!(looked <= MAX_LOOK, "{looked:?}");
    }

    #[test]
    fn a_late_wake_doubles_the_lanes_margin_up_to_a_quarter_of_the_prediction_and_one_in_time_shrinks_it(
    ) {
        let mut history = LaneHistory::default();
        history.ended(Duration::from_micros(200));
        history.ended(Duration::from_micros(200));
        let entry = entry(&mut history, Instant::now());
        let took = Duration::from_micros(200);
        history.seen(&entry, took, true);
        assert_eq!(history.margin, MIN_MARGIN * 2);
        for _ in 0..8 {
            history.seen(&entry, took, true);
        }
        let quarter = Duration::from_micros(50);
        assert_eq!(
            history.margin, quarter,
            "never past a quarter of the prediction"
        );
        history.seen(&entry, took, false);
        assert_eq!(history.margin, quarter - quarter / 8);
        for _ in 0..100 {
            history.seen(&entry, took, false);
        }
        assert_eq!(history.margin, MIN_MARGIN, "never under the least");
    }

    #[test]
    fn misses_leave_more_of_a_lanes_waits_to_the_driver_and_sightings_bring_them_back() {
        let skipped = |history: &mut LaneHistory| next_watched(history).0;
        let mut history = LaneHistory::default();
        for _ in 0..4 {
            history.ended(Duration::from_millis(1));
        }
        assert_eq!(skipped(&mut history), 0, "no miss yet");
        let mut after = Vec::new();
        for _ in 0..9 {
            history.missed();
            after.push(skipped(&mut history));
        }
        assert_eq!(after, [0, 1, 3, 7, 15, 31, 63, 63, 63]);
        // A sighting halves the count (9 to 4): the next miss leaves 2^4 - 1 waits.
        let seen = entry(&mut history, Instant::now());
        history.seen(&seen, Duration::from_millis(1), false);
        history.missed();
        assert_eq!(skipped(&mut history), 15);
        // Sightings in a row clear it (5 to 2, 1, 0): one miss then leaves none, two leave one.
        for _ in 0..4 {
            history.seen(&seen, Duration::from_millis(1), false);
        }
        history.missed();
        assert_eq!(skipped(&mut history), 0);
        history.missed();
        assert_eq!(skipped(&mut history), 1);
    }

    #[test]
    fn a_lane_the_watcher_wins_one_watch_in_four_leaves_most_of_its_waits_to_the_driver() {
        // Three misses, then a sighting, again and again: the count settles where most waits are
        // left to the driver, not back at none after each sighting.
        let mut history = LaneHistory::default();
        for _ in 0..4 {
            history.ended(Duration::from_millis(1));
        }
        let (mut watched, mut waits) = (0, 0);
        for round in 0..40 {
            for sighted in [false, false, false, true] {
                // The waits up to the next watched one; those before it are left to the driver.
                let (left, watch) = next_watched(&mut history);
                if round >= 20 {
                    watched += 1;
                    waits += left + 1;
                }
                if sighted {
                    history.seen(&watch, Duration::from_millis(1), false);
                } else {
                    history.missed();
                }
            }
        }
        assert!(watched * 5 <= waits, "{watched} of {waits} waits watched");
    }

    #[test]
    fn one_lanes_margin_is_its_own() {
        // An irregular lane's late sightings widen its margin, not a steady lane's beside it.
        let (mut irregular, mut steady) = (LaneHistory::default(), LaneHistory::default());
        for history in [&mut irregular, &mut steady] {
            history.ended(Duration::from_millis(1));
            history.ended(Duration::from_millis(1));
        }
        let late = entry(&mut irregular, Instant::now());
        for _ in 0..8 {
            irregular.seen(&late, Duration::from_millis(1), true);
        }
        assert!(irregular.margin > MIN_MARGIN);
        let steady_entry = entry(&mut steady, Instant::now());
        assert_eq!(steady_entry.margin, MIN_MARGIN);
        let timing = Timing::default();
        let irregular_entry = entry(&mut irregular, steady_entry.started);
        assert!(timing.look_from(&irregular_entry) < timing.look_from(&steady_entry));
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
    fn how_early_the_watcher_wakes_halves_each_half_life_it_is_not_said_again() {
        // Four late naps in a row must not keep every lane from the watcher for good.
        let now = Instant::now();
        let early = Early {
            early: Duration::from_millis(8),
            said: now,
        };
        assert_eq!(early.at(now), Duration::from_millis(8));
        assert_eq!(early.at(now + EARLY_HALF_LIFE), Duration::from_millis(4));
        assert_eq!(
            early.at(now + EARLY_HALF_LIFE * 3),
            Duration::from_millis(1)
        );
        assert_eq!(early.at(now + EARLY_HALF_LIFE * 100), Duration::ZERO);
        assert_eq!(early.at(now - EARLY_HALF_LIFE), Duration::from_millis(8));
    }

    #[test]
    fn the_spin_budget_earns_its_share_of_the_time_and_saves_up_at_most_a_burst() {
        let start = Instant::now();
        let mut budget = CpuBudget::new(start);
        assert!(budget.earn(start), "a burst to begin with");
        budget.spend(BURST);
        assert!(!budget.earn(start), "spent");
        let later = start + Duration::from_millis(4);
        assert!(budget.earn(later));
        assert_eq!(
            budget.left,
            super::nanos(Duration::from_millis(4) / CPU_SHARE)
        );
        // A look that ran over is owed.
        budget.spend(Duration::from_millis(2));
        assert!(
            !budget.earn(later + Duration::from_millis(4)),
            "1 ms owed, 1 ms earned"
        );
        assert!(budget.earn(later + Duration::from_millis(5)));
        // A long idle spell saves up no more than a burst.
        assert!(budget.earn(later + Duration::from_secs(60)));
        assert_eq!(budget.left, super::nanos(BURST));
    }

    #[test]
    fn a_watcher_that_would_spin_all_the_time_spins_at_most_its_share() {
        let start = Instant::now();
        let (mut now, mut spun) = (start, Duration::ZERO);
        let mut budget = CpuBudget::new(now);
        let look = Duration::from_micros(150);
        for _ in 0..10_000 {
            if budget.earn(now) {
                budget.spend(look);
                spun += look;
                now += look;
            } else {
                // Nothing to spin on: the round ends in a short sleep.
                now += Duration::from_micros(50);
            }
        }
        let passed = now - start;
        assert!(
            spun <= passed / CPU_SHARE + BURST + look,
            "{spun:?} of {passed:?}"
        );
        assert!(
            spun >= passed / CPU_SHARE / 2,
            "it still spins: {spun:?} of {passed:?}"
        );
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
