//! Property tests: random schedules of launches, fences, device-side waits
//! and awaits across host streams. Whenever a wait resolves `Ok`, every piece
//! of work queued before its fence (on its stream, and on every stream it
//! depends on through device-side waits) has run; no wait resolves early.
//! And under random cancellation (futures handed off, then dropped, while
//! streams are held and released) no wait is lost and no event is leaked.

mod common;

use std::time::{Duration, Instant};

use common::faulty::{self, Faulty};
use common::{Gate, Progress};
use device_events::host::{Host, HostStream};
use device_events::{EventFence, Waiter};
use futures::FutureExt;
use proptest::prelude::*;

const STREAMS: usize = 3;

#[derive(Debug, Clone)]
enum Op {
    /// Work on a stream, of this many microseconds.
    Launch(usize, u64),
    /// Record a fence on a stream.
    Fence(usize),
    /// `from`'s fence, waited on by `to` on the device.
    DeviceWait(usize, usize),
    /// Resolve the oldest unresolved fence: by await, `wait_sync`, or with
    /// the next one in a `join!`.
    Await,
    WaitSync,
    JoinTwo,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..STREAMS, 0u64..300).prop_map(|(s, us)| Op::Launch(s, us)),
        3 => (0..STREAMS).prop_map(Op::Fence),
        2 => (0..STREAMS, 0..STREAMS)
            .prop_filter("another stream", |(a, b)| a != b)
            .prop_map(|(a, b)| Op::DeviceWait(a, b)),
        1 => Just(Op::Await),
        1 => Just(Op::WaitSync),
        1 => Just(Op::JoinTwo),
    ]
}

/// A fence and what must have run when it resolves: launches per stream.
struct Expect {
    fence: EventFence<Host>,
    needs: [usize; STREAMS],
}

struct World {
    streams: Vec<HostStream>,
    progress: Vec<Progress>,
    /// Per stream: the launches of every stream its current end depends on.
    clocks: [[usize; STREAMS]; STREAMS],
    waiter: Waiter,
}

impl World {
    fn new() -> Self {
        Self {
            streams: (0..STREAMS).map(|_| HostStream::new().unwrap()).collect(),
            progress: (0..STREAMS).map(|_| Progress::default()).collect(),
            clocks: [[0; STREAMS]; STREAMS],
            waiter: Waiter::builder().max_threads(2).build(),
        }
    }

