#!/usr/bin/env bash
# A PostgreSQL 15 failover pair run by pg_auto_failover, for tests where the primary dies
# mid-sale: monitor on 127.0.0.1:5440, data nodes on 5441/5442 (primary + secondary), loopback
# only, trust auth, no SSL, everything under SECKILL_PG_HA_DIR (~/.cache/seckill/pg-ha).
# The system cluster on 5432 is never touched. Each command prints one `PG_HA ...` line.
#
#   up                       start or resume the pair, synchronous (idempotent); prints the URL
#   mode sync|async          standby in/out of the commit quorum; waits for the primary to agree
#   status                   pg_autoctl show state, then primary=P standby=S timeline=N
#   kill-primary             SIGKILL the primary's postgres and its keeper
#   wait-promoted OLD [S]    wait (S s, default 60) until the other node takes writes
#   rejoin PORT              restart that node's keeper: it rejoins as secondary (pg_rewind)
#   pause-standby | resume-standby   SIGSTOP / SIGCONT the standby's walreceiver
#   promote-threshold BYTES  lag up to which a standby is still promoted (16 MB; `up` resets)
#   down [--purge]           stop keepers and postgres; --purge also deletes the data
set -euo pipefail

DIR="${SECKILL_PG_HA_DIR:-$HOME/.cache/seckill/pg-ha}"
MON=5440
PORTS=(5441 5442)
PGBIN=/usr/lib/postgresql/15/bin
MON_URI="postgres://autoctl_node@127.0.0.1:$MON/pg_auto_failover?sslmode=disable"
URL="host=127.0.0.1,127.0.0.1 port=${PORTS[0]},${PORTS[1]} user=postgres dbname=seckill target_session_attrs=read-write"

log() { echo "pg-ha: $*" >&2; }
die() { log "$*"; exit 1; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }

# Postgres refuses to run as root: pg_autoctl and initdb run as `postgres`, with the XDG
# directories (pg_autoctl's config, state, pids) in DIR rather than /var/lib/postgresql (the
# system cluster's), and the cwd in DIR (postgres cannot read root's).
as_pg() {
  (cd "$DIR" && runuser -u postgres -- env HOME="$DIR" XDG_CONFIG_HOME="$DIR/xdg/config" \
    XDG_DATA_HOME="$DIR/xdg/data" XDG_RUNTIME_DIR="$DIR/xdg/run" PATH="$PGBIN:$PATH" "$@")
}

q() { # PORT SQL [DB]: one query as root over TCP (trust); empty output when it fails
  timeout 5 psql -X -At -v ON_ERROR_STOP=1 -c "$2" \
    "host=127.0.0.1 port=$1 user=postgres dbname=${3:-postgres} connect_timeout=2 ${QATTR:-}" 2>/dev/null || true
}
mon() { q "$MON" "$1" pg_auto_failover; }
state() { mon "SELECT reportedstate || '/' || goalstate FROM pgautofailover.node WHERE nodeport = $1"; }
# Roles come from the nodes themselves, as a client with the URL sees them.
role() { local p; for p in "${PORTS[@]}"; do [[ "$(q "$p" 'SELECT pg_is_in_recovery()')" == "$1" ]] && { echo "$p"; return; }; done; return 1; }
primary() { role f; }
standby() { role t; }

wait_for() { # SECONDS COND: evaluates COND every 0.2 s; 1 when time runs out
  local end; end=$(($(date +%s) + $1))
  until eval "$2"; do (($(date +%s) < end)) || return 1; sleep 0.2; done
}

# A keeper is alive while the pid we recorded is a pg_autoctl process (not a reused pid).
keeper_pid() { cat "$DIR/run/$1.pid" 2>/dev/null || true; }
keeper_alive() { local pid; pid=$(keeper_pid "$1"); [[ -n "$pid" ]] && grep -q pg_autoctl "/proc/$pid/cmdline" 2>/dev/null; }
# `pg_autoctl ARGS` in its own session (setsid: a test runner's Ctrl-C or process-group kill
# must not take the pair down), nohup, logging to log/NAME.log; the pid recorded is the inner
# shell's $!, not runuser's.
spawn() { # NAME ARGS...
  as_pg sh -c 'log=$1; shift 2; setsid nohup pg_autoctl "$@" >>"$log" 2>&1 </dev/null & echo $!' \
    sh "$DIR/log/$1.log" "$@" >"$DIR/run/$1.pid"
}
# Processes left in a dead keeper's session (its postgres, a "start/stop postgres" helper that
# outlived it) would fight a new keeper for the node: SIGKILL them, a crash postgres recovers
# from. Linux reuses no pid while a session bears it, so a live member is ours.
session() { [[ -z "$1" ]] || ps -eo pid=,sid=,user= | awk -v s="$1" '$2 == s && $3 == "postgres" { print $1 }'; }
reap() { local pids; pids=$(session "$(keeper_pid "$1")"); [[ -z "$pids" ]] || kill -KILL $pids 2>/dev/null || true; }

