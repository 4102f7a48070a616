//! Device memory through cudarc's safe API, as a service's CUDA path uses it:
//! allocation, copies each way, sets, and the order of copies on streams
//! (behind device work, across streams with cudarc's event tracking, into
//! page-locked memory read after a fence). Misuse is answered with an error.
//!
//! Runs on a GPU and on the fake driver (`scripts/fake-cuda.sh`, which also
//! runs it with `FAKE_CUDA_NO_MEMORY_POOLS=1`: cudarc's synchronous
//! allocation and free). Skips without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1`
//! fails instead.
#![cfg(feature = "cuda")]
// The misuse test calls the driver directly, through cudarc's `result` and
// `sys` layers; each unsafe block has a SAFETY note.
#![allow(unsafe_code)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use device_events::cuda;
use device_events::cuda::cudarc::driver::{
    result, sys, CudaContext, CudaSlice, DevicePtr, DriverError,
};
use device_events::Waiter;

use common::fake_driver::is_fake;
use common::gpu::gpu;

/// Device work that a copy queued after it must wait for.
const SLEEP: Duration = Duration::from_millis(300);
const LEN: usize = 4096;

fn values(seed: u32) -> Vec<u32> {
    (0..LEN as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

fn status(result: Result<(), DriverError>) -> sys::CUresult {
    match result {
        Ok(()) => sys::CUresult::CUDA_SUCCESS,
        Err(err) => err.0,
    }
}

#[test]
fn alloc_zeros_reads_back_zeros() {
    let Some((ctx, _)) = gpu("alloc_zeros_reads_back_zeros") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let zeros = stream.alloc_zeros::<u32>(LEN).unwrap();
    assert_eq!(stream.clone_dtoh(&zeros).unwrap(), vec![0; LEN]);
}

#[test]
fn htod_then_dtoh_round_trips_the_bytes() {
    let Some((ctx, _)) = gpu("htod_then_dtoh_round_trips_the_bytes") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let sent = values(1);
    let on_device = stream.clone_htod(&sent).unwrap();
    assert_eq!(stream.clone_dtoh(&on_device).unwrap(), sent);
    // Into an existing buffer, and back through a view of part of it.
    let mut again = unsafe_alloc(&stream);
    stream.memcpy_htod(&values(2), &mut again).unwrap();
    let mut part = vec![0u32; 100];
    stream
        .memcpy_dtoh(&again.slice(50..150), &mut part)
        .unwrap();
    assert_eq!(part, values(2)[50..150]);
}

/// `LEN` uninitialised values on `stream`.
fn unsafe_alloc(
    stream: &std::sync::Arc<device_events::cuda::cudarc::driver::CudaStream>,
) -> CudaSlice<u32> {
    // SAFETY: `u32` is valid for any bits; every caller writes the memory
    // before it reads it.
    unsafe { stream.alloc::<u32>(LEN) }.unwrap()
}

#[test]
fn memset_sets_the_bytes() {
    let Some((ctx, _)) = gpu("memset_sets_the_bytes") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let mut buffer = stream.clone_htod(&vec![u32::MAX; LEN]).unwrap();
    stream.memset_zeros(&mut buffer.slice_mut(10..20)).unwrap();
    let read = stream.clone_dtoh(&buffer).unwrap();
    for (i, value) in read.iter().enumerate() {
        let expected = if (10..20).contains(&i) { 0 } else { u32::MAX };
        assert_eq!(*value, expected, "value {i}");
    }
}

/// A copy into page-locked memory queued behind a sleep runs when the sleep
/// ends, not when queued: a write to its source made (on another stream)
/// after the copy was queued but before the sleep ended is what the host
/// reads once the fence behind the copy has passed.
#[test]
fn dtoh_behind_a_sleep_copies_when_the_stream_gets_there() {
    let Some((ctx, sleep)) = gpu("dtoh_behind_a_sleep_copies_when_the_stream_gets_there") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let (before, after) = (values(3), values(4));
    // A loaded host may take longer than the sleep between queueing the copy
    // and the other stream's write: such a round proves nothing, and the
    // next sleeps twice as long.
    let mut time = SLEEP;
    for _round in 0..5 {
        let src = stream.clone_htod(&before).unwrap();
        // SAFETY: `u32` is valid for any bits; the host reads it only after
        // the fence behind the copy that writes all of it.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<u32>(LEN, 0) }.unwrap();
        sleep.launch(&stream, time).unwrap();
        stream.memcpy_dtoh(&src, &mut host).unwrap();
        let fence = cuda::fence(&stream);
        {
            // The other stream overwrites the source while the sleep runs,
            // with no order against the copy (a raw copy: cudarc would order
            // it after the copy's read).
            let (src_ptr, _read) = src.device_ptr(&other);
            // SAFETY: `src_ptr` is a live allocation of `LEN` `u32`s, and
            // `after` (`LEN` values) outlives the copy: `other` is
            // synchronized before it is dropped.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    src_ptr,
                    after.as_ptr().cast(),
                    LEN * 4,
                    other.cu_stream(),
                )
            }
            .result()
            .unwrap();
        }
        other.synchronize().unwrap();
        if fence.is_complete().unwrap() {
            time *= 2;
            continue;
        }
        futures::executor::block_on(fence.wait()).unwrap();
        assert_eq!(host.as_slice().unwrap(), after.as_slice());
        return;
    }
    panic!("the sleep always ended before the other stream's write: the host is too loaded");
}

