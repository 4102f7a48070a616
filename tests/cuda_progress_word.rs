//! A CUDA stream's progress word: where the device supports stream memory
//! operations, each fence's record is followed by a `cuStreamWriteValue64`
//! of one more than its number into a page-locked, device-mapped word, which
//! a waiter reads with a load; the event stays the truth. Every refusal
//! (the device attribute, the allocation, the mapping, the write) turns the
//! word off and leaves fences waited on through their events; a capturing
//! stream writes no word. Word memory comes from per-context pages that are
//! never freed while the context lives (a write captured unseen into a graph
//! replays into live memory), a word held keeps its context, and no page is
//! allocated or freed inside `cuda::fence()`.
//!
//! The refusals and the counts run against the fake driver only (its hooks,
//! `fakeCudaRefuseProgressWord` and the allocation and write counts, are
//! process-wide, so every test here takes one lock); on a real GPU the
//! word's behaviour is checked where the device reports support. Skips
//! without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod common;

use std::ffi::{c_int, CStr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use device_events::cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use device_events::cuda::cudarc::driver::{CudaContext, CudaStream};
use device_events::cuda::{self, Cuda, CudaStreamHandle, FaultKernel, SleepKernel};
use device_events::{EventApi, ProgressWord, Waiter};

use common::fake_driver::{self, is_fake};
use common::gpu::required;

/// The fake's hooks here are process-wide: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn hook(name: &CStr, arg: c_int) -> Option<c_int> {
    fake_driver::call(name, arg)
}

/// Refusal bits of `fakeCudaRefuseProgressWord`.
const NO_ATTRIBUTE: c_int = 1;
const NO_ALLOCATION: c_int = 2;
const NO_MAPPING: c_int = 4;
const NO_WRITE: c_int = 8;
const NO_MAPPED_HOST_MEMORY: c_int = 16;

/// Device `ordinal`'s context and a sleep kernel, or `None` (skipping).
fn gpu(test: &str, ordinal: usize) -> Option<(Arc<CudaContext>, SleepKernel)> {
    let found =
        cuda::context(ordinal).and_then(|ctx| SleepKernel::new(&ctx).map(|kernel| (ctx, kernel)));
    match found {
        Ok(found) => Some(found),
        Err(err) if required() => panic!("{test}: DEVICE_EVENTS_REQUIRE_CUDA=1 but no GPU: {err}"),
        Err(err) => {
            common::skipped::skip(
                test,
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            None
        }
    }
}

/// Ask for `stream`'s progress word, as a spinning waiter does, and wait
/// for the crate's word thread to take one for it: the stream writes it
/// from its next fence on.
fn ask(stream: &Arc<CudaStream>) {
    let word = Cuda::stream_progress(CudaStreamHandle::new(stream));
    assert!(word.is_none(), "a word before any was asked for: {word:?}");
    assert!(
        cuda::wait_for_progress_words(Duration::from_secs(10)),
        "the word thread took no word for the stream in 10 s"
    );
}

/// A new stream, asked for its word.
fn asked(ctx: &Arc<CudaContext>) -> Arc<CudaStream> {
    let stream = ctx.new_stream().unwrap();
    ask(&stream);
    stream
}

/// Every thread's page-locked allocations and frees so far (the word
/// thread makes them).
fn page_calls() -> c_int {
    hook(c"fakeCudaHostMemoryCalls", 1).unwrap()
}

/// The stream's progress word; on a real device without stream memory
/// operations, `None` (the caller skips what needs one).
fn word_of(stream: &Arc<CudaStream>) -> Option<ProgressWord> {
    let word = Cuda::stream_progress(CudaStreamHandle::new(stream));
    assert!(
        word.is_some() || !is_fake(),
        "the fake driver supports stream memory operations: a word should be open"
    );
    if word.is_none() {
        eprintln!("this device has no progress words (no 64-bit stream memory operations)");
    }
    word
}

/// Whether `word` passes `sequence` within a generous bound: a write that
/// never lands fails the test instead of hanging it.
fn passes_soon(word: &ProgressWord, sequence: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if word.passed(sequence) {
            return true;
        }
        std::thread::yield_now();
    }
    false
}

