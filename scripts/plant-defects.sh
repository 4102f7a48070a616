#!/usr/bin/env bash
# Plants, one at a time, each defect in the waiter's races that only a loom
# model reaches, and checks that its model fails. A plant the models do not
# catch fails this script: they have gone soft. CI runs it. That the rest of
# the suite can fail is shown by scripts/mutants.sh.
#
#   bash scripts/plant-defects.sh              # every patch in scripts/plants
#   bash scripts/plant-defects.sh PATCH...     # only these
#
# Each defect is a patch, scripts/plants/<name>.patch, that turns the clean
# code into the defective code; its header names the defect (`What:`) and the
# loom model that must catch it (`Model:`). The list of plants is that folder.
# Each patch is applied to a scratch copy of this tree (target/plant/tree,
# copied afresh each run and reset before each plant), never to the tree
# itself, and one that no longer applies fails the script.
set -euo pipefail
patches=()
for patch in "$@"; do
    patches+=("$(realpath "$patch")")
done
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
repo=$PWD
work=$repo/target/plant
tree=$work/tree
clean=$work/clean

if ((${#patches[@]} == 0)); then
    shopt -s nullglob
    patches=("$repo"/scripts/plants/*.patch)
    shopt -u nullglob
fi
if ((${#patches[@]} == 0)); then
    echo "no plants: scripts/plants holds no *.patch"
    exit 1
fi

# The scratch copy: what `cargo test --lib` needs, copied afresh from this
# tree each run into `clean`, which stays as copied; `tree` is reset from it
# before each plant.
copied=(Cargo.toml Cargo.lock build.rs README.md src tests benches examples)
rm -rf "$tree" "$clean"
mkdir -p "$clean"
for path in "${copied[@]}"; do
    if [[ -e $path ]]; then
        cp -R "$path" "$clean/"
    fi
done
if ! diff -r -q src "$clean/src"; then
    echo "the scratch copy's src/ differs from this tree's"
    exit 1
fi
cp -R "$clean" "$tree"

# One target folder and one scratch path for every plant, so only the crate
# itself is rebuilt for each; the copy's files are new each time, so no build
# of an earlier plant is reused.
run_loom() {
    (cd "$tree" && RUSTFLAGS="--cfg device_events_loom" CARGO_TARGET_DIR=$work/loom-target \
        LOOM_MAX_PREEMPTIONS=2 cargo test --release --lib "$@")
}

echo "== building the loom models (the clean copy, once; each plant rebuilds only the crate)"
run_loom --no-run >"$work/build-loom.log" 2>&1 || { tail -20 "$work/build-loom.log"; exit 1; }

caught=0

# plant PATCH: apply PATCH to a clean copy of src/, run the loom model its
# header names, and require it to fail.
plant() {
    local patch=$1 name what model
    if [[ ! -f $patch ]]; then
        echo "NO SUCH PATCH: $patch"
        return 1
    fi
    name=$(basename "$patch" .patch)
    what=$(sed -n -E 's/^What: //p' "$patch" | head -1)
    model=$(sed -n -E 's/^Model: //p' "$patch" | head -1)
    if [[ -z $what || ! $model =~ ^loom_[a-z0-9_]+$ ]]; then
        echo "BAD PLANT: $patch: its header needs a 'What: ...' line and a 'Model: loom_...' line"
        return 1
    fi

    rm -rf "$tree"
    cp -R "$clean" "$tree"
    if ! grep -rqE "fn $model\(" "$tree/src"; then
        echo "NO SUCH MODEL: $name: $model is not a test in src/ (patch $patch)"
        return 1
    fi
    if ! patch -p1 --forward --batch --fuzz=0 -d "$tree" -i "$patch" >"$work/$name.patch.log" 2>&1; then
        echo "DOES NOT APPLY: $patch no longer applies to the clean code:"
        cat "$work/$name.patch.log"
        echo "Regenerate it: see docs/testing.md, 'Planted defects'."
        return 1
    fi

    if run_loom "$model" >"$work/$name.log" 2>&1; then
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
for patch in "${patches[@]}"; do
    plant "$patch"
done

echo "== every plant caught ($caught)"
