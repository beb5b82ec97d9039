#!/usr/bin/env bash
# Installs the RocketMQ name server and broker (Rust implementation, crates.io 1.0.0) into a
# cache outside the repository, once per build profile. Safe to re-run: it does nothing when the
# binaries are already there.
#
# The servers are built by this workspace, not by `cargo install`: tools/rocketmq-servers puts
# their crates into Cargo.lock, and the build below selects seckill and seckill-bench with them,
# so every crate the servers share with the project (the RocketMQ transport, protocol and runtime
# crates, tokio, rustls, ...) is resolved exactly as the project's own build resolves it (Cargo.toml
# declares the features the servers add; scripts/check-build-graph.py keeps the resolutions
# equal). The servers' binaries are compiled in the project's target directory together with
# seckill's and seckill-bench's of the same profile, so the project's build that follows finds
# everything done. Only the servers' binaries are cached: a later clone's build compiles nothing
# of the servers.
#
# SECKILL_MQ_BUILD picks the profile (docs/RUNNING.md#the-first-run):
#   debug    (default) the profile of make demo and make test: dependencies, the servers' crates
#            among them, at opt-level 1, built with the failpoints feature as the tests are, so
#            the demo's and the tests' builds share every compiled crate with this one.
#   release  what the benchmarks measure (scripts/bench.sh and the other bench scripts set it).
set -euo pipefail
ROCKETMQ_VERSION="${ROCKETMQ_VERSION:-1.0.0}"
TOOLS_DIR="${SECKILL_TOOLS_DIR:-$HOME/.cache/seckill/rocketmq-$ROCKETMQ_VERSION}"
BUILD="${SECKILL_MQ_BUILD:-debug}"
case "$BUILD" in
  debug) cargo_profile=(--features seckill/failpoints) ;;
  release) cargo_profile=(--release) ;;
  *) echo "rocketmq: SECKILL_MQ_BUILD must be debug or release, not '$BUILD'" >&2; exit 2 ;;
esac
BIN_DIR="$TOOLS_DIR/$BUILD/bin"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$BIN_DIR/rocketmq-namesrv-rust" && -x "$BIN_DIR/rocketmq-broker-rust" ]]; then
  echo "rocketmq: binaries present in $BIN_DIR"
  exit 0
fi
mkdir -p "$BIN_DIR"
# One build at a time on this machine: a lock keeps two concurrent callers from racing.
exec 9>"$TOOLS_DIR/.install.lock"
flock 9
if [[ -x "$BIN_DIR/rocketmq-namesrv-rust" && -x "$BIN_DIR/rocketmq-broker-rust" ]]; then
  exit 0
fi
locked_version="$(grep -A1 '^name = "rocketmq-broker"$' "$REPO_DIR/Cargo.lock" | sed -n 's/^version = "\(.*\)"$/\1/p')"
if [[ "$locked_version" != "$ROCKETMQ_VERSION" ]]; then
  echo "rocketmq: Cargo.lock pins rocketmq-broker $locked_version, not $ROCKETMQ_VERSION (ROCKETMQ_VERSION)" >&2
  exit 1
fi
echo "rocketmq: building rocketmq-namesrv and rocketmq-broker $ROCKETMQ_VERSION in the project's target ($BUILD, once)"
started=$(date +%s)
cd "$REPO_DIR"
# Every binary of the selection, seckill's and seckill-bench's too: one invocation lets Cargo
# compile the RocketMQ client and seckill on one core while the broker's crates, a chain of one
# crate after another, hold the other.
cargo build "${cargo_profile[@]}" --locked --bins \
  -p seckill -p seckill-bench -p seckill-rocketmq-servers -p rocketmq-namesrv -p rocketmq-broker
target_dir="${CARGO_TARGET_DIR:-$REPO_DIR/target}"
for bin in rocketmq-namesrv-rust rocketmq-broker-rust; do
  install -m 0755 "$target_dir/$BUILD/$bin" "$BIN_DIR/$bin.tmp"
  mv "$BIN_DIR/$bin.tmp" "$BIN_DIR/$bin"
done
echo "rocketmq: built, with the project's binaries, in $(( $(date +%s) - started )) s"
ls -l "$BIN_DIR"
