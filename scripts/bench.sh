#!/usr/bin/env bash
# make bench: the machine's naive limits (bench/limits/limits.sh) and the pipeline's own figures,
# measured in one run on this machine, then each figure as a ratio to its limit.
#
# This script prepares (services, a release build, the schema and topics), measures the limits
# with pgbench and redis-benchmark, and hands over to `seckill-bench run`
# (bench/src/run/), which runs the scenarios below in order and does the arithmetic
# (bench/src/ratios.rs).
#
#   1. limits: pgbench with the order transaction (one per transaction and batched),
#      redis-benchmark with the reservation script, direct-to-PostgreSQL purchases;
#      the broker's raw send rate (seckill-bench broker), one per call and batched.
#   2. order consumer on a backlog (seckill-bench backlog), one hot SKU: batched transactions
#      (three rounds, each pgbench's batch right before the drain, the median round kept),
#      one order per transaction, and --workers far past the budget.
#   3. the outbox relay draining the events those backlogs left (events/s).
#   4. the API (seckill-bench load): accepted reservations/s with batched sends and with one send
#      per reservation, and with the trust layer (tokens, rate limits) on and off;
#      answers/s for a sold-out SKU; a 10,000-unit sale from 100,000 requests
#      by 60,000 buyers; many SKUs; duplicate-heavy traffic; open-loop arrivals.
#   4b. the front door's ceilings with wrk: /healthz, sold-out answers per token algorithm with
#      the token cache on and off, the accepted path with the consumer stopped.
#   4c. a mixed crowd (seckill-bench crowd): scripted accounts firing at the start instant and
#      people arriving over its first seconds, against first come first served, a fair window,
#      and a fair window among sale-pass holders: the share of units that reach people.
#   5. the baseline a team would otherwise build (seckill-bench baseline-api: the same route,
#      one autocommit statement straight to PostgreSQL): sold-out answers, purchases, and the
#      same sale.
#   6. the crowd as it arrives (bench/src/run/burst.rs): open-loop arrivals at 0.5x, 1x, 3x and
#      10x the direct design's capacity on a sale-shaped crowd (10 SKUs by Zipf popularity,
#      retries, repeat buyers), to both designs, PostgreSQL held to the same CPU for both
#      (BENCH_CROWD_PG_CPU cores, default 0.25, a cgroup quota).
#
# The last line is machine-readable:
#   RATIOS order_vs_pgbench_single=… order_batch1_vs_pgbench_single=… order_vs_pgbench_batch=…
#          accept_batched_vs_unbatched=… soldout_vs_direct_pg=… (sold-out answers/s)
#          soldout_memory_vs_redis=… (the same, with the API's sold-out memory on and off)
#          sale_p99_vs_direct_pg=… sale_vs_front_door=… (the sale against the front door alone)
#          sale_vs_direct_pg=… sale_p99_ms=… direct_pg_sale_p99_ms=… within_3s_pct=…
#          trust_on_vs_off=… soldout_vs_healthz=… soldout_{rs256,ps256,es256,eddsa}_vs_hs256=…
#          (and _nocache: the token cache off) soldout_ceiling_vs_direct_pg=…
#          fcfs_people_share=… fair_people_share=… people_share_of_arrivals_in_window=…
#          passes_people_share=… draw_answers_vs_fcfs=… draw_p99_ms=… violations=…
# The buyers' tokens are RS256 from a key generated for the run (BENCH_TOKEN_ALG=ES256 etc.),
# published in the JWKS both servers verify with; the front door's ceilings are measured with
# wrk (bench/src/run/ceilings.rs), the generator's CPU beside the server's.
# Knobs: BENCH_QUICK=1 (smaller runs, for a smoke test), BENCH_CONCURRENCY (default 64),
# LIMITS_SECONDS (default 10), BENCH_ONLY=sale (only the sale's three runs: make bench-sale),
# BENCH_ONLY=orders|ceilings|fair|relay (one part alone, below),
# BENCH_WAITING_NICE (default 10, as shipped: the nice level of consume, scan and timeout-cancel),
# BENCH_FRESH_START=1 (the order consumer's drains start on the order tables as the migration
# left them, never analyzed, instead of pgbench's start: an inbox with history, analyzed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export SECKILL_ENV=bench
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}/bench"
mkdir -p "$RUN_DIR"
run_args=(--run-dir "$RUN_DIR" --concurrency "${BENCH_CONCURRENCY:-64}"
  --crowd-pg-cpu "${BENCH_CROWD_PG_CPU:-0.25}"
  --waiting-nice "${BENCH_WAITING_NICE:-10}" --token-alg "${BENCH_TOKEN_ALG:-RS256}")
