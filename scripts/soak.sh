#!/usr/bin/env bash
# make soak: a long sale at a steady rate, watched while it runs
# (docs/architecture/roles.md#seckill-bench). SOAK_RATE reservations a second (default 300), each
# from a new buyer, for SOAK_DURATION_SECS (600), against api, consume, scan and timeout-cancel;
# SOAK_PAY_SHARE (0.5) of the orders are paid within their SOAK_PAY_WINDOW_SECS (30) pay window, the
# rest expire and are cancelled all along the run. Every SOAK_SAMPLE_SECS (15) one SAMPLE line:
# memory of every role and the broker, Redis memory, PostgreSQL table sizes, each consumer group's
# lag and oldest age, the orders created and cancelled with their ages, the orders overdue for a
# cancel. The last line:
#   SOAK OK|FAILED duration_s=… created_per_s=… canceled_per_s=… cancel_p50_s=… cancel_p99_s=…
#        rss_slope_mib_per_min=api:…,consume:…,… violations=N
# and the run fails on an invariant violation, an expiry→cancel p99 above 5 s, a role whose
# anonymous memory still grows over the last third, or a drain or settle that never completes.
# Its own schema (seckill_soak), key prefix and topics; the schema and keys are removed after.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/roles-lib.sh
export SECKILL_ENV=soak
DURATION="${SOAK_DURATION_SECS:-600}"
RATE="${SOAK_RATE:-300}"
PAY_SHARE="${SOAK_PAY_SHARE:-0.5}"
PAY_WINDOW="${SOAK_PAY_WINDOW_SECS:-30}"
SAMPLE="${SOAK_SAMPLE_SECS:-15}"
MAX_SLOPE="${SOAK_MAX_RSS_SLOPE_MIB_PER_MIN:-2}"
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
LOG_DIR="$RUN_DIR/soak"
mkdir -p "$LOG_DIR"
log() { printf '[soak] %s\n' "$*" >&2; }
export SECKILL__CONSUMER__PAY_WINDOW_SECS="$PAY_WINDOW"

# The full soak runs release binaries against the release build of the RocketMQ servers, as the
# benchmarks do (on a fresh machine only make test's debug broker is built). The collapse of
# 300 a second to 20-70 orders a second seen in 2026-12 came from 64 queues per topic, not from
# the broker's build (docs/benchmarks-history.md#queues-per-topic).
# soak-small (SECKILL_BIN set: the debug build) keeps whichever broker runs.
if [[ -z "${SECKILL_BIN:-}" ]]; then
  export SECKILL_MQ_BUILD="${SECKILL_MQ_BUILD:-release}"
fi
scripts/services-up.sh >&2
if [[ -z "${SECKILL_BIN:-}" ]]; then
  log "building (release)"
  cargo build --release --quiet -p seckill -p seckill-bench
fi
BIN="${SECKILL_BIN:-$root/target/release/seckill}"
BENCH="${SECKILL_BENCH_BIN:-$(dirname "$BIN")/seckill-bench}"
# The buyers' tokens as a shop issues them: RS256 from a JWKS (TOKEN_ALG to change).
source scripts/tokens-lib.sh
production_tokens "$LOG_DIR/tokens"
PSQL=(psql -X -q -h 127.0.0.1 -U postgres -d postgres)
clean_stores() {
  "${PSQL[@]}" -c "SET client_min_messages = warning; DROP SCHEMA IF EXISTS seckill_soak CASCADE" >&2 || true
  redis-cli -h 127.0.0.1 --scan --pattern 'seckill-soak:*' | xargs -r -n 500 redis-cli -h 127.0.0.1 del >/dev/null || true
}
clean_stores
"$BIN" migrate >&2
"$BIN" topics create >&2
ACTIVITY=$(( $(date +%s) * 10 + 3 ))
# Stock for every request and more: the soak never sells out.
STOCK=$(awk -v r="$RATE" -v d="$DURATION" 'BEGIN { printf "%d", r * d * 1.2 + 1000 }')
"$BIN" activity create --activity-id "$ACTIVITY" --name soak --sku "1:$STOCK:9900" \
  --duration-secs $(( DURATION + PAY_WINDOW + 3600 )) >&2

# Each role's ops port (/readyz, /metrics); the API's buyers listen on 27080.
declare -A PORT=([api]=27100 [consume]=27101 [scan]=27102 [timeout-cancel]=27103)
ROLES=(api consume scan timeout-cancel)
cleanup() { stop_roles_by_name; clean_stores; }
trap cleanup EXIT
for r in "${ROLES[@]}"; do start_role "$r"; done
for r in "${ROLES[@]}"; do wait_role_ready "$r"; done
# Messages an interrupted run left behind are consumed first (their schema is gone: rejected
# and compensated).
until_consumed "${PORT[consume]}" || log "starting anyway"

procs=()
for r in "${ROLES[@]}"; do procs+=(--proc "$r=${PID[$r]}"); done
procs+=(--proc "broker=$(cat "$RUN_DIR/broker.pid")")
log "sale: $RATE a second for $DURATION s, $PAY_SHARE paid within $PAY_WINDOW s, samples every $SAMPLE s"
set +e
"$BENCH" soak --api http://127.0.0.1:27080 --activity-id "$ACTIVITY" --sku-id 1 \
  --duration-secs "$DURATION" --rate "$RATE" --pay-share "$PAY_SHARE" --sample-secs "$SAMPLE" \
  --max-rss-slope-mib-per-min "$MAX_SLOPE" "${procs[@]}" 2> >(tee "$LOG_DIR/soak.err" >&2) \
  | tee "$LOG_DIR/soak.out"
status=${PIPESTATUS[0]}
set -e
# Every role's own counters at the end, beside the samples (e.g. how many cancels the sweep made).
for r in "${ROLES[@]}"; do
  curl -fsS "http://127.0.0.1:${PORT[$r]}/metrics" >"$LOG_DIR/metrics-$r.txt" 2>/dev/null || true
done
# A role that died during the run is a failure even if the figures look right.
for r in "${ROLES[@]}"; do
  kill -0 "${PID[$r]}" 2>/dev/null || { log "$r died during the run (log $LOG_DIR/$r.log)"; status=1; }
done
line="$(grep -E '^SOAK (OK|FAILED)' "$LOG_DIR/soak.out" | tail -1 || true)"
[[ -n "$line" ]] || { log "no SOAK line (see $LOG_DIR)"; status=1; }
# A failed run says why last, after the clean-up, where the tail of a CI log still shows it:
# the verdict's violations, the last samples and the end of each role's log.
if [[ "$status" != 0 ]]; then
  cleanup
  trap - EXIT
  log "FAILED; the last samples:"
  grep -E '^SAMPLE' "$LOG_DIR/soak.out" | tail -3 >&2 || true
  for r in "${ROLES[@]}"; do
    log "$r: the last errors of $LOG_DIR/$r.log"
    grep -E '"level":"(ERROR|WARN)"' "$LOG_DIR/$r.log" | tail -3 | cut -c1-400 >&2 || true
  done
  grep -E '^violation: ' "$LOG_DIR/soak.err" >&2 || true
  log "${line:-no SOAK line}"
fi
exit "$status"