#[test]
fn a_stream_sets_its_word_past_each_fence_once_the_work_before_it_is_done() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_stream_sets_its_word", 0) else {
        return;
    };
    let stream = asked(&ctx);
    let (work, launched) = (Duration::from_millis(200), Instant::now());
    sleep.launch(&stream, work).unwrap();
    let first = cuda::fence(&stream);
    let Some(word) = word_of(&stream) else {
        return;
    };
    sleep.launch(&stream, Duration::from_millis(1)).unwrap();
    let second = cuda::fence(&stream);
    assert_eq!(second.sequence(), first.sequence() + 1);
    // Unless this thread was descheduled for the work's whole length.
    let passed = word.passed(first.sequence());
    assert!(
        !passed || launched.elapsed() >= work,
        "the word moved before the work ended: {word:?}"
    );
    let (first_number, second_number) = (first.sequence(), second.sequence());
    first.wait_sync().unwrap();
    assert!(passes_soon(&word, first_number), "{word:?}");
    second.wait_sync().unwrap();
    assert!(passes_soon(&word, second_number), "{word:?}");
    assert!(!word.passed(second_number + 1), "{word:?}");
}

#[test]
fn a_spinning_first_poll_resolves_through_the_word_and_its_event() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_spinning_first_poll_resolves_through_the_word", 0) else {
        return;
    };
    let waiter = Waiter::builder()
        .spin_budget(Duration::from_millis(50))
        .build();
    let stream = asked(&ctx);
    for work in [
        Duration::ZERO,
        Duration::from_millis(2),
        Duration::from_millis(80),
    ] {
        let started = Instant::now();
        sleep.launch(&stream, work).unwrap();
        futures::executor::block_on(waiter.wait(cuda::fence(&stream))).unwrap();
        assert!(started.elapsed() >= work, "resolved before its work ended");
    }
}

#[test]
fn a_faulted_stream_fails_its_waits_though_a_word_is_open() {
    let _serial = serial();
    // Device 1: the fault is sticky for its context.
    let Some((ctx, sleep)) = gpu("a_faulted_stream_fails_its_waits", 1) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_faulted_stream_fails_its_waits_though_a_word_is_open",
            "on a real GPU it would poison the device for the process",
        );
        return;
    }
    let fault = FaultKernel::new(&ctx).unwrap();
    let stream = asked(&ctx);
    cuda::fence(&stream).wait_sync().unwrap();
    let word = word_of(&stream).expect("the fake opens a word");
    sleep.launch(&stream, Duration::from_millis(20)).unwrap();
    fault.launch(&stream).unwrap();
    let fence = cuda::fence(&stream);
    let sequence = fence.sequence();
    let waiter = Waiter::builder()
        .spin_budget(Duration::from_millis(50))
        .build();
    let err = futures::executor::block_on(waiter.wait(fence)).unwrap_err();
    assert!(err.is_faulted(), "{err}");
    assert!(!word.passed(sequence), "a faulted stream's word moved on");
}

/// The fake's refusals `fakeCudaRefuseProgressWord` set, until dropped
/// (a failed test leaves none set for the next).
struct Refusing(c_int);

impl Refusing {
    fn start(refused: c_int) -> Self {
        Self(hook(c"fakeCudaRefuseProgressWord", refused).unwrap())
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        hook(c"fakeCudaRefuseProgressWord", self.0);
    }
}

/// With the fake refusing `refused`, a new stream's fences open no word
/// and are still waited on, by every path, through their events; no word's
/// memory is left allocated but a page the word had before its write was
/// refused (kept for the context's life). Words come from the context's
/// pages, so a refused allocation or mapping is reached by a stream that
/// needs a new page: the streams before it take free words, held in use.
fn refused_word_falls_back_to_events(refused: c_int) {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("refused_word_falls_back_to_events", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "refused_word_falls_back_to_events",
            "only the fake driver refuses on demand",
        );
        return;
    }
    let allocations = hook(c"fakeCudaHostAllocations", 0).unwrap();
    let refusing = Refusing::start(refused);
    let needs_a_page = refused == NO_ALLOCATION || refused == NO_MAPPING;
    let mut in_use = Vec::new();
    let stream = loop {
        let before = page_calls();
        let stream = asked(&ctx);
        if !needs_a_page || page_calls() != before {
            break stream;
        }
        in_use.push(stream);
        assert!(in_use.len() < 1000, "no stream needed a new page");
    };
    let handle = CudaStreamHandle::new(&stream);
    let waiter = Waiter::builder()
        .spin_budget(Duration::from_millis(20))
        .build();
    sleep.launch(&stream, Duration::from_millis(30)).unwrap();
    let fence = cuda::fence(&stream);
    let word = Cuda::stream_progress(handle);
    let awaited = futures::executor::block_on(waiter.wait(fence));
    sleep.launch(&stream, Duration::from_millis(5)).unwrap();
    let synced = cuda::fence(&stream).wait_sync();
    let later = Cuda::stream_progress(handle);
    // Whatever the stream asked meanwhile is served while still refused.
    assert!(cuda::wait_for_progress_words(Duration::from_secs(10)));
    drop(refusing);
    let left = hook(c"fakeCudaHostAllocations", 0).unwrap() - allocations;
    // Off for good: with the refusal lifted, the stream asks for no word
    // again (it would take a page-locked page at a later wait).
    let again = Cuda::stream_progress(handle);
    assert!(cuda::wait_for_progress_words(Duration::from_secs(10)));
    cuda::fence(&stream).wait_sync().unwrap();
    let after = Cuda::stream_progress(handle);
    assert!(word.is_none(), "a refused word is off: {word:?}");
    assert!(later.is_none(), "and stays off: {later:?}");
    assert!(
        again.is_none() && after.is_none(),
        "a refused word is taken once the refusal is lifted: {again:?}, {after:?}"
    );
    awaited.unwrap();
    synced.unwrap();
    assert!(
        left <= c_int::from(refused == NO_WRITE),
        "{left} word pages left allocated (a page stays only once a word of it was taken)"
    );
}

