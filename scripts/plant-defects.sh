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

# The waiter (host backend and unit tests; no driver needed).

plant "a waiter thread that unwinds is not given back by its guard" src/waiter/pool.rs \
    'Pool::recover(&self.pool, self.owner, &self.lanes, &mut self.batch);' \
    '' \
    lib

plant "a wait put back at its sequence, not where it was placed (and not told)" src/waiter/pool.rs \
    '        let mut place = wait.placed;
        while lane.waits.contains_key(&place) {
            place = place.wrapping_add(1);
        }
        if place != wait.placed {
            wait.placed = place;
            wait.slot.moved_to(place);
        }' \
    '        let mut place = wait.waitable.sequence();
        while lane.waits.contains_key(&place) {
            place = place.wrapping_add(1);
        }
        wait.placed = place;' \
    await_faults

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
        let removed = self.shared.lock().wakers.remove(self.id);' \
    'impl<F, T> Drop for Progress<F, T> {
    fn drop(&mut self) {
        let removed = None::<Waker>;' \
    drop_queue

plant "shutdown_now does not count what it hands back" src/drop_queue.rs \
    'state.stats.handed_back += entries.len() as u64;' \
    '' \
    drop_queue

# plant_loom NAME FILE OLD NEW MODEL: the same, against one loom model of
# the waiter (its own target dir: the loom build has other flags).
plant_loom() {
    local name=$1 model=$5
    copy_with "$2" "$3" "$4"
    if (cd "$work" && CARGO_TARGET_DIR=$work/loom-target RUSTFLAGS="--cfg device_events_loom" \
        LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib "$model" >"$work/$name.log" 2>&1); then
        echo "NOT CAUGHT: $name (the model passed with it planted; log $work/$name.log)"
        return 1
    fi
    # A model that fails reports FAILED, or (when loom's own clean-up
    # panics after it found a deadlock) dies with the model's panic logged.
    local failure
    failure=$(grep -m1 -o -E "^test .*$model .* FAILED$|'waiter::loom_models::$model' \([0-9]+\) panicked at .*" "$work/$name.log" || true)
    if [[ -z $failure ]]; then
        echo "NOT A MODEL FAILURE: $name (log $work/$name.log)"
        tail -5 "$work/$name.log"
        return 1
    fi
    echo "caught: $name: $model: $(grep -m1 -o -E 'deadlock|FAILED|assertion.*' "$work/$name.log" || echo panicked)"
    caught=$((caught + 1))
}

plant_loom "an idle thread leaves on a timeout without looking at the queues" src/waiter/pool.rs \
    '            timed_out = timeout;' \
    '            timed_out = timeout;
            if timed_out {
                sched.lane_thread_left();
                return None;
            }' \
    loom_an_idle_thread_timing_out_races_a_submit

plant_loom "a lane made afresh in settle is not queued" src/waiter/pool.rs \
    '            if new_lane {
                action = pool.queue_lane(key);
            }' \
    '            let _ = new_lane;' \
    loom_a_lane_taken_back_from_the_poller_mid_batch_is_made_again

plant_loom "a submit enters a shard that shutdown has drained" src/waiter/pool.rs \
    '        if shard.shut {
            drop(shard);' \
    '        if shard.shut && false {
            drop(shard);' \
    loom_shutdown_races_a_submit_from_another_task

plant_loom "an idle thread's wake-up is decided but never sent" src/waiter/pool.rs \
    '                pool.work.notify_one();
                return;' \
    '                return;' \
    loom_two_idle_lane_threads_are_woken_for_new_lanes

plant_loom "a refused lane thread leaves its lane queued for threads" src/waiter/pool.rs \
    '            sched.for_poller.extend(lanes);' \
    '            sched.for_threads.extend(lanes);' \
    loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller

plant_loom "a settle miscounts a wait found cancelled" src/waiter/pool.rs \
    'shard.waits_finished(resolved + cancelled.len());' \
    'shard.waits_finished(resolved - cancelled.len());' \
    loom_a_future_dropped_while_the_poller_has_its_wait_out

echo "== every plant caught ($caught)"
