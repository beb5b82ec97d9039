#!/usr/bin/env bash
# make bench-buckets: how one hot SKU scales with stock buckets (docs/ARCHITECTURE.md#stock-buckets),
# measured in one run on this machine.
#
#   1. Redis: the reservation script's rate for one hot SKU (seckill-bench reserve: the
#      API's script and keys, nothing sent) on the one Redis, then on the Redis Cluster
#      (three primaries) with K = 1, 3 and 6 buckets, and each primary's share of the calls.
#   2. PostgreSQL: the order consumer draining a backlog of one hot SKU whose final stock is
#      K = 1, 4 and 8 rows (seckill-bench backlog, as make bench runs it), orders/s, with the
#      backends waiting on a lock sampled every 100 ms during the drain.
#
# Last line: BUCKETS redis_one=… cluster_k1=… cluster_k3=… cluster_k6=… (calls/s)
#   share_k1=… share_k3=… share_k6=… (the busiest primary's share) pg_k1=… pg_k4=… pg_k8=…
#   (orders/s) lockwait_k1=… … (share of samples with a backend waiting on a lock)
# Knobs: BUCKETS_REQUESTS (100000), BUCKETS_BACKLOG (20000), BUCKETS_CONCURRENCY (64),
# BUCKETS_ONLY=redis|pg (one half).
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
if [[ "$ONLY" != redis ]]; then
log "2. the order consumer on a backlog of $BACKLOG orders, one hot SKU in K stock rows"
CONSUME_PID=""
stop_consume() {
  [[ -n "$CONSUME_PID" ]] || return 0
  kill -TERM "$CONSUME_PID" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$CONSUME_PID" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$CONSUME_PID" 2>/dev/null || true
  wait "$CONSUME_PID" 2>/dev/null || true
  CONSUME_PID=""
}
trap stop_consume EXIT
for k in 1 4 8; do
  a=$((base + 20 + k))
  # Twice the backlog in stock: every buyer finds a unit in their home bucket (no scanner
  # moves leftovers here), so the backlog is the same for every K.
  "$BIN" activity create --activity-id "$a" --name "buckets $k" --sku "1:$((BACKLOG * 2)):9900" \
    --stock-buckets "$k" --duration-secs 3600 >&2
  "$BENCH" backlog --activity-id "$a" --messages "$BACKLOG" --fill-only >&2
  "$BIN" consume >"$RUN_DIR/consume-k$k.log" 2>&1 &
  CONSUME_PID=$!
  for _ in $(seq 1 150); do curl -fsS http://127.0.0.1:29101/readyz >/dev/null 2>&1 && break; sleep 0.2; done
  # Lock waits while the backlog drains: one sample every 100 ms of the backends waiting on a
  # lock (a hot row's, a transaction id's) and of those active.
  samples="$RUN_DIR/locks-k$k.txt"
  : >"$samples"
  (
    while true; do
      psql -X -At -h 127.0.0.1 -U postgres -d postgres -c \
        "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'), count(*) FILTER (WHERE state = 'active')
         FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()" \
        >>"$samples" 2>/dev/null || true
      sleep 0.1
    done
  ) &
  sampler=$!
  line="$("$BENCH" backlog --activity-id "$a" --messages "$BACKLOG" --drain-only \
    --summary-prefix "BACKLOG_K$k" | tail -1)"
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  stop_consume
  waits="$(awk -F'|' '$2 > 0 { n++; if ($1 > 0) w++; s += $1 } END {
    if (n) printf "%.3f %.2f %d", w / n, s / n, n; else print "nan nan 0" }' "$samples")"
  log "$line; lock waits: share of samples $(cut -d' ' -f1 <<<"$waits"), mean waiting $(cut -d' ' -f2 <<<"$waits") (of $(cut -d' ' -f3 <<<"$waits") samples with an active backend)"
  R[pg_k$k]="$(field "$line" orders_per_s)"
  R[lockwait_k$k]="$(cut -d' ' -f1 <<<"$waits")"
  [[ "$(field "$line" violations)" == 0 ]] || { log "violations in K=$k"; exit 1; }
done
fi

out="BUCKETS"
for key in redis_one cluster_k1 cluster_k3 cluster_k6 share_k1 share_k3 share_k6 pg_k1 pg_k4 pg_k8 \
  lockwait_k1 lockwait_k4 lockwait_k8; do
  out+=" $key=${R[$key]:-}"
done
echo "$out"