#[test]
fn a_device_without_stream_memory_operations_waits_through_events() {
    refused_word_falls_back_to_events(NO_ATTRIBUTE);
}

#[test]
fn a_device_without_mapped_host_memory_waits_through_events() {
    refused_word_falls_back_to_events(NO_MAPPED_HOST_MEMORY);
}

#[test]
fn a_refused_word_allocation_waits_through_events() {
    refused_word_falls_back_to_events(NO_ALLOCATION);
}

#[test]
fn a_refused_device_mapping_waits_through_events_and_frees_the_allocation() {
    refused_word_falls_back_to_events(NO_MAPPING);
}

#[test]
fn a_refused_write_turns_the_word_off_and_waits_through_events() {
    refused_word_falls_back_to_events(NO_WRITE);
}

#[test]
fn a_write_refused_once_a_word_is_open_turns_it_off_for_later_fences() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_write_refused_once_a_word_is_open", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_write_refused_once_a_word_is_open_turns_it_off_for_later_fences",
            "only the fake driver refuses on demand",
        );
        return;
    }
    let stream = asked(&ctx);
    let handle = CudaStreamHandle::new(&stream);
    cuda::fence(&stream).wait_sync().unwrap();
    let word = Cuda::stream_progress(handle).expect("open");
    let previous = hook(c"fakeCudaRefuseProgressWord", NO_WRITE).unwrap();
    sleep.launch(&stream, Duration::from_millis(20)).unwrap();
    let fence = cuda::fence(&stream);
    let sequence = fence.sequence();
    let later = Cuda::stream_progress(handle);
    hook(c"fakeCudaRefuseProgressWord", previous).unwrap();
    let waiter = Waiter::builder()
        .spin_budget(Duration::from_millis(40))
        .build();
    futures::executor::block_on(waiter.wait(fence)).unwrap();
    assert!(later.is_none(), "{later:?}");
    assert!(
        !word.passed(sequence),
        "no write was queued for it: {word:?}"
    );
}

#[test]
fn a_capturing_stream_writes_no_word() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_capturing_stream_writes_no_word", 0) else {
        return;
    };
    let stream = asked(&ctx);
    cuda::fence(&stream).wait_sync().unwrap();
    let writes = || hook(c"fakeCudaStreamWrites", 0);
    let before = writes();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    sleep.launch(&stream, Duration::from_millis(1)).unwrap();
    let captured = cuda::fence(&stream);
    let during = writes();
    drop(stream.end_capture(CUgraphInstantiate_flags(0)).unwrap());
    assert!(captured.wait_sync().unwrap_err().is_stream_capture());
    assert_eq!(before, during, "a write was queued on a capturing stream");
    // After the capture the word goes on.
    let after = cuda::fence(&stream);
    let sequence = after.sequence();
    after.wait_sync().unwrap();
    if let Some(word) = word_of(&stream) {
        assert!(passes_soon(&word, sequence), "{word:?}");
    }
}

#[test]
fn words_are_reused_once_their_streams_are_gone_and_never_freed() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("words_are_reused_once_their_streams_are_gone", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "words_are_reused_once_their_streams_are_gone_and_never_freed",
            "only the fake driver counts its calls",
        );
        return;
    }
    let allocations = || hook(c"fakeCudaHostAllocations", 0).unwrap();
    let before = allocations();
    // Dropped with a write pending: its word is reused only once it landed.
    let pending = asked(&ctx);
    sleep.launch(&pending, Duration::from_millis(100)).unwrap();
    let fence = cuda::fence(&pending);
    drop((fence, pending));
    // Many streams come and go: each takes a word its predecessors no longer
    // use, so one page serves them all, and nothing is freed.
    let calls = page_calls();
    for _ in 0..300 {
        let stream = asked(&ctx);
        cuda::fence(&stream).wait_sync().unwrap();
    }
    let live = allocations() - before;
    assert!(
        live <= 1,
        "{live} word pages after 300 streams came and went"
    );
    assert!(
        page_calls() - calls <= 1,
        "page-locked allocations or frees for 300 streams' words: {}",
        page_calls() - calls
    );
    let writes = hook(c"fakeCudaWritesAfterFree", 0).unwrap();
    assert_eq!(writes, 0, "a word was freed while its write was pending");
}

