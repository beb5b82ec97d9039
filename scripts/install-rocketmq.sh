#!/usr/bin/env bash
# Installs the RocketMQ name server and broker (Rust implementation, crates.io 1.0.0) into a
# cache outside the repository, once. Safe to re-run: it does nothing when the binaries are
# already there.
#
# The servers are built by this workspace, not by `cargo install`: tools/rocketmq-servers puts
# their crates into Cargo.lock, and the build below selects seckill and seckill-bench with them,
# so every crate the servers share with the project (the RocketMQ transport, protocol and runtime
# crates, tokio, rustls, ...) is resolved exactly as the project's own build resolves it (Cargo.toml
# declares the features the servers add; scripts/check-build-graph.py keeps the two equal). Only
# the servers' binaries and what they need are compiled, in the project's target directory; the
# project's build that follows finds the shared crates done. Only the binaries are cached: a later
# clone's build compiles nothing of the servers.
set -euo pipefail
ROCKETMQ_VERSION="${ROCKETMQ_VERSION:-1.0.0}"
TOOLS_DIR="${SECKILL_TOOLS_DIR:-$HOME/.cache/seckill/rocketmq-$ROCKETMQ_VERSION}"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$TOOLS_DIR/bin/rocketmq-namesrv-rust" && -x "$TOOLS_DIR/bin/rocketmq-broker-rust" ]]; then
  echo "rocketmq: binaries present in $TOOLS_DIR/bin"
  exit 0
fi
mkdir -p "$TOOLS_DIR/bin"
# One build at a time on this machine: a lock keeps two concurrent callers from racing.
exec 9>"$TOOLS_DIR/.install.lock"
flock 9
if [[ -x "$TOOLS_DIR/bin/rocketmq-namesrv-rust" && -x "$TOOLS_DIR/bin/rocketmq-broker-rust" ]]; then
  exit 0
fi
locked_version="$(grep -A1 '^name = "rocketmq-broker"$' "$REPO_DIR/Cargo.lock" | sed -n 's/^version = "\(.*\)"$/\1/p')"
if [[ "$locked_version" != "$ROCKETMQ_VERSION" ]]; then
  echo "rocketmq: Cargo.lock pins rocketmq-broker $locked_version, not $ROCKETMQ_VERSION (ROCKETMQ_VERSION)" >&2
  exit 1
fi
echo "rocketmq: building rocketmq-namesrv and rocketmq-broker $ROCKETMQ_VERSION in the project's target (release, once)"
started=$(date +%s)
cd "$REPO_DIR"
cargo build --release --locked \
  -p seckill -p seckill-bench -p seckill-rocketmq-servers -p rocketmq-namesrv -p rocketmq-broker \
  --bin rocketmq-namesrv-rust --bin rocketmq-broker-rust
target_dir="${CARGO_TARGET_DIR:-$REPO_DIR/target}"
for bin in rocketmq-namesrv-rust rocketmq-broker-rust; do
  install -m 0755 "$target_dir/release/$bin" "$TOOLS_DIR/bin/$bin.tmp"
  mv "$TOOLS_DIR/bin/$bin.tmp" "$TOOLS_DIR/bin/$bin"
done
echo "rocketmq: built in $(( $(date +%s) - started )) s"
ls -l "$TOOLS_DIR/bin"
