#!/usr/bin/env bash
# A whole sale under faults, phase by phase. CHAOS_REQUESTS requests (default 8,000) from
# CHAOS_BUYERS buyers (7,000) for CHAOS_STOCK units (4,000) at CHAOS_RATE a second (250, so the
# intake lasts long enough for its four faults); then
# half of the orders are paid through signed notifications and the rest are cancelled when their
# CHAOS_PAY_WINDOW_SECS (90) pass. Faults are injected by schedule, per phase of the sale, read
# from the stores every half second:
#   intake   requests still arriving and units left in Redis:
#                                         consume killed (down 3 s: an order backlog builds),
#                                         broker killed, api killed, Redis restarted
#   backlog  fewer orders than units taken: PostgreSQL restarted, consume killed, scan killed
#   payment  orders being paid:            api killed, scan killed
#   cancel   unpaid orders being cancelled: timeout-cancel killed, Redis restarted, consume killed
# Kills are SIGKILL followed by a restart. Redis is the project's own for this run (port
# CHAOS_REDIS_PORT, 6390, `appendonly yes`, `appendfsync everysec`, data under
# ~/.cache/seckill/chaos-redis), restarted with SHUTDOWN (which writes the append-only file)
# while the roles keep running: what docs/ARCHITECTURE.md#assumptions assumes of Redis, tested
# rather than stated.
# Then it waits for the pipeline to converge, checks the invariants and the load generator's
# history of every request (seckill-bench load --tolerate-faults) and runs `seckill reconcile
# --fail-on-drift`. Prints the faults by phase and the verdicts; the last line is
#   CHAOS_RUN OK|FAILED faults=N intake=a backlog=b payment=c cancel=d lost=… doubled=… leaked=… …
# and the run fails when a phase got no fault, or on any violation or drift.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/roles-lib.sh
export SECKILL_ENV=chaos
REQUESTS="${CHAOS_REQUESTS:-8000}"
BUYERS="${CHAOS_BUYERS:-7000}"
STOCK="${CHAOS_STOCK:-4000}"
RATE="${CHAOS_RATE:-250}"
CONC="${CHAOS_CONCURRENCY:-64}"
PAY_SHARE="${CHAOS_PAY_SHARE:-0.5}"
PAY_WINDOW="${CHAOS_PAY_WINDOW_SECS:-90}"
REDIS_PORT="${CHAOS_REDIS_PORT:-6390}"
GAP_MS="${CHAOS_FAULT_GAP_MS:-1500}"   # least time between two faults
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
LOG_DIR="$RUN_DIR/chaos"
REDIS_DIR="$HOME/.cache/seckill/chaos-redis"
mkdir -p "$LOG_DIR"
started_ns="$(date +%s%N)"
elapsed() { awk -v s="$started_ns" -v n="$(date +%s%N)" 'BEGIN { printf "%.1f", (n - s) / 1e9 }'; }
log() { printf '[chaos %6ss] %s\n' "$(elapsed)" "$*" >&2; }

# --- the run's own Redis, with the append-only file ---------------------------------------
export SECKILL__REDIS__URL="redis://127.0.0.1:$REDIS_PORT"
export SECKILL__CONSUMER__PAY_WINDOW_SECS="$PAY_WINDOW"
REDIS=(redis-cli -h 127.0.0.1 -p "$REDIS_PORT")
redis_start() {
  mkdir -p "$REDIS_DIR"
  redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$REDIS_DIR" \
    --appendonly yes --appendfsync everysec --save "" \
    --pidfile "$REDIS_DIR/redis.pid" --logfile "$REDIS_DIR/redis.log" >/dev/null
  for _ in $(seq 1 100); do "${REDIS[@]}" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "the chaos Redis did not start (log $REDIS_DIR/redis.log)"; return 1
}
redis_stop() { "${REDIS[@]}" shutdown >/dev/null 2>&1 || true; }

scripts/services-up.sh >&2
redis_stop
rm -rf "$REDIS_DIR"
redis_start
if [[ -z "${SECKILL_BIN:-}" ]]; then
  log "building (release)"
  cargo build --release --quiet -p seckill -p seckill-bench
