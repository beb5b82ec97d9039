#!/usr/bin/env bash
# A sale under faults: CHAOS_REQUESTS requests (default 50,000) from CHAOS_BUYERS buyers for
# CHAOS_STOCK units (default 5,000) while a random role (api, consume, scan, timeout-cancel) is
# killed with SIGKILL every CHAOS_KILL_EVERY seconds (default 2) and restarted, the broker is
# killed (SIGKILL) and restarted once, PostgreSQL is restarted once. Then it waits for the
# pipeline to converge, checks the invariants (seckill-bench load --tolerate-faults) and runs
# `seckill reconcile --fail-on-drift`. Prints a table of the faults injected and the verdicts;
# exits non-zero on any violation or drift.
#
# Redis is never restarted: it runs without persistence here, and the guarantees assume a
# Redis that keeps what it acknowledged (README, "What the guarantees assume").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export SECKILL_ENV=chaos
REQUESTS="${CHAOS_REQUESTS:-50000}"
BUYERS="${CHAOS_BUYERS:-40000}"
STOCK="${CHAOS_STOCK:-5000}"
KILL_EVERY="${CHAOS_KILL_EVERY:-2}"
CONC="${CHAOS_CONCURRENCY:-64}"
# Open loop: the sale lasts REQUESTS / RATE seconds (50,000 / 1,500 ≈ 33 s), long enough for a
# fault every few seconds, whatever the roles' state.
RATE="${CHAOS_RATE:-1500}"
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
LOG_DIR="$RUN_DIR/chaos"
mkdir -p "$LOG_DIR"
log() { printf '[chaos %5.1fs] %s\n' "$(awk -v s="$started_ns" 'BEGIN{ "date +%s%N" | getline n; printf "%.1f", (n - s) / 1e9 }')" "$*" >&2; }
started_ns="$(date +%s%N)"

scripts/services-up.sh >&2
if [[ -z "${SECKILL_BIN:-}" ]]; then
  log "building (release)"
  cargo build --release --quiet -p seckill -p seckill-bench
fi
BIN="${SECKILL_BIN:-$root/target/release/seckill}"
BENCH="${SECKILL_BENCH_BIN:-$(dirname "$BIN")/seckill-bench}"
"$BIN" migrate >&2
"$BIN" topics create >&2
ACTIVITY=$(( $(date +%s) * 10 + 7 ))
"$BIN" activity create --activity-id "$ACTIVITY" --name chaos --sku "1:$STOCK:9900" --duration-secs 3600 >&2

declare -A PID=() PORT=([api]=38080 [consume]=39101 [scan]=39102 [timeout-cancel]=39103)
declare -A READY_PATH=([api]=/readyz [consume]=/readyz [scan]=/readyz [timeout-cancel]=/readyz)
declare -a FAULTS=()
start() { # role
  "$BIN" "$1" >>"$LOG_DIR/$1.log" 2>&1 &
  PID[$1]=$!
}
wait_ready() { # role
  for _ in $(seq 1 150); do
    curl -fsS "http://127.0.0.1:${PORT[$1]}${READY_PATH[$1]}" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "$1 not ready after 30 s (log $LOG_DIR/$1.log)"
  return 1
}
stop_all() {
  for r in "${!PID[@]}"; do kill -TERM "${PID[$r]}" 2>/dev/null || true; done
  for r in "${!PID[@]}"; do
    for _ in $(seq 1 100); do kill -0 "${PID[$r]}" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "${PID[$r]}" 2>/dev/null || true
  done
}
trap stop_all EXIT
for r in api consume scan timeout-cancel; do start "$r"; done
for r in api consume scan timeout-cancel; do wait_ready "$r"; done
sleep 2

