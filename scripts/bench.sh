#!/usr/bin/env bash
# make bench: the machine's naive limits (bench/limits/limits.sh) and the pipeline's own figures,
# measured in one run on this machine, then each figure as a ratio to its limit.
#
#   1. limits: pgbench with the order transaction (one per transaction and batched),
#      redis-benchmark with the reservation script, direct-to-PostgreSQL purchases;
#      the broker's raw send rate (seckill-bench broker), one per call and batched.
#   2. order consumer on a backlog (seckill-bench backlog), one hot SKU: batched transactions,
#      one order per transaction, and --workers far past the budget.
#   3. the outbox relay draining the events those backlogs left (events/s).
#   4. the API (seckill-bench load): accepted reservations/s with batched sends and with one send
#      per reservation, and with the trust layer (tokens, rate limits) on and off;
#      answers/s for a sold-out SKU; a 10,000-unit sale from 100,000 requests
#      by 60,000 buyers; many SKUs; duplicate-heavy traffic; open-loop arrivals.
#   5. the baseline a team would otherwise build (seckill-bench baseline-api: the same route,
#      one autocommit statement straight to PostgreSQL): sold-out answers, purchases, and the
#      same sale.
#
# The last line is machine-readable:
#   RATIOS order_vs_pgbench_single=… order_batch1_vs_pgbench_single=… order_vs_pgbench_batch=…
#          accept_batched_vs_unbatched=… soldout_vs_direct_pg=… (sold-out answers/s)
#          soldout_memory_vs_redis=… (the same, with the API's sold-out memory on and off)
#          sale_p99_vs_direct_pg=… sale_vs_front_door=… (the sale against the front door alone)
#          sale_vs_direct_pg=… sale_p99_ms=… direct_pg_sale_p99_ms=… within_3s_pct=…
#          trust_on_vs_off=… violations=…
# Knobs: BENCH_QUICK=1 (smaller runs, for a smoke test), BENCH_CONCURRENCY (default 64),
# LIMITS_SECONDS (default 10), BENCH_ONLY=sale (only the sale's three runs: make bench-sale),
# BENCH_WAITING_NICE (default 10, as shipped: the nice level of consume, scan and timeout-cancel).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/ready-lib.sh
export SECKILL_ENV=bench
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}/bench"
mkdir -p "$RUN_DIR"
CONC="${BENCH_CONCURRENCY:-64}"
if [[ "${BENCH_QUICK:-0}" == 1 ]]; then
  SALE_REQ=10000 SALE_BUYERS=6000 SALE_STOCK=1000 BACKLOG=5000 BACKLOG_SINGLE=1000 API_REQ=5000
  export LIMITS_SECONDS="${LIMITS_SECONDS:-3}"
else
  SALE_REQ=100000 SALE_BUYERS=60000 SALE_STOCK=10000 BACKLOG=30000 BACKLOG_SINGLE=5000 API_REQ=30000
  export LIMITS_SECONDS="${LIMITS_SECONDS:-10}"
fi

log() { printf '[bench] %s\n' "$*" >&2; }
field() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

scripts/services-up.sh >&2
# A run leaves its reservations in Redis (hundreds of thousands of keys): the next run starts
# without them, and the last one clears its own at the end. Millions of stale keys make every
# SCAN-based clean-up on this Redis slow, the tests' included.
redis_clean() {
  redis-cli -h 127.0.0.1 -p 6379 --scan --pattern 'seckill-bench:*' |
    xargs -r -n 5000 redis-cli -h 127.0.0.1 -p 6379 unlink >/dev/null
}
redis_clean
log "building (release)"
cargo build --release --quiet -p seckill -p seckill-bench
BIN="$root/target/release/seckill"
BENCH="$root/target/release/seckill-bench"
"$BIN" migrate >&2
"$BIN" topics create >&2

