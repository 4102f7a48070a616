//! Two threads fencing one CUDA stream: each fence's sequence (the order the
//! waiter serves a stream's waits in) must follow the order of the records
//! themselves. Numbered after `cuEventRecord` returned, two records could
//! take their numbers the other way round, and a waiter lane would block on
//! the newer record first.
//!
//! The fake driver numbers each stream's records and tells a thread the
//! number of its last one (`fakeCudaLastRecordNumber`); on a real driver the
//! fences are made and awaited, without the order check. Skips without a
//! GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead.
// The fake driver's hook through `common::fake_driver`.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod common;

use std::ffi::c_int;
use std::sync::{Arc, Barrier};

use device_events::cuda::{self, CudaFence};

use common::fake_driver;

/// Fences per thread: enough that records of the two threads interleave
/// many times over.
const FENCES: usize = if cfg!(miri) { 10 } else { 20_000 };

#[test]
fn two_threads_fencing_one_stream_get_sequences_in_record_order() {
    let stream = match cuda::context(0).and_then(|ctx| Ok(ctx.new_stream()?)) {
        Ok(stream) => stream,
        Err(err) if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}")
        }
        Err(err) => {
            common::skipped::skip(
                "two_threads_fencing_one_stream_get_sequences_in_record_order",
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return;
        }
    };
    // The calling thread's last record number, or `None` on a real driver.
    let last_record = || fake_driver::call(c"fakeCudaLastRecordNumber", 0);
    // Up front, before the threads: on the fake driver this panics if the
    // hook is missing.
    last_record();
    let start = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let (stream, start) = (stream.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                // Every fence is kept until the end: a fence event given back
                // to the pool would be recorded again, by another fence.
                (0..FENCES)
                    .map(|_| {
                        let fence = cuda::fence(&stream);
                        assert!(!fence.is_resolved_at_creation(), "{fence:?} not recorded");
                        let record = last_record();
                        (fence.sequence(), record, fence)
                    })
                    .collect::<Vec<(u64, Option<c_int>, CudaFence)>>()
            })
        })
        .collect();
    let mut fences: Vec<_> = threads
        .into_iter()
        .flat_map(|thread| thread.join().unwrap())
        .collect();
    fences.sort_by_key(|(sequence, _, _)| *sequence);
    let inversions = fences
        .windows(2)
        .filter(|pair| pair[0].1 > pair[1].1)
        .count();
    assert_eq!(
        inversions,
        0,
        "{inversions} fences of {} took a smaller sequence than a record made before them",
        fences.len()
    );
    let last = fences.pop().unwrap().2;
    last.wait_sync().unwrap();
}
