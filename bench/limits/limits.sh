#!/usr/bin/env bash
# Measures, on this machine, the naive limits the benchmark compares itself with:
#   1. pgbench, the project's order transaction (src/pg/order_tx/), one order per
#      transaction, at 1, 4 and 16 clients: best tps and the client count that reached it;
#   2. pgbench, the same transaction for BATCH orders at once (set-based), at 2 and 4 clients:
#      best orders/s, and the CPU PostgreSQL and pgbench spent per order there (the floor of
#      the order work's CPU);
#   3. redis-benchmark, 50 clients, EVALSHA of the project's own src/redis/lua/reserve.lua, a
#      new buyer per call: calls/s;
#   4. the direct-to-PostgreSQL purchase a team would otherwise build (conditional UPDATE of
#      one stock row + INSERT of the order, one transaction per request) at DIRECT_PG_CLIENTS
#      clients: with stock left (every request buys) and with stock 0 (every request is told
#      "sold out").
# Measurements run one after another. Loopback only: PostgreSQL 127.0.0.1:5432 (user
# postgres, trust, database postgres) and Redis 127.0.0.1:6379. Everything lives in a private
# schema (seckill_limits) and under a private Redis key prefix (seckill_limits:), both
# removed at the start, at the end and on error; nothing else is touched (no FLUSHALL).
#
# Env: LIMITS_SECONDS   duration of each measurement in seconds (default 10; the whole
#                       script then takes about 1.5 minutes)
#      LIMITS_ONLY=batch only measurement 2 (make bench-orders); the other figures print 0
#      DIRECT_PG_CLIENTS clients of measurement 4 (default 64; capped, with a warning, to the
#                       connections PostgreSQL has free)
#      LIMITS_PG_HOST   PostgreSQL's host for pgbench and psql (default 127.0.0.1); a
#                       directory means its Unix socket, e.g. /var/run/postgresql (pair it
#                       with SECKILL__PG__URL="host=/var/run/postgresql ..." for the roles)
#      LIMITS_PG_PORT   its port (default 5432; scripts/bench-sync.sh points it at a pair)
# Usage: bench/limits/limits.sh [--json | --batch-size]
# Progress goes to stderr; the LAST line on stdout is the result, either
#   LIMITS pgbench_single_tps=<f> pgbench_single_clients=<n> pgbench_batch_orders_per_s=<f>
#          pgbench_batch_size=<n> redis_reserve_per_s=<f> direct_pg_buy_per_s=<f>
#          direct_pg_soldout_per_s=<f> direct_pg_clients=<n> pgbench_batch_cpu_us_per_order=<f>
#          pgbench_batch_cpu_us_postgres=<f> pgbench_batch_cpu_us_pgbench=<f>
#          pgbench_batch_wal_bytes_per_order=<n>   (one line; the
#          CPU, from /proc, that PostgreSQL and pgbench spent per order at measurement 2's best)
# or, with --json, the same figures as one JSON object.
set -euo pipefail
export LC_ALL=C
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
here="$root/bench/limits"

# --- settings ----------------------------------------------------------------------------
SECS="${LIMITS_SECONDS:-10}"
batch_only=0
case "${LIMITS_ONLY:-}" in
  "") ;;
  batch) batch_only=1 ;;
  *) echo "[limits] error: LIMITS_ONLY must be empty or 'batch' (got '$LIMITS_ONLY')" >&2; exit 1 ;;
esac
DIRECT_CLIENTS="${DIRECT_PG_CLIENTS:-64}"
SCHEMA=seckill_limits
RPREFIX=seckill_limits                 # Redis key prefix (Keys::new(prefix) in src/redis)
# Orders per transaction in measurement 2 (<= 99): the consumer's own consumer.batch_size.
# seckill-bench's rounds (make bench, make bench-orders) pass it as their settings resolve it;
# run alone, this reads SECKILL__CONSUMER__BATCH_SIZE over config/default.toml (not the
# SECKILL_ENV files). `SECKILL__CONSUMER__BATCH_SIZE=64 make bench-orders` compares both at 64.
BATCH="${SECKILL__CONSUMER__BATCH_SIZE:-$(awk '/^\[/ { sec = $0 } sec == "[consumer]" && $1 == "batch_size" { print $3 }' \
         "$root/config/default.toml")}"
