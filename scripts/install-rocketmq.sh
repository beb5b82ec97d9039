#!/usr/bin/env bash
# Installs the RocketMQ name server and broker (Rust implementation, crates.io 1.0.0)
# into a cache outside the repository, once. Safe to re-run: it does nothing when the
# binaries are already there. Both packages build in one shared target directory, so the
# dependencies they share (tokio, the RocketMQ crates, ...) compile once, not twice; the
# directory is removed once the binaries are installed.
set -euo pipefail
ROCKETMQ_VERSION="${ROCKETMQ_VERSION:-1.0.0}"
TOOLS_DIR="${SECKILL_TOOLS_DIR:-$HOME/.cache/seckill/rocketmq-$ROCKETMQ_VERSION}"
if [[ -x "$TOOLS_DIR/bin/rocketmq-namesrv-rust" && -x "$TOOLS_DIR/bin/rocketmq-broker-rust" ]]; then
  echo "rocketmq: binaries present in $TOOLS_DIR/bin"
  exit 0
fi
mkdir -p "$TOOLS_DIR"
# One build at a time on this machine: a lock keeps two concurrent callers from racing.
exec 9>"$TOOLS_DIR/.install.lock"
flock 9
if [[ -x "$TOOLS_DIR/bin/rocketmq-namesrv-rust" && -x "$TOOLS_DIR/bin/rocketmq-broker-rust" ]]; then
  exit 0
fi
echo "rocketmq: installing rocketmq-namesrv and rocketmq-broker $ROCKETMQ_VERSION into $TOOLS_DIR (about 10 minutes, once)"
started=$(date +%s)
CARGO_TARGET_DIR="$TOOLS_DIR/target" cargo install --locked --root "$TOOLS_DIR" \
  "rocketmq-namesrv@$ROCKETMQ_VERSION" "rocketmq-broker@$ROCKETMQ_VERSION"
rm -rf "$TOOLS_DIR/target"
echo "rocketmq: installed in $(( $(date +%s) - started )) s"
ls -l "$TOOLS_DIR/bin"
