//! The CUDA driver shut down under the crate: at process exit the driver
//! tears itself down in an exit handler while the waiter's threads still
//! run, and answers every call with `CUDA_ERROR_DEINITIALIZED`. The crate
//! takes that as terminal: pending waits fail with
//! `ServerError::ShutDown`, no later call reaches the driver, and the
//! shutdown is logged once, at debug level; nothing at warn or error.
//!
//! Each case runs this test binary again as a child process (the shutdown
//! is for the whole process, and the child's logger sees only the child):
//! - `teardown`: the fake driver's `fakeCudaTeardown` hook starts the
//!   teardown mid-run, and the child checks each promise above;
//! - `exit`: the child leaves a wait pending on `Waiter::global()` and
//!   exits; the driver's own exit handler (the fake's, registered at
//!   `cuInit`, or a real driver's) tears it down. The parent checks that the
//!   child exits cleanly and logged no warning or error;
//! - `word` and `freed word`: 32 threads of the child read a progress word
//!   in a loop as the child exits; in `freed word` the fake's teardown frees
//!   the word's memory (its handler registered at `cuInit`, or at the first
//!   page-locked allocation). The child exits cleanly in each.
//!
//! Skips without a GPU; `DEVICE_EVENTS_REQUIRE_CUDA=1` fails instead.
// The fake driver's hooks through `common::fake_driver`.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use device_events::cuda::cudarc::driver::CudaContext;
use device_events::cuda::{self, Cuda, CudaStreamHandle, SleepKernel};
use device_events::{status, Event, EventApi, EventFlags, EventProfiler, ServerError};

use common::fake_driver;

const CASE: &str = "DEVICE_EVENTS_EXIT_CASE";

/// Device 0's context and a sleep kernel, or `None` (skipping).
fn gpu(test: &str) -> Option<(Arc<CudaContext>, SleepKernel)> {
    let found = cuda::context(0).and_then(|ctx| SleepKernel::new(&ctx).map(|kernel| (ctx, kernel)));
    match found {
        Ok(found) => Some(found),
        Err(err) if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|v| v == "1") => {
            panic!("{test}: DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}")
        }
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

/// Every record logged in this (child) process, as `LEVEL message`, also
/// written to stderr for the parent.
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Logger;

impl log::Log for Logger {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{} {}", record.level(), record.args());
        eprintln!("{line}");
        LOGGED.lock().unwrap().push(line);
    }

    fn flush(&self) {}
}

fn install_logger() {
    log::set_logger(&Logger).unwrap();
    log::set_max_level(log::LevelFilter::Trace);
}

/// Run the child case `case` for `test`: its stderr, or `None` in the child
/// itself or without a GPU (skipping). A child that has not exited after
/// 60 s (one that hangs in exit) is killed, and fails the test.
fn in_child(test: &str, case: &str) -> Option<String> {
    in_child_with(test, case, &[])
}

/// [`in_child`], with `env` set for the child.
fn in_child_with(test: &str, case: &str, env: &[(&str, &str)]) -> Option<String> {
    if std::env::var(CASE).is_ok() || gpu(test).is_none() {
        return None;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CASE, case)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let read = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    let Some(status) = status else {
        panic!("case {case} hung; killed after 60 s:\n{stdout}\n{stderr}");
    };
    assert!(
        status.success(),
        "case {case} failed ({status}):\n{stdout}\n{stderr}"
    );
    Some(stderr)
}

#[test]
fn a_driver_shut_down_under_pending_waits_fails_them_quietly() {
    if let Some(stderr) = in_child("a_driver_shut_down_under_pending_waits", "teardown") {
        assert!(stderr.contains("teardown checked"), "{stderr}");
    }
}

