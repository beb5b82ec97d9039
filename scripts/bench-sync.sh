#!/usr/bin/env bash
# The price of a synchronous standby (docs/architecture/postgresql.md#failover): orders/s of
# the order transaction's statements (pgbench's batch, bench/limits/order_batch.sql, as
# `make bench-orders` runs it) on the pg_auto_failover pair of scripts/pg-ha.sh, its standby
# in the commit quorum (every commit waits for the standby's flush) and out of it (commits
# are local; the standby still streams), alternating ROUNDS times in one run.
#
# Env: SYNC_ROUNDS (default 2) rounds of both modes; LIMITS_SECONDS (default 10) per mode.
# Last line on stdout:
#   SYNC_RATIOS OK sync_orders_per_s=<f> async_orders_per_s=<f> sync_vs_async=<f> rounds=<n>
# (the medians over the rounds), or SYNC_RATIOS FAILED reason=...
# The pair is left up as it was found running, stopped otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS="${SYNC_ROUNDS:-2}"
export LIMITS_SECONDS="${LIMITS_SECONDS:-10}"
log() { echo "[bench-sync] $*" >&2; }
fail() { echo "SYNC_RATIOS FAILED reason=$1"; exit 1; }

was_up=0
scripts/pg-ha.sh status 2>/dev/null | grep -q '^PG_HA primary=[0-9]' && was_up=1
scripts/pg-ha.sh up >&2 || fail pair_not_up
finish() {
  scripts/pg-ha.sh mode sync >/dev/null 2>&1 || true
  (( was_up )) || scripts/pg-ha.sh down >/dev/null 2>&1 || true
}
trap finish EXIT

primary="$(scripts/pg-ha.sh status | sed -n 's/^PG_HA primary=\([0-9]*\).*/\1/p')"
[[ -n "$primary" ]] || fail no_primary
log "primary on 127.0.0.1:$primary"

# One mode's orders/s: the pair switched to it, then pgbench's batch on the primary.
measure() {
  local line
  scripts/pg-ha.sh mode "$1" >&2 || fail "mode_$1"
  line="$(LIMITS_ONLY=batch LIMITS_PG_PORT="$primary" bench/limits/limits.sh | tail -n 1)"
  log "$1: $line"
  sed -n 's/.*pgbench_batch_orders_per_s=\([0-9.]*\).*/\1/p' <<<"$line"
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

sync_runs=() async_runs=()
for ((r = 1; r <= ROUNDS; r++)); do
  s="$(measure sync)"; [[ -n "$s" ]] || fail sync_run
  a="$(measure async)"; [[ -n "$a" ]] || fail async_run
  sync_runs+=("$s") async_runs+=("$a")
  log "round $r: sync $s, async $a orders/s"
done
s="$(printf '%s\n' "${sync_runs[@]}" | median)"
a="$(printf '%s\n' "${async_runs[@]}" | median)"
ratio="$(awk -v s="$s" -v a="$a" 'BEGIN { if (a > 0) printf "%.2f", s / a; else print "nan" }')"
echo "SYNC_RATIOS OK sync_orders_per_s=$s async_orders_per_s=$a sync_vs_async=$ratio rounds=$ROUNDS" \
  "sync_runs=$(IFS=,; echo "${sync_runs[*]}") async_runs=$(IFS=,; echo "${async_runs[*]}")"
