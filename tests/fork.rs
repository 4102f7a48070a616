//! A wait in a forked child: the child has only the thread that forked, so a
//! waiter made in the parent has no threads there. A wait on it fails at
//! once, with an error that names the fork; `Waiter::global()` is made
//! afresh in the child and serves it. Nothing hangs.
//!
//! One test in its own binary: a fork copies whatever locks other threads
//! held at that moment, and here no other test's threads run.
#![cfg(unix)]

mod common;

use std::time::Duration;

use common::fork::in_a_fork;
use common::Gate;
use device_events::host::{Host, HostContext, HostStream};
use device_events::{status, EventFence, FenceFuture, ServerError, Waiter};
use futures::FutureExt;

/// What the child checks; `Err` says what went wrong. `handed` was handed
/// to `waiter` before the fork.
fn in_the_child(waiter: &Waiter, mut handed: FenceFuture<Host>) -> Result<(), String> {
    // Its thread is in the parent: it fails when polled, and its drop
    // touches nothing of the parent's.
    match (&mut handed).now_or_never() {
        Some(Err(ServerError::WaiterForked)) => {}
        other => {
            return Err(format!(
                "a wait handed off before the fork answered {other:?}"
            ))
        }
    }
    drop(handed);
    // Streams made in the child have their workers here.
    let stream = HostStream::new().map_err(|err| err.to_string())?;
    // A wait on the parent's waiter: refused at once, naming the fork.
    let gate = Gate::hold(&stream);
    let refused = waiter
        .wait(EventFence::<Host>::new(stream.handle()))
        .now_or_never();
    match refused {
        Some(Err(ServerError::WaiterForked)) => {}
        other => return Err(format!("the parent's waiter answered {other:?}")),
    }
    if !ServerError::WaiterForked.to_string().contains("forked") {
        return Err("the error does not name the fork".to_owned());
    }
    if waiter.threads() != 0 || waiter.pending() != 0 {
        return Err("the parent's counts show in the child".to_owned());
    }
    drop(gate);
    // `fence.await` goes to a global waiter of the child's own.
    global_await_resolves()?;
    if Waiter::global().threads() == 0 {
        return Err("the child's global waiter has no thread".to_owned());
    }
    // And in a fork of the child, whose global waiter is the child's.
    match in_a_fork(global_await_resolves) {
        0 => Ok(()),
        code => Err(format!("the grandchild failed ({code})")),
    }
}

/// A `fence.await`, handed off, resolves: through a global waiter of this
/// process's own.
fn global_await_resolves() -> Result<(), String> {
    let stream = HostStream::new().map_err(|err| err.to_string())?;
    let gate = Gate::hold(&stream);
    let mut global = EventFence::<Host>::new(stream.handle()).wait();
    if (&mut global).now_or_never().is_some() {
        return Err("the global wait was not handed off".to_owned());
    }
    gate.open();
    match global.wait_sync_timeout(Duration::from_secs(10)) {
        Some(Ok(())) => Ok(()),
        other => Err(format!("the global waiter answered {other:?}")),
    }
}

/// A host stream made before the fork has its worker in the parent: in the
/// child, its calls and its fences' waits fail at once (an invalid handle),
/// where they would wait forever for work that never runs; the process's
/// primary context is made afresh there.
fn a_host_stream_made_before_the_fork_fails_in_the_child_never_hangs() {
    let parents = HostStream::new().unwrap();
    let shared = HostContext::primary().new_stream().unwrap();
    let held = Gate::hold(&parents);
    let fence = parents.fence();
    let status = in_a_fork(|| {
        let invalid = |what: &str, result: Result<(), ServerError>| match result {
            Err(err) if err.code() == Some(status::INVALID_HANDLE) => Ok(()),
            other => Err(format!("{what} in the child answered {other:?}")),
        };
        invalid("a synchronize", parents.synchronize())?;
        invalid("a launch", parents.launch(|| {}))?;
        invalid("a fence's wait_sync", parents.fence().wait_sync())?;
        let child = HostStream::new().map_err(|err| err.to_string())?;
        invalid(
            "a wait on the parent's fence",
            fence.wait_async(child.handle()),
        )?;
        invalid("a shared stream's synchronize", shared.synchronize())?;
        let primary = HostContext::primary()
            .new_stream()
            .map_err(|err| err.to_string())?;
        primary.fence().wait_sync().map_err(|err| err.to_string())?;
        child.fence().wait_sync().map_err(|err| err.to_string())
    });
    assert_eq!(
        status, 0,
        "the child's checks failed (1: its stderr says why; 142: SIGALRM, a wait hung)"
    );
    held.open();
    fence.wait_sync().unwrap();
    shared.synchronize().unwrap();
}

#[test]
fn a_wait_in_a_forked_child_fails_at_once_or_resolves_never_hangs() {
    // A step of this one test: no other test's threads may run at a fork.
    a_host_stream_made_before_the_fork_fails_in_the_child_never_hangs();
    // The parent's waiter, and the global one, with threads and counts.
    let waiter = Waiter::builder().build();
    let stream = HostStream::new().unwrap();
    for target in [&waiter, Waiter::global()] {
        let gate = Gate::hold(&stream);
        let mut future = target.wait(EventFence::<Host>::new(stream.handle()));
        assert!((&mut future).now_or_never().is_none(), "handed off");
        gate.open();
        futures::executor::block_on(future).unwrap();
    }
    assert!(waiter.threads() > 0 && Waiter::global().threads() > 0);
    // A wait a waiter thread holds across the fork.
    let held = Gate::hold(&stream);
    let mut handed = waiter.wait(EventFence::<Host>::new(stream.handle()));
    assert!((&mut handed).now_or_never().is_none(), "handed off");

    // The child takes the future from here; the parent keeps its own.
    let handed = std::cell::Cell::new(Some(handed));
    let status = in_a_fork(|| in_the_child(&waiter, handed.take().expect("once")));
    assert_eq!(
        status, 0,
        "the child's checks failed (1: its stderr says why; 142: SIGALRM, a wait hung)"
    );
    // The parent's waiter goes on, with the wait it held.
    held.open();
    futures::executor::block_on(handed.take().expect("the parent's")).unwrap();
    futures::executor::block_on(waiter.wait(EventFence::<Host>::new(stream.handle()))).unwrap();
}
