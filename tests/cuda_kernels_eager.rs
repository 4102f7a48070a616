//! The crate's kernels are loaded when made, not at their first launch. Under
//! lazy loading (the default on Linux since CUDA 12.2) a kernel's first
//! launch may load it, and a load "might require context synchronization"
//! (CUDA C++ Programming Guide, "Lazy Loading"): that launch would wait for
//! every other stream of the context. `SleepKernel::new` finishes the load
//! (`cuFuncLoad` where the driver has it), so a first launch waits for no
//! other stream.
//!
//! One test in a binary of its own: making a kernel loads a module, which
//! synchronizes the context, so it would end other tests' sleeps early. On
//! the fake driver (`tests/fake_cuda/libcuda.c`), which loads a function at
//! its first launch unless `cuFuncLoad` loaded it, with the wait of a module
//! load. Skips without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead.
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use device_events::cuda::{self, SleepKernel};

use common::gpu::gpu;

/// Long enough that a launch returning before it ends did not wait for it.
const LONG: Duration = Duration::from_secs(2);

#[test]
fn a_kernels_first_launch_waits_for_no_other_stream() {
    let Some((ctx, busy)) = gpu("a_kernels_first_launch_waits_for_no_other_stream") else {
        return;
    };
    // Made while the context is idle: its module load has nothing to wait for.
    let fresh = SleepKernel::new(&ctx).unwrap();
    let other = ctx.new_stream().unwrap();
    busy.launch(&other, LONG).unwrap();
    let other_done = cuda::fence(&other);
    assert!(!other_done.is_complete().unwrap(), "the other stream runs");

    let stream = ctx.new_stream().unwrap();
    fresh.launch(&stream, Duration::from_millis(1)).unwrap();
    assert!(
        !other_done.is_complete().unwrap(),
        "the kernel's first launch waited for another stream's work: it was loaded at the launch, \
         not when made"
    );
    cuda::fence(&stream).wait_sync().unwrap();
    other_done.wait_sync().unwrap();
}
