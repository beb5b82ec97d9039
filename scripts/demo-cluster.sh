#!/usr/bin/env bash
# make demo-cluster: the sale of `make demo` on the scaled-out topology, on loopback: the Redis
# Cluster of scripts/redis-cluster-up.sh (three primaries), two RocketMQ masters, two `api`,
# three `consume`, two `scan` and two `timeout-cancel`; the SKU's stock split into
# DEMO_STOCK_BUCKETS (3) stock buckets, spread over the primaries. While reservations are being
# accepted it SIGKILLs the second broker and fails the primary of the activity's first bucket
# over to its replica (DEMO_REDIS_FAULT=kill: SIGKILLs that primary instead); the
# sale goes on through both APIs against the one broker left, and the dead one comes back 10 s
# later (what it held and nobody consumed is sent again through the live one meanwhile:
# docs/architecture/messages.md#a-dead-brokers-messages). Half
# the orders are paid and the rest expire. At the end the second broker is stopped and its
# store removed.
# The last line is machine-readable: DEMO OK ... / DEMO FAILED ...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

REQUESTS="${DEMO_REQUESTS:-20000}"
BUYERS="${DEMO_BUYERS:-15000}"
STOCK="${DEMO_STOCK:-2000}"
CONCURRENCY="${DEMO_CONCURRENCY:-64}"
PAY_SHARE="${DEMO_PAY_SHARE:-0.5}"
export SECKILL_ENV=demo
export SECKILL__ENV=DEMOCLUSTER
export SECKILL__REDIS__MODE=cluster
export SECKILL__REDIS__URL="redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003"
export SECKILL__MQ__BROKER_ADDR="127.0.0.1:10911,127.0.0.1:10921"
# Orders whose messages the killed broker held are created once the scanner sends them again
# (scan.unconsumed_resend_ms, 5 s): a pay window longer than make demo's 10 s keeps room for
# the buyers who pay.
export SECKILL__CONSUMER__PAY_WINDOW_SECS="${DEMO_PAY_WINDOW_SECS:-60}"
RUN_BASE="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
RUN_DIR="$RUN_BASE/demo-cluster"
mkdir -p "$RUN_DIR"

scripts/services-up.sh
SECKILL_MQ_BROKERS=2 scripts/rocketmq-up.sh
echo "[demo-cluster] building (release)"
cargo build --release --quiet -p seckill -p seckill-bench
BIN="$root/target/release/seckill"
BENCH="$root/target/release/seckill-bench"
# The buyers' tokens as a shop issues them: RS256 from a JWKS (TOKEN_ALG to change).
source "$root/scripts/tokens-lib.sh"
production_tokens "$RUN_DIR/tokens"

source "$root/scripts/demo-lib.sh"
: >"$RUN_DIR/setup.log"
setup migrate
setup topics create
ACTIVITY_ID="$(date +%s)"
setup activity create --activity-id "$ACTIVITY_ID" --name "demo-cluster sale" --sku "1:$STOCK:9900" \
  --stock-buckets "${DEMO_STOCK_BUCKETS:-3}" --duration-secs 3600

trap stop_roles EXIT

# role NAME PORT_KEY PORT [nice] [args...]: one instance on its own port, logging to NAME.log.
ready_urls=()
role() {
  local name="$1" key="$2" port="$3" niceness="$4"; shift 4
  env "$key=127.0.0.1:$port" nice -n "$niceness" "$BIN" "$@" >"$RUN_DIR/$name.log" 2>&1 &
  pids+=($!)
  ready_urls+=("http://127.0.0.1:$port/readyz")
}
SECKILL__API__METRICS_LISTEN=127.0.0.1:19111 role api-1 SECKILL__API__LISTEN 18080 0 api
SECKILL__API__METRICS_LISTEN=127.0.0.1:19112 role api-2 SECKILL__API__LISTEN 18081 0 api
# Three consumers and two timeout-cancels share the database's worker budgets.
for i in 1 2 3; do
  SECKILL__PG__CONSUME_INSTANCES=3 role "consume-$i" SECKILL__CONSUMER__METRICS_LISTEN "1910$i" 10 consume
done
for i in 1 2; do
  role "scan-$i" SECKILL__SCAN__METRICS_LISTEN "1912$i" 10 scan
  SECKILL__PG__TIMEOUT_CANCEL_INSTANCES=2 role "timeout-cancel-$i" SECKILL__TIMEOUT__METRICS_LISTEN "1913$i" 10 timeout-cancel
done
wait_ready "${ready_urls[@]}"
sleep 2

