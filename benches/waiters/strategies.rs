//! The ways a caller can wait for fences, side by side.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, OnceLock};

use device_events::{EventApi, EventFence, ServerError, Waiter};
use futures::FutureExt;
use tokio::runtime::Runtime;

use crate::measure::{Clock, Stamps};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// This crate: `waiter.wait(fence).await`, with the default settings
    /// (`Waiter::builder().build()`: [`device_events::default_watchers`]
    /// watchers, which may be none on a small machine).
    Await,
    /// The same with `watchers(0)`: every lane thread sleeps in the driver.
    AwaitSleeping,
    /// The same with `watchers(1)`: the watcher on whatever the default, so
    /// that a machine whose default has none still shows what it does.
    AwaitWatching,
    /// `tokio::task::spawn_blocking(move || fence.wait_sync())`.
    SpawnBlocking,
    /// A dedicated thread per wait, handing the result over a oneshot.
    ThreadPerWait,
    /// Query, and `yield_now` until reached, in the task.
    QueryYield,
    /// The floor: a thread blocked in the backend's synchronize, no async.
    RawThread,
    /// The floor of any hand-off: the raw blocked thread wakes a second,
    /// parked thread, as a waiter thread wakes a sleeping executor thread.
    /// In scenario 1 that thread is parked in a channel; in scenario 8 it is
    /// the item's task, woken through a oneshot by its stream's raw thread.
    RawHandoff,
    /// The floor of any waiter (host backend only): the stream's own worker
    /// wakes the item's task the moment the item ends, one hop, with no
    /// waiter thread and no fence wait. The fence is recorded and dropped.
    OneHop,
    /// The floor of any watcher: a thread kept for the run looks at the
    /// stream's progress word from the start of each wait, as the watcher
    /// looks (a pause between looks, then a yield), and wakes the task the
    /// moment the word passes: one hop from a thread already running. Where
    /// the stream keeps no word, a thread blocks in the driver instead.
    SpinHop,
    /// The floor of the watcher's race: the same looking thread, and a
    /// second one, also kept for the run, blocked in the driver on the
    /// fence, as a lane thread blocks; whichever sees the end first wakes
    /// the task.
    SpinRace,
}

pub const ALL: [Strategy; 5] = [
    Strategy::Await,
    Strategy::SpawnBlocking,
    Strategy::ThreadPerWait,
    Strategy::QueryYield,
    Strategy::RawThread,
];

/// Scenario 1's rows: every strategy, and the hand-off floors; what
/// `--strategies` picks from in scenario 8.
pub const SINGLE: [Strategy; 9] = [
    Strategy::AwaitWatching,
    Strategy::Await,
    Strategy::AwaitSleeping,
    Strategy::SpawnBlocking,
    Strategy::OneHop,
    Strategy::ThreadPerWait,
    Strategy::QueryYield,
    Strategy::RawThread,
    Strategy::RawHandoff,
];

/// Two floors only `--strategies` adds, in scenario 1 (each spends a thread
/// looking at a progress word for the whole of every wait).
pub const EXTRA: [Strategy; 2] = [Strategy::SpinHop, Strategy::SpinRace];

/// What `--strategies` may name: scenario 1's rows, and [`EXTRA`].
pub fn nameable() -> Vec<Strategy> {
    SINGLE.iter().chain(&EXTRA).copied().collect()
}

/// Scenario 8's rows unless `--strategies` names others (from [`SINGLE`]):
/// this crate's three waiters, spawn_blocking, and the floors the targets
/// compare against (the raw thread's hand-off, the one hop).
pub const STREAMING: [Strategy; 6] = [
    Strategy::AwaitWatching,
    Strategy::Await,
    Strategy::AwaitSleeping,
    Strategy::SpawnBlocking,
    Strategy::OneHop,
    Strategy::RawHandoff,
];

impl Strategy {
    /// This strategy's name for `--strategies`.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Await => "await",
            Self::AwaitSleeping => "await_sleeping",
            Self::AwaitWatching => "await_watching",
            Self::SpawnBlocking => "spawn_blocking",
            Self::ThreadPerWait => "thread",
            Self::QueryYield => "query_yield",
            Self::RawThread => "raw",
            Self::RawHandoff => "raw_handoff",
            Self::OneHop => "one_hop",
            Self::SpinHop => "spin_hop",
            Self::SpinRace => "spin_race",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Await => "device-events await",
            Self::AwaitSleeping => "await, watchers(0)",
            Self::AwaitWatching => "await, watchers(1)",
            Self::SpawnBlocking => "spawn_blocking(wait_sync)",
            Self::ThreadPerWait => "thread per wait",
            Self::QueryYield => "query + yield_now",
            Self::RawThread => "raw blocked thread",
            Self::RawHandoff => "raw thread + hand-off",
            Self::OneHop => "one hop (stream -> task)",
            Self::SpinHop => "looking thread -> task",
            Self::SpinRace => "looking thread, racing",
        }
    }
}

