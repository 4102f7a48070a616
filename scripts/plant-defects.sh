#!/usr/bin/env bash
# Switches on, one at a time, each defect that a review once found (or that a
# fix removed), and checks that a test fails: the CUDA ones against the fake
# driver, the waiter's against its unit tests, the host backend, the drop
# queue, and the waiter's loom models. A plant the tests do not catch fails
# this script: the fake driver or the tests have gone soft. CI runs it.
#
#   bash scripts/plant-defects.sh
#
# Each defect is a hook beside the code it breaks (`crate::plant::planted`,
# src/plant.rs), compiled only with `--cfg device_events_plant` and chosen
# at run time by `DEVICE_EVENTS_PLANT=<name>`: the tests are built once (and
# the loom models once), and a refactor moves a plant with its code.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
work=$PWD/target/plant
mkdir -p "$work"
export CARGO_TARGET_DIR=$work/target

dir=$PWD/target/fake-cuda
mkdir -p "$dir"
cc -shared -fPIC -O2 -Wall -Wextra -Werror -o "$dir/libcuda.so" tests/fake_cuda/libcuda.c -lpthread
export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DEVICE_EVENTS_REQUIRE_CUDA=1 DEVICE_EVENTS_FAKE_CUDA=1

plants_flags="--cfg device_events_plant"
loom_flags="--cfg device_events_plant --cfg device_events_loom"
echo "== building the tests with the plant hooks (once)"
RUSTFLAGS=$plants_flags cargo test --no-run >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; exit 1; }
RUSTFLAGS=$loom_flags CARGO_TARGET_DIR=$work/loom-target cargo test --release --lib --no-run \
    >"$work/build-loom.log" 2>&1 || { tail -20 "$work/build-loom.log"; exit 1; }

# Every hook in the source is planted below, and every plant below has a
# hook: a renamed hook must not quietly stop being checked.
declared=$(grep -rhoE 'planted\("[a-z0-9-]+"\)' src | sed -E 's/planted\("(.*)"\)/\1/' | sort -u)
listed=$(grep -oE '^plant(_loom)? [a-z0-9-]+' "$0" | awk '{print $2}' | sort -u)
if [[ $declared != "$listed" ]]; then
    echo "the hooks in src/ and the plants in this script differ:"
    diff <(echo "$declared") <(echo "$listed") || true
    exit 1
fi

# plant NAME WHAT TEST...: run the tests (`lib` names the crate's own unit
# tests) with the defect NAME switched on, and require a test failure.
caught=0
plant() {
    local name=$1 what=$2
    shift 2
    local args=()
    for test in "$@"; do
        if [[ $test == lib ]]; then args+=(--lib); else args+=(--test "$test"); fi
    done
    if RUSTFLAGS=$plants_flags DEVICE_EVENTS_PLANT=$name cargo test "${args[@]}" >"$work/$name.log" 2>&1; then
        echo "NOT CAUGHT: $name: $what (the tests passed with it planted; log $work/$name.log)"
        return 1
    fi
    # A run that did not build, or failed outside a test, proves nothing.
    if ! grep -q -E '^test .* FAILED$' "$work/$name.log"; then
        echo "NOT A TEST FAILURE: $name (log $work/$name.log)"
        tail -5 "$work/$name.log"
        return 1
    fi
    echo "caught: $what: $(grep -m1 -E '^test .* FAILED$' "$work/$name.log")"
    caught=$((caught + 1))
}

# plant_loom NAME WHAT MODEL: the same, against one loom model of the waiter.
plant_loom() {
    local name=$1 what=$2 model=$3
    if RUSTFLAGS=$loom_flags CARGO_TARGET_DIR=$work/loom-target DEVICE_EVENTS_PLANT=$name \
        LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib "$model" >"$work/$name.log" 2>&1; then
        echo "NOT CAUGHT: $name: $what (the model passed with it planted; log $work/$name.log)"
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
    echo "caught: $what: $model: $(grep -m1 -o -E 'deadlock|FAILED|assertion.*' "$work/$name.log" || echo panicked)"
    caught=$((caught + 1))
}

# The CUDA backend, against the fake driver.
plant cuda-bind-takes-stored-errors "binding takes cudarc's stored errors" cuda_binding
plant cuda-previous-context-not-restored "the thread's previous context is not restored" cuda_binding
plant profile-waits-for-stop-only "a profile waits for its stop only" cuda
# Graph capture: nothing of the crate's may break a user's capture.
plant cuda-captured-record-not-marked "a fence recorded during capture is queried like any other" cuda_capture
plant cuda-user-calls-in-global-capture-mode "a query on a user's thread is made in its global capture mode" cuda_capture
plant cuda-own-threads-in-global-capture-mode "the waiter's threads query in the global capture mode" cuda_capture
plant cuda-capturing-stream-waits-on-outside-event "a capturing stream is made to wait on a fence from outside its capture" cuda_capture
plant cuda-capturing-stream-synchronized "a capturing stream is synchronized" cuda_capture
plant capture-refusal-synchronizes-stream "a record refused by a capture falls back to synchronizing the stream" cuda_capture
plant capture-wait-falls-back-to-host "a capture's refusal of a device-side wait falls back to a host wait" cuda_capture
plant drop-queue-frees-captured-value "a drop queue frees a value whose fence was recorded during capture" cuda_capture
plant cuda-per-thread-stream-used-anywhere "a per-thread stream handle is used on any thread" cuda_binding
plant cuda-context-made-each-call "cuda::context makes a new context each call" cuda_binding
plant cuda-illegal-address-not-sticky "sticky codes miss CUDA_ERROR_ILLEGAL_ADDRESS" cuda_faults
plant cuda-fence-events-not-pooled "CUDA fence events are destroyed, not pooled" cuda_binding
plant cuda-contained-not-sticky "CUDA_ERROR_CONTAINED (226, by number) is not sticky" cuda_binding