    fn check(&self, expect_needs: &[usize; STREAMS]) -> Result<(), TestCaseError> {
        for (stream, needed) in expect_needs.iter().enumerate() {
            let done = self.progress[stream].get();
            prop_assert!(
                done >= *needed,
                "resolved with stream {stream} at {done} of {needed} launches"
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn a_resolved_wait_means_all_work_before_its_fence_has_run(ops in prop::collection::vec(op(), 1..40)) {
        let mut world = World::new();
        let mut pending: std::collections::VecDeque<Expect> = Default::default();
        for op in ops {
            match op {
                Op::Launch(stream, micros) => {
                    let counter = world.progress[stream].clone();
                    world.streams[stream]
                        .launch(move || {
                            std::thread::sleep(Duration::from_micros(micros));
                            counter.bump();
                        })
                        .unwrap();
                    world.clocks[stream][stream] += 1;
                }
                Op::Fence(stream) => pending.push_back(Expect {
                    fence: EventFence::new(world.streams[stream].handle()),
                    needs: world.clocks[stream],
                }),
                Op::DeviceWait(from, to) => {
                    EventFence::<Host>::new(world.streams[from].handle())
                        .wait_async(world.streams[to].handle())
                        .unwrap();
                    for s in 0..STREAMS {
                        world.clocks[to][s] = world.clocks[to][s].max(world.clocks[from][s]);
                    }
                }
                Op::Await => {
                    if let Some(Expect { fence, needs }) = pending.pop_front() {
                        futures::executor::block_on(world.waiter.wait(fence)).unwrap();
                        world.check(&needs)?;
                    }
                }
                Op::WaitSync => {
                    if let Some(Expect { fence, needs }) = pending.pop_front() {
                        fence.wait_sync().unwrap();
                        world.check(&needs)?;
                    }
                }
                Op::JoinTwo => {
                    let (Some(a), Some(b)) = (pending.pop_front(), pending.pop_front()) else {
                        continue;
                    };
                    let waiter = world.waiter.clone();
                    let needs_a = a.needs;
                    let needs_b = b.needs;
                    let (first, second) = futures::executor::block_on(async {
                        futures::join!(waiter.wait(a.fence), waiter.wait(b.fence))
                    });
                    first.unwrap();
                    second.unwrap();
                    world.check(&needs_a)?;
                    world.check(&needs_b)?;
                }
            }
        }
        // Every fence left resolves too, each after its work.
        while let Some(Expect { fence, needs }) = pending.pop_front() {
            futures::executor::block_on(world.waiter.wait(fence)).unwrap();
            world.check(&needs)?;
        }
    }
}

#[derive(Debug, Clone)]
enum CancelOp {
    /// Hold a stream's worker (if not held yet) until released.
    Hold(usize),
    Release(usize),
    /// Work on a stream, of this many microseconds.
    Launch(usize, u64),
    /// A fence on a stream, awaited: its future is polled once and kept.
    Await(usize),
    /// Drop the kept future at this index (modulo how many are kept).
    Drop(usize),
    /// Poll every kept future once.
    PollAll,
}

fn cancel_op() -> impl Strategy<Value = CancelOp> {
    prop_oneof![
        2 => (0..STREAMS).prop_map(CancelOp::Hold),
        2 => (0..STREAMS).prop_map(CancelOp::Release),
        2 => (0..STREAMS, 0u64..200).prop_map(|(s, us)| CancelOp::Launch(s, us)),
        4 => (0..STREAMS).prop_map(CancelOp::Await),
        3 => any::<usize>().prop_map(CancelOp::Drop),
        1 => Just(CancelOp::PollAll),
    ]
}

proptest! {
    // A failing case waits out its 5 s limit once per shrink: bounded shrinking.
    #![proptest_config(ProptestConfig { cases: 48, max_shrink_iters: 16, ..ProptestConfig::default() })]

    #[test]
    fn under_random_cancellation_no_wait_is_lost_and_no_event_leaked(
        ops in prop::collection::vec(cancel_op(), 1..60),
        max_threads in 1usize..3,
    ) {
        let streams: Vec<HostStream> = (0..STREAMS).map(|_| HostStream::new().unwrap()).collect();
        let mut gates: Vec<Option<Gate>> = (0..STREAMS).map(|_| None).collect();
        let waiter = Waiter::builder().max_threads(max_threads).build();
        let mut created = [0usize; STREAMS];
        let mut kept = Vec::new();
        for op in ops {
            match op {
                CancelOp::Hold(stream) => {
                    if gates[stream].is_none() {
                        gates[stream] = Some(Gate::hold(&streams[stream]));
                    }
                }
                CancelOp::Release(stream) => {
                    if let Some(gate) = gates[stream].take() {
                        gate.open();
                    }
                }
                CancelOp::Launch(stream, micros) => streams[stream]
                    .launch(move || std::thread::sleep(Duration::from_micros(micros)))
                    .unwrap(),
                CancelOp::Await(stream) => {
                    created[stream] += 1;
                    let mut future = waiter.wait(EventFence::<Faulty>::new(streams[stream].handle()));
                    match (&mut future).now_or_never() {
                        Some(result) => result.unwrap(),
                        None => kept.push(future),
                    }
                }
                CancelOp::Drop(index) => {
                    if !kept.is_empty() {
                        drop(kept.swap_remove(index % kept.len()));
                    }
                }
                CancelOp::PollAll => {
                    let mut still = Vec::new();
                    for mut future in kept.drain(..) {
                        match (&mut future).now_or_never() {
                            Some(result) => result.unwrap(),
                            None => still.push(future),
                        }
                    }
                    kept = still;
                }
            }
            // Dropped waits leave the waiter at once, but for a wait a
            // thread is blocked on (one per lane, held until its gate opens)
            // and waits out in a batch a thread is polling (back within
            // moments, unless that thread is descheduled).
            common::eventually(
                Duration::from_secs(20),
                "dropped waits leave, but one held per lane",
                || waiter.pending() <= kept.len() + STREAMS,
            );
        }
        for gate in gates.into_iter().flatten() {
            gate.open();
        }
        // Every future kept resolves, and nothing stays behind.
        for future in kept {
            futures::executor::block_on(future).unwrap();
        }
        // Disposal takes milliseconds; the limit is for a loaded machine.
        let settled = || {
            waiter.pending() == 0
                && (0..STREAMS).all(|s| faulty::destroyed(streams[s].handle()) == created[s])
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !settled() && Instant::now() < deadline {
            std::thread::yield_now();
        }
        let destroyed: Vec<_> = streams.iter().map(|s| faulty::destroyed(s.handle())).collect();
        prop_assert!(
            settled(),
            "{} pending; events destroyed {destroyed:?} of {created:?}",
            waiter.pending()
        );
        // Lane threads, the poller and the watcher.
        prop_assert!(waiter.peak_threads() <= max_threads + 2);
    }
}