# pg_autoctl sizes each instance for the whole machine (shared_buffers = RAM/4, wal_keep_size
# 8 GB): initdb here (pg_autoctl adopts it) and override in postgresql.auto.conf, which base
# backups and pg_rewind copy. A standby that lost its primary retries every 5 s and a promote
# request waits out that sleep (seen: +5 s), hence wal_retrieve_retry_interval. initdb goes to
# a side directory, renamed when done: a killed initdb must leave no half cluster to adopt.
small_initdb() { # NAME
  [[ -f "$DIR/$1/PG_VERSION" ]] && return 0
  local tmp="$DIR/$1.initdb"; rm -rf "$tmp"
  as_pg initdb -D "$tmp" -A trust -U postgres -E UTF8 >/dev/null
  printf "shared_buffers = '128MB'\nwal_keep_size = '512MB'\nwal_retrieve_retry_interval = '200ms'\n" \
    | as_pg tee -a "$tmp/postgresql.auto.conf" >/dev/null
  mv "$tmp" "$DIR/$1"
}
# A node whose pg_autoctl config exists was created: it resumes with `run` (which also
# finishes an init cut short). Otherwise `create ... --run` initialises and registers it.
start_node() { # NAME (monitor or a port)
  local n=$1
  keeper_alive "$n" && return 0
  reap "$n"
  if [[ -f "$DIR/xdg/config/pg_autoctl$DIR/$n/pg_autoctl.cfg" ]]; then spawn "$n" run --pgdata "$DIR/$n"
  elif [[ "$n" == monitor ]]; then
    small_initdb monitor  # --listen works though `create monitor --help` omits it (default '*')
    spawn monitor create monitor --pgdata "$DIR/monitor" --pgport "$MON" --pgctl "$PGBIN/pg_ctl" \
      --listen 127.0.0.1 --hostname 127.0.0.1 --auth trust --no-ssl --run
  else
    [[ "$n" == "${PORTS[0]}" ]] && small_initdb "$n"  # the second node is a base backup of it
    spawn "$n" create postgres --pgdata "$DIR/$n" --pgport "$n" --pgctl "$PGBIN/pg_ctl" \
      --listen 127.0.0.1 --hostname 127.0.0.1 --name "node_$n" --username postgres \
      --dbname seckill --monitor "$MON_URI" --auth trust --no-ssl --run
  fi
  log "keeper $n started (pid $(keeper_pid "$n"), log $DIR/log/$n.log)"
}
# Restarts keepers that are not running (one may exit at once while a just-killed
# predecessor's pid still looks alive in its pidfile: it is tried again).
ensure() { local n; for n in "$@"; do keeper_alive "$n" || { start_node "$n"; sleep 1; }; done; }

# postgres must reach DIR, but HOME (/root) is 0700. The narrowest grant is an ACL entry
# giving the postgres user search (x, not read) on each ancestor it cannot traverse yet;
# DIR itself is postgres-owned and 0700 (initdb requires that of data directories).
prepare_dir() {
  command -v setfacl >/dev/null || apt_install acl
  mkdir -p "$DIR"
  local d="" part parts; IFS=/ read -ra parts <<<"$(dirname "$DIR")"
  for part in "${parts[@]:1}"; do
    d="$d/$part"; runuser -u postgres -- test -x "$d" || setfacl -m u:postgres:x "$d"
  done
  chown postgres:postgres "$DIR"; chmod 700 "$DIR"
  install -d -o postgres -g postgres -m 700 "$DIR"/{log,run,xdg,xdg/config,xdg/data,xdg/run}
}

# Failover speed is set on the monitor (SIGHUP GUCs). Defaults (5 s checks, 5 s timeout,
# 2 retries 2 s apart, unhealthy after 20 s without a keeper report, 30 s for the old primary
# to demote) replace a dead primary in ~1 min; these in ~3.5 s. The demote wait covers a
# partitioned primary, whose keeper demotes it only after network_partition_timeout (20 s):
# a test that partitions instead of killing may see two primaries for a while.
tune_monitor() {
  local kv; for kv in health_check_period=500 health_check_timeout=500 health_check_max_retries=1 \
    health_check_retry_delay=200 node_considered_unhealthy_timeout=2000 startup_grace_period=2000 \
    primary_demote_timeout=1000 promote_wal_log_threshold=16777216; do
    mon "ALTER SYSTEM SET pgautofailover.${kv%=*} = ${kv#*=}" >/dev/null  # one per transaction
  done
  mon 'SELECT pg_reload_conf()' >/dev/null
  wait_for 10 '[[ "$(mon "SHOW pgautofailover.primary_demote_timeout")" == 1s ]]' || die "monitor GUCs not set"
}

