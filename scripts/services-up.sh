#!/usr/bin/env bash
# Makes sure PostgreSQL, Redis, the Redis Cluster of scripts/redis-cluster-up.sh and RocketMQ
# (name server + broker) answer on loopback.
# Idempotent: a service that already answers is left alone. No Docker.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() { printf '[services] %s\n' "$*"; }

# Debian packages: refresh the package lists once before the first install (a machine that
# never ran `apt-get update` has none, and every install fails).
apt_updated=0
apt_install() {
  if [[ "$apt_updated" == 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
}

wait_for() { # name, seconds, command...
  local name="$1" secs="$2"; shift 2
  for _ in $(seq 1 $((secs * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  log "$name did not become ready within ${secs}s"; return 1
}

# --- PostgreSQL ----------------------------------------------------------------
if ! command -v pg_isready >/dev/null 2>&1; then
  log "installing PostgreSQL (apt)"
  apt_install postgresql postgresql-client
fi
if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  log "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start || true
  wait_for PostgreSQL 30 pg_isready -h 127.0.0.1 -p 5432 -q
fi
log "PostgreSQL ready on 127.0.0.1:5432"

# --- Redis -----------------------------------------------------------------------
if ! command -v redis-server >/dev/null 2>&1; then
  log "installing Redis (apt)"
  apt_install redis-server
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  log "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  wait_for Redis 15 redis-cli -h 127.0.0.1 -p 6379 ping
fi
log "Redis ready on 127.0.0.1:6379"

# --- HAProxy (the balancer of tests/it/rolling_restart.rs; deploy/haproxy) -------------------
if ! command -v haproxy >/dev/null 2>&1; then
  log "installing HAProxy (apt)"
  apt_install haproxy
fi

# --- PgBouncer (in front of PostgreSQL in tests/it/pgbouncer.rs; deploy/pgbouncer) ------------
# Installed only: each test starts its own from the shipped configuration.
if ! command -v pgbouncer >/dev/null 2>&1; then
  log "installing PgBouncer (apt)"
  apt_install pgbouncer
fi

# --- wrk (the front door's ceilings in make bench: bench/src/run/ceilings.rs) -----------------
if ! command -v wrk >/dev/null 2>&1; then
  log "installing wrk (apt)"
  apt_install wrk
fi

# --- Redis Cluster (redis.mode = "cluster"; its tests) ------------------------------
"$here/redis-cluster-up.sh"

# --- RocketMQ --------------------------------------------------------------------
"$here/rocketmq-up.sh"