# Contexts opened from several places, dropped and opened again. A thread's
# binding to a context torn down and made again works on the real driver
# (and the fake by default); the fake's strict mode refuses it, so the
# plants that trust such a binding are run there.
plant cuda-last-context-drop-not-restored "the crate drops a context's last handle without restoring the thread's context" cuda_contexts
plant cuda-fence-pool-per-object "fence events are pooled per context object, not per driver context" cuda_contexts
plant cuda-cross-context-record-invalid-context "a cross-context record is refused with INVALID_CONTEXT, not the driver's INVALID_HANDLE" cuda_contexts
export FAKE_CUDA_STRICT_REBIND=1
plant cuda-own-thread-trusts-stale-binding "the crate's own threads trust a torn-down context's binding" cuda_binding
plant cuda-user-thread-trusts-stale-binding "a user's thread trusts a torn-down context's binding" cuda_contexts
unset FAKE_CUDA_STRICT_REBIND

# The CUDA backend at exit, when timing, and fencing from two threads.
plant cuda-calls-after-shutdown "calls still reach the driver after it returned CUDA_ERROR_DEINITIALIZED" cuda_exit
plant cuda-elapsed-legacy-preferred "the legacy cuEventElapsedTime is preferred over _v2" cuda_elapsed
plant cuda-elapsed-across-contexts-not-refused "two events of different contexts are timed by the driver" cuda_elapsed
plant cuda-sequence-taken-after-record "a fence's sequence is taken after its record, outside the stream's lock" cuda_record_order
plant profiler-swaps-context "a profiler used on another context swaps its events silently" profiler

# The waiter (host backend and unit tests; no driver needed).
plant unwinding-thread-not-given-back "a waiter thread that unwinds is not given back by its guard" lib
plant wait-put-back-at-its-sequence "a wait put back at its sequence, not where it was placed (and not told)" await_faults
plant lane-thread-resolves-unreached-wait "a lane thread resolves the wait it takes next without a query showing it reached" lib properties
plant cancel-counts-a-delivered-wait "a future dropped after its result came is counted cancelled too" lib
plant stall-timed-from-hand-off "a stuck wait is timed from its hand-off, not from its stream's last progress" waiter_stats
plant blocked-wait-end-not-progress "the end of a wait a lane thread blocked on is not its stream's progress" waiter_stats
plant hand-off-does-not-look-for-stuck "a hand-off never looks for stuck streams" waiter_stats
plant idle-thread-does-not-look-for-stuck "an idle lane thread sleeps its whole keep-alive without looking for stuck streams" waiter_stats
plant removed-lane-watch-not-parked "a lane removed while its wait is out in a batch ends its stall, and is reported again when made again" lib

# The host backend: as strict as CUDA where a test's meaning depends on it.
plant host-record-releases-earlier-waits "a record reached at once releases waits on earlier records" lib event
plant host-fault-poisons-own-stream-only "a fault poisons its own stream only, not the context" host_stream

# The drop queue: no value dropped before its fence, no flush that hangs.
plant dropped-push-future-drops-value "a push future dropped before it resolved drops its value" drop_queue
plant dropped-flush-future-leaves-waker "a dropped flush future leaves its waker" drop_queue
plant shutdown-now-uncounted "shutdown_now does not count what it hands back" drop_queue

# The waiter's loom models.
plant_loom line-logger-stops-after-letting-go "the thread logging stuck-wait lines stops in a second hold of the lock, so a line queued in between is never logged" \
    loom_queued_lines_are_each_logged_once_in_order
plant_loom line-maker-logs-a-lone-line-itself "a thread whose line is alone in the queue logs it outside the logging turn, so it may come out before an older one" \
    loom_queued_lines_are_each_logged_once_in_order
plant_loom idle-thread-leaves-without-looking "an idle thread leaves on a timeout without looking at the queues" \
    loom_an_idle_thread_timing_out_races_a_submit
plant_loom lane-made-in-settle-not-queued "a lane made afresh in settle is not queued" \
    loom_a_lane_taken_back_from_the_poller_mid_batch_is_made_again
plant_loom submit-enters-drained-shard "a submit enters a shard that shutdown has drained" \
    loom_shutdown_races_a_submit_from_another_task
plant_loom idle-thread-wake-never-sent "an idle thread's wake-up is decided but never sent" \
    loom_two_idle_lane_threads_are_woken_for_new_lanes
plant_loom refused-lane-left-for-threads "a refused lane thread leaves its lane queued for threads" \
    loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller
plant_loom settle-miscounts-cancelled "a settle miscounts a wait found cancelled" \
    loom_a_future_dropped_while_the_poller_has_its_wait_out
plant_loom lane-count-read-before-scheduler-lock "a new lane's count of lanes is read before the scheduler's lock" \
    loom_a_new_lane_never_waits_behind_a_lane_queued_just_before_it
# Counting defects the invariant checks catch where the lock is let go.
plant_loom settle-forgets-cancelled "a settle does not count a wait found cancelled as finished" \
    loom_a_future_dropped_while_the_poller_has_its_wait_out
plant_loom woke-keeps-idle-count "a woken lane thread is still counted idle" \
    loom_an_idle_thread_timing_out_races_a_submit

echo "== every plant caught ($caught)"
