#!/usr/bin/env bash
# Mutation testing of the waiter and the fence: cargo-mutants changes the
# code one small way at a time (a condition flipped, a body replaced by a
# default) and runs the tests that cover it; a mutant that no test fails
# ("missed") is a gap in the tests, or a change that cannot be seen (an
# equivalent mutant). Each known missed mutant is listed in docs/testing.md
# with the test that kills it or the reason it is equivalent.
#
#   bash scripts/mutants.sh                 # src/waiter/ (its tests aside), src/fence.rs, src/api.rs
#   bash scripts/mutants.sh src/waiter/slot.rs   # one file
#
# Not in CI: it builds and tests a few hundred mutants (see docs/testing.md
# for how long that takes). Installs cargo-mutants if it is missing. Results
# go to target/mutants/mutants.out/ (missed.txt, caught.txt, timeout.txt),
# or under $MUTANTS_OUT. MUTANTS_TIMEOUT (seconds a mutant's tests may run,
# default 60: a test that hangs on a mutant is a kill that costs this much)
# and MUTANTS_JOBS (default 1) tune it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

if ! cargo mutants --version >/dev/null 2>&1; then
    cargo install --locked cargo-mutants
fi

files=("$@")
if ((${#files[@]} == 0)); then
    files=("src/waiter/*.rs" "src/waiter/watcher/*.rs" src/fence.rs src/api.rs)
fi
args=()
for file in "${files[@]}"; do args+=(--file "$file"); done

# The tests that exercise the waiter and the fence: its unit tests (with the
# guards' planted panics) and the host-backend suites (the stream's own, for its progress
# word), the stats ones too. The loom models need
# other build flags, and the test-only modules are not mutated.
exec cargo mutants "${args[@]}" \
    --exclude 'src/waiter/tests/*' \
    --output "${MUTANTS_OUT:-target/mutants}" \
    --timeout "${MUTANTS_TIMEOUT:-60}" \
    --jobs "${MUTANTS_JOBS:-1}" \
    -- --lib --test await_faults --test await_panics --test await_runtimes \
    --test await_load --test fence --test fallbacks --test properties --test event \
    --test fork --test profiler --test waiter_stats --test host_stream --test watchers
