#!/usr/bin/env bash
# make bench-buckets: how one hot SKU scales with stock buckets
# (docs/architecture/redis.md#stock-buckets), measured in one run on this machine.
#
#   1. Redis: the reservation script's rate for one hot SKU (seckill-bench reserve: the
#      API's script and keys, nothing sent) on the one Redis, then on the Redis Cluster
#      (three primaries) with K = 1, 3 and 6 buckets, and each primary's share of the calls.
#   2. PostgreSQL: the order consumer draining a backlog of one hot SKU whose final stock is
#      K = 1, 2, 4 and 8 rows (seckill-bench backlog, as make bench runs it), orders/s, with
#      the backends waiting on a lock sampled every 20 ms during the drain; with one
#      transaction per bucket (`consumer.bucket_lanes`, "lanes") and with every transaction
#      gathering all buckets ("mixed", the baseline).
#
# Last line: BUCKETS redis_one=… cluster_k1=… cluster_k3=… cluster_k6=… (calls/s)
#   share_k1=… share_k3=… share_k6=… (the busiest primary's share) pg_<mode>_k<K>=… (orders/s)
#   lockwait_ms_per_tx_<mode>_k<K>=… (ms a backend spent waiting on a lock per transaction)
#   rowlock_ms_per_tx_<mode>_k<K>=… (of which on a row lock: a stock row's tuple/transaction id)
#   order_tx_<mode>_k<K>=… (transactions)
# Knobs: BUCKETS_REQUESTS (100000), BUCKETS_BACKLOG (20000), BUCKETS_CONCURRENCY (64),
# BUCKETS_ONLY=redis|pg (one half), BUCKETS_KS ("1 2 4 8"), BUCKETS_MODES ("lanes mixed"),
# BUCKETS_PIN=1 (PostgreSQL alone on core 0, the consumer and the broker on core 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export SECKILL_ENV=bench
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}/bench-buckets"
mkdir -p "$RUN_DIR"
REQ="${BUCKETS_REQUESTS:-100000}"
BACKLOG="${BUCKETS_BACKLOG:-20000}"
CONC="${BUCKETS_CONCURRENCY:-64}"
log() { printf '[bench-buckets] %s\n' "$*" >&2; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

# The benchmarks measure the release build of the RocketMQ servers (rocketmq-up.sh restarts a
# broker running the debug one), as they measure seckill's release binaries.
export SECKILL_MQ_BUILD=release
scripts/services-up.sh >&2
log "building (release)"
cargo build --release --quiet -p seckill -p seckill-bench
BIN="$root/target/release/seckill"
BENCH="$root/target/release/seckill-bench"
"$BIN" migrate >&2
"$BIN" topics create >&2
CLUSTER=(SECKILL__REDIS__MODE=cluster
  SECKILL__REDIS__URL=redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003)
base=$(( $(date +%s) * 100 ))
declare -A R=()

ONLY="${BUCKETS_ONLY:-}"
# --- 1. Redis ----------------------------------------------------------------------------------
if [[ "$ONLY" != pg ]]; then
log "1. the reservation script, one hot SKU, $REQ buyers, $CONC at a time"
line="$("$BENCH" reserve --activity-id $((base + 1)) --buckets 1 --requests "$REQ" \
  --concurrency "$CONC" | tail -1)"
log "$line"
R[redis_one]="$(field "$line" calls_per_sec)"
for k in 1 3 6; do
  line="$(env "${CLUSTER[@]}" "$BENCH" reserve --activity-id $((base + 10 + k)) --buckets "$k" \
    --requests "$REQ" --concurrency "$CONC" | tail -1)"
  log "$line"
  R[cluster_k$k]="$(field "$line" calls_per_sec)"
  R[share_k$k]="$(field "$line" max_primary_share)"
done
fi

# --- 2. PostgreSQL -----------------------------------------------------------------------------
# Lock waits while a backlog drains: one psql session samples the client backends waiting on a
# lock (a hot row's, a transaction id's) every 20 ms, in a bounded loop (at most 10 minutes).
sample_locks() {
  for _ in $(seq 1 30000); do
    echo "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), count(*) FILTER (WHERE state = 'active'),
                 coalesce(string_agg(wait_event, ',') FILTER (WHERE wait_event_type = 'Lock'), '-'),
                 count(*) FILTER (WHERE wait_event_type = 'Lock' AND wait_event IN ('tuple', 'transactionid'))
          FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid();
          SELECT pg_sleep(0.02);"
  done | psql -X -At -h 127.0.0.1 -U postgres -d postgres 2>/dev/null | grep --line-buffered '|' >"$1" || true
}
# A counter's value from the consumer's /metrics (0 when absent).
metric() {
  curl -fsS http://127.0.0.1:29101/metrics 2>/dev/null |
    awk -v m="$1" '$1 == m { v = $2 } END { print (v == "" ? 0 : v) }'
}
# Every process of PostgreSQL (the postmaster's children inherit its CPU set) and the broker
# pinned with `taskset`, or back on every core.
pin() {
  local cpus="$1" pid
  for pid in $(pgrep -x postgres) $(pgrep -f rocketmq-broker-rust); do
    taskset -a -p -c "$cpus" "$pid" >/dev/null 2>&1 || true
  done
}
if [[ "$ONLY" != redis ]]; then
KS="${BUCKETS_KS:-1 2 4 8}"
# Lanes on (one transaction per bucket, the default) and off (every transaction gathers all
# buckets' orders, as before lanes existed): the same work, the baseline.
MODES="${BUCKETS_MODES:-lanes mixed}"
# BUCKETS_PIN=1: PostgreSQL on core 0 alone, the consumer and the broker on core 1.
PIN="${BUCKETS_PIN:-0}"
log "2. the order consumer on a backlog of $BACKLOG orders, one hot SKU in K stock rows (K: $KS; $MODES; pinned: $PIN)"
CONSUME_PID=""
stop_consume() {
  [[ -n "$CONSUME_PID" ]] || return 0
  kill -TERM "$CONSUME_PID" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$CONSUME_PID" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$CONSUME_PID" 2>/dev/null || true
  wait "$CONSUME_PID" 2>/dev/null || true
  CONSUME_PID=""
}
cleanup_pg() { stop_consume; [[ "$PIN" == 1 ]] && pin 0-$(( $(nproc) - 1 )); return 0; }
trap cleanup_pg EXIT
consume_cmd=("$BIN" consume)
if [[ "$PIN" == 1 ]]; then
  pin 0
  pgrep -f rocketmq-broker-rust | while read -r p; do taskset -a -p -c 1 "$p" >/dev/null; done
  consume_cmd=(taskset -c 1 "$BIN" consume)
fi
n=0
for mode in $MODES; do
  lanes=true
  [[ "$mode" == mixed ]] && lanes=false
  for k in $KS; do
    n=$((n + 1))
    a=$((base + 20 + n))
    # Twice the backlog in stock: every buyer finds a unit in their home bucket (no scanner
    # moves leftovers here), so the backlog is the same for every K.
    "$BIN" activity create --activity-id "$a" --name "buckets $k" --sku "1:$((BACKLOG * 2)):9900" \
      --stock-buckets "$k" --duration-secs 3600 >&2
    "$BENCH" backlog --activity-id "$a" --messages "$BACKLOG" --fill-only >&2
    SECKILL__CONSUMER__BUCKET_LANES=$lanes "${consume_cmd[@]}" >"$RUN_DIR/consume-$mode-k$k.log" 2>&1 &
    CONSUME_PID=$!
    for _ in $(seq 1 150); do curl -fsS http://127.0.0.1:29101/readyz >/dev/null 2>&1 && break; sleep 0.2; done
    samples="$RUN_DIR/locks-$mode-k$k.txt"
    sample_locks "$samples" &
    sampler=$!
    line="$("$BENCH" backlog --activity-id "$a" --messages "$BACKLOG" --drain-only \
      --summary-prefix "BACKLOG_${mode^^}_K$k" | tail -1)"
    pkill -P "$sampler" 2>/dev/null || true
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    txs="$(metric order_tx_batch_size_count)"
    stop_consume
    # Lock-wait time per transaction: backends waiting, summed over the samples, times the
    # sampling period, over the transactions the consumer ran.
    # The row locks' share (a stock row's "tuple" and "transactionid" waits) apart from the
    # rest (a table's extension, the NOTIFY queue's commit lock, ...).
    waits="$(awk -F'|' -v txs="$txs" '{ n++; if ($1 > 0) w++; s += $1; r += $4 } END {
      if (n && txs > 0) printf "%.3f %.2f %d %.2f %.2f", w / n, s / n, n, s * 20 / txs, r * 20 / txs;
      else print "nan nan 0 nan nan" }' "$samples")"
    read -r share mean count per_tx row_per_tx <<<"$waits"
    # Which locks they waited on: a stock row ("tuple", "transactionid"), a relation, ...
    kinds="$(cut -d'|' -f3 "$samples" | tr ',' '\n' | grep -v '^-$' | sort | uniq -c |
      awk '{ printf "%s%s=%s", sep, $2, $1; sep = " " }')"
    log "$line; transactions $txs; lock waits: $per_tx ms per transaction ($row_per_tx on stock rows), share of samples $share, mean waiting $mean (of $count samples); samples by lock: ${kinds:-none}"
    R[pg_${mode}_k$k]="$(field "$line" orders_per_s)"
    R[lockwait_ms_per_tx_${mode}_k$k]="$per_tx"
    R[rowlock_ms_per_tx_${mode}_k$k]="$row_per_tx"
    R[order_tx_${mode}_k$k]="$txs"
    [[ "$(field "$line" violations)" == 0 ]] || { log "violations in $mode K=$k"; exit 1; }
  done
done
cleanup_pg
fi

out="BUCKETS"
for key in redis_one cluster_k1 cluster_k3 cluster_k6 share_k1 share_k3 share_k6; do
  out+=" $key=${R[$key]:-}"
done
for key in $(printf '%s\n' "${!R[@]}" | grep -E '^(pg|lockwait|rowlock|order_tx)_' | sort -V); do
  out+=" $key=${R[$key]}"
done
echo "$out"