#[test]
fn a_live_stream_keeps_its_word_while_other_streams_words_come_and_go() {
    let _serial = serial();
    let Some((ctx, _sleep)) = gpu("a_live_stream_keeps_its_word", 0) else {
        return;
    };
    let kept = asked(&ctx);
    cuda::fence(&kept).wait_sync().unwrap();
    if word_of(&kept).is_none() {
        return;
    }
    // No waiter holds the word now; other streams' words open (and free
    // those done with).
    for _ in 0..3 {
        cuda::fence(&asked(&ctx)).wait_sync().unwrap();
    }
    let word = word_of(&kept).expect("the live stream's word was freed");
    let fence = cuda::fence(&kept);
    let sequence = fence.sequence();
    fence.wait_sync().unwrap();
    assert!(passes_soon(&word, sequence), "{word:?}");
}

#[test]
fn a_stream_no_waiter_asked_about_writes_no_word() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_stream_no_waiter_asked_about_writes_no_word", 0) else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let writes = || hook(c"fakeCudaStreamWrites", 0);
    let before = writes();
    sleep.launch(&stream, Duration::from_millis(1)).unwrap();
    cuda::fence(&stream).wait_sync().unwrap();
    futures::executor::block_on(Waiter::builder().build().wait(cuda::fence(&stream))).unwrap();
    assert_eq!(writes(), before, "a fence wrote a word no one asked for");
    ask(&stream);
    let fence = cuda::fence(&stream);
    assert_eq!(
        writes().map(|count| count - before.unwrap_or(0)),
        before.map(|_| 1),
        "asked once, the next fence writes"
    );
    fence.wait_sync().unwrap();
}

/// New streams of `ctx`, each fenced once, taking every free word until one
/// needs a new page: the streams, with their words (kept, so none is free
/// again).
fn take_every_free_word(ctx: &Arc<CudaContext>) -> Vec<(Arc<CudaStream>, ProgressWord)> {
    let mut taken = Vec::new();
    loop {
        let pages = page_calls();
        let stream = asked(ctx);
        cuda::fence(&stream).wait_sync().unwrap();
        let word = word_of(&stream).expect("the fake opens a word");
        taken.push((stream, word));
        if page_calls() != pages {
            return taken;
        }
        assert!(taken.len() < 10_000, "no stream needed a new page");
    }
}

/// A word a reader holds is never given to another stream, though its own
/// stream is gone: the reader goes on reading that stream's last value.
#[test]
fn a_word_a_reader_holds_is_not_given_to_another_stream() {
    let _serial = serial();
    let Some((ctx, _sleep)) = gpu("a_word_a_reader_holds_is_not_given_to_another_stream", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_word_a_reader_holds_is_not_given_to_another_stream",
            "only the fake driver counts its page allocations",
        );
        return;
    }
    let stream = asked(&ctx);
    // Two fences: past the value a new stream's first fence writes.
    cuda::fence(&stream).wait_sync().unwrap();
    let fence = cuda::fence(&stream);
    let sequence = fence.sequence();
    fence.wait_sync().unwrap();
    let word = word_of(&stream).expect("the fake opens a word");
    assert!(passes_soon(&word, sequence), "{word:?}");
    let read = format!("{word:?}");
    drop(stream);
    let _taken = take_every_free_word(&ctx);
    assert_eq!(
        format!("{word:?}"),
        read,
        "the held word went to another stream"
    );
}

/// A word whose stream is gone with a write still to land is not given to
/// another stream before it lands: no new stream's word shows the old
/// stream's late value.
#[test]
fn a_word_with_a_write_to_land_is_not_given_to_another_stream() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_word_with_a_write_to_land_is_not_given_away", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_word_with_a_write_to_land_is_not_given_to_another_stream",
            "only the fake driver counts its page allocations",
        );
        return;
    }
    let stream = asked(&ctx);
    // Two fences: the late value is past what a new stream's first writes.
    cuda::fence(&stream).wait_sync().unwrap();
    sleep.launch(&stream, Duration::from_millis(200)).unwrap();
    let late = cuda::fence(&stream);
    drop(stream);
    let taken = take_every_free_word(&ctx);
    late.wait_sync().unwrap();
    let words = taken.iter().map(|(_, word)| word);
    let late_values: Vec<_> = words.filter(|word| word.passed(1)).collect();
    assert!(late_values.is_empty(), "{late_values:?}");
}

