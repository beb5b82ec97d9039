#!/usr/bin/env bash
# Starts a local RocketMQ (name server 127.0.0.1:9876, broker 127.0.0.1:10911) in the
# background and waits until both are ready. Idempotent: whatever already answers is left
# alone. Installs the binaries first if they are missing (~15 min, once).
#
# Environment (all optional):
#   SECKILL_RUN_DIR        pid files, logs, rendered configs   (~/.cache/seckill/run)
#   SECKILL_MQ_DATA_DIR    broker store, name server kv data   (~/.cache/seckill/rocketmq-data)
#   SECKILL_TOOLS_DIR      install dir of the binaries         (~/.cache/seckill/rocketmq-1.0.0)
#   SECKILL_MQ_BUILD       which build of the servers runs     (any)
#                             any: whichever is installed, debug first, then release (then an
#                             install from before the per-build layout, <tools>/bin); none: the
#                             debug one is built. A broker already running is kept.
#                             debug: the demo's and the tests' (dependencies at opt-level 1);
#                             release: what the benchmarks measure (scripts/install-rocketmq.sh).
#                             With debug or release, a broker of ours running the other build is
#                             restarted with this one; the name server, which carries no load, is
#                             left alone.
#   SECKILL_MQ_LOG_FILTER  log filter for both servers         (warn)
#   SECKILL_MQ_NAMESRV_HEALTH_PORT / SECKILL_MQ_BROKER_HEALTH_PORT   (19876 / 19911; the
#                             second name server's health port is 19877)
#   SECKILL_MQ_START_TIMEOUT  seconds to wait for readiness    (120: a broker recovers its
#                             store first, which took over 30 s after a 7 GB soak)
#   SECKILL_MQ_PROFILE     the broker's durability profile     (development)
#                             development: ASYNC_FLUSH, a lone ASYNC_MASTER (the fastest);
#                             production:  SYNC_FLUSH, so a confirmed send is on disk before the
#                             answer;
#                             replicated:  SYNC_FLUSH and SYNC_MASTER, with a slave of the same
#                             binary (127.0.0.1:10931, HA 10932, health 19931, store
#                             <data>/store-slave): a confirmed send is on both stores.
#                             Costs measured in BENCHMARKS.md. A broker already running keeps its
#                             profile: stop it first (scripts/rocketmq-down.sh) to change it.
#   SECKILL_MQ_NAMESRVS    name servers                        (1)
#                             2: a second one on 127.0.0.1:9877 (health 19877), the brokers
#                             registered with both (a broker running with another list is
#                             restarted). Back to 1 restarts them registered with the first only:
#                             with thousands of test topics, a broker registering with two at
#                             start-up was seen to fail (transport.admission.queue_saturated).
#   SECKILL_MQ_BROKERS     masters in the cluster              (1)
#                             2: a second master, seckill-broker-b, on 127.0.0.1:10921 (HA 10922,
#                             health 19921, store <data>/store-b), same cluster and name server,
#                             same profile. Topics go on both with
#                             SECKILL__MQ__BROKER_ADDR=127.0.0.1:10911,127.0.0.1:10921.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROCKETMQ_VERSION="${ROCKETMQ_VERSION:-1.0.0}"
TOOLS_DIR="${SECKILL_TOOLS_DIR:-$HOME/.cache/seckill/rocketmq-$ROCKETMQ_VERSION}"
RUN_DIR="${SECKILL_RUN_DIR:-$HOME/.cache/seckill/run}"
DATA_DIR="${SECKILL_MQ_DATA_DIR:-$HOME/.cache/seckill/rocketmq-data}"
LOG_FILTER="${SECKILL_MQ_LOG_FILTER:-warn}"
NAMESRV_PORT=9876
# The second name server (SECKILL_MQ_NAMESRVS=2): the cluster's routes are on both, and every
# client and broker is given both (`mq.name_server = "127.0.0.1:9876;127.0.0.1:9877"`).
NAMESRVS="${SECKILL_MQ_NAMESRVS:-1}"
[[ "$NAMESRVS" == 1 || "$NAMESRVS" == 2 ]] || {
  echo "rocketmq-up: ERROR: SECKILL_MQ_NAMESRVS must be 1 or 2, not '$NAMESRVS'" >&2
  exit 2
}
NAMESRV_B_PORT=9877
NAMESRV_B_HEALTH="127.0.0.1:19877"
NAMESRV_ADDRS="127.0.0.1:$NAMESRV_PORT"
[[ "$NAMESRVS" == 2 ]] && NAMESRV_ADDRS="$NAMESRV_ADDRS;127.0.0.1:$NAMESRV_B_PORT"
BROKER_PORT=10911
NAMESRV_HEALTH="127.0.0.1:${SECKILL_MQ_NAMESRV_HEALTH_PORT:-19876}"
BROKER_HEALTH="127.0.0.1:${SECKILL_MQ_BROKER_HEALTH_PORT:-19911}"
START_TIMEOUT="${SECKILL_MQ_START_TIMEOUT:-120}"

