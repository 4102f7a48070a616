#!/usr/bin/env bash
# Run the CUDA tests and examples against the fake driver in
# tests/fake_cuda/libcuda.c, on a machine without a GPU. It checks the
# crate's side of the CUDA backend (context binding on every thread, handle
# registry, error mapping, fallbacks, the waiter on CUDA fences), not PTX or
# real hardware: scripts/gpu-check.sh does that on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# Beside cargo's build (CARGO_TARGET_DIR when set), so runs with their own
# target directories do not overwrite each other's fake.
dir=${CARGO_TARGET_DIR:-target}/fake-cuda
case $dir in /*) ;; *) dir=$PWD/$dir ;; esac
mkdir -p "$dir"
cc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$dir/libcuda.so" tests/fake_cuda/libcuda.c -lpthread
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DEVICE_EVENTS_REQUIRE_CUDA=1
export DEVICE_EVENTS_FAKE_CUDA=1
# The fake's two readings of a thread's binding to a primary context torn
# down and made again (see its header): by default calls through it succeed,
# as the real driver's did when measured; strict, they are refused until the
# thread binds again. The crate must work under both (the progress words
# among them: a word keeps its context, and its pages go with the context).
for strict in 0 1; do
    FAKE_CUDA_STRICT_REBIND=$strict \
        cargo test --test cuda --test cuda_binding --test cuda_faults --test cuda_contexts --test cuda_capture --test cuda_fence_pool --test cuda_progress_word --test cuda_memory --test any_stream --test http_service
done
# Device memory without stream-ordered allocation (the fake's attribute 115
# reads 0): cudarc allocates with cuMemAlloc_v2 and frees with cuMemFree_v2.
FAKE_CUDA_NO_MEMORY_POOLS=1 cargo test --test cuda_memory
FAKE_CUDA_NO_MEMORY_POOLS=1 cargo run --example cuda_copy_to_host
cargo test --test cuda_exit --test cuda_elapsed --test cuda_record_order --test cuda_fork
# Functions load lazily on the fake, as on Linux drivers since CUDA 12.2: the
# crate's kernels are loaded when made, not at their first launch. And the
# threads a four-stream service takes, on CUDA streams too.
cargo test --test cuda_kernels_eager --test threads
cargo run --example fences
cargo run --example join_streams
cargo run --example tokio_service
# cuda_library_stream's libraries open their own contexts and streams; both
# examples check the bytes they read back.
cargo run --example cuda_library_stream
cargo run --example cuda_copy_to_host
# The HTTP service starts on the fake driver's streams (tests/http_service.rs
# serves it requests) and stops cleanly on Ctrl-C.
cargo build --example http_service
started=$(timeout --preserve-status -s INT 10 "${CARGO_TARGET_DIR:-target}/debug/examples/http_service" 0)
echo "$started"
grep -q "Cuda" <<<"$started" || { echo "http_service did not start on the fake driver's streams"; exit 1; }
cargo test --doc