/// A copy queued on one stream and awaited with a fence: the bytes are
/// there, read with `clone_dtoh` after the await.
#[test]
fn clone_dtoh_after_a_fence_reads_what_the_stream_wrote() {
    let Some((ctx, sleep)) = gpu("clone_dtoh_after_a_fence_reads_what_the_stream_wrote") else {
        return;
    };
    let stream = ctx.new_stream().unwrap();
    let mut on_device = stream.alloc_zeros::<u32>(LEN).unwrap();
    sleep.launch(&stream, SLEEP).unwrap();
    stream.memcpy_htod(&values(5), &mut on_device).unwrap();
    futures::executor::block_on(cuda::fence(&stream).wait()).unwrap();
    assert_eq!(stream.clone_dtoh(&on_device).unwrap(), values(5));
}

/// cudarc's event tracking orders a copy on one stream after the write of
/// its source on another: the second stream's copy waits for the first's
/// sleep and upload.
#[test]
fn dtod_across_streams_waits_for_the_source_write() {
    let Some((ctx, sleep)) = gpu("dtod_across_streams_waits_for_the_source_write") else {
        return;
    };
    let writer = ctx.new_stream().unwrap();
    let reader = ctx.new_stream().unwrap();
    let mut source = writer.alloc_zeros::<u32>(LEN).unwrap();
    sleep.launch(&writer, SLEEP).unwrap();
    writer.memcpy_htod(&values(6), &mut source).unwrap();
    let mut copy = reader.alloc_zeros::<u32>(LEN).unwrap();
    reader.memcpy_dtod(&source, &mut copy).unwrap();
    let also = reader.clone_dtod(&source).unwrap();
    assert_eq!(reader.clone_dtoh(&copy).unwrap(), values(6));
    assert_eq!(reader.clone_dtoh(&also).unwrap(), values(6));
}

/// The synchronous forms (legacy default stream): allocation, copies each
/// way and a set, then a free.
#[test]
fn synchronous_copies_and_sets_round_trip() {
    let Some((ctx, _)) = gpu("synchronous_copies_and_sets_round_trip") else {
        return;
    };
    ctx.bind_to_thread().unwrap();
    let sent = values(7);
    let mut read = vec![0u32; LEN];
    // SAFETY: every pointer is a live allocation of `LEN * 4` bytes (or a
    // host buffer of `LEN` `u32`s), and the synchronous forms have finished
    // with the host buffers when they return (a copy to the host "returns
    // only once the copy has completed"; one from pageable memory once it
    // is staged).
    unsafe {
        let dptr = result::malloc_sync(LEN * 4).unwrap();
        result::memcpy_htod_sync(dptr, &sent).unwrap();
        result::memset_d8_sync(dptr, 0x11, 8).unwrap();
        let copy = result::malloc_sync(LEN * 4).unwrap();
        sys::cuMemcpyDtoD_v2(copy, dptr, LEN * 4).result().unwrap();
        result::memcpy_dtoh_sync(&mut read, copy).unwrap();
        result::free_sync(copy).unwrap();
        result::free_sync(dptr).unwrap();
    }
    assert_eq!(read[..2], [0x1111_1111, 0x1111_1111]);
    assert_eq!(read[2..], sent[2..]);
}

