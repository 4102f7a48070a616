#!/usr/bin/env bash
# A/B benchmark: the `waiters` bench at another git revision (A) against this
# working tree, uncommitted changes included (B), run in turn on the same
# machine so that its speed drifts hit both sides alike.
#
#   scripts/ab-bench.sh REV [bench args...]
#
#   scripts/ab-bench.sh HEAD~1 --quick --only 1,3        # smoke run
#   scripts/ab-bench.sh main --only 1,2,6                # this tree against main
#   scripts/ab-bench.sh HEAD~1 --only 8 --strategies await,spawn_blocking,raw_handoff
#   AB_REPS=5 scripts/ab-bench.sh main --large
#
# (A commit older than scenario 8 checks a backend's targets only when its
# scenario 1 ran: give such a commit's `--only` list a 1.)
#
# REV is anything git takes for a commit. Both benches are built first:
# REV's in a git worktree at AB_DIR/rev-<commit>/ (kept, so a later run at
# the same commit builds nothing new) with a target dir of its own,
# AB_DIR/target/; this tree's with `cargo bench --bench waiters --no-run`
# into its usual target dir ($CARGO_TARGET_DIR, or cargo's default). Each executable is
# taken from cargo's JSON messages. Then the script runs A, B, A, B, ... for
# AB_REPS rounds, each with the bench args (after `--bench`, as cargo bench
# passes it) from its own tree's root, and prints each run's `## summary`.
# At the end it prints the summary lines side by side: each run's value, the
# median of each side and B's median over A's; `!` marks a MISS in that run,
# `n/m` a target not measured, `-` a line that side does not print (one for a
# scenario REV lacks, say). Then the PASS/MISS counts of each run.
#
# When REV's bench rejects an argument (a flag or scenario newer than REV: it
# exits 2 with its usage message), the script says so, runs A no more, and
# shows B alone.
#
# Environment:
#   AB_REPS        rounds, each one run of A and one of B (default 3)
#   AB_DIR         REV worktrees, REV's target dir and logs (default target/ab,
#                  which git ignores; `cargo clean` removes it, and the next run
#                  prunes the worktrees git still lists there)
#   AB_CARGO_ARGS  more arguments for both builds, e.g. --no-default-features
#
# Output goes to AB_DIR/logs/<date>-<time>/: build-A.log and build-B.log (cargo's
# messages), A-1.log, B-1.log, ... (each run's whole output), side-by-side.txt.
# Each run gets CARGO_TARGET_DIR=<that folder>/A-1 (and so on), which the bench
# reads at run time for where to write, so each run's waiters.json and plots
# are kept in A-1/bench-results/.
#
# Needs git, cargo and python3. Exit status: 0 when every run of both sides
# ran; 1 when B's build or a run of B failed; 2 for a usage error (this
# script's, or B's bench rejected the arguments); 3 when B's runs all ran but
# A's are missing or partial (its build failed, its bench rejected the
# arguments, or a run failed).
set -euo pipefail

usage() {
    cat >&2 <<'EOF'
usage: scripts/ab-bench.sh REV [bench args...]
Builds the waiters bench at git revision REV (A) and in this working tree (B),
runs them A, B, A, B, ... for AB_REPS rounds (default 3) with the bench args,
and prints their summaries side by side. For example:
    scripts/ab-bench.sh HEAD~1 --quick --only 1,3
Environment: AB_REPS, AB_DIR (default target/ab), AB_CARGO_ARGS; see the
script's header.
EOF
    exit "$1"
}
[ $# -ge 1 ] || usage 2
case "$1" in -h | --help) usage 0 ;; esac
rev=$1
shift

cd "$(dirname "$0")/.."
root=$(pwd -P)
reps=${AB_REPS:-3}
case "$reps" in '' | *[!0-9]* | 0)
    echo "ab-bench: AB_REPS must be a positive whole number, not '$reps'" >&2
    exit 2
    ;;
esac
read -r -a cargo_args <<<"${AB_CARGO_ARGS:-}"

commit=$(git rev-parse --verify --quiet "$rev^{commit}") || {
    echo "ab-bench: git knows no commit '$rev'" >&2
    exit 2
}
short=$(git rev-parse --short "$commit")
ab_dir=${AB_DIR:-$root/target/ab}
mkdir -p "$ab_dir"
ab_dir=$(cd "$ab_dir" && pwd -P)
worktree=$ab_dir/rev-$commit
logs=$ab_dir/logs/$(date +%Y%m%d-%H%M%S)
mkdir -p "$logs"