[[ "$BATCH" =~ ^[0-9]+$ ]] && ((BATCH >= 1 && BATCH <= 99)) \
  || { echo "[limits] error: consumer.batch_size (config/default.toml or SECKILL__CONSUMER__BATCH_SIZE) must be 1-99 (got '$BATCH')" >&2; exit 1; }
SINGLE_CLIENTS=(1 4 16)
BATCH_CLIENTS=(2 4)
REDIS_CLIENTS=50
REDIS_RANDOM=100000000                 # redis-benchmark -r: range of __rand_int__
REDIS_CALIBRATION=20000                # requests of the short run that sizes the real one
REDIS_MAX_REQUESTS=3000000             # ~1 KB of Redis memory per reservation
REDIS_STOCK=1000000000000
DIRECT_BUY_STOCK=1000000000000000
PGBENCH_THREADS=2
INBOX_HISTORY=100000                   # processed messages already in the inbox (see below)
TRACEPARENT=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01
export PGAPPNAME=seckill-limits PGCONNECT_TIMEOUT=5

PG_HOST="${LIMITS_PG_HOST:-127.0.0.1}"   # a directory: the Unix socket in it
PG_PORT="${LIMITS_PG_PORT:-5432}"
PG_CONN=(-h "$PG_HOST" -p "$PG_PORT" -U postgres)
PSQL=(psql -X -q -v ON_ERROR_STOP=1 "${PG_CONN[@]}" -d postgres)
REDIS=(redis-cli -h 127.0.0.1 -p 6379)

log() { printf '[limits] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

json=0
for arg in "$@"; do
  case "$arg" in
    --json) json=1 ;;
    # What measurement 2 would batch, then stop (its test compares it with the settings).
    --batch-size) echo "$BATCH"; exit 0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 0 ;;
    *) die "unknown argument: $arg (usage: bench/limits/limits.sh [--json | --batch-size])" ;;
  esac
done
[[ "$SECS" =~ ^[1-9][0-9]*$ ]] || die "LIMITS_SECONDS must be a positive integer (got '$SECS')"
[[ "$DIRECT_CLIENTS" =~ ^[1-9][0-9]*$ ]] || die "DIRECT_PG_CLIENTS must be a positive integer (got '$DIRECT_CLIENTS')"

source "$here/lib.sh"

# --- tools -------------------------------------------------------------------------------
need psql postgresql-client
need pgbench postgresql-contrib
need redis-cli redis-tools
need redis-benchmark redis-tools
pgbench_major="$(pgbench --version | sed -n 's/^pgbench (PostgreSQL) \([0-9]*\).*/\1/p')"
[[ -n "$pgbench_major" && "$pgbench_major" -ge 14 ]] \
  || die "pgbench >= 14 is needed (\\aset, \\startpipeline, permute()); found: $(pgbench --version)"

"${PSQL[@]}" -Atc 'SELECT 1' >/dev/null 2>&1 \
  || die "PostgreSQL does not answer on $PG_HOST:$PG_PORT as postgres (scripts/services-up.sh starts it)"
[[ "$("${REDIS[@]}" ping 2>/dev/null)" == PONG ]] \
  || die "Redis does not answer on 127.0.0.1:6379 (scripts/services-up.sh starts it)"

# --- cleanup -----------------------------------------------------------------------------
tmp=""
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
tmp="$(mktemp -d)"

# --- start -------------------------------------------------------------------------------
started=$SECONDS
log "each measurement runs ${SECS}s; load average now: $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) CPUs"
drop_schema
redis_cleanup
"${PSQL[@]}" -f "$here/schema.sql" >/dev/null

avail="$(free_connections)"
max_single=0
for c in "${SINGLE_CLIENTS[@]}" "${BATCH_CLIENTS[@]}"; do if (( c > max_single )); then max_single=$c; fi; done
(( avail - 4 >= max_single )) || die "PostgreSQL has only $avail free connections, $max_single are needed"