fi
BIN="${SECKILL_BIN:-$root/target/release/seckill}"
BENCH="${SECKILL_BENCH_BIN:-$(dirname "$BIN")/seckill-bench}"
# The buyers' tokens as a shop issues them: RS256 from a JWKS (TOKEN_ALG to change).
source scripts/tokens-lib.sh
production_tokens "$LOG_DIR/tokens"
# A fresh schema for the fresh Redis: the run's books start empty on both sides.
psql -X -q -h 127.0.0.1 -U postgres -d postgres -c "DROP SCHEMA IF EXISTS seckill_chaos CASCADE" >&2
"$BIN" migrate >&2
"$BIN" topics create >&2
ACTIVITY=$(( $(date +%s) * 10 + 7 ))
"$BIN" activity create --activity-id "$ACTIVITY" --name chaos --sku "1:$STOCK:9900" --duration-secs 3600 >&2
SKU_KEY="seckill-chaos:{a$ACTIVITY}:sku:1"

# Each role's ops port (/readyz, /metrics); the API's buyers listen on 38080.
declare -A PORT=([api]=39100 [consume]=39101 [scan]=39102 [timeout-cancel]=39103)
declare -a FAULTS=()
declare -A PHASE_FAULTS=([intake]=0 [backlog]=0 [payment]=0 [cancel]=0)
cleanup() { stop_roles_by_name; redis_stop; }
trap cleanup EXIT
ROLES=(api consume scan timeout-cancel)
for r in "${ROLES[@]}"; do start_role "$r"; done
for r in "${ROLES[@]}"; do wait_role_ready "$r"; done

# --- faults --------------------------------------------------------------------------------
kill_role() { # role [seconds down]
  kill -KILL "${PID[$1]}" 2>/dev/null || true
  wait "${PID[$1]}" 2>/dev/null || true
  sleep "${2:-0.5}"
  start_role "$1"
}
fault() { # phase target what...
  local phase="$1" target="$2"; shift 2
  case "$target" in
    consume-down) kill_role consume 3 ;;
    api|consume|scan|timeout-cancel) kill_role "$target" ;;
    broker)
      kill -KILL "$(cat "$RUN_DIR/broker.pid")" 2>/dev/null || true
      sleep 1
      # In the background: the restart takes ~20 s, and the phase's other faults land meanwhile.
      scripts/rocketmq-up.sh >>"$LOG_DIR/rocketmq-up.log" 2>&1 &
      broker_restart=$! ;;
    postgresql)
      pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main \
        restart -m immediate >>"$LOG_DIR/pg.log" 2>&1 ;;
    redis) redis_stop; sleep 0.5; redis_start ;;
  esac
  log "$phase: $target — $*"
  FAULTS+=("$phase|$target|$*|$(elapsed)s")
  PHASE_FAULTS[$phase]=$(( PHASE_FAULTS[$phase] + 1 ))
}
declare -A PLAN=(
  [intake]="consume-down broker api redis"
  [backlog]="postgresql consume scan"
  [payment]="api scan"
  [cancel]="timeout-cancel redis consume"
)
broker_restart=""
describe() {
  case "$1" in
    consume-down) echo "SIGKILL, down 3 s, restart" ;;
    broker) echo "SIGKILL + restart" ;;
    postgresql) echo "restart -m immediate" ;;
    redis) echo "SHUTDOWN (AOF written) + restart" ;;
    *) echo "SIGKILL + restart" ;;
  esac
}

# The sale's phase, read from Redis and PostgreSQL (empty when none of the four).
phase() {
  local remaining counts orders paid canceled
  remaining="$("${REDIS[@]}" hget "$SKU_KEY" remaining 2>/dev/null || true)"
  counts="$(psql -X -q -h 127.0.0.1 -U postgres -d postgres -Atc \
    "SELECT count(*), count(*) FILTER (WHERE status = 'PAID'), count(*) FILTER (WHERE status = 'CANCELED')
       FROM seckill_chaos.orders WHERE activity_id = $ACTIVITY" 2>/dev/null || true)"
  [[ -n "$remaining" && -n "$counts" ]] || return 0
  IFS='|' read -r orders paid canceled <<<"$counts"
  if (( remaining > 0 && $(date +%s) < load_ends )); then echo intake
  elif (( orders < STOCK - remaining && paid == 0 )); then echo backlog
  elif (( canceled > 0 )); then echo cancel
  elif (( paid > 0 )); then echo payment
  fi
}