/// This crate's waiters under test: the default one, one with
/// `watchers(0)`, which only sleeps in the driver, and one with
/// `watchers(1)`, which watches progress words. Each names its threads
/// apart ([`Waiters::watcher_thread`]); nothing else differs from the
/// builder's defaults.
pub struct Waiters {
    pub default: Waiter,
    pub sleeping: Waiter,
    pub watching: Waiter,
}

impl Waiters {
    pub fn new() -> Self {
        let named = |strategy: Strategy| Waiter::builder().thread_name(thread_prefix(strategy));
        Self {
            default: named(Strategy::Await).build(),
            sleeping: named(Strategy::AwaitSleeping).watchers(0).build(),
            watching: named(Strategy::AwaitWatching).watchers(1).build(),
        }
    }

    /// The waiter `strategy` awaits on.
    fn of(&self, strategy: Strategy) -> &Waiter {
        match strategy {
            Strategy::AwaitSleeping => &self.sleeping,
            Strategy::AwaitWatching => &self.watching,
            _ => &self.default,
        }
    }

    /// The name of the watcher thread of `strategy`'s waiter (for
    /// [`threads_cpu`](crate::measure::threads_cpu)); `None` for a strategy
    /// with no waiter of this crate. A waiter with no watcher starts no such
    /// thread: its watcher CPU reads 0.
    pub fn watcher_thread(strategy: Strategy) -> Option<String> {
        matches!(
            strategy,
            Strategy::Await | Strategy::AwaitSleeping | Strategy::AwaitWatching
        )
        .then(|| format!("{}-watcher", thread_prefix(strategy)))
    }

    pub fn shutdown(&self) {
        self.default.shutdown();
        self.sleeping.shutdown();
        self.watching.shutdown();
    }
}

/// Each waiter's thread name prefix: short, as Linux keeps 15 bytes of a
/// thread's name (`device-events-waiter-watcher` reads `device-events-w`,
/// the same as its lane threads), so `{prefix}-watcher` stays whole.
fn thread_prefix(strategy: Strategy) -> &'static str {
    match strategy {
        Strategy::AwaitSleeping => "await-0",
        Strategy::AwaitWatching => "await-1",
        _ => "await-d",
    }
}

/// A fence to wait for: its index (for stamps) and its stream.
pub struct Pending<A: EventApi> {
    pub index: usize,
    pub stream: usize,
    pub fence: EventFence<A>,
}

/// Start waiting for every fence with `strategy`, stamping each wake into
/// `wakes` (`ends`: where the work stamps its end, which the one-hop floor
/// awaits). Returns a handle that blocks until all are resolved.
pub fn start<A: EventApi>(
    strategy: Strategy,
    runtime: &Runtime,
    waiters: &Waiters,
    fences: Vec<Pending<A>>,
    (ends, wakes): (&Arc<Stamps>, &Arc<Stamps>),
    clock: Clock,
) -> Box<dyn FnOnce()> {
    match strategy {
        Strategy::RawThread => return start_raw(fences, wakes, clock),
        Strategy::RawHandoff => return start_raw_handoff(runtime, fences, wakes, clock),
        _ => {}
    }
    let countdown = Countdown::new(fences.len());
    let tasks: Vec<_> = fences
        .into_iter()
        .map(|Pending { index, fence, .. }| {
            let (ends, wakes) = (ends.clone(), wakes.clone());
            let waiter = waiters.of(strategy).clone();
            let countdown = countdown.clone();
            runtime.spawn(async move {
                let result = match strategy {
                    Strategy::Await | Strategy::AwaitSleeping | Strategy::AwaitWatching => {
                        waiter.wait(fence).await
                    }
                    Strategy::SpawnBlocking => {
                        tokio::task::spawn_blocking(move || fence.wait_sync())
                            .await
                            .unwrap_or_else(|err| panic!("spawn_blocking: {err}"))
                    }
                    Strategy::ThreadPerWait => {
                        let (sender, receiver) = futures::channel::oneshot::channel();
                        std::thread::Builder::new()
                            .stack_size(64 * 1024)
                            .spawn(move || {
                                let _ = sender.send(fence.wait_sync());
                            })
                            .expect("spawn a waiting thread");
                        receiver.await.expect("the waiting thread answers")
                    }
                    Strategy::SpinHop | Strategy::SpinRace => {
                        let (sender, receiver) = futures::channel::oneshot::channel();
                        look_for(fence, strategy == Strategy::SpinRace, sender);
                        receiver.await.expect("a looking thread answers")
                    }
                    Strategy::QueryYield => loop {
                        match fence.is_complete() {
                            Ok(true) => break Ok(()),
                            Ok(false) => tokio::task::yield_now().await,
                            Err(err) => break Err(err),
                        }
                    },
                    Strategy::OneHop => {
                        drop(fence);
                        ends.stamped(index).await;
                        Ok(())
                    }
                    Strategy::RawThread | Strategy::RawHandoff => {
                        unreachable!("not run as tasks")
                    }
                };
                wakes.set(index, clock.now());
                countdown.done();
                result
            })
        })
        .collect();
    let handle = runtime.handle().clone();
    Box::new(move || {
        countdown.wait();
        handle.block_on(async {
            for task in tasks {
                task.await.expect("task").expect("fence");
            }
        })
    })
}

