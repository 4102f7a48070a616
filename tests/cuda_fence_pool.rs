//! A context's pool of idle fence events, dropped while the context lives
//! on (kept by a `CudaContext` object the pool never saw, as another
//! library or the CUDA runtime keeps a primary context), destroys its idle
//! events instead of forgetting them: pools dropped and made again leak
//! nothing. A full pool destroys the events it has no room for.
//!
//! Its own test binary, with one test: it counts device 0's live events in
//! the fake driver (`fakeCudaLiveEvents`), which no other test may change
//! meanwhile. On a real driver the count is skipped.
#![cfg(feature = "cuda")]

mod common;

use device_events::cuda::cudarc::driver::CudaContext;
use device_events::cuda::{self, CudaStreamHandle};

use common::fake_driver;
use common::gpu::required;

#[test]
fn a_pool_dropped_while_its_context_lives_on_destroys_its_idle_events() {
    // Asked through the crate first: cudarc panics without a driver.
    match cuda::device_count() {
        Ok(count) if count > 1 => {}
        Ok(count) => {
            common::skipped::skip(
                "a_pool_dropped_while_its_context_lives_on_destroys_its_idle_events",
                format!("this check needs two CUDA devices, the driver reports {count}"),
            );
            return;
        }
        Err(err) if required() => panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}"),
        Err(err) => {
            common::skipped::skip(
                "a_pool_dropped_while_its_context_lives_on_destroys_its_idle_events",
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return;
        }
    }
    // Keeps device 0's primary context alive, and is never used by the
    // crate: the pools below never see it.
    let keeper = CudaContext::new(0).unwrap();
    let Some(before) = fake_driver::call(c"fakeCudaLiveEvents", 0) else {
        eprintln!("a real driver: the live-event count needs the fake driver");
        return;
    };
    for _ in 0..3 {
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let fences: Vec<_> = (0..8).map(|_| cuda::fence(&stream)).collect();
        for fence in fences {
            fence.wait_sync().unwrap(); // its event goes back to the pool
        }
    }
    // The pools' last handles are the registry's entries for the dropped
    // streams, swept once their shard of the registry has grown enough:
    // streams of the other device, kept alive, grow every shard until the
    // dropped pools are gone (or a bound far past that is reached).
    let other = cuda::context(1).unwrap();
    let mut kept = Vec::new();
    let mut live = fake_driver::call(c"fakeCudaLiveEvents", 0).unwrap();
    while live != before && kept.len() < 1 << 14 {
        for _ in 0..1024 {
            let stream = other.new_stream().unwrap();
            CudaStreamHandle::new(&stream);
            kept.push(stream);
        }
        live = fake_driver::call(c"fakeCudaLiveEvents", 0).unwrap();
    }
    assert_eq!(
        live,
        before,
        "idle fence events of dropped pools were forgotten while their context lived on \
         ({} streams registered since)",
        kept.len()
    );
    drop((kept, other, keeper));

    // A full pool destroys what it has no room for: a burst of fences
    // dropped at once leaves at most the pool's 512 idle events alive. On a
    // thread of its own: this one may still be bound to a context torn down.
    let kept = std::thread::spawn(|| {
        let ctx = cuda::context(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let before = fake_driver::call(c"fakeCudaLiveEvents", 0).unwrap();
        let fences: Vec<_> = (0..1000).map(|_| cuda::fence(&stream)).collect();
        drop(fences);
        fake_driver::call(c"fakeCudaLiveEvents", 0).unwrap() - before
    });
    let kept = kept.join().unwrap();
    assert!(kept <= 512, "{kept} idle events kept");
}
