#!/usr/bin/env bash
# make demo: services up, migrate, topics, a fresh flash-sale activity, api + consume + scan +
# timeout-cancel, a burst of buyers, wait for the orders, pay half of them, let the rest expire
# (20 s pay window in config/demo.toml) and be cancelled, then print what happened and whether
# the invariants hold.
# The last line is machine-readable: DEMO OK ... / DEMO FAILED ...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

REQUESTS="${DEMO_REQUESTS:-20000}"
BUYERS="${DEMO_BUYERS:-15000}"
STOCK="${DEMO_STOCK:-2000}"
CONCURRENCY="${DEMO_CONCURRENCY:-64}"
PAY_SHARE="${DEMO_PAY_SHARE:-0.5}"
WORKERS="${DEMO_WORKERS:-}"
export SECKILL_ENV=demo
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}/demo"
mkdir -p "$RUN_DIR"

scripts/services-up.sh
# The debug profile with optimised dependencies and the tests' features: the build make test
# reuses, and a third of release's cost on a first run (docs/RUNNING.md#the-first-run). The
# release binaries are `make build`'s, for deployments and the benchmarks.
echo "[demo] building (debug profile, dependencies optimised)"
cargo build --quiet --features seckill/failpoints -p seckill -p seckill-bench
BIN="$root/target/debug/seckill"
BENCH="$root/target/debug/seckill-bench"
# The buyers' tokens as a shop issues them: RS256 from a JWKS (TOKEN_ALG to change).
source "$root/scripts/tokens-lib.sh"
production_tokens "$RUN_DIR/tokens"

source "$root/scripts/demo-lib.sh"
: >"$RUN_DIR/setup.log"
setup migrate
setup topics create
ACTIVITY_ID="$(date +%s)"
setup activity create --activity-id "$ACTIVITY_ID" --name "demo sale" --sku "1:$STOCK:9900" --duration-secs 3600

trap stop_roles EXIT

"$BIN" api >"$RUN_DIR/api.log" 2>&1 &
pids+=($!)
# The roles whose work can wait run at nice 10, as deploy/systemd weighs them
# (docs/architecture/roles.md#scheduling-weights).
nice -n 10 "$BIN" consume ${WORKERS:+--workers "$WORKERS"} >"$RUN_DIR/consume.log" 2>&1 &
pids+=($!)
nice -n 10 "$BIN" scan >"$RUN_DIR/scan.log" 2>&1 &
pids+=($!)
nice -n 10 "$BIN" timeout-cancel >"$RUN_DIR/timeout-cancel.log" 2>&1 &
pids+=($!)

wait_ready http://127.0.0.1:18080/readyz http://127.0.0.1:19101/readyz http://127.0.0.1:19102/readyz http://127.0.0.1:19103/readyz
# The consumer needs a moment to get its queue assignment from the broker.
sleep 2

echo "[demo] activity $ACTIVITY_ID: $REQUESTS requests from $BUYERS buyers for $STOCK units, $CONCURRENCY at a time"
set +e
# The terminal gets the human summary; the load generator's own log lines go to bench.log.
"$BENCH" load --api http://127.0.0.1:18080 --activity-id "$ACTIVITY_ID" --sku-id 1 \
  --requests "$REQUESTS" --buyers "$BUYERS" --concurrency "$CONCURRENCY" \
  --pay-share "$PAY_SHARE" --summary-prefix DEMO 2>"$RUN_DIR/bench.log" | tee "$RUN_DIR/bench.out"
status=${PIPESTATUS[0]}
set -e
if [[ "$status" -ne 0 ]]; then tail -5 "$RUN_DIR/bench.log"; fi
stop_roles
trap - EXIT
echo "[demo] role logs: $RUN_DIR/{setup,api,consume,scan,timeout-cancel,bench}.log"
line="$(grep -E '^DEMO (OK|FAILED)' "$RUN_DIR/bench.out" | tail -1)"
echo "${line:-DEMO FAILED reason=no_summary}"
exit "$status"
