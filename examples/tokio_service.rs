//! A small tokio service: jobs arrive over TCP on loopback, each launches
//! work on one of several streams and awaits its fence, then answers.
//!
//! It runs on a *current-thread* runtime, so a single thread serves every
//! connection, and a heartbeat task measures how late its ticks fire: an await
//! that blocked the thread would show up as a lag the length of a job. Runs on
//! CUDA when a GPU is present, on the host backend otherwise: the service
//! holds `AnyStream`s, and only launching a job's work is written per
//! backend.
//!
//! `cargo run --example tokio_service`

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use device_events::host::HostStream;
use device_events::{AnyStream, ServerError};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const STREAMS: usize = 4;
const CLIENTS: usize = 8;
const JOBS_PER_CLIENT: usize = 10;
const JOB: Duration = Duration::from_millis(20);
const TICK: Duration = Duration::from_millis(2);

/// Tells the heartbeat to stop once every client is done.
static STOP: AtomicBool = AtomicBool::new(false);

/// The streams jobs run on, CPU worker queues or CUDA streams alike, and
/// how work is launched on them: the one part written per backend.
struct Streams {
    streams: Vec<AnyStream>,
    launcher: Launcher,
}

/// Launching a job's work: a closure on a host stream, a kernel on a CUDA
/// stream.
enum Launcher {
    Host,
    #[cfg(feature = "cuda")]
    Cuda(gpu::Gpu),
}

impl Streams {
    fn open() -> Result<Self, ServerError> {
        #[cfg(feature = "cuda")]
        match gpu::Gpu::open(STREAMS) {
            Ok((gpu, streams)) => {
                println!("backend: CUDA, device 0");
                return Ok(Self {
                    streams,
                    launcher: Launcher::Cuda(gpu),
                });
            }
            Err(why) => println!("backend: Host (no CUDA GPU here: {why})"),
        }
        let streams = (0..STREAMS)
            .map(|_| HostStream::new().map(AnyStream::from))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            streams,
            launcher: Launcher::Host,
        })
    }

    /// Launch `length` of work on stream `index` and await its fence: the
    /// same code on either backend, but for the launch.
    async fn run_job(&self, index: usize, length: Duration) -> Result<(), ServerError> {
        let stream = &self.streams[index % self.streams.len()];
        self.launch(stream, length)?;
        stream.fence().await
    }

    fn launch(&self, stream: &AnyStream, length: Duration) -> Result<(), ServerError> {
        match (&self.launcher, stream) {
            (Launcher::Host, AnyStream::Host(host)) => {
                host.launch(move || std::thread::sleep(length))
            }
            #[cfg(feature = "cuda")]
            (Launcher::Cuda(gpu), AnyStream::Cuda(cuda)) => gpu.launch(cuda, length),
            _ => unreachable!("the streams were made for their launcher's backend"),
        }
    }
}

async fn serve(listener: TcpListener, streams: Arc<Streams>) -> std::io::Result<()> {
    let next = Arc::new(AtomicUsize::new(0));
    for _ in 0..CLIENTS {
        let (socket, _) = listener.accept().await?;
        let (streams, next) = (streams.clone(), next.clone());
        tokio::spawn(async move {
            let (read, mut write) = socket.into_split();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let index = next.fetch_add(1, Ordering::Relaxed) % STREAMS;
                let started = Instant::now();
                let answer = match streams.run_job(index, JOB).await {
                    Ok(()) => format!("{line} done on stream {index} in {:?}\n", started.elapsed()),
                    Err(err) => format!("{line} failed: {err}\n"),
                };
                if write.write_all(answer.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
    Ok(())
}

async fn client(address: std::net::SocketAddr, id: usize) -> std::io::Result<usize> {
    let socket = TcpStream::connect(address).await?;
    let (read, mut write) = socket.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut done = 0;
    for job in 0..JOBS_PER_CLIENT {
        write
            .write_all(format!("client {id} job {job}\n").as_bytes())
            .await?;
        match lines.next_line().await? {
            Some(answer) if answer.contains(" done ") => done += 1,
            Some(answer) => eprintln!("{answer}"),
            None => break,
        }
    }
    Ok(done)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let streams = Arc::new(Streams::open()?);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        tokio::spawn(serve(listener, streams));

        // The heartbeat: how late does a tick fire on the runtime's one thread?
        let heartbeat = tokio::spawn(async {
            let mut worst = Duration::ZERO;
            let mut interval = tokio::time::interval(TICK);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut expected = Instant::now();
            while !STOP.load(Ordering::Relaxed) {
                interval.tick().await;
                worst = worst.max(Instant::now().saturating_duration_since(expected));
                expected = Instant::now() + TICK;
            }
            worst
        });

        let started = Instant::now();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|id| tokio::spawn(client(address, id)))
            .collect();
        let mut done = 0;
        for client in clients {
            done += client.await??;
        }
        let elapsed = started.elapsed();
        STOP.store(true, Ordering::Relaxed);
        let worst = heartbeat.await?;

        let serial = JOB * (CLIENTS * JOBS_PER_CLIENT) as u32;
        println!(
            "{done}/{} jobs answered in {elapsed:?} on one runtime thread",
            CLIENTS * JOBS_PER_CLIENT
        );
        println!("  ({STREAMS} streams, {JOB:?} per job: {serial:?} if run one after another)");
        println!("  heartbeat's worst lag: {worst:?} (a blocking await would lag by ~{JOB:?})");
        Ok(())
    })
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;
    use std::time::Duration;

    use device_events::cuda::cudarc::driver::{CudaContext, CudaStream};
    use device_events::cuda::{self, SleepKernel};
    use device_events::{AnyStream, ServerError};

    /// The device's context and the kernel jobs launch.
    pub struct Gpu {
        _ctx: Arc<CudaContext>,
        sleep: SleepKernel,
    }

    impl Gpu {
        /// The device, and `streams` streams on it.
        pub fn open(streams: usize) -> Result<(Self, Vec<AnyStream>), ServerError> {
            let ctx = cuda::context(0)?;
            let sleep = SleepKernel::new(&ctx)?;
            let streams = (0..streams)
                .map(|_| ctx.new_stream().map(AnyStream::from))
                .collect::<Result<_, _>>()?;
            Ok((Self { _ctx: ctx, sleep }, streams))
        }

        pub fn launch(
            &self,
            stream: &Arc<CudaStream>,
            length: Duration,
        ) -> Result<(), ServerError> {
            self.sleep.launch(stream, length)
        }
    }
}