/// A capture begun (by another thread) during a fence's record may have
/// taken the word's write into its graph: the word is off from then on, and
/// later fences write none.
#[test]
fn a_capture_begun_during_a_record_turns_the_word_off() {
    let _serial = serial();
    let Some((ctx, _sleep)) = gpu("a_capture_begun_during_a_record_turns_the_word_off", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_capture_begun_during_a_record_turns_the_word_off",
            "only the fake driver makes the race on demand",
        );
        return;
    }
    let stream = asked(&ctx);
    cuda::fence(&stream).wait_sync().unwrap();
    assert!(word_of(&stream).is_some());
    hook(c"fakeCudaCaptureInNextRecord", 3).unwrap();
    let raced = cuda::fence(&stream);
    assert_ne!(
        hook(c"fakeCudaLastRecordCapture", 0),
        Some(0),
        "no capture took it"
    );
    drop(stream.end_capture(CUgraphInstantiate_flags(0)));
    assert!(raced.wait_sync().unwrap_err().is_stream_capture());
    let writes = || hook(c"fakeCudaStreamWrites", 0).unwrap();
    let before = writes();
    cuda::fence(&stream).wait_sync().unwrap();
    assert_eq!(writes(), before, "a later fence wrote the word");
    assert!(Cuda::stream_progress(CudaStreamHandle::new(&stream)).is_none());
}

/// Finding 1: another thread begins and ends a (relaxed) capture of a
/// stream between the crate's two capture checks around a fence's record,
/// so the word write goes into that thread's graph unseen. The crate cannot
/// see it; the word's memory must outlive anything that graph can do: once
/// the stream is gone and other streams' words come and go, launching the
/// graph writes into live memory (a word recycled, maybe, which only shows a
/// wrong number), never into freed memory.
#[test]
fn a_word_write_captured_unseen_never_replays_into_freed_memory() {
    let _serial = serial();
    let Some((ctx, _sleep)) = gpu("a_word_write_captured_unseen", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_word_write_captured_unseen_never_replays_into_freed_memory",
            "only the fake driver makes the race on demand",
        );
        return;
    }
    let stream = asked(&ctx);
    cuda::fence(&stream).wait_sync().unwrap();
    let word = word_of(&stream).expect("the fake opens a word");
    let captured = || hook(c"fakeCudaStreamWrites", 1).unwrap();
    let before = captured();
    hook(c"fakeCudaCaptureNextWordWrite", 1).unwrap();
    let raced = cuda::fence(&stream);
    hook(c"fakeCudaCaptureNextWordWrite", 0).unwrap();
    assert_eq!(
        captured() - before,
        1,
        "the race took no write into a graph"
    );
    // A later write lands: the word holds its stream's last queued value.
    let later = cuda::fence(&stream);
    let sequence = later.sequence();
    later.wait_sync().unwrap();
    assert!(passes_soon(&word, sequence), "{word:?}");
    raced.wait_sync().unwrap();
    drop((word, stream));
    // Other streams' words come and go (where the word of a gone stream
    // could be freed).
    for _ in 0..3 {
        let other = asked(&ctx);
        cuda::fence(&other).wait_sync().unwrap();
        cuda::fence(&other).wait_sync().unwrap();
    }
    let into_freed = hook(c"fakeCudaLaunchRaceGraph", 0).unwrap();
    assert!(into_freed >= 0, "the raced graph could not be launched");
    assert_eq!(
        into_freed, 0,
        "launching the graph wrote into freed page-locked memory"
    );
}

/// Finding 2: a `ProgressWord` is public and safe to hold; held past the
/// release of everything else of its context, it must still read its
/// stream's word (its memory alive), not freed memory.
#[test]
fn a_progress_word_held_past_its_contexts_last_release_reads_valid_memory() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("a_progress_word_held_past_its_context", 0) else {
        return;
    };
    let stream = asked(&ctx);
    let fence = cuda::fence(&stream);
    let sequence = fence.sequence();
    fence.wait_sync().unwrap();
    let Some(word) = word_of(&stream) else {
        return;
    };
    assert!(passes_soon(&word, sequence), "{word:?}");
    drop((stream, sleep, ctx));
    let retains = hook(c"fakeCudaPrimaryRetains", 0);
    assert!(
        !word.passed(1_000_000),
        "a word read past its context's release: {word:?}"
    );
    assert!(word.passed(sequence), "{word:?}");
    if let Some(retains) = retains {
        assert!(retains > 0, "the word does not hold its context");
    }
    drop(word);
}