BUILD="${SECKILL_MQ_BUILD:-any}"
installed() { [[ -x "$1/rocketmq-namesrv-rust" && -x "$1/rocketmq-broker-rust" ]]; }
case "$BUILD" in
  any)
    INSTALL_BUILD=debug
    BIN_DIR="$TOOLS_DIR/debug/bin"
    for dir in "$TOOLS_DIR/debug/bin" "$TOOLS_DIR/release/bin" "$TOOLS_DIR/bin"; do
      if installed "$dir"; then BIN_DIR="$dir"; break; fi
    done
    ;;
  debug | release)
    INSTALL_BUILD="$BUILD"
    BIN_DIR="$TOOLS_DIR/$BUILD/bin"
    ;;
  *)
    echo "rocketmq-up: ERROR: SECKILL_MQ_BUILD must be any, debug or release, not '$BUILD'" >&2
    exit 2
    ;;
esac
NAMESRV_BIN="$BIN_DIR/rocketmq-namesrv-rust"
BROKER_BIN="$BIN_DIR/rocketmq-broker-rust"

log() { echo "rocketmq-up: $*"; }

# Each start writes this marker into the server's log; an error shows the lines after it.
MARKER="==== rocketmq-up start $$"

# How one server is started, checked and stopped.
# shellcheck source=scripts/rocketmq-lib.sh
source "$REPO_DIR/scripts/rocketmq-lib.sh"

broker_ready() { ready_at "$BROKER_HEALTH" "$BROKER_PORT"; }

PROFILE="${SECKILL_MQ_PROFILE:-development}"
case "$PROFILE" in
  development) FLUSH_DISK_TYPE=ASYNC_FLUSH BROKER_ROLE=ASYNC_MASTER ;;
  production) FLUSH_DISK_TYPE=SYNC_FLUSH BROKER_ROLE=ASYNC_MASTER ;;
  replicated) FLUSH_DISK_TYPE=SYNC_FLUSH BROKER_ROLE=SYNC_MASTER ;;
  *)
    echo "rocketmq-up: ERROR: SECKILL_MQ_PROFILE must be development, production or replicated, not '$PROFILE'" >&2
    exit 2
    ;;
esac
SLAVE_PORT=10931
SLAVE_HEALTH="127.0.0.1:19931"
BROKERS="${SECKILL_MQ_BROKERS:-1}"
[[ "$BROKERS" == 1 || "$BROKERS" == 2 ]] || {
  echo "rocketmq-up: ERROR: SECKILL_MQ_BROKERS must be 1 or 2, not '$BROKERS'" >&2
  exit 2
}
B_PORT=10921
B_HEALTH="127.0.0.1:19921"

render() {
  # Fills the data directory, the profile and the name servers into a config template; '|'
  # cannot occur in a path we build.
  sed -e "s|@DATA_DIR@|$DATA_DIR|g" -e "s|@FLUSH_DISK_TYPE@|$FLUSH_DISK_TYPE|g" \
    -e "s|@BROKER_ROLE@|$BROKER_ROLE|g" -e "s|@NAMESRV_ADDRS@|$NAMESRV_ADDRS|g" "$1" >"$2"
}

# The second name server's config: its own kv store.
render_namesrv_b() {
  sed -e "s|@DATA_DIR@/namesrv|$DATA_DIR/namesrv-b|g" -e "s|@DATA_DIR@|$DATA_DIR|g" "$1" >"$2"
}

# The replicated profile's slave: the same template, brokerId 1, role SLAVE (in both sections:
# the broker only starts its replica manager when its own config says so), its own ports and
# store, and the master's HA address (learning it from the name server does not connect).
render_slave() {
  sed -e "s|@DATA_DIR@/store|$DATA_DIR/store-slave|g" -e "s|@DATA_DIR@|$DATA_DIR|g" \
    -e "s|@FLUSH_DISK_TYPE@|$FLUSH_DISK_TYPE|g" -e "s|@BROKER_ROLE@|SLAVE|g" \
    -e "s|@NAMESRV_ADDRS@|$NAMESRV_ADDRS|g" \
    -e "s|^listenPort = $BROKER_PORT|listenPort = $SLAVE_PORT|" \
    -e 's|^brokerId = 0|brokerId = 1|' \
    -e 's|^haListenPort = 10912|haListenPort = 10932\nhaMasterAddress = "127.0.0.1:10912"|' \
    "$1" >"$2"
}