log "sale: $REQUESTS requests from $BUYERS buyers for $STOCK units, $RATE a second (at most $CONC at a time)"
"$BENCH" load --api http://127.0.0.1:38080 --activity-id "$ACTIVITY" --sku-id 1 \
  --requests "$REQUESTS" --buyers "$BUYERS" --concurrency "$CONC" --rate "$RATE" --scenario chaos \
  --tolerate-faults --drain-timeout-secs 300 --summary-prefix CHAOS >"$LOG_DIR/bench.out" 2>&1 &
bench=$!

roles=(api consume scan timeout-cancel)
n=0 broker_done=0 pg_done=0
while kill -0 "$bench" 2>/dev/null; do
  sleep "$KILL_EVERY"
  kill -0 "$bench" 2>/dev/null || break
  n=$((n + 1))
  # A role that died on its own (e.g. it started while PostgreSQL was restarting) comes back.
  for r in "${roles[@]}"; do
    if ! kill -0 "${PID[$r]}" 2>/dev/null; then
      log "$r found dead; restarting"
      start "$r"
    fi
  done
  if [[ $broker_done == 0 && $n == 3 ]]; then
    bpid="$(cat "$RUN_DIR/broker.pid")"
    kill -KILL "$bpid" 2>/dev/null || true
    log "broker killed (SIGKILL, pid $bpid)"
    sleep 1
    scripts/rocketmq-up.sh >>"$LOG_DIR/rocketmq-up.log" 2>&1
    log "broker restarted"
    FAULTS+=("broker|SIGKILL + restart|$(date +%T)")
    broker_done=1
    continue
  fi
  if [[ $pg_done == 0 && $n == 1 ]]; then
    ver="$(ls /etc/postgresql | sort -V | tail -1)"
    pg_ctlcluster --skip-systemctl-redirect "$ver" main restart -m immediate >>"$LOG_DIR/pg.log" 2>&1
    log "PostgreSQL restarted (immediate: open transactions are lost, not committed)"
    FAULTS+=("postgresql|restart -m immediate|$(date +%T)")
    pg_done=1
    continue
  fi
  r="${roles[RANDOM % ${#roles[@]}]}"
  kill -KILL "${PID[$r]}" 2>/dev/null || true
  wait "${PID[$r]}" 2>/dev/null || true
  log "$r killed (SIGKILL)"
  sleep 1
  start "$r"
  wait_ready "$r" || true
  log "$r restarted"
  FAULTS+=("$r|SIGKILL + restart|$(date +%T)")
done
set +e
wait "$bench"
bench_status=$?
set -e
# Every role up again for the final checks; then reconcile (grace: anything older than 5 s).
for r in api consume scan timeout-cancel; do kill -0 "${PID[$r]}" 2>/dev/null || start "$r"; done
"$BIN" reconcile --window-hours 1 --grace-secs 5 --fail-on-drift >"$LOG_DIR/reconcile.out" 2>&1
reconcile_status=$?
stop_all
trap - EXIT

line="$(grep -E '^CHAOS (OK|FAILED)' "$LOG_DIR/bench.out" | tail -1 || true)"
{
  echo
  echo "== faults injected =="
  printf '%-16s %-26s %s\n' target fault at
  for f in "${FAULTS[@]}"; do IFS='|' read -r t what at <<<"$f"; printf '%-16s %-26s %s\n' "$t" "$what" "$at"; done
  echo "total: ${#FAULTS[@]}"
  echo "== verdicts =="
  sed -n '/^requests/,/^invariants/p' "$LOG_DIR/bench.out"
  echo "reconcile exit $reconcile_status (0 = no drift)"
  tail -5 "$LOG_DIR/reconcile.out"
} | tee "$LOG_DIR/summary.txt"
status=OK
[[ $bench_status == 0 && $reconcile_status == 0 && -n "$line" && $broker_done == 1 && $pg_done == 1 ]] || status=FAILED
echo "CHAOS_RUN $status faults=${#FAULTS[@]} broker_restarts=$broker_done pg_restarts=$pg_done reconcile_exit=$reconcile_status bench=[${line:-none}]"
[[ $status == OK ]]