/// The fake's page-locked calls wait for the context's work, until dropped.
struct Synchronizing(c_int);

impl Synchronizing {
    fn start() -> Self {
        Self(hook(c"fakeCudaHostMemorySynchronizes", 1).unwrap())
    }
}

impl Drop for Synchronizing {
    fn drop(&mut self) {
        hook(c"fakeCudaHostMemorySynchronizes", self.0);
    }
}

/// Page-locked allocation and free may make the context's
/// streams wait for each other ("Implicit Synchronization"). With the fake
/// making them wait for the context's work, the first fence of a newly
/// watched stream must not wait for a long kernel on another stream: no
/// allocation or free runs inside `cuda::fence()`.
#[test]
fn the_first_fence_of_a_newly_watched_stream_allocates_and_frees_nothing() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("the_first_fence_of_a_newly_watched_stream", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "the_first_fence_of_a_newly_watched_stream_allocates_and_frees_nothing",
            "only the fake driver counts and synchronizes page-locked calls",
        );
        return;
    }
    let page_calls = || hook(c"fakeCudaHostMemoryCalls", 0).unwrap();
    let busy = ctx.new_stream().unwrap();
    // Asked (as a waiter thread would): any page is had here.
    let watched = asked(&ctx);
    let kernel = Duration::from_secs(2);
    let synchronizing = Synchronizing::start();
    sleep.launch(&busy, kernel).unwrap();
    let started = Instant::now();
    let calls = page_calls();
    let fence = cuda::fence(&watched);
    let during = page_calls() - calls;
    let took = started.elapsed();
    // Another stream's first ask, with the long kernel still running; then
    // streams go and their words are reused, all outside any fence.
    let second = ctx.new_stream().unwrap();
    let calls = page_calls();
    assert!(Cuda::stream_progress(CudaStreamHandle::new(&second)).is_none());
    let second_fence = cuda::fence(&second);
    let second_during = page_calls() - calls;
    drop(synchronizing);
    assert_eq!(during, 0, "page-locked allocations or frees inside fence()");
    assert_eq!(second_during, 0, "page-locked calls inside fence()");
    assert!(
        took < kernel,
        "the first fence of a newly watched stream waited for another stream's kernel: {took:?}"
    );
    let sequence = fence.sequence();
    fence.wait_sync().unwrap();
    second_fence.wait_sync().unwrap();
    let word = word_of(&watched).expect("the fake opens a word");
    assert!(passes_soon(&word, sequence), "{word:?}");
}

/// A new stream whose first ask takes a new page: the context's free words
/// are all taken by streams kept in `held` (asked until a page is allocated,
/// then until the next, which tells how many words a page has, then as many
/// as that page has left).
fn needing_a_page(ctx: &Arc<CudaContext>, held: &mut Vec<Arc<CudaStream>>) -> Arc<CudaStream> {
    let until_a_page = |held: &mut Vec<Arc<CudaStream>>| {
        let before = page_calls();
        for asked_streams in 1..=10_000 {
            held.push(asked(ctx));
            if page_calls() != before {
                return asked_streams;
            }
        }
        panic!("no new page for 10,000 streams");
    };
    until_a_page(held);
    let per_page = until_a_page(held);
    for _ in 1..per_page {
        held.push(asked(ctx));
    }
    ctx.new_stream().unwrap()
}

/// Page-locked allocation may make the context's streams wait for each
/// other ("Implicit Synchronization", CUDA C++ Programming Guide). With the
/// fake making it wait for the context's work: a stream whose first ask
/// needs a new page, prepared before a 2 s kernel starts on another stream;
/// `measure` waits on it, then the kernel and the word thread are waited out.
/// Whatever waited for the allocation took all of the kernel; `measure`'s
/// timed bounds are half of it.
fn beside_a_word_allocation<T>(
    test: &str,
    measure: impl FnOnce(&SleepKernel, &Arc<CudaStream>) -> T,
) -> Option<T> {
    let (ctx, sleep) = gpu(test, 0)?;
    if !is_fake() {
        common::skipped::skip(
            test,
            "only the fake driver makes allocations wait on demand",
        );
        return None;
    }
    let mut held = Vec::new();
    let stream = needing_a_page(&ctx, &mut held);
    let busy = ctx.new_stream().unwrap();
    let synchronizing = Synchronizing::start();
    let calls = page_calls();
    sleep.launch(&busy, LONG_KERNEL).unwrap();
    let started = Instant::now();
    let measured = measure(&sleep, &stream);
    assert!(cuda::wait_for_progress_words(Duration::from_secs(10)));
    let allocated = started.elapsed();
    cuda::fence(&busy).wait_sync().unwrap();
    drop(synchronizing);
    // What `measure` did not wait for: one allocation, which waited for the kernel.
    assert_eq!(
        page_calls() - calls,
        1,
        "the stream's first ask took one new page"
    );
    assert!(
        allocated >= LONG_KERNEL / 2,
        "the allocation did not wait for the kernel: {allocated:?}"
    );
    Some(measured)
}