# The second master: the same template under another name, with its own ports and store.
render_b() {
  sed -e "s|@DATA_DIR@/store|$DATA_DIR/store-b|g" -e "s|@DATA_DIR@|$DATA_DIR|g" \
    -e "s|@FLUSH_DISK_TYPE@|$FLUSH_DISK_TYPE|g" -e "s|@BROKER_ROLE@|$BROKER_ROLE|g" \
    -e "s|@NAMESRV_ADDRS@|$NAMESRV_ADDRS|g" \
    -e "s|^listenPort = $BROKER_PORT|listenPort = $B_PORT|" \
    -e 's|^brokerName = "seckill-broker-a"|brokerName = "seckill-broker-b"|' \
    -e 's|^haListenPort = 10912|haListenPort = 10922|' \
    "$1" >"$2"
}

# start_companion NAME FILE PORT HEALTH RENDER: another broker from the same binary beside the
# first (the replicated profile's slave, the second master), unless it is ready already. FILE
# names its pid file, log and config (broker-slave -> store-slave, broker-b -> store-b).
start_companion() {
  local name="$1" file="$2" port="$3" health="$4" render_fn="$5"
  local store="$DATA_DIR/store-${file#broker-}"
  if runs_other_bin "$RUN_DIR/$file.pid" "$BROKER_BIN"; then
    log "$name runs the other build of the broker; restarting it with $BROKER_BIN"
    stop_stale "$RUN_DIR/$file.pid" rocketmq-broker-rust
    for _ in $(seq 50); do port_open "$port" || break; sleep 0.2; done
  fi
  if ready_at "$health" "$port"; then
    log "$name already ready on 127.0.0.1:$port"
    return 0
  fi
  stop_stale "$RUN_DIR/$file.pid" rocketmq-broker-rust
  mkdir -p "$store"
  "$render_fn" "$REPO_DIR/config/rocketmq/broker.toml" "$RUN_DIR/conf/$file.toml"
  log "starting $name (log $RUN_DIR/logs/$file.log, store $store)"
  start_detached "$RUN_DIR/$file.pid" "$RUN_DIR/logs/$file.log" \
    env ROCKETMQ_HEALTH_BIND_ADDR="$health" "$BROKER_BIN" \
    -c "$RUN_DIR/conf/$file.toml" -n "$NAMESRV_ADDRS" \
    --log-filter "$LOG_FILTER"
  wait_until "$name" "$RUN_DIR/logs/$file.log" "$RUN_DIR/$file.pid" rocketmq-broker-rust \
    ready_at "$health" "$port"
  log "$name ready (pid $(cat "$RUN_DIR/$file.pid"), health http://$health/readyz)"
}

if [[ ! -x "$NAMESRV_BIN" || ! -x "$BROKER_BIN" ]]; then
  log "binaries missing in $BIN_DIR; installing"
  SECKILL_TOOLS_DIR="$TOOLS_DIR" SECKILL_MQ_BUILD="$INSTALL_BUILD" "$REPO_DIR/scripts/install-rocketmq.sh"
fi

mkdir -p "$RUN_DIR/logs" "$RUN_DIR/conf" "$DATA_DIR/home" "$DATA_DIR/namesrv" "$DATA_DIR/namesrv-b" \
  "$DATA_DIR/store"
# One caller at a time: two concurrent runs must not both start a server.
exec 9>"$RUN_DIR/.rocketmq-up.lock"
flock 9

export ROCKETMQ_HOME="$DATA_DIR/home"
export ROCKETMQ_SECURITY_PROFILE=development-insecure-loopback

# ---- name servers ----
# start_namesrv NAME FILE PORT HEALTH RENDER: one name server, unless it answers already.
start_namesrv() {
  local name="$1" file="$2" port="$3" health="$4" render_fn="$5"
  if port_open "$port"; then
    log "$name already answers on 127.0.0.1:$port"
    return 0
  fi
  stop_stale "$RUN_DIR/$file.pid" rocketmq-namesrv-rust
  "$render_fn" "$REPO_DIR/config/rocketmq/namesrv.toml" "$RUN_DIR/conf/$file.toml"
  log "starting $name (log $RUN_DIR/logs/$file.log)"
  start_detached "$RUN_DIR/$file.pid" "$RUN_DIR/logs/$file.log" \
    env ROCKETMQ_HEALTH_BIND_ADDR="$health" "$NAMESRV_BIN" \
    -c "$RUN_DIR/conf/$file.toml" --bindAddress 127.0.0.1 --listenPort "$port" \
    --log-filter "$LOG_FILTER"
  wait_until "$name" "$RUN_DIR/logs/$file.log" "$RUN_DIR/$file.pid" rocketmq-namesrv-rust \
    port_open "$port"
  log "$name ready (pid $(cat "$RUN_DIR/$file.pid"))"
}
start_namesrv "name server" namesrv "$NAMESRV_PORT" "$NAMESRV_HEALTH" render
if [[ "$NAMESRVS" == 2 ]]; then
  start_namesrv "name server b" namesrv-b "$NAMESRV_B_PORT" "$NAMESRV_B_HEALTH" render_namesrv_b
