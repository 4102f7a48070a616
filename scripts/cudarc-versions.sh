#!/usr/bin/env bash
# The crate builds whatever CUDA version feature a cudarc user picks
# (cudarc's version features are exclusive, so this crate names none), and
# builds for a project that names none. CI runs it.
#
# 1. The crate's library and tests against the oldest and newest 12.x and
#    13.x bindings.
# 2. A user's project, as cudarc's README has users write it (default
#    features, one version feature), with this crate beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

for version in 12000 12090 13000 13040; do
    echo "== cudarc/cuda-$version"
    cargo check --quiet --lib --tests --features "cudarc/cuda-$version"
done

user=target/cudarc-user-project
rm -rf "$user"
mkdir -p "$user/src"
cat >"$user/Cargo.toml" <<TOML
[package]
name = "cudarc-user"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
cudarc = { version = "0.19", features = ["cuda-12080"] }
device-events = { path = "$PWD" }

[workspace]
TOML
cat >"$user/src/main.rs" <<'RS'
fn main() {
    match device_events::cuda::context(0) {
        Ok(ctx) => {
            let stream = ctx.new_stream().expect("a stream");
            device_events::cuda::fence(&stream).wait_sync().expect("a fence");
        }
        Err(err) => eprintln!("no GPU: {err}"),
    }
}
RS
echo "== a user's project with cudarc { features = [\"cuda-12080\"] }"
CARGO_TARGET_DIR="$PWD/target" cargo check --quiet --manifest-path "$user/Cargo.toml"
echo "== a user's project that names no CUDA version"
sed -i 's/cudarc = .*/cudarc = { version = "0.19", default-features = false, features = ["driver"] }/' "$user/Cargo.toml"
CARGO_TARGET_DIR="$PWD/target" cargo check --quiet --manifest-path "$user/Cargo.toml"