log "sale: $REQUESTS requests from $BUYERS buyers for $STOCK units, $RATE a second; then $PAY_SHARE of the orders paid, the rest cancelled after $PAY_WINDOW s"
"$BENCH" load --api http://127.0.0.1:38080 --activity-id "$ACTIVITY" --sku-id 1 \
  --requests "$REQUESTS" --buyers "$BUYERS" --concurrency "$CONC" --rate "$RATE" --scenario chaos \
  --pay-share "$PAY_SHARE" --settle-timeout-secs $(( PAY_WINDOW * 4 + 120 )) \
  --tolerate-faults --drain-timeout-secs 300 --summary-prefix CHAOS >"$LOG_DIR/bench.out" 2>&1 &
bench=$!
# The open loop sends on a fixed schedule: requests arrive until then.
load_ends=$(( $(date +%s) + (REQUESTS + RATE - 1) / RATE ))

last_fault_ns=0
while kill -0 "$bench" 2>/dev/null; do
  sleep 0.5
  # A role that died on its own (it started while PostgreSQL restarted, say) comes back.
  for r in "${ROLES[@]}"; do
    if ! kill -0 "${PID[$r]}" 2>/dev/null; then
      wait "${PID[$r]}" 2>/dev/null || true
      log "$r found dead; restarting"
      start_role "$r"
    fi
  done
  p="$(phase)"
  [[ -n "$p" ]] || continue
  read -r -a todo <<<"${PLAN[$p]}"
  (( ${#todo[@]} > 0 )) || continue
  (( $(date +%s%N) - last_fault_ns >= GAP_MS * 1000000 )) || continue
  fault "$p" "${todo[0]}" "$(describe "${todo[0]}")"
  PLAN[$p]="${todo[*]:1}"
  last_fault_ns="$(date +%s%N)"
done
set +e
wait "$bench"
bench_status=$?
[[ -z "$broker_restart" ]] || wait "$broker_restart"
set -e
# Every role up again for the final checks; then reconcile (grace: anything older than 5 s).
for r in "${ROLES[@]}"; do kill -0 "${PID[$r]}" 2>/dev/null || start_role "$r"; done
set +e
"$BIN" reconcile --window-hours 1 --grace-secs 5 --fail-on-drift >"$LOG_DIR/reconcile.out" 2>&1
reconcile_status=$?
set -e
cleanup
trap - EXIT
rm -rf "$REDIS_DIR"

line="$(grep -E '^CHAOS (OK|FAILED)' "$LOG_DIR/bench.out" | tail -1 || true)"
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$line"; }
{
  echo
  echo "== faults injected, by phase =="
  printf '%-8s %-16s %-34s %s\n' phase target fault at
  for f in "${FAULTS[@]}"; do
    IFS='|' read -r ph t what at <<<"$f"
    printf '%-8s %-16s %-34s %s\n' "$ph" "$t" "$what" "$at"
  done
  echo "total: ${#FAULTS[@]}; not injected (their phase ended first): ${PLAN[*]}"
  echo "== verdicts =="
  sed -n '/^requests/,/^invariants/p' "$LOG_DIR/bench.out"
  echo "reconcile exit $reconcile_status (0 = no drift)"
  tail -5 "$LOG_DIR/reconcile.out"
} | tee "$LOG_DIR/summary.txt"
status=OK
for ph in intake backlog payment cancel; do (( PHASE_FAULTS[$ph] > 0 )) || status=FAILED; done
[[ $bench_status == 0 && $reconcile_status == 0 && -n "$line" ]] || status=FAILED
echo "CHAOS_RUN $status faults=${#FAULTS[@]} intake=${PHASE_FAULTS[intake]} backlog=${PHASE_FAULTS[backlog]} payment=${PHASE_FAULTS[payment]} cancel=${PHASE_FAULTS[cancel]} lost=$(field lost) doubled=$(field doubled) leaked=$(field leaked) unknown=$(field unknown) paid=$(field paid) canceled=$(field canceled) violations=$(field violations) reconcile_exit=$reconcile_status"
[[ $status == OK ]]
