#!/usr/bin/env bash
# make test-api-fuzz: schemathesis (property-based API tests from docs/openapi.yaml) against a
# live `seckill api`. Fails on any 5xx and on any response that does not conform to the spec
# (status code, content type, headers, body schema) or that accepts invalid / rejects valid input.
#
# Isolated from everything else on the machine: environment FUZZ (its own topics and consumer
# groups), PostgreSQL schema seckill_fuzz, Redis key prefix seckill-fuzz, free loopback ports.
# The schema and the keys are dropped before (a crashed earlier run) and after the run; the
# broker topics FUZZ_SECKILL_* are kept (created idempotently).
#
# A `seckill consume` runs beside the api. Without it nothing consumes FUZZ_SECKILL_ORDER_CREATE_V1,
# the api's fail-closed admission sees the queue's oldest message grow older than 60 s and answers
# every reservation 503 SALE_PAUSED (by design); with it the reservations become orders, so the
# GET /v1/orders route is exercised with real data too (payment notifications, unsigned, are refused).
#
# Does not build: it uses ${SECKILL_BIN:-target/debug/seckill}.
# Knobs: SCHEMATHESIS_MAX_EXAMPLES (default 100 per operation), SCHEMATHESIS_WORKERS (default 1),
# SCHEMATHESIS_SEED (reproduce a run), SCHEMATHESIS_VENV; extra arguments go to `schemathesis run`.
# The last line is machine-readable: SCHEMATHESIS OK ... / SCHEMATHESIS FAILED ...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/ready-lib.sh
started=$SECONDS

# Pinned: 4.32.5 needs Python >= 3.11 (checked with 3.11.7). Bump here and the venv is rebuilt.
ST_VERSION=4.32.5
VENV="${SCHEMATHESIS_VENV:-$HOME/.cache/seckill/venv-schemathesis}"
BIN="${SECKILL_BIN:-target/debug/seckill}"
MAX_EXAMPLES="${SCHEMATHESIS_MAX_EXAMPLES:-100}"
WORKERS="${SCHEMATHESIS_WORKERS:-1}"
SEED="${SCHEMATHESIS_SEED:-}"
# The whole script stays under 3 minutes: schemathesis gets what is left of this budget.
BUDGET_SECS="${SCHEMATHESIS_BUDGET_SECS:-170}"
SPEC="$root/docs/openapi.yaml"
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}/schemathesis"

PG_SCHEMA=seckill_fuzz
REDIS_PREFIX=seckill-fuzz
PGHOST="${PGHOST:-127.0.0.1}" PGPORT="${PGPORT:-5432}" PGUSER="${PGUSER:-postgres}"
export PGHOST PGPORT PGUSER
REDIS_HOST=127.0.0.1 REDIS_PORT=6379

log() { printf '[schemathesis] %s\n' "$*"; }

# --- the binary (never built here) -------------------------------------------------------
if [[ ! -x "$BIN" ]]; then
  log "no seckill binary at $BIN"
  log "build it first: cargo build --features failpoints   (target/debug/seckill, as make test)"
  log "            or: cargo build --release && SECKILL_BIN=target/release/seckill $0"
  echo "SCHEMATHESIS FAILED reason=no_binary bin=$BIN"
  exit 2
fi
BIN="$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")"

mkdir -p "$RUN_DIR"
exec 9>"$RUN_DIR/.lock"
if ! flock -n 9; then
  log "another scripts/schemathesis.sh is running (lock $RUN_DIR/.lock)"
  echo "SCHEMATHESIS FAILED reason=already_running"
  exit 1
