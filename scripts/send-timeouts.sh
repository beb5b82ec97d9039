#!/usr/bin/env bash
# make send-timeouts: how often a bounded synchronous send ends UNKNOWN on this broker, for
# each send timeout and number of client retries, and what the broker's durability profile
# costs. The figures behind mq.send_timeout_ms, mq.send_retries and SECKILL_MQ_PROFILE
# (docs/benchmarks-history.md, "Send timeout, retries and the broker profile").
#
# Each cell: seckill-bench broker, one message per call from SENDERS concurrent senders for
# SEND_SECONDS, through the pipeline's own producer and classifier. A timeout is the bound of one
# call; an UNKNOWN outcome is what the API then answers 202 for and leaves to the scanner.
# Then the same sends (one per call and batches of 32) against each broker profile
# (scripts/rocketmq-up.sh: development = ASYNC_FLUSH; production = SYNC_FLUSH; replicated =
# SYNC_FLUSH + SYNC_MASTER with a slave): the broker is restarted for each and left in the
# development profile at the end, the slave's store removed.
#
# Knobs: SENDERS (64), SEND_SECONDS (10), TIMEOUTS ("20 40 100 300"), RETRIES ("0 2").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export SECKILL_ENV=bench
SENDERS="${SENDERS:-64}"
SECONDS_EACH="${SEND_SECONDS:-10}"
TIMEOUTS="${TIMEOUTS:-20 40 100 300}"
RETRIES="${RETRIES:-0 2}"

log() { printf '[send-timeouts] %s\n' "$*" >&2; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

# The benchmarks measure the release build of the RocketMQ servers (rocketmq-up.sh restarts a
# broker running the debug one), as they measure seckill's release binaries.
export SECKILL_MQ_BUILD=release
scripts/services-up.sh >&2
cargo build --release --quiet -p seckill-bench
BENCH="$root/target/release/seckill-bench"

restart_broker() {
  scripts/rocketmq-down.sh --broker-only >&2
  SECKILL_MQ_PROFILE="$1" scripts/rocketmq-up.sh >&2
}
# Whatever happens, the broker goes back to the development profile and the slave's store goes.
trap 'restart_broker development; rm -rf "${SECKILL_MQ_DATA_DIR:-$HOME/.cache/seckill/rocketmq-data}/store-slave"' EXIT

restart_broker development
echo "| timeout (ms) | client retries | sends/s | UNKNOWN | call p50 (ms) | call p99 (ms) | call p99.9 (ms) |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for t in $TIMEOUTS; do
  for r in $RETRIES; do
    line="$("$BENCH" broker --batch 1 --senders "$SENDERS" --seconds "$SECONDS_EACH" \
      --timeout-ms "$t" --retries "$r" | tail -1 || true)"
    log "$line"
    echo "| $t | $r | $(field "$line" msgs_per_s) | $(field "$line" unknown_pct) % ($(field "$line" unknown)) | $(field "$line" call_p50_ms) | $(field "$line" call_p99_ms) | $(field "$line" call_p999_ms) |"
  done
done

echo
echo "| profile | batch | msgs/s | call p50 (ms) | call p99 (ms) | UNKNOWN |"
echo "| --- | --- | --- | --- | --- | --- |"
for profile in development production replicated; do
  restart_broker "$profile"
  for spec in "1 $SENDERS" "32 4"; do
    read -r batch senders <<<"$spec"
    line="$("$BENCH" broker --batch "$batch" --senders "$senders" --seconds "$SECONDS_EACH" \
      --timeout-ms 3000 | tail -1 || true)"
    log "$profile: $line"
    echo "| $profile | $batch | $(field "$line" msgs_per_s) | $(field "$line" call_p50_ms) | $(field "$line" call_p99_ms) | $(field "$line" unknown) |"
  done
done