# The faults, once reservations are being accepted: broker b dies (SIGKILL) and the activity's
# Redis primary hands its slot to its replica; broker b restarts 10 s later.
faults() {
  local accepted=0
  for _ in $(seq 1 300); do
    accepted="$(curl -fsS http://127.0.0.1:19111/metrics 2>/dev/null | awk '/^reservation_total\{result="queued"\}/ { print $2 }')"
    accepted="${accepted:-0}"
    (( ${accepted%.*} >= 50 )) && break
    sleep 0.1
  done
  kill -KILL "$(cat "$RUN_BASE/broker-b.pid")" && echo "[demo-cluster] fault: broker b SIGKILLed at ${accepted:-0} accepted by api-1"
  local slot primary replica
  slot="$(redis-cli -p 7001 cluster keyslot "a$ACTIVITY_ID")"
  primary="$(redis-cli -p 7001 cluster nodes | awk -v s="$slot" '$3 ~ /master/ && $3 !~ /fail/ {
      for (i = 9; i <= NF; i++) { split($i, r, "-"); if (r[2] == "") r[2] = r[1]; if (s >= r[1] && s <= r[2]) print $1 } }')"
  replica="$(redis-cli -p 7001 cluster nodes | awk -v m="$primary" '$4 == m && $3 !~ /fail/ { split($2, a, "[:@]"); print a[2]; exit }')"
  if [[ "${DEMO_REDIS_FAULT:-failover}" == kill ]]; then
    # The primary dies outright: its replica is promoted after cluster-node-timeout.
    local pport
    pport="$(redis-cli -p 7001 cluster nodes | awk -v m="$primary" '$1 == m { split($2, a, "[:@]"); print a[2] }')"
    if [[ -n "$pport" && -n "$replica" ]] && kill -KILL "$(cat "$HOME/.cache/seckill/redis-cluster/$pport/redis.pid")"; then
      echo "[demo-cluster] fault: primary :$pport of slot $slot (activity $ACTIVITY_ID) SIGKILLed; replica :$replica takes over"
    else
      echo "[demo-cluster] fault: no primary found for slot $slot"
    fi
  elif [[ -n "$replica" ]] && redis-cli -p "$replica" cluster failover >/dev/null; then
    echo "[demo-cluster] fault: slot $slot of activity $ACTIVITY_ID failed over to :$replica"
  else
    echo "[demo-cluster] fault: no replica found for slot $slot"
  fi
  sleep 10
  SECKILL_MQ_BROKERS=2 scripts/rocketmq-up.sh >/dev/null && echo "[demo-cluster] broker b restarted"
  # A killed node comes back as a replica of the one that took its slots.
  scripts/redis-cluster-up.sh >/dev/null && echo "[demo-cluster] Redis Cluster whole again"
}
faults >"$RUN_DIR/faults.log" 2>&1 &
faults_pid=$!

# A graceful failover must cost no buyer an error (the strict verdict); a primary killed
# outright leaves its slot without a primary until the replica is promoted, and those buyers
# are answered 503 (fail closed; they retry with the same request id): every such answer is
# still checked against the stores.
tolerate=()
[[ "${DEMO_REDIS_FAULT:-failover}" == kill ]] && tolerate=(--tolerate-faults)
echo "[demo-cluster] activity $ACTIVITY_ID: $REQUESTS requests from $BUYERS buyers for $STOCK units through two APIs, $CONCURRENCY at a time"
set +e
"$BENCH" load --api http://127.0.0.1:18080,http://127.0.0.1:18081 --activity-id "$ACTIVITY_ID" --sku-id 1 \
  --requests "$REQUESTS" --buyers "$BUYERS" --concurrency "$CONCURRENCY" \
  --pay-share "$PAY_SHARE" --summary-prefix DEMO "${tolerate[@]}" 2>"$RUN_DIR/bench.log" | tee "$RUN_DIR/bench.out"
status=${PIPESTATUS[0]}
set -e
wait "$faults_pid" || true
cat "$RUN_DIR/faults.log"
if [[ "$status" -ne 0 ]]; then tail -5 "$RUN_DIR/bench.log"; fi
# What the scanners sent again that the dead broker held
# (docs/architecture/messages.md#a-dead-brokers-messages).
resent=0 requeued=0
for port in 19121 19122; do
  m="$(curl -fsS "http://127.0.0.1:$port/metrics" 2>/dev/null || true)"
  resent=$(( resent + $(awk '/^reservation_unconsumed_resend_total/ { s += $2 } END { printf "%d", s }' <<<"$m") ))
  requeued=$(( requeued + $(awk '/^outbox_unconsumed_requeue_total/ { s += $2 } END { printf "%d", s }' <<<"$m") ))
done
echo "[demo-cluster] held by the dead broker and sent again: $resent order messages, $requeued releases"
stop_roles
trap - EXIT
# Back to one broker, the second one's store gone (the demo's topics stay on the first).
scripts/rocketmq-down.sh --second-broker >/dev/null
echo "[demo-cluster] role logs: $RUN_DIR"
line="$(grep -E '^DEMO (OK|FAILED)' "$RUN_DIR/bench.out" | tail -1)"
faults_seen="$(grep -c '^\[demo-cluster\] fault: ' "$RUN_DIR/faults.log" || true)"
if [[ "$faults_seen" -lt 2 ]]; then
  echo "DEMO FAILED reason=faults_not_injected ${line#DEMO * }"
  exit 1
fi
echo "${line:-DEMO FAILED reason=no_summary}"
exit "$status"
