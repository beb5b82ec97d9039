#!/usr/bin/env bash
# Starts a local Redis Cluster for `redis.mode = "cluster"`: six `redis-server` nodes on
# loopback (3 primaries, 3 replicas), AOF with `appendfsync everysec`, data and logs under
# SECKILL_REDIS_CLUSTER_DIR. Idempotent: nodes already answering are left alone, and a cluster
# already formed is not formed again. Prints the seed list for SECKILL__REDIS__CLUSTER_NODES.
#
# `--node PORT` starts that one node only (if it is down) and returns once it answers, without
# waiting for the cluster's state: a fault test brings a node back on its own.
#
# Environment: SECKILL_REDIS_CLUSTER_DIR (~/.cache/seckill/redis-cluster),
# SECKILL_REDIS_CLUSTER_PORT (7001: nodes on that port and the five after it).
set -euo pipefail

DIR="${SECKILL_REDIS_CLUSTER_DIR:-$HOME/.cache/seckill/redis-cluster}"
BASE="${SECKILL_REDIS_CLUSTER_PORT:-7001}"
PORTS=()
for i in 0 1 2 3 4 5; do PORTS+=("$((BASE + i))"); done
ONLY=""
if [[ "${1:-}" == "--node" ]]; then
  ONLY="${2:?--node needs a port}"
  PORTS=("$ONLY")
fi

log() { echo "redis-cluster-up: $*"; }

if ! command -v redis-server >/dev/null 2>&1; then
  log "installing Redis (apt)"
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null
fi

# A node answers once PING gets PONG: while it loads its AOF it replies LOADING (and
# redis-cli still exits 0), and every CLUSTER command fails until the load ends.
answers() { [[ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null | tr -d '\r')" == PONG ]]; }

running() { redis-cli -h 127.0.0.1 -p "$1" ping >/dev/null 2>&1; }

for port in "${PORTS[@]}"; do
  if running "$port"; then
    continue
  fi
  mkdir -p "$DIR/$port"
  # The node's own cluster state lives in nodes.conf beside its AOF: a restarted node
  # rejoins the cluster it belonged to.
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" \
    --cluster-enabled yes --cluster-config-file "$DIR/$port/nodes.conf" \
    --cluster-node-timeout 2000 --cluster-announce-ip 127.0.0.1 \
    --appendonly yes --appendfsync everysec --save "" \
    --dir "$DIR/$port" --pidfile "$DIR/$port/redis.pid" --logfile "$DIR/$port/redis.log"
  log "node $port started"
done
# Nodes restarted over an existing AOF load it first: wait for every one (bounded).
for port in "${PORTS[@]}"; do
  for _ in $(seq 1 600); do
    answers "$port" && break
    sleep 0.1
  done
  answers "$port" || { log "node $port is not ready after 60 s (see $DIR/$port/redis.log)"; exit 1; }
done

[[ -n "$ONLY" ]] && exit 0

state() { redis-cli -h 127.0.0.1 -p "$BASE" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_state://p'; }
known() { redis-cli -h 127.0.0.1 -p "$BASE" cluster info 2>/dev/null | tr -d '\r' | sed -n 's/^cluster_known_nodes://p'; }

if [[ "$(known)" != 6 ]]; then
  # A node left half-joined (its nodes.conf lost, or a create that stopped midway) holds
  # state `--cluster create` refuses ("not empty"): this cluster is scratch, start it clean.
  for port in "${PORTS[@]}"; do
    redis-cli -h 127.0.0.1 -p "$port" flushall >/dev/null 2>&1 || true
    redis-cli -h 127.0.0.1 -p "$port" cluster reset hard >/dev/null 2>&1 || true
  done
  log "forming the cluster (3 primaries, 3 replicas)"
  addrs=()
  for port in "${PORTS[@]}"; do addrs+=("127.0.0.1:$port"); done
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$DIR/create.log" 2>&1 || {
    log "forming failed:"; cat "$DIR/create.log"; exit 1
  }
fi
for _ in $(seq 1 300); do
  [[ "$(state)" == ok ]] && break
  sleep 0.1
done
[[ "$(state)" == ok ]] || { log "cluster state is '$(state)', not ok"; exit 1; }
seeds="$(printf '127.0.0.1:%s,' "${PORTS[@]:0:3}")"
log "cluster ok; seeds ${seeds%,}"