/// Misuse of device memory is an error from the driver, not a crash.
#[test]
fn misuse_is_an_error() {
    let Some((ctx, _)) = gpu("misuse_is_an_error") else {
        return;
    };
    ctx.bind_to_thread().unwrap();
    let mut host = vec![0u8; 128];
    // SAFETY: every call is given pointers the fake checks (null, unknown,
    // freed, or ranges past an allocation); each host buffer outlives its
    // call and is as long as the count given.
    unsafe {
        // "If bytesize is 0, cuMemAlloc() returns CUDA_ERROR_INVALID_VALUE."
        let mut dptr = 0;
        assert_eq!(
            sys::cuMemAlloc_v2(&mut dptr, 0),
            sys::CUresult::CUDA_ERROR_INVALID_VALUE
        );
        if !is_fake() {
            // The rest is the fake's reading of what the driver leaves
            // undefined (a real driver may fault instead).
            return;
        }
        let invalid = sys::CUresult::CUDA_ERROR_INVALID_VALUE;
        let to_host = |src: sys::CUdeviceptr, bytes: usize, host: &mut [u8]| {
            sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), src, bytes)
        };
        assert_eq!(to_host(0, 16, &mut host), invalid, "a null device pointer");
        assert_eq!(
            to_host(0x1234_5678, 16, &mut host),
            invalid,
            "an unknown one"
        );
        let dptr = result::malloc_sync(64).unwrap();
        assert_eq!(to_host(dptr, 128, &mut host), invalid, "past the end");
        assert_eq!(
            to_host(dptr + 32, 64, &mut host),
            invalid,
            "running past the end"
        );
        assert_eq!(
            sys::cuMemcpyDtoH_v2(std::ptr::null_mut(), dptr, 16),
            invalid,
            "a null host pointer"
        );
        assert_eq!(
            sys::cuMemsetD32_v2(dptr + 1, 7, 4),
            invalid,
            "a misaligned 32-bit set"
        );
        assert_eq!(
            status(result::free_sync(dptr + 8)),
            invalid,
            "not its start"
        );
        result::free_sync(dptr).unwrap();
        assert_eq!(status(result::free_sync(dptr)), invalid, "freed twice");
        assert_eq!(to_host(dptr, 16, &mut host), invalid, "a freed pointer");
        // Another context's memory (the fake has two devices) is found by its
        // address, as with unified addressing: read and freed with this
        // context current.
        let other = cuda::context(1).unwrap();
        let theirs = {
            other.bind_to_thread().unwrap();
            result::malloc_sync(64).unwrap()
        };
        ctx.bind_to_thread().unwrap();
        assert_eq!(
            to_host(theirs, 16, &mut host),
            sys::CUresult::CUDA_SUCCESS,
            "another context's"
        );
        result::free_sync(theirs).unwrap();
        // No context to allocate in: none is current on a new thread.
        let unbound = std::thread::spawn(|| {
            let mut dptr = 0;
            sys::cuMemAlloc_v2(&mut dptr, 64)
        });
        assert_eq!(
            unbound.join().unwrap(),
            sys::CUresult::CUDA_ERROR_INVALID_CONTEXT,
            "allocated with no context current"
        );
        ctx.bind_to_thread().unwrap();
    }
    // The context still works.
    let stream = ctx.new_stream().unwrap();
    let on_device = stream.clone_htod(&values(8)).unwrap();
    assert_eq!(stream.clone_dtoh(&on_device).unwrap(), values(8));
}

