//! A rig: streams of one backend, and work of a known length on them.

use std::sync::Arc;
use std::time::Duration;

use device_events::host::{Host, HostStream};
use device_events::{EventApi, EventFence, ServerError};

use crate::measure::{Clock, Stamps};

pub trait Rig: Send + Sync + 'static {
    type Api: EventApi;

    fn name(&self) -> &'static str;

    fn streams(&self) -> usize;

    /// The name prefix of threads that stand in for the device (the host
    /// backend's stream workers): their CPU is the device's work, not the
    /// cost of waiting for it, which is all a GPU's host pays.
    fn device_threads(&self) -> Option<&'static str> {
        None
    }

    /// Whether [`work`](Self::work) stamps its end as it ends, from the
    /// stream's own thread (host), so that a task can await the stamp: the
    /// one-hop floor. Not where the end is estimated (CUDA).
    fn work_stamps_its_end(&self) -> bool {
        false
    }

    fn handle(&self, stream: usize) -> <Self::Api as EventApi>::Stream;

    /// Queue `length` of work on `stream`; `ends[index]` receives when it
    /// ended (host: written by the work itself; CUDA: estimated from the
    /// launch time and what was queued before).
    fn work(&self, stream: usize, length: Duration, ends: &Arc<Stamps>, index: usize);

    /// Queue `length` of work on `stream`, with no bookkeeping (for loops
    /// that only count).
    fn launch(&self, stream: usize, length: Duration);

    fn fence(&self, stream: usize) -> EventFence<Self::Api> {
        EventFence::new(self.handle(stream))
    }

    /// Block until every stream is idle.
    fn drain(&self) {
        for stream in 0..self.streams() {
            let _ = EventFence::<Self::Api>::new(self.handle(stream)).wait_sync();
        }
    }
}

pub struct HostRig {
    streams: Vec<HostStream>,
    clock: Clock,
}

impl HostRig {
    pub fn new(streams: usize, clock: Clock) -> Result<Self, ServerError> {
        Ok(Self {
            streams: (0..streams)
                .map(|_| HostStream::new())
                .collect::<Result<_, _>>()?,
            clock,
        })
    }
}

impl Rig for HostRig {
    type Api = Host;

    fn name(&self) -> &'static str {
        "host"
    }

    fn streams(&self) -> usize {
        self.streams.len()
    }

    fn device_threads(&self) -> Option<&'static str> {
        Some("host-stream")
    }

    fn work_stamps_its_end(&self) -> bool {
        true
    }

    fn handle(&self, stream: usize) -> <Host as EventApi>::Stream {
        self.streams[stream].handle()
    }

    fn launch(&self, stream: usize, length: Duration) {
        let launched = self.streams[stream].launch(move || {
            if !length.is_zero() {
                std::thread::sleep(length);
            }
        });
        if let Err(err) = launched {
            panic!("host launch failed: {err}");
        }
    }

    fn work(&self, stream: usize, length: Duration, ends: &Arc<Stamps>, index: usize) {
        let (ends, clock) = (ends.clone(), self.clock);
        let launched = self.streams[stream].launch(move || {
            if !length.is_zero() {
                std::thread::sleep(length);
            }
            ends.set(index, clock.now());
        });
        if let Err(err) = launched {
            panic!("host launch failed: {err}");
        }
    }
}

#[cfg(feature = "cuda")]
pub use cuda_rig::CudaRig;

#[cfg(feature = "cuda")]
mod cuda_rig {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use device_events::cuda::cudarc::driver::{CudaContext, CudaStream};
    use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
    use device_events::ServerError;

    use super::Rig;
    use crate::measure::{Clock, Stamps};

    pub struct CudaRig {
        _ctx: Arc<CudaContext>,
        streams: Vec<Arc<CudaStream>>,
        handles: Vec<CudaStreamHandle>,
        sleep: SleepKernel,
        /// When each stream's queued work is expected to end.
        busy_until: Mutex<Vec<Instant>>,
        clock: Clock,
    }

    impl CudaRig {
        pub fn new(streams: usize, clock: Clock) -> Result<Self, ServerError> {
            let ctx = cuda::context(0)?;
            let sleep = SleepKernel::new(&ctx)?;
            let streams: Vec<_> = (0..streams)
                .map(|_| ctx.new_stream())
                .collect::<Result<_, _>>()?;
            let handles = streams.iter().map(CudaStreamHandle::new).collect();
            Ok(Self {
                _ctx: ctx,
                busy_until: Mutex::new(vec![Instant::now(); streams.len()]),
                streams,
                handles,
                sleep,
                clock,
            })
        }
    }

    impl Rig for CudaRig {
        type Api = Cuda;

        fn name(&self) -> &'static str {
            "cuda"
        }

        fn streams(&self) -> usize {
            self.streams.len()
        }

        fn handle(&self, stream: usize) -> CudaStreamHandle {
            self.handles[stream]
        }

        fn launch(&self, stream: usize, length: Duration) {
            if let Err(err) = self.sleep.launch(&self.streams[stream], length) {
                panic!("CUDA launch failed: {err}");
            }
        }

        fn work(&self, stream: usize, length: Duration, ends: &Arc<Stamps>, index: usize) {
            let mut busy = self.busy_until.lock().unwrap();
            let start = busy[stream].max(Instant::now());
            busy[stream] = start + length;
            ends.set(index, self.clock.at(start + length));
            if let Err(err) = self.sleep.launch(&self.streams[stream], length) {
                panic!("CUDA launch failed: {err}");
            }
        }
    }
}