fi
rm -rf "$RUN_DIR/report" "$RUN_DIR"/*.log

# --- state, cleanup, final line ------------------------------------------------------------
stage=setup
result=FAILED
detail=""
pids=()

stop_roles() { # SIGTERM each role we started (api first), wait for it, SIGKILL after 25 s
  local pid
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 125); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      log "pid $pid did not stop within 25 s of SIGTERM; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  pids=()
}

drop_state() { # the fuzz schema and every key of the fuzz prefix (SCAN + DEL, never FLUSH*)
  psql -d postgres -v ON_ERROR_STOP=1 -qX \
    -c "DROP SCHEMA IF EXISTS \"$PG_SCHEMA\" CASCADE" >/dev/null 2>&1 ||
    log "warning: could not drop schema $PG_SCHEMA"
  redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" --scan --pattern "$REDIS_PREFIX:*" 2>/dev/null |
    xargs -r -d '\n' -n 500 redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" del >/dev/null 2>&1 ||
    log "warning: could not delete the $REDIS_PREFIX:* keys"
}

finish() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  stop_roles
  if [[ "$stage" != setup ]]; then drop_state; fi
  local secs=$((SECONDS - started))
  if [[ "$result" == OK && $rc -eq 0 ]]; then
    echo "SCHEMATHESIS OK seconds=$secs version=$ST_VERSION $detail"
    exit 0
  fi
  [[ $rc -ne 0 ]] || rc=1
  log "logs: $RUN_DIR (api.log, consume.log, schemathesis.log, report/)"
  echo "SCHEMATHESIS FAILED stage=$stage seconds=$secs version=$ST_VERSION $detail"
  exit "$rc"
}
trap finish EXIT
trap 'detail="reason=interrupted"; exit 130' INT
trap 'detail="reason=terminated"; exit 143' TERM

# --- schemathesis in a venv outside the repository ------------------------------------------
stage=install
if ! "$VENV/bin/schemathesis" --version 2>/dev/null | grep -qx "schemathesis, version $ST_VERSION"; then
  log "installing schemathesis $ST_VERSION into $VENV"
  [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$ST_VERSION"
fi

# --- services and isolated settings ---------------------------------------------------------
stage=services
scripts/services-up.sh

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port="$(free_port)"
consume_port="$(free_port)"
while [[ "$consume_port" == "$port" ]]; do consume_port="$(free_port)"; done
admin_port="$(free_port)"
while [[ "$admin_port" == "$port" || "$admin_port" == "$consume_port" ]]; do admin_port="$(free_port)"; done
ops_port="$(free_port)"
while [[ "$ops_port" == "$port" || "$ops_port" == "$consume_port" || "$ops_port" == "$admin_port" ]]; do ops_port="$(free_port)"; done
export SECKILL_ENV=test
export SECKILL__ENV=FUZZ
export SECKILL__PG__SCHEMA="$PG_SCHEMA"
export SECKILL__REDIS__KEY_PREFIX="$REDIS_PREFIX"
export SECKILL__API__LISTEN="127.0.0.1:$port"
export SECKILL__API__ADMIN_TOKEN="fuzz-admin-token-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export SECKILL__API__ADMIN_LISTEN="127.0.0.1:$admin_port"
export SECKILL__API__METRICS_LISTEN="127.0.0.1:$ops_port"
export SECKILL__CONSUMER__METRICS_LISTEN="127.0.0.1:$consume_port"
export SECKILL__TELEMETRY__LOG_LEVEL="${SECKILL__TELEMETRY__LOG_LEVEL:-info,rocketmq_client_rust=warn,rocketmq_runtime=error,rocketmq_transport=warn,rocketmq_remoting=warn}"

# --- fresh schema, topics, one activity -----------------------------------------------------
stage=prepare
drop_state # leftovers of an interrupted run
"$BIN" migrate >"$RUN_DIR/prepare.log" 2>&1 || { tail -20 "$RUN_DIR/prepare.log"; exit 1; }
"$BIN" topics create >>"$RUN_DIR/prepare.log" 2>&1 || { tail -20 "$RUN_DIR/prepare.log"; exit 1; }
# SKU 1 with stock for a million buyers: the fuzzer never sells out.
"$BIN" activity create --activity-id 1 --name "schemathesis" --sku 1:1000000:9900 \
  --duration-secs 3600 >>"$RUN_DIR/prepare.log" 2>&1 || { tail -20 "$RUN_DIR/prepare.log"; exit 1; }
# Activity 2 sells to sale-pass holders from an hour on: its registration (with a light proof
# of work) is open during the run, so the pass routes reach their own logic.
"$BIN" activity create --activity-id 2 --name "schemathesis passes" --sku 1:1000000:9900 \
  --starts-at "$(date -u -d '+1 hour' +%Y-%m-%dT%H:%M:%SZ)" --duration-secs 3600 \
  --passes 1000000 --pass-pow-difficulty 20 \
  >>"$RUN_DIR/prepare.log" 2>&1 || { tail -20 "$RUN_DIR/prepare.log"; exit 1; }
log "schema $PG_SCHEMA migrated, FUZZ topics present, activity 1 / sku 1 on sale for an hour, activity 2 registering passes"


# --- the roles ----------------------------------------------------------------------------------
stage=roles
wait_ready() { # name, url, pid, seconds
  local name="$1" url="$2" pid="$3" secs="$4"
  until_ready "$url" "$secs" "$pid" && return 0
  tail -30 "$RUN_DIR/$name.log"
  if kill -0 "$pid" 2>/dev/null; then detail="reason=${name}_not_ready"; else detail="reason=${name}_exited"; fi
  return 1
}
# The api goes first in pids: it is stopped first, while the consumer can still take its orders.
"$BIN" api >"$RUN_DIR/api.log" 2>&1 &
pids+=($!)
api_pid=$!
"$BIN" consume >"$RUN_DIR/consume.log" 2>&1 &
pids+=($!)
consume_pid=$!
base="http://127.0.0.1:$port"
wait_ready consume "http://127.0.0.1:$consume_port/readyz" "$consume_pid" 30
wait_ready api "$base/readyz" "$api_pid" 30
log "api ready on $base (pid $api_pid), consume ready (pid $consume_pid, metrics :$consume_port)"

# Fail-closed admission opens once the consumer has caught up with the order queue (it starts
# from the first offset the first time its group exists on this broker).
# The lag is the consume role's reading (the API only uses its own for admission).
open=""
for _ in $(seq 1 150); do
  m="$(curl -fsS -m 2 "http://127.0.0.1:$ops_port/metrics" 2>/dev/null || true)"
  c="$(curl -fsS -m 2 "http://127.0.0.1:$consume_port/metrics" 2>/dev/null || true)"
  if ! grep -qE '^admission_paused 1' <<<"$m" &&
    grep -qE '^mq_consumer_lag_messages\{topic="order_create"\} 0$' <<<"$c"; then
    open=1; break
  fi
  sleep 0.2
done
if [[ -z "$open" ]]; then
  grep -E '^admission_paused' <<<"$m" || true
  grep -E '^mq_consumer_lag' <<<"$c" || true
  detail="reason=admission_closed"; exit 1
fi
log "admission open, order queue drained"

# --- schemathesis -----------------------------------------------------------------------------
stage=schemathesis
left=$((BUDGET_SECS - (SECONDS - started) - 30)) # kept for the roles' drain and the cleanup
if ((left < 30)); then detail="reason=no_time_left"; exit 1; fi
# The buyers' routes need a buyer token: one development token (buyer 1) for every request.
# Other buyers' reservations and orders (the ids the fuzzer follows from 202s are buyer 1's
# own) answer 404; calls without it are checked by schemathesis' ignored_auth check.
token="$("$BIN" token mint --user 1 --ttl 3600 2>>"$RUN_DIR/prepare.log")" || { detail="reason=token_mint"; exit 1; }
args=(
  run "$SPEC"
  --url "$base"
  --header "Authorization: Bearer $token"
  --checks all
  --max-examples "$MAX_EXAMPLES"
  --workers "$WORKERS"
  --request-timeout 10
  --generation-database none
  --report junit --report-dir "$RUN_DIR/report"
  --no-color
)
[[ -z "$SEED" ]] || args+=(--seed "$SEED")
log "schemathesis ${args[*]} $*  (at most ${left}s)"
set +e
# Run from $RUN_DIR: hypothesis and schemathesis keep caches (.hypothesis/, .schemathesis/) in
# the working directory, which must not be the repository.
(cd "$RUN_DIR" && PYTHONDONTWRITEBYTECODE=1 timeout --signal=INT --kill-after=10 "$left" \
  "$VENV/bin/schemathesis" "${args[@]}" "$@") 2>&1 | tee "$RUN_DIR/schemathesis.log"
st=${PIPESTATUS[0]}
set -e
seed="$(grep -oE -- '--seed[= ][0-9]+|Seed: *[0-9]+' "$RUN_DIR/schemathesis.log" | grep -oE '[0-9]+' | tail -1 || true)"
if ((st == 124 || st == 130)); then
  detail="reason=timeout limit=${left}s${seed:+ seed=$seed}"; exit 1
fi
if ((st != 0)); then
  detail="reason=checks_failed exit=$st${seed:+ seed=$seed}"; exit 1
fi
stage=finished
result=OK
detail="max_examples=$MAX_EXAMPLES${seed:+ seed=$seed}"
