//! Every PTX module the crate ships, assembled by NVIDIA's own `ptxas`, for
//! the target it names and for sm_90 (H100/H200) and sm_100, where the driver
//! JIT-compiles it on newer GPUs. Needs no GPU: `ptxas` ships in the PyPI
//! package `nvidia-cuda-nvcc-cu12` and runs on any x86-64 Linux.
//!
//! `ptxas` is found through `$PTXAS`, then `PATH`, then the cache `.ci/run`
//! installs it into. Without one the test says so and passes, unless
//! `DEVICE_EVENTS_REQUIRE_PTXAS=1` (CI sets it) makes that a failure.
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Architectures every module must also assemble for.
const ALSO_FOR: &[&str] = &["sm_90", "sm_100"];

/// Tried in order, the newest target first: a CUDA 13 driver may no longer
/// compile the oldest.
#[test]
fn the_modules_are_tried_newest_target_first() {
    let modules = device_events::cuda::ptx_modules();
    let number = |target: &str| target["sm_".len()..].parse::<u32>().unwrap();
    let targets: Vec<u32> = modules.iter().map(|(target, _)| number(target)).collect();
    assert!(
        targets.windows(2).all(|pair| pair[0] > pair[1]),
        "{targets:?}"
    );
}

fn ptxas() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PTXAS") {
        return Some(PathBuf::from(path));
    }
    let on_path = Command::new("ptxas").arg("--version").output();
    if on_path.is_ok_and(|output| output.status.success()) {
        return Some(PathBuf::from("ptxas"));
    }
    let home = std::env::var_os("HOME")?;
    let cached = Path::new(&home).join(".cache/device-events/nvcc/nvidia/cuda_nvcc/bin/ptxas");
    cached.is_file().then_some(cached)
}

#[test]
fn every_shipped_ptx_module_assembles_with_ptxas() {
    let Some(ptxas) = ptxas() else {
        assert!(
            std::env::var("DEVICE_EVENTS_REQUIRE_PTXAS").map_or(true, |v| v != "1"),
            "DEVICE_EVENTS_REQUIRE_PTXAS=1 but no ptxas was found ($PTXAS, PATH, ~/.cache/device-events/nvcc)"
        );
        common::skipped::skip("every_shipped_ptx_module_assembles_with_ptxas", "no ptxas here (pip install nvidia-cuda-nvcc-cu12, or set PTXAS); set DEVICE_EVENTS_REQUIRE_PTXAS=1 to fail instead");
        return;
    };
    let version = Command::new(&ptxas).arg("--version").output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&version.stdout).trim());
    let dir = std::env::temp_dir().join(format!("device-events-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let modules = device_events::cuda::ptx_modules();
    assert!(!modules.is_empty());
    let mut failures = Vec::new();
    for (target, ptx) in &modules {
        let source = dir.join(format!("{target}.ptx"));
        std::fs::write(&source, ptx).unwrap();
        for arch in std::iter::once(*target).chain(ALSO_FOR.iter().copied()) {
            let output = Command::new(&ptxas)
                .arg(format!("-arch={arch}"))
                .arg(&source)
                .arg("-o")
                .arg(dir.join(format!("{target}-{arch}.cubin")))
                .output()
                .unwrap();
            eprintln!("{target} PTX for {arch}: {}", output.status);
            let stderr = String::from_utf8_lossy(&output.stderr);
            if arch == *target && no_longer_known(&stderr, arch) {
                // CUDA 13's ptxas dropped the targets before sm_75; the
                // module still assembles for the newer targets below, and
                // drivers JIT-compile it (an H200 on driver 13.0 ran sm_50
                // PTX). The CI's ptxas (CUDA 12.9) still checks it.
                eprintln!("{target} PTX for {arch}: this ptxas no longer knows {arch}; skipped");
                continue;
            }
            if !output.status.success() || !output.stderr.is_empty() {
                failures.push(format!(
                    "{target} PTX for {arch}: {}\n{}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Whether `stderr` is ptxas saying it does not know `arch` at all (a target
/// a newer toolkit dropped), as opposed to an error in the PTX.
fn no_longer_known(stderr: &str, arch: &str) -> bool {
    stderr.contains(&format!(
        "Value '{arch}' is not defined for option 'gpu-name'"
    ))
}

#[test]
fn a_target_ptxas_dropped_is_told_from_an_error_in_the_ptx() {
    let dropped = "ptxas fatal   : Value 'sm_50' is not defined for option 'gpu-name'\n";
    assert!(no_longer_known(dropped, "sm_50"));
    assert!(!no_longer_known(dropped, "sm_60"));
    let error = "ptxas /tmp/x.ptx, line 9; error   : Unknown symbol 'x'\n";
    assert!(!no_longer_known(error, "sm_50"));
}
