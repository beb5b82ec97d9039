# The naive limits' helpers (bench/limits/limits.sh sources this after its settings): the
# tools it installs, the cleanup of its private schema and Redis prefix, the resets that make
# every run start alike, and pgbench with the CPU and WAL it cost. They read the settings'
# globals (PSQL, REDIS, SCHEMA, RPREFIX, SECS, tmp, ...).
# shellcheck shell=bash

# --- tools -------------------------------------------------------------------------------
need() { # command, apt package
  command -v "$1" >/dev/null 2>&1 && return 0
  local sudo=()
  [[ "$(id -u)" -eq 0 ]] || sudo=(sudo)
  log "installing $2 (apt) for $1"
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y -q "$2" >/dev/null 2>&1; then
    "${sudo[@]}" apt-get update -q >/dev/null
    "${sudo[@]}" apt-get install -y -q "$2" >/dev/null
  fi
  command -v "$1" >/dev/null 2>&1 || die "$1 is still missing after installing $2"
}

# --- cleanup -----------------------------------------------------------------------------
drop_schema() {
  "${PSQL[@]}" -c "SET client_min_messages = warning; SET lock_timeout = '10s';
                   DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null
}
redis_keys() { "${REDIS[@]}" --scan --pattern "$RPREFIX:*"; }
redis_cleanup() { # SCAN + UNLINK of the private prefix, sent as one pipelined stream
  local left=""
  for _ in 1 2 3; do
    redis_keys \
      | awk '{ printf "*2\r\n$6\r\nUNLINK\r\n$%d\r\n%s\r\n", length($0), $0 }' \
      | "${REDIS[@]}" --pipe >/dev/null
    left="$(redis_keys | wc -l)"
    [[ "$left" -eq 0 ]] && return 0
  done
  log "warning: $left Redis keys under $RPREFIX: are still there"
  return 1
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  local clean=1
  drop_schema || { clean=0; log "warning: could not drop schema $SCHEMA"; }
  redis_cleanup || clean=0
  [[ -n "$tmp" ]] && rm -rf "$tmp"
  if [[ $rc -ne 0 ]]; then
    if (( clean )); then log "failed (exit $rc); schema $SCHEMA and keys $RPREFIX:* removed"
    else log "failed (exit $rc)"; fi
  fi
  exit "$rc"
}

# --- helpers -----------------------------------------------------------------------------
fmt1() { printf '%.1f' "$1"; }
gt() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a > b) }'; }
free_connections() {
  "${PSQL[@]}" -Atc "SELECT current_setting('max_connections')::int
                            - current_setting('superuser_reserved_connections')::int
                            - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
}

# Fresh order tables and a full hot row, vacuumed and checkpointed, so every run starts alike.
# The inbox starts with INBOX_HISTORY processed messages of earlier sales, analyzed, as a
# production inbox would: on an empty, analyzed inbox, pgbench's prepared statements cache
# (after 5 executions) a generic plan that scans all the group's inbox rows for the inbox
# update, and the run slows down as the table grows (seen here: 140 -> 60 batches/s within
# 8 s). The project's own unnest-join inbox update gets such a plan too on a small inbox.
# reset_order_tables [history rows]
reset_order_tables() {
  "${PSQL[@]}" >/dev/null <<SQL
SET client_min_messages = warning;
TRUNCATE $SCHEMA.consumer_inbox_by_day, $SCHEMA.reservations, $SCHEMA.orders,
         $SCHEMA.stock_ledger, $SCHEMA.event_outbox_by_day;
INSERT INTO $SCHEMA.consumer_inbox_by_day
    (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
     received_at, updated_at, id_at)
SELECT 'seckill-limits-consumer', 'evt_old' || lpad(i::text, 23, '0'), 'seckill-order-create',
       'rsv_old' || lpad(i::text, 23, '0'), 'ord_old' || lpad(i::text, 23, '0'), 'SUCCEEDED',
       'CREATED', now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'
FROM generate_series(1, ${1:-$INBOX_HISTORY}) AS i;
UPDATE $SCHEMA.stock_buckets SET remaining_stock = total_stock;
VACUUM ANALYZE $SCHEMA.stock_buckets;
VACUUM ANALYZE $SCHEMA.consumer_inbox_by_day;
VACUUM ANALYZE $SCHEMA.reservations;
VACUUM ANALYZE $SCHEMA.orders;
VACUUM ANALYZE $SCHEMA.stock_ledger;
VACUUM ANALYZE $SCHEMA.event_outbox_by_day;
CHECKPOINT;
SQL
}
reset_direct() { # stock
  "${PSQL[@]}" >/dev/null <<SQL
SET client_min_messages = warning;
TRUNCATE $SCHEMA.direct_orders;
UPDATE $SCHEMA.stock SET remaining = $1 WHERE id = 1;
VACUUM ANALYZE $SCHEMA.stock;
VACUUM ANALYZE $SCHEMA.direct_orders;
CHECKPOINT;
SQL
}

