//! A context's pool of idle fence events, dropped while the context lives
//! on (kept by a `CudaContext` object the pool never saw, as another
//! library or the CUDA runtime keeps a primary context), destroys its idle
//! events instead of forgetting them: pools dropped and made again leak
//! nothing. A full pool destroys the events it has no room for. The pages
//! of a pool's progress words outlive it, for its context's next pool
//! alone.
//!
//! Its own test binary: it counts device 0's live events, word pages and
//! primary contexts in the fake driver, which no test may change meanwhile
//! (the tests here take one lock). On a real driver the counts are skipped.
#![cfg(feature = "cuda")]

mod common;

use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use device_events::cuda::cudarc::driver::{CudaContext, CudaStream};
use device_events::cuda::{self, Cuda, CudaStreamHandle};
use device_events::EventApi;

use common::fake_driver;
use common::gpu::required;

/// The fake's counts are process-wide: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether there are two devices (else the test skips, or fails with
/// `DEVICE_EVENTS_REQUIRE_CUDA=1` and no GPU) and the fake driver's counts.
fn two_devices_counted(test: &str) -> bool {
    // Asked through the crate first: cudarc panics without a driver.
    match cuda::device_count() {
        Ok(count) if count > 1 => {}
        Ok(count) => {
            common::skipped::skip(
                test,
                format!("this check needs two CUDA devices, the driver reports {count}"),
            );
            return false;
        }
        Err(err) if required() => panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}"),
        Err(err) => {
            common::skipped::skip(
                test,
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return false;
        }
    }
    if count(c"fakeCudaLiveEvents").is_none() {
        eprintln!("{test}: a real driver, whose counts only the fake driver keeps");
        return false;
    }
    true
}

/// Device 0's count `hook` in the fake driver (`None` on a real driver).
fn count(hook: &CStr) -> Option<i32> {
    fake_driver::call(hook, 0)
}

/// Register streams of `other`, kept alive, until `done`, or a bound far
/// past what it takes: a pool's last handles are the registry's entries for
/// its dropped streams, swept once their shard of the registry has grown
/// enough. The streams registered.
fn sweep_until(other: &Arc<CudaContext>, mut done: impl FnMut() -> bool) -> usize {
    let mut kept = Vec::new();
    while !done() && kept.len() < 1 << 14 {
        for _ in 0..1024 {
            let stream = other.new_stream().unwrap();
            CudaStreamHandle::new(&stream);
            kept.push(stream);
        }
    }
    kept.len()
}

#[test]
fn a_pool_dropped_while_its_context_lives_on_destroys_its_idle_events() {
    let _serial = serial();
    if !two_devices_counted("a_pool_dropped_while_its_context_lives_on_destroys_its_idle_events") {
        return;
    }
    // Keeps device 0's primary context alive, and is never used by the
    // crate: the pools below never see it.
    let keeper = CudaContext::new(0).unwrap();
    let before = count(c"fakeCudaLiveEvents").unwrap();
    for _ in 0..3 {
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let fences: Vec<_> = (0..8).map(|_| cuda::fence(&stream)).collect();
        for fence in fences {
            fence.wait_sync().unwrap(); // its event goes back to the pool
        }
    }
    let other = cuda::context(1).unwrap();
    let live = || count(c"fakeCudaLiveEvents").unwrap();
    let registered = sweep_until(&other, || live() == before);
    assert_eq!(
        live(),
        before,
        "idle fence events of dropped pools were forgotten while their context lived on \
         ({registered} streams registered since)"
    );
    drop((other, keeper));

    // A full pool destroys what it has no room for: a burst of fences
    // dropped at once leaves at most the pool's 512 idle events alive. On a
    // thread of its own: this one may still be bound to a context torn down.
    let kept = std::thread::spawn(|| {
        let ctx = cuda::context(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let before = count(c"fakeCudaLiveEvents").unwrap();
        let fences: Vec<_> = (0..1000).map(|_| cuda::fence(&stream)).collect();
        drop(fences);
        count(c"fakeCudaLiveEvents").unwrap() - before
    });
    let kept = kept.join().unwrap();
    assert!(kept <= 512, "{kept} idle events kept");
}

/// A new stream of `ctx`, asked for its progress word, with one fence
/// waited on (its event idle in the stream's pool) whose word write landed.
fn stream_with_word(ctx: &Arc<CudaContext>) -> Arc<CudaStream> {
    let stream = ctx.new_stream().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    assert!(
        Cuda::stream_progress(handle).is_none(),
        "a word before any was asked for"
    );
    assert!(
        cuda::wait_for_progress_words(Duration::from_secs(10)),
        "the word thread took no word for the stream in 10 s"
    );
    let fence = cuda::fence(&stream);
    let sequence = fence.sequence();
    fence.wait_sync().unwrap();
    let word = Cuda::stream_progress(handle).expect("the fake opens a word");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !word.passed(sequence) {
        assert!(
            std::time::Instant::now() < deadline,
            "the word never passed: {word:?}"
        );
        std::thread::yield_now();
    }
    stream
}

/// A progress word's page is never freed while its context lives (a graph
/// may replay a write into it): it outlives its pool, and the context's
/// next pool takes it back. A later context of the device never does (the
/// page went with the old one), and a pool that goes after its context
/// does not make the device's primary context again to find that out.
#[test]
fn word_pages_outlive_their_pool_for_their_context_alone() {
    let _serial = serial();
    if !two_devices_counted("word_pages_outlive_their_pool_for_their_context_alone") {
        return;
    }
    let other = cuda::context(1).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let live = || count(c"fakeCudaLiveEvents").unwrap();
    let pages = || count(c"fakeCudaHostAllocations").unwrap();
    let idle = live();
    drop(stream_with_word(&ctx));
    let page = pages();
    // The pool goes (destroying its idle event, as its context lives on),
    // and its page waits for the context's next pool.
    sweep_until(&other, || live() == idle);
    assert_eq!(live(), idle, "the first stream's pool never went");
    drop(stream_with_word(&ctx));
    assert_eq!(pages(), page, "the context's next pool took a new page");
    sweep_until(&other, || live() == idle);
    assert_eq!(live(), idle, "the second stream's pool never went");

    // A pool with an idle event outlives its context.
    let stream = ctx.new_stream().unwrap();
    cuda::fence(&stream).wait_sync().unwrap();
    drop((stream, ctx));
    assert_eq!(
        count(c"fakeCudaPrimaryRetains"),
        Some(0),
        "device 0's context lives on"
    );
    let (made, asks) = (
        count(c"fakeCudaPrimaryMade"),
        count(c"fakeCudaPrimaryStateAsks"),
    );
    sweep_until(&other, || count(c"fakeCudaPrimaryStateAsks") != asks);
    assert_ne!(
        count(c"fakeCudaPrimaryStateAsks"),
        asks,
        "the last pool never went"
    );
    assert_eq!(
        count(c"fakeCudaPrimaryMade"),
        made,
        "a pool that went after its context made the device's primary context again"
    );

    // The device's next context writes its words into pages of its own.
    let written = fake_driver::call(c"fakeCudaWritesAfterFree", 0).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = stream_with_word(&ctx);
    assert_eq!(
        fake_driver::call(c"fakeCudaWritesAfterFree", 0),
        Some(written),
        "a word of the device's old context was written after its memory was freed"
    );
    assert_eq!(pages(), 1, "the new context's word is on a page of its own");
    drop((stream, ctx, other));
}