/// Counts a run's tasks down; the last wakes the thread waiting for them
/// all. So the benchmark's main thread is woken once per run, not once per
/// task as awaiting each task's handle in turn would: that would charge
/// every async strategy a wake-up per wait (and its tokio worker the
/// unpark) that the raw floors, whose threads are joined, do not pay.
struct Countdown {
    left: AtomicUsize,
    lock: Mutex<()>,
    zero: Condvar,
}

impl Countdown {
    fn new(count: usize) -> Arc<Self> {
        Arc::new(Self {
            left: AtomicUsize::new(count),
            lock: Mutex::new(()),
            zero: Condvar::new(),
        })
    }

    fn done(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Under the lock, so a waiter between its check and its wait
            // cannot miss it.
            let _locked = self.lock.lock().expect("the countdown's lock");
            self.zero.notify_all();
        }
    }

    fn wait(&self) {
        let mut locked = self.lock.lock().expect("the countdown's lock");
        while self.left.load(Ordering::Acquire) > 0 {
            locked = self.zero.wait(locked).expect("the countdown's lock");
        }
    }
}

/// A job for one of the floors' threads.
type Job = Box<dyn FnOnce() + Send>;

/// The floors' two threads, each started at its first job and kept for the
/// run, as a waiter keeps its threads: one looks at words, one blocks in the
/// driver. Each runs its jobs in turn.
static LOOKING: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
static BLOCKED: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();

/// Run `job` on `thread` (named `name`), starting it if need be.
fn run_on(thread: &OnceLock<Mutex<mpsc::Sender<Job>>>, name: &str, job: Job) {
    let sender = thread.get_or_init(|| {
        let (sender, jobs) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || jobs.into_iter().for_each(|job| job()))
            .expect("start a floor's thread");
        Mutex::new(sender)
    });
    let sent = sender.lock().expect("a floor's queue").send(job);
    sent.expect("a floor's thread runs");
}

/// For [`Strategy::SpinHop`] and [`Strategy::SpinRace`]: the looking thread
/// looks at `fence`'s progress word until it passes, as the watcher looks;
/// with `race`, the blocked thread blocks in the driver on the fence
/// meanwhile. The first to see the end answers on `sender`.
fn look_for<A: EventApi>(
    fence: EventFence<A>,
    race: bool,
    sender: futures::channel::oneshot::Sender<Result<(), ServerError>>,
) {
    let sender = Arc::new(Mutex::new(Some(sender)));
    let answer = |sender: &Mutex<Option<_>>, result| {
        let first = sender.lock().expect("the answer's lock").take();
        if let Some(sender) = first {
            let _ = futures::channel::oneshot::Sender::send(sender, result);
        }
    };
    let block = |sender: Arc<Mutex<Option<_>>>, fence: EventFence<A>| {
        let job = move || answer(&sender, fence.wait_sync());
        run_on(&BLOCKED, "floor-blocked", Box::new(job));
    };
    let Some(word) = A::stream_progress(fence.stream()) else {
        return block(sender, fence);
    };
    let sequence = fence.sequence();
    let looking = sender.clone();
    // The fence stays with the blocked thread if there is one, else with the
    // looking thread, which then also asks it now and then (a faulted stream's
    // word may never pass); a looking thread that lost the race stops.
    let kept = if race {
        block(sender, fence);
        None
    } else {
        Some(fence)
    };
    let look = move || {
        let mut looks = 0u32;
        let result = loop {
            if word.passed(sequence) {
                break Ok(());
            }
            looks = looks.wrapping_add(1);
            if looks.is_multiple_of(64) && looking.lock().expect("the answer's lock").is_none() {
                return;
            }
            if looks.is_multiple_of(1024) {
                match kept.as_ref().map(EventFence::is_complete) {
                    Some(Ok(false)) | None => {}
                    Some(reached) => break reached.map(drop),
                }
            }
            if looks < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        };
        answer(&looking, result);
        drop(kept);
    };
    run_on(&LOOKING, "floor-looking", Box::new(look));
}

