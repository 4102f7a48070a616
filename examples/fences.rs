//! Two streams, a device-side dependency between them, and a host wait.
//!
//! `cargo run --example fences` runs on CUDA when a GPU is present and on the
//! host backend otherwise, and says which.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use device_events::host::{Host, HostStream};
use device_events::{EventFence, ServerError};

const PRODUCE: Duration = Duration::from_millis(50);
const CONSUME: Duration = Duration::from_millis(20);

fn main() -> Result<(), ServerError> {
    #[cfg(feature = "cuda")]
    match gpu::open() {
        Ok(gpu) => {
            println!("backend: CUDA, device 0");
            return gpu.run();
        }
        Err(why) => println!("backend: Host (no CUDA GPU here: {why})"),
    }
    #[cfg(not(feature = "cuda"))]
    println!("backend: Host (built without the `cuda` feature)");
    run_host()
}

fn run_host() -> Result<(), ServerError> {
    let producer = HostStream::new()?;
    let consumer = HostStream::new()?;
    let timeline = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();

    let log = timeline.clone();
    producer.launch(move || {
        std::thread::sleep(PRODUCE);
        log.lock().unwrap().push(("produced", start.elapsed()));
    })?;

    // The consumer's later work waits for the producer's, on the "device".
    let queued = Instant::now();
    EventFence::<Host>::new(producer.handle()).wait_async(consumer.handle())?;
    println!(
        "wait_async returned after {:?}: the host did not block",
        queued.elapsed()
    );

    let log = timeline.clone();
    consumer.launch(move || {
        std::thread::sleep(CONSUME);
        log.lock().unwrap().push(("consumed", start.elapsed()));
    })?;

    // The host blocks once, on the consumer's fence.
    EventFence::<Host>::new(consumer.handle()).wait_sync()?;
    println!("wait_sync returned after {:?}", start.elapsed());
    for (what, at) in timeline.lock().unwrap().iter() {
        println!("  {what:>8} at {at:?}");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;
    use std::time::Instant;

    use device_events::cuda::cudarc::driver::CudaContext;
    use device_events::cuda::{self, CudaStreamHandle, SleepKernel};
    use device_events::ServerError;

    use super::{CONSUME, PRODUCE};

    pub struct Gpu {
        ctx: Arc<CudaContext>,
        sleep: SleepKernel,
    }

    pub fn open() -> Result<Gpu, ServerError> {
        let ctx = cuda::context(0)?;
        let sleep = SleepKernel::new(&ctx)?;
        Ok(Gpu { ctx, sleep })
    }

    impl Gpu {
        pub fn run(self) -> Result<(), ServerError> {
            let producer = self.ctx.new_stream()?;
            let consumer = self.ctx.new_stream()?;
            let start = Instant::now();

            self.sleep.launch(&producer, PRODUCE)?;
            let produced = cuda::fence(&producer);

            let queued = Instant::now();
            cuda::fence(&producer).wait_async(CudaStreamHandle::new(&consumer))?;
            println!(
                "wait_async returned after {:?}: the host did not block",
                queued.elapsed()
            );
            println!("  producer still running: {}", !produced.is_complete()?);

            self.sleep.launch(&consumer, CONSUME)?;
            cuda::fence(&consumer).wait_sync()?;
            println!(
                "wait_sync returned after {:?} (>= {:?} of device work in two streams, in order)",
                start.elapsed(),
                PRODUCE + CONSUME
            );
            println!("  producer done: {}", produced.is_complete()?);
            Ok(())
        }
    }
}
