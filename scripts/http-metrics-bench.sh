#!/usr/bin/env bash
# The HTTP service example under load, with its /metrics published by the
# `metrics` feature (this tree) against REV's example without the feature
# (hand-written Prometheus text; default: the commit before the feature),
# and this tree's build against a second process of itself, to show the
# noise band. Loopback only; `wrk` (Debian package `wrk`) sends jobs
# of no work, and a GET /metrics every SCRAPE_EVERY requests, which publishes
# every series then renders them. The three servers run side by side and take
# turns rep by rep, in rotated order; CPU per request is the server's own
# (utime + stime from /proc) over the requests wrk completed.
#
#   bash scripts/http-metrics-bench.sh [REV]     # REPS=4 SECONDS_EACH=4 SCRAPE_EVERY=100
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-b1393c3}
reps=${REPS:-4}
seconds=${SECONDS_EACH:-4}
every=${SCRAPE_EVERY:-100}
target=${CARGO_TARGET_DIR:-$PWD/target}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

# Both builds in one target directory (their dependencies are shared).
cargo build --release --example http_service
cp "$target/release/examples/http_service" "$work/on"
cp "$work/on" "$work/on2"
mkdir "$work/rev"
git archive "$rev" | tar -x -C "$work/rev"
(cd "$work/rev" && CARGO_TARGET_DIR=$target cargo build --release --example http_service)
cp "$target/release/examples/http_service" "$work/off"

cat >"$work/load.lua" <<LUA
local n = 0
local job = wrk.format("POST", "/jobs", {["Content-Type"] = "application/json"},
    '{"work_us": 0, "stream": "any"}')
local scrape = wrk.format("GET", "/metrics")
request = function()
    n = n + 1
    if n % $every == 0 then return scrape end
    return job
end
LUA

declare -A port pid
names=(off on on2)
for i in "${!names[@]}"; do
    name=${names[$i]}
    port[$name]=$((3170 + i))
    "$work/$name" "${port[$name]}" >"$work/$name.log" 2>&1 &
    pid[$name]=$!
done
sleep 1
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
tick=$(getconf CLK_TCK)
echo "build rep requests/s p99_ms cpu_us_per_request"
for rep in $(seq 1 "$reps"); do
    for k in 0 1 2; do
        name=${names[$(((k + rep) % 3))]}
        before=$(cpu "${pid[$name]}")
        out=$(wrk -t1 -c16 -d"${seconds}s" --latency -s "$work/load.lua" "http://127.0.0.1:${port[$name]}/")
        after=$(cpu "${pid[$name]}")
        requests=$(awk '/requests in/ {print $1}' <<<"$out")
        rate=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
        p99=$(awk '$1 == "99%" {v = $2; if (v ~ /us$/) {sub(/us/, "", v); v /= 1000} else if (v ~ /ms$/) {sub(/ms/, "", v)} else if (v ~ /s$/) {sub(/s/, "", v); v *= 1000} print v}' <<<"$out")
        per=$(awk -v t=$((after - before)) -v hz="$tick" -v n="$requests" 'BEGIN {printf "%.1f", t / hz * 1e6 / n}')
        echo "$name $rep $rate $p99 $per"
    done
done