# CPU clock ticks (utime + stime) of every PostgreSQL process, plus what the postmaster
# reaped from backends that ended (cutime + cstime): a pgbench run's backends still count
# once they have exited.
pg_ticks() {
  local pm p f total=0
  local -a a
  pm="$(pgrep -o -x postgres)" || { echo 0; return; }
  for p in $(pgrep -x postgres); do
    f="$(cat "/proc/$p/stat" 2>/dev/null)" || continue
    read -r -a a <<<"${f##*) }" # after the command name: state ppid ... utime(11) stime(12)
    total=$((total + a[11] + a[12]))
    if [[ "$p" == "$pm" ]]; then total=$((total + a[13] + a[14])); fi
  done
  echo "$total"
}

# WAL bytes PostgreSQL has written since its statistics were reset (pg_stat_wal).
wal_bytes() { "${PSQL[@]}" -Atc "SELECT wal_bytes FROM pg_stat_wal"; }

# run_pgbench label script clients [pgbench args...] -> prints tps; leaves
# "<transactions> <PostgreSQL CPU s> <pgbench CPU s> <WAL bytes>" in $tmp/pgbench.cpu
run_pgbench() {
  local label="$1" script="$2" clients="$3"; shift 3
  local out="$tmp/pgbench.out" rc=0 ticks_before ticks_after wal_before wal_after
  local TIMEFORMAT='%3U %3S'
  wal_before="$(wal_bytes)"
  ticks_before="$(pg_ticks)"
  { time pgbench "${PG_CONN[@]}" -n -M prepared -c "$clients" -j "$PGBENCH_THREADS" -T "$SECS" \
       -f "$script" "$@" postgres >"$out" 2>&1; } 2>"$tmp/pgbench.time" || rc=$?
  ticks_after="$(pg_ticks)"
  wal_after="$(wal_bytes)"
  if ((rc != 0)); then
    cat "$out" >&2
    die "pgbench failed: $label"
  fi
  local tps txs failed lat
  tps="$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$out" | tail -1)"
  txs="$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out")"
  failed="$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out")"
  lat="$(sed -n 's/^latency average = \(.*\)$/\1/p' "$out")"
  [[ -n "$tps" && -n "$txs" && "$txs" -gt 0 ]] || { cat "$out" >&2; die "no result from pgbench: $label"; }
  [[ "${failed:-0}" -eq 0 ]] || { cat "$out" >&2; die "pgbench: $failed failed transactions: $label"; }
  log "  $label: $(fmt1 "$tps") tps ($txs transactions, latency $lat)"
  awk -v t="$txs" -v d="$((ticks_after - ticks_before))" -v hz="$(getconf CLK_TCK)" \
      -v w="$((wal_after - wal_before))" \
      '{ printf "%d %.3f %.3f %d\n", t, d / hz, $1 + $2, w }' "$tmp/pgbench.time" >"$tmp/pgbench.cpu"
  printf '%s' "$tps"
}

psql_value() { "${PSQL[@]}" -Atc "$1"; }