# --- roles -----------------------------------------------------------------------------------
declare -A PID=()
start_with() { # binary, name, args...
  local bin="$1" name="$2" pre=(); shift 2
  # The roles whose work can wait (orders, relay, cancels) run at nice BENCH_WAITING_NICE (10),
  # as deploy/systemd's units weigh them against the API (docs/ARCHITECTURE.md#scheduling-weights).
  case "$name" in
    consume | scan | timeout-cancel) pre=(nice -n "${BENCH_WAITING_NICE:-10}") ;;
  esac
  "${pre[@]}" "$bin" "$@" >"$RUN_DIR/$name.log" 2>&1 &
  PID[$name]=$!
}
start() { start_with "$BIN" "$@"; } # name, args...
stop() { # name
  local pid="${PID[$1]:-}"
  [[ -n "$pid" ]] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  unset "PID[$1]"
}
stop_all() { for n in "${!PID[@]}"; do stop "$n"; done; }
trap stop_all EXIT
wait_ready() { # url
  until_ready "$1" && return 0
  log "$1 not ready; logs in $RUN_DIR"; return 1
}
cpu_args() { # the --cpu flags for the processes running now
  local a=()
  for n in "${!PID[@]}"; do a+=(--cpu "$n=${PID[$n]}"); done
  local b; b="$(pgrep -d+ -f rocketmq-broker-rust || true)"; [[ -n "$b" ]] && a+=(--cpu "broker=$b")
  # PostgreSQL by its postmaster: the bench counts its children too, so backends that pools
  # open during the run are included.
  local p; p="$(pgrep -o -x postgres || true)"; [[ -n "$p" ]] && a+=(--cpu "postgres=$p")
  local r; r="$(pgrep -d+ -x redis-server || true)"; [[ -n "$r" ]] && a+=(--cpu "redis=$r")
  printf '%s\n' "${a[@]}"
}
# Every scenario gets a fresh activity; its id comes from a counter file, since the helper
# runs in command substitutions (subshells) that cannot update a shell variable.
echo $(( $(date +%s) * 100 )) >"$RUN_DIR/next-activity"
activity() { # stock [skus] -> prints the new activity id
  local stock="$1" skus="${2:-1}" spec=() i a
  a=$(( $(cat "$RUN_DIR/next-activity") + 1 ))
  echo "$a" >"$RUN_DIR/next-activity"
  for i in $(seq 1 "$skus"); do spec+=(--sku "$i:$stock:9900"); done
  "$BIN" activity create --activity-id "$a" --name "bench" "${spec[@]}" \
    --duration-secs 3600 >&2
  echo "$a"
}
consume() { # args... (restarts the consumer)
  stop consume
  start consume consume "$@"
  wait_ready http://127.0.0.1:29101/readyz
  sleep 2 # queue assignment
}
backlog() { # label stock messages [consume args...] -> BACKLOG line
  # The backlog is filled while no consumer runs, then a fresh consumer drains it: the figure
  # is the consumer's alone (first to last order), not shared with the load generator.
  local label="$1" stock="$2" n="$3"; shift 3
  local a; a="$(activity "$stock")"
  stop consume
  "$BENCH" backlog --activity-id "$a" --messages "$n" --fill-only >&2
  # At nice 0, as pgbench runs: the consumer's own rate against the database's, like for like
  # (the shipped nice 10 is about sharing the host with the API, which is not running here).
  BENCH_WAITING_NICE=0 start consume consume "$@"
  local line
  line="$("$BENCH" backlog --activity-id "$a" --messages "$n" --drain-only \
    --summary-prefix "BACKLOG_$label" | tail -1)"
  stop consume
  log "$line"
  echo "$line"
}
quiesce() { # waits (up to 3 minutes) until the relay has published every outbox row due now
  # (timers wait in the outbox until shortly before they are due: scan.timer_lead_secs)
  local n=1 i
  for i in $(seq 1 900); do
    n="$(psql -h 127.0.0.1 -U postgres -Atc \
      "SELECT count(*) FROM seckill_bench.event_outbox WHERE status = 'PENDING' AND next_attempt_at <= now()")"
    [[ "$n" == 0 ]] && { log "quiet: outbox drained (${i}×0.2 s)"; return 0; }
    sleep 0.2
  done
  log "outbox still has $n pending rows; measuring anyway"
}
api_bench() { # label activity sku skus requests buyers [extra bench args...]
  # Each scenario starts quiet: the relay has published what earlier scenarios left behind,
  # so a scenario's figures carry its own background work, not its predecessors'.
  quiesce
  local label="$1" a="$2" sku="$3" skus="$4" req="$5" buyers="$6"; shift 6
  local cpu; mapfile -t cpu < <(cpu_args)
  local line
  line="$("$BENCH" load --api http://127.0.0.1:28080 --activity-id "$a" --sku-id "$sku" --skus "$skus" \
    --requests "$req" --buyers "$buyers" --concurrency "$CONC" --scenario "$label" \
    --summary-prefix BENCH "${cpu[@]}" "$@" | tee "$RUN_DIR/bench-$label.out" | tail -1)"
  log "$line"
  echo "$line"
}