/// The other stream's kernel in [`beside_a_word_allocation`].
const LONG_KERNEL: Duration = Duration::from_secs(2);

/// The process's threads named as the crate's word thread
/// (`device-events-words`, cut to 15 bytes, so a waiter thread of the default
/// name, `device-events-waiter-n`, counts too).
fn word_threads() -> usize {
    common::threads_named("device-events-w")
}

/// One thread serves every stream's request, in turn, and leaves once none
/// is queued (`word_thread.rs`). Streams asked while it waits in a page
/// allocation (the fake makes it wait for a 2 s kernel) queue behind it:
/// none is dropped from the queue, all take words of that one page (a
/// second thread would have found no free word and allocated its own), and
/// no word thread is left once all are served.
#[test]
fn one_word_thread_serves_every_queued_stream_in_turn_and_leaves() {
    let _serial = serial();
    let test = "one_word_thread_serves_every_queued_stream_in_turn_and_leaves";
    let Some((ctx, sleep)) = gpu(test, 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            test,
            "only the fake driver makes allocations wait on demand",
        );
        return;
    }
    // Earlier tests' waiter threads leave after their keep-alive; none
    // starts here (the test holds the others off).
    common::eventually(Duration::from_secs(30), "no thread of that name", || {
        word_threads() == 0
    });
    let mut held = Vec::new();
    let first = needing_a_page(&ctx, &mut held);
    let queued: Vec<_> = (0..3).map(|_| ctx.new_stream().unwrap()).collect();
    let streams: Vec<_> = std::iter::once(first).chain(queued).collect();
    let busy = ctx.new_stream().unwrap();
    let synchronizing = Synchronizing::start();
    let calls = page_calls();
    sleep.launch(&busy, LONG_KERNEL).unwrap();
    for stream in &streams {
        assert!(Cuda::stream_progress(CudaStreamHandle::new(stream)).is_none());
    }
    assert!(cuda::wait_for_progress_words(Duration::from_secs(10)));
    cuda::fence(&busy).wait_sync().unwrap();
    drop(synchronizing);
    assert_eq!(
        page_calls() - calls,
        1,
        "one page for the streams: those queued behind the first take its words"
    );
    for stream in &streams {
        let fence = cuda::fence(stream);
        let sequence = fence.sequence();
        fence.wait_sync().unwrap();
        let word = word_of(stream).expect("every queued stream is served");
        assert!(passes_soon(&word, sequence), "{word:?}");
    }
    common::eventually(Duration::from_secs(10), "the word thread has left", || {
        word_threads() == 0
    });
}

/// A spinning first poll, on the executor's thread, of a stream whose word
/// needs a new page: it hands the stream to the crate's word thread and
/// returns within its budget, making no page-locked call.
#[test]
fn a_spinning_first_poll_waits_for_no_word_allocation() {
    let _serial = serial();
    let budget = Duration::from_millis(1);
    let measured = beside_a_word_allocation(
        "a_spinning_first_poll_waits_for_no_word_allocation",
        |sleep, stream| {
            let waiter = Waiter::builder().spin_budget(budget).build();
            let work = Duration::from_millis(200);
            let launched = Instant::now();
            sleep.launch(stream, work).unwrap();
            let mut future = waiter.wait(cuda::fence(stream));
            let calls = hook(c"fakeCudaHostMemoryCalls", 0).unwrap();
            let started = Instant::now();
            let first = futures::FutureExt::poll_unpin(
                &mut future,
                &mut std::task::Context::from_waker(futures::task::noop_waker_ref()),
            );
            let took = started.elapsed();
            // A host that kept this thread off its core past the work's end: the fence is
            // reached at the first poll, rightly.
            let outlasted = launched.elapsed() >= work;
            let calls = hook(c"fakeCudaHostMemoryCalls", 0).unwrap() - calls;
            if first.is_pending() {
                futures::executor::block_on(future).unwrap();
            }
            (first.is_pending() || outlasted, took, calls)
        },
    );
    let Some((pending, took, calls)) = measured else {
        return;
    };
    eprintln!("a first poll with a {budget:?} spin budget beside a word allocation: {took:?}");
    assert!(
        took < LONG_KERNEL / 2,
        "the first poll waited for a word allocation: {took:?}"
    );
    assert_eq!(calls, 0, "a page-locked call on the polling thread");
    assert!(pending, "the work outlasts the budget");
}

