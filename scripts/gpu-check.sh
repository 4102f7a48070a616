#!/usr/bin/env bash
# Runs on a GPU machine from the binaries scripts/build-device-bin.sh made:
# every test with DEVICE_EVENTS_REQUIRE_CUDA=1 (a missing driver fails them
# instead of skipping), the fences, join_streams, cuda_copy_to_host and
# cuda_library_stream examples, then the benchmark; a short summary last.
#
#   bash device-bin/gpu-check.sh [device-bin] [--quick|--large]
#
# Each step has its own timeout (tests 120 s each, examples 60 s, benchmark
# 360 s): a hang fails its step and the rest still runs, and each step's log
# is written as it goes, so an outer time limit still leaves the logs.
# Results (JSON, SVG plots, logs) go to $OUT when set, else ./gpu-results.
#
# Driver behaviour the fake driver takes from the docs or on the strict
# reading, which these tests confirm on a real driver (each runs here like
# any other test binary):
# - tests/cuda_capture.rs: a record on a stream whose capture was
#   invalidated (refused with 901, or captured: the test accepts both);
#   fork and join of two streams within one capture ending cleanly.
# - tests/cuda_exit.rs: a real driver's teardown at process exit under
#   pending waits (exit status 0, no warnings or errors logged), and with a
#   thread still reading a progress word (the crate's exit handler, run
#   before the driver's, stops the reads: exit status 0, no SIGSEGV).
# - tests/cuda_contexts.rs, tests/cuda_elapsed.rs: a primary context
#   released and retained again, cuEventElapsedTime_v2, cross-context calls.
# - tests/cuda_progress_word.rs: the device's stream memory operations and
#   host-mapped memory (a stream's word lands past each fence only once the
#   work before it is done; no write on a capturing stream).
# Not yet measured on a GPU: the benchmark's scenarios 1 and 8 with the
# watcher (`await, watchers(1)`, racing a lane thread blocked in
# cuEventSynchronize) beside the default `await` (on the GPU machine's core
# count) and `await, watchers(0)`: lone-wait and 1 ms-item wake p50 and p99,
# CPU per await and the watcher thread's; the time of the first fence of a
# newly watched stream while a 1 s kernel runs on another stream (it must
# not wait for that kernel: no page-locked allocation on the fence path);
# and the cost of the capture checks and of the progress word's write per
# fence (scenarios 3 and 4 against the last GPU run's figures).
set -u
bin=${1:-device-bin}
mode=${2:-}
results=${OUT:-gpu-results}
mkdir -p "$results"
export DEVICE_EVENTS_REQUIRE_CUDA=1
export CARGO_TARGET_DIR="$results"
summary=()

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$results/nvidia-smi.txt"
glibc=$(ldd --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+$' || true)
echo "glibc ${glibc:-unknown}"
# The binaries were built on a machine with glibc 2.34 or later; on an older
# one each would fail with a loader error. Say so once and stop.
probe=$(ls "$bin"/tests/* 2>/dev/null | head -1)
if [ -z "$probe" ]; then
    echo "no test binaries under $bin/tests: run scripts/build-device-bin.sh first"
    exit 1
fi
if ! "$probe" --list >/dev/null 2>"$results/loader.log"; then
    echo "the prebuilt binaries cannot start here (they need glibc 2.34 or later; this machine has ${glibc:-unknown}): $(head -1 "$results/loader.log")"
    exit 1
fi

echo "== tests (DEVICE_EVENTS_REQUIRE_CUDA=1)"
for test in "$bin"/tests/*; do
    name=$(basename "$test")
    if timeout 120 "$test" > "$results/test-$name.log" 2>&1; then
        line=$(grep -E "^test result" "$results/test-$name.log" | tail -1)
        summary+=("PASS test $name: $line")
    else
        summary+=("FAIL test $name (see test-$name.log)")
        tail -30 "$results/test-$name.log"
    fi
done

echo "== examples"
for example in fences join_streams cuda_copy_to_host cuda_library_stream; do
    if [ -x "$bin/examples/$example" ]; then
        if timeout 60 "$bin/examples/$example" > "$results/example-$example.log" 2>&1; then
            summary+=("PASS example $example: $(head -1 "$results/example-$example.log")")
        else
            summary+=("FAIL example $example (see example-$example.log)")
        fi
        cat "$results/example-$example.log"
    fi
done

echo "== benchmark"
if timeout 360 "$bin"/bench/waiters $mode > "$results/bench.log" 2>&1; then
    summary+=("PASS bench waiters $mode")
else
    summary+=("FAIL bench waiters $mode (see bench.log)")
fi
cat "$results/bench.log"

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
grep -E "^(PASS|MISS|INFO|----) \[" "$results/bench.log" || true
