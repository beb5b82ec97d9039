#!/usr/bin/env bash
# A broker whose disk can be filled on purpose, for the full-disk drill
# (tests/it/broker_disk.rs, docs/RUNBOOK.md#alert-seckillbrokerdiskfull).
#
#   scripts/broker-drill.sh up [MIB]   a third master, seckill-broker-drill, on 127.0.0.1:10941
#                                      (HA 10942, health 19941), registered with the running name
#                                      server, its whole store on a tmpfs of MIB MiB (256) of its
#                                      own: a mount namespace, so the mount goes with the process
#   scripts/broker-drill.sh fill PCT   fills that disk to PCT % (a file beside the store)
#   scripts/broker-drill.sh free       removes the filler
#   scripts/broker-drill.sh down       stops the broker; its store (the tmpfs) is gone with it
#
# The broker checks its disk every second here (cleanResourceInterval, 10 s by default) and
# refuses every write from 90 % used (diskSpaceWarningLevelRatio). The name server
# (scripts/rocketmq-up.sh) must be running. Nothing is left on the host's disk but the config,
# the log and the pid file under ~/.cache/seckill/run.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${SECKILL_TOOLS_DIR:-$HOME/.cache/seckill/rocketmq-${ROCKETMQ_VERSION:-1.0.0}}"
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
DATA_DIR="${SECKILL_MQ_DATA_DIR:-$HOME/.cache/seckill/rocketmq-data}"
STORE="$RUN_DIR/drill-store"
PIDFILE="$RUN_DIR/broker-drill.pid"
LOGFILE="$RUN_DIR/logs/broker-drill.log"
CONF="$RUN_DIR/conf/broker-drill.toml"
PORT=10941
HEALTH="127.0.0.1:19941"
NAMESRV="${SECKILL_MQ_NAMESRV:-127.0.0.1:9876}"

log() { echo "broker-drill: $*"; }
die() {
  echo "broker-drill: ERROR: $*" >&2
  exit 1
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
ready() {
  [[ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://$HEALTH/readyz" || true)" == 200 ]] &&
    port_open "$PORT"
}
pid() {
  [[ -f "$PIDFILE" ]] || return 1
  local p
  p="$(cat "$PIDFILE")"
  [[ "$p" =~ ^[0-9]+$ ]] && kill -0 "$p" 2>/dev/null && echo "$p"
}
# The store as the broker sees it: its mount namespace, through /proc.
store_view() {
  local p
  p="$(pid)" || die "the drill broker is not running (scripts/broker-drill.sh up)"
  echo "/proc/$p/root$STORE"
}

# The binary the shared broker runs (scripts/rocketmq-up.sh), else the first one installed.
broker_bin() {
  local exe dir
  if [[ -f "$RUN_DIR/broker.pid" ]]; then
    exe="$(readlink "/proc/$(cat "$RUN_DIR/broker.pid")/exe" 2>/dev/null || true)"
    exe="${exe% (deleted)}"
    [[ -x "$exe" ]] && echo "$exe" && return 0
  fi
  for dir in "$TOOLS_DIR/debug/bin" "$TOOLS_DIR/release/bin" "$TOOLS_DIR/bin"; do
    [[ -x "$dir/rocketmq-broker-rust" ]] && echo "$dir/rocketmq-broker-rust" && return 0
  done
  return 1
}

up() {
  local mib="${1:-256}" bin
  bin="$(broker_bin)" || die "no broker binary (scripts/rocketmq-up.sh installs it)"
  port_open 9876 || die "no name server on $NAMESRV (scripts/rocketmq-up.sh)"
  if pid >/dev/null && ready; then
    log "already ready on 127.0.0.1:$PORT"
    return 0
  fi
  down
  mkdir -p "$RUN_DIR/conf" "$RUN_DIR/logs" "$STORE"
  # The shipped template, renamed and moved, its disk checked every second, its commit log in
  # 16 MiB files (the broker refuses to start on a disk that cannot hold one 1 GiB file).
  sed -e "s|@DATA_DIR@/store|$STORE|g" -e "s|@DATA_DIR@|$RUN_DIR/drill-data|g" \
    -e "s|@FLUSH_DISK_TYPE@|ASYNC_FLUSH|g" -e "s|@BROKER_ROLE@|ASYNC_MASTER|g" \
    -e "s|@NAMESRV_ADDRS@|$NAMESRV|g" \
    -e "s|^listenPort = 10911|listenPort = $PORT|" \
    -e 's|^brokerName = "seckill-broker-a"|brokerName = "seckill-broker-drill"|' \
    -e 's|^haListenPort = 10912|haListenPort = 10942|' \
    -e 's|^\[store\]|[store]\ncleanResourceInterval = 1000\nmappedFileSizeCommitLog = 16777216|' \
    "$REPO_DIR/config/rocketmq/broker.toml" >"$CONF"
  log "starting seckill-broker-drill on a ${mib} MiB tmpfs (log $LOGFILE)"
  # setsid: it outlives this script; the child writes its own pid, then becomes the broker
  # inside a user and mount namespace where the tmpfs is mounted over the store.
  setsid bash -c 'echo $$ > "$0"; exec unshare --user --map-root-user --mount bash -c "$1"' \
    "$PIDFILE" "mount -t tmpfs -o size=${mib}m,mode=0700 drill '$STORE' && cd '$RUN_DIR' &&
      exec env ROCKETMQ_HEALTH_BIND_ADDR=$HEALTH ROCKETMQ_HOME='$DATA_DIR/home' \
        ROCKETMQ_SECURITY_PROFILE=development-insecure-loopback '$bin' -c '$CONF' -n '$NAMESRV' --log-filter warn" \
    >>"$LOGFILE" 2>&1 </dev/null &
  for _ in $(seq 150); do
    ready && {
      log "ready (pid $(cat "$PIDFILE"))"
      return 0
    }
    pid >/dev/null || {
      tail -20 "$LOGFILE" >&2
      die "the drill broker exited during start-up"
    }
    sleep 0.2
  done
  tail -20 "$LOGFILE" >&2
  die "the drill broker is not ready after 30 s"
}

# "used% of size" of the drill disk. statfs on the path itself: df would look the path up in
# this shell's mount table, where the tmpfs does not exist.
usage() {
  stat -f -c '%b %f %S' "$1" | awk '{ printf "%.1f%% of %d MiB\n", 100 * ($1 - $2) / $1, $1 * $3 / 1048576 }'
}

fill() {
  local pct="$1" view blocks free bsize want
  view="$(store_view)"
  read -r blocks free bsize < <(stat -f -c '%b %f %S' "$view")
  want=$(((blocks * pct / 100 - (blocks - free)) * bsize))
  ((want > 0)) || {
    log "already at or above $pct %"
    return 0
  }
  fallocate -l "$want" "$view/filler"
  log "filled: $(usage "$view")"
}

free_disk() {
  local view
  view="$(store_view)"
  rm -f "$view/filler"
  log "freed: $(usage "$view")"
}

down() {
  local p
  if p="$(pid)"; then
    log "stopping pid $p"
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$p" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$p" 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
}

case "${1:-}" in
  up) up "${2:-256}" ;;
  fill) fill "${2:?PCT}" ;;
  free) free_disk ;;
  down) down ;;
  *)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
