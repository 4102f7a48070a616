#!/usr/bin/env bash
# Build every test, benchmark and example binary here, stripped, into one
# git-ignored folder (default device-bin/) that a GPU machine runs with
# scripts/gpu-check.sh. That machine needs the NVIDIA driver, not Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-device-bin}
rm -rf "$out"
mkdir -p "$out/tests" "$out/bench" "$out/examples"

# Executables of a cargo build, from its JSON messages.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["target"]["kind"][0], message["target"]["name"], message["executable"])
'
}

copy() { # kind name path
    case "$1" in
        test) dest="$out/tests/$2" ;;
        bench) dest="$out/bench/$2" ;;
        example) dest="$out/examples/$2" ;;
        *) return 0 ;;
    esac
    cp "$3" "$dest"
    strip "$dest" 2>/dev/null || true
}

cargo test --release --no-run --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do
        # The library's unit tests are named after the crate.
        [ "$kind" = lib ] && kind=test
        copy "$kind" "$name" "$path"
    done
cargo bench --no-run --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do copy "$kind" "$name" "$path"; done
cargo build --release --examples --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do copy "$kind" "$name" "$path"; done
cp scripts/gpu-check.sh "$out/"
du -sh "$out"
ls "$out"/*