fi

# ---- broker ----
# The benchmarks ask for the release build, and get it.
if runs_other_bin "$RUN_DIR/broker.pid" "$BROKER_BIN"; then
  log "broker (pid $(cat "$RUN_DIR/broker.pid")) runs the other build; restarting it with $BROKER_BIN"
  stop_stale "$RUN_DIR/broker.pid" rocketmq-broker-rust
  for _ in $(seq 50); do port_open "$BROKER_PORT" || break; sleep 0.2; done
fi
# A broker of ours started from an older config/rocketmq/broker.toml (same profile: the same
# flushDiskType and brokerRole) is restarted with the current one, so a changed key (the
# transaction check timing, say) takes effect; one started with another profile is left alone.
if broker_ready && pid_alive "$RUN_DIR/broker.pid" rocketmq-broker-rust && [[ -f "$RUN_DIR/conf/broker.toml" ]]; then
  render "$REPO_DIR/config/rocketmq/broker.toml" "$RUN_DIR/conf/broker.toml.next"
  profile_lines() { grep -E '^(flushDiskType|brokerRole) ' "$1" | sort; }
  if ! cmp -s "$RUN_DIR/conf/broker.toml.next" "$RUN_DIR/conf/broker.toml" &&
    [[ "$(profile_lines "$RUN_DIR/conf/broker.toml.next")" == "$(profile_lines "$RUN_DIR/conf/broker.toml")" ]]; then
    log "broker (pid $(cat "$RUN_DIR/broker.pid")) runs an older config/rocketmq/broker.toml; restarting it"
    stop_stale "$RUN_DIR/broker.pid" rocketmq-broker-rust
    for _ in $(seq 50); do port_open "$BROKER_PORT" || break; sleep 0.2; done
  fi
  rm -f "$RUN_DIR/conf/broker.toml.next"
fi
if broker_ready; then
  log "broker already ready on 127.0.0.1:$BROKER_PORT"
else
  if pid_alive "$RUN_DIR/broker.pid" rocketmq-broker-rust; then
    # Ours, alive, not ready yet: it is starting (recovering its store can take a while).
    log "broker (pid $(cat "$RUN_DIR/broker.pid")) is starting; waiting"
    wait_until "broker" "$RUN_DIR/logs/broker.log" "$RUN_DIR/broker.pid" rocketmq-broker-rust broker_ready
    log "broker ready"
  elif port_open "$BROKER_PORT"; then
    die "port $BROKER_PORT is in use by another process, and http://$BROKER_HEALTH/readyz does not answer 200" \
      "$RUN_DIR/logs/broker.log"
  else
    render "$REPO_DIR/config/rocketmq/broker.toml" "$RUN_DIR/conf/broker.toml"
    log "starting broker, $PROFILE profile ($FLUSH_DISK_TYPE; log $RUN_DIR/logs/broker.log, store $DATA_DIR/store)"
    start_detached "$RUN_DIR/broker.pid" "$RUN_DIR/logs/broker.log" \
      env ROCKETMQ_HEALTH_BIND_ADDR="$BROKER_HEALTH" "$BROKER_BIN" \
      -c "$RUN_DIR/conf/broker.toml" -n "$NAMESRV_ADDRS" \
      --log-filter "$LOG_FILTER"
    wait_until "broker" "$RUN_DIR/logs/broker.log" "$RUN_DIR/broker.pid" rocketmq-broker-rust broker_ready
    log "broker ready (pid $(cat "$RUN_DIR/broker.pid"), health http://$BROKER_HEALTH/readyz)"
  fi
fi

# ---- the replicated profile's slave, the second master ----
if [[ "$PROFILE" == replicated ]]; then
  start_companion "broker slave" broker-slave "$SLAVE_PORT" "$SLAVE_HEALTH" render_slave
fi
if [[ "$BROKERS" == 2 ]]; then
  start_companion "broker b" broker-b "$B_PORT" "$B_HEALTH" render_b
fi
