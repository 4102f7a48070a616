//! The CUDA backend's checks before its first driver call, against stand-in
//! driver libraries built here: one that finds no device, one too old to have
//! the entry points the backend uses. Both must give
//! `ServerError::Unavailable`, never a panic.
//!
//! Each case runs this test binary again as a child process with the
//! stand-in first on `LD_LIBRARY_PATH`, since a process loads its driver
//! once. Needs a C compiler (`cc`); skips with a message without one.
#![cfg(all(feature = "cuda", target_os = "linux"))]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use device_events::cuda;

/// Every entry point the backend probes, but the two error-text lookups
/// the stand-in defines itself.
fn symbols() -> Vec<&'static str> {
    cuda::required_symbols()
        .iter()
        .copied()
        .filter(|symbol| !symbol.starts_with("cuGetError"))
        .collect()
}

/// A stand-in `libcuda.so` whose every entry point in `symbols` answers
/// CUDA_ERROR_NO_DEVICE (100).
fn stub_source(symbols: &[&str]) -> String {
    let mut source = String::from(
        "int cuGetErrorName(int e, const char **s) { *s = e == 100 ? \"CUDA_ERROR_NO_DEVICE\" : \"CUDA_ERROR_UNKNOWN\"; return 0; }\n\
         int cuGetErrorString(int e, const char **s) { *s = \"no CUDA-capable device is detected\"; return 0; }\n",
    );
    for symbol in symbols {
        source.push_str(&format!("int {symbol}(void) {{ return 100; }}\n"));
    }
    source
}

/// Build a stand-in driver into `dir`; `None` without a C compiler.
fn build_stub(dir: &Path, symbols: &[&str]) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let source = dir.join("stub.c");
    std::fs::write(&source, stub_source(symbols)).ok()?;
    let library = dir.join("libcuda.so");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .status()
        .ok()?;
    built.success().then_some(library)
}

/// Run the child case `case` with the stand-in in `dir` first on the path.
fn run_child(case: &str, dir: &Path) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", dir)
        .env("DEVICE_EVENTS_STUB_CASE", case)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "case {case} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "case {case} did not run:\n{stdout}"
    );
}

#[test]
fn a_driver_without_devices_or_too_old_is_unavailable_not_a_panic() {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda-driver-stub");
    let cases = [("no-device", symbols()), ("too-old", vec!["cuInit"])];
    for (case, symbols) in cases {
        let dir = root.join(case);
        if build_stub(&dir, &symbols).is_none() {
            common::skipped::skip(
                "a_driver_without_devices_or_too_old_is_unavailable_not_a_panic",
                "no C compiler (cc) to build a stand-in driver",
            );
            return;
        }
        run_child(case, &dir);
    }
}

/// The child side: asserts what the stand-in named by
/// `DEVICE_EVENTS_STUB_CASE` must produce. Does nothing when run directly.
#[test]
fn child() {
    let Ok(case) = std::env::var("DEVICE_EVENTS_STUB_CASE") else {
        return;
    };
    let err = cuda::context(0).expect_err("a stand-in driver has no device");
    assert!(err.is_unavailable(), "{err}");
    assert!(!cuda::is_available());
    let reason = err.to_string();
    match case.as_str() {
        "no-device" => assert!(reason.contains("CUDA_ERROR_NO_DEVICE"), "{reason}"),
        "too-old" => assert!(
            reason.contains("too old") && reason.contains("cuEventCreate"),
            "{reason}"
        ),
        other => panic!("unknown case {other}"),
    }
    // Asked again: the same answer, from the cache, still no panic.
    assert_eq!(cuda::context(0).unwrap_err(), err);
}