single_best=0 single_best_c=0 redis_rps=0 direct_buy=0 direct_soldout=0 direct_c=0
declare -A single_tps=()
if (( ! batch_only )); then
  # 1. one order per transaction ---------------------------------------------------------------
  log "1. pgbench, the order transaction, 1 order per transaction (${SINGLE_CLIENTS[*]} clients)"
  single_best=0 single_best_c=0
  declare -A single_tps=()
  for c in "${SINGLE_CLIENTS[@]}"; do
    reset_order_tables
    tps="$(run_pgbench "order_single.sql, $c clients" "$here/order_single.sql" "$c" -D n=0)"
    single_tps[$c]="$tps"
    sold="$(psql_value "SELECT count(*) FROM $SCHEMA.orders WHERE order_id IN
                          (SELECT order_id FROM $SCHEMA.stock_ledger)")"
    left="$(psql_value "SELECT total_stock - remaining_stock FROM $SCHEMA.stock_buckets")"
    [[ "$sold" -eq "$left" && "$sold" -gt 0 ]] \
      || die "order_single.sql: $sold orders with a ledger row but $left units taken from stock"
    if gt "$tps" "$single_best"; then single_best="$tps"; single_best_c="$c"; fi
  done

fi

# 2. BATCH orders per transaction ------------------------------------------------------------
log "2. pgbench, the order transaction, $BATCH orders per transaction (${BATCH_CLIENTS[*]} clients)"
batch_best=0 batch_best_c=0 batch_cpu_pg=0 batch_cpu_pgbench=0 batch_wal=0
declare -A batch_orders=()
for c in "${BATCH_CLIENTS[@]}"; do
  reset_order_tables
  tps="$(run_pgbench "order_batch.sql x$BATCH, $c clients" "$here/order_batch.sql" "$c" \
         -D n=0 -D batch="$BATCH")"
  orders="$(awk -v t="$tps" -v b="$BATCH" 'BEGIN { printf "%.6f", t * b }')"
  batch_orders[$c]="$orders"
  log "    = $(fmt1 "$orders") orders/s"
  sold="$(psql_value "SELECT count(*) FROM $SCHEMA.orders")"
  left="$(psql_value "SELECT total_stock - remaining_stock FROM $SCHEMA.stock_buckets")"
  outbox="$(psql_value "SELECT count(*) FROM $SCHEMA.event_outbox_by_day")"
  [[ "$sold" -eq "$left" && "$outbox" -eq $((2 * sold)) && $((sold % BATCH)) -eq 0 ]] \
    || die "order_batch.sql: $sold orders, $left units taken, $outbox outbox rows"
  if gt "$orders" "$batch_best"; then
    batch_best="$orders"; batch_best_c="$c"
    # The floor of the order work's CPU: what PostgreSQL and pgbench spent per order.
    read -r batch_cpu_pg batch_cpu_pgbench batch_wal < <(awk -v b="$BATCH" \
      '{ n = $1 * b; printf "%.1f %.1f %.0f\n", $2 * 1e6 / n, $3 * 1e6 / n, $4 / n }' "$tmp/pgbench.cpu")
  fi
  log "    CPU: $(awk -v b="$BATCH" '{ n = $1 * b; printf "PostgreSQL %.1f us, pgbench %.1f us, WAL %.0f bytes per order", $2 * 1e6 / n, $3 * 1e6 / n, $4 / n }' "$tmp/pgbench.cpu")"
done
reset_order_tables 0 # gives the disk space back before the next measurements

