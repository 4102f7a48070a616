#!/usr/bin/env bash
# Switches on, one at a time, each defect planted in the waiter's races that
# only a loom model reaches, and checks that its model fails. A plant the
# models do not catch fails this script: they have gone soft. CI runs it.
# That the rest of the suite can fail is shown by scripts/mutants.sh.
#
#   bash scripts/plant-defects.sh
#
# Each defect is a hook beside the code it breaks (`plant::planted`,
# src/waiter/plant.rs), compiled only with `--cfg device_events_plant` and chosen
# at run time by `DEVICE_EVENTS_PLANT=<name>`: the models are built once,
# and a refactor moves a plant with its code.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
work=$PWD/target/plant
mkdir -p "$work"

loom_flags="--cfg device_events_plant --cfg device_events_loom"
echo "== building the loom models with the plant hooks (once)"
RUSTFLAGS=$loom_flags CARGO_TARGET_DIR=$work/loom-target cargo test --release --lib --no-run \
    >"$work/build-loom.log" 2>&1 || { tail -20 "$work/build-loom.log"; exit 1; }

# Every hook in the source is planted below, and every plant below has a
# hook: a renamed hook must not quietly stop being checked.
declared=$(grep -rhoE 'planted\("[a-z0-9-]+"\)' src | sed -E 's/planted\("(.*)"\)/\1/' | sort -u)
listed=$(grep -oE '^plant_loom [a-z0-9-]+' "$0" | awk '{print $2}' | sort -u)
if [[ $declared != "$listed" ]]; then
    echo "the hooks in src/ and the plants in this script differ:"
    diff <(echo "$declared") <(echo "$listed") || true
    exit 1
fi

caught=0

# plant_loom NAME WHAT MODEL: run one loom model of the waiter with the
# defect NAME switched on, and require it to fail.
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
    failure=$(grep -m1 -o -E "^test .*$model .* FAILED$|'waiter::tests::loom_models::$model' \([0-9]+\) panicked at .*" "$work/$name.log" || true)
    if [[ -z $failure ]]; then
        echo "NOT A MODEL FAILURE: $name (log $work/$name.log)"
        tail -5 "$work/$name.log"
        return 1
    fi
    # What failed: loom's deadlock, or the first panic's message (the line
    # after the first "panicked at").
    local why
    why=$(grep -m1 -o -E '^deadlock' "$work/$name.log" \
        || grep -m1 -A1 -E 'panicked at ' "$work/$name.log" | sed -n 2p)
    echo "caught: $what: $model: ${why:-panicked}"
    caught=$((caught + 1))
}

# The waiter's races that only a loom model reaches: each breaks a count or
# a queue under the pool's lock (its invariants fail when the lock is let
# go) or loses a wake-up (the model deadlocks, or a watcher's nap runs out
# past an entry due before its end: the nap's own check fails).
plant_loom woke-keeps-idle-count "a woken lane thread is still counted idle" \
    loom_an_idle_thread_timing_out_races_a_submit
plant_loom idle-thread-leaves-without-looking "an idle thread leaves on a timeout without looking at the queues" \
    loom_an_idle_thread_timing_out_races_a_submit
plant_loom submit-after-shutdown-queued "a submit after shutdown queues its wait in a lane nobody serves" \
    loom_shutdown_races_a_submit
plant_loom refused-lane-left-for-threads "a refused lane thread leaves its lanes queued for threads" \
    loom_a_refused_thread_spawn_leaves_the_lane_to_the_poller
plant_loom idle-thread-wake-never-sent "an idle thread's wake-up is decided but never sent" \
    loom_two_idle_lane_threads_are_woken_for_new_lanes
plant_loom watcher-takes-the-hold-delivers-nothing "the watcher wins the race for a wait but never delivers it" \
    loom_the_watcher_and_the_driver_race_to_resolve_a_wait_once
plant_loom shutdown-leaves-the-watchers-list "shutdown leaves entries on the list of a watcher that then exits" \
    loom_shutdown_during_the_race
plant_loom napping-watcher-never-woken "a napping watcher is not woken for an entry due before its nap ends" \
    loom_an_entry_due_before_the_watchers_nap_ends_wakes_it

echo "== every plant caught ($caught)"
