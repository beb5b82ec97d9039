#!/usr/bin/env bash
# make test-upgrade: a sale running on the previous release is upgraded to this checkout the way
# docs/architecture/postgresql.md#upgrades says, without stopping it, and nothing is lost or
# doubled.
#
#  1. The previous release (the newest one RELEASES records below HEAD, or UPGRADE_FROM=<version>
#     of RELEASES: scripts/releases.sh; no tags needed) is built from its recorded commit once
#     and cached with its config under ~/.cache/seckill/releases/<version>-<commit>/.
#  2. Its migrations, topics and activity; its roles: two APIs behind HAProxy
#     (deploy/haproxy/seckill-api.cfg), consume, scan, timeout-cancel; a steady sale through
#     HAProxy (seckill-bench soak: new buyers at UPGRADE_RATE/s for UPGRADE_DURATION_SECS).
#  3. Mid-sale, in the documented order:
#     - this checkout's `seckill migrate` under the old roles (expand only);
#     - a producer switched too early: an API of this checkout writing v2 before the consumers
#       read it takes a few reservations; the old consumer quarantines them (UNSUPPORTED_SCHEMA),
#       or, when the previous release reads v2 already (v0.2.0 on), decides them;
#     - consumers first: consume, then timeout-cancel and scan, then each API in turn behind the
#       balancer, each stopped with SIGTERM (the API drains) and replaced; then the contract step
#       (`seckill migrate --contract`: V25's mirrored inbox and outbox found equal, dropped);
#     - then the producers: APIs and scan restarted with mq.order_event_schema = 2, and a few
#       reservations naming a channel go through;
#     - the quarantined messages are replayed (`seckill dlq replay --quarantined`, audited).
#  4. The verdict: the soak's (every request accepted, so none failed at the client; every
#     reservation decided; every order paid or cancelled; the invariants), and nothing left in
#     quarantine, every replay audited with its effect, the v2 orders carrying their channel.
#
# Not in `make test` (it builds a second tree of the project once, and runs for minutes).
# Last line: UPGRADE OK from=<tag> ... | UPGRADE FAILED reason=...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
RATE="${UPGRADE_RATE:-30}"
DURATION="${UPGRADE_DURATION_SECS:-150}"
CACHE_ROOT="${SECKILL_CACHE:-$HOME/.cache/seckill}/releases"
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}/upgrade"
mkdir -p "$RUN_DIR" "$CACHE_ROOT"
rm -f "$RUN_DIR"/*.log
log() { printf '[upgrade] %s\n' "$*" >&2; }
fail() {
  log "$2"
  echo "UPGRADE FAILED reason=$1"
  exit 1
}

# The roles' shared settings: the soak overlay's ports and limits, a schema, key prefix and
# topics of their own. Both releases read them from the environment.
export SECKILL_ENV=soak SECKILL__ENV=UPGRADE SECKILL__PG__SCHEMA=seckill_upgrade
export SECKILL__REDIS__KEY_PREFIX=seckill-upgrade SECKILL__CONSUMER__PAY_WINDOW_SECS=20
export SECKILL__TELEMETRY__LOG_LEVEL=info,rocketmq_client_rust=error,rocketmq_runtime=error

if [[ -n "${UPGRADE_FROM:-}" ]]; then
  PREV="$UPGRADE_FROM"
  PREV_COMMIT="$(scripts/releases.sh commit "$PREV")" || fail no_previous_release "$PREV is not in RELEASES"
else
  previous="$(scripts/releases.sh previous)" || fail no_previous_release "RELEASES records no release below HEAD"
  read -r PREV PREV_COMMIT <<<"$previous"
fi
# The message versions the previous release's consumers read (RELEASES' last field).
PREV_READS="$(awk -v v="$PREV" '$1 == v { print $NF }' RELEASES)"
OLD="$CACHE_ROOT/$PREV-${PREV_COMMIT:0:12}"
NEW_DESC="$(git describe --tags --always --dirty)"

scripts/services-up.sh >&2
if [[ ! -x "$OLD/bin/seckill" ]]; then
  log "building release $PREV ($PREV_COMMIT) once; cached in $OLD"
  rm -rf "$OLD.src"
  mkdir -p "$OLD.src"
  git archive "$PREV_COMMIT" | tar -x -C "$OLD.src"
  (cd "$OLD.src" && CARGO_TARGET_DIR="$CACHE_ROOT/target" cargo build --locked --quiet -p seckill --bin seckill)
  mkdir -p "$OLD/bin"
  cp "$CACHE_ROOT/target/debug/seckill" "$OLD/bin/seckill"
  cp -r "$OLD.src/config" "$OLD/config"
  rm -rf "$OLD.src"
fi
log "building this checkout ($NEW_DESC)"
# The demo's and the tests' build (their features), so nothing is compiled a second time.
cargo build --quiet --features seckill/failpoints -p seckill -p seckill-bench
NEW_BIN="$root/target/debug/seckill"
BENCH="$root/target/debug/seckill-bench"

# run old|new ARGS...: a one-shot command of one release.
run() {
  local which="$1"
  shift
  if [[ "$which" == old ]]; then
    SECKILL_CONFIG_DIR="$OLD/config" "$OLD/bin/seckill" "$@"
  else
    SECKILL_CONFIG_DIR="$root/config" "$NEW_BIN" "$@"
  fi
}

PSQL=(psql -X -q -h 127.0.0.1 -U postgres -d postgres)
clean_stores() {
  "${PSQL[@]}" -c "SET client_min_messages = warning; DROP SCHEMA IF EXISTS seckill_upgrade CASCADE" >&2 || true
  redis-cli -h 127.0.0.1 --scan --pattern 'seckill-upgrade:*' | xargs -r -n 500 redis-cli -h 127.0.0.1 del >/dev/null || true
}

# Each instance: its release, its command and its ports (buyers, ops, admin); started and
# stopped as every script that runs roles does (scripts/roles-lib.sh).
source scripts/roles-lib.sh
declare -A OPS=(
  [api1]=26100 [api2]=26102 [early]=26104 [consume]=26111 [scan]=26112 [timeout-cancel]=26113
)
declare -A LISTEN=([api1]=26080 [api2]=26082 [early]=26084)
LB=26090
LB_STATS=26091
# start NAME old|new [VAR=VALUE...]: starts instance NAME of that release, waits for /readyz.
start() {
  local name="$1" which="$2"
  shift 2
  local role="${name%[0-9]}" vars=("$@")
  [[ "$name" == early ]] && role=api
  case "$role" in
    api) vars+=(SECKILL__API__LISTEN="127.0.0.1:${LISTEN[$name]}"
                SECKILL__API__METRICS_LISTEN="127.0.0.1:${OPS[$name]}"
                SECKILL__API__ADMIN_LISTEN="127.0.0.1:$(( ${OPS[$name]} + 50 ))"
                SECKILL__API__DRAIN_DELAY_MS=3000) ;;
    consume) vars+=(SECKILL__CONSUMER__METRICS_LISTEN="127.0.0.1:${OPS[$name]}") ;;
    scan) vars+=(SECKILL__SCAN__METRICS_LISTEN="127.0.0.1:${OPS[$name]}") ;;
    timeout-cancel) vars+=(SECKILL__TIMEOUT__METRICS_LISTEN="127.0.0.1:${OPS[$name]}") ;;
  esac
  local bin="$NEW_BIN" cfg="$root/config"
  [[ "$which" == old ]] && { bin="$OLD/bin/seckill"; cfg="$OLD/config"; }
  echo "--- $(date -u +%T) start $which ${vars[*]}" >>"$RUN_DIR/$name.log"
  env "${vars[@]}" SECKILL_CONFIG_DIR="$cfg" "$bin" "$role" >>"$RUN_DIR/$name.log" 2>&1 &
  PID[$name]=$!
  until_ready "http://127.0.0.1:${OPS[$name]}/readyz" 30 "${PID[$name]}" \
    && { log "$name: $which ready"; return 0; }
  tail -20 "$RUN_DIR/$name.log" >&2
  fail "${name}_not_ready" "$name ($which) not ready (log $RUN_DIR/$name.log)"
}
# stop NAME: SIGTERM, then waits for it to exit (the API drains first; SIGKILL after 60 s).
stop() {
  local name="$1" pid="${PID[$1]:-}"
  [[ -n "$pid" ]] || return 0
  stop_pids 60 "$pid"
  wait "$pid" 2>/dev/null || true
  unset "PID[$name]"
}
# replace NAME old|new [VAR=VALUE...]: one instance handed over.
replace() {
  local name="$1"
  shift
  stop "$name"
  start "$name" "$@"
}
HAPROXY_PID=""
cleanup() {
  for name in "${!PID[@]}"; do stop "$name"; done
  [[ -n "$HAPROXY_PID" ]] && kill "$HAPROXY_PID" 2>/dev/null || true
  clean_stores
}
trap cleanup EXIT
q() { "${PSQL[@]}" -At -c "SET search_path TO seckill_upgrade; $1"; }

# reserve_direct PORT USER CHANNEL: one reservation at an API, 202 expected.
reserve_direct() {
  local token
  token="$(run new token mint --user "$2" 2>>"$RUN_DIR/setup.log")"
  curl -fsS -o /dev/null -w '%{http_code}' -X POST \
    "http://127.0.0.1:$1/v1/activities/$ACTIVITY/skus/1/reservations" \
    -H "authorization: Bearer $token" -H 'content-type: application/json' \
    -d "{\"request_id\":\"upgrade-$2\",\"quantity\":1,\"channel\":\"$3\"}"
}

# --- 2. the previous release, selling -------------------------------------------------------
clean_stores
log "release $PREV: migrate, topics, activity"
run old migrate 2>>"$RUN_DIR/setup.log"
run old topics create 2>>"$RUN_DIR/setup.log" >/dev/null
# The broker this checkout configures creates no consumer group by itself: this release's
# `topics create` makes them (an operator runs it before rolling out that broker config).
run new topics create 2>>"$RUN_DIR/setup.log" >/dev/null
ACTIVITY=$(( $(date +%s) * 10 + 7 ))
STOCK=$(( RATE * DURATION * 2 + 1000 ))
run old activity create --activity-id "$ACTIVITY" --name upgrade --sku "1:$STOCK:9900" \
  --duration-secs $(( DURATION + 3600 )) 2>>"$RUN_DIR/setup.log" >/dev/null
for name in api1 api2 consume scan timeout-cancel; do start "$name" old; done
SECKILL_LB_BIND="127.0.0.1:$LB" SECKILL_LB_STATS="127.0.0.1:$LB_STATS" \
  SECKILL_API_1="127.0.0.1:${LISTEN[api1]}" SECKILL_API_2="127.0.0.1:${LISTEN[api2]}" \
  haproxy -db -f deploy/haproxy/seckill-api.cfg >"$RUN_DIR/haproxy.log" 2>&1 &
HAPROXY_PID=$!
until_ready "http://127.0.0.1:$LB/readyz" 10 || true
# What an earlier run left in the topics is consumed first (its schema is gone: rejected and
# compensated, or quarantined). Quarantines counted from here on are this run's.
until_consumed "${OPS[consume]}" || true
Q0="$(q "SELECT count(*) FROM quarantined_messages WHERE reason = 'UNSUPPORTED_SCHEMA'")"
EARLY_USERS=$(( ACTIVITY * 100 ))
V2_USERS=$(( ACTIVITY * 100 + 50 ))

log "sale: $RATE/s for $DURATION s through HAProxy on :$LB"
"$BENCH" soak --api "http://127.0.0.1:$LB" --activity-id "$ACTIVITY" --rate "$RATE" \
  --duration-secs "$DURATION" --pay-share 0.5 --sample-secs 15 --max-cancel-p99-secs 30 \
  --summary-prefix SALE >"$RUN_DIR/soak.out" 2>"$RUN_DIR/soak.log" &
SOAK_PID=$!
at() { # at SECONDS: waits until that many seconds into the sale.
  while (( SECONDS - SALE_START < $1 )); do sleep 0.5; done
}
SALE_START=$SECONDS

# --- 3. the upgrade, mid-sale -----------------------------------------------------------------
at 10
log "migrate with $NEW_DESC under the running $PREV roles"
run new migrate 2>>"$RUN_DIR/setup.log"

at 15
log "a producer switched too early: v2 before the consumers read it"
start early new SECKILL__MQ__ORDER_EVENT_SCHEMA=2
EARLY=5
for i in $(seq 1 "$EARLY"); do
  code="$(reserve_direct "${LISTEN[early]}" $(( EARLY_USERS + i )) app)"
  [[ "$code" == 202 ]] || fail early_reserve "an early v2 reservation answered $code"
done
stop early
# A previous release that reads v2 already (RELEASES says so) decides them; one that does not
# quarantines them.
if [[ ",$PREV_READS," == *,v2,* ]]; then READS_V2=1; else READS_V2=0; fi
seen() {
  if ((READS_V2)); then
    q "SELECT count(*) FROM reservations WHERE activity_id = $ACTIVITY AND user_id BETWEEN $EARLY_USERS AND $(( EARLY_USERS + 49 ))"
  else
    echo $(( $(q "SELECT count(*) FROM quarantined_messages WHERE reason = 'UNSUPPORTED_SCHEMA'") - Q0 ))
  fi
}
for _ in $(seq 1 120); do
  [[ "$(seen)" -ge "$EARLY" ]] && break
  sleep 0.5
done
QUARANTINED=$(( $(q "SELECT count(*) FROM quarantined_messages WHERE reason = 'UNSUPPORTED_SCHEMA'") - Q0 ))
if ((READS_V2)); then
  log "the $PREV consumer reads v2 already: $(seen) of $EARLY early reservations decided, $QUARANTINED quarantined"
  [[ "$QUARANTINED" -eq 0 ]] || fail quarantined_v2 "a release that reads v2 quarantined $QUARANTINED"
else
  log "the $PREV consumer quarantined $QUARANTINED v2 message(s)"
  [[ "$QUARANTINED" -ge 1 ]] || fail no_quarantine "the old consumer did not quarantine the v2 messages"
fi

log "consumers first"
replace consume new
replace timeout-cancel new
replace scan new
log "then the producers, one API at a time behind the balancer"
replace api1 new
sleep 3
replace api2 new
log "every instance runs $NEW_DESC: the contract step, the mirrored tables equal until now"
out="$(run new migrate --contract 2>>"$RUN_DIR/setup.log")" && [[ "$out" == *"differed: 0)"* ]] || fail contract "$out"

at $(( DURATION / 2 + 10 ))
log "every consumer reads v2: producers switch (mq.order_event_schema = 2)"
replace scan new SECKILL__MQ__ORDER_EVENT_SCHEMA=2
replace api1 new SECKILL__MQ__ORDER_EVENT_SCHEMA=2
sleep 3
replace api2 new SECKILL__MQ__ORDER_EVENT_SCHEMA=2
V2=5
for i in $(seq 1 "$V2"); do
  code="$(reserve_direct "$LB" $(( V2_USERS + i )) web)"
  [[ "$code" == 202 ]] || fail v2_reserve "a v2 reservation answered $code"
done

if (( $(q "SELECT count(*) FROM quarantined_messages WHERE status = 'QUARANTINED'") > 0 )); then
  log "replay what was quarantined during the rollout"
  GROUP="$(q "SELECT DISTINCT consumer_group FROM quarantined_messages LIMIT 1")"
  run new dlq replay --quarantined --quarantine-reason UNSUPPORTED_SCHEMA --group "$GROUP" \
    --reason "consumers read v2 now" --actor upgrade-test --verify-secs 60 \
    >"$RUN_DIR/replay.out" 2>>"$RUN_DIR/setup.log" || fail replay "dlq replay failed: $(cat "$RUN_DIR/replay.out")"
  log "$(tail -1 "$RUN_DIR/replay.out")"
else
  log "nothing was quarantined: no replay"
fi

# --- 4. the verdict ---------------------------------------------------------------------------
log "waiting for the sale's drain, settle and invariants"
set +e
wait "$SOAK_PID"
soak_status=$?
set -e
sale="$(grep -E '^SALE (OK|FAILED)' "$RUN_DIR/soak.out" | tail -1)"
log "${sale:-no sale summary}"
[[ "$soak_status" -eq 0 && -n "$sale" ]] || { grep violation "$RUN_DIR/soak.log" >&2 || true; fail sale "the sale's verdict: ${sale:-none}"; }

left="$(q "SELECT count(*) FROM quarantined_messages WHERE status = 'QUARANTINED'")"
[[ "$left" -eq 0 ]] || fail quarantine_left "$left message(s) still quarantined"
audited="$(q "SELECT count(*) FROM dlq_audit WHERE quarantine_id IS NOT NULL AND action = 'REPLAY'
             AND (effect LIKE 'APPLIED:%' OR effect = 'DUPLICATE')")"
all_q="$(q "SELECT count(*) FROM quarantined_messages")"
[[ "$audited" -eq "$all_q" ]] || fail replay_audit "$audited of $all_q replays audited with an effect"
effects="$(q "SELECT string_agg(effect || ':' || n, ',') FROM (SELECT effect, count(*) n FROM dlq_audit
              WHERE quarantine_id IS NOT NULL GROUP BY effect ORDER BY effect) e")"
# Each early reservation decided once: an order (from the replay, or from a v1 re-send of the
# old scanner before it) or a rejection with its unit given back.
decided="$(q "SELECT count(*) FROM reservations WHERE activity_id = $ACTIVITY AND user_id BETWEEN $EARLY_USERS AND $(( EARLY_USERS + 49 ))")"
[[ "$decided" -eq "$EARLY" ]] || fail early_decided "$decided of $EARLY early reservations decided"
web="$(q "SELECT count(*) FROM orders WHERE activity_id = $ACTIVITY AND channel = 'web'")"
[[ "$web" -eq "$V2" ]] || fail v2_channel "$web of $V2 v2 orders carry their channel"
echo "UPGRADE OK from=$PREV to=$NEW_DESC early_v2=$EARLY quarantined=$QUARANTINED replays=$effects v2_orders_with_channel=$web ${sale#SALE OK }"
