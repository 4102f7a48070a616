//! Work split across streams and joined with `futures::join!`, with a
//! device-side dependency between two of them.
//!
//! Four streams each sum the squares of a quarter of a vector; a fifth
//! stream combines the first two partial sums, ordered behind them on the
//! device (`wait_async`), not by the host. The host awaits the combine and the
//! two remaining streams together. Runs on the host backend (real work); with
//! a GPU present, it also shows the same shape on CUDA streams.
//!
//! `cargo run --example join_streams`

use std::sync::{Arc, Mutex};

use device_events::host::{Host, HostStream};
use device_events::{EventFence, ServerError};

const N: u64 = 4_000_000;
const PARTS: usize = 4;

fn main() -> Result<(), ServerError> {
    let data: Arc<Vec<u64>> = Arc::new((0..N).collect());
    let partials = Arc::new(Mutex::new([0u64; PARTS]));
    let combined = Arc::new(Mutex::new(0u64));
    let streams = (0..PARTS)
        .map(|_| HostStream::new())
        .collect::<Result<Vec<_>, _>>()?;
    let combine = HostStream::new()?;

    let chunk = data.len() / PARTS;
    for (part, stream) in streams.iter().enumerate() {
        let (data, partials) = (data.clone(), partials.clone());
        stream.launch(move || {
            let sum = data[part * chunk..(part + 1) * chunk]
                .iter()
                .map(|x| x * x % 1_000_003)
                .sum();
            partials.lock().unwrap()[part] = sum;
        })?;
    }

    // The combine stream waits for streams 0 and 1 on the device: the host
    // queues the dependency and moves on.
    EventFence::<Host>::new(streams[0].handle()).wait_async(combine.handle())?;
    EventFence::<Host>::new(streams[1].handle()).wait_async(combine.handle())?;
    {
        let (partials, combined) = (partials.clone(), combined.clone());
        combine.launch(move || {
            let partials = partials.lock().unwrap();
            *combined.lock().unwrap() = partials[0] + partials[1];
        })?;
    }

    let (joined, third, fourth) = futures::executor::block_on(async {
        futures::join!(
            EventFence::<Host>::new(combine.handle()).wait(),
            EventFence::<Host>::new(streams[2].handle()).wait(),
            EventFence::<Host>::new(streams[3].handle()).wait(),
        )
    });
    joined?;
    third?;
    fourth?;

    let partials = partials.lock().unwrap();
    let total = *combined.lock().unwrap() + partials[2] + partials[3];
    let expected: u64 = data.iter().map(|x| x * x % 1_000_003).sum();
    println!("host streams: total {total} (expected {expected})");
    assert_eq!(total, expected, "the combine ran after streams 0 and 1");

    #[cfg(feature = "cuda")]
    gpu::run();
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::time::{Duration, Instant};

    use device_events::cuda::{self, CudaStreamHandle, SleepKernel};
    use device_events::ServerError;

    /// The same shape on CUDA streams, with sleep kernels as the work.
    pub fn run() {
        match try_run() {
            Ok(()) => {}
            Err(err) if err.is_unavailable() => println!("CUDA: skipped ({err})"),
            Err(err) => println!("CUDA: failed: {err}"),
        }
    }

    fn try_run() -> Result<(), ServerError> {
        let ctx = cuda::context(0)?;
        let sleep = SleepKernel::new(&ctx)?;
        let streams = (0..4)
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()?;
        let combine = ctx.new_stream()?;
        let started = Instant::now();
        for (i, stream) in streams.iter().enumerate() {
            sleep.launch(stream, Duration::from_millis(10 * (i as u64 + 1)))?;
        }
        cuda::fence(&streams[0]).wait_async(CudaStreamHandle::new(&combine))?;
        cuda::fence(&streams[1]).wait_async(CudaStreamHandle::new(&combine))?;
        sleep.launch(&combine, Duration::from_millis(5))?;
        let (a, b, c) = futures::executor::block_on(async {
            futures::join!(
                cuda::fence(&combine).wait(),
                cuda::fence(&streams[2]).wait(),
                cuda::fence(&streams[3]).wait(),
            )
        });
        a?;
        b?;
        c?;
        println!(
            "CUDA streams: joined after {:?} (longest stream 40 ms, combine 20 + 5 ms)",
            started.elapsed()
        );
        Ok(())
    }
}