# Where PostgreSQL's time goes during the whole sale, when the server has pg_stat_statements
# loaded (`shared_preload_libraries`; the bench does not change the server's settings): the
# statements of the sale's run, by total time, in $RUN_DIR/sale-pg-statements.txt.
pg_statements() { # reset | save FILE
  local q=(psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1)
  [[ "$("${q[@]}" -Atc "SHOW shared_preload_libraries" 2>/dev/null)" == *pg_stat_statements* ]] || return 0
  "${q[@]}" -qc "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null 2>&1 || return 0
  if [[ "$1" == reset ]]; then
    "${q[@]}" -Atc "SELECT pg_stat_statements_reset()" >/dev/null
  else
    "${q[@]}" -c "SELECT calls, round(total_exec_time::numeric, 1) AS total_ms,
        round((total_exec_time / calls)::numeric, 3) AS mean_ms, rows, wal_bytes,
        left(regexp_replace(query, '\s+', ' ', 'g'), 110) AS query
      FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 25" >"$2" 2>&1 || true
  fi
}
# The sale (section 4) through the whole pipeline, then through the front door alone (the
# consumer stopped, so the API, Redis and the broker have the cores: the ceiling); the consumer
# then turns that backlog into orders. Needs api, consume and scan running. Sets SALE, SALE_FRONT.
sale_pair() {
  log "the sale: $SALE_REQ requests by $SALE_BUYERS buyers for $SALE_STOCK units"
  pg_statements reset
  SALE="$(api_bench hot-sku "$(activity "$SALE_STOCK")" 1 1 "$SALE_REQ" "$SALE_BUYERS")"
  pg_statements save "$RUN_DIR/sale-pg-statements.txt"
  # The order roles' own view of this run (transactions, batch sizes, the SLO histogram),
  # before the consumer is stopped for the next one.
  curl -fsS http://127.0.0.1:29101/metrics >"$RUN_DIR/consume-sale.metrics" 2>/dev/null || true
  log "the same sale, the front door alone (the consumer stopped)"
  stop consume
  local a n; a="$(activity "$SALE_STOCK")"
  SALE_FRONT="$(api_bench hot-sku-front-door "$a" 1 1 "$SALE_REQ" "$SALE_BUYERS" --load-only)"
  consume
  for _ in $(seq 1 900); do
    n="$(psql -h 127.0.0.1 -U postgres -Atc \
      "SELECT count(*) FROM seckill_bench.reservations WHERE activity_id = $a")"
    ((n >= $(field "$SALE_FRONT" accepted))) && break
    sleep 0.2
  done
}
# The same sale answered by the direct-PostgreSQL server (section 5 starts it on port 28090
# with stock for activity $BASE_SALE_A): the comparison a team choosing the design makes (same
# requests, buyers, stock, concurrency and request mix). Sets BASE_SALE.
baseline_sale() {
  log "baseline: the sale, $SALE_REQ requests by $SALE_BUYERS buyers for $SALE_STOCK units"
  BASE_SALE="$("$BENCH" load --api http://127.0.0.1:28090 --activity-id "$BASE_SALE_A" --sku-id 1 \
    --requests "$SALE_REQ" --buyers "$SALE_BUYERS" --concurrency "$CONC" --load-only \
    --stock "$SALE_STOCK" --scenario baseline-sale | tail -1)"
  log "$BASE_SALE"
}
record_lines() { # NAME... : each scenario's line (the variable NAME) into $RUN_DIR/lines/NAME
  rm -rf "$RUN_DIR/lines" && mkdir -p "$RUN_DIR/lines"
  local name
  for name in "$@"; do printf '%s\n' "${!name:-}" >"$RUN_DIR/lines/$name"; done
}