/// The floor: one thread per stream, blocked in `wait_sync` on each fence of
/// its stream in turn.
fn start_raw<A: EventApi>(
    fences: Vec<Pending<A>>,
    wakes: &Arc<Stamps>,
    clock: Clock,
) -> Box<dyn FnOnce()> {
    let mut by_stream: std::collections::BTreeMap<usize, Vec<Pending<A>>> = Default::default();
    for pending in fences {
        by_stream.entry(pending.stream).or_default().push(pending);
    }
    let threads: Vec<_> = by_stream
        .into_values()
        .map(|fences| {
            let wakes = wakes.clone();
            std::thread::spawn(move || {
                for Pending { index, fence, .. } in fences {
                    fence.wait_sync().expect("fence");
                    wakes.set(index, clock.now());
                }
            })
        })
        .collect();
    Box::new(move || {
        for thread in threads {
            thread.join().expect("raw waiting thread");
        }
    })
}

/// The floor of a hand-off to tasks: one thread per stream, blocked in
/// `wait_sync` on each fence of its stream in turn, which then wakes that
/// fence's task through a oneshot; the task stamps its wake.
fn start_raw_handoff<A: EventApi>(
    runtime: &Runtime,
    fences: Vec<Pending<A>>,
    wakes: &Arc<Stamps>,
    clock: Clock,
) -> Box<dyn FnOnce()> {
    let mut by_stream: std::collections::BTreeMap<usize, Vec<_>> = Default::default();
    let mut tasks = Vec::with_capacity(fences.len());
    let countdown = Countdown::new(fences.len());
    for Pending {
        index,
        stream,
        fence,
    } in fences
    {
        let (sender, receiver) = futures::channel::oneshot::channel::<()>();
        let (wakes, countdown) = (wakes.clone(), countdown.clone());
        tasks.push(runtime.spawn(async move {
            receiver.await.expect("the stream's thread answers");
            wakes.set(index, clock.now());
            countdown.done();
        }));
        by_stream.entry(stream).or_default().push((fence, sender));
    }
    let threads: Vec<_> = by_stream
        .into_values()
        .map(|fences| {
            std::thread::spawn(move || {
                for (fence, sender) in fences {
                    fence.wait_sync().expect("fence");
                    let _ = sender.send(());
                }
            })
        })
        .collect();
    let handle = runtime.handle().clone();
    Box::new(move || {
        for thread in threads {
            thread.join().expect("raw waiting thread");
        }
        countdown.wait();
        handle.block_on(async {
            for task in tasks {
                task.await.expect("task");
            }
        })
    })
}

/// Wait for one fence with `strategy` and stamp the wake; for the latency
/// rounds of scenario 1.
pub fn wait_one<A: EventApi>(
    strategy: Strategy,
    runtime: &Runtime,
    waiters: &Waiters,
    pending: Pending<A>,
    (ends, wakes): (&Arc<Stamps>, &Arc<Stamps>),
    clock: Clock,
) {
    match strategy {
        Strategy::RawThread => {
            let Pending { index, fence, .. } = pending;
            fence.wait_sync().expect("fence");
            wakes.set(index, clock.now());
        }
        Strategy::RawHandoff => {
            let Pending { index, fence, .. } = pending;
            let (sender, receiver) = std::sync::mpsc::channel();
            let wakes = wakes.clone();
            // Parked in `recv` (started before the work ends) until woken.
            let woken = std::thread::spawn(move || {
                receiver.recv().expect("the blocked thread hands over");
                wakes.set(index, clock.now());
            });
            fence.wait_sync().expect("fence");
            sender.send(()).expect("the parked thread waits");
            woken.join().expect("the parked thread");
        }
        _ => start(
            strategy,
            runtime,
            waiters,
            vec![pending],
            (ends, wakes),
            clock,
        )(),
    }
}

/// The first poll of an await on a fence already reached.
pub fn await_ready<A: EventApi>(waiter: &Waiter, fence: EventFence<A>) {
    waiter
        .wait(fence)
        .now_or_never()
        .expect("a reached fence is ready on first poll")
        .expect("fence");
}