/// A watched wait of a stream whose word needs a new page ends as soon as
/// the same wait unwatched: its lane thread hands the stream to the word
/// thread and blocks in the driver at once. The ratio is printed.
#[test]
fn a_watched_wait_waits_for_no_word_allocation() {
    let _serial = serial();
    let work = Duration::from_millis(20);
    let timed = |sleep: &SleepKernel, stream: &Arc<CudaStream>, watchers: usize| {
        let waiter = Waiter::builder().watchers(watchers).build();
        sleep.launch(stream, work).unwrap();
        let fence = cuda::fence(stream);
        let started = Instant::now();
        futures::executor::block_on(waiter.wait(fence)).unwrap();
        started.elapsed()
    };
    let measured = beside_a_word_allocation(
        "a_watched_wait_waits_for_no_word_allocation",
        |sleep, stream| {
            // Unwatched first: nothing asks for the word, so the page is still to take.
            (timed(sleep, stream, 0), timed(sleep, stream, 1))
        },
    );
    let Some((unwatched, watched)) = measured else {
        return;
    };
    eprintln!(
        "a fresh stream's {work:?} wait beside a word allocation: {unwatched:?} with \
         watchers(0), {watched:?} with watchers(1) ({:.2}x)",
        watched.as_secs_f64() / unwatched.as_secs_f64()
    );
    assert!(
        watched < LONG_KERNEL / 2,
        "a watched wait waited for a word allocation: {watched:?} ({unwatched:?} unwatched)"
    );
}

/// A word's readers never wait for its writer's driver call: with a fence's
/// word write held inside the driver, asking for the stream's word returns.
#[test]
fn a_word_write_held_in_the_driver_holds_up_no_reader() {
    let _serial = serial();
    let Some((ctx, _sleep)) = gpu("a_word_write_held_in_the_driver_holds_up_no_reader", 0) else {
        return;
    };
    if !is_fake() {
        common::skipped::skip(
            "a_word_write_held_in_the_driver_holds_up_no_reader",
            "only the fake driver holds a write on demand",
        );
        return;
    }
    let stream = asked(&ctx);
    cuda::fence(&stream).wait_sync().unwrap();
    let handle = CudaStreamHandle::new(&stream);
    hook(c"fakeCudaHoldNextWrite", 1).unwrap();
    let writer = std::thread::spawn(move || cuda::fence(&stream).wait_sync());
    common::eventually(Duration::from_secs(20), "the write is held", || {
        hook(c"fakeCudaWriteHeld", 0) == Some(1)
    });
    let (read, reads) = std::sync::mpsc::channel();
    std::thread::spawn(move || read.send(Cuda::stream_progress(handle).is_some()));
    let answered = reads.recv_timeout(Duration::from_secs(20));
    hook(c"fakeCudaHoldNextWrite", 0).unwrap();
    writer.join().unwrap().unwrap();
    assert_eq!(answered, Ok(true), "the reader waited for the write");
}

/// As behaviour (timings are measured by hand, not asserted): a
/// stream with many writes queued behind a long kernel lands them all, in
/// order (the word never goes back), once the kernel ends.
#[test]
fn many_queued_word_writes_land_in_order() {
    let _serial = serial();
    let Some((ctx, sleep)) = gpu("many_queued_word_writes_land_in_order", 0) else {
        return;
    };
    let stream = asked(&ctx);
    cuda::fence(&stream).wait_sync().unwrap();
    let Some(word) = word_of(&stream) else {
        return;
    };
    let count = if is_fake() { 20_000 } else { 2_000 };
    sleep.launch(&stream, Duration::from_millis(200)).unwrap();
    let mut last = None;
    for _ in 0..count {
        let fence = cuda::fence(&stream);
        last = Some(fence.sequence());
    }
    let last = last.unwrap();
    let mut seen = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !word.passed(last) {
        let now = format!("{word:?}");
        let value: u64 = now
            .trim_start_matches("ProgressWord(")
            .trim_end_matches(')')
            .parse()
            .unwrap();
        assert!(value >= seen, "the word went back: {seen} then {value}");
        seen = value;
        assert!(
            Instant::now() < deadline,
            "the writes never landed: {word:?}"
        );
        std::thread::yield_now();
    }
}