# BENCH_ONLY=sale (make bench-sale): the sale's three runs alone, minutes instead of the whole
# bench; last line SALE_RATIOS ... violations=N.
if [[ "${BENCH_ONLY:-}" == sale ]]; then
  consume
  start scan scan
  wait_ready http://127.0.0.1:29102/readyz
  start api api
  wait_ready http://127.0.0.1:28080/readyz
  sale_pair
  stop_all
  BASE_SALE_A="$(date +%s)"
  start_with "$BENCH" baseline baseline-api --pool 16 --stock "$BASE_SALE_A:1:$SALE_STOCK"
  wait_ready http://127.0.0.1:28090/readyz
  baseline_sale
  stop_all
  trap - EXIT
  redis_clean
  record_lines SALE SALE_FRONT BASE_SALE
  "$BENCH" ratios --dir "$RUN_DIR/lines" --sale-only
  exit
fi

# --- 1. limits -------------------------------------------------------------------------------
log "limits (pgbench, redis-benchmark, direct PostgreSQL), ${LIMITS_SECONDS}s each"
DIRECT_PG_CLIENTS="$CONC" bench/limits/limits.sh | tee "$RUN_DIR/limits.out" >&2
LIMITS="$(grep '^LIMITS ' "$RUN_DIR/limits.out" | tail -1)"
[[ -n "$LIMITS" ]] || { echo "RATIOS FAILED reason=no_limits"; exit 1; }
log "broker raw send rate"
BROKER1="$("$BENCH" broker --batch 1 --senders 16 --seconds 5 | tail -1)"
BROKER32="$("$BENCH" broker --batch 32 --senders 4 --seconds 5 | tail -1)"
log "$BROKER1"
log "$BROKER32"

# --- 2. order consumer on a backlog ----------------------------------------------------------
log "order consumer on a backlog, one hot SKU"
# These orders' timers are written due at once (a lead longer than the pay window), so section 3
# relays both kinds of event, as a relay catching up on a backlog does.
export SECKILL__SCAN__TIMER_LEAD_SECS=86400
B_BATCH="$(backlog batched "$((BACKLOG * 2))" "$BACKLOG")"
B_WIDE="$(backlog workers64 "$((BACKLOG * 2))" "$BACKLOG" --workers 64)"
B_SINGLE="$(SECKILL__CONSUMER__BATCH_SIZE=1 backlog single "$((BACKLOG_SINGLE * 2))" "$BACKLOG_SINGLE")"
unset SECKILL__SCAN__TIMER_LEAD_SECS
consume

# --- 3. the outbox relay on the backlog's events ----------------------------------------------
# The backlogs above left their orders' events (ORDER_CREATED, and the CANCEL_IF_UNPAID timer
# of each order) in the outbox, with no relay running: a fresh relay drains them alone.
pending() {
  psql -h 127.0.0.1 -U postgres -Atc \
    "SELECT count(*) FROM seckill_bench.event_outbox WHERE status = 'PENDING' AND next_attempt_at <= now()"
}
RELAY_ROWS="$(pending)"
log "outbox relay on a backlog of $RELAY_ROWS events"
relay_t0="$(date +%s.%N)"
start scan scan
for _ in $(seq 1 1800); do [[ "$(pending)" == 0 ]] && break; sleep 0.1; done
relay_left="$(pending)"
RELAY="RELAY $([[ "$relay_left" == 0 ]] && echo OK || echo FAILED) rows=$RELAY_ROWS left=$relay_left $(awk -v n="$RELAY_ROWS" -v t0="$relay_t0" -v t1="$(date +%s.%N)" \
  'BEGIN { printf "seconds=%.2f events_per_s=%.0f", t1 - t0, n / (t1 - t0) }')"