if [[ "${BENCH_QUICK:-0}" == 1 ]]; then
  run_args+=(--quick)
  export LIMITS_SECONDS="${LIMITS_SECONDS:-3}"
else
  export LIMITS_SECONDS="${LIMITS_SECONDS:-10}"
fi
log() { printf '[bench] %s\n' "$*" >&2; }

# The benchmarks measure the release build of the RocketMQ servers (rocketmq-up.sh restarts a
# broker running the debug one), as they measure seckill's release binaries.
export SECKILL_MQ_BUILD=release
scripts/services-up.sh >&2
# A run leaves its reservations in Redis (hundreds of thousands of keys): the next run starts
# without them, and the last one clears its own at the end. Millions of stale keys make every
# SCAN-based clean-up on this Redis slow, the tests' included.
redis_clean() {
  redis-cli -h 127.0.0.1 -p 6379 --scan --pattern 'seckill-bench:*' |
    xargs -r -n 5000 redis-cli -h 127.0.0.1 -p 6379 unlink >/dev/null
}
# The crowd holds PostgreSQL in a CPU-quota cgroup while it runs (bench/src/run/pg_cpu.rs) and
# lets it go at the end; a run killed before that would leave the database throttled for
# whatever runs next, so every run lets go of such a leftover first and last.
pg_cpu_release() {
  local dir root
  for root in /sys/fs/cgroup/cpu /sys/fs/cgroup; do
    dir="$root/seckill-bench-postgres"
    [[ -d "$dir" ]] || continue
    while read -r pid; do echo "$pid" >"$root/cgroup.procs" 2>/dev/null || true; done <"$dir/cgroup.procs"
    rmdir "$dir" 2>/dev/null || true
  done
}
pg_cpu_release
redis_clean
trap 'redis_clean; pg_cpu_release' EXIT
log "building (release)"
cargo build --release --quiet -p seckill -p seckill-bench
BIN="$root/target/release/seckill"
BENCH="$root/target/release/seckill-bench"
# Every run starts from the same empty schema, as pgbench's limits do from theirs: tables
# that earlier runs grew (and that no autovacuum trimmed) make each write dearer, and the
# figures would drift with the machine's history rather than with the code.
bench_schema="$(awk -F'"' '/^schema = / { print $2; exit }' config/bench.toml)"
[[ "$bench_schema" == seckill_bench ]] || { log "config/bench.toml: unexpected schema '$bench_schema'"; exit 1; }
psql -X -q -h 127.0.0.1 -U postgres -d postgres -c "DROP SCHEMA IF EXISTS $bench_schema CASCADE" >&2
"$BIN" migrate >&2
"$BIN" topics create >&2
run_args+=(--seckill "$BIN")

# BENCH_ONLY=<part>: one part alone, minutes instead of the whole bench; last line
# <PART>_RATIOS ... violations=N.
#   ceilings (make bench-ceilings)  the front door's ceilings alone (wrk)
#   sale     (make bench-sale)      the sale's three runs
#   fair     (make bench-fair)      who gets the units of a contested start, first come, drawn,
#                                   and drawn among sale-pass holders
#   orders   (make bench-orders)    pgbench's batch (the limits' measurement 2) and the order
#                                   consumer on a backlog, with the CPU each spends per order,
#                                   in three rounds back to back (the median kept)
#   relay    (make bench-relay)     the broker's raw rate, the order backlogs as make bench
#                                   makes them, then the outbox relay on the events they left
#   crowd    (make bench-crowd)     open-loop arrivals in steps of the direct design's
#                                   capacity, both designs, PostgreSQL held to the same CPU
if [[ -n "${BENCH_ONLY:-}" ]]; then
  exec_status=0
  "$BENCH" run "${run_args[@]}" --only "$BENCH_ONLY" || exec_status=$?
  exit "$exec_status"
fi

log "limits (pgbench, redis-benchmark, direct PostgreSQL), ${LIMITS_SECONDS}s each"
DIRECT_PG_CLIENTS="${BENCH_CONCURRENCY:-64}" bench/limits/limits.sh | tee "$RUN_DIR/limits.out" >&2
grep -q '^LIMITS ' "$RUN_DIR/limits.out" || { echo "RATIOS FAILED reason=no_limits"; exit 1; }
"$BENCH" run "${run_args[@]}" --limits "$RUN_DIR/limits.out"
