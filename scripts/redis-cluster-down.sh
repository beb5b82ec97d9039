#!/usr/bin/env bash
# Stops the nodes scripts/redis-cluster-up.sh started (SHUTDOWN NOSAVE, then the pid file's
# process). Idempotent. `--purge` also removes their data, so the next `up` forms a new,
# empty cluster.
#
# Environment: as scripts/redis-cluster-up.sh.
set -euo pipefail

DIR="${SECKILL_REDIS_CLUSTER_DIR:-$HOME/.cache/seckill/redis-cluster}"
BASE="${SECKILL_REDIS_CLUSTER_PORT:-7001}"

for i in 0 1 2 3 4 5; do
  port=$((BASE + i))
  redis-cli -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 || true
  pidfile="$DIR/$port/redis.pid"
  if [[ -f "$pidfile" ]]; then
    pid="$(cat "$pidfile")"
    if [[ "$pid" =~ ^[0-9]+$ ]] && grep -q redis-server "/proc/$pid/cmdline" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
  fi
done
echo "redis-cluster-down: nodes ${BASE}..$((BASE + 5)) stopped"
if [[ "${1:-}" == --purge ]]; then
  rm -rf "$DIR"
  echo "redis-cluster-down: removed $DIR"
fi