log "$RELAY"
wait_ready http://127.0.0.1:29102/readyz

# --- 4. through the API ----------------------------------------------------------------------
# The send path alone: the consumer is stopped, so the load generator, the API, Redis and the
# broker have the two cores to themselves (the reservations wait in the broker until it is
# back). This isolates the lever (batched sends); the pair after it is the whole pipeline.
accept_run() { # label one_send_each(0|1) activity [bench args...] -> BENCH line
  # Accepted reservations/s through a fresh API, every request a new buyer; the API is
  # started for the run (in this subshell) and stopped after it.
  local label="$1" single="$2" a="$3"; shift 3
  if [[ "$single" == 1 ]]; then SECKILL__MQ__SEND_BATCH_MAX=1 start api api; else start api api; fi
  wait_ready http://127.0.0.1:28080/readyz
  log "$label: accepted reservations/s, $([[ "$single" == 1 ]] && echo "one send per reservation" || echo "batched sends")"
  # Each of these activities holds $API_REQ units: every request must be accepted.
  api_bench "$label" "$a" 1 1 "$API_REQ" "$API_REQ" --dup-request-share 0 --repeat-buyer-share 0 \
    --stock "$API_REQ" "$@"
  stop api
}
stop consume
I_A1="$(activity "$API_REQ")" I_A2="$(activity "$API_REQ")"
I_BATCHED="$(accept_run accept-batched-send-path 0 "$I_A1" --load-only)"
I_SINGLE="$(accept_run accept-unbatched-send-path 1 "$I_A2" --load-only)"
# The trust layer's cost on the same send path: buyer tokens verified (EdDSA/HS256 check per
# request) and both rate limits on, set high enough that nothing is refused (the cost, not the
# refusals), beside the same run believing the body's user_id with no limits. The load
# generator mints every token before its clock starts.
# Two pairs, alternating (off, on, off, on): one pair on this machine moves by 10-20 % from
# run to run; the figure is the ratio of the pairs' sums. With the consumer stopped this long
# the order queue's lag passes the fail-closed bound (60 s): these runs get 300 s, both sides.
trust_off() {
  SECKILL__API__FAIL_CLOSED_SHARE=1.0 SECKILL__AUTH__BUYERS=body \
    accept_run "accept-trust-off-$1" 0 "$2" --load-only
}
trust_on() {
  SECKILL__API__FAIL_CLOSED_SHARE=1.0 SECKILL__API__BUYER_RATE_PER_SEC=5 SECKILL__API__BUYER_BURST=10 \
    SECKILL__API__ADDRESS_RATE_PER_SEC=10000000 SECKILL__API__ADDRESS_BURST=10000000 \
    accept_run "accept-trust-on-$1" 0 "$2" --load-only
}
T_A1="$(activity "$API_REQ")" T_A2="$(activity "$API_REQ")"
T_A3="$(activity "$API_REQ")" T_A4="$(activity "$API_REQ")"
T_OFF="$(trust_off 1 "$T_A1")"
T_ON="$(trust_on 1 "$T_A2")"
T_OFF2="$(trust_off 2 "$T_A3")"
T_ON2="$(trust_on 2 "$T_A4")"
consume
# The next scenarios start once the consumer has turned that backlog into orders.
i_accepted=$(( $(field "$I_BATCHED" accepted) + $(field "$I_SINGLE" accepted) + $(field "$T_OFF" accepted) + $(field "$T_ON" accepted) + $(field "$T_OFF2" accepted) + $(field "$T_ON2" accepted) ))
for _ in $(seq 1 900); do
  n="$(psql -h 127.0.0.1 -U postgres -Atc \
    "SELECT count(*) FROM seckill_bench.reservations WHERE activity_id IN ($I_A1, $I_A2, $T_A1, $T_A2, $T_A3, $T_A4)")"
  ((n >= i_accepted)) && break
  sleep 0.2