pair_ready() {
  # pg_autoctl's pg_basebackup waits for a spread checkpoint (~95 s): CHECKPOINT hurries it.
  [[ -z "$(mon "SELECT 1 FROM pgautofailover.node WHERE reportedstate IN ('wait_standby', 'catchingup')")" ]] \
    || q "$(primary || echo 0)" CHECKPOINT >/dev/null
  [[ "$(mon "SELECT string_agg(reportedstate || '/' || goalstate, ' ' ORDER BY reportedstate)
             FROM pgautofailover.node")" == "primary/primary secondary/secondary" ]] \
    && primary >/dev/null && standby >/dev/null  # the monitor's view lags a crash by a second
}

cmd_up() {
  command -v pg_autoctl >/dev/null || apt_install postgresql-15-auto-failover pg-auto-failover-cli
  prepare_dir
  wait_for 60 'ensure monitor; [[ -n "$(mon "SELECT 1 FROM pgautofailover.formation")" ]]' \
    || die "monitor not ready after 60 s (see $DIR/log/monitor.log)"
  tune_monitor
  # The first node registers (and becomes primary) before the second exists.
  wait_for 120 'ensure "${PORTS[0]}"; [[ -n "$(state "${PORTS[0]}")" ]]' || die "node ${PORTS[0]} not registered"
  wait_for 300 'ensure monitor "${PORTS[@]}"; pair_ready' \
    || { cmd_status || true; die "pair not ready after 300 s (logs in $DIR/log)"; }
  local p; p=$(primary) || die "no node accepts writes"
  [[ "$(q "$p" "SELECT 1 FROM pg_database WHERE datname = 'seckill'")" == 1 ]] || q "$p" 'CREATE DATABASE seckill' >/dev/null
  cmd_mode sync >/dev/null
  echo "PG_HA up url='$URL'"
}

# synchronous_standby_names in brackets, so '' (async) differs from "no answer".
ssn() { local p; p=$(primary) && q "$p" "SELECT '[' || current_setting('synchronous_standby_names') || ']'"; }
# replication-quorum is per node: set on both, the mode survives failovers. With
# number_sync_standbys=0 the primary has 'ANY 1 (pgautofailover_standby_N)' while that
# (quorum) standby is healthy, and '' otherwise.
cmd_mode() {
  local want; case "${1:-}" in sync) want=true ;; async) want=false ;; *) die "mode sync|async" ;; esac
  local p; for p in "${PORTS[@]}"; do as_pg pg_autoctl set node replication-quorum "$want" \
    --pgdata "$DIR/$p" >>"$DIR/log/mode.log" 2>&1 || die "see $DIR/log/mode.log"; done
  local v c='[[ "$(ssn)" == "[]" ]]'; [[ $want == false ]] || c='[[ "$(ssn)" == \[?*\] ]]'
  wait_for 60 "$c" || die "synchronous_standby_names is still $(ssn)"
  v=$(ssn); echo "PG_HA mode=$1 synchronous_standby_names='${v:1:-1}'"
}

# The monitor promotes no standby more than promote_wal_log_threshold bytes behind the
# primary's last report: it logs nothing, the dead primary stays assigned "primary". Raising
# it (at once, mid-failover too) promotes the lagging standby, losing the WAL it lacked.
cmd_promote_threshold() {
  local b=${1:?promote-threshold BYTES}; [[ "$b" =~ ^[0-9]+$ ]] || die "BYTES must be an integer"
  mon "ALTER SYSTEM SET pgautofailover.promote_wal_log_threshold = $b" >/dev/null; mon 'SELECT pg_reload_conf()' >/dev/null
  wait_for 10 '[[ "$(mon "SHOW pgautofailover.promote_wal_log_threshold")" == "$b" ]]' || die "not set"
  echo "PG_HA promote_wal_log_threshold=$b"
}

cmd_status() {
  as_pg pg_autoctl show state --pgdata "$DIR/monitor" || true
  local p s; p=$(primary || echo none); s=$(standby || echo none)
  echo "PG_HA primary=$p standby=$s timeline=$(mon "SELECT reportedtli FROM pgautofailover.node WHERE nodeport = '${p/none/0}'")"
}

