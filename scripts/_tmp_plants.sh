#!/usr/bin/env bash
# Plants, one at a time, each defect that a review once found (or that a fix
# removed), in a copy of the crate, and checks that a test fails: the CUDA
# ones against the fake driver, the waiter's against its unit tests, the
# host backend and its loom models. A plant the tests do not catch fails this script: the
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

# copy_with FILE OLD NEW: a fresh copy of the crate in $work, with OLD
# replaced by NEW in its FILE (OLD must occur).
copy_with() {
    local file=$1 old=$2 new=$3
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
}

# plant NAME FILE OLD NEW TEST...: replace OLD by NEW in a fresh copy's FILE,
# run the tests (`lib` names the crate's own unit tests), and require a
# failure.
caught=0
plant() {
    local name=$1
    copy_with "$2" "$3" "$4"
    shift 4
    local args=()
    for test in "$@"; do
        if [[ $test == lib ]]; then args+=(--lib); else args+=(--test "$test"); fi
    done
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

# The host backend: as strict as CUDA where a test's meaning depends on it.

plant "a record reached at once releases waits on earlier records" src/backend/host/event.rs \
    '        state.recorded += 1;
        state.reached_at = self.inner.timing.then(Instant::now);' \
    '        state.recorded += 1;
        state.pending.clear();
        state.reached_at = self.inner.timing.then(Instant::now);' \
    lib event

plant "a fault poisons its own stream only, not the context" src/backend/host/context.rs \
    'match self.fault() {' \
    'match None::<&String> {' \
    host_stream

# The drop queue: no value dropped before its fence, no flush that hangs.

plant "a push future dropped before it resolved drops its value" src/drop_queue.rs \
    'self.shared.adopt(fence, value);' \
    'drop((fence, value));' \
    drop_queue

plant "a dropped flush future leaves its waker" src/drop_queue.rs \
    'impl<F, T> Drop for Progress<F, T> {
    fn drop(&mut self) {
        self.shared.lock().wakers.remove(self.id);' \
    'impl<F, T> Drop for Progress<F, T> {
    fn drop(&mut self) {' \
    drop_queue

plant "shutdown_now does not count what it hands back" src/drop_queue.rs \
    'state.stats.handed_back += entries.len() as u64;' \
    '' \
    drop_queue

echo "caught $caught"