done
log "send-path backlog: $n of $i_accepted reservations recorded"
A_BATCHED="$(accept_run accept-batched 0 "$(activity "$API_REQ")")"
A_SINGLE="$(accept_run accept-unbatched 1 "$(activity "$API_REQ")")"
# Sold-out answers: every one from Redis (the API's memory of sold-out SKUs off), then with it
# on (the default: after the first SOLD_OUT the instance answers by itself).
SECKILL__API__SOLD_OUT_POLL_MS=0 start api api
wait_ready http://127.0.0.1:28080/readyz
log "sold-out SKU, every answer from Redis"
SOLDOUT_REDIS="$(api_bench sold-out-redis "$(activity 0)" 1 1 "$API_REQ" "$API_REQ")"
stop api
start api api
wait_ready http://127.0.0.1:28080/readyz
log "sold-out SKU"
SOLDOUT_A="$(activity 0)"
SOLDOUT="$(api_bench sold-out "$SOLDOUT_A" 1 1 "$API_REQ" "$API_REQ")"
sale_pair
log "many SKUs"
MANY="$(api_bench many-skus "$(activity $((SALE_STOCK / 10)) 20)" 1 20 "$((API_REQ / 2))" "$((API_REQ / 2))")"
log "duplicate-heavy traffic"
# Every order of this scenario is then paid through a signed payment notification (the
# provider's route), as in production; the settle waits for all of them.
DUPS="$(api_bench duplicates "$(activity "$SALE_STOCK")" 1 1 "$((API_REQ / 2))" "$((API_REQ / 8))" \
  --dup-request-share 0.4 --repeat-buyer-share 0.3 --pay-share 1.0)"
log "open loop"
OPEN="$(api_bench open-loop "$(activity "$SALE_STOCK")" 1 1 "$((API_REQ / 2))" "$((API_REQ / 2))" \
  --rate 2000)"
stop api
stop scan
stop consume

# --- 5. the baseline a team would otherwise build: same route, straight to PostgreSQL --------
BASE_SOLDOUT_A=1 BASE_BUY_A="$(date +%s)" BASE_SALE_A="$(( $(date +%s) + 1 ))"
start_with "$BENCH" baseline baseline-api --pool 16 --stock "$BASE_SOLDOUT_A:1:0" --stock "$BASE_BUY_A:1:2000000000" \
  --stock "$BASE_SALE_A:1:$SALE_STOCK"
wait_ready http://127.0.0.1:28090/readyz
log "baseline (direct PostgreSQL over HTTP): sold-out answers and purchases"
BASE_SOLDOUT="$("$BENCH" load --api http://127.0.0.1:28090 --activity-id "$BASE_SOLDOUT_A" --sku-id 1 \
  --requests "$API_REQ" --buyers "$API_REQ" --concurrency "$CONC" --load-only --stock 0 --scenario baseline-sold-out | tail -1)"
log "$BASE_SOLDOUT"
BASE_BUY="$("$BENCH" load --api http://127.0.0.1:28090 --activity-id "$BASE_BUY_A" --sku-id 1 \
  --requests "$((API_REQ / 3))" --buyers "$((API_REQ / 3))" --concurrency "$CONC" --load-only \
  --stock 2000000000 --dup-request-share 0 --repeat-buyer-share 0 --scenario baseline-buy | tail -1)"
log "$BASE_BUY"
baseline_sale
stop_all
trap - EXIT
redis_clean

# --- ratios ----------------------------------------------------------------------------------
# Each scenario's line in a file of its name; seckill-bench does the arithmetic and the verdicts.
record_lines LIMITS BROKER1 BROKER32 B_BATCH B_WIDE B_SINGLE RELAY I_BATCHED I_SINGLE T_OFF T_ON \
  T_OFF2 T_ON2 A_BATCHED A_SINGLE SOLDOUT_REDIS SOLDOUT SALE SALE_FRONT MANY DUPS OPEN \
  BASE_SOLDOUT BASE_BUY BASE_SALE
"$BENCH" ratios --dir "$RUN_DIR/lines" | tee "$RUN_DIR/summary.txt"