# SIGKILL the keeper's whole session (supervisor, its helpers, postgres and its backends)
# and the postmaster. Killing only postgres is no failover: the keeper restarts it in place.
cmd_kill_primary() {
  local p pids t w rel=""; p=$(primary) || die "no primary to kill"
  pids="$(session "$(keeper_pid "$p")") $(head -1 "$DIR/$p/postmaster.pid" 2>/dev/null || true)"
  kill -KILL $pids 2>/dev/null || true
  t=$(now); echo "$t" >"$DIR/run/last-kill"
  # A paused (SIGSTOPped) walreceiver would block the promotion forever: the startup process
  # waits for it to exit. End it unread (SIGTERM is pending when SIGCONT resumes it), so the
  # WAL it had not read is lost, as if it never reached the standby.
  w=$(cat "$DIR/run/paused" 2>/dev/null || true)
  if [[ -n "$w" ]] && grep -q walreceiver "/proc/$w/cmdline" 2>/dev/null; then
    kill -TERM "$w"; kill -CONT "$w"; rel=" released_walreceiver=$w"
  fi
  rm -f "$DIR/run/paused"; echo "PG_HA killed port=$p at=$(date -u -d "@$t" +%FT%T.%3NZ) epoch=$t$rel"
}

cmd_wait_promoted() {
  local old=${1:?wait-promoted OLD_PORT [SECONDS]} limit=${2:-60} t0 new since=""; t0=$(now)
  new=${PORTS[0]}; [[ "$old" != "$new" ]] || new=${PORTS[1]}
  # Out of recovery is not enough: pg_auto_failover keeps default_transaction_read_only on
  # until the old primary counts as demoted (wait_primary). So connect as the application
  # does (target_session_attrs=read-write) and commit an xid, as a write would.
  wait_for "$limit" '[[ "$(QATTR=target_session_attrs=read-write q "$new" "SELECT txid_current() > 0")" == t ]]' \
    || die "port $new not promoted after $limit s"
  [[ -f "$DIR/run/last-kill" ]] && since=" since_kill=$(secs "$(cat "$DIR/run/last-kill")" "$(now)")s"
  echo "PG_HA promoted port=$new after=$(secs "$t0" "$(now)")s$since"
}

cmd_rejoin() {
  local p=${1:?rejoin PORT}
  wait_for 180 'ensure "$p"; [[ "$(state "$p")" == secondary/secondary ]]' \
    || die "port $p is not secondary after 180 s ($(state "$p"))"
  echo "PG_HA rejoined port=$p state=secondary"
}

# SIGSTOP the standby's walreceiver: it stays (nothing looks wrong to the startup process or
# keeper) but reads no WAL: pg_last_wal_receive_lsn() stands still while the primary writes.
# In sync mode every commit then blocks until resume-standby, as the monitor keeps the still
# "healthy" standby in the quorum, even after wal_sender_timeout (seen: blocked 70 s).
cmd_pause_standby() {
  local s pm w; s=$(standby) || die "no standby"; pm=$(head -1 "$DIR/$s/postmaster.pid")
  w=$(ps --ppid "$pm" -o pid=,args= | awk '/walreceiver/ { print $1; exit }')
  [[ -n "$w" ]] || die "standby $s has no walreceiver"; kill -STOP "$w"; echo "$w" >"$DIR/run/paused"
  echo "PG_HA paused standby=$s walreceiver=$w lsn=$(q "$s" 'SELECT pg_last_wal_receive_lsn()')"
}
cmd_resume_standby() {
  local w; w=$(cat "$DIR/run/paused" 2>/dev/null || true)
  [[ -n "$w" ]] && grep -q walreceiver "/proc/$w/cmdline" 2>/dev/null && kill -CONT "$w"
  rm -f "$DIR/run/paused"; echo "PG_HA resumed walreceiver=${w:-none}"
}

# Monitor first, so it orchestrates no failover while the nodes go down; then each keeper
# (SIGTERM: it stops its postgres, fast); then whatever is left of its session.
cmd_down() {
  [[ -d "$DIR/run" ]] && cmd_resume_standby >/dev/null
  local n pid; for n in monitor "${PORTS[@]}"; do
    if keeper_alive "$n"; then
      pid=$(keeper_pid "$n"); kill -TERM "$pid"; wait_for 60 '[[ ! -e /proc/$pid ]]' || true
    fi
    reap "$n"; rm -f "$DIR/run/$n.pid"
  done
  if [[ "${1:-}" == --purge ]]; then rm -rf "$DIR"; echo "PG_HA down purged=$DIR"; else echo "PG_HA down"; fi
}

case "${1:-}" in
  up | status | kill-primary | pause-standby | resume-standby) "cmd_${1//-/_}" ;;
  mode | wait-promoted | rejoin | down | promote-threshold) c="cmd_${1//-/_}"; shift; "$c" "$@" ;;
  *) awk 'NR > 1 && /^set -e/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 2 ;;
esac