#[test]
fn a_process_exiting_with_a_pending_await_exits_cleanly() {
    let Some(stderr) = in_child("a_process_exiting_with_a_pending_await", "exit") else {
        return;
    };
    assert!(
        stderr.contains("exiting"),
        "the child did not get to exit:\n{stderr}"
    );
    for line in stderr.lines() {
        assert!(
            !line.starts_with("ERROR") && !line.starts_with("WARN"),
            "logged at exit: {line}\n{stderr}"
        );
    }
}

/// Threads still reading a progress word as the process exits: the
/// driver's exit handler may free the word's page-locked memory (the docs
/// do not say; the fake keeps it, or frees it after
/// `fakeCudaTeardownFrees(1)`, and a read of it then faults), and may be
/// registered at `cuInit` or at the first page-locked allocation (the docs
/// do not say either). The process exits cleanly under each reading.
#[test]
fn a_process_exiting_while_a_progress_word_is_read_exits_cleanly() {
    let test = "a_process_exiting_while_a_progress_word_is_read";
    // The driver's handler registered at `cuInit` (the fake's default), or
    // as its first page-locked allocation returns (the docs do not say when).
    let at_first_allocation = &[("FAKE_CUDA_TEARDOWN_AT_HOST_ALLOC", "1")][..];
    let cases: &[(&str, &[(&str, &str)])] = if fake_driver::is_fake() {
        &[
            ("word", &[]),
            ("freed word", &[]),
            ("freed word", at_first_allocation),
        ]
    } else {
        &[("word", &[])]
    };
    for &(case, env) in cases {
        let Some(stderr) = in_child_with(test, case, env) else {
            return;
        };
        assert!(
            stderr.contains("exiting"),
            "case {case}: the child did not get to exit:\n{stderr}"
        );
    }
}

/// A cudarc error that says the driver is deinitialized (say, from the
/// user's own cudarc call) is the same shutdown: later calls of the crate
/// do not reach the driver.
#[test]
fn a_cudarc_error_saying_the_driver_is_deinitialized_is_the_shutdown() {
    if let Some(stderr) = in_child("a_cudarc_error_saying_the_driver", "cudarc") {
        assert!(stderr.contains("cudarc checked"), "{stderr}");
    }
}

/// The child side: the case named by `DEVICE_EVENTS_EXIT_CASE`.
#[test]
fn child() {
    let Ok(case) = std::env::var(CASE) else {
        return;
    };
    install_logger();
    let (ctx, sleep) = gpu("child").expect("a GPU (the parent found one)");
    let stream = ctx.new_stream().unwrap();
    // Device work that outlasts the test: the fence stays pending.
    sleep.launch(&stream, Duration::from_secs(30)).unwrap();
    let pending = cuda::fence(&stream);
    match case.as_str() {
        "teardown" => teardown(&stream, pending),
        "cudarc" => {
            use device_events::cuda::cudarc::driver::{result::DriverError, sys};
            let deinitialized = DriverError(sys::CUresult::CUDA_ERROR_DEINITIALIZED);
            let err = ServerError::from(deinitialized);
            assert!(err.is_shut_down(), "{err}");
            let fence = cuda::fence(&stream);
            assert!(fence.is_resolved_at_creation());
            assert!(fence.wait_sync().unwrap_err().is_shut_down());
            drop(pending);
            eprintln!("cudarc checked");
        }
        "exit" => {
            // Awaited on the global waiter by a thread of its own; the
            // process exits while the waiter's thread waits in the driver.
            std::thread::spawn(move || futures::executor::block_on(pending.wait()));
            let profiler = EventProfiler::<Cuda>::new();
            let start = profiler.start(CudaStreamHandle::new(&stream)).unwrap();
            let profile = profiler
                .stop(start, CudaStreamHandle::new(&stream))
                .unwrap();
            std::thread::spawn(move || futures::executor::block_on(profile.wait()));
            eprintln!("exiting");
            std::process::exit(0);
        }
        "word" | "freed word" => {
            if case == "freed word" {
                fake_driver::call(c"fakeCudaTeardownFrees", 1).expect("on the fake driver");
            }
            let handle = CudaStreamHandle::new(&stream);
            assert!(Cuda::stream_progress(handle).is_none(), "the first ask");
            assert!(cuda::wait_for_progress_words(Duration::from_secs(20)));
            let _written = cuda::fence(&stream);
            let Some(word) = Cuda::stream_progress(handle) else {
                assert!(!fake_driver::is_fake(), "the fake opens a word");
                eprintln!("exiting: this device has no progress words");
                std::process::exit(0);
            };
            // Many readers, more than the cores: a close that each read can
            // hold up never ends.
            let (reading, read) = std::sync::mpsc::channel();
            for _ in 0..32 {
                let (reading, word) = (reading.clone(), word.clone());
                std::thread::spawn(move || {
                    reading.send(()).unwrap();
                    loop {
                        std::hint::black_box(word.passed(0));
                    }
                });
            }
            (0..32).for_each(|_| read.recv().unwrap());
            eprintln!("exiting");
            std::process::exit(0);
        }
        other => panic!("unknown case {other}"),
    }
}

