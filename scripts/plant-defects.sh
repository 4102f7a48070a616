#!/usr/bin/env bash
# Plants, one at a time, each CUDA defect that a review once found (or that a
# fix removed), in a copy of the crate, and checks that the tests against the
# fake driver fail. A plant the tests do not catch fails this script: the
# fake driver or the tests have gone soft. CI runs it.
#
#   bash scripts/plant-defects.sh
#
# The copy lives in target/plant/ (its own target dir, reused between runs).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
root=$PWD
work=$root/target/plant
export CARGO_TARGET_DIR=$work/target

dir=$root/target/fake-cuda
mkdir -p "$dir"
cc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$dir/libcuda.so" tests/fake_cuda/libcuda.c -lpthread
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DEVICE_EVENTS_REQUIRE_CUDA=1 DEVICE_EVENTS_FAKE_CUDA=1

# plant NAME FILE OLD NEW TEST...: replace OLD by NEW in a fresh copy's FILE
# (OLD must occur), run the tests, and require a failure.
caught=0
plant() {
    local name=$1 file=$2 old=$3 new=$4
    shift 4
    rm -rf "$work/src" "$work/tests"
    mkdir -p "$work"
    rm -rf "$work/benches" "$work/examples"
    cp -r src tests benches examples Cargo.toml Cargo.lock build.rs README.md "$work/"
    python3 - "$work/$file" "$old" "$new" <<'PY'
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if old not in text:
    sys.exit(f"plant: the text to replace is not in {path}:\n{old}")
open(path, "w").write(text.replace(old, new, 1))
PY
    local args=()
    for test in "$@"; do args+=(--test "$test"); done
    if (cd "$work" && cargo test "${args[@]}" >"$work/$name.log" 2>&1); then
        echo "NOT CAUGHT: $name (the tests passed with it planted; log $work/$name.log)"
        return 1
    fi
    # A plant that does not build proves nothing about the tests.
    if ! grep -q -E '^test .* FAILED$' "$work/$name.log"; then
        echo "NOT A TEST FAILURE: $name (it did not build, or failed outside a test; log $work/$name.log)"
        tail -5 "$work/$name.log"
        return 1
    fi
    echo "caught: $name: $(grep -m1 -E '^test .* FAILED$' "$work/$name.log")"
    caught=$((caught + 1))
}

plant "binding takes cudarc's stored errors" src/backend/cuda/driver.rs \
    'fn bind(ctx: &Arc<CudaContext>) -> Result<Bound, ServerError> {' \
    'fn bind(ctx: &Arc<CudaContext>) -> Result<Bound, ServerError> {
    ctx.bind_to_thread().map_err(|err| driver_error("cuCtxSetCurrent", err))?;' \
    cuda_binding

plant "the thread's previous context is not restored" src/backend/cuda/driver.rs \
    'let Some(previous) = self.previous else {' \
    'let Some(previous) = self.previous.filter(|_| false) else {' \
    cuda_binding

plant "a profile waits for its stop only" src/profiler.rs \
    'self.start().wait_sync()?;' \
    '' \
    cuda

plant "a per-thread stream handle is used on any thread" src/backend/cuda/stream.rs \
    'if self.thread != 0 && self.thread != thread_key() {' \
    'if false {' \
    cuda_binding

plant "cuda::context makes a new context each call" src/backend/cuda/mod.rs \
    'if let Some(ctx) = contexts.get(ordinal).and_then(Weak::upgrade) {' \
    'if let Some(ctx) = contexts.get(ordinal).and_then(Weak::upgrade).filter(|_| false) {' \
    cuda_binding

plant "sticky codes miss CUDA_ERROR_ILLEGAL_ADDRESS" src/backend/cuda/driver.rs \
    '    sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,' \
    '' \
    cuda_faults

plant "CUDA fence events are destroyed, not pooled" src/backend/cuda/driver.rs \
    'if idle.len() < SHARD_CAPACITY {' \
    'if idle.len() < SHARD_CAPACITY && false {' \
    cuda_binding

plant "CUDA_ERROR_CONTAINED (226, by number) is not sticky" src/backend/cuda/driver.rs \
    'const STICKY_SINCE_12_8: &[i32] = &[226, 721];' \
    'const STICKY_SINCE_12_8: &[i32] = &[721];' \
    cuda_binding

plant "the crate's own threads trust a torn-down context's binding" src/backend/cuda/driver.rs \
    'if previous == target && (!own || left_bound_by(ctx)) {' \
    'if previous == target {' \
    cuda_binding

echo "== every plant caught ($caught)"