if (( ! batch_only )); then
  # 3. Redis reservation script ----------------------------------------------------------------
  log "3. redis-benchmark, EVALSHA src/redis/lua/reserve.lua, $REDIS_CLIENTS clients, a new buyer per call"
  sha="$("${REDIS[@]}" -x SCRIPT LOAD <"$root/src/redis/lua/reserve.lua")"
  [[ "$sha" =~ ^[0-9a-f]{40}$ ]] || die "SCRIPT LOAD of reserve.lua answered: $sha"
  tag="$RPREFIX:{a1}"      # Keys::tag: "<prefix>:{a<activity_id>}"
  now_ms="$(date +%s%3N)"
  redis_setup() {
    "${REDIS[@]}" HSET "$tag:meta" starts_at_ms 0 ends_at_ms $((now_ms + 86400000)) valid_ms 900000 >/dev/null
    "${REDIS[@]}" HSET "$tag:sku:1" total "$REDIS_STOCK" remaining "$REDIS_STOCK" >/dev/null
  }
  # The first 8 KEYS and 16 ARGV that reserve.lua's opening tables name (Intake::reserve
  # passes them all); the rest (the draw, passes, the seen mark) absent: no fair start, no
  # passes, as in the bench. Rates and bursts 0: the abuse limits off.
  reserve_cmd=(EVALSHA "$sha" 8 "$tag:meta" "$tag:sku:1" "$tag:buyers:1" "$tag:req"
               "$tag:pending" "$tag:pending_since" "$tag:rl:ip:127.0.0.1" "$tag:rl:u:__rand_int__"
               "$now_ms" __rand_int__ req-__rand_int__ rsv-__rand_int__ evt-__rand_int__
               ord-__rand_int__ 1 1 $((now_ms + 5000)) "$tag:rsv:" "$TRACEPARENT" 605700 0 0 0 0)
  redis_bench() { # requests -> prints requests/s
    local out="$tmp/redis.out"
    redis-benchmark -h 127.0.0.1 -p 6379 -c "$REDIS_CLIENTS" -n "$1" -r "$REDIS_RANDOM" --csv \
      "${reserve_cmd[@]}" >"$out" 2>"$tmp/redis.err" \
      || { cat "$out" "$tmp/redis.err" >&2; die "redis-benchmark failed"; }
    local rps
    rps="$(tail -1 "$out" | awk -F'","' '{ print $2 }' | tr -d '"')"
    [[ "$rps" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { cat "$out" "$tmp/redis.err" >&2; die "no result from redis-benchmark"; }
    printf '%s' "$rps"
  }
  redis_setup
  calib="$(redis_bench "$REDIS_CALIBRATION")"
  requests="$(awk -v r="$calib" -v s="$SECS" -v lo="$REDIS_CALIBRATION" -v hi="$REDIS_MAX_REQUESTS" \
              'BEGIN { n = int(r * s); if (n < lo) n = lo; if (n > hi) n = hi; print n }')"
  log "  calibration: $(fmt1 "$calib") calls/s -> $requests requests for ~${SECS}s"
  redis_cleanup
  redis_setup
  redis_rps="$(redis_bench "$requests")"
  reserved=$(( REDIS_STOCK - $("${REDIS[@]}" HGET "$tag:sku:1" remaining) ))
  buyers="$("${REDIS[@]}" HLEN "$tag:buyers:1")"
  mem="$("${REDIS[@]}" INFO memory | sed -n 's/^used_memory_human:\(.*\)\r*$/\1/p' | tr -d '\r')"
  log "  reserve.lua: $(fmt1 "$redis_rps") calls/s ($requests calls: $reserved reservations," \
      "$((requests - reserved)) answered ALREADY_PURCHASED (random buyer drawn twice); Redis memory $mem)"
  [[ "$buyers" -eq "$reserved" ]] || die "Redis: $reserved units taken but $buyers buyers recorded"
  (( reserved * 10 >= requests * 9 )) \
    || die "Redis: only $reserved of $requests calls reserved (script errors?)"
  redis_cleanup

  # 4. direct-to-PostgreSQL purchase -----------------------------------------------------------
  avail="$(free_connections)"
  direct_c="$DIRECT_CLIENTS"
  if (( direct_c > avail - 4 )); then
    direct_c=$(( avail - 4 > 1 ? avail - 4 : 1 ))
    log "warning: PostgreSQL has $avail free connections: direct purchase at $direct_c clients instead of $DIRECT_CLIENTS"
  fi
  log "4. pgbench, direct purchase from PostgreSQL, $direct_c clients"
  reset_direct "$DIRECT_BUY_STOCK"
  direct_buy="$(run_pgbench "direct_buy.sql, stock left, $direct_c clients" "$here/direct_buy.sql" "$direct_c")"
  sold="$(psql_value "SELECT count(*) FROM $SCHEMA.direct_orders")"
  left="$(psql_value "SELECT $DIRECT_BUY_STOCK - remaining FROM $SCHEMA.stock WHERE id = 1")"
  [[ "$sold" -eq "$left" && "$sold" -gt 0 ]] || die "direct_buy.sql: $sold orders but $left units taken"
  reset_direct 0
  direct_soldout="$(run_pgbench "direct_buy.sql, sold out, $direct_c clients" "$here/direct_buy.sql" "$direct_c")"
  sold="$(psql_value "SELECT count(*) FROM $SCHEMA.direct_orders")"
  [[ "$sold" -eq 0 ]] || die "direct_buy.sql with stock 0 created $sold orders"

fi

# --- report ------------------------------------------------------------------------------
{
  printf '\n%-52s %14s\n' "measurement (${SECS}s each)" "rate"
  for c in "${SINGLE_CLIENTS[@]}"; do
    [[ -n "${single_tps[$c]:-}" ]] || continue
    printf '%-52s %14s%s\n' "order tx, 1 order/tx, $c clients (tps)" "$(fmt1 "${single_tps[$c]}")" \
      "$([[ $c == "$single_best_c" ]] && echo '  <- best')"
  done
  for c in "${BATCH_CLIENTS[@]}"; do
    printf '%-52s %14s%s\n' "order tx, $BATCH orders/tx, $c clients (orders/s)" "$(fmt1 "${batch_orders[$c]}")" \
      "$([[ $c == "$batch_best_c" ]] && echo '  <- best')"
  done
  printf '%-52s %14s\n' "reserve.lua, $REDIS_CLIENTS clients (calls/s)" "$(fmt1 "$redis_rps")"
  printf '%-52s %14s\n' "direct PG purchase, stock left, $direct_c clients (tps)" "$(fmt1 "$direct_buy")"
  printf '%-52s %14s\n' "direct PG purchase, sold out, $direct_c clients (tps)" "$(fmt1 "$direct_soldout")"
  printf '\ntook %ss; load average now: %s\n\n' "$((SECONDS - started))" "$(cut -d' ' -f1-3 /proc/loadavg)"
} >&2

batch_cpu="$(awk -v a="$batch_cpu_pg" -v b="$batch_cpu_pgbench" 'BEGIN { printf "%.1f", a + b }')"
if (( json )); then
  printf '{"pgbench_single_tps":%s,"pgbench_single_clients":%d,"pgbench_batch_orders_per_s":%s,"pgbench_batch_size":%d,"redis_reserve_per_s":%s,"direct_pg_buy_per_s":%s,"direct_pg_soldout_per_s":%s,"direct_pg_clients":%d,"pgbench_batch_cpu_us_per_order":%s,"pgbench_batch_cpu_us_postgres":%s,"pgbench_batch_cpu_us_pgbench":%s,"pgbench_batch_wal_bytes_per_order":%s}\n' \
    "$(fmt1 "$single_best")" "$single_best_c" "$(fmt1 "$batch_best")" "$BATCH" "$(fmt1 "$redis_rps")" \
    "$(fmt1 "$direct_buy")" "$(fmt1 "$direct_soldout")" "$direct_c" "$batch_cpu" "$batch_cpu_pg" "$batch_cpu_pgbench" "$batch_wal"
else
  printf 'LIMITS pgbench_single_tps=%s pgbench_single_clients=%d pgbench_batch_orders_per_s=%s pgbench_batch_size=%d redis_reserve_per_s=%s direct_pg_buy_per_s=%s direct_pg_soldout_per_s=%s direct_pg_clients=%d pgbench_batch_cpu_us_per_order=%s pgbench_batch_cpu_us_postgres=%s pgbench_batch_cpu_us_pgbench=%s pgbench_batch_wal_bytes_per_order=%s\n' \
    "$(fmt1 "$single_best")" "$single_best_c" "$(fmt1 "$batch_best")" "$BATCH" "$(fmt1 "$redis_rps")" \
    "$(fmt1 "$direct_buy")" "$(fmt1 "$direct_soldout")" "$direct_c" "$batch_cpu" "$batch_cpu_pg" "$batch_cpu_pgbench" "$batch_wal"
fi
