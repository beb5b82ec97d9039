#!/usr/bin/env bash
# Stops the local RocketMQ started by scripts/rocketmq-up.sh, broker first, by pid file:
# SIGTERM, then SIGKILL after a bound. Idempotent: missing or stale pid files are fine.
# Data (store, offsets) stays in SECKILL_MQ_DATA_DIR.
#
# `--broker-only` leaves the name server running (to restart the broker with another profile).
# `--second-broker` stops only the second master (SECKILL_MQ_BROKERS=2) and removes its store.
#
# Environment: SECKILL_RUN_DIR (~/.cache/seckill/run), SECKILL_MQ_STOP_TIMEOUT (15 s).
set -euo pipefail

RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
STOP_TIMEOUT="${SECKILL_MQ_STOP_TIMEOUT:-15}"
DATA_DIR="${SECKILL_MQ_DATA_DIR:-$HOME/.cache/seckill/rocketmq-data}"

log() { echo "rocketmq-down: $*"; }

stop() {
  local what="$1" pidfile="$2" name="$3" pid
  if [[ ! -f "$pidfile" ]]; then
    log "$what: no pid file, nothing to stop"
    return 0
  fi
  pid="$(cat "$pidfile")"
  # Only signal the process we started: a stale file may name a reused pid.
  if [[ ! "$pid" =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null ||
    ! grep -q "$name" "/proc/$pid/cmdline" 2>/dev/null; then
    log "$what: not running (stale pid file)"
    rm -f "$pidfile"
    return 0
  fi
  # A SIGSTOPped process would never act on SIGTERM.
  kill -CONT "$pid" 2>/dev/null || true
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + STOP_TIMEOUT))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      log "$what (pid $pid) still running after ${STOP_TIMEOUT}s; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
      break
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
  log "$what stopped (pid $pid)"
}

if [[ "${1:-}" == --second-broker ]]; then
  stop "broker b" "$RUN_DIR/broker-b.pid" rocketmq-broker-rust
  rm -rf "$DATA_DIR/store-b"
  exit 0
fi
# The replicated profile's slave first: it follows its master.
stop "broker slave" "$RUN_DIR/broker-slave.pid" rocketmq-broker-rust
stop "broker b" "$RUN_DIR/broker-b.pid" rocketmq-broker-rust
stop broker "$RUN_DIR/broker.pid" rocketmq-broker-rust
if [[ "${1:-}" != --broker-only ]]; then
  stop "name server" "$RUN_DIR/namesrv.pid" rocketmq-namesrv-rust
  stop "name server b" "$RUN_DIR/namesrv-b.pid" rocketmq-namesrv-rust
fi
