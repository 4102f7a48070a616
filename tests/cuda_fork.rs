//! CUDA in a forked child: "Any use of CUDA after a call to fork and before
//! a subsequent call to exec has undefined behavior" (NVIDIA's CUDA C++
//! guidelines), and the child has only the thread that forked, so a lock of
//! the crate's that a parent thread held at the fork stays held there. A
//! fence, a handle, a drop or a context in the child fails at once (or
//! forgets what it holds), making no CUDA call, and a progress word is not
//! read (its page-locked mapping is the parent's); nothing hangs.
//!
//! One test in its own binary: a fork copies whatever locks other threads
//! held at that moment, and here no other test's threads run. It holds a
//! record inside the driver across the fork with the fake driver's hook
//! (`fakeCudaHoldNextRecord`); on a real driver it skips.
#![cfg(all(unix, feature = "cuda"))]

mod common;

use std::time::Duration;

use device_events::cuda::cudarc::driver::CudaContext;
use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
use device_events::{EventApi, Waiter};

use common::fake_driver;
use common::fork::in_a_fork;
use common::gpu::gpu;

const LIMIT: Duration = Duration::from_secs(20);

#[test]
fn cuda_in_a_forked_child_fails_at_once_and_never_hangs() {
    let Some((ctx, _)) = gpu("cuda_in_a_forked_child_fails_at_once_and_never_hangs") else {
        return;
    };
    if !fake_driver::is_fake() {
        eprintln!("a real driver: holding a record across the fork needs the fake driver's hook");
        return;
    }
    // A kernel holding the last handle of a context object of its own
    // (loaded first: a load waits for the context's work).
    let kernel = SleepKernel::new(&CudaContext::new(0).unwrap()).unwrap();
    let stream = ctx.new_stream().unwrap();
    // A progress word open in the parent, read in the child.
    let handle = CudaStreamHandle::new(&stream);
    assert!(Cuda::stream_progress(handle).is_none(), "the first ask");
    assert!(cuda::wait_for_progress_words(LIMIT));
    let passed = cuda::fence(&stream);
    let passed_at = passed.sequence();
    passed.wait_sync().unwrap();
    let word = Cuda::stream_progress(handle).expect("the fake opens a word");
    common::eventually(LIMIT, "the word passes its fence", || {
        word.passed(passed_at)
    });
    // Made in the parent, waited on and dropped in the child.
    let fence = cuda::fence(&stream);
    let waiter = Waiter::builder().build();
    // A record held inside the driver, on another thread, across the fork:
    // that thread holds the stream's lock of the crate's meanwhile.
    fake_driver::call(c"fakeCudaHoldNextRecord", 1);
    let recording = {
        let stream = stream.clone();
        std::thread::spawn(move || cuda::fence(&stream).wait_sync())
    };
    common::eventually(LIMIT, "the record is held in the driver", || {
        fake_driver::call(c"fakeCudaRecordHeld", 0) == Some(1)
    });
    let status = in_a_fork(|| {
        let refused = cuda::fence(&stream);
        let err = refused.wait_sync().expect_err("a fence in the child");
        if !(err.is_unavailable() && err.to_string().contains("fork")) {
            return Err(format!("a fence in the child failed with {err}"));
        }
        // The driver's mappings are the parent's: the word is not read.
        if word.passed(passed_at) {
            return Err("a progress word read in the child says its fence passed".to_owned());
        }
        let handle = CudaStreamHandle::new(&stream);
        if handle.stream().is_some() {
            return Err("a handle made in the child names a stream".to_owned());
        }
        // Made in the parent: its wait fails at once, and its drop (here)
        // forgets its event rather than calling the driver (the fake driver
        // aborts a forked child that calls it).
        let err = fence
            .wait_sync()
            .expect_err("a parent's fence in the child");
        if !err.is_unavailable() {
            return Err(format!("a parent's fence in the child failed with {err}"));
        }
        // The crate holds that context object's last handle: dropped here,
        // it is forgotten rather than released (cudarc's drop calls the driver).
        drop(kernel);
        match cuda::context(0) {
            Err(err) if err.is_unavailable() => {}
            other => return Err(format!("cuda::context in the child answered {other:?}")),
        }
        match waiter.wait(cuda::fence(&stream)).wait_sync_timeout(LIMIT) {
            Some(Err(_)) => Ok(()),
            other => Err(format!("an await in the child answered {other:?}")),
        }
    });
    fake_driver::call(c"fakeCudaHoldNextRecord", 0);
    assert_eq!(
        status, 0,
        "the child's checks failed (1: its stderr says why; 134: it called the fake driver; \
         142: SIGALRM, something hung)"
    );
    recording.join().unwrap().unwrap();
    cuda::fence(&stream).wait_sync().unwrap();
}