fn teardown(
    stream: &Arc<cuda::cudarc::driver::CudaStream>,
    pending: device_events::cuda::CudaFence,
) {
    let handle = CudaStreamHandle::new(stream);
    if !fake_driver::is_fake() {
        common::skipped::skip("teardown", "only the fake driver has a teardown hook");
        eprintln!("teardown checked");
        return;
    }
    // On the fake driver `call` answers, or panics where a hook is missing.
    let calls_after =
        || fake_driver::call(c"fakeCudaCallsAfterTeardown", 0).expect("on the fake driver");
    let doomed = Event::<Cuda>::new(handle, EventFlags::TIMING).unwrap();
    let recorded_before = cuda::fence(stream);
    let waiting = std::thread::spawn(move || futures::executor::block_on(pending.wait()));

    fake_driver::call(c"fakeCudaTeardown", 0);
    let err = waiting.join().unwrap().unwrap_err();
    assert!(err.is_shut_down(), "{err}");
    assert_eq!(err.code(), Some(status::DEINITIALIZED), "{err}");
    assert!(err.to_string().contains("shut down"), "{err}");

    // From here on nothing reaches the driver, and each call says why.
    let reached = calls_after();
    assert!(
        reached >= 1,
        "the pending wait was not answered by the driver"
    );
    let fence = cuda::fence(stream);
    assert!(fence.is_resolved_at_creation());
    assert!(fence.wait_sync().unwrap_err().is_shut_down());
    let refused: [Result<(), ServerError>; 4] = [
        Event::<Cuda>::new(handle, EventFlags::FENCE).map(drop),
        Cuda::stream_synchronize(handle),
        doomed.record(handle),
        doomed.is_complete().map(drop),
    ];
    for result in refused {
        assert!(result.as_ref().unwrap_err().is_shut_down(), "{result:?}");
    }
    // Not a refusal to work around with a host wait (and a warning).
    let err = recorded_before.wait_async(handle).unwrap_err();
    assert!(err.is_shut_down(), "{err}");
    assert!(cuda::context(0).unwrap_err().is_shut_down());
    drop(doomed);
    let reached_since = calls_after() - reached;
    assert_eq!(
        reached_since, 0,
        "calls reached the driver after its teardown"
    );

    let logged = LOGGED.lock().unwrap().clone();
    let noisy: Vec<_> = logged
        .iter()
        .filter(|line| line.starts_with("ERROR") || line.starts_with("WARN"))
        .collect();
    assert!(noisy.is_empty(), "logged loudly: {noisy:#?}");
    let told = logged
        .iter()
        .filter(|line| line.contains("driver is shutting down"))
        .count();
    assert_eq!(told, 1, "the shutdown should be logged once: {logged:#?}");
    eprintln!("teardown checked");
}