/// A service's requests on a multi-thread tokio runtime, each in a task of
/// its own: upload, a short kernel, a copy back into page-locked memory, an
/// await of the fence behind it on the service's own waiter, then the
/// bytes checked and the device memory dropped wherever the task resumed.
/// One more slice is dropped on a thread that never bound any context.
/// cudarc frees a slice on drop without binding its context (when it
/// tracks no events for it): every free must still succeed, and be
/// recorded by cudarc as no error. With `tracking` the context tracks
/// events (cudarc's default); without, it does not (cudarc's advice for
/// one stream per slice), so the drop makes no call that binds.
fn service_drops_device_memory_on_any_thread(test: &str, tracking: bool, streams: usize) {
    let Some((shared, sleep)) = gpu(test) else {
        return;
    };
    // A context of the test's own (the same device's primary context), so
    // the errors cudarc records on it are this test's alone.
    let ctx = CudaContext::new(shared.ordinal()).unwrap();
    if !tracking {
        // SAFETY: each slice is used on the one stream it was made on.
        unsafe { ctx.disable_event_tracking() };
    }
    let streams: Vec<_> = (0..streams).map(|_| ctx.new_stream().unwrap()).collect();
    let waiter = Arc::new(Waiter::builder().build());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(3)
        .enable_all()
        .build()
        .unwrap();
    let freed: Vec<sys::CUdeviceptr> = runtime.block_on(async {
        let tasks: Vec<_> = (0..32u32)
            .map(|task| {
                let stream = streams[task as usize % streams.len()].clone();
                let waiter = waiter.clone();
                tokio::spawn(async move {
                    let sent = values(100 + task);
                    let on_device = stream.clone_htod(&sent).unwrap();
                    sleep.launch(&stream, Duration::from_millis(5)).unwrap();
                    // SAFETY: `u32` is valid for any bits; the host reads it
                    // only after the fence behind the copy that writes all
                    // of it.
                    let mut host =
                        unsafe { stream.context().alloc_pinned_with_flags::<u32>(LEN, 0) }.unwrap();
                    stream.memcpy_dtoh(&on_device, &mut host).unwrap();
                    waiter.wait(cuda::fence(&stream)).await.unwrap();
                    assert_eq!(host.as_slice().unwrap(), sent.as_slice(), "task {task}");
                    let ptr = on_device.device_ptr(&stream).0;
                    drop(on_device);
                    ptr
                })
            })
            .collect();
        let mut freed = Vec::new();
        for task in tasks {
            freed.push(task.await.unwrap());
        }
        freed
    });
    drop(runtime);
    let last = streams[0].clone_htod(&values(99)).unwrap();
    let last_ptr = last.device_ptr(&streams[0]).0;
    std::thread::spawn(move || drop(last)).join().unwrap();
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(
        ctx.check_err(),
        Ok(()),
        "an error cudarc recorded in a drop"
    );
    if is_fake() {
        // Each slice was freed: the fake never hands an address out twice,
        // so a freed one is refused.
        ctx.bind_to_thread().unwrap();
        for ptr in freed.into_iter().chain([last_ptr]) {
            let mut byte = 0u8;
            // SAFETY: `byte` outlives the synchronous copy of one byte.
            let copied = unsafe { sys::cuMemcpyDtoH_v2((&mut byte as *mut u8).cast(), ptr, 1) };
            assert_eq!(
                copied,
                sys::CUresult::CUDA_ERROR_INVALID_VALUE,
                "{ptr:#x} still allocated"
            );
        }
    }
    waiter.shutdown();
}

#[test]
fn tasks_drop_device_memory_on_any_worker_thread() {
    service_drops_device_memory_on_any_thread(
        "tasks_drop_device_memory_on_any_worker_thread",
        true,
        4,
    );
}

#[test]
fn tasks_drop_untracked_device_memory_on_any_worker_thread() {
    service_drops_device_memory_on_any_thread(
        "tasks_drop_untracked_device_memory_on_any_worker_thread",
        false,
        1,
    );
}