# Paths as printed: relative to the tree's root where they are inside it.
show() {
    case "$1" in
    "$root") echo . ;;
    "$root"/*) echo "${1#"$root"/}" ;;
    *) echo "$1" ;;
    esac
}

head_short=$(git rev-parse --short HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    b_label="working tree ($head_short + changes)"
else
    b_label="working tree ($head_short)"
fi
a_label="$short ($rev)"
case "$commit" in "$rev"*) a_label=$short ;; esac

# REV's worktree, made once per commit and kept. `git worktree prune` forgets
# worktrees whose folder is gone (after `cargo clean`, say).
git worktree prune 2>/dev/null || true
if [ -d "$worktree" ] &&
    [ "$(git -C "$worktree" rev-parse --show-toplevel 2>/dev/null)" = "$worktree" ]; then
    # Undo any edit made there; files already right keep their times, so cargo
    # rebuilds nothing.
    git -C "$worktree" reset --quiet --hard "$commit"
else
    rm -rf "$worktree"
    git worktree prune 2>/dev/null || true
    echo "ab-bench: making a worktree for $short at $(show "$worktree")"
    git worktree add --quiet --detach "$worktree" "$commit"
fi

# build SIDE DIR [TARGET_DIR]: builds the bench in DIR (into TARGET_DIR when
# given) and prints its executable's path; cargo's messages go to
# build-SIDE.log.
build() {
    local side=$1 dir=$2 target_dir=${3:-} started=$SECONDS
    echo "ab-bench: building $side's bench in $(show "$dir") (log: $(show "$logs/build-$side.log"))" >&2
    if ! (cd "$dir" && if [ -n "$target_dir" ]; then export CARGO_TARGET_DIR=$target_dir; fi &&
        cargo bench --bench waiters --no-run --message-format=json ${cargo_args[@]+"${cargo_args[@]}"}) \
        >"$logs/build-$side.json" 2>"$logs/build-$side.log"; then
        echo "ab-bench: $side's build failed; the end of its log:" >&2
        tail -n 20 "$logs/build-$side.log" | sed 's/^/    /' >&2
        return 1
    fi
    python3 -c '
import json, sys
for line in open(sys.argv[1]):
    try:
        message = json.loads(line)
    except ValueError:
        continue
    target = message.get("target") or {}
    if (message.get("reason") == "compiler-artifact" and message.get("executable")
            and target.get("name") == "waiters" and "bench" in target.get("kind", [])):
        print(message["executable"])
        break
' "$logs/build-$side.json" | grep . || {
        echo "ab-bench: $side's build named no waiters bench executable" >&2
        return 1
    }
    echo "ab-bench: $side built in $((SECONDS - started)) s" >&2
}

# Both builds before any run. B's target dir is the tree's usual one.
a_exe=$(build A "$worktree" "$ab_dir/target") || a_exe=
b_exe=$(build B "$root") || {
    echo "ab-bench: B ($b_label) did not build: nothing to run" >&2
    exit 1
}
a_state=ok # ok, partial (a run failed), rejected (usage), none (no build)
b_state=ok # ok, failed (a run failed), rejected (usage)
[ -n "$a_exe" ] || {
    a_state=none
    echo "ab-bench: A ($short) did not build: running B alone" >&2
}

# run SIDE REP: one run of the bench; prints its summary. Returns the bench's
# exit status.
run() {
    local side=$1 rep=$2 exe dir label log started status=0
    shift 2
    if [ "$side" = A ]; then
        exe=$a_exe dir=$worktree label=$a_label
    else
        exe=$b_exe dir=$root label=$b_label
    fi
    log=$logs/$side-$rep.log
    started=$SECONDS
    echo
    echo "=== $side $rep/$reps: $label (log: $(show "$log"))"
    (cd "$dir" && CARGO_TARGET_DIR=$logs/$side-$rep "$exe" --bench "$@") >"$log" 2>&1 || status=$?
    if [ "$status" = 0 ]; then
        sed -n '/^## summary/,$p' "$log" >"$logs/$side-$rep.summary"
        cat "$logs/$side-$rep.summary"
        echo "=== $side $rep/$reps: $((SECONDS - started)) s"
    elif [ "$status" = 2 ]; then
        echo "$side's bench rejected the arguments (exit status 2):"
        sed 's/^/    /' "$log"
    else
        echo "$side's run FAILED (exit status $status); the end of its log:"
        tail -n 30 "$log" | sed 's/^/    /'
    fi
    return "$status"
}

for ((rep = 1; rep <= reps; rep++)); do
    if [ "$a_state" = ok ] || [ "$a_state" = partial ]; then
        status=0
        run A "$rep" "$@" || status=$?
        if [ "$status" = 2 ]; then
            a_state=rejected a_rejected=$logs/A-$rep.log
            echo "ab-bench: A's bench rejected the arguments: A is not run again"
        elif [ "$status" != 0 ]; then
            a_state=partial
        fi
    fi
    status=0
    run B "$rep" "$@" || status=$?
    if [ "$status" = 2 ]; then
        b_state=rejected b_rejected=$logs/B-$rep.log
        echo "ab-bench: B's bench rejected the arguments: stopping"
        break
    elif [ "$status" != 0 ]; then
        b_state=failed
    fi
done

# The side-by-side, from the summaries of the runs that finished.
echo
python3 - "$reps" "A = $a_label" "B = $b_label" "$logs" <<'PY' | tee "$logs/side-by-side.txt"
import os, sys

reps = int(sys.argv[1])
labels = {"A": sys.argv[2], "B": sys.argv[3]}
logs = sys.argv[4]

rows = {}      # key -> {"target": str, ("A", rep): cell, ...}
order = []     # keys in B's order, with lines only A prints merged in
counts = {}    # (side, rep) -> (PASS, MISS)
values = {}    # (key, side) -> [float]
for side in ("B", "A"):
    for rep in range(1, reps + 1):
        path = os.path.join(logs, f"{side}-{rep}.summary")
        if not os.path.exists(path):
            continue
        passed = missed = 0
        previous = None
        for line in open(path):
            line = line.rstrip("\n")
            status, _, rest = line.partition(" ")
            if status not in ("PASS", "MISS", "----", "INFO") or ": " not in rest:
                continue
            key, _, value = rest.rpartition(": ")
            target = ""
            if " (target " in value:
                value, _, target = value.partition(" (target ")
                target = target.rstrip(")")
            if status == "INFO":
                target = "(info)"
            if key not in rows:
                rows[key] = {"target": target}
                # A line new here goes after the line this run printed
                # before it.
                order.insert(order.index(previous) + 1 if previous else 0, key)
            elif target and not rows[key]["target"]:
                rows[key]["target"] = target
            if status == "----":
                cell = "n/m"
            else:
                cell = value
                try:
                    values.setdefault((key, side), []).append(float(value))
                except ValueError:
                    pass
                if status == "MISS":
                    cell += "!"
            passed += status == "PASS"
            missed += status == "MISS"
            rows[key][(side, rep)] = cell
            previous = key
        counts[(side, rep)] = (passed, missed)


def median(numbers):
    numbers = sorted(numbers)
    if not numbers:
        return None
    middle = len(numbers) // 2
    if len(numbers) % 2:
        return numbers[middle]
    return (numbers[middle - 1] + numbers[middle]) / 2


print(f"## A/B side by side, {reps} rep(s) each: {labels['A']}; {labels['B']}")
if not counts:
    print("(no run of either side finished)")
elif not rows:
    print("(no PASS, MISS, ---- or INFO line in either side's summary: a bench older")
    print(" than scenario 8 checks a backend's targets only when its scenario 1 ran,")
    print(" so give --only a 1)")
else:
    header = ["summary line"]
    for side in ("A", "B"):
        header += [f"{side}{rep}" for rep in range(1, reps + 1)] + [f"{side} med"]
    header += ["B/A", "target"]
    table = [header]
    for key in order:
        row = rows[key]
        line = [key]
        med = {}
        for side in ("A", "B"):
            line += [row.get((side, rep), "-") for rep in range(1, reps + 1)]
            med[side] = median(values.get((key, side), []))
            line.append("-" if med[side] is None else f"{med[side]:.2f}")
        if med["A"] and med["B"] is not None:
            line.append(f"{med['B'] / med['A']:.2f}")
        else:
            line.append("-")
        line.append(row["target"])
        table.append(line)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        cells = [line[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(line[1:-1], widths[1:-1])]
        cells.append(line[-1])
        print("  ".join(cells).rstrip())
    print("(! a MISS in that run; n/m not measured; - no such line or run)")
for side in ("A", "B") if counts else ():
    runs = [counts[(side, rep)] for rep in range(1, reps + 1) if (side, rep) in counts]
    if runs:
        per_run = ", ".join(f"{p} PASS {m} MISS" for p, m in runs)
        print(f"{labels[side]}: {per_run} (in {len(runs)} of {reps} run(s))")
    else:
        print(f"{labels[side]}: no run finished")
PY

case "$b_state/$a_state" in
rejected/rejected)
    echo "ab-bench: both benches rejected the arguments (see $(show "$b_rejected")): check them against the usage line above" >&2
    ;;
rejected/*)
    echo "ab-bench: this tree's bench rejected the arguments (see $(show "$b_rejected"))" >&2
    ;;
*/rejected)
    echo "ab-bench: A ($short)'s bench rejected the arguments this tree's accepts: $short predates a flag or scenario in them, so B ran alone (see $(show "$a_rejected"))"
    ;;
*/none) echo "ab-bench: A ($short) did not build (log: $(show "$logs/build-A.log")): B ran alone" ;;
*/partial) echo "ab-bench: some of A's runs failed; see their logs in $(show "$logs")" ;;
esac
[ "$b_state" = failed ] && echo "ab-bench: some of B's runs failed; see their logs in $(show "$logs")" >&2
echo "ab-bench: logs in $(show "$logs")"
case "$b_state" in
rejected) exit 2 ;;
failed) exit 1 ;;
esac
[ "$a_state" = ok ] || exit 3
